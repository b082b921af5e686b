"""The prepared GPU check (benchmarks/gpu_check.sh) runs end to end: here on the CPU, so that
time on a GPU goes to the GPU checks, not to fixing the script. Every step runs, on tiny_gpt
alone (MODELS=tiny_gpt): the other models take the same lines of the script, and the whole
rehearsal (about 200 s) is the script's own command, ``DEVICE=cpu ROUNDS=1 PYTEST=0 bash
benchmarks/gpu_check.sh``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_gpu_check_script_runs_on_the_cpu(tmp_path):
    env = {**os.environ, "DEVICE": "cpu", "PY": sys.executable, "OUT": str(tmp_path), "ROUNDS": "1", "PYTEST": "0",
           "MODELS": "tiny_gpt", "PROFILES": "2"}
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models.tar.gz", "profiler.md", "repeatability.md"]  # within the device tool's 8 files
    table = (tmp_path / "profiler.md").read_text().splitlines()
    assert [row.split("|")[1].strip() for row in table[2:]] == ["tiny_gpt"]
    repeats = [row for row in (tmp_path / "repeatability.md").read_text().splitlines() if row.startswith("| ")]
    assert [row.split("|")[1].strip() for row in repeats[1:]] == ["tiny_gpt"]  # step 6, a row per model
    with tarfile.open(tmp_path / "models.tar.gz") as archive:
        archive.extractall(tmp_path / "models", filter="data")
    for model in ("tiny_gpt", "tiny_gpt-zb-h1"):  # step 3, each 1-rank plan
        steps = [json.loads(line) for line in (tmp_path / "models" / f"{model}.metrics.jsonl").read_text().splitlines()]
        assert [s["step"] for s in steps] == [0, 1, 2] and all(s["iteration_ms"] > 0 for s in steps)
        assert json.loads((tmp_path / "models" / f"{model}.trace.json").read_text())["traceEvents"]
    for name in ("tiny_gpt-1f1b-pp2", "tiny_gpt-interleaved-pp2", "tiny_gpt-zbv-pp2", "tiny_gpt-1f1b-pp2-dp2"):  # step 4
        assert f"{name}: ok, losses" in done.stdout, done.stdout[-3000:]
    assert "FAILED" not in done.stdout
    for model in ("tiny_gpt",):  # step 5: bf16, a checkpoint and a bit-identical resume
        whole, resumed = ([json.loads(line)["loss"] for line in (tmp_path / "models" / name).read_text().splitlines()]
                          for name in (f"{model}-bf16.metrics.jsonl", f"{model}-bf16-resumed.metrics.jsonl"))
        assert len(whole) == 4 and resumed == whole[2:]
        assert f"{model} bf16: " in done.stdout and "bit-identical" in done.stdout.split(f"{model} bf16: ")[1].splitlines()[0]
