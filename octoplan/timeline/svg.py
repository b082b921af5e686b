"""The timeline as an SVG picture, written by hand (no plotting dependency).

Rows are pipeline ranks; each op is one ``<rect class="op">`` coloured by kind (shaded by the
stage's chunk on its rank) with its label when the box is wide enough; idle gaps are hatched
by what they waited on (a dependency, data still in transit) or plain grey once the rank is done;
transfers are thin lines from sender to receiver when there are few enough to read; dp
all-reduces are a thin strip under the rank's row. Sizes adapt to the rank count so that 32
ranks stay legible.
"""

from __future__ import annotations

import logging
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

from octoplan.ops import Kind
from octoplan.plan import Plan
from octoplan.simulator import SimResult
from octoplan.timeline._layout import (
    KIND_NAMES,
    chunk_of_stage,
    describe_plan,
    format_ms,
    kinds_present,
    nice_ticks,
    op_colour,
    spans_by_rank,
    summary_line,
    text_colour,
    time_origin,
)

__all__ = ["write_svg", "svg_text"]

log = logging.getLogger(__name__)

PLOT_WIDTH = 1200.0
_RIGHT = 28.0
_FONT = "DejaVu Sans, Helvetica, Arial, sans-serif"
# Transfer lines beyond this count turn into noise; the trace shows them all.
_MAX_TRANSFER_LINES = 600
# Per-op tooltips make large pictures heavy; beyond this many ops they are left out.
_MAX_TOOLTIPS = 5000
_BUBBLE_FILLS = {
    "dependency": ("url(#idle-dependency)", "idle: waiting on a dependency"),
    "transfer": ("url(#idle-transfer)", "idle: data in transit"),
    "drain": ("#f0f0f0", "idle: rank done, waiting for the others"),
}
_ALLREDUCE_COLOUR = "#00838f"
_TRANSFER_COLOUR = "#333333"


def _n(value: float) -> str:
    """A coordinate with at most two decimals, for compact files."""
    text = f"{value:.2f}".rstrip("0").rstrip(".")
    return "0" if text == "-0" else text


def _tag(name: str, attrs: dict[str, object], body: str | None = None) -> str:
    parts = " ".join(f"{key.replace('_', '-')}={quoteattr(str(value))}" for key, value in attrs.items())
    if body is None:
        return f"<{name} {parts}/>"
    return f"<{name} {parts}>{body}</{name}>"


def _defs() -> str:
    def hatch(pattern_id: str, background: str, stripe: str) -> str:
        return (
            f'<pattern id="{pattern_id}" patternUnits="userSpaceOnUse" width="6" height="6" '
            f'patternTransform="rotate(45)"><rect width="6" height="6" fill="{background}"/>'
            f'<line x1="0" y1="0" x2="0" y2="6" stroke="{stripe}" stroke-width="2.2"/></pattern>'
        )

    return "<defs>" + hatch("idle-dependency", "#f4f4f4", "#c4c4c4") + hatch("idle-transfer", "#fff3e6", "#e9a86a") + "</defs>"


def _idle_pieces(result: SimResult) -> list[tuple[int, float, float, str, str]]:
    """Idle gaps as ``(rank, start_ms, end_ms, reason, tooltip)``, split where the wait changed.

    The simulator names one reason per gap: ``transfer`` when the needed op had finished by the
    time the rank started, however briefly its data was on the wire. Drawn that way, a long wait
    for a busy neighbour would look like a slow link, so the part of the gap before the needed op
    ended is drawn as a dependency wait and only the rest as data in transit.
    """
    op_end = {span.op: span.end_ms for span in result.spans()}
    pieces = []
    for bubble in result.bubbles:
        if bubble.waits_for is None:
            pieces.append((bubble.rank, bubble.start_ms, bubble.end_ms, "drain" if bubble.reason == "drain" else "dependency",
                           f"idle {format_ms(bubble.duration_ms)} ms"))
            continue
        need = f"{bubble.waits_for} (rank {bubble.from_rank})"
        split = min(max(op_end.get(bubble.waits_for, bubble.start_ms), bubble.start_ms), bubble.end_ms)
        if split > bubble.start_ms:
            pieces.append((bubble.rank, bubble.start_ms, split, "dependency",
                           f"idle {format_ms(split - bubble.start_ms)} ms: waits for {need} to finish"))
        if bubble.end_ms > split:
            pieces.append((bubble.rank, split, bubble.end_ms, "transfer",
                           f"idle {format_ms(bubble.end_ms - split)} ms: waits for the output of {need} in transit"))
    return pieces


