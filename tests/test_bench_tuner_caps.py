"""Balance caps (octoplan.tuner.caps and benchmarks/bench_tuner.py): the best balance of any
assignment of layers to ranks, of at most k stages per rank, and of two stages per rank in a
loop and in a V, against hand-computed answers."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from octoplan.profile import Layer, ModelRef, Profile

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_tuner import two_per_rank_balance  # noqa: E402
from octoplan.tuner.caps import balance_cap  # noqa: E402
from octoplan.tuner.cli import _balance_cap_line  # noqa: E402


def _profile(work_ms: list[float]) -> Profile:
    """Layers whose F + I + W is ``work_ms`` (split 1 : 1 : 1, as only the sum counts)."""
    layers = tuple(Layer(f"layer.{i}", "block", w / 3, w / 3, w / 3, 1024, 1024, 1000) for i, w in enumerate(work_ms))
    return Profile(model=ModelRef("caps"), layers=layers, microbatch_size=1)


def test_heavy_ends_cap_a_v_but_neither_a_loop_nor_a_free_assignment():
    # total 12 on 2 ranks: {4, 1, 1} and {1, 1, 4} balance perfectly, and so does the loop
    # {4} + {1, 1} | {1, 1} + {4}; a V puts the first and the last layer (stages 0 and 3) on
    # rank 0: 8 of work against the ideal 6
    profile = _profile([4, 1, 1, 1, 1, 4])
    assert balance_cap(profile, 2) == pytest.approx((1.0, 1.0))
    assert two_per_rank_balance(profile, 2) == pytest.approx((1.0, 0.75))


def test_two_per_rank_needs_two_layers_per_rank():
    assert all(math.isnan(b) for b in two_per_rank_balance(_profile([1, 1, 1]), 2))  # 4 stages of 3 layers


def test_stages_per_rank_cap_counts_alternating_layers():
    # layers 1, 10, 1, 10, 1, 10 (three cheap even-indexed, three costly odd-indexed) on 2
    # ranks, 16.5 each at best. One stage per rank: the cuts give 1 | 32, 11 | 22, 12 | 21,
    # 22 | 11, 23 | 10, so 21 at best; counting agrees, since a run holds at most one more
    # costly layer than cheap ones, and no split of the counts does better than (2 costly, 1
    # cheap) | (1, 2). Two stages per rank may hold two more: {10, 10} | {1, 10, 1, 1} (the
    # loop [1] [10] [1, 10, 1] [10] on ranks 1 0 1 0), 20, which any assignment also
    # needs: one rank holds two of the 10s.
    profile = _profile([1, 10, 1, 10, 1, 10])
    assert balance_cap(profile, 2, stages_per_rank=1) == pytest.approx((16.5 / 21, 16.5 / 21))
    assert balance_cap(profile, 2, stages_per_rank=2) == pytest.approx((16.5 / 20, 16.5 / 20))
    assert balance_cap(profile, 2) == pytest.approx((16.5 / 20, 16.5 / 20))


def test_stages_per_rank_cap_is_never_above_the_free_assignment_nor_below_an_exact_cut():
    # alternating cheap and costly layers as in a split-block model, with a heavy head
    profile = _profile([1] + [2, 5] * 10 + [9])
    free_found, free_proven = balance_cap(profile, 4)
    loop, v = two_per_rank_balance(profile, 4)  # exact for those two layouts
    found, proven = balance_cap(profile, 4, stages_per_rank=2)
    assert found == pytest.approx(proven)
    assert max(loop, v) - 1e-9 <= proven <= free_proven + 1e-9


def test_the_cap_counts_a_layer_at_its_cheaper_backward():
    # layer b's fused B (1 ms) is cheaper than its I + W (4): the lower bound counts it at
    # 1 + 1, so the three layers weigh 2 each, 3 per rank at best on 2 ranks, and one rank
    # holds two of them: 3 / 4. Counted at F + I + W, b alone (5) would set the bound and the
    # cap would read 1.0.
    layers = (Layer("a", "block", 1, 0.5, 0.5, 1024, 1024, 1000),
              Layer("b", "block", 1, 2, 2, 1024, 1024, 1000, backward_ms=1),
              Layer("c", "block", 1, 0.5, 0.5, 1024, 1024, 1000))
    profile = Profile(model=ModelRef("caps"), layers=layers, microbatch_size=1)
    cap = balance_cap(profile, 2)
    assert tuple(cap) == pytest.approx((0.75, 0.75)) and cap.is_proven


def test_tune_says_whether_a_layout_or_only_finer_layers_could_balance_better():
    profile = _profile([1, 1, 3, 3])  # 4 per rank on 2 ranks: {1, 3} | {1, 3}
    assert _balance_cap_line(profile, 2, 0.8) == (
        "no layout of these layers balances 2 ranks better than 1.000 (proven); the tuned plan balances 0.800")
    assert _balance_cap_line(profile, 2, 1.0) == (
        "no layout of these layers balances 2 ranks better than 1.000 (proven); the tuned plan is at it")
    assert _balance_cap_line(_profile([1, 1, 1]), 2, 0.75).startswith(  # 1.5 a rank at best, 2 at least
        "no layout of these layers balances 2 ranks better than 0.750 (proven); the tuned plan is at it, so only finer layers")


def test_layers_of_no_time_balance_perfectly():
    assert tuple(balance_cap(_profile([0, 0, 0]), 2)) == (1.0, 1.0)
