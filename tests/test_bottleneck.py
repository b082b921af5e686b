"""Op orders by the shifting-bottleneck procedure (octoplan.schedules.bottleneck)."""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings

from octoplan.costs import LayerTable, stage_costs
from octoplan.ops import parse_ops
from octoplan.plan import Parallel, Stage, check_structure
from octoplan.schedules.bottleneck import bottleneck_order
from octoplan.schedules.exact import one_machine_bound, order_bound
from octoplan.schedules.justify import justify
from octoplan.schedules.list_order import longest_tail_order
from octoplan.schedules.opgraph import OpGraph, most_in_flight
from octoplan.schedules.policy import default_policies, policy_schedule
from octoplan.simulator import simulate, simulate_costs
from octoplan.tuner.space import Candidate, Config, Evaluator
from tests.conftest import free_cluster, make_profile
from tests.test_justify import _plan, assert_microbatch_order
from tests.test_tuner_policy import costly_policy_order, placements


def uneven_v():
    """A V on 2 ranks (stages 0 and 3 on rank 0, 1 and 2 on rank 1), 2 microbatches, uneven
    stages (F, I, W) = (1, 3, 0), (3, 3, 0), (3, 2, 1), (1, 1, 1) ms, free transfers, and the
    policy scheduler's order for it."""
    profile = make_profile([(1, 3, 0), (3, 3, 0), (3, 2, 1), (1, 1, 1)])
    cluster, parallel = free_cluster(2), Parallel(pp=2, microbatches=2)
    ranks = (0, 1, 1, 0)
    stages = tuple(Stage(s, s + 1, r) for s, r in enumerate(ranks))
    costs = stage_costs(stages, LayerTable(profile))
    ops = policy_schedule(ranks, costs, microbatches=2, policies=default_policies(ranks, 2, 2, split=True),
                          cluster=cluster, parallel=parallel)
    return profile, cluster, parallel, ranks, stages, costs, ops


def test_the_bottleneck_rank_is_ordered_to_the_optimum_that_justification_misses():
    # Rank 1 holds 2 x (3+3+0 + 3+2+1) = 24 ms of work and cannot start before 0F0 ends at 1.
    # Its last I (1I1) is followed by 0I1 (3 ms) on rank 0, and only stage 2's two Ws (2 ms)
    # can run on rank 1 after 1I1, so no order beats 1 + 22 + 3 = 26 ms.
    # The policy scheduler's order takes 28 ms (rank 1 runs 2F1 after 2I0, and Ws between its
    # Is), and justification, which moves ops into gaps of that order, finds nothing. The shifting
    # bottleneck orders rank 1 by its ops' tails: every forward first, then the Is, the Ws
    # last (1F0 2F0 1F1 2F1 2I0 1I0 2I1 1I1, Ws) — 26 ms, the optimum, with each stage holding
    # no more microbatches in flight than the policy's order did.
    profile, cluster, parallel, ranks, stages, costs, ops = uneven_v()
    assert [" ".join(map(str, r)) for r in ops] == ["0F0 0F1 3F0 3I0 3W0 0I0 3F1 3I1 0W0 3W1 0I1 0W1",
                                                    "1F0 2F0 1F1 2I0 1I0 2F1 2W0 1W0 2I1 1I1 2W1 1W1"]
    assert simulate(_plan(profile, cluster, parallel, stages, ops), profile).iteration_ms == 28.0
    for keep in (True, False):
        assert justify(ops, ranks, costs, cluster=cluster, parallel=parallel, keep_memory=keep)[1] == 28.0
        order, span = bottleneck_order(ops, ranks, costs, cluster=cluster, parallel=parallel, keep_memory=keep)
        assert span == 26.0
        assert " ".join(map(str, order[1])) == "1F0 2F0 1F1 2F1 2I0 1I0 2I1 1I1 2W0 2W1 1W0 1W1"
        assert simulate(_plan(profile, cluster, parallel, stages, order), profile).iteration_ms == 26.0
        assert all(most_in_flight(order)[s] <= n for s, n in most_in_flight(ops).items())
    # 26 is what the one-machine relaxation and CP-SAT prove for every order
    assert one_machine_bound(OpGraph(ops, ranks, costs, cluster, parallel, False), 2) == 26.0
    exact = order_bound(ops, ranks, costs, cluster=cluster, parallel=parallel, keep_memory=False, time_limit_s=10)
    assert (exact.status, exact.lower_bound_ms) == ("OPTIMAL", 26.0)


def test_the_tuner_offers_the_bottleneck_order_and_its_justified_orders():
    # The Evaluator's reordering, on the same layout: the new orders (in-flight bound kept,
    # and free of it), each then justified, none equal to the given one; the best is 26 ms.
    profile, cluster, parallel, ranks, _, _, _ = uneven_v()
    evaluator = Evaluator(profile, cluster)
    seed = Candidate(Config(2, 1, 2), (0, 1, 2, 3, 4), ranks, default_policies(ranks, 2, 2, split=True), None,
                     "policy seed")
    found = evaluator.reordered(seed)
    assert found and all(c.fixed is not None and c.fixed != evaluator.schedule(seed) for c in found)
    assert len({c.fixed for c in found}) == len(found)
    assert found[0].origin == "policy seed, shifting-bottleneck order"
    assert min(evaluator.score(c).iteration_ms for c in found) == 26.0
    assert evaluator.score(seed).iteration_ms == 28.0


