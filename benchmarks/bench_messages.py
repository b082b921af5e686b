"""octorun's count of tapes and messages against the plan's prediction (docs/BENCHMARKS.md,
"Memory"): per schedule and rank, ``predicted.peak_with_message_bytes`` beside what each
step held (``octorun --activation-memory``), on gloo processes of this machine.

``replay``: the replay model (examples/models/replay.py, bytes scale 1) of a profile of F = I =
W = 6, 6, 15, 15 ms and 400 kB outputs, profiled, planned for 2 ranks and 4 microbatches, and
run for 3 steps: the ops last what the plan says. ``real``: tiny_gpt and hybrid (the test
configurations), profiled on the CPU, planned for 3 ranks and 6 microbatches, run for 3 steps.

    .venv/bin/python benchmarks/bench_messages.py replay [--schedules gpipe 1f1b zb-h1 zb-h2]
    .venv/bin/python benchmarks/bench_messages.py real [--schedules 1f1b gpipe zb-h1 zb-h2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the multi-process launcher the tests use

from conftest import make_profile  # noqa: E402
from runtime_helpers import EXAMPLE_CONFIGS, EXAMPLES, Job, launch  # noqa: E402

from octoplan.baseline import make_baseline  # noqa: E402
from octoplan.plan import Cluster, save_plan  # noqa: E402
from octoplan.profile import save_profile  # noqa: E402
from octoplan.profiler import profile_model_file  # noqa: E402
from octorun.runtime import RunConfig  # noqa: E402


def _profiles(kind: str, folder: Path) -> dict[str, Path]:
    if kind == "replay":
        save_profile(make_profile([(6, 6, 6), (6, 6, 6), (15, 15, 15), (15, 15, 15)], out=400_000), folder / "source.yaml")
        config = {"profile": str(folder / "source.yaml"), "time_scale": 1.0, "bytes_scale": 1.0}
        found = {"replay": profile_model_file(str(EXAMPLES / "replay.py"), config=config, microbatch_size=1, repeat=3,
                                              warmup=1, clock="wall")}
    else:
        found = {model: profile_model_file(str(EXAMPLES / f"{model}.py"), config=EXAMPLE_CONFIGS[model], microbatch_size=2,
                                           repeat=3, warmup=1, device="cpu") for model in ("tiny_gpt", "hybrid")}
    paths = {}
    for name, profile in found.items():
        paths[name] = folder / f"{name}.yaml"
        save_profile(profile, paths[name])
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=("replay", "real"))
    parser.add_argument("--schedules", nargs="*", default=["gpipe", "1f1b", "zb-h1", "zb-h2"])
    args = parser.parse_args()
    ranks, microbatches = (2, 4) if args.kind == "replay" else (3, 6)
    cluster = Cluster(gpus=ranks, latency_us=300.0, intra_node_gbps=1.0)  # about gloo on loopback
    from octoplan.profile import load_profile

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        jobs, predicted = [], {}
        for model, path in _profiles(args.kind, folder).items():
            for schedule in args.schedules:
                name = f"{model}-{schedule}"
                plan = make_baseline(load_profile(path), schedule=schedule, gpus=ranks, pp=ranks, microbatches=microbatches,
                                     cluster=cluster, profile_path=path)
                save_plan(plan, folder / f"{name}.yaml")
                predicted[name] = plan.predicted
                jobs.append(Job(name, RunConfig(plan_path=str(folder / f"{name}.yaml"), steps=3, activation_memory=True,
                                                timeout_s=60)))
        done = launch(ranks, jobs, folder / "run", timeout_s=600)
        if done.exitcodes != [0] * ranks:
            sys.exit("\n".join(done.logs))
        print("| plan | predicted bytes per rank | step 0 | step 1 | step 2 | tapes as predicted in every step |")
        print("|---|---|---|---|---|---|")
        for name, want in predicted.items():
            steps = done.result(name, 0)["metrics"]
            held = " | ".join(" / ".join(str(b) for b in m.peak_with_message_bytes) for m in steps)
            tapes = all(list(m.peak_activation_bytes) == want["peak_activation_bytes"] for m in steps)
            print(f"| {name} | {' / '.join(str(b) for b in want['peak_with_message_bytes'])} | {held} | {tapes} |")


if __name__ == "__main__":
    main()