def _legend(items: list[tuple[str, str, str]], *, x0: float, y0: float, max_x: float) -> tuple[list[str], float]:
    """Legend swatches ``(shape, colour, text)`` laid out in lines that wrap at ``max_x``;
    returns the elements and the bottom of the last line."""
    out: list[str] = []
    x, y = x0, y0
    for shape, colour, text in items:
        item_w = 19 + 6.6 * len(text)
        if x > x0 and x + item_w > max_x:
            x, y = x0, y + 20
        if shape == "line":
            out.append(_tag("line", {"x1": _n(x), "y1": _n(y + 11), "x2": _n(x + 14), "y2": _n(y + 1), "stroke": colour, "stroke_width": 1.2}))
        elif shape == "strip":
            out.append(_tag("rect", {"x": _n(x), "y": _n(y + 8), "width": 14, "height": 4, "fill": colour}))
        else:
            out.append(_tag("rect", {"x": _n(x), "y": _n(y), "width": 14, "height": 12, "fill": colour, "stroke": "#888", "stroke_width": 0.5}))
        out.append(_tag("text", {"x": _n(x + 19), "y": _n(y + 10.5), "font-size": 12, "fill": "#333"}, escape(text)))
        x += item_w + 18
    return out, y + 12


def svg_text(plan: Plan, result: SimResult, *, title: str | None = None, transfers: bool | None = None) -> str:
    """The SVG document as a string (see :func:`write_svg`)."""
    pp = result.num_ranks
    span_ms = result.iteration_ms if result.iteration_ms > 0 else 1.0
    t0 = time_origin(result)
    scale = PLOT_WIDTH / span_ms
    row_h = float(min(36, max(14, 640 // max(pp, 1))))
    bar_h = row_h - max(2.0, round(row_h * 0.18))
    font = min(12.0, bar_h * 0.62)
    char_w = font * 0.62
    label_w = 12 + 7.2 * len(f"rank {pp - 1}")
    left = label_w + 10
    width = left + PLOT_WIDTH + _RIGHT
    chunk = chunk_of_stage(plan)
    idle = _idle_pieces(result)
    draw_transfers = len(result.transfers) <= _MAX_TRANSFER_LINES if transfers is None else transfers

    # Legend: kinds in the plan, chunk shades when ranks hold several stages, idle kinds.
    items: list[tuple[str, str, str]] = [("box", op_colour(kind), f"{kind.value} {KIND_NAMES[kind]}") for kind in kinds_present(plan)]
    for c in range(1, max(chunk) + 1):
        items.append(("box", op_colour(Kind.F, c), "2nd stage on a rank (darker)" if c == 1 else f"stage {c + 1} on a rank"))
    reasons = {piece[3] for piece in idle}
    items += [("box", fill, text) for reason, (fill, text) in _BUBBLE_FILLS.items() if reason in reasons]
    if draw_transfers and result.transfers:
        items.append(("line", _TRANSFER_COLOUR, "transfer"))
    if result.allreduces:
        items.append(("strip", _ALLREDUCE_COLOUR, "dp all-reduce"))
    legend, legend_bottom = _legend(items, x0=12.0, y0=62.0, max_x=width - _RIGHT)
    top = legend_bottom + 14
    rows_end = top + pp * row_h
    height = rows_end + 48
    all_spans = spans_by_rank(result)
    tooltips = sum(len(s) for s in all_spans) <= _MAX_TOOLTIPS

    def x_of(ms: float) -> float:
        return left + (ms - t0) * scale

    def y_of(rank: int) -> float:
        return top + rank * row_h + (row_h - bar_h) / 2

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_n(width)}" height="{_n(height)}" '
        f'viewBox="0 0 {_n(width)} {_n(height)}" font-family="{_FONT}">',
        _defs(),
        _tag("rect", {"width": _n(width), "height": _n(height), "fill": "#ffffff"}),
        _tag("text", {"x": 12, "y": 26, "font-size": 17, "font-weight": "bold", "fill": "#222"}, escape(title or describe_plan(plan))),
        _tag("text", {"x": 12, "y": 46, "font-size": 13, "fill": "#333"}, escape(summary_line(result))),
        *legend,
    ]

    # Row stripes and labels, then time grid, behind the boxes.
    for rank in range(pp):
        y = top + rank * row_h
        if rank % 2:
            out.append(_tag("rect", {"x": 0, "y": _n(y), "width": _n(width), "height": _n(row_h), "fill": "#f8f8fa"}))
        stages = ", ".join(f"s{s}" for s in plan.stages_of(rank))
        out.append(_tag(
            "text",
            {"x": _n(label_w), "y": _n(y + row_h / 2 + font * 0.35), "font-size": _n(min(13.0, font + 1)), "text-anchor": "end", "fill": "#222"},
            escape(f"rank {rank}") + f"<title>{escape(f'rank {rank}: stages {stages}')}</title>",
        ))
    ticks = nice_ticks(span_ms, max_ticks=max(2, int(PLOT_WIDTH // 70)))
    for tick in ticks:
        x = _n(x_of(t0 + tick))
        out.append(_tag("line", {"x1": x, "y1": _n(top - 2), "x2": x, "y2": _n(rows_end + 4), "stroke": "#dddddd", "stroke_width": 0.8}))
        out.append(_tag("text", {"x": x, "y": _n(rows_end + 18), "font-size": 11, "text-anchor": "middle", "fill": "#444"}, format_ms(tick)))
    out.append(_tag("line", {"x1": _n(left), "y1": _n(rows_end + 4), "x2": _n(left + PLOT_WIDTH), "y2": _n(rows_end + 4), "stroke": "#888", "stroke_width": 1}))
    out.append(_tag("text", {"x": _n(left + PLOT_WIDTH / 2), "y": _n(rows_end + 38), "font-size": 12, "text-anchor": "middle", "fill": "#444"}, "time (ms)"))

    for rank, start_ms, end_ms, reason, tip in idle:
        x0, x1 = x_of(start_ms), x_of(end_ms)
        out.append(_tag(
            "rect",
            {"class": "bubble", "x": _n(x0), "y": _n(y_of(rank)), "width": _n(x1 - x0), "height": _n(bar_h), "fill": _BUBBLE_FILLS[reason][0]},
            f"<title>{escape(tip)}</title>",
        ))

    for rank, spans in enumerate(all_spans):
        y = y_of(rank)
        for span in spans:
            op = span.op
            x0, x1 = x_of(span.start_ms), x_of(span.end_ms)
            w = x1 - x0
            fill = op_colour(op.kind, chunk[op.stage])
            attrs: dict[str, object] = {"class": "op", "x": _n(x0), "y": _n(y), "width": _n(w), "height": _n(bar_h), "fill": fill}
            if w >= 3:  # a white edge separates neighbours; on slivers it would hide the colour
                attrs.update(stroke="#ffffff", stroke_width=0.6)
            tip = f"<title>{op}: {format_ms(span.start_ms - t0)}–{format_ms(span.end_ms - t0)} ms</title>" if tooltips else None
            out.append(_tag("rect", attrs, tip))
            label = next((text for text in (str(op), f"{op.kind.value}{op.mb}", str(op.mb)) if len(text) * char_w + 3 <= w), None)
            if label:
                out.append(_tag(
                    "text",
                    {"x": _n(x0 + w / 2), "y": _n(y + bar_h / 2 + font * 0.36), "font-size": _n(font), "text-anchor": "middle", "fill": text_colour(fill)},
                    label,
                ))

    for ar in result.allreduces:
        x0, x1 = x_of(ar.start_ms), x_of(ar.end_ms)
        out.append(_tag(
            "rect",
            {"class": "allreduce", "x": _n(x0), "y": _n(y_of(ar.rank) + bar_h - 3), "width": _n(max(x1 - x0, 0.5)), "height": 3, "fill": _ALLREDUCE_COLOUR},
            f"<title>all-reduce of stage {ar.stage}: {format_ms(ar.end_ms - ar.start_ms)} ms</title>",
        ))

    if draw_transfers:
        for t in result.transfers:
            down = t.dst_rank > t.src_rank
            y0 = y_of(t.src_rank) + (bar_h if down else 0)
            y1 = y_of(t.dst_rank) + (0 if down else bar_h)
            out.append(_tag("line", {
                "class": "transfer", "x1": _n(x_of(t.start_ms)), "y1": _n(y0), "x2": _n(x_of(t.end_ms)), "y2": _n(y1),
                "stroke": _TRANSFER_COLOUR, "stroke_width": 0.8, "stroke_opacity": 0.55,
            }))
    out.append("</svg>")
    return "\n".join(out) + "\n"


def write_svg(plan: Plan, result: SimResult, path: str | Path, *, title: str | None = None, transfers: bool | None = None) -> None:
    """Write the timeline picture to ``path``.

    ``title`` replaces the first heading line (the plan's description); the second always gives
    iteration ms, bubble ratio and efficiency. ``transfers``: draw transfer lines (``None``: when
    there are at most a few hundred).
    """
    Path(path).write_text(svg_text(plan, result, title=title, transfers=transfers), encoding="utf-8")
    log.info("wrote timeline picture %s", path)