def gpipe(backward: str):
    """4 equal stages (F 1, I 2, W 0) on 4 ranks, 8 microbatches, in GPipe's order: every
    forward, then every backward as ``backward`` ("B", or "I W": I and W apart). The profile,
    cluster, parallel degrees, stages, stage costs and the order."""
    profile = make_profile([(1, 2, 0)] * 4)
    cluster, parallel = free_cluster(4), Parallel(pp=4, microbatches=8)
    stages = tuple(Stage(s, s + 1, s) for s in range(4))
    costs = stage_costs(stages, LayerTable(profile))
    each = {"B": "{s}B{m}", "I W": "{s}I{m} {s}W{m}"}[backward]
    ops = [parse_ops(" ".join([f"{s}F{m}" for m in range(8)] + [each.format(s=s, m=m) for m in range(8)]))
           for s in range(4)]
    return profile, cluster, parallel, stages, costs, ops


def test_a_plan_without_gaps_keeps_its_time():
    # GPipe's order on equal stages takes (m + p - 1)(F + B) = 33 ms, which no order beats
    # (test_exact proves it for 1F1B's); the procedure finds an order as short
    profile, cluster, parallel, stages, costs, ops = gpipe("B")
    order, span = bottleneck_order(ops, range(4), costs, cluster=cluster, parallel=parallel, keep_memory=False)
    assert span == 33.0
    assert simulate(_plan(profile, cluster, parallel, stages, order), profile).iteration_ms == 33.0


@pytest.mark.parametrize("rebuild", [bottleneck_order, longest_tail_order,
                                     # past its deadline from the start: each rank ordered in turn
                                     functools.partial(bottleneck_order, deadline=0.0)])
@settings(max_examples=60, deadline=None)
@given(placements())
def test_rebuilt_orders_are_valid_and_never_beat_the_bound(rebuild, case):
    # both rules that build a whole order anew: the shifting-bottleneck procedure and the
    # longest-tail-first list scheduler (octoplan.schedules.list_order)
    pp, ranks = case[0], case[1]
    profile, cluster, parallel, stages, costs, ops = costly_policy_order(case)
    bound = one_machine_bound(OpGraph(ops, ranks, costs, cluster, parallel, False), pp)
    for keep in (True, False):
        order, span = rebuild(ops, ranks, costs, cluster=cluster, parallel=parallel, keep_memory=keep)
        plan = _plan(profile, cluster, parallel, stages, order)
        check_structure(plan, num_layers=profile.num_layers)  # every op once, on its rank, I before W
        run = simulate_costs(plan, costs).iteration_ms  # raises DeadlockError on a cycle
        assert bound <= span + 1e-9 and bound <= run + 1e-9
        # the model leaves out link contention only, which can only add time
        assert span <= run + 1e-9
        assert_microbatch_order(order)
        if keep:
            assert all(most_in_flight(order)[s] <= n for s, n in most_in_flight(ops).items())


def test_search_polish_reorders_the_best_plan():
    # the tuner's last step: the best plan found (here the policy seed, 28 ms) reordered, the
    # faster order kept and climbed from; with the layout held (schedule moves only), nothing
    # beats its 26 ms, the optimum
    from octoplan.tuner.search import TuneOptions, _Search

    profile, cluster, _, ranks, _, _, _ = uneven_v()
    evaluator = Evaluator(profile, cluster)
    search = _Search(evaluator, TuneOptions(gpus=2, time_limit_s=30, dimensions=("schedule",)), None)
    search.offer(Candidate(Config(2, 1, 2), (0, 1, 2, 3, 4), ranks, default_policies(ranks, 2, 2, split=True), None,
                           "policy seed"))
    assert search.best_scored.iteration_ms == 28.0
    search.polish()
    assert search.best_scored.iteration_ms == 26.0
    assert search.best.origin.startswith("policy seed, shifting-bottleneck order")


def test_cli_justify_reorder_writes_the_bottleneck_order(profile_file, tmp_path):
    from typer.testing import CliRunner

    from octoplan.cli import app
    from octoplan.plan import Plan, load_plan, save_plan

    profile, cluster, parallel, _, stages, _, ops = uneven_v()
    given = tmp_path / "given.yaml"
    save_plan(Plan(model=profile.model, cluster=cluster, parallel=parallel, stages=stages,
                   schedule=tuple(tuple(r) for r in ops), profile=str(profile_file(profile))), given)
    runner = CliRunner()
    plain = runner.invoke(app, ["justify", str(given), "-o", str(tmp_path / "j.yaml")])
    assert plain.exit_code == 0 and "unchanged" in plain.output  # justification alone: 28 ms
    out = tmp_path / "r.yaml"
    result = runner.invoke(app, ["justify", str(given), "--reorder", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "reordered, justified" in result.output and "1.077x faster" in result.output  # 28 / 26
    assert load_plan(out).predicted["iteration_ms"] == 26.0
    assert runner.invoke(app, ["validate", str(out)]).exit_code == 0
    # a time limit for the procedure: given, it runs; without --reorder, or not above 0, refused
    limited = runner.invoke(app, ["justify", str(given), "--reorder", "--time-limit", "60", "-o", str(out)])
    assert limited.exit_code == 0 and "1.077x faster" in limited.output, limited.output
    for args, says in ((["--time-limit", "5"], "limits --reorder only"), (["--reorder", "--time-limit", "0"], "is 0"),
                       (["--reorder", "--time-limit", "nan"], "is nan")):
        refused = runner.invoke(app, ["justify", str(given), *args, "-o", str(tmp_path / "x.yaml")])
        assert refused.exit_code == 2 and f"--time-limit: {says}" in refused.output, refused.output
        assert not (tmp_path / "x.yaml").exists()
