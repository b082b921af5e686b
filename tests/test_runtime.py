"""octorun on real gloo processes: pipelined training equals a single-process reference.

Jobs are grouped by world size and run as one batch per group of processes (see
runtime_helpers.launch); each parametrized case then checks its own job's losses and final
parameters (max abs diff <= 1e-5) against the reference, on every rank.

Everything runs in float32 except AdamW on the example models, which runs in float64: their
attention key biases have a gradient that is exactly zero in exact arithmetic (softmax ignores a
shift shared by all keys), so in float32 it is rounding noise of ~1e-9 whose value depends on the
summation order, and AdamW's normalisation turns any such noise into an update of ~lr. No
pipelined (or data-parallel) order can match a single-process reference there; in float64 the
noise stays far below AdamW's eps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import runtime_helpers as h
from octoplan.plan import save_plan
from octorun.runtime import RunConfig, summarize_step

TOL = 1e-5
STEPS = 3
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv", "dualpipev")
LR = {"sgd": 0.1, "adamw": 0.01}


class Batch:
    """Jobs for one world size; runs them all on first use and remembers what each expects."""

    def __init__(self, world: int, folder: Path):
        self.world = world
        self.folder = folder
        self.jobs: list[h.Job] = []
        self.expect: dict[str, tuple] = {}
        self.launched: h.Launch | None = None

    def add(self, name: str, plan, model_path: Path, config: dict, *, optimizer: str, microbatch_size: int = 2,
            metrics: bool = False, dtype: str = "float32", **run: Any) -> None:
        assert plan.cluster.gpus == self.world
        path = self.folder / f"{name}.yaml"
        save_plan(plan, path)
        extra = {}
        if metrics:
            extra = {"metrics_path": str(self.folder / f"{name}.metrics.jsonl"), "trace_path": str(self.folder / f"{name}.trace.json")}
        self.jobs.append(h.Job(name, RunConfig(plan_path=str(path), steps=STEPS, optimizer=optimizer, lr=LR[optimizer],
                                               timeout_s=30, **extra, **run), dtype=dtype))
        self.expect[name] = (model_path, config, plan, optimizer, microbatch_size, dtype)

    def run(self) -> h.Launch:
        if self.launched is None:
            self.launched = h.launch(self.world, self.jobs, self.folder / "out", timeout_s=60 + 10 * len(self.jobs))
        return self.launched

    def check(self, name: str) -> None:
        launched = self.run()
        assert launched.exitcodes == [0] * self.world, "\n".join(launched.logs)
        model_path, config, plan, optimizer, mbs, dtype = self.expect[name]
        ref = h.reference(model_path, config, steps=STEPS, microbatches=plan.microbatches, dp=plan.parallel.dp,
                          microbatch_size=mbs, optimizer=optimizer, lr=LR[optimizer], dtype=dtype)
        metrics = launched.result(name, 0)["metrics"]
        assert [m.step for m in metrics] == list(range(STEPS))
        assert [m.loss for m in metrics] == pytest.approx(ref.losses, abs=TOL)
        replicas: dict[int, dict] = {}
        for rank in range(self.world):
            out = launched.result(name, rank)
            replicas.setdefault(out["dp_rank"], {}).update(out["state"])
        assert sorted(replicas) == list(range(plan.parallel.dp))
        for dp_rank, state in replicas.items():  # every replica holds every layer, equal to the reference
            assert h.max_abs_diff(state, ref.state) <= TOL, f"replica {dp_rank}"


def _hand_batches(folder: Path) -> dict[int, Batch]:
    model_path, config = h.model_spec("tiny", folder)
    batches = {w: Batch(w, folder / f"w{w}") for w in (2, 3, 4)}
    for batch in batches.values():
        batch.folder.mkdir(parents=True, exist_ok=True)
    for index, (name, (plan, world)) in enumerate(h.hand_plans(model_path, config, 6).items()):
        batches[world].add(name, plan, model_path, config, optimizer=("sgd", "adamw")[index % 2], metrics=name == "v-shape-iw")
    # every baseline schedule on two ranks (microbatches 4: DualPipeV needs 2 * pp)
    for index, schedule in enumerate(SCHEDULES):
        plan = h.baseline_plan(schedule, model_path, config, folder, gpus=2, pp=2, microbatches=4)
        batches[2].add(f"tiny-{schedule}-pp2", plan, model_path, config, optimizer=("sgd", "adamw")[index % 2])
    # and on four: pp 4 for the V and interleaved ones (8 stages), pp 2 x dp 2 for 1F1B
    model10, config10 = h.model_spec("tiny10", folder)
    for schedule in ("interleaved-1f1b", "zbv", "dualpipev"):
        batches[4].add(f"tiny-{schedule}-pp4", h.baseline_plan(schedule, model10, config10, folder, gpus=4, pp=4, microbatches=8),
                       model10, config10, optimizer="sgd")
    # shapes that change between microbatches and steps: every message carries its layout
    vary_path, vary_config = h.model_spec("tiny-vary", folder)
    for schedule in ("1f1b", "zbv"):
        plan = h.baseline_plan(schedule, vary_path, vary_config, folder, gpus=2, pp=2, microbatches=4)
        batches[2].add(f"tiny-vary-{schedule}-dynamic", plan, vary_path, vary_config, optimizer="sgd", dynamic_shapes=True)
    batches[4].add("tiny-1f1b-pp2-dp2", h.baseline_plan("1f1b", model_path, config, folder, gpus=4, pp=2, microbatches=3),
                   model_path, config, optimizer="adamw")
    return batches


def _example_batch(folder: Path) -> Batch:
    batch = Batch(4, folder / "examples")
    batch.folder.mkdir(parents=True, exist_ok=True)
    for model in ("tiny_gpt", "vlm", "hybrid"):
        model_path, config = h.model_spec(model, folder)
        for schedule in SCHEDULES:
            # sgd on pp 4 (two-chunk schedules: 8 one-layer stages), adamw on pp 2 x dp 2
            plan = h.baseline_plan(schedule, model_path, config, folder / model, gpus=4, pp=4, microbatches=8)
            batch.add(f"{model}-{schedule}-sgd-pp4", plan, model_path, config, optimizer="sgd")
            plan = h.baseline_plan(schedule, model_path, config, folder / model, gpus=4, pp=2, microbatches=4)
            batch.add(f"{model}-{schedule}-adamw-pp2dp2", plan, model_path, config, optimizer="adamw", dtype="float64")
    return batch


@pytest.fixture(scope="module")
def hand_batches(tmp_path_factory) -> dict[int, Batch]:
    return _hand_batches(tmp_path_factory.mktemp("hand"))


@pytest.fixture(scope="module")
def example_batch(tmp_path_factory) -> Batch:
    return _example_batch(tmp_path_factory.mktemp("examples"))


def _hand_cases() -> list[tuple[int, str]]:
    folder = Path("/nonexistent")  # names only; nothing is written
    names = [(world, name) for name, (_, world) in h.hand_plans(folder / "m.py", {}, 6).items()]
    names += [(2, f"tiny-{s}-pp2") for s in SCHEDULES] + [(2, f"tiny-vary-{s}-dynamic") for s in ("1f1b", "zbv")]
    names += [(4, f"tiny-{s}-pp4") for s in ("interleaved-1f1b", "zbv", "dualpipev")] + [(4, "tiny-1f1b-pp2-dp2")]
    return names


HAND_CASES = _hand_cases()


@pytest.mark.parametrize("world,name", HAND_CASES, ids=[f"{n}" for _, n in HAND_CASES])
def test_pipelined_training_equals_reference(hand_batches, world, name):
    hand_batches[world].check(name)


EXAMPLE_CASES = [f"{m}-{s}-{o}" for m in ("tiny_gpt", "vlm", "hybrid") for s in SCHEDULES for o in ("sgd-pp4", "adamw-pp2dp2")]


@pytest.mark.slow
@pytest.mark.parametrize("name", EXAMPLE_CASES)
def test_example_models_equal_reference(example_batch, name):
    example_batch.check(name)


def test_metrics_and_trace_are_written(hand_batches):
    batch = hand_batches[2]
    launched = batch.run()
    assert launched.exitcodes == [0, 0], "\n".join(launched.logs)
    plan = batch.expect["v-shape-iw"][2]
    lines = (batch.folder / "v-shape-iw.metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [0, 1, 2]
    for record in records:
        assert {"step", "loss", "iteration_ms", "bubble_ratio", "step_ms"} <= set(record)
        assert record["iteration_ms"] > 0 and 0 <= record["bubble_ratio"] < 1
        assert "predicted_iteration_ms" not in record  # hand plans carry no prediction
    assert [r["loss"] for r in records] == pytest.approx([m.loss for m in launched.result("v-shape-iw", 0)["metrics"]])
    trace = json.loads((batch.folder / "v-shape-iw.trace.json").read_text())
    # real work, not replayed, of the plan's model
    assert trace["otherData"] == {"source": "octorun", "model": plan.model.name, "replay_time_scale": None}
    events = trace["traceEvents"]
    expected = {(rank, str(op)) for rank, ops in enumerate(plan.schedule) for op in ops}
    assert {(e["tid"], e["name"]) for e in events} == expected
    assert len(events) == len(expected)
    assert min(e["ts"] for e in events) == 0
    for event in events:
        assert event["ph"] == "X" and event["pid"] == 0 and event["dur"] >= 0
        assert event["cat"] == event["name"][len(str(event["args"]["stage"]))]
        assert event["name"] == f'{event["args"]["stage"]}{event["cat"]}{event["args"]["mb"]}'
    # per rank, ops appear in the plan's order and never overlap
    for rank, ops in enumerate(plan.schedule):
        mine = sorted((e for e in events if e["tid"] == rank), key=lambda e: e["ts"])
        assert [e["name"] for e in mine] == [str(op) for op in ops]
        for a, b in zip(mine, mine[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3


def test_baseline_metrics_report_the_prediction(hand_batches):
    launched = hand_batches[2].run()
    assert launched.exitcodes == [0, 0], "\n".join(launched.logs)
    plan = hand_batches[2].expect["tiny-1f1b-pp2"][2]
    metrics = launched.result("tiny-1f1b-pp2", 0)["metrics"]
    assert [m.predicted_iteration_ms for m in metrics] == [plan.predicted["iteration_ms"]] * STEPS


def _record(spans, reduced_s=None, *, loss_sum=1.0):
    return {"loss_sum": loss_sum, "loss_count": 2, "step_s": 0.02, "reduced_s": reduced_s,
            "spans": [(0, kind, 0, start, end) for kind, start, end in spans]}


def test_a_step_with_data_parallelism_ends_with_its_last_all_reduce():
    # two replicas of one stage: ops busy 0-4 and 6-10 ms on one, 1-5 and 7-12 ms on the other;
    # their all-reduces finish at 15 and 14 ms. The simulator's iteration ends with the all-reduce,
    # so the measured one must too: 15 ms, not the ops' 12 (1 ms of the 15 is before rank 1 starts).
    records = [_record([("F", 0.000, 0.004), ("B", 0.006, 0.010)], 0.015),
               _record([("F", 0.001, 0.005), ("B", 0.007, 0.012)], 0.014, loss_sum=3.0)]
    metrics = summarize_step(2, records, 14.5)
    assert metrics.iteration_ms == pytest.approx(15.0)
    assert metrics.bubble_ratio == pytest.approx(1 - 17 / 30)
    assert (metrics.step, metrics.loss, metrics.step_ms, metrics.predicted_iteration_ms) == (2, 1.0, 20.0, 14.5)
    # without data parallelism there is no all-reduce: first op start to last op end
    alone = summarize_step(0, [_record([("F", 0.000, 0.004), ("B", 0.006, 0.010)]),
                               _record([("F", 0.001, 0.005), ("B", 0.007, 0.012)])], None)
    assert alone.iteration_ms == pytest.approx(12.0) and alone.bubble_ratio == pytest.approx(1 - 17 / 24)


@pytest.mark.slow  # fresh interpreters under torchrun: ~15-30 s on a shared 2-core machine
def test_torchrun_cli_end_to_end(tmp_path):
    """The SPEC's command line, under the real launcher: losses equal the reference."""
    model_path, config = h.model_spec("tiny_gpt", tmp_path)
    plan = h.baseline_plan("zb-h1", model_path, config, tmp_path, gpus=2, pp=2, microbatches=4)
    save_plan(plan, tmp_path / "plan.yaml")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(h.free_port()),
         "-m", "octorun", str(tmp_path / "plan.yaml"), "--steps", "2", "--optimizer", "sgd", "--lr", "0.1",
         "--metrics", str(tmp_path / "m.jsonl"), "--trace", str(tmp_path / "t.json"), "--timeout", "60"],
        capture_output=True, text=True, cwd=h.ROOT, env=env, timeout=180,
    )
    assert done.returncode == 0, done.stderr
    ref = h.reference(model_path, config, steps=2, microbatches=4, dp=1, microbatch_size=2, optimizer="sgd", lr=0.1)
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in records] == pytest.approx(ref.losses, abs=TOL)
    assert [r["predicted_iteration_ms"] for r in records] == [plan.predicted["iteration_ms"]] * 2
    summary = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in summary] == ["step 0", "step 1"]
    assert [float(line.split()[3]) for line in summary] == pytest.approx(ref.losses, abs=1e-5)
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert sorted((e["tid"], e["name"]) for e in events) == sorted((r, str(op)) for r, ops in enumerate(plan.schedule) for op in ops)


