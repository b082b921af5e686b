"""Extending the tuner: a seed family and a neighbourhood plugged in through their interfaces
(octoplan.tuner.seeds, octoplan.tuner.neighbourhoods), with no change to the search."""

from __future__ import annotations

import pytest

from octoplan.tuner import TuneOptions, tune
from octoplan.tuner.climb import Search
from octoplan.tuner.neighbourhoods import NEIGHBOURHOODS, BasicMoves, Neighbourhood
from octoplan.tuner.seeds import SEED_FAMILIES, SeedFamily
from octoplan.tuner.space import Evaluator
from tests.conftest import free_cluster, make_profile


def _uneven():
    # 8 uneven layers on 4 ranks, 8 microbatches: the whole search reaches 85 ms (a justified
    # order); tuning the partition alone from the baselines stops at zbv's 95 ms
    profile = make_profile([(1, 1, 0)] + [(2, 2, 1)] * 6 + [(3, 3, 2)], act=10**6, out=10**6, params=10**6)
    return profile, free_cluster(4)


FULL = TuneOptions(gpus=4, pp=4, microbatches=8, time_limit_s=60, max_plans=400)
PARTITION_ONLY = TuneOptions(gpus=4, pp=4, microbatches=8, time_limit_s=60, max_plans=400, dimensions=("partition",))


class WarmStart(SeedFamily):
    """Seeds the search with a plan known beforehand (say, an earlier run's)."""

    name = "warm start"

    def __init__(self, plan):
        self.plan = plan
        self.asked: list = []

    def seeds(self, ctx, config, earlier):
        self.asked.append((config, len(earlier)))
        if config == self.plan.config:
            yield self.plan


class JustifiedBest(SeedFamily):
    """From the ranked seeds: the best one's order justified."""

    name = "the best seed justified"

    def from_ranked(self, ctx, ranked):
        _, index, best = ranked[0]
        for moved in ctx.search.justified(best):
            yield index, moved


def test_a_seed_family_plugged_in_seeds_the_search():
    profile, cluster = _uneven()
    known = tune(profile, cluster, FULL)
    assert known.scored.iteration_ms == pytest.approx(85.0)
    alone = tune(profile, cluster, PARTITION_ONLY)
    assert alone.scored.iteration_ms == pytest.approx(95.0)

    # a family's seeds of each configuration are ranked with the baselines, and win
    plan = known.candidate
    warm = WarmStart(plan)
    found = tune(profile, cluster, PARTITION_ONLY, seed_families=SEED_FAMILIES + (warm,))
    assert warm.asked == [(plan.config, len(alone.baselines))]  # after the baselines of its configuration
    assert found.scored.iteration_ms == pytest.approx(85.0)
    assert found.candidate == plan and found.candidate.fixed == plan.fixed
    assert found.stats["seeds"] == alone.stats["seeds"] + 1

    # a family's seeds made from the ranked ones: the best baseline (zbv) justified
    derived = tune(profile, cluster, PARTITION_ONLY, seed_families=(JustifiedBest(),))
    assert derived.scored.iteration_ms < 95.0
    assert derived.candidate.origin.startswith("zbv/") and "justified" in derived.candidate.origin


class JustifyAnyway(Neighbourhood):
    """The whole order justified, whatever dimensions the search tunes."""

    name = "justified, whatever the dimensions"

    def moves(self, search, cand, timeline, deadline):
        yield from search.justified(cand)


class Recording(Neighbourhood):
    """Yields nothing; records the candidates it was asked about."""

    name = "recording"

    def __init__(self, dimensions=()):
        self.dimensions = dimensions
        self.asked: list = []

    def moves(self, search, cand, timeline, deadline):
        self.asked.append((cand, timeline.iteration_ms))
        return iter(())


def test_a_neighbourhood_plugged_in_moves_the_climbs():
    profile, cluster = _uneven()
    found = tune(profile, cluster, PARTITION_ONLY, neighbourhoods=NEIGHBOURHOODS + (JustifyAnyway(),))
    assert found.scored.iteration_ms < 95.0
    assert "justified" in found.candidate.origin


def test_a_neighbourhood_is_asked_at_the_local_optima_of_those_before_it_and_only_for_its_dimensions():
    profile, cluster = _uneven()
    evaluator = Evaluator(profile, cluster)
    start = next(row.candidate for row in tune(profile, cluster, PARTITION_ONLY).baselines if row.name == "zbv/uniform")
    after_basic, needs_placement = Recording(), Recording(("placement",))
    search = Search(evaluator, PARTITION_ONLY, None,
                    neighbourhoods=(BasicMoves(), after_basic, needs_placement, JustifyAnyway()))
    end = search.climb(start, deadline=600)  # far beyond where the climb ends, at a local optimum
    assert needs_placement.asked == []  # the search tunes the partition alone
    # asked, with the candidate's timeline, at every step where the basic moves found nothing
    # better: before each justification the climb took, and at its end
    assert [cand for cand, _ in after_basic.asked][-1] == end
    assert all(ms == evaluator.score(cand).iteration_ms for cand, ms in after_basic.asked)
    assert len(after_basic.asked) == sum(1 for move in search.accepted_moves if "justified" in move) + 1
    assert evaluator.score(end).iteration_ms < 95.0
