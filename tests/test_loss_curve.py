"""examples/loss_curve.py: the training loss of runs that continue one another, and their
held-out losses, as one SVG."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "loss_curve.py"


def _metrics(path: Path, steps: range, evaluated: dict[int, float]) -> Path:
    lines = [{"step": s, "loss": 5.0 - 0.1 * s, **({"eval_loss": evaluated[s]} if s in evaluated else {})} for s in steps]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _draw(tmp_path: Path, *segments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *segments, "-o", str(tmp_path / "loss.svg")],
                          capture_output=True, text=True)


def test_each_segment_is_a_line_and_each_held_out_loss_a_circle(tmp_path):
    # steps 0-9 evaluated after 4 and 9, steps 10-19 after 14 and 19; the lowest point is a
    # held-out loss (3.0 < the last training loss 3.1), so the scale takes it in
    first = _metrics(tmp_path / "a.jsonl", range(10), {4: 4.8, 9: 4.3})
    second = _metrics(tmp_path / "b.jsonl", range(10, 20), {14: 3.6, 19: 3.0})
    done = _draw(tmp_path, f"pp 4={first}", f"pp 2 x dp 2={second}")
    assert done.returncode == 0, done.stderr
    svg = (tmp_path / "loss.svg").read_text()
    assert svg.count("<polyline") == 2
    circles = [(float(x), float(y)) for x, y in re.findall(r'<circle cx="([\d.]+)" cy="([\d.]+)"', svg)]
    assert len(circles) == 4
    assert [x for x, _ in circles] == sorted(x for x, _ in circles)  # in step order
    ys = [y for _, y in circles]
    assert ys == sorted(ys)  # falling losses sit lower on the page as they fall: larger y
    assert "held-out loss (--eval-data)" in svg
    assert "pp 4 (steps 0-9)" in svg and "pp 2 x dp 2 (steps 10-19)" in svg


def test_runs_without_held_out_losses_have_no_circles_nor_their_legend(tmp_path):
    done = _draw(tmp_path, f"run={_metrics(tmp_path / 'a.jsonl', range(5), {})}")
    assert done.returncode == 0, done.stderr
    svg = (tmp_path / "loss.svg").read_text()
    assert "<circle" not in svg and "held-out" not in svg


def test_a_file_that_is_no_metrics_file_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    done = _draw(tmp_path, f"run={bad}")
    assert done.returncode == 2 and done.stderr.splitlines() == [
        f"loss_curve: {bad}: line 1 is not JSON (give LABEL=METRICS, a --metrics file octorun wrote)"]
    assert not (tmp_path / "loss.svg").exists()
