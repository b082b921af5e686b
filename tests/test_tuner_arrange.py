"""Start-aware placement: the busiest rank takes early stages, late-starting ranks carry less."""

from __future__ import annotations

from octoplan.schedules.policy import default_policies
from octoplan.tuner.arrange import rank_times, start_aware
from octoplan.tuner.space import Candidate, Config, Evaluator
from tests.conftest import free_cluster, make_profile


def test_one_stage_per_rank_has_nothing_to_move():
    # stage 3 (work 2) waits 1.5 ms of lead on any rank: with one stage per rank a swap only
    # renames ranks, so the placement is kept
    work, lead = [1, 1, 1, 2], [0.5, 0.5, 0.5, 1]
    assert rank_times((0, 1, 2, 3), work, lead, num_ranks=4, microbatches=4) == [4, 4.5, 5, 9.5]
    assert start_aware((0, 1, 2, 3), work, lead, num_ranks=4, microbatches=4, max_per_rank=1) == (0, 1, 2, 3)


def test_same_loads_earlier_start_simulates_faster():
    # small (3 ms) and big (6 ms) layers alternate, one layer per stage; rank 1 holds two bigs
    # and the last small (15 ms per microbatch, the busiest), but its first stage is stage 1
    profile = make_profile([(1, 1, 1), (2, 2, 2)] * 4 + [(1, 1, 1)])
    evaluator = Evaluator(profile, free_cluster(4))
    config = Config(4, 1, 8)
    bounds = tuple(range(10))
    ranks = (0, 1, 2, 3, 0, 1, 2, 3, 1)
    cand = Candidate(config, bounds, ranks, default_policies(ranks, 4, 8, split=True, depth=2, warmup_gap=False))
    costs = evaluator.costs(cand)
    work = [c.forward_ms + c.backward_input_ms + c.backward_weight_ms for c in costs]
    lead = [c.forward_ms + c.backward_input_ms for c in costs]
    assert rank_times(ranks, work, lead, num_ranks=4, microbatches=8) == [48, 122, 54, 104]
    new = start_aware(ranks, work, lead, num_ranks=4, microbatches=8, max_per_rank=3)
    # the swap gives rank 1 a small first stage (12 ms per microbatch) and no lead time
    assert new == (1, 0, 3, 2, 0, 1, 2, 3, 1)
    assert rank_times(new, work, lead, num_ranks=4, microbatches=8) == [74, 96, 80, 78]
    moved = Candidate(config, bounds, new, default_policies(new, 4, 8, split=True, depth=2, warmup_gap=False))
    assert evaluator.score(cand).iteration_ms == 121.0
    # the simulator agrees with the proxy: 8 x 12 ms, no idle time on the busiest rank
    assert evaluator.score(moved).iteration_ms == 96.0
