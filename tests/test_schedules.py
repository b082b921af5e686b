"""Every baseline schedule: exact closed forms with free communication, validity for many
shapes, and clean refusals where a schedule cannot apply."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from octoplan.baseline import make_baseline
from octoplan.errors import InputError
from octoplan.partition import balanced_partition, uniform_partition
from octoplan.schedules import SCHEDULES
from octoplan.simulator import simulate
from octoplan.validate import check_runnable

from conftest import free_cluster, make_profile, uniform_profile

SHAPES = [(2, 4), (3, 6), (4, 4), (4, 8), (4, 12), (4, 16), (8, 16), (8, 32)]


def _run(schedule, p, m, *, layers_per_rank, chunks=None, t=1.0):
    profile = uniform_profile(p * layers_per_rank, t)
    plan = make_baseline(profile, schedule=schedule, gpus=p, microbatches=m, chunks=chunks, cluster=free_cluster(p))
    check_runnable(plan)
    return plan, simulate(plan, profile)


@pytest.mark.parametrize("p,m", SHAPES)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_take_m_plus_p_minus_1_times_f_plus_b(schedule, p, m):
    # Per rank F = 2 (two layers of 1 ms), B = I + W = 4.
    _, result = _run(schedule, p, m, layers_per_rank=2)
    assert result.iteration_ms == pytest.approx((m + p - 1) * (2 + 4))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (4, 12), (8, 16), (8, 24)])
@pytest.mark.parametrize("chunks", [2, 3, 4])
def test_interleaved_1f1b_closed_form(p, m, chunks):
    # m is a multiple of p: M(F+B) + (p-1)(F+B)/V with F, B per rank.
    _, result = _run("interleaved-1f1b", p, m, layers_per_rank=chunks, chunks=chunks)
    f_plus_b = 3.0 * chunks
    assert result.iteration_ms == pytest.approx(m * f_plus_b + (p - 1) * f_plus_b / chunks)


def test_interleaved_1f1b_with_one_chunk_is_1f1b():
    profile = uniform_profile(4, 1.0)
    one = make_baseline(profile, schedule="interleaved-1f1b", gpus=4, microbatches=8, chunks=1, cluster=free_cluster(4))
    assert one.schedule == make_baseline(profile, schedule="1f1b", gpus=4, microbatches=8, cluster=free_cluster(4)).schedule


@pytest.mark.parametrize("p,m", SHAPES)
def test_zb_h1_takes_3mt_plus_p_minus_1_t(p, m):
    t = 2.0  # F = I = W = t per rank
    _, result = _run("zb-h1", p, m, layers_per_rank=1, t=t)
    assert result.iteration_ms == pytest.approx(3 * m * t + (p - 1) * t)


@pytest.mark.parametrize("p,m", [(p, m) for p, m in SHAPES if m >= 2 * p - 1])
def test_zbv_takes_3mt_plus_half_p_minus_1_t(p, m):
    # Two chunks per rank of t/2 each, so F = I = W = t per rank.
    _, result = _run("zbv", p, m, layers_per_rank=2, t=0.5)
    t = 1.0
    assert result.iteration_ms == pytest.approx(3 * m * t + (p - 1) * t / 2)


@pytest.mark.parametrize("p,m", [(2, 4), (3, 6), (4, 8), (4, 12), (6, 12), (8, 16), (8, 32)])
def test_zb_h2_leaves_no_gap_between_a_ranks_first_and_last_op(p, m):
    _, result = _run("zb-h2", p, m, layers_per_rank=1)
    assert result.iteration_ms == pytest.approx(3 * m + (p - 1))  # F = I = W = 1: the ramp only
    for rank in range(p):
        spans = result.spans(rank)
        for before, after in zip(spans, spans[1:]):
            assert after.start_ms == pytest.approx(before.end_ms), (rank, before.op, after.op)
        assert spans[0].start_ms == pytest.approx(rank)  # the parallelogram's slanted edge


def test_zb_h1_holds_no_more_activations_than_1f1b_and_zb_h2_about_twice():
    p, m = 4, 16
    profile = make_profile([(1, 1, 1)] * p, act=100)
    peaks = {}
    for name in ("1f1b", "zb-h1", "zb-h2"):
        plan = make_baseline(profile, schedule=name, gpus=p, microbatches=m, cluster=free_cluster(p))
        peaks[name] = simulate(plan, profile).peak_memory_bytes
    assert peaks["1f1b"] == tuple(100 * (p - r) for r in range(p))
    # W frees the activations, so a rank lagging r Ws holds r more, but the peak over ranks
    # stays 1F1B's: rank r holds at most (p - r) + r.
    assert max(peaks["zb-h1"]) == max(peaks["1f1b"]) == 100 * p
    # ZB-H2: every rank holds 2p - 1 (the paper's peak): rank r's 2(p - r) - 1 forwards before
    # its first backward, plus the 2r Ws it lags
    assert peaks["zb-h2"] == (100 * (2 * p - 1),) * p


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 9), (3, 10)])
def test_dualpipev_fills_the_pipeline_as_well_as_zbv(p, m):
    _, dual = _run("dualpipev", p, m, layers_per_rank=2, t=0.5)
    _, zbv = _run("zbv", p, m, layers_per_rank=2, t=0.5)
    assert dual.iteration_ms <= zbv.iteration_ms + 1e-9


@settings(max_examples=60, deadline=None)
@given(
    schedule=st.sampled_from(sorted(SCHEDULES)),
    p=st.integers(1, 6),
    m=st.integers(1, 20),
    extra_layers=st.integers(0, 7),
    chunks=st.integers(1, 3),
    partition=st.sampled_from(["uniform", "balanced"]),
    seed=st.integers(0, 10_000),
)
def test_every_generator_validates_for_many_shapes(schedule, p, m, extra_layers, chunks, partition, seed):
    spec = SCHEDULES[schedule]
    if schedule != "interleaved-1f1b":
        chunks = None  # the others fix their stages per rank (tested below)
    num_stages = spec.num_stages(p, chunks or 2)
    import random

    rng = random.Random(seed)
    times = [(rng.uniform(0.1, 3), rng.uniform(0.1, 3), rng.uniform(0.1, 3)) for _ in range(num_stages + extra_layers)]
    profile = make_profile(times, kinds=["embedding"] + ["layer"] * (len(times) - 2) + ["head"] if len(times) >= 2 else None)
    if m < spec.min_microbatches(p):
        with pytest.raises(InputError, match="microbatches"):
            make_baseline(profile, schedule=schedule, gpus=p, microbatches=m, chunks=chunks, partition_method=partition)
        return
    try:
        plan = make_baseline(profile, schedule=schedule, gpus=p, microbatches=m, chunks=chunks, partition_method=partition)
    except InputError as exc:
        # Only the uniform split may run out of layers (embedding and head are pinned).
        assert "cannot fill" in str(exc)
        assert partition == "uniform"
        return
    check_runnable(plan)
    result = simulate(plan, profile)
    assert result.iteration_ms >= result.lower_bound_ms - 1e-9


def test_too_few_layers_and_microbatches_are_refused_with_why():
    profile = uniform_profile(3)
    with pytest.raises(InputError, match="3 layers cannot fill 4 stages") as caught:
        make_baseline(profile, schedule="1f1b", gpus=4, microbatches=8)
    # the uniform split does not send the user to --partition balanced, which cannot fill them either
    assert "balanced" not in caught.value.line() and "uniformly" not in caught.value.line()
    with pytest.raises(InputError, match="3 layers cannot fill 4 stages"):
        make_baseline(profile, schedule="1f1b", gpus=4, microbatches=8, partition_method="balanced")
    with pytest.raises(InputError, match="DualPipeV needs at least 2\\*pp"):
        make_baseline(uniform_profile(8), schedule="dualpipev", gpus=4, microbatches=7)
    with pytest.raises(InputError, match="unknown schedule"):
        make_baseline(profile, schedule="2f2b", gpus=1, microbatches=1)


def test_uniform_partition_is_megatrons_split():
    kinds = ["embedding"] + ["layer"] * 10 + ["head"]
    profile = make_profile([(1, 1, 1)] * 12, kinds=kinds)
    # 10 body layers over 4 stages: 3, 3, 2, 2, embedding joins the first, head the last.
    assert uniform_partition(profile, 4) == [(0, 4), (4, 7), (7, 9), (9, 12)]


def test_balanced_partition_minimizes_the_largest_stage():
    profile = make_profile([(t, 0, 0) for t in (5, 1, 1, 1, 1, 1, 4, 4)])
    bounds = balanced_partition(profile, 3)
    loads = [sum(l.forward_ms for l in profile.layers[s:e]) for s, e in bounds]
    assert bounds == [(0, 3), (3, 7), (7, 8)]  # 5+1+1 | 1+1+1+4 | 4: bottleneck 7
    assert max(loads) == 7


def test_balanced_partition_of_a_fused_backward_order_balances_f_plus_b():
    # F + I + W per layer: 3, 3, 6; F + B (fused backwards measured): 3, 3, 2
    from dataclasses import replace

    profile = make_profile([(1, 1, 1), (1, 1, 1), (1, 2.5, 2.5)])
    profile = profile.with_layers([replace(l, backward_ms=b) for l, b in zip(profile.layers, (2.0, 2.0, 1.0))])
    assert balanced_partition(profile, 2) == [(0, 2), (2, 3)]  # 6 | 6
    assert balanced_partition(profile, 2, fused_backward=True) == [(0, 1), (1, 3)]  # 3 | 5, not 6 | 2
    # 1F1B's order is all B, ZB-H1's splits I and W: each baseline balances what it runs
    stages = lambda schedule: [(st.start, st.end) for st in make_baseline(
        profile, schedule=schedule, gpus=2, microbatches=4, partition_method="balanced").stages]
    assert stages("1f1b") == [(0, 1), (1, 3)] and stages("zb-h1") == [(0, 2), (2, 3)]


@settings(max_examples=80, deadline=None)
@given(costs=st.lists(st.integers(1, 20), min_size=1, max_size=9), stages=st.integers(1, 5))
def test_balanced_partition_matches_brute_force(costs, stages):
    from itertools import combinations

    if stages > len(costs):
        return
    profile = make_profile([(c, 0, 0) for c in costs])
    bounds = balanced_partition(profile, stages)
    assert len(bounds) == stages and all(e > s for s, e in bounds)
    best = min(
        max(sum(costs[a:b]) for a, b in zip((0, *cuts), (*cuts, len(costs))))
        for cuts in combinations(range(1, len(costs)), stages - 1)
    )
    assert max(sum(costs[s:e]) for s, e in bounds) == best
