"""The bad-input corpus of tests/test_bad_input_corpus.py at a large example count: per
command, how many generated cases it was given and how many broke the contract (exit 2, one
line on stderr naming the file and the field, no traceback, no output created or changed, an
end within 60 s). A violation is counted and the run goes on; the first of each command is
printed.

    .venv/bin/python benchmarks/bench_bad_input.py [--examples 500] [--only plans profiles models launch checkpoints]

``--examples`` is per property: the plan corpus runs once per command (simulate, validate,
show, export, octorun), the profile corpus once per command (baseline, tune, and simulate of a
plan whose profile is bad). Checkpoints are a fixed list, each damage once, each a process.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import test_bad_input_corpus as corpus  # noqa: E402

GROUPS = ("plans", "profiles", "models", "launch", "checkpoints")


def _run(group: str) -> None:
    if group == "plans":
        for command in corpus.PLAN_COMMANDS:
            corpus.test_bad_plans_are_refused_by_every_command(command)
        corpus.test_bad_plans_are_refused_by_octorun()
    elif group == "profiles":
        for command in (*corpus.PROFILE_COMMANDS, "simulate"):
            corpus.test_bad_profiles_are_refused_by_every_command(command)
    elif group == "models":
        import torch

        torch.set_num_threads(1)
        corpus.test_model_files_off_the_contract_are_refused_by_profile(None)
    elif group == "launch":
        corpus.test_launch_variables_that_disagree_with_the_plan_are_refused()
    else:
        for how in corpus._CHECKPOINT_DAMAGE:
            corpus.check_checkpoint_case(how, existing=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=500, help="cases per property (default 500)")
    parser.add_argument("--only", nargs="+", choices=GROUPS, default=list(GROUPS))
    args = parser.parse_args()
    corpus.EXAMPLES = args.examples
    corpus.TALLY.record_only = True
    started = time.perf_counter()
    for group in args.only:
        began = time.perf_counter()
        _run(group)
        print(f"{group}: {time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True)
    print(f"{'command':28s} {'cases':>7s} {'violations':>10s}")
    for command, tried in corpus.TALLY.tried.items():
        print(f"{command:28s} {tried:7d} {corpus.TALLY.violated[command]:10d}")
    print(f"{'all':28s} {sum(corpus.TALLY.tried.values()):7d} {sum(corpus.TALLY.violated.values()):10d}"
          f"   ({time.perf_counter() - started:.0f} s, {args.examples} examples per property)")
    for command, text in corpus.TALLY.examples.items():
        print(f"first violation, {text[:600]}")


if __name__ == "__main__":
    main()
