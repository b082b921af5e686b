"""Forward-backward justification of an op order (octoplan.schedules.justify)."""

from __future__ import annotations

from hypothesis import given, settings

from octoplan.baseline import make_baseline
from octoplan.costs import LayerTable, stage_costs
from octoplan.ops import parse_ops
from octoplan.plan import Parallel, Plan, Stage, check_structure
from octoplan.schedules.justify import justify
from octoplan.schedules.opgraph import most_in_flight
from octoplan.schedules.policy import policy_schedule
from octoplan.simulator import simulate, simulate_costs
from tests.conftest import free_cluster, make_profile
from tests.test_tuner_policy import placements


def assert_microbatch_order(schedule):
    """Each stage runs each kind (F; I or B; W) in microbatch order."""
    for rank_ops in schedule:
        for stage in {op.stage for op in rank_ops}:
            for kinds in ("F", "IB", "W"):
                mbs = [op.mb for op in rank_ops if op.stage == stage and op.kind.value in kinds]
                assert mbs == sorted(mbs)


def _plan(profile, cluster, parallel, stages, schedule):
    return Plan(model=profile.model, cluster=cluster, parallel=parallel, stages=stages,
                schedule=tuple(tuple(ops) for ops in schedule))


def _layer_per_stage(times, ranks, microbatches, orders):
    """Layers of ``times`` (F, I, W ms), layer i the stage on rank ``ranks[i]``, free
    communication, and each rank's order parsed: (profile, cluster, parallel, stages,
    schedule, stage costs)."""
    profile, pp = make_profile(times), max(ranks) + 1
    stages = tuple(Stage(i, i + 1, rank) for i, rank in enumerate(ranks))
    return (profile, free_cluster(pp), Parallel(pp=pp, microbatches=microbatches), stages,
            [parse_ops(order) for order in orders], stage_costs(stages, LayerTable(profile)))


def test_a_w_that_blocks_a_forward_moves_out_of_its_way():
    # 2 ranks, 1 stage each, 2 microbatches, F = I = W = 1 ms. Rank 1 runs 1W0 before 1F1,
    # although 1F1's input is there at t=2: 1F1 waits until 4, 1I1 ends at 6, and rank 0's
    # 0I1, 0W1 end at 8. Rank 1 has 6 ms of work from t=1, so 7 is optimal: justification
    # defers 1W0 behind 1F1 and 1I1.
    profile, cluster, parallel, stages, schedule, costs = _layer_per_stage(
        [(1, 1, 1), (1, 1, 1)], (0, 1), 2, ["0F0 0F1 0I0 0W0 0I1 0W1", "1F0 1I0 1W0 1F1 1I1 1W1"])
    assert simulate(_plan(profile, cluster, parallel, stages, schedule), profile).iteration_ms == 8.0
    # deferring 1W0 keeps two microbatches in flight on stage 1, where the order held one
    kept, kept_span = justify(schedule, (0, 1), costs, cluster=cluster, parallel=parallel)
    assert kept_span == 8.0
    new, span = justify(schedule, (0, 1), costs, cluster=cluster, parallel=parallel, keep_memory=False)
    assert span == 7.0
    assert simulate(_plan(profile, cluster, parallel, stages, new), profile).iteration_ms == 7.0
    rank1 = [str(op) for op in new[1]]
    assert rank1.index("1W0") > rank1.index("1F1")


def test_a_tight_order_is_returned_unchanged():
    # 1F1B on uniform stages has no gap that any op fits in better: same order, same time
    profile = make_profile([(1, 2, 0)] * 4)
    base = make_baseline(profile, schedule="1f1b", gpus=4, microbatches=8, cluster=free_cluster(4))
    costs = stage_costs(base.stages, LayerTable(profile))
    new, span = justify(base.schedule, [s.rank for s in base.stages], costs, cluster=base.cluster,
                        parallel=base.parallel)
    assert span == simulate(base, profile).iteration_ms == (8 + 3) * 3.0
    assert [list(ops) for ops in new] == [list(ops) for ops in base.schedule]


def test_releases_out_of_microbatch_order_keep_memory_without_a_cycle():
    # One stage that splits microbatch 0's backward and fuses microbatch 1's: 0B1 frees
    # microbatch 1 before 0W0 frees microbatch 0, and 0F2 runs between them with 2 in flight.
    # F(2) may wait for the order's first release (0B1), not for microbatch 0's (0W0, which
    # comes after it: a cycle, which used to make justification refuse the order).
    profile, cluster, parallel, stages, schedule, costs = _layer_per_stage([(1, 1, 1)], (0,), 3, ["0F0 0F1 0I0 0B1 0F2 0W0 0B2"])
    assert most_in_flight(schedule) == {0: 2}
    new, span = justify(schedule, (0,), costs, cluster=cluster, parallel=parallel)
    assert span == 9.0  # one rank: all of its work, 3 F + I + W + 2 B
    assert most_in_flight(new) == {0: 2}
    assert simulate(_plan(profile, cluster, parallel, stages, new), profile).iteration_ms == 9.0


