"""The terminal timeline: one text row per pipeline rank, time scaled to the width.

Each character cell stands for ``iteration_ms / cells`` of time and shows whatever covers
most of it: an op kind (coloured; its label when the op is wide enough to hold one) or idle
(``·``). With many microbatches a cell spans several ops, and the majority rule keeps the
picture honest about where each rank spends its time.

The view lays itself out when rich renders it, so with ``width=None`` it fills whatever width
the console (or an enclosing panel) offers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.constrain import Constrain
from rich.padding import Padding
from rich.text import Text

from octoplan.ops import Kind, Op
from octoplan.plan import Plan
from octoplan.simulator import SimResult, Span
from octoplan.timeline._layout import (
    KIND_NAMES,
    KIND_ORDER,
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

__all__ = ["render_terminal", "TimelineView", "rank_cells", "IDLE_CHAR"]

IDLE_CHAR = "·"
_IDLE_STYLE = "bright_black"
_MIN_CELLS = 8
_KIND_INDEX = {kind: i for i, kind in enumerate(KIND_ORDER)}


def rank_cells(spans: Sequence[Span], *, t0: float, cell_ms: float, num_cells: int) -> list[Op | Kind | None]:
    """What each cell of one rank's row shows.

    A cell is idle (``None``) when idle time covers more of it than ops do. Otherwise it shows
    the kind that covers most of it: the :class:`Op` that covers most of the cell when that op
    is of the winning kind, else just the :class:`Kind` (several short ops of one kind). Busy
    and idle compare in total, so a rank busy 60% of the time in short ops of three kinds still
    reads busy; ties go to busy.
    """
    kind_cover = [[0.0] * num_cells for _ in KIND_ORDER]
    best_cover = [0.0] * num_cells
    best_op: list[Op | None] = [None] * num_cells
    for span in spans:
        a = (span.start_ms - t0) / cell_ms
        b = (span.end_ms - t0) / cell_ms
        covers = kind_cover[_KIND_INDEX[span.op.kind]]
        first = max(int(a), 0)
        last = min(math.ceil(b), num_cells)
        for i in range(first, last):
            c = min(b, i + 1) - max(a, i)
            if c <= 0:
                continue
            covers[i] += c
            if c > best_cover[i]:
                best_cover[i] = c
                best_op[i] = span.op
    cells: list[Op | Kind | None] = []
    for i in range(num_cells):
        busy = 0.0
        top_kind, top = None, 0.0
        for k, kind in enumerate(KIND_ORDER):
            c = kind_cover[k][i]
            busy += c
            if c > top:
                top_kind, top = kind, c
        if top_kind is None or 1.0 - busy > busy + 1e-9:
            cells.append(None)
        elif best_op[i] is not None and best_op[i].kind is top_kind:
            cells.append(best_op[i])
        else:
            cells.append(top_kind)
    return cells


def _row_text(cells: list[Op | Kind | None], *, chunk: list[int], multi_stage: bool) -> Text:
    """Turn cells into styled text: runs of one op carry its label when it fits."""
    chars: list[str] = []
    styles: list[str] = []
    i, n = 0, len(cells)
    while i < n:
        cell = cells[i]
        if cell is None:
            chars.append(IDLE_CHAR)
            styles.append(_IDLE_STYLE)
            i += 1
            continue
        j = i + 1
        if isinstance(cell, Op):
            while j < n and cells[j] == cell:
                j += 1
            kind = cell.kind
            # Odd microbatches a shade lighter: neighbouring ops of one kind stay apart.
            fg = text_colour(op_colour(kind, chunk[cell.stage]))  # one text colour per kind and chunk
            bg = op_colour(kind, chunk[cell.stage], lighter=0.18 if cell.mb % 2 else 0.0)
            labels = [str(cell), f"{kind.value}{cell.mb}"] if multi_stage else [f"{kind.value}{cell.mb}"]
            label = next((text for text in labels if len(text) <= j - i), None)
            run = label.ljust(j - i) if label else kind.value * (j - i)
        else:
            kind = cell
            bg = op_colour(kind)
            fg = text_colour(bg)
            run = kind.value
        style = f"bold {fg} on {bg}"
        chars.extend(run)
        styles.extend([style] * len(run))
        i = j
    text = Text(no_wrap=True, overflow="crop")
    start = 0
    for k in range(1, len(chars) + 1):
        if k == len(chars) or styles[k] != styles[start]:
            text.append("".join(chars[start:k]), style=styles[start])
            start = k
    return text


def _axis(num_cells: int, span_ms: float, indent: int) -> tuple[Text, Text]:
    """A tick line and a label line. Ticks are spaced so that labels never touch; a label
    starts at its tick, and one that would run past the row's end is left out."""
    cell_ms = span_ms / num_cells
    widest = max(len(format_ms(span_ms)), len("0 ms"))
    max_ticks = max(2, num_cells // (widest + 2) + 1)
    line = ["─"] * num_cells
    labels = [" "] * num_cells
    free_from = 0  # first column a label may use without touching the one before
    for tick in nice_ticks(span_ms, max_ticks=max_ticks):
        col = min(int(round(tick / cell_ms)), num_cells - 1)
        line[col] = "┬" if col else "┌"
        label = format_ms(tick) if col else "0 ms"  # the unit once, where it never moves
        if col < free_from or col + len(label) > num_cells:
            continue
        labels[col : col + len(label)] = label
        free_from = col + len(label) + 1
    pad = " " * indent
    return (
        Text(pad + "".join(line), style="bright_black", no_wrap=True, overflow="crop"),
        Text(pad + "".join(labels).rstrip(), style="bright_black", no_wrap=True, overflow="crop"),
    )


def _legend(plan: Plan) -> Text:
    text = Text()
    for kind in kinds_present(plan):
        bg = op_colour(kind)
        text.append(f" {kind.value} ", style=f"bold {text_colour(bg)} on {bg}")
        text.append(f" {KIND_NAMES[kind]}   ")
    text.append(IDLE_CHAR, style=_IDLE_STYLE)
    text.append(" idle")
    chunks = max(chunk_of_stage(plan)) + 1
    if chunks > 1:
        text.append("   chunk ")
        for c in range(chunks):
            bg = op_colour(Kind.F, c)
            text.append(f" {c} ", style=f"bold {text_colour(bg)} on {bg}")
    return text


@dataclass(frozen=True)
class TimelineView:
    """A rich renderable; laid out at render time for ``width`` or the console's width."""

    plan: Plan
    result: SimResult
    width: int | None = None

    def lines(self, width: int) -> list[RenderableType]:
        plan, result = self.plan, self.result
        label_width = len(f"r{plan.pp - 1}")
        num_cells = max(width - label_width - 1, _MIN_CELLS)
        span_ms = result.iteration_ms if result.iteration_ms > 0 else 1.0
        cell_ms = span_ms / num_cells
        rank_spans = spans_by_rank(result)
        t0 = time_origin(rank_spans)
        chunk = chunk_of_stage(plan)
        multi = [len(plan.stages_of(r)) > 1 for r in range(plan.pp)]
        out: list[RenderableType] = [Text(describe_plan(plan), style="bold", no_wrap=True, overflow="ellipsis")]
        for rank, spans in enumerate(rank_spans):
            row = Text(no_wrap=True, overflow="crop")
            row.append(f"r{rank}".rjust(label_width) + " ", style="bold")
            cells = rank_cells(spans, t0=t0, cell_ms=cell_ms, num_cells=num_cells)
            row.append_text(_row_text(cells, chunk=chunk, multi_stage=multi[rank]))
            out.append(row)
        out.extend(_axis(num_cells, span_ms, label_width + 1))
        # Padding, not leading spaces: wrapped lines keep the indent too.
        out.append(Padding(_legend(plan), (0, 0, 0, label_width + 1)))
        out.append(Padding(Text(summary_line(result)), (0, 0, 0, label_width + 1)))
        return out

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        # Never wider than the console: rich would crop the rows' right end, the last ops.
        width = min(self.width or options.max_width, options.max_width)
        # Constrain: the legend and footer wrap at the requested width too, not the console's.
        yield Constrain(Group(*self.lines(width)), width)


def render_terminal(plan: Plan, result: SimResult, *, width: int | None = None) -> TimelineView:
    """The timeline as a rich renderable: rows per rank, time axis, legend, summary footer.

    ``width`` is the whole line, rank label included; ``None`` takes the console's width, and
    a larger one is capped to it (rich cannot print past the console's width; to write wider
    lines, e.g. into a file, print on a ``Console(width=...)``).
    """
    return TimelineView(plan, result, width=width)


