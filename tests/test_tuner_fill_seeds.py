"""The fill-capped seed family (octoplan.tuner.seeds.fill_capped): a V and a loop of two stages
per rank at the fill caps' cut points, in tunes long enough to pay for CP-SAT."""

from __future__ import annotations

from octoplan.tuner.fill_caps import fill_cap, shape_ranks
from octoplan.tuner.search import TuneOptions, _Search
from octoplan.tuner.seeds import SEED_FAMILIES, FillCappedSeeds, SeedContext
from octoplan.tuner.seeds.fill_capped import FILL_SEED_TIME_S
from octoplan.tuner.space import Config, Evaluator
from tests.conftest import free_cluster, make_profile

# uneven layers, a thick one first and a head last: the fill and the balance pull apart
PROFILE = make_profile([(3, 4, 1), (1, 2, 1), (1, 2, 1), (2, 3, 2), (1, 2, 1), (2, 2, 1), (1, 1, 1), (4, 6, 2)])


def _context(time_limit_s: float, **opts) -> SeedContext:
    search = _Search(Evaluator(PROFILE, free_cluster(2)),
                     TuneOptions(gpus=2, pp=2, microbatches=4, time_limit_s=time_limit_s, chunks_max=2, **opts), None)
    return SeedContext(search=search, configs=[Config(2, 1, 4)], baseline_chunks=1)


def test_the_seeds_hold_the_fill_caps_cut_points():
    ctx = _context(60)
    family = next(f for f in SEED_FAMILIES if isinstance(f, FillCappedSeeds))
    assert family.applies(ctx)
    seeds = family.seeds(ctx, Config(2, 1, 4), ())
    expected = {}
    for shape, label in (("zigzag", "V"), ("loop", "loop x2")):
        ranks = shape_ranks(shape, 2, 2)
        cap = fill_cap(PROFILE, free_cluster(2), microbatches=4, ranks=ranks, time_limit_s=FILL_SEED_TIME_S)
        expected[label] = (cap.bounds, ranks)
    # three policy settings per layout, named after its shape
    assert len(seeds) == 6 and all(s.policies is not None for s in seeds)
    for s in seeds:
        label = s.origin.split(",")[0].removeprefix("fill-capped ")
        assert (s.bounds, s.ranks) == expected[label], s.origin
    assert [entry["shape"] for entry in ctx.stats["fill_capped"]] == ["V", "loop x2"]
    # the other rank order of the same pp and microbatches reuses the solves
    again = family.seeds(ctx, Config(2, 1, 4, "dp-inner"), ())
    assert [(s.bounds, s.ranks) for s in again] == [(s.bounds, s.ranks) for s in seeds]
    assert len(ctx.stats["fill_capped"]) == 2


def test_the_seeds_are_reordered_longest_tail_first():
    ctx = _context(60)
    family = FillCappedSeeds()
    search = ctx.search
    seeds = family.seeds(ctx, Config(2, 1, 4), ())
    ranked = sorted(((search.offer(c).score, i, c) for i, c in enumerate(seeds)), key=lambda item: item[:2])
    made = list(family.from_ranked(ctx, ranked))
    # one rebuild per layout, from its best-ranked seed, each named after it
    layouts = {(c.bounds, c.ranks) for _, c in made}
    assert layouts == {(s.bounds, s.ranks) for s in seeds}
    for index, cand in made:
        assert cand.fixed is not None and cand.origin.startswith(seeds[index].origin + ", longest-tail-first order")


def test_short_tunes_and_fixed_placements_go_without():
    short = _context(10)
    assert FillCappedSeeds().seeds(short, Config(2, 1, 4), ()) == []
    assert "fill_capped" not in short.stats or not short.stats["fill_capped"]
    assert not FillCappedSeeds().applies(_context(60, runs_on="loop"))
    assert not FillCappedSeeds().applies(_context(60, dimensions=("partition", "schedule")))


def test_a_solve_starts_only_if_it_should_end_within_the_familys_share(monkeypatch):
    # 6 s into a 60 s tune, after a solve of another pp that took 10 s: the next would end
    # after 15 s, a quarter of the limit. Under a plan budget the clock counts plans, which no
    # solve adds, and it runs
    for max_plans, solved in ((None, 0), (1000, 2)):
        ctx = _context(60, max_plans=max_plans)
        monkeypatch.setattr(ctx.search.clock, "elapsed", lambda: 6.0)
        ctx.stats["fill_capped"] = [{"pp": 4, "microbatches": 8, "shape": "V", "bounds": None, "wall_s": 10.0}]
        FillCappedSeeds().seeds(ctx, Config(2, 1, 4), ())
        assert len(ctx.stats["fill_capped"]) == 1 + solved
    ctx = _context(60)
    monkeypatch.setattr(ctx.search.clock, "elapsed", lambda: 6.5)  # 6.5 + 8 s before the first solve
    FillCappedSeeds().seeds(ctx, Config(2, 1, 4), ())
    assert [s["shape"] for s in ctx.stats["fill_capped"]] == ["V", "loop x2"]


def test_on_the_clock_a_solve_never_runs_past_the_familys_share(monkeypatch):
    # 5 s into a 60 s tune, the solves may take what is left of its quarter, 10 s of wall time;
    # under a plan budget no wall time caps them, so the tune stays deterministic
    import octoplan.tuner.seeds.fill_capped as module

    for max_plans, expected in ((None, 10.0), (1000, None)):
        walls = []
        monkeypatch.setattr(module, "fill_cap", lambda *a, wall_limit_s=None, **k: walls.append(wall_limit_s))
        ctx = _context(60, max_plans=max_plans)
        monkeypatch.setattr(ctx.search.clock, "elapsed", lambda: 5.0)
        FillCappedSeeds().seeds(ctx, Config(2, 1, 4), ())
        assert walls == [expected, expected]
