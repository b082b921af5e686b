"""Profiler accuracy and repeatability, for every example model.

``accuracy`` (the default, no subcommand): the sum over layers of F+I+W against a whole-model
forward+backward of the same microbatch measured separately, and the ratio each profile records
itself (its layers' F + B against the whole model timed in the same run).

Run: .venv/bin/python benchmarks/bench_profiler.py [--rounds 4] [--device cpu|cuda] [--size small|large]

``--size large`` gives each model GPU-sized layers (hidden 2048, sequences of 256-1024). On a GPU
the default sizes time mostly kernel launches and the autograd engine's per-call work.

Each round profiles the model between two whole-model measurements and compares with their
mean, so both see the same conditions on a shared machine; the median ratio is reported.

``repeatability``: three back-to-back ``octoplan profile MODEL`` commands per example model (each
its own process, as a user runs them), and from their profiles: each one's layers' F + B over
the whole model timed in the same run, and how far each layer's share of the sum (its F + B over
the layers' F + B) moved between the three. Targets: the sum within 5% of the whole model, the
shares within 3% of themselves.

Run: .venv/bin/python benchmarks/bench_profiler.py repeatability [--profiles 3] [--device cpu|cuda] [--size small|large]
     [--repeat N] [--in-process]

``overhead``: the pass the layers are timed in against the plain whole model, with and without
the saved-tensor boxes octorun records every forward into (the profiler times what octorun runs).

Run: .venv/bin/python benchmarks/bench_profiler.py overhead [--rounds 60]

``estimators``: which figure of a layer's repeats keeps its share steadiest from one profile to
the next: the median, the median of the faster half, or the least (the profiler's).

Run: .venv/bin/python benchmarks/bench_profiler.py estimators [--profiles 3] [--repeat 10]

``--in-process`` profiles in this one process instead: on a CPU the difference between the two
is what depends on where a process's tensors happen to lie in memory (caches, pages), which
stays fixed within a process and which no order of repeats can even out.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from octoplan.profile import profile_to_dict
from octoplan.profiler import measure_whole_model_ms, profile_model_file

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "models"
MODELS = ("tiny_gpt", "vlm", "hybrid")
# Example model files that are not models to measure: the replay model sleeps a given profile's
# times (its accuracy is the sleep's), and needs a profile to replay.
NOT_MEASURED = {"replay": "sleeps the times of a profile it is given"}
# Config overrides that make each example's layers take milliseconds on a GPU.
LARGE = {
    "tiny_gpt": {"vocab": 32768, "hidden": 2048, "heads": 16, "seq": 1024},
    "vlm": {"image_size": 224, "patch": 14, "vision_hidden": 1024, "hidden": 2048, "heads": 16, "vocab": 32768,
            "text_len": 512},
    "hybrid": {"vocab": 32768, "hidden": 2048, "heads": 16, "seq": 256, "expert_hidden": 4096},
}
# A layer's share is compared relatively only where it is at least this much of the sum: the
# share of a layer of 0.5% moves by a third when it moves by 0.17 percentage points.
RELATIVE_SHARE_FLOOR = 0.05


def accuracy(args: argparse.Namespace) -> None:
    # F+I+W is what the first target compared; F+B (B: the fused backward, as a 1F1B plan runs
    # it) is the like-for-like sum, since the whole model's backward is one fused pass too.
    print("| model | layers | sum of layers F+I+W ms | whole model ms | ratio (median of rounds) | rounds | F+B ratio "
          "| in-profile F+B ratio |")
    print("|---|---:|---:|---:|---:|---|---:|---:|")
    for name in args.models or MODELS:
        path = str(EXAMPLES / f"{name}.py")
        config = LARGE[name] if args.size == "large" else None
        kwargs = dict(config=config, microbatch_size=4, repeat=args.repeat, device=args.device, seed=0)
        before = measure_whole_model_ms(path, **kwargs)
        sums, wholes, ratios, fused_ratios, own = [], [], [], [], []
        for _ in range(args.rounds):
            profile = profile_model_file(path, **kwargs)
            after = measure_whole_model_ms(path, **kwargs)
            sums.append(sum(layer.total_ms for layer in profile.layers))
            wholes.append((before + after) / 2)
            ratios.append(sums[-1] / wholes[-1])
            fused_ratios.append(sum(layer.forward_ms + layer.b_ms for layer in profile.layers) / wholes[-1])
            own.append(profile.whole_model.ratio)
            before = after
        rounds = ", ".join(f"{r:.2f}" for r in ratios)
        print(f"| {name} | {profile.num_layers} | {statistics.median(sums):.1f} | {statistics.median(wholes):.1f} | "
              f"{statistics.median(ratios):.3f} | {rounds} | {statistics.median(fused_ratios):.3f} | "
              f"{statistics.median(own):.3f} |")


def _octoplan() -> list[str]:
    """The octoplan command of this Python: its console script, or the module's main."""
    script = Path(sys.executable).parent / "octoplan"
    return [str(script)] if script.exists() else [sys.executable, "-c", "from octoplan.cli import main; main()"]


