"""The policy list scheduler: valid, deadlock-free orders for any placement."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from octoplan.baseline import make_baseline
from octoplan.costs import LayerTable, stage_costs
from octoplan.plan import Parallel, Plan, Stage, check_structure
from octoplan.schedules.policy import RankPolicy, default_policies, policy_schedule
from octoplan.simulator import simulate, simulate_costs
from tests.conftest import free_cluster, make_profile, uniform_profile


@st.composite
def placements(draw):
    pp = draw(st.integers(1, 4))
    num_stages = draw(st.integers(pp, 3 * pp)) if pp > 1 else draw(st.integers(1, 3))
    ranks = list(range(pp)) + [draw(st.integers(0, pp - 1)) for _ in range(num_stages - pp)]
    order = draw(st.permutations(ranks))
    microbatches = draw(st.integers(1, 6))
    policies = tuple(
        RankPolicy(inflight=draw(st.integers(1, 6)), split=draw(st.booleans()), w_cap=draw(st.integers(0, 8)),
                   deep_first=draw(st.booleans()))
        for _ in range(pp)
    )
    times = [(draw(st.integers(1, 5)), draw(st.integers(1, 5)), draw(st.integers(0, 5))) for _ in range(num_stages)]
    # activation budgets from "not even one microbatch" to "no limit"
    budget = draw(st.one_of(st.none(), st.lists(st.integers(0, 6000), min_size=pp, max_size=pp)))
    return pp, tuple(order), microbatches, policies, times, budget


def layout_of(case, *, latency_us: float, inter_node_gbps: float):
    """A drawn case's profile (one layer per stage), cluster (2 GPUs per node, so transfers
    cross node boundaries at ``inter_node_gbps``), parallel degrees, stages and stage costs."""
    pp, ranks, microbatches, _, times, _ = case
    profile = make_profile(times, act=1000, out=1000, params=1000)
    cluster = free_cluster(pp, gpus_per_node=2)
    cluster = type(cluster)(**{**cluster.to_dict(), "latency_us": latency_us, "inter_node_gbps": inter_node_gbps})
    parallel = Parallel(pp=pp, microbatches=microbatches)
    stages = tuple(Stage(s, s + 1, r) for s, r in enumerate(ranks))
    return profile, cluster, parallel, stages, stage_costs(stages, LayerTable(profile))


def costly_policy_order(case):
    """:func:`layout_of` with transfers that cost something across a node boundary (the
    simulator's link contention is the one thing the order model leaves out, so its bounds must
    still hold there), and the drawn policies' order: ``layout_of``'s five values and the ops."""
    pp, ranks, microbatches, policies, _, _ = case
    profile, cluster, parallel, stages, costs = layout = layout_of(case, latency_us=300.0, inter_node_gbps=1e-5)
    ops = policy_schedule(ranks, costs, microbatches=microbatches, policies=policies, cluster=cluster, parallel=parallel)
    return (*layout, ops)


@settings(max_examples=150, deadline=None)
@given(placements())
def test_any_placement_gets_a_valid_deadlock_free_order(case):
    pp, ranks, microbatches, policies, times, budget = case
    profile, cluster, parallel, stages, costs = layout_of(case, latency_us=5.0, inter_node_gbps=1e-3)
    ops = policy_schedule(ranks, costs, microbatches=microbatches, policies=policies, cluster=cluster,
                          parallel=parallel, activation_budget_bytes=budget)
    plan = Plan(model=profile.model, cluster=cluster, parallel=parallel, stages=stages, schedule=tuple(map(tuple, ops)))
    check_structure(plan, num_layers=profile.num_layers)  # every op once, on its rank, I before W
    result = simulate_costs(plan, costs)  # raises DeadlockError on a cycle
    assert result.iteration_ms > 0
    # split ranks emit I+W, the others B
    for rank, rank_ops in enumerate(ops):
        kinds = {op.kind.value for op in rank_ops}
        assert ("B" in kinds) != policies[rank].split
    # so the tuner can count a policy candidate's ops without scheduling it
    from octoplan.tuner.space import Candidate, Config

    cand = Candidate(Config(pp, 1, microbatches), tuple(range(len(ranks) + 1)), ranks, policies)
    assert cand.num_ops == sum(len(rank_ops) for rank_ops in ops)


@settings(max_examples=150, deadline=None)
@given(placements(), st.data())
def test_knobs_that_cannot_bind_are_moot(case, data):
    # RankPolicy.acts_like: in-flight limits of at least the microbatches, warm-up depths of at
    # least the in-flight limit, W caps of at least the Ws a rank can hold back, W knobs of a
    # rank that does not split and the forward order of a rank of one stage give one order (the
    # tuner skips such moves); a warm-up or a cap below those is a real change
    pp, ranks, microbatches, policies, _, budget = case
    _, cluster, parallel, _, costs = layout_of(case, latency_us=5.0, inter_node_gbps=1e-3)
    held = [ranks.count(r) for r in range(pp)]
    rank = data.draw(st.integers(0, pp - 1))

    def unbinding(q, r):
        deep_first = data.draw(st.booleans()) if held[r] == 1 else q.deep_first
        split_knobs = {} if q.split else {"w_fits_gap": data.draw(st.booleans())}
        # a limit the microbatches make moot varies; one that binds stays
        inflight = data.draw(st.integers(microbatches, microbatches + 3)) if q.inflight >= microbatches else q.inflight
        return replace(q, inflight=inflight, warmup=data.draw(st.integers(min(inflight, microbatches), inflight + 4)),
                       w_cap=data.draw(st.integers(held[r] * microbatches, held[r] * microbatches + 4)),
                       deep_first=deep_first, **split_knobs)

    loose = [unbinding(q, r) for r, q in enumerate(policies)]
    looser = list(loose)
    looser[rank] = unbinding(policies[rank], rank)
    assert looser[rank].acts_like(loose[rank], stages=held[rank], microbatches=microbatches)
    orders = [policy_schedule(ranks, costs, microbatches=microbatches, policies=tuple(knobs), cluster=cluster,
                              parallel=parallel, activation_budget_bytes=budget) for knobs in (loose, looser)]
    assert orders[0] == orders[1]
    p, known = loose[rank], {"stages": held[rank], "microbatches": microbatches}
    bound = min(p.inflight, microbatches)
    if bound > 1:
        assert not replace(p, warmup=bound - 1).acts_like(p, **known)
    if p.inflight < microbatches:
        assert not replace(p, inflight=p.inflight + 1).acts_like(p, **known)
    assert replace(p, w_cap=held[rank] * microbatches - 1).acts_like(p, **known) == (not p.split)
    if p.split:  # without the stage count, no cap is known to be moot
        assert not replace(p, w_cap=p.w_cap + 1).acts_like(p, microbatches=microbatches)


def test_warm_up_moves_that_change_nothing_are_not_offered():
    # gemma3-27b's case in small: warm-ups of every microbatch under smaller in-flight limits,
    # and a W cap above the 16 Ws a rank of 2 stages and 8 microbatches can hold back. "warm-up
    # -1" would still be above the limit, so only a rank whose limit is its warm-up depth (rank
    # 1 here) gets the warm-up moves; rank 1's cap of 20 gets only the caps that bind (0, 10),
    # not 40 or 24, where rank 0's cap of 8 gets all four
    from octoplan.tuner.moves import neighbours
    from octoplan.tuner.space import Candidate, Config, Evaluator
    import random

    profile = uniform_profile(4, act=10, out=10, params=10)
    cluster = free_cluster(2)
    policies = (RankPolicy(inflight=2, warmup=8, split=True, w_cap=8), RankPolicy(inflight=8, warmup=8, split=True, w_cap=20))
    cand = Candidate(Config(2, 1, 8), (0, 1, 2, 3, 4), (0, 1, 0, 1), policies)
    result = Evaluator(profile, cluster).simulate(cand)
    origins = [moved.origin for moved in neighbours(cand, result, dimensions=("schedule",), rng=random.Random(0))]
    assert "rank 1: warm-up 7" in origins and "every rank warm-up -1" in origins
    assert not any(o.startswith("rank 0: warm-up") for o in origins)
    assert [o for o in origins if "w_cap" in o] == ["rank 0: w_cap 0", "rank 0: w_cap 4", "rank 0: w_cap 16",
                                                   "rank 0: w_cap 24", "rank 1: w_cap 0", "rank 1: w_cap 10"]
    assert "rank 0: in-flight 1" in origins  # (its "in-flight 3" is "every rank in-flight +1", rank 1 being at 8)


def test_default_knobs_on_a_loop_reproduce_1f1b():
    profile = uniform_profile(8, act=10, out=10, params=10)
    base = make_baseline(profile, schedule="1f1b", gpus=4, microbatches=8, cluster=free_cluster(4))
    ranks = [s.rank for s in base.stages]
    costs = stage_costs(base.stages, LayerTable(profile))
    ops = policy_schedule(ranks, costs, microbatches=8, policies=default_policies(ranks, 4, 8),
                          cluster=base.cluster, parallel=base.parallel)
    assert [list(r) for r in ops] == [list(r) for r in base.schedule]
    # uniform layers of 3 ms, 2 per stage: (M + pp - 1) x 6 ms
    assert simulate(base.with_schedule(ops), profile).iteration_ms == (8 + 3) * 6.0


def test_split_with_deferred_w_matches_zero_bubble_h1_time():
    profile = uniform_profile(8, act=10, out=10, params=10)
    zb = make_baseline(profile, schedule="zb-h1", gpus=4, microbatches=8, cluster=free_cluster(4))
    ranks = [s.rank for s in zb.stages]
    costs = stage_costs(zb.stages, LayerTable(profile))
    ops = policy_schedule(ranks, costs, microbatches=8, policies=default_policies(ranks, 4, 8, split=True),
                          cluster=zb.cluster, parallel=zb.parallel)
    ours = simulate(zb.with_schedule(ops), profile).iteration_ms
    assert ours <= simulate(zb, profile).iteration_ms


def test_activation_budget_caps_the_warm_up():
    # 1 layer per stage, 1000 activation bytes each; a budget of 2500 bytes lets rank 0 hold
    # two microbatches at once instead of the four 1F1B's warm-up would admit
    profile = uniform_profile(4, act=1000, out=0, params=0)
    base = make_baseline(profile, schedule="1f1b", gpus=4, microbatches=8, cluster=free_cluster(4))
    ranks = [s.rank for s in base.stages]
    costs = stage_costs(base.stages, LayerTable(profile))
    free = policy_schedule(ranks, costs, microbatches=8, policies=default_policies(ranks, 4, 8),
                           cluster=base.cluster, parallel=base.parallel)
    capped = policy_schedule(ranks, costs, microbatches=8, policies=default_policies(ranks, 4, 8),
                             cluster=base.cluster, parallel=base.parallel, activation_budget_bytes=[2500] * 4)
    assert simulate(base.with_schedule(free), profile).peak_memory_bytes[0] == 4000
    assert simulate(base.with_schedule(capped), profile).peak_memory_bytes[0] == 2000


def test_a_v_rank_admits_a_microbatch_whose_second_stage_memory_older_ones_leave_free():
    # a V on 2 ranks (stages 0 and 3 on rank 0), 1000 activation bytes per stage, F 1 ms and
    # B 2 ms. With 3000 bytes rank 0 can hold microbatch 0's two stages and microbatch 1's
    # first: 0F1 runs before 3F0 (1000 held + 1000 for it + 1000 that 3F0 will add), and the
    # iteration takes 34 ms. One byte less and microbatch 1 waits for 0B0, as a rule that
    # reserves both stages at admission would always make it (39 ms)
    profile = uniform_profile(4, act=1000, out=0, params=0)
    base = make_baseline(profile, schedule="zbv", gpus=2, microbatches=4, cluster=free_cluster(2))
    ranks = [s.rank for s in base.stages]
    assert ranks == [0, 1, 1, 0]
    costs = stage_costs(base.stages, LayerTable(profile))

    def run(budget):
        ops = policy_schedule(ranks, costs, microbatches=4, policies=default_policies(ranks, 2, 4),
                              cluster=base.cluster, parallel=base.parallel, activation_budget_bytes=[budget, 10**9])
        return [" ".join(map(str, rank_ops)) for rank_ops in ops], simulate(base.with_schedule(ops), profile)

    order, result = run(3000)
    assert order[0].startswith("0F0 0F1 3F0 3B0 3F1 3B1 0B0")
    assert (result.iteration_ms, result.peak_activation_bytes[0]) == (34.0, 3000)
    order, result = run(2999)
    assert order[0].startswith("0F0 3F0 3B0 0F1 0B0")
    assert (result.iteration_ms, result.peak_activation_bytes[0]) == (39.0, 2000)


@settings(max_examples=150, deadline=None)
@given(placements(), st.data())
def test_the_tapes_stay_within_the_budget_wherever_one_microbatch_fits(case, data):
    # the budget less the transport's room (per channel: a send out; a receive posted and one
    # waiting in) is what the tapes may use; every order keeps them there when one
    # microbatch's activations on all the rank's stages fit in it (drawn: up to 4 more stages'
    # worth beside them)
    pp, ranks, microbatches, policies, _, _ = case
    profile, cluster, parallel, stages, costs = layout_of(case, latency_us=5.0, inter_node_gbps=1e-3)
    channels = {(ranks[s], ranks[t]) for s in range(len(ranks)) for t in (s - 1, s + 1)
                if 0 <= t < len(ranks) and ranks[s] != ranks[t]}
    room = [sum(costs[s].activation_bytes for s, r in enumerate(ranks) if r == rank) + data.draw(st.integers(0, 4000))
            for rank in range(pp)]
    budget = [room[rank] + 1000 * sum(1 if src == rank else 2 for src, dst in channels if rank in (src, dst))
              for rank in range(pp)]
    ops = policy_schedule(ranks, costs, microbatches=microbatches, policies=policies, cluster=cluster,
                          parallel=parallel, activation_budget_bytes=budget)
    plan = Plan(model=profile.model, cluster=cluster, parallel=parallel, stages=stages, schedule=tuple(map(tuple, ops)))
    tapes = simulate_costs(plan, costs).peak_activation_bytes
    assert all(tape <= limit for tape, limit in zip(tapes, room))


def test_default_warm_up_matches_1f1b_and_zb_v():
    from octoplan.schedules import loop_placement, v_placement

    loop = default_policies(loop_placement(4, 4), 4, 16)
    assert [p.warmup for p in loop] == [4, 3, 2, 1]  # 1F1B: pp - r forwards before the first B
    assert [p.inflight for p in loop] == [4, 3, 2, 1]
    v = default_policies(v_placement(4, 8), 4, 16)
    assert [p.warmup for p in v] == [7, 5, 3, 1]  # ZB-V: 2(pp - r) - 1 forwards of chunk 0
    assert [p.warmup for p in default_policies(v_placement(4, 8), 4, 16, warmup_gap=False)] == [16] * 4


def test_placement_moves_leave_no_rank_with_more_stages_than_allowed():
    # rank 0 (two heavy stages) is hot; rank 1 also holds two, rank 2 one: with at most two
    # per rank, a stage may move to rank 2 but never onto rank 1
    import random

    from octoplan.tuner.moves import neighbours
    from octoplan.tuner.space import Candidate, Config, Evaluator

    profile = make_profile([(3, 3, 3), (1, 1, 1), (1, 1, 1), (3, 3, 3), (1, 1, 1)])
    evaluator = Evaluator(profile, free_cluster(3))
    ranks = (0, 1, 2, 0, 1)
    cand = Candidate(Config(3, 1, 6), (0, 1, 2, 3, 4, 5), ranks, default_policies(ranks, 3, 6))
    moved = list(neighbours(cand, evaluator.simulate(cand), dimensions=("placement",), rng=random.Random(0),
                            max_stages_per_rank=2))
    origins = {m.origin for m in moved}
    assert {"move stage 0 to rank 2", "move stage 3 to rank 2"} <= origins
    assert all(max(m.ranks.count(r) for r in range(3)) <= 2 for m in moved)
    roomier = list(neighbours(cand, evaluator.simulate(cand), dimensions=("placement",), rng=random.Random(0),
                              max_stages_per_rank=3))
    assert any(max(m.ranks.count(r) for r in range(3)) == 3 for m in roomier)


@settings(max_examples=100, deadline=None)
@given(placements(), st.sampled_from([250.0, 1000.0, 4000.0]))
def test_the_op_overhead_is_scheduled_as_the_simulator_charges_it(case, overhead_us):
    # each op lasts its stage's time plus the overhead, once (a B too): the same as costs that
    # include it on a cluster without one
    pp, ranks, microbatches, policies, _, budget = case
    _, cluster, parallel, _, costs = layout_of(case, latency_us=5.0, inter_node_gbps=1e-3)
    o = overhead_us / 1000.0
    with_it = [replace(c, forward_ms=c.forward_ms + o, backward_input_ms=c.backward_input_ms + o,
                       backward_weight_ms=c.backward_weight_ms + o, backward_ms=c.b_ms + o) for c in costs]
    charged = replace(cluster, op_overhead_us=overhead_us)
    assert policy_schedule(ranks, costs, microbatches=microbatches, policies=policies, cluster=charged,
                           parallel=parallel, activation_budget_bytes=budget) == \
        policy_schedule(ranks, with_it, microbatches=microbatches, policies=policies, cluster=cluster,
                        parallel=parallel, activation_budget_bytes=budget)


def test_the_memory_budget_keeps_room_for_the_messages_beside_the_tapes():
    # 4 ranks of one 1 GB layer each, 0.5 GB messages, 3.5 GB per GPU. The tapes alone would
    # let rank 1 admit 3 microbatches; with its two incoming channels (a receive posted ahead
    # and one waiting on each: 2 GB) and its two outgoing ones (1 GB) it keeps room for 3 GB of
    # messages, so it admits one at a time and the plan fits with its messages counted.
    from octoplan.plan import Cluster
    from octoplan.profile import Layer, ModelRef, Profile
    from octoplan.tuner.space import Candidate, Config, Evaluator

    gb = 10**9
    profile = Profile(model=ModelRef("x"), layers=tuple(Layer(f"l{i}", "layer", 1.0, 1.0, 1.0, 0, gb, gb // 2)
                                                        for i in range(4)))
    cluster = Cluster(gpus=4, memory_gb=3.5, latency_us=0, intra_node_gbps=1e12, inter_node_gbps=1e12)
    ranks = (0, 1, 2, 3)
    cand = Candidate(Config(4, 1, 8), (0, 1, 2, 3, 4), ranks, default_policies(ranks, 4, 8))
    result = Evaluator(profile, cluster).simulate(cand)
    assert result.fits_memory
    assert max(result.peak_message_bytes) >= gb  # the messages are what the budget made room for
    assert list(result.peak_activation_bytes) == [2 * gb, gb, gb, gb]
