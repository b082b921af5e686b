"""The timeline as an SVG picture, written by hand (no plotting dependency).

Rows are pipeline ranks; each op is one ``<rect class="op">`` coloured by kind (shaded by the
stage's chunk on its rank) with its label when the box is wide enough; idle gaps are hatched
by what they waited on (a dependency, data still in transit) or plain grey once the rank is
done; transfers are thin lines from sender to receiver when there are few enough to read; dp
all-reduces are a thin strip at the bottom of the rank's row. Row height and font shrink with
the rank count so that 32 ranks stay legible; the time axis is always ``PLOT_WIDTH`` pixels.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

from octoplan.ops import Kind
from octoplan.outputs import write_text
from octoplan.plan import Plan
from octoplan.simulator import SimResult, Span
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

__all__ = ["write_svg", "svg_text", "PLOT_WIDTH"]

log = logging.getLogger(__name__)

PLOT_WIDTH = 1200.0  # pixels of the time axis
_RIGHT = 28.0
_FONT = "DejaVu Sans, Helvetica, Arial, sans-serif"
# Transfer lines beyond this count turn into noise; the trace shows them all.
_MAX_TRANSFER_LINES = 600
# Tooltips make large pictures heavy; beyond this many boxes (ops and idle) they are left out.
_MAX_TOOLTIPS = 5000
# Idle pieces narrower than this many pixels cannot be seen; they would only weigh the file.
_MIN_IDLE_PX = 0.25
_IDLE_FILLS = {
    "dependency": ("url(#idle-dependency)", "idle: waiting on a dependency"),
    "transfer": ("url(#idle-transfer)", "idle: data in transit"),
    "drain": ("#f0f0f0", "idle: rank done, waiting for the others"),
}
_ALLREDUCE_COLOUR = "#00838f"
_TRANSFER_COLOUR = "#333333"
_CRITICAL_COLOUR = "#d62728"


def _n(value: float) -> str:
    """A coordinate with at most two decimals, for compact files."""
    text = f"{value:.2f}".rstrip("0").rstrip(".")
    return "0" if text == "-0" else text


def _tag(name: str, attrs: dict[str, object], body: str | None = None) -> str:
    """One element; ``attrs`` keys with ``_`` become ``-``; ``body`` is inserted as is."""
    parts = " ".join(f"{key.replace('_', '-')}={quoteattr(str(value))}" for key, value in attrs.items())
    if body is None:
        return f"<{name} {parts}/>"
    return f"<{name} {parts}>{body}</{name}>"


# What XML 1.0 forbids in a document (C0 controls but tab and line breaks, the surrogates, two
# non-characters): a plan named with one would make the picture unreadable to every viewer
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def _text(text: str) -> str:
    """``text`` as XML character data: escaped, and each character XML cannot hold written as
    its Python escape (``\\x1b``), as the terminal's error lines write them."""
    return escape(_NOT_XML.sub(lambda found: ascii(found.group())[1:-1], text))


def _title(text: str) -> str:
    return f"<title>{_text(text)}</title>"


@dataclass(frozen=True)
class _Frame:
    """Where things go: time to x, rank to the y of its bar."""

    t0: float
    scale: float  # pixels per ms
    left: float
    top: float
    row_h: float
    bar_h: float
    font: float
    width: float

    def x(self, ms: float) -> float:
        return self.left + (ms - self.t0) * self.scale

    def y(self, rank: int) -> float:
        return self.top + rank * self.row_h + (self.row_h - self.bar_h) / 2


def _idle_pieces(result: SimResult, rank_spans: list[list[Span]]) -> list[tuple[int, float, float, str, str]]:
    """Idle gaps as ``(rank, start_ms, end_ms, reason, tooltip)``, split where the wait changed.

    The simulator names one reason per gap: ``transfer`` when the needed op had finished by the
    time the rank started, however briefly its data was on the wire. Drawn that way, a long wait
    for a busy neighbour would look like a slow link, so the part of the gap before the needed op
    ended is drawn as a dependency wait and only the rest as data in transit.
    """
    op_end = {span.op: span.end_ms for spans in rank_spans for span in spans}
    pieces = []
    for bubble in result.bubbles:
        if bubble.waits_for is None:
            reason = "drain" if bubble.reason == "drain" else "dependency"
            pieces.append((bubble.rank, bubble.start_ms, bubble.end_ms, reason, f"idle {format_ms(bubble.duration_ms)} ms"))
            continue
        need = f"{bubble.waits_for} (rank {bubble.from_rank})"
        split = min(max(op_end.get(bubble.waits_for, bubble.start_ms), bubble.start_ms), bubble.end_ms)
        if split > bubble.start_ms:
            tip = f"idle {format_ms(split - bubble.start_ms)} ms: waits for {need} to finish"
            pieces.append((bubble.rank, bubble.start_ms, split, "dependency", tip))
        if bubble.end_ms > split:
            tip = f"idle {format_ms(bubble.end_ms - split)} ms: waits for the output of {need} in transit"
            pieces.append((bubble.rank, split, bubble.end_ms, "transfer", tip))
    return pieces


