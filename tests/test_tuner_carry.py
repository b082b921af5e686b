"""Layout moves that keep the tuned order (octoplan.tuner.carry): timelines worked by hand."""

from __future__ import annotations

from octoplan.ops import parse_ops
from octoplan.tuner.carry import Carrier, peel_moves
from octoplan.tuner.space import Candidate, Config, Evaluator
from tests.conftest import free_cluster, make_profile


def _two_ranks() -> tuple[Evaluator, Candidate]:
    """4 layers of 1 ms each for F, I and W; stages [0, 2) on rank 0 and [2, 4) on rank 1; 2
    microbatches in a 1F1B order with split backwards. Its timeline, by hand:
    rank 0: 0F0 [0, 2], 0F1 [2, 4], 0I0 [6, 8], 0W0 [8, 10], 0I1 [12, 14], 0W1 [14, 16];
    rank 1: 1F0 [2, 4], 1I0 [4, 6], 1W0 [6, 8], 1F1 [8, 10], 1I1 [10, 12], 1W1 [12, 14]."""
    evaluator = Evaluator(make_profile([(1, 1, 1)] * 4), free_cluster(2))
    order = (tuple(parse_ops("0F0 0F1 0I0 0W0 0I1 0W1")), tuple(parse_ops("1F0 1I0 1W0 1F1 1I1 1W1")))
    cand = Candidate(Config(2, 1, 2), (0, 2, 4), (0, 1), None, order, "1f1b", "1f1b")
    assert evaluator.score(cand).iteration_ms == 16.0
    return evaluator, cand


def test_the_same_layout_carries_the_same_order():
    evaluator, cand = _two_ranks()
    carry = Carrier(cand, evaluator.timeline(cand), evaluator)
    assert carry(cand.bounds, cand.ranks, "same").fixed == cand.fixed


def test_a_peeled_layer_runs_where_it_ran_inside_its_old_stage():
    # Layer 1 peeled off stage 0 onto rank 1. Its forward starts halfway through the old 0F
    # (1 and 3 ms); its backward where the old 0I and 0W started (6, 8; 12, 14), since no layer
    # of the old stage comes after it. Old stage 1, now stage 2, keeps its times. Equal times
    # put a later stage's backward first (2W0 and the new 1I0 both at 6), and a forward before
    # a backward (2F1 and 1W0 both at 8). Layer 0's I and W
    # start after layer 1's half of them (7, 9; 13, 15): rank 0's order is unchanged.
    evaluator, cand = _two_ranks()
    carry = Carrier(cand, evaluator.timeline(cand), evaluator)
    moved = carry((0, 1, 2, 4), (0, 1, 1), "peel")
    assert moved.fixed == (tuple(parse_ops("0F0 0F1 0I0 0W0 0I1 0W1")),
                           tuple(parse_ops("1F0 2F0 1F1 2I0 2W0 1I0 2F1 1W0 2I1 2W1 1I1 1W1")))
    assert moved.bounds == (0, 1, 2, 4) and moved.ranks == (0, 1, 1) and moved.policies is None
    # the carried order runs as it stands: rank 1 does 1F0 [1, 2], 2F0 [2, 4], 1F1 [4, 5],
    # 2I0 [5, 7], 2W0 [7, 9], 1I0 [9, 10], 2F1 [10, 12], 1W0 [12, 13], 2I1 [13, 15],
    # 2W1 [15, 17], 1I1 [17, 18], 1W1 [18, 19]; rank 0 ends with 0I1 [18, 19], 0W1 [19, 20]
    assert evaluator.score(moved).iteration_ms == 20.0
    # and a justification (what the search does next) closes what the changed times left open
    best = min(evaluator.score(c).iteration_ms for c in evaluator.justified(moved))
    assert best < 20.0


def test_a_forward_of_0_ms_stays_ahead_of_its_own_backward():
    # the last layer's forward takes 0 ms, so the last stage's B starts when its F does: the
    # tie goes to the forward (the backward first would deadlock)
    evaluator = Evaluator(make_profile([(1, 1, 1), (1, 1, 1), (0, 1, 1)]), free_cluster(2))
    order = (tuple(parse_ops("0F0 0F1 0B0 0B1")), tuple(parse_ops("1F0 1B0 1F1 1B1")))
    cand = Candidate(Config(2, 1, 2), (0, 2, 3), (0, 1), None, order, "1f1b", "1f1b")
    assert evaluator.score(cand).iteration_ms == 12.0
    same = Carrier(cand, evaluator.timeline(cand), evaluator)(cand.bounds, cand.ranks, "same")
    assert same.fixed == order


def test_a_merge_of_fused_and_split_backwards_is_not_carried():
    evaluator = Evaluator(make_profile([(1, 1, 1)] * 4), free_cluster(2))
    order = (tuple(parse_ops("0F0 0B0")), tuple(parse_ops("1F0 1I0 1W0")))
    cand = Candidate(Config(2, 1, 1), (0, 2, 4), (0, 1), None, order, "mixed", "mixed")
    carry = Carrier(cand, evaluator.timeline(cand), evaluator)
    assert carry((0, 4), (0,), "merge") is None
    # each part on its own carries: stage 0 keeps its B, stage 1 its I and W, swapped ranks
    assert carry((0, 2, 4), (1, 0), "swap").fixed == (tuple(parse_ops("1F0 1I0 1W0")), tuple(parse_ops("0F0 0B0")))


