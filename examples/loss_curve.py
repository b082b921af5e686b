"""Draw the loss curve of one training that ran in several segments (each a ``--metrics`` file of
``octorun``, for example before and after a re-plan) as one SVG picture.

    python examples/loss_curve.py "4 GPUs, pp 4=out/train-pp4.jsonl" "pp 2 x dp 2=out/train-pp2dp2.jsonl" -o out/loss.svg

Each segment is drawn in its own colour and labelled; a dashed line marks where one segment
hands over to the next (the step a run resumed at). The held-out losses of a run with
``--eval-data`` (each line's ``eval_loss``) are open circles in its colour. The picture is plain SVG, written by hand:
a polyline per segment needs no plotting library.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import sys
from pathlib import Path
from typing import NoReturn

WIDTH, HEIGHT = 720, 360
LEFT, RIGHT, TOP, BOTTOM = 64, 24, 40, 48
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e")


def _bad(path: str, problem: str) -> NoReturn:
    """Bad input, as the octoplan commands report it: one line, exit 2."""
    sys.stderr.write(f"loss_curve: {path}: {problem} (give LABEL=METRICS, a --metrics file octorun wrote)\n")
    sys.exit(2)


Points = list[tuple[int, float]]


def read_segment(path: str) -> tuple[Points, Points]:
    """A --metrics file's (step, loss) points and its (step, eval_loss) points."""
    points, held_out = [], []
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        _bad(path, f"cannot be read: {getattr(exc, 'strerror', None) or exc}")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            _bad(path, f"line {number} is not JSON")
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            _bad(path, f"line {number} is no step of octorun --metrics")
        if isinstance(record.get("loss"), (int, float)) and math.isfinite(record["loss"]):
            points.append((record["step"], float(record["loss"])))
        if isinstance(record.get("eval_loss"), (int, float)) and math.isfinite(record["eval_loss"]):
            held_out.append((record["step"], float(record["eval_loss"])))
    if not points:
        _bad(path, "holds no finite loss")
    return points, held_out


def _ticks(low: float, high: float, count: int = 5) -> list[float]:
    step = (high - low) / (count - 1) if high > low else 1.0
    return [low + i * step for i in range(count)]


def render(segments: list[tuple[str, Points, Points]], title: str) -> str:
    steps = [s for _, points, _ in segments for s, _ in points]
    losses = [loss for _, points, held_out in segments for _, loss in points + held_out]
    x0, x1 = min(steps), max(max(steps), min(steps) + 1)
    y0, y1 = min(losses), max(losses)
    pad = (y1 - y0) * 0.05 or 0.5
    y0, y1 = y0 - pad, y1 + pad

    def x(step: float) -> float:
        return LEFT + (step - x0) / (x1 - x0) * (WIDTH - LEFT - RIGHT)

    def y(loss: float) -> float:
        return TOP + (y1 - loss) / (y1 - y0) * (HEIGHT - TOP - BOTTOM)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" font-size="12">',
           f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
           f'<text x="{WIDTH / 2}" y="22" text-anchor="middle" font-size="14">{html.escape(title)}</text>']
    for value in _ticks(y0, y1):
        out.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y(value):.1f}" y2="{y(value):.1f}" stroke="#e0e0e0"/>')
        out.append(f'<text x="{LEFT - 6}" y="{y(value) + 4:.1f}" text-anchor="end">{value:.2f}</text>')
    for value in _ticks(x0, x1):
        out.append(f'<text x="{x(value):.1f}" y="{HEIGHT - BOTTOM + 16}" text-anchor="middle">{value:.0f}</text>')
    out.append(f'<text x="{WIDTH / 2}" y="{HEIGHT - 10}" text-anchor="middle">step</text>')
    out.append(f'<text x="16" y="{HEIGHT / 2}" text-anchor="middle" transform="rotate(-90 16 {HEIGHT / 2})">loss</text>')
    out.append(f'<rect x="{LEFT}" y="{TOP}" width="{WIDTH - LEFT - RIGHT}" height="{HEIGHT - TOP - BOTTOM}" fill="none" stroke="#888"/>')
    for index, (label, points, held_out) in enumerate(segments):
        colour = COLOURS[index % len(COLOURS)]
        if index:  # where this segment took over
            at = x(points[0][0] - 0.5)
            out.append(f'<line x1="{at:.1f}" x2="{at:.1f}" y1="{TOP}" y2="{HEIGHT - BOTTOM}" stroke="#555" stroke-dasharray="4 3"/>')
        line = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in points)
        out.append(f'<polyline points="{line}" fill="none" stroke="{colour}" stroke-width="2"/>')
        for step, loss in held_out:
            out.append(f'<circle cx="{x(step):.1f}" cy="{y(loss):.1f}" r="4" fill="white" stroke="{colour}" stroke-width="2"/>')
        out.append(f'<text x="{WIDTH - RIGHT - 8}" y="{TOP + 16 + 16 * index}" text-anchor="end" fill="{colour}">'
                   f'{html.escape(label)} (steps {points[0][0]}-{points[-1][0]})</text>')
    if any(held_out for _, _, held_out in segments):
        out.append(f'<text x="{WIDTH - RIGHT - 8}" y="{TOP + 16 + 16 * len(segments)}" text-anchor="end" fill="#555">'
                   f'o held-out loss (--eval-data)</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("segments", nargs="+", metavar="LABEL=METRICS.jsonl")
    parser.add_argument("-o", "--output", required=True, metavar="LOSS.svg")
    parser.add_argument("--title", default="training loss")
    args = parser.parse_args(argv)
    segments = []
    for spec in args.segments:
        label, sep, path = spec.rpartition("=")
        segments.append((label if sep else Path(path).stem, *read_segment(path)))
    Path(args.output).write_text(render(segments, args.title))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main(sys.argv[1:])
