"""``octorun PLAN --replay``: a plan of a model too large to run here (an analytic profile,
no model file) executes with every op sleeping its profiled time, and its measured iteration
follows the simulator's prediction."""

from __future__ import annotations

import json

import pytest

import runtime_helpers as h
from octoplan.baseline import make_baseline
from octoplan.calibrate import calibrate
from octoplan.plan import Cluster, save_plan
from octorun.runtime import RunConfig

from conftest import make_profile


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
    metrics = tmp_path / "m.jsonl"
    trace = tmp_path / "t.json"
    job = h.Job("replay", RunConfig(plan_path=str(path), steps=3, replay_time_scale=1.0, metrics_path=str(metrics),
                                    trace_path=str(trace)))
    launched = h.launch(2, [job], tmp_path / "out", timeout_s=90)
    assert launched.exitcodes == [0, 0], launched.logs
    steps = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(steps) == 3
    predicted = plan.predicted["iteration_ms"]
    assert steps[-1]["predicted_iteration_ms"] == pytest.approx(predicted)
    measured = sorted(s["iteration_ms"] for s in steps[1:])[0]
    assert predicted == pytest.approx(150 + 5 * 0.3 * 2, abs=2.0)
    # Loose on purpose: this shared CPU adds sleep overshoot and gloo jitter per op; the
    # fidelity benchmark (docs/BENCHMARKS.md) measures the real error. Skipping a sleep (a
    # third less) or sleeping twice would still fail here.
    assert measured == pytest.approx(predicted, rel=0.25)
    # The ranks' op times share one clock: every op starts after the op on the other rank
    # whose output it consumes has ended.
    times = {e["name"]: (e["ts"], e["ts"] + e["dur"]) for e in json.loads(trace.read_text())["traceEvents"]}
    for mb in range(4):
        assert times[f"1F{mb}"][0] >= times[f"0F{mb}"][1]
        assert times[f"0B{mb}"][0] >= times[f"1B{mb}"][1]
    # octoplan calibrate reads this trace: every op but rank 0's first either waited for its
    # message or followed a runtime gap, or sat in between (its message possibly in flight)
    cal = calibrate(plan, profile, trace)
    assert cal.counts["ops"] == 16 and cal.counts["pairs"] == 1
    assert cal.counts["transfers"] >= 2  # rank 1's first forward; rank 0's first backward
    assert cal.counts["gaps"] + cal.counts["transfers"] <= 15
    assert cal.latency_ms is not None and 0.0 <= cal.latency_ms < 20.0
    assert 0.0 <= cal.op_overhead_ms < 10.0


def test_replay_without_the_profile_is_bad_input(tmp_path, profile_file):
    from octoplan.errors import InputError
    from octorun.runtime import prepare

    profile = make_profile([(1, 1, 1)] * 2)
    ppath = profile_file(profile)
    plan = make_baseline(profile, schedule="gpipe", gpus=1, microbatches=1, profile_path=ppath)
    path = tmp_path / "plan.yaml"
    save_plan(plan, path)
    with pytest.raises(InputError, match="an analytic plan has no model to train"):
        prepare(RunConfig(plan_path=str(path)))
    ppath.unlink()
    with pytest.raises(InputError, match="--replay needs the plan's profile"):
        prepare(RunConfig(plan_path=str(path), replay_time_scale=1.0))


@pytest.mark.parametrize("override,flag", [
    ({"timeout_s": float("nan")}, "--timeout"),
    ({"timeout_s": float("inf")}, "--timeout"),
    ({"lr": -1.0}, "--lr"),
    ({"lr": float("nan")}, "--lr"),
    ({"seed": 10**20}, "--seed"),
])
def test_bad_flags_are_refused_before_anything_runs(tmp_path, override, flag):
    from octoplan.errors import InputError
    from octorun.runtime import prepare

    with pytest.raises(InputError) as info:
        prepare(RunConfig(plan_path=str(tmp_path / "missing.yaml"), **override))
    assert info.value.field == flag


def test_a_metrics_path_that_is_a_folder_is_refused(tmp_path):
    from octoplan.errors import InputError
    from octorun.runtime import prepare

    with pytest.raises(InputError, match="--metrics names a folder"):
        prepare(RunConfig(plan_path=str(tmp_path / "missing.yaml"), metrics_path=str(tmp_path)))