def test_a_model_that_exits_mid_step_fails_the_run_naming_the_exit(tmp_path):
    """sys.exit in a model's loss_fn (an argparse error, a stray exit()) is the model's failure:
    the run fails and says so, rather than ending with the model's own status 0 and no word."""
    path = h.write_tiny_model(tmp_path)
    text = path.read_text()
    path.write_text(text.replace("def loss_fn(logits, targets):\n", "def loss_fn(logits, targets):\n    import sys\n"
                                 "    sys.exit(0)\n"))
    plan = h.baseline_plan("1f1b", path, {}, tmp_path, gpus=1, pp=1, microbatches=2)
    save_plan(plan, tmp_path / "plan.yaml")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run([sys.executable, "-m", "octorun", str(tmp_path / "plan.yaml"), "--steps", "1"],
                          capture_output=True, text=True, cwd=h.ROOT, env=env, timeout=120)
    assert done.returncode == 1
    where = path.resolve()  # outside the working folder: named by its whole path
    line = next(number for number, text in enumerate(path.read_text().splitlines(), 1) if "sys.exit(0)" in text)
    assert done.stderr.strip().splitlines()[-1] == (f"octorun: rank 0: failed while running op 0F0 of step 0: SystemExit: 0 "
                                                    f"(at {where}:{line} in loss_fn)")


