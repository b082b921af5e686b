"""glibc's malloc as it is against its thresholds fixed (octoplan.host_malloc), side by side.

``profiles`` (the default): per example model, ``--rounds`` rounds, each with one profile per
setting (``OCTOPIPE_MALLOC=as-is``, then the default), each its own process. Prints the minor
page faults per in-sequence repeat (the mechanism), the layers' F + B over the whole model, and
how far the layers' shares moved over the rounds.

``octorun``: per example model, a 1F1B plan on ``--ranks`` processes (its profile measured
once), then ``--rounds`` pairs of ``torchrun ... octorun PLAN --steps N --optimizer adamw``, one
per setting, interleaved; each run's median step after the first two, and each pair's ratio.

Run: .venv/bin/python benchmarks/bench_malloc.py [profiles] [--rounds 6] [--repeat 10] [--models ...]
     .venv/bin/python benchmarks/bench_malloc.py octorun [--rounds 4] [--ranks 2] [--steps 12] [--models ...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from bench_profiler import EXAMPLES, MODELS, _octoplan, _share_moves

SETTINGS = ("as-is", "steady")

_PROFILE_RUN = """
import json, resource, sys
import octoplan.profiler as profiler
from octoplan.host_malloc import steady_malloc
timed = profiler.time_in_sequence
faults = []
def counted(chain, *, clock, repeat, warmup):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    samples = timed(chain, clock=clock, repeat=repeat, warmup=warmup)
    faults.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / (repeat + warmup))
    return samples
profiler.time_in_sequence = counted
profile = profiler.profile_model_file(sys.argv[1], device="cpu", repeat=int(sys.argv[2]))
times = [layer.forward_ms + layer.b_ms for layer in profile.layers]
print(json.dumps({"malloc": steady_malloc(), "faults": faults[0], "ratio": profile.whole_model.ratio, "times": times}))
"""


def _env(setting: str) -> dict[str, str]:
    return {**os.environ, "OCTOPIPE_MALLOC": setting}


def _load() -> str:
    return str(Path("/proc/loadavg").read_text().split()[:3])


def profiles(args: argparse.Namespace) -> None:
    print(f"{datetime.datetime.now().isoformat(timespec='minutes')}, load average at the start: {_load()}")
    runs: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.rounds):
        for name in args.models:
            for setting in SETTINGS:
                done = subprocess.run([sys.executable, "-c", _PROFILE_RUN, str(EXAMPLES / f"{name}.py"), str(args.repeat)],
                                      capture_output=True, text=True, check=True, env=_env(setting))
                runs.setdefault((name, setting), []).append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"\n{args.rounds} profiles per model and setting, --repeat {args.repeat}\n")
    print("| model | malloc | minor page faults per in-sequence repeat (median) | layers' F + B / whole model "
          "| largest share move, layers >= 5% | all layers, points |\n|---|---|---:|---|---:|---:|")
    for name in args.models:
        for setting in SETTINGS:
            found = runs[(name, setting)]
            assert all(r["malloc"] == setting for r in found), found  # each process did as it was told
            relative, points, _ = _share_moves([r["times"] for r in found])
            print(f"| {name} | {setting} | {statistics.median(r['faults'] for r in found):.0f} | "
                  f"{min(r['ratio'] for r in found):.3f}-{max(r['ratio'] for r in found):.3f} | {relative:.1%} | {points:.2f} |")
    print(f"\nload average at the end: {_load()}")


def _median_step_ms(metrics: Path) -> float:
    steps = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return statistics.median(step["iteration_ms"] for step in steps[2:])


def octorun(args: argparse.Namespace) -> None:
    print(f"{datetime.datetime.now().isoformat(timespec='minutes')}, load average at the start: {_load()}")
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.ranks),
              "-m", "octorun"]
    print(f"per model: octoplan profile MODEL --repeat 3; octoplan baseline --gpus {args.ranks} --schedule 1f1b "
          f"--microbatches 8; then {args.rounds} x (OCTOPIPE_MALLOC=as-is, steady): torchrun --nproc-per-node "
          f"{args.ranks} octorun PLAN --steps {args.steps} --optimizer adamw --metrics M.jsonl\n")
    print("| model | predicted ms | as-is: median step per run, ms | steady: median step per run, ms "
          "| steady / as-is, per pair | median ratio |\n|---|---:|---|---|---|---:|")
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models:
            profile, plan = Path(folder) / f"{name}.yaml", Path(folder) / f"{name}-plan.yaml"
            subprocess.run([*_octoplan(), "profile", str(EXAMPLES / f"{name}.py"), "--repeat", "3", "-o", str(profile)],
                           capture_output=True, check=True)
            subprocess.run([*_octoplan(), "baseline", str(profile), "--gpus", str(args.ranks), "--schedule", "1f1b",
                            "--microbatches", "8", "-o", str(plan)], capture_output=True, check=True)
            predicted = yaml.safe_load(plan.read_text())["predicted"]["iteration_ms"]
            steps: dict[str, list[float]] = {setting: [] for setting in SETTINGS}
            for round_ in range(args.rounds):
                for setting in SETTINGS:
                    metrics = Path(folder) / f"{name}-{setting}-{round_}.jsonl"
                    done = subprocess.run([*launch, str(plan), "--steps", str(args.steps), "--optimizer", "adamw",
                                           "--metrics", str(metrics)], capture_output=True, text=True, env=_env(setting))
                    if done.returncode != 0:
                        sys.exit(f"octorun failed ({done.returncode}): {done.stderr[-2000:]}")
                    steps[setting].append(_median_step_ms(metrics))
            ratios = [fixed / plain for plain, fixed in zip(steps["as-is"], steps["steady"])]
            print(f"| {name} | {predicted:.1f} | {', '.join(f'{v:.1f}' for v in steps['as-is'])} | "
                  f"{', '.join(f'{v:.1f}' for v in steps['steady'])} | {', '.join(f'{r:.3f}' for r in ratios)} | "
                  f"{statistics.median(ratios):.3f} |")
            sys.stdout.flush()
    print(f"\nload average at the end: {_load()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command")
    part = commands.add_parser("profiles", help="profiles of every example model, each setting (the default)")
    part.add_argument("--rounds", type=int, default=6, help="profiles per model and setting")
    part.add_argument("--repeat", type=int, default=10)
    part.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    run = commands.add_parser("octorun", help="octorun's step, each setting")
    run.add_argument("--rounds", type=int, default=4, help="pairs of runs per model")
    run.add_argument("--ranks", type=int, default=2)
    run.add_argument("--steps", type=int, default=12)
    run.add_argument("--models", nargs="+", choices=MODELS, default=["tiny_gpt", "hybrid"])
    argv = sys.argv[1:]
    if not argv or argv[0] not in ("profiles", "octorun", "-h", "--help"):
        argv = ["profiles", *argv]  # the default part
    args = parser.parse_args(argv)
    if args.rounds < (2 if args.command == "profiles" else 1):
        parser.error("--rounds: at least 2 profiles to compare, at least 1 pair of runs")
    (octorun if args.command == "octorun" else profiles)(args)


if __name__ == "__main__":
    main()