def test_releases_out_of_order_that_no_forward_waits_for_may_be_reordered():
    # Stage 0 (rank 1) releases microbatch 1 with 0B1 before microbatch 0 with 0W0, but with
    # 2 in flight and 2 microbatches no forward waits for a release: justification is free to
    # run 0W0 first, which lets rank 0's 1B1 start sooner (43 -> 40 ms), within the same memory.
    profile, cluster, parallel, stages, schedule, costs = _layer_per_stage(
        [(5, 4, 3), (4, 5, 5)], (1, 0), 2, ["1F0 1B0 1F1 1B1", "0F0 0F1 0I0 0B1 0W0"])
    assert simulate(_plan(profile, cluster, parallel, stages, schedule), profile).iteration_ms == 43.0
    new, span = justify(schedule, (1, 0), costs, cluster=cluster, parallel=parallel)
    assert span == 40.0 and [str(op) for op in new[1]] == ["0F0", "0F1", "0I0", "0W0", "0B1"]
    assert most_in_flight(new) == most_in_flight(schedule) == {1: 1, 0: 2}


def heavy_head_profile():
    """Like deepseek-v3: a light embedding, six middle layers, a heavy head and short Ws."""
    return make_profile([(1, 1, 0)] + [(2, 2, 1)] * 6 + [(3, 3, 2)], act=10**6)


def heavy_head_zbv():
    """:func:`heavy_head_profile` and its ZB-V plan on 4 ranks, 8 microbatches, free transfers."""
    profile = heavy_head_profile()
    return profile, make_baseline(profile, schedule="zbv", gpus=4, microbatches=8, cluster=free_cluster(4))


def test_zbv_with_a_heavy_head_gets_faster():
    # ZB-V's hand-written order assumes equal stages and W as long as F; here (like
    # deepseek-v3) the embedding is light, the head heavy and W short. Rank 0 holds the
    # embedding and the head: 10 ms per microbatch, so no order beats 8 x 10 = 80 ms. ZB-V's
    # order takes 95 ms. Justified with each stage's microbatches in flight kept, 88 ms; free
    # to hold more, 85 ms. The simulator, not the model, is the judge of both.
    profile, zbv = heavy_head_zbv()
    costs = stage_costs(zbv.stages, LayerTable(profile))
    before = simulate(zbv, profile)
    assert before.iteration_ms == 95.0
    ranks = [s.rank for s in zbv.stages]
    kept, kept_span = justify(zbv.schedule, ranks, costs, cluster=zbv.cluster, parallel=zbv.parallel)
    free, free_span = justify(zbv.schedule, ranks, costs, cluster=zbv.cluster, parallel=zbv.parallel,
                              keep_memory=False)
    assert (kept_span, free_span) == (88.0, 85.0)
    kept_run, free_run = simulate(zbv.with_schedule(kept), profile), simulate(zbv.with_schedule(free), profile)
    assert (kept_run.iteration_ms, free_run.iteration_ms) == (88.0, 85.0)
    # ZB-V holds 8 microbatches' activations (1 MB each) at its peak on every rank; kept,
    # each stage holds no more than it did, but a rank's two stages now peak together
    assert max(before.peak_memory_bytes) == 8 * 10**6
    assert max(kept_run.peak_memory_bytes) == 9 * 10**6
    assert max(free_run.peak_memory_bytes) == 11 * 10**6
    assert all(most_in_flight(kept)[s] <= n for s, n in most_in_flight(zbv.schedule).items())


