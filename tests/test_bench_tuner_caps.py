"""benchmarks/bench_tuner.py's balance caps: the best balance of any assignment of layers to
ranks, and of two stages per rank in a loop and in a V, against hand-computed answers."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from octoplan.profile import Layer, ModelRef, Profile

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_tuner import balance_cap, two_per_rank_balance  # noqa: E402


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
