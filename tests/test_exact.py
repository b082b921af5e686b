"""CP-SAT's bound on a layout's best op order (octoplan.schedules.exact, `octoplan bound`)."""

from __future__ import annotations

import json

from hypothesis import given, settings

from octoplan.arch import analytic_profile
from octoplan.baseline import make_baseline
from octoplan.costs import LayerTable, stage_costs
from octoplan.ops import parse_ops
from octoplan.plan import Cluster, Parallel, Stage, check_structure
from octoplan.schedules.exact import one_machine_bound, order_bound, rank_bounds
from octoplan.schedules.justify import justify
from octoplan.schedules.opgraph import OpGraph, most_in_flight
from octoplan.simulator import simulate, simulate_costs
from tests.conftest import free_cluster, make_profile
from tests.test_justify import _plan, assert_microbatch_order, heavy_head_zbv, heavy_head_zbv_file
from tests.test_tuner_policy import costly_policy_order, placements


def test_the_two_rank_case_is_solved_to_its_optimum():
    # test_justify's case: F = I = W = 1 ms, 2 ranks, 2 microbatches; the given order takes 8.
    # Rank 1 has 6 ms of work from t = 1, so 7 is optimal; holding one microbatch per stage
    # (1W0 before 1F1), 8 is.
    profile = make_profile([(1, 1, 1), (1, 1, 1)])
    cluster, parallel = free_cluster(2), Parallel(pp=2, microbatches=2)
    stages = (Stage(0, 1, 0), Stage(1, 2, 1))
    schedule = [parse_ops("0F0 0F1 0I0 0W0 0I1 0W1"), parse_ops("1F0 1I0 1W0 1F1 1I1 1W1")]
    costs = stage_costs(stages, LayerTable(profile))
    kept = order_bound(schedule, (0, 1), costs, cluster=cluster, parallel=parallel)
    assert (kept.status, kept.given_ms, kept.best_ms, kept.lower_bound_ms) == ("OPTIMAL", 8.0, 8.0, 8.0)
    assert kept.order == tuple(tuple(ops) for ops in schedule) and kept.gap == 0.0
    free = order_bound(schedule, (0, 1), costs, cluster=cluster, parallel=parallel, keep_memory=False)
    assert (free.status, free.given_ms, free.best_ms, free.lower_bound_ms) == ("OPTIMAL", 8.0, 7.0, 7.0)
    assert free.gap == 1 / 8
    assert simulate(_plan(profile, cluster, parallel, stages, free.order), profile).iteration_ms == 7.0


def test_1f1b_on_uniform_stages_is_proven_optimal():
    # F = 1, B = 2 on 4 ranks, 8 microbatches. No order beats (m + p - 1)(F + B) = 33: the last
    # rank starts at 3 (the forward chain), has 8 x 3 ms of work, and its last B still has to
    # travel back through 3 ranks (6 ms). 1F1B takes exactly that.
    profile = make_profile([(1, 2, 0)] * 4)
    base = make_baseline(profile, schedule="1f1b", gpus=4, microbatches=8, cluster=free_cluster(4))
    costs = stage_costs(base.stages, LayerTable(profile))
    result = order_bound(base.schedule, [s.rank for s in base.stages], costs, cluster=base.cluster,
                         parallel=base.parallel, keep_memory=False)
    assert (result.status, result.given_ms, result.best_ms, result.lower_bound_ms) == ("OPTIMAL", 33.0, 33.0, 33.0)


