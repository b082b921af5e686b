"""Cut points for two stages per rank (octoplan.tuner.placed_cuts): the exact best cut of a loop
and of a V, against hand-computed answers and against enumerating every cut of small models;
and the seed family that hands them to the search."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from octoplan.schedules import loop_placement, v_placement
from octoplan.tuner import TuneOptions, tune
from octoplan.tuner.placed_cuts import loop_cuts, v_cuts
from octoplan.tuner.seeds import SEED_FAMILIES, RankBalancedSeeds
from octoplan.tuner.seeds.rank_balanced import rank_balanced_seeds
from octoplan.tuner.space import Config
from tests.conftest import free_cluster, make_profile

LOOP, V = (lambda r, pp: pp + r), (lambda r, pp: 2 * pp - 1 - r)  # rank r's second stage


def _busiest(work, bounds, pp, second) -> int:
    """The busiest rank's work under ``bounds``, checking they cut every layer into 2 pp
    non-empty stages in order."""
    assert len(bounds) == 2 * pp + 1 and bounds[0] == 0 and bounds[-1] == len(work), bounds
    assert all(a < b for a, b in zip(bounds, bounds[1:])), bounds
    prefix = list(itertools.accumulate(work, initial=0))
    stage = [prefix[b] - prefix[a] for a, b in zip(bounds, bounds[1:])]
    return max(stage[r] + stage[second(r, pp)] for r in range(pp))


def _best_by_enumeration(work, pp, second) -> int:
    return min(_busiest(work, (0, *inner, len(work)), pp, second)
               for inner in itertools.combinations(range(1, len(work)), 2 * pp - 1))


def test_heavy_ends_hand_computed():
    # 12 of work on 2 ranks. A loop pairs stages 0 + 2 and 1 + 3: {4} + {1, 1} and {1, 1} + {4}
    # is the only way to 6 each. A V pairs 0 + 3, the first and the last layer: 8 at best.
    work = [4, 1, 1, 1, 1, 4]
    loop = loop_cuts(work, 2)
    assert (loop.bounds, loop.busiest) == ((0, 1, 3, 5, 6), 6)
    v = v_cuts(work, 2)
    assert v.busiest == 8 and _busiest(work, v.bounds, 2, V) == 8


def test_a_heavy_head_goes_to_a_rank_of_its_own_in_the_loop():
    # a head of 8 after eight layers of 2 (24 in all, 12 per rank on 2 ranks): balanced stages
    # (6, 6, 4, 8) would give rank 1 stages of 6 and 8; the best loop gives rank 1 a single
    # layer before the head (2 + 8) and rank 0 the rest (12: ideal)
    work = [2] * 8 + [8]
    found = loop_cuts(work, 2)
    assert found.busiest == 12 and _busiest(work, found.bounds, 2, LOOP) == 12


def test_fewer_layers_than_stages_have_no_cut():
    assert loop_cuts([1, 1, 1], 2) is None and v_cuts([1, 1, 1], 2) is None


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(pp=st.integers(1, 3), data=st.data())
def test_both_shapes_match_every_cut_enumerated(pp, data):
    work = data.draw(st.lists(st.integers(1, 40), min_size=2 * pp, max_size=9))
    for cut, second in ((loop_cuts, LOOP), (v_cuts, V)):
        found = cut(work, pp)
        assert found.busiest == _best_by_enumeration(work, pp, second), (cut.__name__, work)
        assert _busiest(work, found.bounds, pp, second) == found.busiest, (cut.__name__, work)


def test_the_seeds_hold_those_cuts_in_their_placements():
    profile = make_profile([(1, 1, 0)] * 8 + [(4, 4, 0)])  # work 2 per layer, a head of 8, in ms
    seeds = rank_balanced_seeds(profile, Config(pp=2, dp=1, microbatches=4))
    shapes = {(s.ranks, s.bounds) for s in seeds}
    assert shapes == {(tuple(loop_placement(2, 4)), loop_cuts([2000] * 8 + [8000], 2).bounds),
                      (tuple(v_placement(2, 4)), v_cuts([2000] * 8 + [8000], 2).bounds)}
    assert len(seeds) == 6 and all(s.policies is not None for s in seeds)
    assert rank_balanced_seeds(profile, Config(pp=1, dp=1, microbatches=4)) == []


def test_a_tune_with_the_seeds_is_faster():
    # the same search on a budget of plans (deterministic), with and without the family
    profile = make_profile([(3, 4, 1), (1, 4, 3), (4, 3, 2), (2, 1, 3), (1, 3, 3), (1, 3, 3), (1, 2, 3), (1, 4, 1),
                            (4, 4, 2), (2, 3, 2)])
    opts = TuneOptions(gpus=4, pp=4, microbatches=4, max_plans=2000, time_limit_s=600)
    found = {}
    for with_family in (False, True):
        families = [f for f in SEED_FAMILIES if with_family or not isinstance(f, RankBalancedSeeds)]
        found[with_family] = tune(profile, free_cluster(4), opts, seed_families=families).scored.iteration_ms
    assert found == {False: 95.0, True: 92.0}