def test_peels_go_from_the_rank_that_finishes_last_to_the_one_that_finishes_first():
    evaluator, cand = _two_ranks()
    result = evaluator.timeline(cand)
    # rank 0 starts at 0 and is busy 12 ms; rank 1 starts at 2 and is busy 12 ms: rank 1 gives
    peels = peel_moves(cand, result, max_per_rank=2)
    assert [(gain, bounds, ranks) for gain, bounds, ranks, _ in peels] == [(2.0, (0, 2, 3, 4), (0, 1, 0)),
                                                                          (2.0, (0, 2, 3, 4), (0, 0, 1))]
    assert peel_moves(cand, result, max_per_rank=1) == []  # rank 0 may hold no second stage


def test_a_peel_with_its_order_justified_gets_a_climb_past_a_local_optimum():
    # 7 uneven layers on 3 ranks, 6 microbatches, from 1F1B (found by a seeded random search
    # over small cases): the climb's other moves, the compound shifts included, stop at 120 ms;
    # with the peels (PEELS = 6) it goes on to 106 ms through two of them. The shifting-
    # bottleneck reordering is off, as in the compound-shift test, to isolate the move.
    from octoplan.baseline import make_baseline
    from octoplan.tuner import TuneOptions
    from octoplan.tuner.climb import Search
    from octoplan.tuner.neighbourhoods import NEIGHBOURHOODS, PEELS, BottleneckOrder, PeeledAndJustified

    profile, cluster = make_profile([(1, 4, 1), (2, 2, 3), (1, 4, 2), (3, 3, 3), (4, 3, 1), (2, 3, 1), (1, 1, 2)]), free_cluster(3)
    base = make_baseline(profile, schedule="1f1b", gpus=3, microbatches=6, cluster=cluster)
    start = Candidate(Config(3, 1, 6), (0,) + tuple(s.end for s in base.stages), tuple(s.rank for s in base.stages), None,
                      tuple(tuple(ops) for ops in base.schedule), "1f1b", "1f1b")
    ends = {}
    for peels in (0, PEELS):
        chosen = [PeeledAndJustified(peels) if isinstance(n, PeeledAndJustified) else n
                  for n in NEIGHBOURHOODS if not isinstance(n, BottleneckOrder)]
        evaluator = Evaluator(profile, cluster)
        climber = Search(evaluator, TuneOptions(gpus=3, pp=3, microbatches=6, time_limit_s=600), None,
                         neighbourhoods=chosen)
        end = climber.climb(start, deadline=600)
        ends[peels] = (evaluator.score(end).iteration_ms, climber.accepted_moves)
    assert ends[0][0] == 120.0 and not any("peel" in move for move in ends[0][1])
    assert ends[PEELS][0] == 106.0
    assert [move for move in ends[PEELS][1] if "peel" in move] == [
        "peel the last layer of stage 0 onto rank 2, justified", "peel the last layer of stage 3 onto rank 0, justified"]


def test_the_peels_make_a_whole_tune_faster():
    # the same search on a budget of plans (deterministic), with and without the peels: 96 -> 92 ms
    from octoplan.tuner import TuneOptions, tune
    from octoplan.tuner.neighbourhoods import NEIGHBOURHOODS, PEELS, PeeledAndJustified

    profile = make_profile([(3, 4, 1), (1, 4, 3), (4, 3, 2), (2, 1, 3), (1, 3, 3), (1, 3, 3), (1, 2, 3), (1, 4, 1), (4, 4, 2), (2, 3, 2)])
    opts = TuneOptions(gpus=4, pp=4, microbatches=4, max_plans=2000, time_limit_s=600)
    found = {}
    for peels in (0, PEELS):
        chosen = [PeeledAndJustified(peels) if isinstance(n, PeeledAndJustified) else n for n in NEIGHBOURHOODS]
        found[peels] = tune(profile, free_cluster(4), opts, neighbourhoods=chosen).scored.iteration_ms
    assert found == {0: 96.0, PEELS: 92.0}


def test_a_stage_that_fuses_some_backwards_and_splits_others_keeps_each_microbatchs_kinds():
    evaluator = Evaluator(make_profile([(1, 1, 1)] * 4), free_cluster(2))
    order = (tuple(parse_ops("0F0 0F1 0I0 0W0 0B1")), tuple(parse_ops("1F0 1B0 1F1 1I1 1W1")))
    cand = Candidate(Config(2, 1, 2), (0, 2, 4), (0, 1), None, order, "mixed", "mixed")
    carry = Carrier(cand, evaluator.timeline(cand), evaluator)
    assert carry(cand.bounds, (1, 0), "swap").fixed == (order[1], order[0])
    # stage 0 split microbatch 0 where stage 1 fused it: one stage of both cannot be carried
    assert carry((0, 4), (0,), "merge") is None
    assert carry((0, 1, 4), (0, 1), "shift") is None
    # a layer peeled off stage 0 splits microbatch 0's backward and fuses microbatch 1's, as stage 0 did
    peeled = carry((0, 1, 2, 4), (0, 1, 1), "peel").fixed
    assert sorted(peeled[1]) == sorted(parse_ops("1F0 1F1 1I0 1W0 1B1 2F0 2F1 2B0 2I1 2W1"))
    assert sorted(peeled[0]) == sorted(parse_ops("0F0 0F1 0I0 0W0 0B1"))
