"""``octorun PLAN --replay``: a plan of a model too large to run here (an analytic profile,
no model file) executes with every op sleeping its profiled time, and its measured iteration
follows the simulator's prediction."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import runtime_helpers as h
from octoplan.baseline import make_baseline
from octoplan.calibrate import calibrate
from octoplan.errors import InputError
from octoplan.outputs import StreamedOutput
from octoplan.plan import Cluster, save_plan
from octorun.runtime import RunConfig, prepare

from conftest import make_profile, remeasured


@pytest.mark.slow
def test_replay_of_a_profile_without_model_file_matches_the_prediction(tmp_path, profile_file):
    # 4 layers of F = I = W = 5 ms; 1F1B on 2 ranks, 4 microbatches: (4 + 2 - 1) x (10 + 20) = 150 ms.
    profile = make_profile([(5, 5, 5)] * 4, out=4096)
    ppath = profile_file(profile)
    cluster = Cluster(gpus=2, latency_us=300.0, intra_node_gbps=1.0)  # about gloo on loopback
    plan = make_baseline(profile, schedule="1f1b", gpus=2, microbatches=4, cluster=cluster, profile_path=ppath)
    assert plan.model.source is None
    path = tmp_path / "plan.yaml"
    save_plan(plan, path)
    predicted = plan.predicted["iteration_ms"]
    assert predicted == pytest.approx(150 + 5 * 0.3 * 2, abs=2.0)
    results: list[tuple[float, Path]] = []

    def measure() -> tuple[float, Path]:
        out = tmp_path / f"run{len(results)}"
        out.mkdir()
        metrics, trace = out / "m.jsonl", out / "t.json"
        job = h.Job("replay", RunConfig(plan_path=str(path), steps=3, replay_time_scale=1.0,
                                        metrics_path=str(metrics), trace_path=str(trace)))
        launched = h.launch(2, [job], out / "logs", timeout_s=90)
        assert launched.exitcodes == [0, 0], launched.logs
        steps = [json.loads(line) for line in metrics.read_text().splitlines()]
        assert len(steps) == 3
        assert steps[-1]["predicted_iteration_ms"] == pytest.approx(predicted)
        measured = min(s["iteration_ms"] for s in steps[1:])
        # A stall only adds time, so skipping a sleep (a third less) fails on every attempt.
        assert measured >= 0.75 * predicted
        return measured, trace

    # Loose on purpose: this shared CPU adds sleep overshoot and gloo jitter per op; the
    # fidelity benchmark (docs/BENCHMARKS.md) measures the real error. A stall of the shared
    # machine (one CI run took 203 ms) is measured again; sleeping twice misses every time.

    def misses(result: tuple[float, Path]) -> list[str]:
        results.append(result)
        return [] if result[0] <= 1.25 * predicted else [f"{result[0]:.1f} ms against {predicted:.1f} predicted"]

    assert remeasured(measure, misses) == []
    trace = results[-1][1]
    # The ranks' op times share one clock: every op starts after the op on the other rank
    # whose output it consumes has ended.
    times = {e["name"]: (e["ts"], e["ts"] + e["dur"]) for e in json.loads(trace.read_text())["traceEvents"]}
    for mb in range(4):
        assert times[f"1F{mb}"][0] >= times[f"0F{mb}"][1]
        assert times[f"0B{mb}"][0] >= times[f"1B{mb}"][1]
    # octoplan calibrate reads this trace: every op but rank 0's first either waited for its
    # message or followed a runtime gap, or sat in between (its message possibly in flight)
    assert json.loads(trace.read_text())["otherData"] == {"source": "octorun", "model": plan.model.name,
                                                          "replay_time_scale": 1.0}
    cal = calibrate(plan, profile, trace)
    assert cal.counts["ops"] == 16 and cal.counts["pairs"] == 1
    assert cal.counts["transfers"] >= 2  # rank 1's first forward; rank 0's first backward
    assert cal.counts["gaps"] + cal.counts["transfers"] <= 15
    assert cal.latency_ms is not None and 0.0 <= cal.latency_ms < 20.0
    assert 0.0 <= cal.op_overhead_ms < 10.0


def _saved_plan(tmp_path, profile_file, *, layers: int, schedule: str, gpus: int, microbatches: int):
    """A plan of ``layers`` layers of F = I = W = 1 ms, saved with its profile: (plan path, profile path)."""
    profile = make_profile([(1, 1, 1)] * layers)
    ppath = profile_file(profile)
    plan = make_baseline(profile, schedule=schedule, gpus=gpus, microbatches=microbatches, profile_path=ppath)
    path = tmp_path / "plan.yaml"
    save_plan(plan, path)
    return path, ppath


def test_replay_without_the_profile_is_bad_input(tmp_path, profile_file):
    path, ppath = _saved_plan(tmp_path, profile_file, layers=2, schedule="gpipe", gpus=1, microbatches=1)
    with pytest.raises(InputError, match="an analytic plan has no model to train"):
        prepare(RunConfig(plan_path=str(path)))
    with pytest.raises(InputError) as evaluated:  # a replay's layers only sleep: nothing to evaluate
        prepare(RunConfig(plan_path=str(path), replay_time_scale=1.0, eval_data_path=str(tmp_path / "held_out.bin")))
    assert evaluated.value.field == "--eval-data"
    ppath.unlink()
    with pytest.raises(InputError, match="--replay needs the plan's profile"):
        prepare(RunConfig(plan_path=str(path), replay_time_scale=1.0))


@pytest.mark.parametrize("override,flag", [
    ({"timeout_s": float("nan")}, "--timeout"),
    ({"timeout_s": float("inf")}, "--timeout"),
    ({"timeout_s": 1e10}, "--timeout"),  # overflowed the store's milliseconds: a traceback
    ({"timeout_s": 60.0, "init_timeout_s": 1e300}, "--init-timeout"),
    ({"lr": -1.0}, "--lr"),
    ({"lr": float("nan")}, "--lr"),
    ({"seed": 10**20}, "--seed"),
    ({"replay_time_scale": float("nan")}, "--replay"),
    ({"replay_time_scale": float("inf")}, "--replay"),
    ({"replay_time_scale": -1.0}, "--replay"),
    # options that need another to mean anything were ignored without a word
    ({"keep": 3}, "--keep"),
    ({"data_dtype": "uint32"}, "--data-dtype"),
    ({"betas": (0.8, 0.9)}, "--betas"),  # sgd has none
    ({"min_lr": 1e-4}, "--min-lr"),  # the constant schedule never falls to it
    ({"decay_steps": 100}, "--decay-steps"),
    ({"eval_every": 5}, "--eval-every"),
    ({"eval_batches": 2}, "--eval-batches"),
    ({"eval_every": 0, "eval_data_path": "held_out.bin"}, "--eval-every"),
    ({"eval_batches": 0, "eval_data_path": "held_out.bin"}, "--eval-batches"),
])
def test_bad_flags_are_refused_before_anything_runs(tmp_path, override, flag):
    with pytest.raises(InputError) as info:
        prepare(RunConfig(plan_path=str(tmp_path / "missing.yaml"), **override))
    assert info.value.field == flag


def test_the_seed_limit_said_is_the_one_enforced(tmp_path):
    # it said "from 0 to 10**9" and refused 1000000
    from octoplan.modelfile import microbatch_seed
    from octoplan.plan import MAX_GPUS, MAX_MICROBATCHES
    from octorun.runtime import MAX_SEED, MAX_STEPS

    last = dict(step=MAX_STEPS - 1, replica=MAX_GPUS - 1, mb=MAX_MICROBATCHES - 1)
    assert microbatch_seed(seed=MAX_SEED, **last) < 2**63 <= microbatch_seed(seed=MAX_SEED + 1, **last)
    with pytest.raises(InputError) as info:
        prepare(RunConfig(plan_path=str(tmp_path / "missing.yaml"), seed=MAX_SEED + 1))
    assert info.value.field == "--seed" and info.value.fix == f"give a seed from 0 to {MAX_SEED}"
    with pytest.raises(InputError) as info:  # the largest passes, to the next check
        prepare(RunConfig(plan_path=str(tmp_path / "missing.yaml"), seed=MAX_SEED))
    assert info.value.field != "--seed"


def test_a_metrics_path_that_is_a_folder_is_refused(tmp_path):
    with pytest.raises(InputError, match="--metrics names a folder"):
        prepare(RunConfig(plan_path=str(tmp_path / "missing.yaml"), metrics_path=str(tmp_path)))


def test_output_paths_that_cannot_be_written_are_refused_before_training(tmp_path, profile_file):
    # a file under a plain file's name cannot be created: found before anything runs, not
    # after the training steps (which used to end in exit 1 with a wrong activity named)
    path, _ = _saved_plan(tmp_path, profile_file, layers=2, schedule="1f1b", gpus=2, microbatches=2)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for flag, field in (("--metrics", "metrics_path"), ("--trace", "trace_path")):
        with pytest.raises(InputError, match=f"{flag} cannot be written"):
            prepare(RunConfig(plan_path=str(path), replay_time_scale=0.0, **{field: str(blocker / "m.jsonl")}))
    # bad input elsewhere leaves no file or folder behind, and neither does the check of a good
    # run: the metrics file makes its missing folders when it is written, as octoplan's -o does
    out = tmp_path / "new" / "deeper" / "m.jsonl"
    with pytest.raises(InputError, match="no such plan file"):
        prepare(RunConfig(plan_path=str(tmp_path / "missing.yaml"), metrics_path=str(out)))
    assert not out.parent.exists()
    prepare(RunConfig(plan_path=str(path), replay_time_scale=0.0, metrics_path=str(out)))
    assert not (tmp_path / "new").exists()
    metrics = StreamedOutput(out, flag="--metrics")
    metrics.write_line("{}")
    metrics.commit()
    assert out.read_text() == "{}\n" and list(out.parent.iterdir()) == [out]


@pytest.mark.parametrize("env,variable", [
    ({"RANK": "5", "WORLD_SIZE": "2"}, "RANK"),  # used to wait --timeout for peers that cannot exist
    ({"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "99999"}, "MASTER_PORT"),
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "29500"}, "MASTER_ADDR"),
])
def test_bad_launch_variables_are_one_line_on_every_rank(tmp_path, profile_file, env, variable):
    import os
    import subprocess
    import sys

    path, _ = _saved_plan(tmp_path, profile_file, layers=2, schedule="1f1b", gpus=2, microbatches=2)
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    run = subprocess.run([sys.executable, "-m", "octorun", str(path), "--replay", "0", "--timeout", "20"],
                         env={**clean, **env}, capture_output=True, text=True, timeout=120)
    # printed even where RANK is not 0: a launch variable is each process's own
    assert run.returncode == 2 and run.stderr.startswith(f"octorun: {variable}: ") and run.stderr.count("\n") == 1, run.stderr


def test_a_replay_scale_whose_ops_outlast_the_timeout_is_refused(tmp_path, profile_file):
    # stages of two layers of F, I, W 1 ms each: 1F1B's B op (I + W) lasts 4 ms, so at scale
    # 1250 it sleeps 5 s, not under a 5 s --timeout, which would trip the watchdog of the rank
    # waiting on it
    path, _ = _saved_plan(tmp_path, profile_file, layers=4, schedule="1f1b", gpus=2, microbatches=2)
    with pytest.raises(InputError, match="makes the longest op sleep 5 s, not under --timeout 5 s"):
        prepare(RunConfig(plan_path=str(path), replay_time_scale=1250.0, timeout_s=5.0))
    assert prepare(RunConfig(plan_path=str(path), replay_time_scale=1200.0, timeout_s=5.0)).plan.pp == 2


def test_a_replay_scale_whose_waits_outlast_the_timeout_is_refused(tmp_path, profile_file):
    """Four stages of one layer (F 1 ms, B 2 ms), 1F1B of 2 microbatches: rank 0 runs 0F0 0F1 by
    2 ms, then waits for 0B0's gradient, which the three other ranks' forwards and backwards
    (3 + 6 ms, less its own 1 ms F) and six 10-us hops bring at 10.06 ms: an 8.06 ms wait. At
    scale 700 each op sleeps at most 1.4 s, yet the wait lasts 5.64 s: the watchdog, not the
    scale, would have ended the run (at scale 6 on llama3-8b, a review saw exactly that)."""
    path, _ = _saved_plan(tmp_path, profile_file, layers=4, schedule="1f1b", gpus=4, microbatches=2)
    with pytest.raises(InputError, match="makes the plan's longest wait for an input 5.64 s, not under --timeout 5 s"):
        prepare(RunConfig(plan_path=str(path), replay_time_scale=700.0, timeout_s=5.0))
    assert prepare(RunConfig(plan_path=str(path), replay_time_scale=600.0, timeout_s=5.0)).plan.pp == 4  # 4.84 s


def test_a_resume_at_another_replay_scale_is_named(tmp_path, profile_file):
    """The checkpoint records the --replay scale its run slept at; a resume at another scale
    goes on with its own and says so, as for any changed setting."""
    import os
    import subprocess
    import sys

    path, _ = _saved_plan(tmp_path, profile_file, layers=2, schedule="1f1b", gpus=1, microbatches=2)
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}

    def octorun(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "octorun", str(path), *args], env=clean, capture_output=True,
                              text=True, timeout=120)

    saved = octorun("--replay", "0", "--steps", "1", "--save", str(tmp_path / "ck"))
    assert saved.returncode == 0, saved.stderr
    resumed = octorun("--replay", "0.5", "--steps", "2", "--resume", str(tmp_path / "ck"))
    assert resumed.returncode == 0, resumed.stderr
    assert "this run's settings differ from the checkpoint's: replay_time_scale 0.0 -> 0.5;" in resumed.stderr


def test_the_replay_model_leaves_octoruns_folder_off_the_import_path(tmp_path, profile_file, monkeypatch):
    """The replay model is a model file of octorun's own: loading it must not put octorun/ on
    the import path, where its modules would import a second time under bare names
    (``checkpoint``, ``watchdog``) and shadow other packages of those names."""
    import sys

    import octorun

    monkeypatch.setattr(sys, "path", list(sys.path))
    path, _ = _saved_plan(tmp_path, profile_file, layers=2, schedule="1f1b", gpus=2, microbatches=2)
    assert prepare(RunConfig(plan_path=str(path), replay_time_scale=1.0)).model.name == "replay"
    assert str(Path(octorun.__file__).parent) not in sys.path
