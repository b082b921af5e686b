"""What the terminal view and the SVG picture share: colours, stage shades, time ticks.

One palette for both, so that a timeline reads the same in a terminal and in a picture:
F blue, I orange, W green, B purple. A rank that holds several stages (interleaved, V and
DualPipe schedules) draws its first stage in the base colour and each later one darker, so the
chunks tell apart without a second legend per stage.
"""

from __future__ import annotations

import math

from octoplan.ops import Kind
from octoplan.plan import Plan
from octoplan.simulator import SimResult, Span

__all__ = [
    "KIND_ORDER",
    "KIND_NAMES",
    "KIND_COLOURS",
    "IDLE_COLOUR",
    "chunk_of_stage",
    "kinds_present",
    "op_colour",
    "text_colour",
    "nice_ticks",
    "format_ms",
    "time_origin",
    "spans_by_rank",
    "describe_plan",
    "summary_line",
]

KIND_ORDER = (Kind.F, Kind.I, Kind.W, Kind.B)
KIND_NAMES = {
    Kind.F: "forward",
    Kind.I: "backward input",
    Kind.W: "backward weight",
    Kind.B: "backward (I+W)",
}
KIND_COLOURS = {
    Kind.F: "#3b7dd8",
    Kind.I: "#f28e2b",
    Kind.W: "#3aa655",
    Kind.B: "#8e5cc9",
}
IDLE_COLOUR = "#9a9a9a"

# Shade per chunk index on a rank: 0 is the base colour, later chunks darker then lighter.
_CHUNK_SHADES = (0.0, -0.38, 0.35, -0.6, 0.55)


def _mix(hex_colour: str, factor: float) -> str:
    """``factor`` < 0 darkens toward black, > 0 lightens toward white."""
    rgb = [int(hex_colour[i : i + 2], 16) for i in (1, 3, 5)]
    target = 0 if factor < 0 else 255
    weight = abs(factor)
    mixed = [round(c + (target - c) * weight) for c in rgb]
    return "#" + "".join(f"{c:02x}" for c in mixed)


def op_colour(kind: Kind, chunk: int = 0, *, lighter: float = 0.0) -> str:
    """The fill of an op of ``kind`` in the ``chunk``-th stage of its rank, optionally lightened."""
    colour = _mix(KIND_COLOURS[kind], _CHUNK_SHADES[chunk % len(_CHUNK_SHADES)])
    return _mix(colour, lighter) if lighter else colour


def text_colour(background: str) -> str:
    """Black or white, whichever reads better on ``background`` (relative luminance)."""
    r, g, b = (int(background[i : i + 2], 16) / 255 for i in (1, 3, 5))
    luminance = 0.2126 * r + 0.7152 * g + 0.0722 * b
    return "#111111" if luminance > 0.55 else "#ffffff"


def chunk_of_stage(plan: Plan) -> list[int]:
    """For every stage, its index among the stages its rank holds (0 for the rank's first)."""
    seen = [0] * plan.pp
    out = []
    for stage in plan.stages:
        out.append(seen[stage.rank])
        seen[stage.rank] += 1
    return out


def kinds_present(plan: Plan) -> list[Kind]:
    present = {op.kind for ops in plan.schedule for op in ops}
    return [kind for kind in KIND_ORDER if kind in present]


def nice_ticks(span_ms: float, *, max_ticks: int) -> list[float]:
    """Tick positions 0, step, 2*step, ... <= span_ms with step 1, 2 or 5 times a power of ten,
    the smallest such step that gives at most ``max_ticks`` ticks."""
    if span_ms <= 0 or max_ticks < 1:
        return [0.0]
    raw = span_ms / max(max_ticks - 1, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw * (1 - 1e-9))
    count = int(span_ms / step + 1e-9)
    return [round(i * step, 12) for i in range(count + 1)]


def format_ms(value: float) -> str:
    """A tick or summary value in ms, without trailing zeros: 0, 2.5, 120, 0.05."""
    if value == 0:
        return "0"
    text = f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
    if "e" in text:
        text = f"{value:.6f}".rstrip("0").rstrip(".")
    return text


def time_origin(rank_spans: list[list[Span]]) -> float:
    """The first op's start (the simulator measures iteration_ms from there), given
    :func:`spans_by_rank`."""
    starts = [spans[0].start_ms for spans in rank_spans if spans]
    return min(starts, default=0.0)


def spans_by_rank(result: SimResult) -> list[list[Span]]:
    return [result.spans(rank) for rank in range(result.num_ranks)]


def describe_plan(plan: Plan) -> str:
    """One line naming the schedule and the plan's shape, for titles and headers."""
    generator = plan.extra.get("generator") if isinstance(plan.extra, dict) else None
    schedule = generator.get("schedule") if isinstance(generator, dict) else None
    parts = [plan.model.name]
    if schedule:
        parts.append(str(schedule))
    shape = f"pp {plan.pp}"
    if plan.parallel.dp > 1:
        shape += f" × dp {plan.parallel.dp}"
    parts.append(shape)
    parts.append(f"{plan.microbatches} microbatches")
    recomputing = plan.num_recomputing
    some = f", {plan.num_recomputing_part} of them only their first layers" if plan.num_recomputing_part else ""
    parts.append(f"{plan.num_stages} stages" + (f" ({recomputing} recompute{some}: their I/B run F again)" if recomputing else ""))
    return " · ".join(parts)


def summary_line(result: SimResult) -> str:
    return (
        f"iteration {format_ms(result.iteration_ms)} ms · bubble ratio {result.bubble_ratio:.1%} · "
        f"efficiency {result.efficiency:.1%} (lower bound {format_ms(result.lower_bound_ms)} ms)"
    )
