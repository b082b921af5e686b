"""Chain shifts (octoplan.tuner.neighbourhoods.chains): a layer passed along a run of stages, and
the final polish that climbs over them; the pacing of the justifications, the climbs' and the
seeds'."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from octoplan.ops import parse_ops
from octoplan.tuner import TuneOptions
from octoplan.tuner.climb import Search, climbs_end_s, polish_end_s
from octoplan.tuner.moves import heat_of
from octoplan.tuner.neighbourhoods import NEIGHBOURHOODS, ChainShifts
from octoplan.tuner.neighbourhoods.chains import chain_shifts
from octoplan.tuner.search import _ranked
from octoplan.tuner.seeds import JustifiedSeeds, RecomputingCopies, SeedContext
from octoplan.tuner.space import ORDER_RULES, Candidate, Config, Evaluator
from tests.conftest import free_cluster, make_profile

# 1F1B with split backwards on 3 ranks, 3 microbatches
ONE_F_ONE_B = (tuple(parse_ops("0F0 0F1 0F2 0I0 0W0 0I1 0W1 0I2 0W2")),
               tuple(parse_ops("1F0 1F1 1I0 1W0 1F2 1I1 1W1 1I2 1W2")),
               tuple(parse_ops("2F0 2I0 2W0 2F1 2I1 2W1 2F2 2I2 2W2")))


def _three_ranks(times) -> tuple[Evaluator, Candidate]:
    evaluator = Evaluator(make_profile(times), free_cluster(3))
    cand = Candidate(Config(3, 1, 3), (0, 2, 4, 6), (0, 1, 2), None, ONE_F_ONE_B, "1f1b", "1f1b")
    return evaluator, cand


def test_the_chains_take_a_layer_off_the_rank_that_finishes_last_to_every_other_stage():
    # Rank 0 finishes last, as in every 1F1B order: its last backward waits for every other
    # rank's. Stage 0 passes its last layer on: to stage 1 (boundary 1 one layer earlier) or
    # through stage 1 to stage 2 (boundaries 1 and 2 both). Stage 2 holds the lightest layers,
    # so rank 2 is the coolest and its move comes first.
    evaluator, cand = _three_ranks([(2, 2, 2)] * 4 + [(1, 1, 1)] * 2)
    timeline = evaluator.timeline(cand)
    assert [timeline.idle_parts(r)[2] for r in range(3)][0] == 0.0
    assert min(timeline.idle_parts(r)[2] for r in (1, 2)) > 0.0
    heat = heat_of(timeline)
    assert heat.heat(2) < heat.heat(1)
    assert chain_shifts(cand, timeline) == [((0, 1, 3, 6), "chain: stage 0's last layer to stage 2"),
                                            ((0, 1, 4, 6), "chain: stage 0's last layer to stage 1")]


def test_a_chain_back_through_earlier_stages_and_none_from_a_single_layer_stage():
    # A V on 2 ranks whose rank 0 finishes last (layer 0's W of 3 ms comes last). Stage 2
    # (layers 4 and 5, on rank 0) passes its first layer back to stage 1, or through it to
    # stage 0, which is on rank 0 itself and not offered; rank 0's stage 0 has a single layer
    # and offers nothing.
    evaluator = Evaluator(make_profile([(1, 1, 3)] + [(1, 1, 1)] * 5), free_cluster(2))
    order = (tuple(parse_ops("0F0 0F1 0F2 2F0 2I0 2W0 2F1 2I1 2W1 2F2 2I2 2W2 0I0 0W0 0I1 0W1 0I2 0W2")),
             tuple(parse_ops("1F0 1F1 1F2 1I0 1W0 1I1 1W1 1I2 1W2")))
    cand = Candidate(Config(2, 1, 3), (0, 1, 4, 6), (0, 1, 0), None, order, "v", "v")
    timeline = evaluator.timeline(cand)
    assert timeline.idle_parts(0)[2] == 0.0 < timeline.idle_parts(1)[2]
    assert chain_shifts(cand, timeline) == [((0, 1, 5, 6), "chain: stage 2's first layer to stage 1")]


def test_a_chain_keeps_the_order_and_the_stages_between_keep_their_load():
    # deepseek-v3's pattern in small: blocks of a light and a heavy layer. Passing stage 0's
    # last layer through stage 1 to stage 2 leaves stage 1 one light and one heavy layer.
    evaluator, cand = _three_ranks([(1, 1, 1), (3, 3, 3)] * 3)
    moved_bounds = (0, 1, 3, 6)
    [moved] = [c for c in ChainShifts(8).moves(_search(evaluator), cand, evaluator.timeline(cand), 1e9)
               if c.bounds == moved_bounds and c.fixed == cand.fixed]
    before, after = evaluator.costs(cand), evaluator.costs(moved)
    assert after[1].forward_ms == before[1].forward_ms == 4.0
    assert (after[0].forward_ms, after[2].forward_ms) == (1.0, 7.0)


def _search(evaluator: Evaluator, **opts) -> Search:
    return Search(evaluator, TuneOptions(gpus=3, pp=3, microbatches=3, **{"time_limit_s": 600, **opts}), None)


def test_justifications_in_a_climb_are_paced_against_its_deadline_unless_plans_are_the_budget():
    evaluator, cand = _three_ranks([(1, 1, 1)] * 6)
    search = _search(evaluator)
    search._justify_pace = 1e6  # seconds per op: no justification ends in time
    assert search.justified_by(cand, deadline=599.0) == []
    search._justify_pace = 1e-9
    done = search.justified_by(cand, deadline=599.0)
    assert done == search.justified(cand) and search._justify_pace < 1.0
    budgeted = _search(evaluator, max_plans=100)
    budgeted._justify_pace = 1e6  # a plan budget is measured in plans: it always runs
    assert budgeted.justified_by(cand, deadline=0.0) == search.justified(cand)


def test_the_justified_seeds_are_paced_against_the_climbs_end():
    # a justification started just before the time limit would end after it
    evaluator, cand = _three_ranks([(1, 1, 1)] * 2 + [(2, 3, 1)] * 2 + [(1, 1, 1)] * 2)
    search = _search(evaluator)
    ctx = SeedContext(search, [cand.config], 1)
    ranked = [(search.offer(cand).score, 0, cand)]
    justified = search.justified(cand)
    assert justified
    search._justify_pace = 1e6
    assert list(JustifiedSeeds().from_ranked(ctx, ranked)) == []
    search._justify_pace = 1e-9
    assert list(JustifiedSeeds().from_ranked(ctx, ranked)) == [(0, c) for c in justified]


def test_seeds_are_priced_until_the_climbs_end_and_the_rest_is_the_final_plans(monkeypatch):
    # 58.5 s into a 60 s tune: past the climbs' end (57 s), before the limit. Only the first
    # seed is priced (the search needs a best plan), and no recomputing copy is made
    evaluator, cand = _three_ranks([(1, 1, 1)] * 6)
    search = _search(evaluator, time_limit_s=60)
    monkeypatch.setattr(search.clock, "elapsed", lambda: 58.5)
    assert climbs_end_s(60) == 57.0 and not search.clock.out()
    ctx = SeedContext(search, [cand.config], 1)
    other = dataclasses.replace(cand, bounds=(0, 1, 3, 6), origin="other")
    ranked = _ranked(ctx, [RecomputingCopies()], [cand, other])
    assert [item[2] for item in ranked] == [cand] and search.ev.evaluations == 1


def test_a_configuration_is_seeded_only_where_it_should_end_by_the_climbs_end(monkeypatch):
    # every configuration's seeding takes 3 s of a 10 s tune whose climbs end at 9.25 s: the
    # first three start at 0, 3 and 6 s; a fourth at 9 s would end at 12, past the limit itself
    # (it started, since the limit was not yet out)
    from octoplan.tuner.search import _seeds
    from octoplan.tuner.seeds.base import SeedFamily

    evaluator, cand = _three_ranks([(1, 1, 1)] * 6)
    search = _search(evaluator, time_limit_s=10)
    now = [0.0]
    monkeypatch.setattr(search.clock, "elapsed", lambda: now[0])
    seeded: list[Config] = []

    class ThreeSeconds(SeedFamily):
        name = "three seconds"

        def seeds(self, ctx, config, earlier):
            seeded.append(config)
            now[0] += 3.0
            return ()

    configs = [Config(3, 1, m) for m in (3, 6, 9, 12)]
    assert climbs_end_s(10) == 9.25
    _seeds(SeedContext(search, configs, 1), [ThreeSeconds()], [])
    assert seeded == configs[:3] and now[0] == 9.0


def test_chain_shifts_are_the_polishs_alone():
    assert [type(n).__name__ for n in NEIGHBOURHOODS if n.polish] == ["ChainShifts"]
    assert [type(n).__name__ for n in NEIGHBOURHOODS if not n.climbs] == ["ChainShifts"]


def test_a_chain_shift_gets_a_climb_past_a_local_optimum():
    # tests/test_tuner_carry.py's case: 7 uneven layers on 3 ranks, 6 microbatches, from 1F1B.
    # Every other move but the peels (and the shifting-bottleneck reordering, off in both
    # climbs there too) stops at 120 ms; from there a climb over the chain shifts goes on to
    # 115 ms: stage 0's last layer passed through stage 1 to stage 2, the order justified.
    from octoplan.baseline import make_baseline
    from octoplan.tuner.neighbourhoods import BottleneckOrder, PeeledAndJustified

    profile, cluster = make_profile([(1, 4, 1), (2, 2, 3), (1, 4, 2), (3, 3, 3), (4, 3, 1), (2, 3, 1), (1, 1, 2)]), free_cluster(3)
    base = make_baseline(profile, schedule="1f1b", gpus=3, microbatches=6, cluster=cluster)
    start = Candidate(Config(3, 1, 6), (0,) + tuple(s.end for s in base.stages), tuple(s.rank for s in base.stages), None,
                      tuple(tuple(ops) for ops in base.schedule), "1f1b", "1f1b")
    chosen = [n for n in NEIGHBOURHOODS if not isinstance(n, (BottleneckOrder, PeeledAndJustified))]
    evaluator = Evaluator(profile, cluster)
    climber = Search(evaluator, TuneOptions(gpus=3, pp=3, microbatches=6, time_limit_s=600), None, neighbourhoods=chosen)
    stuck = climber.climb(start, deadline=600)  # the chain shifts are not among a climb's moves
    assert evaluator.score(stuck).iteration_ms == 120.0 and not any(m.startswith("chain") for m in climber.accepted_moves)
    on = Search(evaluator, TuneOptions(gpus=3, pp=3, microbatches=6, time_limit_s=600), None, neighbourhoods=chosen)
    end = on.climb(stuck, deadline=600, only=[ChainShifts()])
    assert evaluator.score(end).iteration_ms == 115.0
    assert on.accepted_moves == ["chain: stage 0's last layer to stage 2, justified (in flight unbounded)"]


def test_the_polish_climbs_over_the_chain_shifts_from_the_best_plan():
    # the same case: the plan the climb without chain shifts ends at (120 ms) as the search's
    # best, then the polish
    from octoplan.baseline import make_baseline
    from octoplan.tuner.neighbourhoods import BottleneckOrder, PeeledAndJustified

    profile, cluster = make_profile([(1, 4, 1), (2, 2, 3), (1, 4, 2), (3, 3, 3), (4, 3, 1), (2, 3, 1), (1, 1, 2)]), free_cluster(3)
    base = make_baseline(profile, schedule="1f1b", gpus=3, microbatches=6, cluster=cluster)
    start = Candidate(Config(3, 1, 6), (0,) + tuple(s.end for s in base.stages), tuple(s.rank for s in base.stages), None,
                      tuple(tuple(ops) for ops in base.schedule), "1f1b", "1f1b")
    opts = TuneOptions(gpus=3, pp=3, microbatches=6, time_limit_s=600)
    evaluator = Evaluator(profile, cluster)
    without = [n for n in NEIGHBOURHOODS if not isinstance(n, (BottleneckOrder, PeeledAndJustified, ChainShifts))]
    stuck = Search(evaluator, opts, None, neighbourhoods=without).climb(start, deadline=600)
    assert evaluator.score(stuck).iteration_ms == 120.0
    search = Search(evaluator, opts, None)
    search.offer(stuck)
    search.polish()
    # the chain shift first (115 ms, the climb above), then a climb over every neighbourhood
    # from it, since the polish found a faster plan
    assert search.accepted_moves[0] == "chain: stage 0's last layer to stage 2, justified (in flight unbounded)"
    assert search.best_scored.iteration_ms == 107.0


def test_the_polishs_rebuilds_end_by_its_end_and_leave_the_rest_to_the_final_plan(monkeypatch):
    # 58.5 s into a 60 s tune, rebuilds estimated to take no time: past the polish's end (58 s),
    # so none runs (a rebuild's pace, taken from smaller layouts, can be off by half)
    evaluator, cand = _three_ranks([(1, 1, 1)] * 2 + [(2, 3, 1)] * 2 + [(1, 1, 1)] * 2)
    search = _search(evaluator, time_limit_s=60)
    search.offer(cand)
    search._rebuild_pace = {rule: 1e-12 for rule in ORDER_RULES}
    monkeypatch.setattr(search.clock, "elapsed", lambda: 58.5)
    assert polish_end_s(60) == 58.0 and not search.clock.out()
    search.polish()
    assert all(not done for done in search._rebuilt.values())
    monkeypatch.setattr(search.clock, "elapsed", lambda: 57.5)
    search.polish()
    assert all(cand in done for done in search._rebuilt.values())


def test_the_suite_benchmark_names_the_neighbourhoods_it_can_leave_out(monkeypatch):
    # `bench_tuner.py suite --without-moves "chain shifts"` is how docs/BENCHMARKS.md measures
    # what the move buys; a name that is no neighbourhood stops before any tune, listing them
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks import bench_tuner

    monkeypatch.setattr(sys, "argv", ["bench_tuner.py", "suite", "--without-moves", "chains"])
    with pytest.raises(SystemExit) as stop:
        bench_tuner.main()
    assert str(stop.value).startswith("bench_tuner.py: --without-moves chains: no such neighbourhood; use one of: ")
    assert "'chain shifts'" in str(stop.value)
