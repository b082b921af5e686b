"""octoplan calibrate: the cluster figures a measured trace implies. On a trace the simulator
wrote, they are the cluster it simulated, exactly; on octorun's own trace they are counted op by
op (tests/test_runtime_replay.py)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from octoplan.baseline import make_baseline
from octoplan.calibrate import calibrate, split_trace, within_cluster_ranges
from octoplan.cli import app
from octoplan.errors import InputError
from octoplan.plan import Cluster, save_plan
from octoplan.simulator import simulate
from octoplan.timeline import write_trace

from conftest import make_profile

# Uneven stages and nothing to send: a transfer costs exactly the latency.
PROFILE = make_profile([(3, 1, 2), (1, 1.5, 1), (2, 2, 2), (1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 1), (4, 3, 3)])


def _simulated_trace(tmp_path, schedule: str, latency_us: float, overhead_us: float):
    cluster = Cluster(gpus=4, latency_us=latency_us, op_overhead_us=overhead_us, intra_node_gbps=1e12)
    plan = make_baseline(PROFILE, schedule=schedule, gpus=4, microbatches=8, cluster=cluster)
    path = tmp_path / f"{schedule}.json"
    write_trace(plan, simulate(plan, PROFILE), path)
    return plan, path


@pytest.mark.parametrize("schedule,latency_us,overhead_us", [("1f1b", 300.0, 150.0), ("zb-h1", 1200.0, 0.0),
                                                               ("interleaved-1f1b", 50.0, 700.0)])
def test_a_simulated_trace_gives_back_its_cluster(tmp_path, schedule, latency_us, overhead_us):
    plan, path = _simulated_trace(tmp_path, schedule, latency_us, overhead_us)
    cal = calibrate(plan, PROFILE, path)
    # the simulator runs a rank's ops back to back unless one waits for a message, and puts the
    # per-op cost inside each op: no gaps, every op's excess is that cost, every wait a latency
    assert cal.gap_ms == pytest.approx(0.0, abs=1e-9)
    assert cal.excess_ms == pytest.approx(overhead_us / 1000, abs=1e-9)
    assert cal.latency_ms == pytest.approx(latency_us / 1000, abs=1e-9)
    assert cal.flags() == f"--latency-us {latency_us:.0f} --op-overhead-us {overhead_us:.0f}"
    ops = len(plan.stages) * 8 * (3 if schedule == "zb-h1" else 2)
    assert cal.counts["ops"] == ops
    assert cal.counts["gaps"] > 0 and cal.counts["transfers"] > 0
    assert cal.counts["gaps"] + cal.counts["transfers"] <= ops - 1  # rank 0's first op is neither
    assert cal.counts["pairs"] == (4 if schedule == "interleaved-1f1b" else 3)  # neighbours both ways; the loop closes


def test_clock_offsets_cancel_both_ways(tmp_path):
    plan, path = _simulated_trace(tmp_path, "1f1b", 800.0, 0.0)
    doc = json.loads(path.read_text())
    for event in doc["traceEvents"]:  # rank 3 left the step's barrier 0.2 ms after the others
        if event.get("ph") == "X" and event.get("tid") == 3 and event.get("cat") in "FIWB":
            event["ts"] -= 200.0
    path.write_text(json.dumps(doc))
    split = split_trace(plan, PROFILE, path)
    assert split.offsets_ms["0/2-0/3"] == pytest.approx(-0.2, abs=1e-9)
    assert calibrate(plan, PROFILE, path).latency_ms == pytest.approx(0.8, abs=1e-9)


@pytest.mark.parametrize("scale", [1.0, 20.0, 10**400])
def test_a_replay_at_another_scale_than_the_profiles_is_bad_input(tmp_path, scale):
    """octorun --replay 20 sleeps 20 x the profile's times: read as this trace's own, every op
    would exceed its profiled time by 19 x itself (an op overhead of seconds). At scale 1 the
    trace is read as any other."""
    plan, path = _simulated_trace(tmp_path, "1f1b", 300.0, 150.0)
    doc = json.loads(path.read_text())
    doc["otherData"] = {"source": "octorun", "replay_time_scale": scale}  # as octorun writes it
    path.write_text(json.dumps(doc))
    if scale == 1.0:
        assert calibrate(plan, PROFILE, path).latency_ms == pytest.approx(0.3, abs=1e-9)
        return
    said = "is 20: its ops slept 20 x the profile's times" if scale == 20.0 else "is too large to be a scale"
    with pytest.raises(InputError, match=f"otherData.replay_time_scale: {said}"):
        calibrate(plan, PROFILE, path)


def test_times_no_run_could_have_are_bad_input(tmp_path):
    plan, path = _simulated_trace(tmp_path, "1f1b", 100.0, 0.0)
    doc = json.loads(path.read_text())
    ops = [e for e in doc["traceEvents"] if e.get("ph") == "X" and e.get("cat") in "FIWB"]
    # figures beyond the 1e9 us any plan accepts, from times a trace may hold
    sane = calibrate(plan, PROFILE, path)
    assert within_cluster_ranges(sane, path) is sane
    with pytest.raises(InputError, match="imply op_overhead_us 2e\\+09, beyond the 1e\\+09 any plan accepts"):
        within_cluster_ranges(replace(sane, gap_ms=2e6, excess_ms=0.0), path)
    with pytest.raises(InputError, match="imply latency_us 3e\\+09"):
        within_cluster_ranges(replace(sane, latency_ms=3e6), path)
    last = ops[-1]
    last["ts"] = 1e300  # no clock reads that
    path.write_text(json.dumps(doc))
    with pytest.raises(InputError, match=r"traceEvents\[\d+\]\.ts: of op \S+ is 1e\+300 us, more than 1e\+12"):
        calibrate(plan, PROFILE, path)
    # JSON's integers have no bound: one past a float's range, one past Python's digit limit
    last["ts"] = 10**400
    path.write_text(json.dumps(doc))
    with pytest.raises(InputError, match=r"\.ts: of op \S+ is a 401-digit number of us, more than 1e\+12"):
        calibrate(plan, PROFILE, path)
    path.write_text(json.dumps(doc).replace("1" + "0" * 400, "1" + "0" * 5000))
    with pytest.raises(InputError, match="cannot be read: Exceeds the limit"):
        calibrate(plan, PROFILE, path)


def test_an_octorun_trace_of_another_model_or_holding_an_op_twice_is_bad_input(tmp_path):
    """octorun's trace names the model it ran and holds one step: one of another model with the
    same ops, or one whose events are each written twice, is no run of this plan (calibrate read
    the first as figures and the second as two steps)."""
    plan, path = _simulated_trace(tmp_path, "1f1b", 100.0, 0.0)
    doc = json.loads(path.read_text())
    doc["otherData"] = {"source": "octorun", "model": "another-model", "replay_time_scale": None}
    path.write_text(json.dumps(doc))
    with pytest.raises(InputError) as caught:
        calibrate(plan, PROFILE, path)
    assert (caught.value.field, caught.value.problem) == ("otherData.model", "is 'another-model', and the plan's "
                                                          f"model is {plan.model.name!r}")
    doc["otherData"]["model"] = plan.model.name
    path.write_text(json.dumps(doc))
    calibrate(plan, PROFILE, path)
    doc["traceEvents"] += [event for event in doc["traceEvents"] if event.get("ph") == "X"]
    path.write_text(json.dumps(doc))
    with pytest.raises(InputError, match="op 0F0 appears twice in one step"):
        calibrate(plan, PROFILE, path)
    from octoplan.timeline.trace import compare_measured  # show --measured

    with pytest.raises(InputError, match="appears twice in step 0"):
        compare_measured(plan, simulate(plan, PROFILE), path)


def test_a_trace_of_another_plan_is_bad_input(tmp_path):
    plan, _ = _simulated_trace(tmp_path, "1f1b", 100.0, 0.0)
    other = make_baseline(PROFILE, schedule="1f1b", gpus=4, microbatches=2, cluster=plan.cluster)
    path = tmp_path / "other.json"
    write_trace(plan, simulate(plan, PROFILE), path)
    with pytest.raises(InputError, match="not in the plan"):
        calibrate(other, PROFILE, path)


def test_cli_prints_the_flags_and_the_table(tmp_path, profile_file):
    ppath = profile_file(PROFILE)
    cluster = Cluster(gpus=4, latency_us=300.0, op_overhead_us=150.0, intra_node_gbps=1e12)
    plan = make_baseline(PROFILE, schedule="1f1b", gpus=4, microbatches=8, cluster=cluster, profile_path=ppath)
    plan_path, trace = tmp_path / "plan.yaml", tmp_path / "t.json"
    save_plan(plan, plan_path)
    write_trace(plan, simulate(plan, PROFILE), trace)
    runner = CliRunner()
    flags = runner.invoke(app, ["calibrate", str(plan_path), str(trace), "--flags"])
    assert flags.exit_code == 0, flags.output
    assert flags.output == "--latency-us 300 --op-overhead-us 150\n"
    table = runner.invoke(app, ["calibrate", str(plan_path), str(trace)], terminal_width=140)
    assert table.exit_code == 0, table.output
    assert "latency / transfer" in table.output and "plan with: --latency-us 300 --op-overhead-us 150" in table.output
    trace.write_text("{not json")
    bad = runner.invoke(app, ["calibrate", str(plan_path), str(trace)])
    assert bad.exit_code == 2
    assert bad.output.count("\n") == 1 and "is not JSON" in bad.output and str(trace) in bad.output


def _move_runtime_after_ops(path, cut_us: float) -> None:
    """octorun times an op's compute only: its runtime work (posting sends, taking the next
    input) comes after the op's end. Shorten every op by ``cut_us`` of the simulated per-op
    cost, which then falls in the gap after it, as in a measured trace."""
    doc = json.loads(path.read_text())
    for event in doc["traceEvents"]:
        if event.get("ph") == "X" and event.get("cat") in ("F", "I", "W", "B"):
            event["dur"] -= cut_us
    path.write_text(json.dumps(doc))


def test_runtime_time_after_the_ops_is_not_counted_twice(tmp_path):
    # per op 700 us, of which 400 after the op's end: every gap is 400 us, every wait is the
    # producer's 400 us plus the 300 us latency, and the figures come back as simulated
    plan, path = _simulated_trace(tmp_path, "zb-h1", 300.0, 700.0)
    _move_runtime_after_ops(path, 400.0)
    cal = calibrate(plan, PROFILE, path)
    assert cal.gap_ms == pytest.approx(0.4, abs=1e-9)
    assert cal.excess_ms == pytest.approx(0.3, abs=1e-9)
    assert cal.latency_ms == pytest.approx(0.3, abs=1e-9)
    assert cal.flags() == "--latency-us 300 --op-overhead-us 700"
    # and the plan simulated with those figures reproduces the trace's iteration
    split = split_trace(plan, PROFILE, path)
    assert simulate(plan, PROFILE).iteration_ms == pytest.approx(split.iteration_ms + 0.4, abs=1e-6)
    assert all(o.transfer_ms == pytest.approx(0.7, abs=1e-9) for o in split.ops if o.transfer_ms is not None)


def test_data_parallel_replicas_pair_within_their_pipeline(tmp_path):
    plan, path = _simulated_trace(tmp_path, "1f1b", 500.0, 100.0)
    plan = replace(plan, cluster=replace(plan.cluster, gpus=8), parallel=replace(plan.parallel, dp=2))  # its 2 replicas
    doc = json.loads(path.read_text())
    ops = [e for e in doc["traceEvents"] if e.get("ph") == "X" and e.get("cat") in ("F", "B")]
    for event in ops:  # replica 1 runs 3 ms later than replica 0: pairing across them would show it
        doc["traceEvents"].append({**event, "pid": event["pid"] + 1, "ts": event["ts"] + 3000.0})
    path.write_text(json.dumps(doc))
    cal = calibrate(plan, PROFILE, path)
    assert cal.latency_ms == pytest.approx(0.5, abs=1e-9)
    assert cal.counts["ops"] == 2 * len(ops) and cal.counts["pairs"] == 6


@pytest.mark.parametrize("case,message", [
    ("other placement", "the plan puts stage"),
    ("fused plan", "not in the plan's schedule"),
    ("op twice", "appears twice in one step"),
    ("one rank", "one pipeline rank only"),
    ("bigger plan", "holds 96 of the plan's 192 ops"),
    ("overlapping ops", "starts before op"),
])
def test_traces_that_do_not_match_the_plan_are_bad_input(tmp_path, case, message):
    plan, path = _simulated_trace(tmp_path, "zb-h1", 300.0, 0.0)
    doc = json.loads(path.read_text())
    ops = [e for e in doc["traceEvents"] if e.get("ph") == "X" and e.get("cat") in ("F", "I", "W")]
    if case == "other placement":  # the same stages and microbatches, ranks reversed
        other = make_baseline(PROFILE, schedule="zb-h1", gpus=4, microbatches=8, cluster=plan.cluster)
        for event in ops:
            event["tid"] = 3 - event["tid"]
    elif case == "fused plan":
        other = make_baseline(PROFILE, schedule="1f1b", gpus=4, microbatches=8, cluster=plan.cluster)
    elif case == "op twice":
        other = plan
        for event in ops:  # one step, said so, and an op of it twice (two steps concatenated)
            event["args"] = {"step": 0}
        doc["traceEvents"].append({**ops[5], "ts": ops[5]["ts"] + 1e6})
    elif case == "overlapping ops":  # every op at time 0: no rank can have run them
        other = plan
        for event in ops:
            event["ts"] = 0.0
    elif case == "bigger plan":  # every op of the trace is in it, on the same rank, but half of its ops are not in the trace
        other = make_baseline(PROFILE, schedule="zb-h1", gpus=4, microbatches=16, cluster=plan.cluster)
    else:
        other = plan
        doc["traceEvents"] = [e for e in doc["traceEvents"] if e.get("tid") == 1 or e.get("ph") != "X"]
    path.write_text(json.dumps(doc))
    with pytest.raises(InputError, match=message):
        calibrate(other, PROFILE, path)


def test_a_single_rank_plan_is_bad_input(tmp_path):
    cluster = Cluster(gpus=1, latency_us=0.0)
    plan = make_baseline(PROFILE, schedule="1f1b", gpus=1, microbatches=2, cluster=cluster)
    path = tmp_path / "one.json"
    write_trace(plan, simulate(plan, PROFILE), path)
    with pytest.raises(InputError, match="nothing is sent between ranks") as caught:
        calibrate(plan, PROFILE, path, plan_path=tmp_path / "one.yaml")
    assert (caught.value.file, caught.value.field) == (str(tmp_path / "one.yaml"), "parallel.pp")  # the plan's, not the trace's


def test_the_trace_of_more_replicas_than_the_plan_has_is_refused(tmp_path):
    """A pp 4 x dp 2 run's trace read against a pp 4 plan: the same ops on the same pipeline
    ranks, twice. Its waits and the "plan has" column would be the other plan's."""
    plan, path = _simulated_trace(tmp_path, "1f1b", 300.0, 150.0)
    doc = json.loads(path.read_text())
    ops = [e for e in doc["traceEvents"] if e.get("ph") == "X" and e.get("cat") in "FIWB"]
    doc["traceEvents"] += [{**e, "pid": 7} for e in ops]  # a second replica, as octorun writes one
    path.write_text(json.dumps(doc))
    with pytest.raises(InputError, match="holds the ops of 2 data-parallel replicas \\(processes\\), but the plan has dp 1"):
        calibrate(plan, PROFILE, path)