def test_justification_reaches_the_optimum_on_zbv_with_a_heavy_head():
    # test_justify's deepseek-like ZB-V (95 ms). Rank 0 holds the embedding stage (F 1) and the
    # head stage (3 + 3 + 2): 80 ms of work. Its first head forward waits for microbatch 0 to
    # cross the 7 stages before (1 + 6 x 2 = 13 ms) while only 8 embedding forwards (8 ms) can
    # run, so no order beats 80 + 13 - 8 = 85, which justification without the in-flight bound
    # reaches. With it, CP-SAT proves justification's 88 optimal as well.
    profile, zbv = heavy_head_zbv()
    costs = stage_costs(zbv.stages, LayerTable(profile))
    ranks = [s.rank for s in zbv.stages]
    kw = dict(cluster=zbv.cluster, parallel=zbv.parallel)
    for keep, optimum in ((True, 88.0), (False, 85.0)):
        result = order_bound(zbv.schedule, ranks, costs, keep_memory=keep, time_limit_s=60, **kw)
        assert (result.status, result.given_ms, result.best_ms, result.lower_bound_ms) == ("OPTIMAL", 95.0, optimum, optimum)
        assert justify(zbv.schedule, ranks, costs, keep_memory=keep, **kw)[1] == optimum
        assert simulate(zbv.with_schedule(result.order), profile).iteration_ms == optimum
        if keep:
            assert all(most_in_flight(result.order)[s] <= n for s, n in most_in_flight(zbv.schedule).items())


@settings(max_examples=40, deadline=None)
@given(placements())
def test_the_bound_holds_and_the_orders_found_are_valid(case):
    ranks = case[1]
    profile, cluster, parallel, stages, costs, ops = costly_policy_order(case)
    given_run = simulate_costs(_plan(profile, cluster, parallel, stages, ops), costs).iteration_ms
    for keep in (True, False):
        result = order_bound(ops, ranks, costs, cluster=cluster, parallel=parallel, keep_memory=keep, time_limit_s=10)
        assert result.lower_bound_ms <= result.best_ms <= result.given_ms
        assert result.lower_bound_ms <= given_run + 1e-9
        plan = _plan(profile, cluster, parallel, stages, result.order)
        check_structure(plan, num_layers=profile.num_layers)  # every op once, on its rank, I before W
        found_run = simulate_costs(plan, costs).iteration_ms  # raises DeadlockError on a cycle
        assert result.lower_bound_ms <= found_run + 1e-9
        if keep:
            assert all(most_in_flight(result.order)[s] <= n for s, n in most_in_flight(ops).items())
        if result.status == "OPTIMAL":  # justification can do no better than the optimum
            span = justify(ops, ranks, costs, cluster=cluster, parallel=parallel, keep_memory=keep)[1]
            assert span >= result.best_ms - 1e-9
        assert_microbatch_order(result.order)


def test_cli_bound_reports_and_writes_the_best_order(profile_file, tmp_path):
    from typer.testing import CliRunner

    from octoplan.cli import app
    from octoplan.plan import load_plan

    runner = CliRunner()
    zbv, best = heavy_head_zbv_file(profile_file, tmp_path), tmp_path / "best.yaml"
    result = runner.invoke(app, ["bound", str(zbv), "--unbounded-in-flight", "-o", str(best)])
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())  # rich wraps its lines
    assert ("could save at most 10.53% of PLAN's 95.000 ms among any order (bound by the one-machine relaxation; "
            "CP-SAT OPTIMAL") in said
    # which rank the bound is, and where there is room (the per-rank figures of the test below)
    assert ("the one-machine relaxation's 85.000 ms is rank 0's: its first op cannot start before 0.000 ms, it runs "
            "80.000 ms of ops, and the dataflow forces 5.000 ms of waiting on it; next: rank 3 85.000 ms, rank 2 83.000 "
            "ms; most room: rank 1, 4.000 ms under it") in said
    # and what no cut of its V can beat: rank 3 starts after the first 3 layers' forwards (5 ms)
    # and works 8 x 10; rank 0 waits 13 ms for the head's first input with 8 ms of embedding
    # forwards to run, then has 8 x 9 left: 85 ms either way, which the order above reaches
    assert ("no layout of a V of 2 stages per rank, as PLAN places its stages (any cut points) runs faster than "
            "85.000 ms once the pipeline's fill is counted, an efficiency of at most 0.941 (proven); PLAN's 95.000 ms "
            "is 0.842") in said
    assert load_plan(best).predicted["iteration_ms"] == 85.0
    assert runner.invoke(app, ["validate", str(best)]).exit_code == 0
    as_json = runner.invoke(app, ["bound", str(zbv), "--json"])
    assert as_json.exit_code == 0, as_json.output
    figures = json.loads(as_json.output)
    assert (figures["iteration_ms"], figures["best_found_iteration_ms"], figures["lower_bound_ms"]) == (95.0, 88.0, 88.0)
    assert (figures["status"], figures["in_flight"], figures["relaxation_ms"]) == ("OPTIMAL", "plan's", 88.0)
    by_rank = figures["relaxation_by_rank"]
    assert [row["rank"] for row in by_rank] == [0, 1, 2, 3]
    assert max(row["bound_ms"] for row in by_rank) == figures["relaxation_ms"]
    assert [row["busy_ms"] for row in by_rank] == [80.0] * 4  # each rank's F + I + W, whatever the memory
    assert (figures["placement_cap_ms"], figures["placement_cap_found_ms"]) == (85.0, 85.0)
    again = runner.invoke(app, ["bound", str(best), "--unbounded-in-flight"])
    said = " ".join(again.output.split())
    assert again.exit_code == 0 and "PLAN's order is optimal among any order (proven by the one-machine relaxation" in said
    # bad input: exit 2, one line naming the field or the file
    for args in (["--time-limit", "0"], ["--workers", "0"]):
        bad = runner.invoke(app, ["bound", str(zbv), *args])
        assert bad.exit_code == 2 and args[0] in bad.output and len(bad.output.strip().splitlines()) == 1
    missing = runner.invoke(app, ["bound", str(tmp_path / "nope.yaml")])
    assert missing.exit_code == 2 and "nope.yaml" in missing.output