def _defs() -> str:
    def hatch(pattern_id: str, background: str, stripe: str) -> str:
        return (
            f'<pattern id="{pattern_id}" patternUnits="userSpaceOnUse" width="6" height="6" '
            f'patternTransform="rotate(45)"><rect width="6" height="6" fill="{background}"/>'
            f'<line x1="0" y1="0" x2="0" y2="6" stroke="{stripe}" stroke-width="2.2"/></pattern>'
        )

    return "<defs>" + hatch("idle-dependency", "#f4f4f4", "#c4c4c4") + hatch("idle-transfer", "#fff3e6", "#e9a86a") + "</defs>"


def _legend(items: list[tuple[str, str, str]], *, x0: float, y0: float, max_x: float) -> tuple[list[str], float]:
    """Swatches ``(shape, colour, text)`` in lines that wrap at ``max_x``; returns the elements
    and the bottom of the last line."""
    out: list[str] = []
    x, y = x0, y0
    for shape, colour, text in items:
        item_w = 19 + 6.6 * len(text)  # 6.6 px: the mean glyph width of a 12 px sans font
        if x > x0 and x + item_w > max_x:
            x, y = x0, y + 20
        if shape == "line":
            out.append(_tag("line", {"x1": _n(x), "y1": _n(y + 11), "x2": _n(x + 14), "y2": _n(y + 1), "stroke": colour, "stroke_width": 1.2}))
        elif shape == "strip":
            out.append(_tag("rect", {"x": _n(x), "y": _n(y + 8), "width": 14, "height": 4, "fill": colour}))
        else:
            out.append(_tag("rect", {"x": _n(x), "y": _n(y), "width": 14, "height": 12, "fill": colour, "stroke": "#888", "stroke_width": 0.5}))
        out.append(_tag("text", {"x": _n(x + 19), "y": _n(y + 10.5), "font-size": 12, "fill": "#333"}, _text(text)))
        x += item_w + 18
    return out, y + 12


