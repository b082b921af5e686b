"""What a finer decomposition buys: the hybrid example with whole layers against the same model with
its LM head in two vocabulary shards and each Mamba-style block in two layers
(examples/models/hybrid.py ``head_shards=2``, ``split_mamba=true``).

For each granularity, on this machine: ``octoplan profile`` (bf16, as ``make demo`` profiles),
the best balance any assignment of the profile's layers to the ranks allows
(:func:`octoplan.tuner.caps.balance_cap`, a CP-SAT bin packing), ``octoplan tune`` with a
deterministic budget (``--max-plans``), and the tuned plan run by octorun with ``--replay`` on
torchrun processes (every op sleeps its profiled time, as ``make demo`` step 8 does), whose
measured step time is the median of the steps after the first (as examples/report.py reads it),
over ``--rounds`` runs of each.

The two profiles are measured separately, so their total work differs by the machine's noise
(and by what splitting itself costs or saves): compare iteration times, not only efficiencies.
On a shared machine other processes inflate a profile's CPU times (caches, context switches), so
each granularity is profiled ``--profile-rounds`` times, alternating between the two, and the
profile with the median total F + B is the one tuned; the replays alternate between the plans too.
A third row removes that noise from the comparison: the split profile's layers summed back into
whole layers ("merged"), the same measured work at the coarse granularity, so that the split
and merged rows differ in granularity only (the merged row still carries what splitting costs,
e.g. the head shards' concatenation, which whole layers would not pay).

Run: .venv/bin/python benchmarks/bench_split_layers.py [--repeat 5] [--profile-rounds 3] [--rounds 3] [--out out/bench-split-layers] [--reuse-profiles]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from octoplan.plan import load_plan
from octoplan.profile import Layer, ModelRef, Profile, load_profile, save_profile

from octoplan.tuner.caps import balance_cap

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "examples" / "models" / "hybrid.py"
BIN = Path(sys.executable).parent  # octoplan and torchrun of this environment
# granularity -> (file tag, octoplan profile --config overrides)
GRANULARITIES = {"whole layers": ("whole", []), "split": ("split", ["head_shards=2", "split_mamba=true"])}
# "fastest baseline that fits: NAME (pp=.. dp=.. mb=..), 99.30 ms" as octoplan tune prints it
BASELINE_LINE = re.compile(r"fastest baseline that fits: (\S+) \(.*?\), ([0-9.]+) ms")


@dataclass
class Result:
    granularity: str
    overrides: list[str]
    profile_path: Path
    plan_path: Path
    profile: Profile | None = None
    profile_totals_ms: list[float] = field(default_factory=list)  # every profiling round's F+B per microbatch
    cap: float = float("nan")
    predicted_ms: float = float("nan")
    efficiency: float = float("nan")
    balance: float = float("nan")
    baseline: str = ""
    baseline_ms: float = float("nan")
    step_ms: list[float] = field(default_factory=list)  # every replayed step but each run's first

    @property
    def measured_ms(self) -> float:
        return statistics.median(self.step_ms)


def fb_ms(layer: Layer) -> float:
    return layer.forward_ms + layer.b_ms


def work_ms(layer: Layer) -> float:
    """F + I + W (the cap and the planner's lower bound take the cheaper of I + W and B; on these
    profiles B is timed as I + W or more)."""
    return layer.forward_ms + layer.backward_input_ms + layer.backward_weight_ms


def unsplit_name(name: str) -> str:
    """mamba.0.conv -> mamba.0, head.1 -> head: the layer of the unsplit model a split layer is part of."""
    if name.startswith("head."):
        return "head"
    return name.rsplit(".", 1)[0] if name.endswith((".conv", ".scan")) else name


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def run(command: list[str], **kwargs) -> str:
    print("$", shlex.join(command), flush=True)
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, **kwargs)
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}): {shlex.join(command)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done.stdout


def profile_round(result: Result, round_index: int, args: argparse.Namespace) -> None:
    path = result.profile_path.with_suffix(f".round{round_index}.yaml")
    run([str(BIN / "octoplan"), "profile", str(MODEL), *(f"--config={o}" for o in result.overrides),
         "--repeat", str(args.repeat), "--precision", "bf16", "-o", str(path)])


def pick_profile(result: Result, args: argparse.Namespace) -> None:
    """The round whose total F+B is the median becomes ``result.profile_path``."""
    if not (args.reuse_profiles and result.profile_path.exists()):
        rounds = [result.profile_path.with_suffix(f".round{k}.yaml") for k in range(args.profile_rounds)]
        totals = [sum(map(fb_ms, load_profile(path).layers)) for path in rounds]
        median = sorted(range(len(rounds)), key=totals.__getitem__)[len(rounds) // 2]
        result.profile_path.write_text(rounds[median].read_text())
        result.profile_totals_ms = totals
    result.profile = load_profile(result.profile_path)


def merged(split: Profile) -> Profile:
    """``split``'s layers summed back into the unsplit model's layers: the same work, coarser.

    Times, parameters, activations and FLOPs add up; what leaves a merged layer is its last
    part's output, what its I frees is its first part's input."""
    groups: dict[str, list[Layer]] = {}
    for layer in split.layers:
        groups.setdefault(unsplit_name(layer.name), []).append(layer)
    layers = []
    for name, parts in groups.items():
        first, last = parts[0], parts[-1]

        def total(field_name: str) -> float:
            return sum(getattr(part, field_name) for part in parts)

        layers.append(replace(
            last, name=name, kind=last.kind if last.kind == "head" else first.kind,
            forward_ms=total("forward_ms"), backward_input_ms=total("backward_input_ms"),
            backward_weight_ms=total("backward_weight_ms"), backward_ms=sum(p.b_ms for p in parts),
            param_bytes=total("param_bytes"), activation_bytes=total("activation_bytes"),
            flops=sum(p.flops or 0.0 for p in parts), pending_w_bytes=total("pending_w_bytes"),
            w_saved_bytes=sum(p.held_for_w_bytes for p in parts), input_freed_bytes=first.input_freed_bytes,
            spread=max((p.spread for p in parts if p.spread is not None), default=None), isolated=None,
        ))
    config = {**split.model.config, "head_shards": 1, "split_mamba": False}
    return replace(split, model=ModelRef(split.model.name, split.model.source, config), layers=tuple(layers),
                   extra={**split.extra, "merged_from": "the split profile of bench_split_layers.py"}, whole_model=None)


def tune(result: Result, args: argparse.Namespace) -> None:
    result.cap, _ = balance_cap(result.profile, args.gpus)
    out = run([str(BIN / "octoplan"), "tune", str(result.profile_path), "--gpus", str(args.gpus), "--pp", str(args.gpus), "--microbatches",
               str(args.microbatches), "--max-plans", str(args.max_plans), "-o", str(result.plan_path)],
              env={**os.environ, "COLUMNS": "250"})  # wide enough that no line of the report wraps
    found = BASELINE_LINE.search(out)
    if found is None:
        sys.exit(f"no 'fastest baseline that fits' line in octoplan tune's output:\n{out[-3000:]}")
    result.baseline, result.baseline_ms = found.group(1), float(found.group(2))
    plan = load_plan(result.plan_path)
    result.predicted_ms, result.efficiency = plan.predicted["iteration_ms"], plan.predicted["efficiency"]
    result.balance = plan.extra["tuner"]["balance"]


def replay(result: Result, args: argparse.Namespace) -> None:
    metrics_path = result.plan_path.with_suffix(".jsonl")
    metrics_path.unlink(missing_ok=True)
    run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(args.gpus), "-m", "octorun", str(result.plan_path),
         "--replay", "--steps", str(args.steps), "--metrics", str(metrics_path)], env={**os.environ, "OMP_NUM_THREADS": "1"})
    steps = [json.loads(line)["iteration_ms"] for line in metrics_path.read_text().splitlines() if line.strip()]
    result.step_ms += steps[1:] or steps  # the first step warms up


def report(results: list[Result], args: argparse.Namespace) -> None:
    print(f"\nhybrid example, {args.gpus} ranks, {args.microbatches} microbatches, bf16 profiles (--repeat {args.repeat}); "
          f"tune --max-plans {args.max_plans}; octorun --replay --steps {args.steps}, {args.rounds} run(s) per plan\n")
    for r in results:
        check = r.profile.whole_model
        # how far the machine's noise moved this profile: its layers against the whole model, same run
        whole = f"layers' F+B sum {check.layers_sum_ms:.2f} ms, whole model {check.ms:.2f} ms; " if check else ""
        rounds = f"profiling rounds' F+B {', '.join(f'{ms:.2f}' for ms in r.profile_totals_ms)} ms (median tuned); " if r.profile_totals_ms else ""
        print(f"- {r.granularity}: {rounds}{whole}replayed steps {', '.join(f'{ms:.1f}' for ms in r.step_ms)} ms")
    print("\n| layers | count | F+B per microbatch ms | F+I+W ms | largest layer F+I+W ms | balance cap | tuned predicted ms "
          "| efficiency | balance | best baseline ms | tuned measured ms (replay) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        layers = r.profile.layers
        largest = max(layers, key=work_ms)
        print(f"| {r.granularity} | {len(layers)} | {sum(map(fb_ms, layers)):.2f} | {sum(map(work_ms, layers)):.2f} "
              f"| {work_ms(largest):.2f} ({largest.name}) | {r.cap:.3f} | {r.predicted_ms:.2f} | {r.efficiency:.3f} "
              f"| {r.balance:.3f} | {r.baseline_ms:.2f} ({r.baseline}) | {r.measured_ms:.2f} |")
    whole, split, same_work = results
    print()
    for other in (whole, same_work):
        print(f"split / {other.granularity}: predicted {split.predicted_ms / other.predicted_ms:.3f}x, measured "
              f"{split.measured_ms / other.measured_ms:.3f}x, total F+I+W "
              f"{sum(map(work_ms, split.profile.layers)) / sum(map(work_ms, other.profile.layers)):.3f}x, total F+B "
              f"{sum(map(fb_ms, split.profile.layers)) / sum(map(fb_ms, other.profile.layers)):.3f}x")

    # how each split layer's work divides between its parts, each profile's own figures
    print("\n| unsplit layer | F+I+W ms, whole | F+I+W ms of the parts, split | parts' sum / whole |")
    print("|---|---|---|---|")
    parts: dict[str, list[Layer]] = {}
    for layer in split.profile.layers:
        parts.setdefault(unsplit_name(layer.name), []).append(layer)
    for layer in whole.profile.layers:
        pieces = parts.get(layer.name, [])
        if len(pieces) > 1:
            cells = " + ".join(f"{work_ms(p):.2f} ({p.name})" for p in pieces)
            print(f"| {layer.name} | {work_ms(layer):.2f} | {cells} | {sum(map(work_ms, pieces)) / work_ms(layer):.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="octoplan profile --repeat (make demo's)")
    parser.add_argument("--profile-rounds", type=int, default=3, help="profiles per granularity; the median is tuned")
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--max-plans", type=int, default=3000)
    parser.add_argument("--steps", type=int, default=5, help="octorun --steps per replay run")
    parser.add_argument("--rounds", type=int, default=3, help="replay runs per plan, alternating between the plans")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "bench-split-layers")
    parser.add_argument("--reuse-profiles", action="store_true", help="keep the profiles a previous run wrote in --out")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"{datetime.datetime.now().isoformat(timespec='seconds')}, load average {load_average()}, {os.cpu_count()} CPUs")
    results = [Result(name, overrides, args.out / f"hybrid-{tag}.yaml", args.out / f"hybrid-{tag}.plan.yaml")
               for name, (tag, overrides) in GRANULARITIES.items()]
    if not args.reuse_profiles:
        for k in range(args.profile_rounds):  # alternating, so both meet the same conditions
            for result in results:
                profile_round(result, k, args)
    for result in results:
        pick_profile(result, args)
    results.append(Result("merged (split profile, whole layers)", [], args.out / "hybrid-merged.yaml",
                          args.out / "hybrid-merged.plan.yaml", profile=merged(results[1].profile)))
    save_profile(results[-1].profile, results[-1].profile_path)
    for result in results:
        tune(result, args)
    for _ in range(args.rounds):
        for result in results:
            replay(result, args)
    print(f"load average after: {load_average()}")
    report(results, args)
    print(f"\n$ {shlex.join([sys.executable, *sys.argv])}")


if __name__ == "__main__":
    main()
