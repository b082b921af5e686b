"""Fill caps (octoplan.tuner.fill_caps): the least iteration time of every layout of one shape,
the pipeline's fill counted. Checked by hand on a small V, against the exact best order of
every cut of small profiles, and on the suite's jamba-v0.1, whose V it caps below 0.88."""

from __future__ import annotations

import dataclasses
import itertools
import random
import sys

import pytest

from octoplan.costs import lower_bound_ms
from octoplan.plan import Cluster
from octoplan.schedules.exact import order_bound
from octoplan.tuner.fill_caps import _figure, _fill_terms, _tables, fill_cap, shape_label, shape_of, shape_ranks
from octoplan.tuner.seeds.base import SPLIT_SETTINGS, with_policies
from octoplan.tuner.space import Config, Evaluator
from tests.conftest import REPO, free_cluster, make_profile, uniform_profile


def test_a_zigzag_runs_down_the_ranks_and_back_up_and_a_loop_starts_again_at_the_first():
    assert shape_ranks("zigzag", 3, 3) == (0, 1, 2, 2, 1, 0, 0, 1, 2)
    assert shape_ranks("loop", 3, 3) == (0, 1, 2, 0, 1, 2, 0, 1, 2)


def test_a_v_of_four_unit_layers_is_capped_by_hand_and_its_best_order_meets_the_cap():
    # Four layers of F = I = W = 1 ms on 2 ranks, 2 microbatches: the V's stages are one layer
    # each, rank 0 holding stages 0 and 3 and rank 1 stages 1 and 2; each rank works 2 x 6 ms.
    # Rank 1 cannot start before the first forward has passed layer 0 (1 ms): 1 + 12 = 13 ms,
    # against the 12 ms of the balance alone. Rank 0's last stage waits for the first
    # microbatch to come down (3 ms) with only stage 0's forwards to run meanwhile:
    # 3 + 2 x (2 + 3) = 13 as well.
    profile, cluster = uniform_profile(4), free_cluster(2)
    cap = fill_cap(profile, cluster, microbatches=2, ranks=shape_ranks("zigzag", 2, 2))
    assert cap is not None and cap.is_proven
    assert cap.found_ms == cap.proven_ms == 13.0
    # and no order does better: CP-SAT's best order of that layout takes the same 13 ms
    best = _best_order_ms(profile, cluster, 2, cap.bounds, (0, 1, 1, 0))
    assert best == pytest.approx(13.0)


def _best_order_ms(profile, cluster, microbatches, bounds, ranks, settings=SPLIT_SETTINGS) -> float:
    """The exact best order of a layout (any in-flight count), by CP-SAT, its backwards split
    or fused as the first of the policy ``settings`` has them."""
    evaluator = Evaluator(profile, cluster)
    pp = max(ranks) + 1
    cand = with_policies(Config(pp, 1, microbatches), bounds, ranks, "test", settings)[0]
    found = order_bound(evaluator.schedule(cand), list(ranks), evaluator.costs(cand), cluster=cluster,
                        parallel=cand.config.parallel(), time_limit_s=20.0, keep_memory=False)
    assert found.status == "OPTIMAL"
    return found.best_ms


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("shape", ["zigzag", "loop"])
def test_no_cut_of_a_shape_has_an_order_faster_than_its_cap(shape, seed):
    # Every cut of 6 uneven layers into a V or loop of 2 ranks x 2 stages, each ordered as well
    # as CP-SAT can (proven optimal): the fastest is no faster than the cap, and the cap is no
    # looser than the fill makes it, above the balance's own bound.
    rng = random.Random(seed)
    profile = make_profile([(rng.randint(1, 4), rng.randint(1, 4), rng.randint(1, 3)) for _ in range(6)], out=1 << 20)
    cluster = free_cluster(2)
    microbatches = 3
    ranks = shape_ranks(shape, 2, 2)
    cap = fill_cap(profile, cluster, microbatches=microbatches, ranks=ranks)
    assert cap is not None and cap.is_proven
    fastest = min(_best_order_ms(profile, cluster, microbatches, (0, *inner, 6), ranks)
                  for inner in itertools.combinations(range(1, 6), 3))
    assert cap.proven_ms <= fastest + 1e-6
    assert cap.proven_ms > lower_bound_ms(profile, pp=2, microbatches=microbatches)


