"""Restarts: climbs again from the first seeds on shaken layer times (octoplan.tuner.climb)."""

from __future__ import annotations

import random

import pytest

from octoplan.plan import plan_to_dict
from octoplan.profile import Layer, ModelRef, Profile
from octoplan.simulator import simulate
from tests.conftest import free_cluster, make_profile


def test_shaken_times_draw_one_gaussian_per_time_in_layer_order():
    layers = (Layer("a", "layer", 1.0, 2.0, 3.0, 10, 20, 30), Layer("b", "layer", 4.0, 5.0, 6.0, 40, 50, 60, backward_ms=9.0))
    profile = Profile(model=ModelRef("m"), layers=layers)
    rng = random.Random(11)
    # layer a: F, I, W; layer b: F, I, W and its measured fused B
    want = [ms * (1 + 0.01 * rng.gauss(0, 1)) for ms in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 9.0)]
    shaken = profile.shaken(0.01, 11)
    got = [shaken.layers[0].forward_ms, shaken.layers[0].backward_input_ms, shaken.layers[0].backward_weight_ms,
           shaken.layers[1].forward_ms, shaken.layers[1].backward_input_ms, shaken.layers[1].backward_weight_ms,
           shaken.layers[1].backward_ms]
    assert got == want and got != [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 9.0]
    # only the times move
    assert [(l.name, l.param_bytes, l.activation_bytes, l.output_bytes) for l in shaken.layers] == \
        [(l.name, l.param_bytes, l.activation_bytes, l.output_bytes) for l in layers]
    assert profile.shaken(0.01, 11) == shaken and profile.shaken(0.01, 12) != shaken
    assert profile.shaken(0.0, 11) == profile
    # never below 0, however large the noise
    wild = profile.shaken(10.0, 3)
    assert all(ms >= 0 for l in wild.layers for ms in (l.forward_ms, l.backward_input_ms, l.backward_weight_ms))
    assert any(ms == 0 for l in wild.layers for ms in (l.forward_ms, l.backward_input_ms, l.backward_weight_ms))


class _StubSearch:
    """What Restarts asks of a search: a clock, restart() (answering from ``wins``) and its count."""

    def __init__(self, wins):
        self.wins = iter(wins)
        self.calls = []
        self.restarts = 0
        self.clock = type("Clock", (), {"elapsed": lambda _: 0.0})()

    def restart(self, start, *, deadline):
        self.restarts += 1
        self.calls.append(start)
        return next(self.wins)


def test_restarts_take_the_seeds_in_turn_until_three_rounds_in_a_row_find_nothing():
    from octoplan.tuner.climb import RESTART_PATIENCE, Restarts

    assert RESTART_PATIENCE == 3
    stub = _StubSearch([False, True, False, True] + [False] * 6)
    restarts = Restarts(stub, ["a", "b"])
    while not restarts.done:
        restarts.next(60.0)
    # a win at the 2nd and the 4th; then 3 rounds of 2 seeds that find nothing
    assert stub.calls == ["a", "b", "a", "b"] + ["a", "b"] * 3
    assert Restarts(stub, []).done  # no seeds, no restarts


def test_restarts_stop_at_the_deadline():
    from octoplan.tuner.climb import Restarts

    stub = _StubSearch([False] * 10)
    stub.clock = type("Clock", (), {"elapsed": lambda _: 60.0})()
    restarts = Restarts(stub, ["a"])
    restarts.next(60.0)
    assert stub.calls == [] and not restarts.done


def test_restarts_find_a_faster_plan_judged_on_the_true_times(monkeypatch):
    # 7 uneven layers on 4 ranks, 4 microbatches, on a budget of plans (deterministic); found
    # by a seeded random search over small cases. Without restarts the search ends at 70 ms
    # with budget to spare; climbs from its first seeds again, on times shaken by 0.1%, find a
    # plan of 64 ms, and the plan written is priced on the true times.
    import octoplan.tuner.climb as climb
    from octoplan.tuner import TuneOptions, tune

    profile = make_profile([(4, 1, 2), (4, 1, 3), (4, 3, 2), (2, 2, 1), (1, 2, 3), (3, 3, 1), (3, 1, 3)])
    opts = TuneOptions(gpus=4, pp=4, microbatches=4, max_plans=3000, time_limit_s=600)
    found = {}
    for patience in (0, climb.RESTART_PATIENCE):
        monkeypatch.setattr(climb, "RESTART_PATIENCE", patience)
        found[patience] = tune(profile, free_cluster(4), opts)
    without, with_restarts = found[0], found[climb.RESTART_PATIENCE]
    assert without.stats["restarts"] == 0 and without.stats["evaluations"] < 3000 * 0.95
    assert without.scored.iteration_ms == 70.0
    assert with_restarts.stats["restarts"] > 0
    assert with_restarts.scored.iteration_ms == 64.0
    assert simulate(with_restarts.plan, profile).iteration_ms == pytest.approx(64.0)
    # the restarts' draws come from the seed: the same run again gives the same plan, to the
    # plan simulated
    again = tune(profile, free_cluster(4), opts)
    strip = lambda result: {k: v for k, v in plan_to_dict(result.plan).items() if k != "tuner"}
    assert strip(again) == strip(with_restarts)
    assert again.stats["evaluations"] == with_restarts.stats["evaluations"]
    assert again.stats["plans_in_restarts"] == with_restarts.stats["plans_in_restarts"] > 0


def test_a_restart_that_ends_a_rounding_error_faster_is_no_win(monkeypatch):
    # Float layer times: a restart may end on a plan of the same true time whose sum came out
    # in another order (7.900000000000001 -> 7.9 ms). Counted as a win, it would reset the
    # stopping rule every time; only a gain the climbs would accept (a relative 1e-9) counts.
    from octoplan.tuner import TuneOptions, tune
    from octoplan.tuner.climb import Search

    outcomes = []
    restart = Search.restart

    def recorded(self, start, *, deadline):
        before = self.best_scored.score[1]
        won = restart(self, start, deadline=deadline)
        outcomes.append((won, before, self.best_scored.score[1]))
        return won

    monkeypatch.setattr(Search, "restart", recorded)
    a, b, c = (0.7, 0.1, 0.2), (0.3, 0.3, 0.3), (0.1, 0.2, 0.3)
    tune(make_profile([a, b, a, a, b, c]), free_cluster(4),
         TuneOptions(gpus=4, pp=4, microbatches=4, max_plans=1500, time_limit_s=600, seed=14, use_cpsat=False))
    slivers = [(won, old, new) for won, old, new in outcomes if 0 < old - new < 1e-9 * old]
    gains = [(won, old, new) for won, old, new in outcomes if old - new >= 1e-9 * old]
    assert slivers and not any(won for won, _, _ in slivers)
    assert gains and all(won for won, _, _ in gains)  # 7.9 -> 7.7 ms
