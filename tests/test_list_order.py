"""Op orders by the longest-tail-first list scheduler (octoplan.schedules.list_order); its
property test, shared with the shifting-bottleneck procedure, is in test_bottleneck."""

from __future__ import annotations

from octoplan.schedules.list_order import longest_tail_order
from octoplan.schedules.opgraph import most_in_flight
from octoplan.schedules.policy import default_policies
from octoplan.simulator import simulate
from octoplan.tuner.space import LONGEST_TAIL, Candidate, Config, Evaluator
from tests.conftest import free_cluster, make_profile
from tests.test_bottleneck import gpipe, uneven_v
from tests.test_justify import _plan


def test_every_rank_at_once_runs_the_op_on_the_longest_chain():
    # The V of test_bottleneck (rank 0: stages 0 and 3, rank 1: stages 1 and 2; (F, I, W) =
    # (1, 3, 0), (3, 3, 0), (3, 2, 1), (1, 1, 1) ms; 2 microbatches), whose policy order takes
    # 28 ms and whose optimum is 26. Traced by hand, rank 1 (tails in brackets):
    #   t=1  only 1F0 has arrived                       1F0 [1, 4]
    #   t=4  2F0 (13) and 1F1 (13): a tie, the earlier  2F0 [4, 7]
    #   t=7  1F1                                        1F1 [7, 10]
    #   t=10 2F1 (10) before 2I0 (9; 3I0 ended at 9)    2F1 [10, 13], 2I0 [13, 15]
    #   t=15 1I0 and 2I1 (6 each), then 1I1 (3) and the Ws, whose tails are 1 and 0:
    #        1I0 [15, 18], 2I1 [18, 20], 1I1 [20, 23], 2W0 [23, 24], 1W0, 2W1 [24, 25], 1W1.
    # Rank 0 runs stage 3's ops as they arrive, then 0I0 at 18 (1I0's end) and 0I1 at 23 (1I1's):
    # 26 ms, the optimum, with every stage's in-flight count as in the policy order.
    profile, cluster, parallel, ranks, stages, costs, ops = uneven_v()
    for keep in (True, False):
        order, span = longest_tail_order(ops, ranks, costs, cluster=cluster, parallel=parallel, keep_memory=keep)
        assert span == 26.0
        assert [" ".join(map(str, r)) for r in order] == [
            "0F0 0F1 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 0I1 0W1",
            "1F0 2F0 1F1 2F1 2I0 1I0 2I1 1I1 2W0 1W0 2W1 1W1"]
        assert simulate(_plan(profile, cluster, parallel, stages, order), profile).iteration_ms == 26.0
        assert most_in_flight(order) == most_in_flight(ops)


def test_a_plain_pipeline_reaches_its_bound_from_gpipe_order():
    # 4 equal stages (F 1, I 2, W 0) on 4 ranks, 8 microbatches, GPipe's order given: no order
    # beats (m + p - 1)(F + B) = 33 ms. A stage runs each kind in microbatch order, so on the
    # last rank 3Fm's tail is 22 - 2m (the forwards after it, 3I7 and the three Is beneath)
    # and 3Im's 20 - 2m. At t=4, 3F1 and 3I0 tie at 20 (the earlier in topological order, 3F1,
    # goes first); at t=5 3I0 (20) beats 3F2 (18); then each forward ties with the backward
    # before it and goes first, and that backward beats the next forward: one forward, one
    # backward, 33 ms, the bound, with or without GPipe's in-flight counts.
    profile, cluster, parallel, stages, costs, ops = gpipe("I W")
    for keep in (True, False):
        order, span = longest_tail_order(ops, range(4), costs, cluster=cluster, parallel=parallel, keep_memory=keep)
        assert span == 33.0
        assert " ".join(map(str, order[3])).startswith("3F0 3F1 3I0 3F2 3I1 3F3 3I2")
        assert simulate(_plan(profile, cluster, parallel, stages, order), profile).iteration_ms == 33.0


def test_given_tails_replace_the_dataflow_s():
    # The same pipeline with priorities that put every forward first (100 against 0): the last
    # rank's forwards arrive one per ms from t=3, each beats the I waiting beside it, so that
    # rank runs all 8 forwards before its first I, where the dataflow's tails interleave them
    # (above). GPipe's order, and its 33 ms: the last I leaves rank 3 at 27 and takes 2 ms per
    # rank down to rank 0.
    from octoplan.ops import Kind

    profile, cluster, parallel, stages, costs, ops = gpipe("I W")
    forwards_first = [100.0 if op.kind is Kind.F else 0.0 for rank_ops in ops for op in rank_ops]
    order, span = longest_tail_order(ops, range(4), costs, cluster=cluster, parallel=parallel, tail=forwards_first)
    assert " ".join(map(str, order[3])).startswith("3F0 3F1 3F2 3F3 3F4 3F5 3F6 3F7 3I0")
    assert span == 33.0
    default, _ = longest_tail_order(ops, range(4), costs, cluster=cluster, parallel=parallel)
    assert " ".join(map(str, default[3])).startswith("3F0 3F1 3I0")