def test_every_cuts_own_figure_is_no_faster_than_its_best_order():
    # The facts priced at one layout's cut points, on uneven profiles with thick layers (so that
    # microbatches reach later ranks at the rate of a thick stage) and with 0.5 ms hops: for
    # every cut, the figure is at most the exact best order of that layout, and the rate facts
    # raise it on some of them.
    raised = 0
    for seed in (0, 2, 3, 5):  # seeds whose exact orders CP-SAT proves within a few seconds
        rng = random.Random(seed)
        profile = make_profile([(rng.choice([1, 1, 2, 6]), rng.randint(1, 4), rng.randint(1, 3)) for _ in range(6)],
                               out=1 << 20)
        cluster = Cluster(gpus=2, gpus_per_node=1, latency_us=500.0, intra_node_gbps=1e12, inter_node_gbps=1e12)
        microbatches = rng.choice([3, 4, 5])
        t = _tables(profile, cluster)
        for shape in ("zigzag", "loop"):
            ranks = shape_ranks(shape, 2, 2)
            for inner in itertools.combinations(range(1, 6), 3):
                cuts = (0, *inner, 6)
                terms = _fill_terms(*[[table[c] for c in cuts] for table in (t.fwd, t.back, t.down)], ranks, microbatches, t)
                figure_ms = max(_figure(terms)) / 1000
                assert figure_ms <= _best_order_ms(profile, cluster, microbatches, cuts, ranks) + 1e-6
                raised += figure_ms > max(alternatives[0] for alternatives in terms if len(alternatives) == 1) / 1000
    assert raised > 0


@pytest.mark.parametrize("shape", ["zigzag", "loop"])
def test_the_cap_holds_with_a_per_op_overhead_and_a_fused_backward_cheaper_than_i_plus_w(shape):
    # The cap prices every op's overhead once per stage and op kind, and a rank's backward at
    # the cheaper of I + W and the fused B. Here every layer's fused B costs 60% of its I + W
    # and every op pays 0.3 ms: no cut's best order, with its backwards split or fused, beats
    # the cap, and the overhead shows in it (the cap is above the same profile's without).
    rng = random.Random(7)
    plain = make_profile([(rng.randint(1, 4), rng.randint(1, 4), rng.randint(1, 3)) for _ in range(6)], out=1 << 20)
    profile = dataclasses.replace(plain, layers=tuple(
        dataclasses.replace(l, backward_ms=0.6 * (l.backward_input_ms + l.backward_weight_ms)) for l in plain.layers))
    cluster = free_cluster(2, op_overhead_us=300.0)
    microbatches = 3
    ranks = shape_ranks(shape, 2, 2)
    cap = fill_cap(profile, cluster, microbatches=microbatches, ranks=ranks)
    assert cap is not None and cap.is_proven
    fused, split = ((False, 1.0, True),), ((True, 2.0, False),)
    fastest = min(_best_order_ms(profile, cluster, microbatches, (0, *inner, 6), ranks, settings)
                  for inner in itertools.combinations(range(1, 6), 3) for settings in (fused, split))
    assert cap.proven_ms <= fastest + 1e-6
    assert cap.proven_ms > fill_cap(profile, free_cluster(2), microbatches=microbatches, ranks=ranks).proven_ms


def test_microbatches_reach_a_rank_no_faster_than_a_thick_stage_before_it_passes_them_on():
    # A loop of four layers on 2 ranks, 3 microbatches: layer 0 has F = 3, I = W = 0.5 ms, the
    # others F = I = W = 1. Rank 1 holds stages 1 and 3 and starts at 3 ms with 3 x 6 = 18 ms
    # of work: 21 ms, the figure without the rate of arrivals. But stage 0 passes on a
    # microbatch every 3 ms: microbatch 1 reaches stage 1 at 6 ms, while microbatch 0 reaches
    # stage 3 at 5. From 4 to 5 ms rank 1 has nothing to run, so it ends at 22 at the
    # earliest, and CP-SAT's best order does: 22 ms.
    profile, cluster = make_profile([(3, 0.5, 0.5), (1, 1, 1), (1, 1, 1), (1, 1, 1)]), free_cluster(2)
    cap = fill_cap(profile, cluster, microbatches=3, ranks=(0, 1, 0, 1))
    assert cap is not None and cap.is_proven and cap.bounds == (0, 1, 2, 3, 4)
    assert cap.proven_ms == 22.0
    assert _best_order_ms(profile, cluster, 3, cap.bounds, (0, 1, 0, 1)) == pytest.approx(22.0)