def test_the_one_machine_relaxation_gives_the_hand_computed_bounds():
    # Without CP-SAT: each rank alone, its ops released at their heads and followed by their
    # tails. 1F1B on uniform stages: the last rank's first F has a head of 3, its 24 ms of work
    # follow, and its last B a tail of 3 x 2 ms, so 33 (the optimum above).
    profile = make_profile([(1, 2, 0)] * 4)
    base = make_baseline(profile, schedule="1f1b", gpus=4, microbatches=8, cluster=free_cluster(4))
    costs = stage_costs(base.stages, LayerTable(profile))
    graph = OpGraph(base.schedule, [s.rank for s in base.stages], costs, base.cluster, base.parallel, keep_memory=False)
    assert one_machine_bound(graph, 4) == 33.0
    # per rank: rank r's first F comes after r forwards; its 8 F run back to back (released one
    # a ms), then its 8 B, and its last B has r more B of 2 ms after it on the ranks before it.
    # Rank 0 instead idles from 8 to 10 ms: its first B comes back after 3 F and 3 B elsewhere.
    assert [(b.rank, b.first_start_ms, b.busy_ms, b.bound_ms) for b in rank_bounds(graph, 4)] == [
        (0, 0.0, 24.0, 26.0), (1, 1.0, 24.0, 27.0), (2, 2.0, 24.0, 30.0), (3, 3.0, 24.0, 33.0)]
    assert [b.forced_wait_ms for b in rank_bounds(graph, 4)] == [2.0, 2.0, 4.0, 6.0]
    # the heavy-head ZB-V: rank 0's head forwards are released at 13, when only 8 ms of its
    # embedding forwards can have run: 85; with the in-flight limits as edges, 88
    profile, zbv = heavy_head_zbv()
    costs = stage_costs(zbv.stages, LayerTable(profile))
    ranks = [s.rank for s in zbv.stages]
    for keep, bound in ((False, 85.0), (True, 88.0)):
        assert one_machine_bound(OpGraph(zbv.schedule, ranks, costs, zbv.cluster, zbv.parallel, keep), 4) == bound
    # without the limits the bound is rank 0's (its head forwards) and rank 3's alike
    unlimited = rank_bounds(OpGraph(zbv.schedule, ranks, costs, zbv.cluster, zbv.parallel, False), 4)
    assert [(b.bound_ms, b.first_start_ms, b.busy_ms) for b in unlimited] == [
        (85.0, 0.0, 80.0), (81.0, 1.0, 80.0), (83.0, 3.0, 80.0), (85.0, 5.0, 80.0)]
    # so these bounds need no search: with 1 ms for CP-SAT the bound still proves the order optimal
    result = order_bound(zbv.schedule, ranks, costs, cluster=zbv.cluster, parallel=zbv.parallel, keep_memory=False,
                         time_limit_s=1e-3)
    assert result.lower_bound_ms == 85.0
    # and an order that meets the relaxation (justification's, 85 ms) is optimal without any search
    justified, _ = justify(zbv.schedule, ranks, costs, cluster=zbv.cluster, parallel=zbv.parallel, keep_memory=False)
    optimal = order_bound(justified, ranks, costs, cluster=zbv.cluster, parallel=zbv.parallel, keep_memory=False,
                          time_limit_s=1e-3)
    assert (optimal.status, optimal.given_ms, optimal.best_ms, optimal.lower_bound_ms) == ("OPTIMAL", 85.0, 85.0, 85.0)