def _shares(times: list[float]) -> list[float]:
    total = sum(times)
    return [t / total for t in times]


def _share_moves(runs: list[list[float]]) -> tuple[float, float, str]:
    """Over the pairs of runs (each a list of per-layer times): the largest relative move of a
    layer's share among layers holding >= RELATIVE_SHARE_FLOOR of the sum, the largest move in
    percentage points among all layers, and the layer of the relative one (its index)."""
    shares = [_shares(times) for times in runs]
    relative, points, worst = 0.0, 0.0, "-"
    for index in range(len(runs[0])):
        values = [s[index] for s in shares]
        mean = statistics.fmean(values)
        spread = max(abs(a - b) for a, b in itertools.combinations(values, 2))
        points = max(points, 100 * spread)
        if mean >= RELATIVE_SHARE_FLOOR and spread / mean > relative:
            relative, worst = spread / mean, str(index)
    return relative, points, worst


def repeatability(args: argparse.Namespace) -> None:
    files = sorted(EXAMPLES.glob("*.py"))
    models = [f for f in files if f.stem not in NOT_MEASURED]
    command = [*_octoplan(), "profile", "MODEL", "--device", args.device, "-o", "OUT.yaml"]
    if args.repeat is not None:
        command[-2:-2] = ["--repeat", str(args.repeat)]
    print(f"size: {args.size}" + (" (GPU-sized layers: each model's LARGE config as --config options)"
                                  if args.size == "large" else ""))
    started = datetime.datetime.now().isoformat(timespec="minutes")
    print(f"{started}, load average at the start: {Path('/proc/loadavg').read_text().split()[:3]}")
    if args.in_process:
        print(f"per model, {args.profiles} back-to-back profile_model_file(MODEL, device={args.device!r}) in this process")
    else:
        print(f"per model, {args.profiles} back-to-back: {shlex.join(command)}")
    for skipped in sorted(set(f.stem for f in files) - set(f.stem for f in models)):
        print(f"not measured: {skipped} ({NOT_MEASURED[skipped]})")
    if args.models:
        print(f"only: {', '.join(args.models)} (--models)")
        models = [f for f in models if f.stem in args.models]
    print()
    # The ratio in two parts: the layers' sum over the pass they were timed in (what splitting it
    # into layers does), and that pass over the plain whole model (what running the layers as
    # octorun does, each input detached, saved tensors boxed, one autograd call per layer, costs).
    print("| model | layers | layers' F + B, ms | whole model, ms | ratio (each profile) | = layers / pass | x pass / whole "
          "| largest share move, layers >= 5% | largest share move, all layers | timed alone: ratio "
          "| timed alone: share move, layers >= 5% |")
    print("|---|---:|---|---|---|---|---|---:|---:|---|---:|")
    with tempfile.TemporaryDirectory() as folder:
        for model in models:
            profiles = []
            config = LARGE[model.stem] if args.size == "large" else None
            for run in range(args.profiles):
                if args.in_process:  # one process: the same memory placement for every profile
                    kwargs = {} if args.repeat is None else {"repeat": args.repeat}
                    kwargs["config"] = config
                    profiles.append(profile_to_dict(profile_model_file(str(model), device=args.device, **kwargs)))
                    continue
                out = Path(folder) / f"{model.stem}-{run}.yaml"
                argv = [str(model) if part == "MODEL" else str(out) if part == "OUT.yaml" else part for part in command]
                argv += [item for key, value in (config or {}).items() for item in ("--config", f"{key}={value}")]
                done = subprocess.run(argv, capture_output=True, text=True)
                if done.returncode != 0:
                    sys.exit(f"{shlex.join(argv)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
                profiles.append(yaml.safe_load(out.read_text()))
            in_sequence = [[layer["forward_ms"] + layer.get("backward_ms", layer["backward_input_ms"] + layer["backward_weight_ms"])
                            for layer in p["layers"]] for p in profiles]
            alone = [[layer["isolated"]["forward_ms"] + layer["isolated"]["backward_ms"] for layer in p["layers"]]
                     for p in profiles]
            checks = [p["whole_model"] for p in profiles]
            relative, points, worst = _share_moves(in_sequence)
            alone_relative, _, _ = _share_moves(alone)
            names = [layer["name"] for layer in profiles[0]["layers"]]
            cells = [
                model.stem, str(len(names)),
                ", ".join(f"{c['layers_sum_ms']:.1f}" for c in checks),
                ", ".join(f"{c['ms']:.1f}" for c in checks),
                ", ".join(f"{c['ratio']:.3f}" for c in checks),
                ", ".join(f"{c['layers_sum_ms'] / c['in_sequence_ms']:.3f}" for c in checks),
                ", ".join(f"{c['in_sequence_ms'] / c['ms']:.3f}" for c in checks),
                f"{100 * relative:.1f}% ({names[int(worst)] if worst != '-' else '-'})",
                f"{points:.2f} pp",
                ", ".join(f"{c['isolated_sum_ms'] / c['ms']:.3f}" for c in checks),
                f"{100 * alone_relative:.1f}%",
            ]
            print(f"| {' | '.join(cells)} |")
            sys.stdout.flush()
    print()
    print(f"load average at the end: {Path('/proc/loadavg').read_text().split()[:3]}")


def overhead(args: argparse.Namespace) -> None:
    """What the pass the layers are timed in costs over the plain whole model, and how much of it
    is the saved-tensor boxes: per example model, rounds of the profiler's F then B pass as it
    runs it, the same pass with autograd saving tensors as usual (no boxes), and the plain whole
    model, interleaved; medians of the rounds, on this process's clock (the thread's CPU time)."""
    import contextlib

    import torch

    from octoplan import profiler
    from octoplan.host_malloc import steady_malloc
    from octoplan.modelfile import load_model_file
    from octoplan.sequence_timing import Chain, Marks
    from octoplan.splitgrad import SavedTensors

    malloc = steady_malloc()  # as a profile's (OCTOPIPE_MALLOC=as-is: glibc's own)
    torch.set_num_threads(1)
    device = torch.device("cpu")
    clock = profiler._Clock(device, threads=1)
    boxed = SavedTensors.recording
    print(f"{datetime.datetime.now().isoformat(timespec='minutes')}, load average {Path('/proc/loadavg').read_text().split()[:3]}; "
          f"{args.rounds} rounds after 5, malloc {malloc}")
    print("| model | saved tensors per pass | pass, ms | pass without boxes, ms | whole model, ms | pass / whole "
          "| without boxes / whole |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in MODELS:
        mf = load_model_file(str(EXAMPLES / f"{name}.py"), None, seed=0)
        modules = [profiler._build(mf, i, device) for i in range(mf.num_layers())]
        inputs, targets = profiler._first_batch(mf, 4, device)
        chain = Chain(lambda index, layer, outputs, wanted, mf=mf: profiler._loss(mf, index, layer, outputs, wanted),
                      modules, [str(i) for i in range(len(modules))], inputs, targets, device, "fp32")
        boxes = sum(len(tape.saved.boxes) for tape in chain.forward(lambda: None))

        def one_pass(with_boxes: bool) -> float:
            SavedTensors.recording = boxed if with_boxes else (lambda self: contextlib.nullcontext())
            try:
                marks = Marks(clock)
                chain.backward_fused(chain.forward(marks), marks)
            finally:
                SavedTensors.recording = boxed
            return sum(marks.durations_ms())

        def whole() -> float:
            chain.clear_grads()
            begin = clock.now_ns()
            chain.whole()
            end = clock.now_ns()
            chain.clear_grads()
            return (end - begin) / 1e6

        times: dict[str, list[float]] = {"pass": [], "bare": [], "whole": []}
        for r in range(5 + args.rounds):
            for key, run in (("pass", lambda: one_pass(True)), ("bare", lambda: one_pass(False)), ("whole", whole)):
                value = run()
                if r >= 5:
                    times[key].append(value)
        med = {key: statistics.median(values) for key, values in times.items()}
        print(f"| {name} | {boxes} | {med['pass']:.2f} | {med['bare']:.2f} | {med['whole']:.2f} | "
              f"{med['pass'] / med['whole']:.3f} | {med['bare'] / med['whole']:.3f} |")
        sys.stdout.flush()


# one profile with a chosen estimator of the in-sequence repeats, run as its own process; prints
# each layer's share of the layers' F + B as JSON
_ESTIMATOR_RUN = """
import json, statistics, sys
import octoplan.sequence_timing as timing
from octoplan.profiler import profile_model_file
def faster_half(samples):
    ordered = sorted(samples)
    return statistics.median(ordered[: max(1, len(ordered) // 2)])
timing.least = {"median": statistics.median, "least": min, "faster-half median": faster_half}[sys.argv[1]]
profile = profile_model_file(sys.argv[2], device="cpu", repeat=int(sys.argv[3]))
total = sum(layer.forward_ms + layer.b_ms for layer in profile.layers)
print(json.dumps([(layer.forward_ms + layer.b_ms) / total for layer in profile.layers]))
"""
ESTIMATORS = ("median", "faster-half median", "least")


def estimators(args: argparse.Namespace) -> None:
    """Per example model, ``--profiles`` rounds; in each round one profile per estimator of a
    layer's in-sequence repeats, each its own process, the estimators interleaved so load hits
    them alike. Prints, per model and estimator, the largest (max - min) / min of a layer's share
    over the rounds (layers holding >= 5% of the sum), and the largest move in points."""
    print(f"{datetime.datetime.now().isoformat(timespec='minutes')}, load average at the start: "
          f"{Path('/proc/loadavg').read_text().split()[:3]}")
    shares: dict[tuple[str, str], list[list[float]]] = {}
    for _ in range(args.profiles):
        for name in MODELS:
            for estimator in ESTIMATORS:
                done = subprocess.run([sys.executable, "-c", _ESTIMATOR_RUN, estimator, str(EXAMPLES / f"{name}.py"),
                                       str(args.repeat)], capture_output=True, text=True, check=True)
                shares.setdefault((name, estimator), []).append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"\n| model | estimator | largest share move, layers >= 5% | all layers, points |\n|---|---|---:|---:|")
    for name in MODELS:
        for estimator in ESTIMATORS:
            runs = shares[(name, estimator)]
            per_layer = list(zip(*runs))
            rel = max(((max(v) - min(v)) / min(v) for v in per_layer if min(v) >= 0.05), default=0.0)
            points = max(100 * (max(v) - min(v)) for v in per_layer)
            print(f"| {name} | {estimator} | {rel:.1%} | {points:.2f} |")
    print(f"\nload average at the end: {Path('/proc/loadavg').read_text().split()[:3]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (layers timed with CUDA events)")
    parser.add_argument("--size", choices=("small", "large"), default="small", help="large: GPU-sized layers")
    models_help = "only these example models [default: every one]"
    parser.add_argument("--models", nargs="+", choices=MODELS, help=models_help)
    parser.add_argument("--config-args", metavar="MODEL", choices=MODELS,
                        help="only print MODEL's large config as octoplan profile options")
    commands = parser.add_subparsers(dest="command")
    repeat = commands.add_parser("repeatability", help="three back-to-back profiles per example model")
    repeat.add_argument("--profiles", type=int, default=3, help="back-to-back profiles per model")
    repeat.add_argument("--device", default="cpu")
    repeat.add_argument("--size", choices=("small", "large"), default="small", help="large: GPU-sized layers")
    repeat.add_argument("--repeat", type=int, default=None, help="octoplan profile --repeat [default: its own]")
    repeat.add_argument("--models", nargs="+", choices=MODELS, help=models_help)
    repeat.add_argument("--in-process", action="store_true",
                        help="the profiles in this process, not one command each: what stays the same within a process "
                             "(where its tensors lie in memory) stays out of the comparison")
    boxes = commands.add_parser("overhead", help="the in-sequence pass against the whole model, with and without "
                                                 "saved-tensor boxes (CPU)")
    boxes.add_argument("--rounds", type=int, default=60)
    choose = commands.add_parser("estimators", help="the median, the faster half's median and the least repeat, "
                                                    "side by side: which keeps a layer's share steadiest")
    choose.add_argument("--profiles", type=int, default=3, help="rounds of one profile per estimator")
    choose.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    if args.command == "estimators":
        estimators(args)
        return
    if args.command == "repeatability":
        repeatability(args)
        return
    if args.command == "overhead":
        overhead(args)
        return
    if args.config_args:
        print(" ".join(f"--config {key}={value}" for key, value in LARGE[args.config_args].items()))
        return
    accuracy(args)


if __name__ == "__main__":
    main()
