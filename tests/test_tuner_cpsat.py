"""CP-SAT partition + placement on tiny problems with known optima."""

from __future__ import annotations

import itertools

import pytest

from octoplan.plan import Cluster
from octoplan.tuner.cpsat import PartitionProblem, problem_for, solve_partition
from octoplan.tuner.space import Config, Evaluator
from tests.conftest import make_profile


def _brute_force(costs, num_ranks, num_stages, max_per_rank=3):
    """The least max-rank load over every contiguous split into exactly ``num_stages`` stages
    and every placement that keeps neighbouring stages apart (what the model allows)."""
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        b = (0, *cuts, n)
        loads = [sum(costs[b[j]:b[j + 1]]) for j in range(num_stages)]
        for ranks in itertools.product(range(num_ranks), repeat=num_stages):
            if num_ranks > 1 and any(ranks[j] == ranks[j + 1] for j in range(num_stages - 1)):
                continue
            counts = [ranks.count(r) for r in range(num_ranks)]
            if min(counts) < 1 or max(counts) > max_per_rank:
                continue
            worst = max(sum(loads[j] for j in range(num_stages) if ranks[j] == r) for r in range(num_ranks))
            best = worst if best is None else min(best, worst)
    return best


def _problem(costs, ranks, stages, **kwargs):
    zero = (0,) * len(costs)
    return PartitionProblem(tuple(costs), zero, zero, num_ranks=ranks, num_stages=stages, **kwargs)


def test_two_ranks_two_stages_by_hand():
    # layers 1..6 (sum 21): the best cut is after layer 4, 1+2+3+4 = 10 against 5+6 = 11
    solution = solve_partition(_problem([1, 2, 3, 4, 5, 6], 2, 2), exact_stages=True)
    assert solution.status == "OPTIMAL"
    assert solution.max_load == 11
    assert solution.bounds == (0, 4, 6)
    assert solution.ranks == (0, 1)


def test_three_ranks_five_stages_by_hand():
    # 21 over 3 ranks needs at least 7; [1][2][3,4][5][6] on ranks 0,1,2,1,0 gives 7, 7, 7
    solution = solve_partition(_problem([1, 2, 3, 4, 5, 6], 3, 5), exact_stages=True)
    assert solution.max_load == 7
    loads = [0, 0, 0]
    b = solution.bounds
    for j, r in enumerate(solution.ranks):
        loads[r] += sum([1, 2, 3, 4, 5, 6][b[j]:b[j + 1]])
    assert loads == [7, 7, 7]


@pytest.mark.parametrize("ranks,stages", [(2, 3), (2, 4), (3, 3), (3, 6), (2, 5)])
def test_matches_brute_force(ranks, stages):
    costs = [3, 1, 4, 1, 5, 9, 2]
    exact = solve_partition(_problem(costs, ranks, stages), exact_stages=True)
    assert exact.status == "OPTIMAL"
    assert len(exact.ranks) == stages
    assert exact.max_load == _brute_force(costs, ranks, stages)
    # with the stage count free up to the cap, the optimum is the best over every count
    free = solve_partition(_problem(costs, ranks, stages))
    assert free.max_load == min(_brute_force(costs, ranks, s) for s in range(ranks, stages + 1))


def test_stages_per_rank_cap():
    # [4, 4, 1, 1] on 2 ranks: one contiguous stage each gives at best [4] | [4, 1, 1] = 6;
    # two stages per rank give [4] [4, 1] [1] on ranks 0, 1, 0 = 5 | 5
    costs = [4, 4, 1, 1]
    assert solve_partition(_problem(costs, 2, 2, max_per_rank=1)).max_load == 6
    two = solve_partition(_problem(costs, 2, 4, max_per_rank=2))
    assert two.max_load == 5
    assert two.bounds == (0, 1, 3, 4) and two.ranks == (0, 1, 0)


def test_memory_limit_moves_the_cut_and_can_make_it_infeasible():
    costs = [1, 1, 1, 1, 1, 1]
    static = (10, 10, 10, 10, 10, 50)  # the last layer's weights are heavy
    free = solve_partition(_problem(costs, 2, 2, static_mb=static, activation_mb=(0,) * 6, memory_mb=1000))
    assert free.max_load == 3 and free.bounds == (0, 3, 6)  # even split: 3 layers of 1 tick each
    tight = solve_partition(_problem(costs, 2, 2, static_mb=static, activation_mb=(0,) * 6, memory_mb=60))
    assert tight.bounds == (0, 4, 6)  # [3, 6) would hold 70 MB; the last stage takes one layer less
    assert tight.max_load == 4
    assert solve_partition(_problem(costs, 2, 2, static_mb=static, activation_mb=(0,) * 6, memory_mb=40)) is None