@settings(max_examples=100, deadline=None)
@given(placements())
def test_justified_orders_are_valid_and_never_slower(case):
    pp, ranks, microbatches, policies, times, _ = case
    profile = make_profile(times, act=1000, out=1000, params=1000)
    cluster = free_cluster(pp)
    parallel = Parallel(pp=pp, microbatches=microbatches)
    stages = tuple(Stage(s, s + 1, r) for s, r in enumerate(ranks))
    costs = stage_costs(stages, LayerTable(profile))
    ops = policy_schedule(ranks, costs, microbatches=microbatches, policies=policies, cluster=cluster, parallel=parallel)
    before = simulate_costs(_plan(profile, cluster, parallel, stages, ops), costs).iteration_ms
    for keep_memory in (True, False):
        new, span = justify(ops, ranks, costs, cluster=cluster, parallel=parallel, keep_memory=keep_memory)
        if keep_memory:  # no stage holds more microbatches in flight than the given order did
            assert all(most_in_flight(new)[s] <= n for s, n in most_in_flight(ops).items())
        plan = _plan(profile, cluster, parallel, stages, new)
        check_structure(plan, num_layers=profile.num_layers)  # every op once, on its rank, I before W
        after = simulate_costs(plan, costs).iteration_ms  # raises DeadlockError on a cycle
        # without transfer costs the model is the simulator's; justification keeps the better order
        assert abs(after - span) <= 1e-9 * max(1.0, span)
        assert after <= before + 1e-9 * max(1.0, before)
        assert_microbatch_order(new)


def heavy_head_zbv_file(profile_file, tmp_path):
    """The ZB-V plan file of the deepseek-like profile above, written by `octoplan baseline` for
    a cluster whose transfers cost nothing (95 ms)."""
    from typer.testing import CliRunner

    from octoplan.cli import app

    path = profile_file(heavy_head_profile())
    free = ["--latency-us", "0", "--intra-node-gbps", "1e12", "--inter-node-gbps", "1e12"]
    zbv = tmp_path / "zbv.yaml"
    made = CliRunner().invoke(app, ["baseline", str(path), "--gpus", "4", "--schedule", "zbv", "--microbatches", "8",
                                    *free, "-o", str(zbv)])
    assert made.exit_code == 0, made.output
    return zbv


def test_cli_justify_writes_the_faster_order(profile_file, tmp_path):
    from typer.testing import CliRunner

    from octoplan.cli import app
    from octoplan.plan import load_plan

    runner = CliRunner()
    zbv = heavy_head_zbv_file(profile_file, tmp_path)
    kept, unbounded = tmp_path / "kept.yaml", tmp_path / "free.yaml"
    assert load_plan(zbv).predicted["iteration_ms"] == 95.0
    result = runner.invoke(app, ["justify", str(zbv), "-o", str(kept)])
    assert result.exit_code == 0, result.output
    assert "justified order written" in result.output
    assert load_plan(kept).predicted["iteration_ms"] == 88.0
    assert runner.invoke(app, ["justify", str(zbv), "--unbounded-in-flight", "-o", str(unbounded)]).exit_code == 0
    assert load_plan(unbounded).predicted["iteration_ms"] == 85.0
    assert runner.invoke(app, ["validate", str(unbounded)]).exit_code == 0
    # a tight order stays as it is
    again = runner.invoke(app, ["justify", str(unbounded), "-o", str(tmp_path / "again.yaml")])
    assert again.exit_code == 0 and "unchanged" in again.output
    # bad input: exit 2, one line naming the file
    missing = runner.invoke(app, ["justify", str(tmp_path / "nope.yaml"), "-o", str(tmp_path / "x.yaml")])
    assert missing.exit_code == 2


def test_a_plan_whose_stage_takes_microbatches_out_of_order_is_refused_in_one_line(profile_file, tmp_path):
    """Such a plan runs (octorun keeps any order), but justify and bound keep each stage's
    microbatches in order: one line naming the op, not a traceback or a false cycle."""
    import yaml
    from typer.testing import CliRunner

    from octoplan.cli import app

    zbv = heavy_head_zbv_file(profile_file, tmp_path)
    data = yaml.safe_load(zbv.read_text())
    ops = data["schedule"][0].split()
    first, second = ops.index("0F0"), ops.index("0F1")
    ops[first], ops[second] = "0F1", "0F0"
    data["schedule"][0] = " ".join(ops)
    swapped = tmp_path / "swapped.yaml"
    swapped.write_text(yaml.safe_dump(data, sort_keys=False))
    runner = CliRunner()
    assert runner.invoke(app, ["validate", str(swapped)]).exit_code == 0
    said = f"{swapped}: schedule: cannot be %s: rank 0 runs 0F1 before 0F0: microbatch 1 of stage 0 before microbatch 0"
    for command, verb in ((["justify", str(swapped), "-o", str(tmp_path / "j.yaml")], "justified"),
                          (["justify", str(swapped), "--reorder", "-o", str(tmp_path / "j.yaml")], "justified"),
                          (["bound", str(swapped), "--time-limit", "1"], "bounded")):
        result = runner.invoke(app, command)
        assert result.exit_code == 2, result.output
        assert said % verb in result.stderr and result.stderr.count("\n") == 1, result.stderr
    assert not (tmp_path / "j.yaml").exists()