def test_a_shape_needs_a_layer_for_every_stage():
    assert fill_cap(uniform_profile(3), free_cluster(2), microbatches=2, ranks=(0, 1, 1, 0)) is None
    with pytest.raises(ValueError, match="shape"):
        shape_ranks("w", 2, 2)
    with pytest.raises(ValueError, match="hint"):
        fill_cap(uniform_profile(4), free_cluster(2), microbatches=2, ranks=(0, 1, 1, 0), hint=(0, 2, 2, 3, 4))


def test_transfers_between_ranks_lengthen_the_fill():
    # The loop of four unit layers on 2 ranks (rank 0: stages 0 and 2), with 1 ms on every hop
    # between ranks. Rank 0 can run only forwards until the first backward reaches it: the
    # forward's 4 ms and its 3 hops, stage 3's backward (1 ms) and the hop back, 9 ms; then
    # 2 microbatches x 4 ms of backwards are left: 17 ms, against 13 without the hops. CP-SAT's
    # best order agrees.
    profile = uniform_profile(4)
    free = fill_cap(profile, free_cluster(2), microbatches=2, ranks=(0, 1, 0, 1))
    hops = Cluster(gpus=2, gpus_per_node=1, latency_us=1000.0, intra_node_gbps=1e12, inter_node_gbps=1e12)
    slow = fill_cap(profile, hops, microbatches=2, ranks=(0, 1, 0, 1))
    assert free.proven_ms == 13.0
    assert slow.proven_ms == 17.0
    assert _best_order_ms(profile, hops, 2, slow.bounds, (0, 1, 0, 1)) == pytest.approx(17.0)


def test_a_placement_is_named_by_its_shape_whatever_the_order_of_its_ranks():
    assert shape_of((0, 1, 2, 2, 1, 0), 3) == ("zigzag", 2)
    assert shape_of((2, 0, 1, 1, 0, 2), 3) == ("zigzag", 2)  # the same V on ranks taken in another order
    assert shape_of((1, 0, 1, 0, 1, 0), 2) == ("loop", 3)
    assert shape_of((0, 1, 2), 3) == ("loop", 1)
    assert shape_of((0, 1, 0, 1, 1, 0), 2) is None  # a loop, then a turn
    assert shape_of((0, 0, 1, 1), 2) is None
    assert [shape_label("zigzag", 2), shape_label("loop", 3), shape_label("loop", 1)] == [
        "a V of 2 stages per rank", "a loop of 3 stages per rank", "one stage per rank"]


def test_no_v_of_jamba_passes_efficiency_0_88():
    # The suite's jamba-v0.1 (pp 16, 32 microbatches, blocks split into mixer and MLP/MoE
    # layers): no V runs faster than 1145.0 ms, an efficiency of 0.878. (Its tuned placement,
    # a V with its first three stages on ranks 2, 1, 0, has the same cap: `octoplan bound`.)
    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_tuner import SUITE, _profile_and_cluster

    w = next(w for w in SUITE if w.name == "jamba-v0.1")
    profile, cluster = _profile_and_cluster(w, split_blocks=True)
    bound = lower_bound_ms(profile, pp=w.pp, microbatches=w.microbatches)
    cap = fill_cap(profile, cluster, microbatches=w.microbatches, ranks=shape_ranks("zigzag", w.pp, 2), time_limit_s=20.0)
    assert cap is not None and cap.is_proven
    assert cap.proven_ms == pytest.approx(1145.0, abs=0.1)
    assert bound / cap.proven_ms < 0.88


def test_a_solve_cut_short_returns_no_worse_than_its_hint():
    # CP-SAT's time ends right after presolve, at the hinted answer: its figure is the hinted
    # layout's own (the objective was once hinted at its upper bound, 2353 ms here, and a short
    # solve returned that)
    rng = random.Random(1)
    profile = make_profile([(rng.randint(1, 6), rng.randint(1, 8), rng.randint(1, 4)) for _ in range(24)])
    cluster, ranks, hint = free_cluster(4), shape_ranks("zigzag", 4, 2), (0, 1, 2, 3, 4, 5, 6, 7, 24)
    t = _tables(profile, cluster)
    hinted_ms = max(_figure(_fill_terms(*[[table[c] for c in hint] for table in (t.fwd, t.back, t.down)], ranks, 8, t))) / 1000
    cap = fill_cap(profile, cluster, microbatches=8, ranks=ranks, time_limit_s=0.1, hint=hint)
    assert cap is not None and cap.found_ms <= hinted_ms == 1544.0