def test_inter_node_edges_are_charged():
    # balance alone cuts after layer 0 (12 | 12 ms); layer 0 outputs 1 GB, layer 1 nothing.
    # Across nodes at 1 GB/s that transfer costs a second, so the model cuts after layer 1
    # (15 | 9 ms) instead; within a node at 10 TB/s it keeps the balanced cut.
    profile = make_profile([(4, 4, 4), (1, 1, 1), (1, 1, 1), (2, 2, 2)], params=0, act=0, out=0)
    layers = list(profile.layers)
    layers[0] = layers[0].__class__(**{**layers[0].__dict__, "output_bytes": 10**9})
    profile = profile.with_layers(layers)
    config = Config(pp=2, dp=1, microbatches=2)
    for gpus_per_node, cut in ((1, 2), (2, 1)):
        cluster = Cluster(gpus=2, gpus_per_node=gpus_per_node, inter_node_gbps=1.0, intra_node_gbps=1e4, latency_us=0.0)
        problem = problem_for(Evaluator(profile, cluster), config, 2)
        assert problem.rank_class == ((0, 1) if gpus_per_node == 1 else (0, 0))
        assert solve_partition(problem).bounds == (0, cut, 4)


def test_one_stage_per_rank_gets_a_third_of_the_limit():
    # the one-stage problem is solved under a third of the several-stage problem's limit (its
    # hint is at or near its optimum); alone, it gets the whole limit
    from octoplan.tuner.cpsat import SINGLE_STAGE_SHARE, cpsat_seeds

    profile = make_profile([(1, 1, 1), (2, 2, 2), (3, 3, 3), (1, 2, 1), (2, 1, 2), (1, 1, 3)], params=0, act=0, out=0)
    evaluator = Evaluator(profile, Cluster(gpus=2, gpus_per_node=2))
    config = Config(pp=2, dp=1, microbatches=4)
    _, both = cpsat_seeds(evaluator, config, chunks_max=3, time_limit_s=1.5)
    assert SINGLE_STAGE_SHARE == 3
    assert [(row["max_per_rank"], row["limit_s"]) for row in both] == [(1, 0.5), (3, 1.5)]
    _, alone = cpsat_seeds(evaluator, config, chunks_max=1, time_limit_s=1.5)
    assert [(row["max_per_rank"], row["limit_s"]) for row in alone] == [(1, 1.5)]


def test_the_partition_model_weighs_a_cheaper_fused_backward_as_the_simulator_does():
    from dataclasses import replace

    # layer 0: I + W = 6 but B measured at 3, so its backward weighs 3 (I 2 and W 1 in the
    # proportion of its I and W); layer 1: B = 8 is dearer than I + W = 6, which stays
    profile = make_profile([(1, 4, 2), (1, 4, 2)])
    layers = (replace(profile.layers[0], backward_ms=3.0), replace(profile.layers[1], backward_ms=8.0))
    profile = profile.with_layers(layers)
    problem = problem_for(Evaluator(profile, Cluster(gpus=2)), Config(2, 1, 4), 2)
    assert problem.backward_input == (2000, 4000) and problem.backward_weight == (1000, 2000)



def test_start_aware_moves_weigh_a_stage_by_the_backward_its_order_runs():
    from octoplan.ops import Kind, Op
    from octoplan.schedules.policy import default_policies
    from octoplan.tuner.neighbourhoods.basic import _fused_stages
    from octoplan.tuner.space import Candidate

    config = Config(2, 1, 1)
    fixed = ((Op(0, Kind.F, 0), Op(0, Kind.B, 0)), (Op(1, Kind.F, 0), Op(1, Kind.I, 0), Op(1, Kind.W, 0)))
    assert _fused_stages(Candidate(config, (0, 1, 2), (0, 1), None, fixed, "", "x")) == {0}
    policies = (default_policies((0, 1), 2, 1, split=False)[0], default_policies((0, 1), 2, 1, split=True)[1])
    assert _fused_stages(Candidate(config, (0, 1, 2), (0, 1), policies)) == {0}


def test_a_plan_budget_widens_cp_sats_wall_clock_net(monkeypatch):
    # --max-plans promises the same plan at any load: CP-SAT's deterministic limit must end
    # its solves, not a wall-clock net that a loaded machine reaches first
    import octoplan.tuner.cpsat as cpsat
    from octoplan.tuner import TuneOptions, tune
    from tests.conftest import free_cluster

    seen = []
    real = cpsat.cpsat_seeds

    def spy(*args, **kwargs):
        seen.append(kwargs["wall_factor"])
        return real(*args, **kwargs)

    monkeypatch.setattr(cpsat, "cpsat_seeds", spy)
    profile = make_profile([(1, 1, 1)] * 6)
    tune(profile, free_cluster(2), TuneOptions(gpus=2, pp=2, microbatches=4, max_plans=50))
    tune(profile, free_cluster(2), TuneOptions(gpus=2, pp=2, microbatches=4, time_limit_s=2))
    assert seen == [cpsat.DETERMINISTIC_WALL_FACTOR, cpsat.WALL_FACTOR]