def test_a_run_at_another_precision_than_its_profiles_says_so(tmp_path):
    path = h.write_tiny_model(tmp_path)
    plan = h.baseline_plan("1f1b", path, {}, tmp_path, gpus=1, pp=1, microbatches=2, precision="bf16")
    save_plan(plan, tmp_path / "plan.yaml")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    said = ("octorun: the plan's profile was measured at --precision bf16, this run is fp32: the plan's predicted times "
            "and activation bytes are bf16's (run with --precision bf16, or profile at fp32)")
    for precision, warned in (("fp32", True), ("bf16", False)):
        done = subprocess.run([sys.executable, "-m", "octorun", str(tmp_path / "plan.yaml"), "--steps", "1",
                               "--precision", precision], capture_output=True, text=True, cwd=h.ROOT, env=env, timeout=120)
        assert done.returncode == 0, done.stderr
        assert (said in done.stderr.splitlines()) == warned, done.stderr
        assert done.stdout.startswith("step 0: loss ")  # the step's line, printed as the step ended


def test_a_process_on_the_cpu_runs_with_its_profiles_threads(tmp_path):
    """A profile timed with 1 thread: octorun's process (here alone, as without torchrun) runs
    with 1 too, not every core, so that the plan's times hold; OMP_NUM_THREADS, where the user
    (or torchrun) set it, still decides."""
    path = h.write_tiny_model(tmp_path)
    path.write_text(path.read_text().replace("def build_layer(index, ", "def build_layer(index, ", 1) +
                    "\n_build = build_layer\n\ndef build_layer(*args, **kwargs):\n    import os, torch\n"
                    "    open(os.environ['THREADS_OUT'], 'a').write(f'{torch.get_num_threads()}\\n')\n"
                    "    return _build(*args, **kwargs)\n")
    # the profiler's settings, as octoplan profile records them on a CPU
    plan = h.baseline_plan("1f1b", path, {}, tmp_path, gpus=1, pp=1, microbatches=2, extra={"profiler": {"threads": 1}})
    save_plan(plan, tmp_path / "plan.yaml")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")}
    for omp, expected in ((None, "1"), ("2", "2")):
        out = tmp_path / f"threads-{omp}.txt"
        run_env = {**env, "THREADS_OUT": str(out), **({"OMP_NUM_THREADS": omp} if omp else {})}
        done = subprocess.run([sys.executable, "-m", "octorun", str(tmp_path / "plan.yaml"), "--steps", "1"],
                              capture_output=True, text=True, cwd=h.ROOT, env=run_env, timeout=120)
        assert done.returncode == 0, done.stderr
        assert set(out.read_text().split()) == {expected}


def test_single_process_without_torchrun(tmp_path, monkeypatch):
    """No launcher: a world of one; three stages on the one rank hand values over directly."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "x")  # so that monkeypatch restores the environment run() fills in
        monkeypatch.delenv(name)
    from octorun.runtime import run

    model_path, config = h.model_spec("tiny", tmp_path)
    plan = h.make_plan(model_path, config, stages=h.even_stages(6, [0, 0, 0]), microbatches=2,
                       schedule=["0F0 1F0 2F0 0F1 1F1 2F1 2I1 1B1 2W1 2B0 1I0 0B1 1W0 0B0"])
    save_plan(plan, tmp_path / "one.yaml")
    result = run(RunConfig(plan_path=str(tmp_path / "one.yaml"), steps=STEPS, optimizer="adamw", lr=LR["adamw"],
                           metrics_path=str(tmp_path / "m.jsonl")))
    ref = h.reference(model_path, config, steps=STEPS, microbatches=2, dp=1, microbatch_size=2, optimizer="adamw", lr=LR["adamw"])
    assert [m.loss for m in result.metrics] == pytest.approx(ref.losses, abs=TOL)
    assert h.max_abs_diff(result.state, ref.state) <= TOL
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == STEPS
