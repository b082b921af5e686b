"""Layout moves that keep the tuned op order: a new partition and placement, its order carried
over from the old plan's simulated timeline.

A move that changes which rank holds which layers (a stage moved, split, or a layer peeled off
into a stage of its own) has no order of its own. Handing it to the policy scheduler throws
away the order the climb has tuned, and a layout one move away then scores 50-100% slower than
it could (jamba-v0.1: 2053-2282 ms against a tuned 1159 ms), so such moves only pay inside a
compound move. This module is that compound move's first half: every op of the new layout is
timed where the same layers ran in the old timeline, and each rank runs its ops in the order of
those times. A forward of layers [a, b) starts where layer a's forward started inside the old
forward that ran it; a backward (I, W or B) where layer b - 1's started inside its old
backward (a backward walks the layers from the last). The times come from one valid timeline,
so ops that depend on each other stay in order on every rank and the order cannot deadlock
where the old one did not. The search then justifies the carried order
(:mod:`octoplan.schedules.justify`), which closes the gaps the changed durations leave.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Sequence

from octoplan.costs import op_ms
from octoplan.ops import Kind, Op
from octoplan.simulator import SimResult
from octoplan.tuner.space import Candidate, Evaluator

__all__ = ["Carrier", "peel_moves"]


def _old_stage_of(bounds: Sequence[int]) -> list[int]:
    """Per layer, the index of the stage that holds it."""
    out = []
    for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
        out.extend([s] * (b - a))
    return out


class Carrier:
    """Carries the order of ``cand``'s simulated timeline ``result`` onto new layouts; op times
    come from ``evaluator``'s stage costs."""

    def __init__(self, cand: Candidate, result: SimResult, evaluator: Evaluator):
        self.cand = cand
        self.ev = evaluator
        num_mb = cand.config.microbatches
        # per old stage and kind, the starts and ends of its ops by microbatch (NaN where a
        # microbatch has no such op: a stage may fuse some backwards and split others)
        self.times: dict[tuple[int, Kind], tuple[list[float], list[float]]] = {}
        for span in result.spans():
            op = span.op
            starts, ends = self.times.setdefault((op.stage, op.kind), ([math.nan] * num_mb, [math.nan] * num_mb))
            starts[op.mb], ends[op.mb] = span.start_ms, span.end_ms
        # per old stage and microbatch, whether its backward ran as I and W (else as one B)
        self.split = [[t == t for t in self.times[(stage, Kind.I)][0]] if (stage, Kind.I) in self.times else [False] * num_mb
                      for stage in range(cand.num_stages)]

    def _share(self, old: int, start: int, end: int, kind: Kind) -> float:
        """How much of old stage ``old``'s op of ``kind`` is done once its layers [start, end)
        have run: those before the new op's first (a forward), or after its last (a backward)."""
        bounds = self.cand.bounds
        total = op_ms(self.ev.stage_cost(bounds[old], bounds[old + 1]), kind)
        return op_ms(self.ev.stage_cost(start, end), kind) / total if end > start and total > 0 else 0.0

    def __call__(self, bounds: tuple[int, ...], ranks: tuple[int, ...], origin: str) -> Candidate | None:
        """The order carried onto the layout ``bounds``/``ranks`` as a fixed order; None where
        it cannot be: a candidate with recomputation, or a new stage whose layers ran in fused
        and split backwards alike."""
        cand = self.cand
        if cand.recompute:
            return None
        times, split_of = self.times, self.split
        old_bounds = cand.bounds
        stage_of = _old_stage_of(old_bounds)
        mbs = range(cand.config.microbatches)
        timed: list[list[tuple[float, int, int, Op]]] = [[] for _ in range(cand.config.pp)]
        for s, rank in enumerate(ranks):
            a, b = bounds[s], bounds[s + 1]
            f_old, back_old = stage_of[a], stage_of[b - 1]
            # the backward's kinds, per microbatch: as the old stage that ran the new one's last layer
            split = split_of[back_old]
            if any(split_of[o] != split for o in range(f_old, back_old)):
                return None
            # ties (zero-time layers) keep forwards in stage order, backwards in reverse
            parts = [(Kind.F, f_old, self._share(f_old, old_bounds[f_old], a, Kind.F), s)]
            backwards = ((Kind.I, Kind.W) if any(split) else ()) + (() if all(split) else (Kind.B,))
            parts += [(kind, back_old, self._share(back_old, b, old_bounds[back_old + 1], kind), -s) for kind in backwards]
            for kind, old, fraction, tie in parts:
                starts, ends = times[(old, kind)]
                timed[rank].extend((t0 + fraction * (t1 - t0), tie, mb, Op(s, kind, mb))
                                   for t0, t1, mb in zip(starts, ends, mbs) if t0 == t0)  # NaN: no such op
        # at equal times a forward goes first: no forward waits for a backward, while the last
        # stage's backward waits for its forward (a 0 ms layer makes the two times equal)
        fixed = tuple(tuple(op for *_, op in sorted(ops, key=lambda item: (item[0], item[3].kind is not Kind.F, item[1:])))
                      for ops in timed)
        tag = cand.fixed_id.split("#")[0] if cand.fixed_id else "policy"
        return replace(cand, bounds=bounds, ranks=ranks, policies=None, fixed=fixed, origin=origin,
                       fixed_id=f"{tag}+carried#{hash(fixed) & 0xFFFFFFFFFFFF:x}")


def peel_moves(cand: Candidate, result: SimResult, *, max_per_rank: int, hot: int = 2, cold: int = 4) -> list[tuple[float, tuple[int, ...], tuple[int, ...], str]]:
    """Layouts one peel away, the most promising first: an end layer of a stage of one of the
    ``hot`` ranks that finish last (first op's start + busy time) becomes a stage of its own on
    one of the ``cold`` ranks that finish first and hold fewer than ``max_per_rank`` stages.
    Each is (gain, bounds, ranks, origin); gain is how much later the giver finishes (always > 0)."""
    pp = cand.config.pp
    finish = [start + busy for start, busy in zip(result.first_start_ms, result.busy_ms)]
    order = sorted(range(pp), key=lambda r: (-finish[r], r))
    counts = [cand.ranks.count(r) for r in range(pp)]
    takers = [r for r in reversed(order) if counts[r] < max_per_rank][:cold]
    b = cand.bounds
    out = []
    for h in order[:hot]:
        for s in cand.stages_of(h):
            if b[s + 1] - b[s] < 2:
                continue
            for c in takers:
                if c == h:
                    continue
                gain = finish[h] - finish[c]
                if gain <= 0:
                    continue
                # the last layer, as a stage after s; the first, as a stage before it
                end = b[:s + 1] + (b[s + 1] - 1,) + b[s + 1:]
                out.append((gain, end, cand.ranks[:s + 1] + (c,) + cand.ranks[s + 1:], f"peel the last layer of stage {s} onto rank {c}"))
                start = b[:s + 1] + (b[s] + 1,) + b[s + 1:]
                out.append((gain, start, cand.ranks[:s] + (c,) + cand.ranks[s:], f"peel the first layer of stage {s} onto rank {c}"))
    out.sort(key=lambda item: -item[0])  # stable: ties keep the order above
    return out