def _rows_and_axis(frame: _Frame, plan: Plan, span_ms: float, label_x: float) -> list[str]:
    """Row stripes and rank labels, the time grid and axis: everything behind the boxes."""
    out = []
    pp = plan.pp
    for rank in range(pp):
        y = frame.top + rank * frame.row_h
        if rank % 2:
            out.append(_tag("rect", {"x": 0, "y": _n(y), "width": _n(frame.width), "height": _n(frame.row_h), "fill": "#f8f8fa"}))
        stages = ", ".join(f"s{s}" for s in plan.stages_of(rank))
        attrs = {"x": _n(label_x), "y": _n(y + frame.row_h / 2 + frame.font * 0.35), "font-size": _n(min(13.0, frame.font + 1)),
                 "text-anchor": "end", "fill": "#222"}
        out.append(_tag("text", attrs, f"rank {rank}" + _title(f"rank {rank}: stages {stages}")))
    rows_end = frame.top + pp * frame.row_h
    for tick in nice_ticks(span_ms, max_ticks=max(2, int(PLOT_WIDTH // 70))):
        x = _n(frame.x(frame.t0 + tick))
        out.append(_tag("line", {"x1": x, "y1": _n(frame.top - 2), "x2": x, "y2": _n(rows_end + 4), "stroke": "#dddddd", "stroke_width": 0.8}))
        out.append(_tag("text", {"x": x, "y": _n(rows_end + 18), "font-size": 11, "text-anchor": "middle", "fill": "#444"}, format_ms(tick)))
    axis_y = _n(rows_end + 4)
    out.append(_tag("line", {"x1": _n(frame.left), "y1": axis_y, "x2": _n(frame.left + PLOT_WIDTH), "y2": axis_y, "stroke": "#888", "stroke_width": 1}))
    centre = _n(frame.left + PLOT_WIDTH / 2)
    out.append(_tag("text", {"x": centre, "y": _n(rows_end + 38), "font-size": 12, "text-anchor": "middle", "fill": "#444"}, "time (ms)"))
    return out


def _idle_boxes(frame: _Frame, idle: list[tuple[int, float, float, str, str]], *, tooltips: bool) -> list[str]:
    out = []
    height = _n(frame.bar_h)
    for rank, start_ms, end_ms, reason, tip in idle:
        x0, x1 = frame.x(start_ms), frame.x(end_ms)
        rect = f'<rect class="bubble" x="{_n(x0)}" y="{_n(frame.y(rank))}" width="{_n(x1 - x0)}" height="{height}" fill="{_IDLE_FILLS[reason][0]}"'
        out.append(f"{rect}>{_title(tip)}</rect>" if tooltips else rect + "/>")
    return out


def _op_boxes(frame: _Frame, plan: Plan, rank_spans: list[list[Span]], *, tooltips: bool) -> list[str]:
    """One rect per op and its label where it fits.

    The hot loop of big pictures (12k ops at 32 ranks x 128 microbatches): plain f-strings of
    numbers, colours and op names, which need no escaping, instead of :func:`_tag`.
    """
    chunk = chunk_of_stage(plan)
    fills = {(kind, c): op_colour(kind, c) for kind in Kind for c in set(chunk)}
    char_w = frame.font * 0.62
    # Which label form fits is decided by the widest label of that form, so that ops of one
    # width all get the same form whatever their microbatch number.
    mb_digits, stage_digits = len(str(plan.microbatches - 1)), len(str(plan.num_stages - 1))
    label_need = [n * char_w + 3 for n in (stage_digits + 1 + mb_digits, 1 + mb_digits, mb_digits)]
    height, font = _n(frame.bar_h), _n(frame.font)
    out = []
    for rank, spans in enumerate(rank_spans):
        y = frame.y(rank)
        y_attr, text_y = _n(y), _n(y + frame.bar_h / 2 + frame.font * 0.36)
        for span in spans:
            op = span.op
            x0 = frame.x(span.start_ms)
            w = frame.x(span.end_ms) - x0
            fill = fills[op.kind, chunk[op.stage]]
            edge = ' stroke="#ffffff" stroke-width="0.6"' if w >= 3 else ""  # on slivers an edge hides the colour
            rect = f'<rect class="op" x="{_n(x0)}" y="{y_attr}" width="{_n(w)}" height="{height}" fill="{fill}"{edge}'
            if tooltips:
                start, end = format_ms(span.start_ms - frame.t0), format_ms(span.end_ms - frame.t0)
                out.append(f"{rect}><title>{op}: {start}–{end} ms</title></rect>")
            else:
                out.append(rect + "/>")
            form = next((f for f, need in enumerate(label_need) if need <= w), None)
            if form is not None:
                label = (str(op), f"{op.kind.value}{op.mb}", str(op.mb))[form]
                out.append(
                    f'<text x="{_n(x0 + w / 2)}" y="{text_y}" font-size="{font}" text-anchor="middle" '
                    f'fill="{text_colour(fill)}">{label}</text>'
                )
    return out


def _critical_marks(frame: _Frame, result: SimResult, rank_spans: list[list[Span]]) -> list[str]:
    """A dark strip along the top of every op on the critical path: what decides the iteration."""
    critical = set(result.critical_path)
    out = []
    for rank, spans in enumerate(rank_spans):
        y = _n(frame.y(rank) - 1)
        for span in spans:
            if span.op in critical:
                x0 = frame.x(span.start_ms)
                w = max(frame.x(span.end_ms) - x0, 0.5)
                out.append(f'<rect class="critical" x="{_n(x0)}" y="{y}" width="{_n(w)}" height="2.5" fill="{_CRITICAL_COLOUR}"/>')
    return out


def _allreduce_strips(frame: _Frame, result: SimResult) -> list[str]:
    out = []
    for ar in result.allreduces:
        x0, x1 = frame.x(ar.start_ms), frame.x(ar.end_ms)
        attrs = {"class": "allreduce", "x": _n(x0), "y": _n(frame.y(ar.rank) + frame.bar_h - 3), "width": _n(max(x1 - x0, 0.5)),
                 "height": 3, "fill": _ALLREDUCE_COLOUR}
        out.append(_tag("rect", attrs, _title(f"all-reduce of stage {ar.stage}: {format_ms(ar.end_ms - ar.start_ms)} ms")))
    return out


def _transfer_lines(frame: _Frame, result: SimResult) -> list[str]:
    """From the sender's bar edge when the data leaves to the receiver's when it arrives."""
    out = []
    for t in result.transfers:
        down = t.dst_rank > t.src_rank
        y0 = frame.y(t.src_rank) + (frame.bar_h if down else 0)
        y1 = frame.y(t.dst_rank) + (0 if down else frame.bar_h)
        out.append(_tag("line", {
            "class": "transfer", "x1": _n(frame.x(t.start_ms)), "y1": _n(y0), "x2": _n(frame.x(t.end_ms)), "y2": _n(y1),
            "stroke": _TRANSFER_COLOUR, "stroke_width": 0.8, "stroke_opacity": 0.55,
        }))
    return out


def svg_text(plan: Plan, result: SimResult, *, title: str | None = None, transfers: bool | None = None) -> str:
    """The SVG document as a string (see :func:`write_svg`)."""
    pp = result.num_ranks
    span_ms = result.iteration_ms if result.iteration_ms > 0 else 1.0
    rank_spans = spans_by_rank(result)
    t0 = time_origin(rank_spans)
    scale = PLOT_WIDTH / span_ms
    row_h = float(min(36, max(14, 640 // max(pp, 1))))
    bar_h = row_h - max(2.0, round(row_h * 0.18))
    label_x = 12 + 7.2 * len(f"rank {pp - 1}")
    left = label_x + 10
    width = left + PLOT_WIDTH + _RIGHT
    idle = [piece for piece in _idle_pieces(result, rank_spans) if (piece[2] - piece[1]) * scale >= _MIN_IDLE_PX]
    draw_transfers = len(result.transfers) <= _MAX_TRANSFER_LINES if transfers is None else transfers
    tooltips = sum(len(spans) for spans in rank_spans) + len(idle) <= _MAX_TOOLTIPS

    # Legend: kinds in the plan, chunk shades when ranks hold several stages, what is drawn.
    items = [("box", op_colour(kind), f"{kind.value} {KIND_NAMES[kind]}") for kind in kinds_present(plan)]
    for c in range(1, max(chunk_of_stage(plan)) + 1):
        items.append(("box", op_colour(Kind.F, c), "2nd stage on a rank (darker)" if c == 1 else f"stage {c + 1} on a rank"))
    reasons = {piece[3] for piece in idle}
    items += [("box", fill, text) for reason, (fill, text) in _IDLE_FILLS.items() if reason in reasons]
    items.append(("strip", _CRITICAL_COLOUR, "critical path"))
    if draw_transfers and result.transfers:
        items.append(("line", _TRANSFER_COLOUR, "transfer"))
    if result.allreduces:
        items.append(("strip", _ALLREDUCE_COLOUR, "dp all-reduce"))
    legend, legend_bottom = _legend(items, x0=12.0, y0=62.0, max_x=width - _RIGHT)

    top = legend_bottom + 14
    height = top + pp * row_h + 48
    frame = _Frame(t0=t0, scale=scale, left=left, top=top, row_h=row_h, bar_h=bar_h, font=min(12.0, bar_h * 0.62), width=width)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_n(width)}" height="{_n(height)}" '
        f'viewBox="0 0 {_n(width)} {_n(height)}" font-family="{_FONT}">',
        _defs(),
        _tag("rect", {"width": _n(width), "height": _n(height), "fill": "#ffffff"}),
        _tag("text", {"x": 12, "y": 26, "font-size": 17, "font-weight": "bold", "fill": "#222"}, _text(f"{title} — {describe_plan(plan)}" if title else describe_plan(plan))),
        _tag("text", {"x": 12, "y": 46, "font-size": 13, "fill": "#333"}, _text(summary_line(result))),
        *legend,
        *_rows_and_axis(frame, plan, span_ms, label_x),
        *_idle_boxes(frame, idle, tooltips=tooltips),
        *_op_boxes(frame, plan, rank_spans, tooltips=tooltips),
        *_critical_marks(frame, result, rank_spans),
        *_allreduce_strips(frame, result),
        *(_transfer_lines(frame, result) if draw_transfers else []),
        "</svg>",
    ]
    return "\n".join(out) + "\n"


def write_svg(plan: Plan, result: SimResult, path: str | Path, *, title: str | None = None, transfers: bool | None = None) -> None:
    """Write the timeline picture to ``path``.

    The heading names the plan (model, schedule, pp, microbatches, stages) after ``title``
    when one is given; the line below gives iteration ms, bubble ratio, efficiency and the
    lower bound. ``transfers``: draw a line per
    transfer (``None``: only when there are at most a few hundred).
    """
    write_text(path, svg_text(plan, result, title=title, transfers=transfers))
    log.info("wrote timeline picture %s", path)