def test_cp_sat_starts_from_the_given_order_on_a_plan_of_thousands_of_ops():
    # jamba-v0.1's ZB-V on 16 ranks, 16 microbatches: 1,536 ops, and its order is 4% above the
    # relaxation. CP-SAT must take the given order as its first solution (status FEASIBLE, an
    # order returned) within a second or two; with an incomplete hint (the makespan left out)
    # it returned UNKNOWN and no order after 3 s on this plan.
    profile = analytic_profile("jamba-v0.1", "h200", tp=2, split_blocks=True)
    cluster = Cluster(gpus=16, gpus_per_node=8, memory_gb=141)
    zbv = make_baseline(profile, schedule="zbv", gpus=16, microbatches=16, partition_method="balanced", cluster=cluster)
    costs = stage_costs(zbv.stages, LayerTable(profile))
    assert sum(map(len, zbv.schedule)) == 1536
    result = order_bound(zbv.schedule, [s.rank for s in zbv.stages], costs, cluster=zbv.cluster,
                         parallel=zbv.parallel, time_limit_s=2.0)
    assert result.status in ("FEASIBLE", "OPTIMAL")
    assert result.lower_bound_ms <= result.best_ms <= result.given_ms
    assert result.lower_bound_ms < result.given_ms  # not proven optimal without a search


def test_cli_bound_says_when_its_time_leaves_the_placement_without_a_cap(profile_file, tmp_path, monkeypatch):
    # where CP-SAT finds no cut points in its time (its presolve alone takes about a
    # deterministic second on 32 stages), bound says so and the JSON's caps are null
    from typer.testing import CliRunner

    import octoplan.tuner.fill_caps
    from octoplan.cli import app

    monkeypatch.setattr(octoplan.tuner.fill_caps, "fill_cap", lambda *args, **kwargs: None)
    runner = CliRunner()
    zbv = heavy_head_zbv_file(profile_file, tmp_path)
    figures = json.loads(runner.invoke(app, ["bound", str(zbv), "--json"]).output)
    assert figures["placement_cap_ms"] is None and figures["placement_cap_found_ms"] is None
    result = runner.invoke(app, ["bound", str(zbv), "--time-limit", "0.5"])
    assert result.exit_code == 0, result.output
    assert ("CP-SAT found no cut points for PLAN's placement within --time-limit (0.5 deterministic s); a longer one "
            "lets it bound every layout with that placement") in " ".join(result.output.split())


def test_cli_bound_of_a_plan_whose_ops_take_no_time(profile_file, tmp_path):
    """A profile of zeros is a valid profile: its plan is optimal, with nothing to divide by."""
    from typer.testing import CliRunner

    from octoplan.cli import app
    from octoplan.plan import save_plan

    path = profile_file(make_profile([(0, 0, 0)] * 4))
    plan = tmp_path / "zero.yaml"
    save_plan(make_baseline(make_profile([(0, 0, 0)] * 4), schedule="1f1b", gpus=2, microbatches=4,
                            cluster=free_cluster(2), profile_path=path), plan)
    result = CliRunner().invoke(app, ["bound", str(plan), "--time-limit", "2"])
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "an efficiency of at most 1.000 (proven); PLAN's 0.000 ms is 1.000" in said
