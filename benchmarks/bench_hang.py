"""How long a job takes to end when one rank hangs, tried as a user would: torchrun of 4 processes
training the tiny test model, one worker stopped with SIGSTOP after the first steps (whose deadline
is --init-timeout), the seconds from the stop
to torchrun's exit (median of --repeat tries). octorun's guarantee is --timeout + 10 s.

    .venv/bin/python benchmarks/bench_hang.py --timeout 15 --repeat 3
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import runtime_helpers as h  # noqa: E402  (the tests' plan builders)
from octoplan.plan import save_plan  # noqa: E402


def one_try(folder: Path, plan: Path, timeout: float, stop_after: float, victim: int) -> tuple[float, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    for old in (folder / "m.jsonl", folder / "m.jsonl.partial"):
        old.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                             "-m", "octorun", str(plan), "--steps", "1000000", "--timeout", str(timeout),
                             "--metrics", str(folder / "m.jsonl")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    # past the first step, whose deadline is --init-timeout (at least 300 s), then a while more
    partial = folder / "m.jsonl.partial"
    while not partial.exists() or len(partial.read_text().splitlines()) < 2:
        time.sleep(0.2)
    time.sleep(stop_after)
    found = subprocess.run(["pgrep", "-f", f"octorun {plan}"], capture_output=True, text=True).stdout.split()
    workers = sorted(int(pid) for pid in found if int(pid) != proc.pid)
    pid = workers[victim]
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        _, err = proc.communicate(timeout=timeout * 2 + 40)
    except subprocess.TimeoutExpired:
        proc.kill()  # torchrun; its workers follow it
        subprocess.run(["pkill", "-9", "-f", f"octorun {plan}"])
        return float("inf"), "the job did not end"
    ended = time.monotonic() - stopped
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    first = next((line for line in err.splitlines() if line.startswith("octorun: rank")), "")
    return ended, first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=15.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--stop-after", type=float, default=3.0, help="seconds of training after the first step, before the stop")
    parser.add_argument("--folder", help="where the plan, metrics and ranks' records go (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.folder or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        model, config = h.model_spec("tiny", folder)
        plan = folder / "plan.yaml"
        save_plan(h.baseline_plan("1f1b", model, config, folder, gpus=4, pp=4, microbatches=8), plan)
        times = []
        for attempt in range(args.repeat):
            seconds, first = one_try(folder, plan, args.timeout, args.stop_after, victim=attempt % 4)
            times.append(seconds)
            print(f"try {attempt}: rank {attempt % 4} stopped; the job ended {seconds:.1f} s later; first line: {first[:160]}")
    print(f"median {statistics.median(times):.1f} s from the stop to the end at --timeout {args.timeout:g} "
          f"(the guarantee: {args.timeout + 10:g} s)")


if __name__ == "__main__":
    main()