def test_the_tuner_offers_the_list_order_once_per_candidate():
    # the climb's neighbourhood: the new orders of the policy seed (in-flight bound kept and
    # free of it, each justified), named after the rule, the best at the 26 ms optimum; asked
    # again for the same candidate, it yields nothing
    from octoplan.tuner.neighbourhoods import NEIGHBOURHOODS, LongestTailOrder
    from octoplan.tuner.search import TuneOptions, _Search

    profile, cluster, _, ranks, _, _, _ = uneven_v()
    evaluator = Evaluator(profile, cluster)
    seed = Candidate(Config(2, 1, 2), (0, 1, 2, 3, 4), ranks, default_policies(ranks, 2, 2, split=True), None,
                     "policy seed")
    search = _Search(evaluator, TuneOptions(gpus=2, time_limit_s=30, dimensions=("schedule",)), None)
    neighbourhood = next(n for n in NEIGHBOURHOODS if isinstance(n, LongestTailOrder))
    found = list(neighbourhood.moves(search, seed, evaluator.simulate(seed), deadline=30.0))
    assert found and found[0].origin == "policy seed, longest-tail-first order"
    assert found[0].fixed_id.startswith("policy+longest-tail#")
    assert len({c.fixed for c in found}) == len(found)
    assert min(evaluator.score(c).iteration_ms for c in found) == 26.0
    assert list(neighbourhood.moves(search, seed, evaluator.simulate(seed), deadline=30.0)) == []


def test_polish_takes_the_list_order_where_it_beats_the_bottleneck_order():
    # A loop on 2 ranks (stages 0 and 2 on rank 0, 1 and 3 on rank 1), 3 microbatches, (F, I, W)
    # = (2, 1, 2), (1, 3, 1), (4, 3, 0), (4, 3, 1) ms, free transfers. The policy order takes
    # 48 ms and justification leaves it as it is; the shifting-bottleneck order takes 46; the
    # longest-tail-first order takes 45, which CP-SAT proves optimal for every order (with the
    # policy's in-flight counts or free of them). The search's polish tries both rebuilds of its
    # best plan and keeps the faster.
    from octoplan.schedules.exact import order_bound
    from octoplan.tuner.search import TuneOptions, _Search

    profile = make_profile([(2, 1, 2), (1, 3, 1), (4, 3, 0), (4, 3, 1)])
    evaluator, ranks = Evaluator(profile, free_cluster(2)), (0, 1, 0, 1)
    seed = Candidate(Config(2, 1, 3), (0, 1, 2, 3, 4), ranks, default_policies(ranks, 2, 3, split=True), None,
                     "policy seed")
    assert evaluator.score(seed).iteration_ms == 48.0
    assert evaluator.justified(seed) == []  # no order it can reach differs
    assert min(evaluator.score(c).iteration_ms for c in evaluator.reordered(seed)) == 46.0
    listed = evaluator.reordered(seed, LONGEST_TAIL)
    assert [evaluator.score(c).iteration_ms for c in listed[:2]] == [45.0, 45.0]
    assert " ".join(map(str, listed[0].fixed[0])) == "0F0 0F1 2F0 0F2 2F1 2I0 2W0 2F2 2I1 2W1 0I0 0W0 2I2 0I1 0W1 0I2 2W2 0W2"
    for keep in (True, False):
        exact = order_bound(evaluator.schedule(seed), ranks, evaluator.costs(seed), cluster=evaluator.cluster,
                            parallel=seed.config.parallel(), keep_memory=keep, time_limit_s=30)
        assert (exact.status, exact.lower_bound_ms) == ("OPTIMAL", 45.0)
    search = _Search(evaluator, TuneOptions(gpus=2, time_limit_s=30, dimensions=("schedule",)), None)
    search.offer(seed)
    search.polish()
    assert search.best_scored.iteration_ms == 45.0
    assert search.best.origin == "policy seed, longest-tail-first order"


def test_the_best_seeds_are_list_ordered_before_the_climbs():
    # the seed family: each of the best ranked layouts (one per layout) list-ordered, its
    # orders ranked among the seeds with the index of the seed they came from; on the loop
    # above, the 45 ms optimum
    from octoplan.tuner.search import TuneOptions, _Search
    from octoplan.tuner.seeds import SEED_FAMILIES, ListOrderedSeeds, SeedContext

    profile = make_profile([(2, 1, 2), (1, 3, 1), (4, 3, 0), (4, 3, 1)])
    evaluator, ranks = Evaluator(profile, free_cluster(2)), (0, 1, 0, 1)
    config = Config(2, 1, 3)
    seeds = [Candidate(config, (0, 1, 2, 3, 4), ranks, default_policies(ranks, 2, 3, split=split), None,
                       f"policy seed, split={split}") for split in (True, False)]
    search = _Search(evaluator, TuneOptions(gpus=2, pp=2, microbatches=3, time_limit_s=30), None)
    ranked = sorted(((search.offer(c).score, i, c) for i, c in enumerate(seeds)), key=lambda item: item[:2])
    family = next(f for f in SEED_FAMILIES if isinstance(f, ListOrderedSeeds))
    ctx = SeedContext(search=search, configs=[config], baseline_chunks=1)
    assert family.applies(ctx)
    made = list(family.from_ranked(ctx, ranked))
    # one layout, so only the best seed's order is rebuilt
    assert made and {index for index, _ in made} == {ranked[0][1]}
    assert min(evaluator.score(c).iteration_ms for _, c in made) == 45.0
    assert all(c.origin.startswith(ranked[0][2].origin + ", longest-tail-first order") for _, c in made)
    assert not family.applies(SeedContext(
        search=_Search(evaluator, TuneOptions(gpus=2, time_limit_s=30, dimensions=("partition",)), None),
        configs=[config], baseline_chunks=1))
