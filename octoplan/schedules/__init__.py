"""Baseline schedules (FORMATS.md section 6), each generated from a rule over ranks, microbatches and
stages — never hand-listed.

A schedule says how many stages each rank holds, how stages are placed on ranks, and every
rank's compute-op order. Generators emit compute ops only; transfers, memory and timing are
derived by the simulator and the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from octoplan.ops import Op
from octoplan.schedules import dualpipev, gpipe, looped, zbv
from octoplan.schedules.placement import framework_placement, loop_placement, v_placement

__all__ = ["ScheduleSpec", "SCHEDULES", "get_schedule", "framework_placement", "loop_placement", "v_placement"]


@dataclass(frozen=True)
class ScheduleSpec:
    name: str
    description: str
    # pp, microbatches, chunks -> per-rank op lists (stage s lives on placement(pp, num_stages)[s])
    generate: Callable[[int, int, int], list[list[Op]]]
    stages_per_rank: Callable[[int], int]  # chunks -> stages held by each rank
    placement: Callable[[int, int], list[int]]  # (pp, num_stages) -> rank of each stage
    min_microbatches: Callable[[int], int]  # pp -> fewest microbatches the rule supports
    why_min: str

    def num_stages(self, pp: int, chunks: int) -> int:
        return pp * self.stages_per_rank(chunks)


def _one(_: int) -> int:
    return 1


def _two(_: int) -> int:
    return 2


SCHEDULES: dict[str, ScheduleSpec] = {
    spec.name: spec
    for spec in (
        ScheduleSpec("gpipe", "all forwards, then all backwards", lambda p, m, v: gpipe.generate(p, m),
                     _one, loop_placement, lambda p: 1, ""),
        ScheduleSpec("1f1b", "one forward one backward after a warm-up of p-1-r forwards",
                     lambda p, m, v: looped.one_f_one_b(p, m), _one, loop_placement, lambda p: 1, ""),
        ScheduleSpec("interleaved-1f1b", "Megatron-LM's interleaved 1F1B over V chunks per rank",
                     lambda p, m, v: looped.interleaved_1f1b(p, m, v), lambda v: v, loop_placement,
                     lambda p: p, "interleaved 1F1B needs at least pp microbatches so every chunk fills"),
        ScheduleSpec("zb-h1", "zero-bubble H1: 1F1B with B split into I and W, W deferred to fill the drain",
                     lambda p, m, v: looped.zb_h1(p, m), _one, loop_placement, lambda p: 1, ""),
        ScheduleSpec("zb-h2", "zero-bubble H2: a deeper warm-up so no rank idles between its first and last op",
                     lambda p, m, v: looped.zb_h2(p, m), _one, loop_placement, lambda p: 1, ""),
        ScheduleSpec("zbv", "zero-bubble V: two chunks per rank in a V, I/W split",
                     lambda p, m, v: zbv.generate(p, m), _two, v_placement, lambda p: 1, ""),
        ScheduleSpec("dualpipev", "DeepSeek's DualPipeV: V placement, forward of one chunk paired with backward of the other",
                     lambda p, m, v: dualpipev.generate(p, m), _two, v_placement,
                     lambda p: 2 * p, "DualPipeV needs at least 2*pp microbatches (one per stage)"),
    )
}


def get_schedule(name: str) -> ScheduleSpec:
    try:
        return SCHEDULES[name]
    except KeyError:
        raise KeyError(f"unknown schedule {name!r}; choose from {', '.join(SCHEDULES)}") from None
