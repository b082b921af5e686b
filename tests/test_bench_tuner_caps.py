"""benchmarks/bench_tuner.py's balance caps: the best balance of any assignment of layers to
ranks, and of a V layout (stages r and 2 pp - 1 - r on rank r), against hand-computed answers
and against enumerating every cut of small models."""

from __future__ import annotations

import itertools
import random
import sys
from pathlib import Path

import pytest

from octoplan.profile import Layer, ModelRef, Profile

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_tuner import balance_cap, v_cut_balance  # noqa: E402


def _profile(work_ms: list[float]) -> Profile:
    """Layers whose F + I + W is ``work_ms`` (split 1 : 1 : 1, as only the sum counts)."""
    layers = tuple(Layer(f"layer.{i}", "block", w / 3, w / 3, w / 3, 1024, 1024, 1000) for i, w in enumerate(work_ms))
    return Profile(model=ModelRef("caps"), layers=layers, microbatch_size=1)


def test_heavy_ends_cap_a_v_but_not_a_free_assignment():
    # total 12 on 2 ranks: {4, 1, 1} and {1, 1, 4} balance perfectly, but a V puts the first
    # and the last layer (stages 0 and 3) on rank 0: 8 of work against the ideal 6
    profile = _profile([4, 1, 1, 1, 1, 4])
    assert balance_cap(profile, 2) == pytest.approx((1.0, 1.0))
    assert v_cut_balance(profile, 2) == pytest.approx((0.75, 0.75))


def test_a_v_cut_needs_two_layers_per_rank():
    assert all(v != v for v in v_cut_balance(_profile([1, 1, 1]), 2))  # nan: 4 stages of 3 layers


def _best_v_by_enumeration(work: list[int], pp: int) -> float:
    stages = 2 * pp
    prefix = list(itertools.accumulate(work, initial=0))
    busiest = min(
        max(prefix[cuts[r + 1]] - prefix[cuts[r]] + prefix[cuts[stages - r]] - prefix[cuts[stages - 1 - r]]
            for r in range(pp))
        for inner in itertools.combinations(range(1, len(work)), stages - 1)
        for cuts in [(0, *inner, len(work))])
    return max(sum(work) / pp, max(work)) / busiest


@pytest.mark.parametrize("pp", [2, 3])
def test_v_cut_matches_every_cut_enumerated(pp):
    rng = random.Random(pp)
    for _ in range(8):
        work = [rng.randint(1, 30) for _ in range(rng.randint(2 * pp, 10))]
        found, proven = v_cut_balance(_profile(work), pp)
        assert found == pytest.approx(_best_v_by_enumeration(work, pp), rel=1e-9), work
        assert proven == pytest.approx(found, rel=1e-9), work  # optimal, not only feasible
