"""The simulator: hand-computed timelines op by op, all-reduce, memory, bubbles and their
causes, the critical path, deadlocks, and properties of random valid plans."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from octoplan.costs import LayerTable
from octoplan.memory import static_bytes
from octoplan.ops import Kind, Op
from octoplan.plan import Cluster, Parallel, Plan, Stage
from octoplan.profile import Layer, ModelRef, Profile
from octoplan.simulator import DeadlockError, simulate

from conftest import free_cluster, hand_plan, make_profile


def _two_layer_profile(params=(0, 0)) -> Profile:
    # layer 0: F 2, I 1, W 1, sends 2 MB; layer 1 (head): F 1, I 2, W 2.
    return Profile(model=ModelRef("t"), layers=(
        Layer("a", "layer", 2.0, 1.0, 1.0, params[0], 100, 2_000_000),
        Layer("b", "head", 1.0, 2.0, 2.0, params[1], 1000, 8),
    ))


# 1 ms latency + 2 MB at 1 GB/s = 3 ms per transfer.
SLOW_LINK = dict(gpus_per_node=8, intra_node_gbps=1.0, inter_node_gbps=0.5, latency_us=1000.0)


def test_gpipe_on_two_ranks_with_latency_and_bandwidth_op_by_op():
    profile = _two_layer_profile()
    plan = hand_plan([(0, 1, 0), (1, 2, 1)], ["0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1"],
                 cluster=Cluster(gpus=2, **SLOW_LINK), microbatches=2)
    result = simulate(plan, profile)
    # rank 0: 0F0 [0,2] 0F1 [2,4]; its sends queue on one link: [2,5] then [5,8].
    # rank 1: 1F0 [5,6] 1F1 [8,9] 1B0 [9,13] 1B1 [13,17]; gradients back [13,16], [17,20].
    # rank 0: 0B0 [16,18] 0B1 [20,22].
    assert result.op_times() == {
        Op(0, Kind.F, 0): (0, 2), Op(0, Kind.F, 1): (2, 4), Op(0, Kind.B, 0): (16, 18), Op(0, Kind.B, 1): (20, 22),
        Op(1, Kind.F, 0): (5, 6), Op(1, Kind.F, 1): (8, 9), Op(1, Kind.B, 0): (9, 13), Op(1, Kind.B, 1): (13, 17),
    }
    assert [(t.src_rank, t.dst_rank, str(t.op), t.start_ms, t.end_ms) for t in result.transfers] == [
        (0, 1, "0F0", 2, 5), (0, 1, "0F1", 5, 8), (1, 0, "1B0", 13, 16), (1, 0, "1B1", 17, 20),
    ]
    assert result.iteration_ms == 22
    assert result.busy_ms == (8, 10)
    assert result.bubble_ratio == pytest.approx((14 + 12) / 44)
    assert [(b.rank, b.start_ms, b.end_ms, b.reason, str(b.waits_for) if b.waits_for else None, b.from_rank)
            for b in result.bubbles] == [
        (0, 4, 16, "dependency", "1B0", 1), (0, 18, 20, "transfer", "1B1", 1),
        (1, 0, 5, "transfer", "0F0", 0), (1, 6, 8, "transfer", "0F1", 0), (1, 17, 22, "drain", None, None),
    ]
    # idle split: rank 0 never waits to start and ends last; rank 1 waits 5 ms for its first
    # input, 2 ms for its second, and idles 5 ms after its last op
    assert [result.idle_parts(r) for r in range(2)] == [(0, 14, 0), (5, 2, 5)]
    assert result.summary()["idle_ms"] == [[0, 14, 0], [5, 2, 5]]
    assert [str(op) for op in result.critical_path] == ["0F0", "0F1", "1F1", "1B0", "1B1", "0B1"]
    # Tapes: rank 0 holds two microbatches of layer a (its 2 MB output, once sent, no tape
    # holds: octorun keeps only its backward's gradient edge); rank 1 two of layer b.
    assert result.peak_activation_bytes == (2 * 100, 2 * 1000)
    # Messages, 2 MB each. Rank 0: the buffer for 1B0's gradient is posted from the start; 0F0
    # is held from 2 until its send is done at 5 (past 0F1's end at 4), 0F1 from 4 until 0B0
    # ends at 18: at [4, 5) it holds three (6 MB) beside two microbatches' 200 bytes. Rank 1:
    # one posted buffer throughout, and the gradient of 1B0 from 13 until 1B1 ends at 17 (its
    # send was done at 16): 4 MB beside one microbatch at [13, 17), two buffers and 1B1's
    # gradient (held until 20) with none at [17, 20). Rank 0 holds three again at [16, 18):
    # 1B0's gradient, which 0B0 reads until it ends, 1B1's posted buffer and 0F1.
    assert result.peak_message_bytes == (3 * 2_000_000, 2 * 2_000_000)
    assert result.peak_memory_bytes == (3 * 2_000_000 + 2 * 100, 2 * 2_000_000 + 1000)


def test_the_critical_path_follows_the_data_where_it_ties_with_the_rank():
    # 1F1B of two unit layers on a free link: 0F0 [0,1] 0F1 [1,2]; 1F0 [1,2], and 1F1 starts at 2,
    # when both 1F0 ends and 0F1's activation arrives; 1B0 [3,5] 1B1 [5,7]; 0B0 [5,7] 0B1 [7,9].
    # At that tie the path steps back along the data (to 0F1), not the rank (to 1F0)
    plan = hand_plan([(0, 1, 0), (1, 2, 1)], ["0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1"], cluster=free_cluster(2),
                     microbatches=2)
    result = simulate(plan, make_profile([(1, 1, 1)] * 2))
    assert result.iteration_ms == 9
    assert [str(op) for op in result.critical_path] == ["0F0", "0F1", "1F1", "1B0", "1B1", "0B1"]


def test_a_backward_holds_the_gradient_it_reads_until_it_ends():
    # GPipe on a free link: 0F0 [0,2] 0F1 [2,4]; 1F0 [2,3] 1F1 [4,5] 1B0 [5,9] 1B1 [9,13];
    # 0B0 [9,11] 0B1 [13,15]. When 1B0's gradient lands at 9, rank 0's receiver posts the buffer
    # of 1B1's, while 0B0 reads the one that landed until 11, and 0F1's output is held until
    # 0B0 ends (the end of rank 0's next op): three 2 MB messages at [9, 11) beside both
    # microbatches' tapes. Were the gradient let go when 0B0 starts, two would be the most.
    profile = _two_layer_profile()
    plan = hand_plan([(0, 1, 0), (1, 2, 1)], ["0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1"],
                 cluster=Cluster(gpus=2, latency_us=0.0, intra_node_gbps=1e12, inter_node_gbps=1e12), microbatches=2)
    result = simulate(plan, profile)
    assert result.op_times()[Op(0, Kind.B, 0)] == pytest.approx((9, 11))
    assert result.peak_message_bytes[0] == 3 * 2_000_000
    assert result.peak_with_message_bytes[0] == 3 * 2_000_000 + 2 * 100


def test_a_message_that_waits_in_the_mailbox_counts_beside_the_next_posted_buffer():
    # Rank 1 runs 1F1B's order: 1B0 [6, 10] comes before 1F1, whose input 0F1 lands at 8.
    profile = _two_layer_profile()
    plan = hand_plan([(0, 1, 0), (1, 2, 1)], ["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"],
                 cluster=Cluster(gpus=2, **SLOW_LINK), microbatches=2)
    result = simulate(plan, profile)
    assert result.op_times()[Op(1, Kind.F, 1)] == (10, 11) and result.op_times()[Op(0, Kind.B, 1)] == (18, 20)
    # Rank 1's channel from rank 0: 0F1's buffer is posted when 0F0 lands (5) and waits until
    # 1F1 starts (10); once 0F1 has landed (8) the next step's first buffer is posted. At
    # [8, 10) it holds both (4 MB) while 1B0 still holds microbatch 0's 1000 bytes; at 10 the
    # input is handed to 1F1's tape and 1B0's gradient (held until it lands at 13) takes its place.
    assert result.peak_message_bytes[1] == 2 * 2_000_000
    assert result.peak_memory_bytes[1] == 2 * 2_000_000 + 1000
    assert result.peak_activation_bytes == (2 * 100, 1000)


def _memory_by_sweep(result, costs, rank_of_stage, num_mb) -> tuple[list[int], list[int]]:
    """The memory rules of docs/FORMATS.md section 7, stated plainly over ops and the
    timeline's transfers: per rank, the peak of tapes plus messages, and of messages alone."""
    times = result.op_times()
    landed = {t.op: t.end_ms for t in result.transfers}
    first = min(start for start, _ in times.values())
    last = result.iteration_ms + first
    events = [[] for _ in range(result.num_ranks)]  # (time, tape delta, message delta)

    def grows(op):
        c = costs[op.stage]
        return {Kind.F: c.activation_bytes, Kind.I: c.i_delta_bytes, Kind.W: -(c.w_held_bytes + c.pending_w_bytes),
                Kind.B: -c.activation_bytes}[op.kind]

    def bursts(op):
        c = costs[op.stage]
        return {Kind.I: c.recompute_bytes + c.i_peak_bytes, Kind.B: c.recompute_bytes}.get(op.kind, 0)

    def weight(op):
        return costs[op.stage].output_bytes if op.kind is Kind.F else costs[op.stage - 1].output_bytes

    def reader(op):
        if op.kind is Kind.F:
            return Op(op.stage + 1, Kind.F, op.mb)
        below = Op(op.stage - 1, Kind.I, op.mb)
        return below if below in times else Op(op.stage - 1, Kind.B, op.mb)

    channels: dict[tuple[int, int], list[Op]] = {}
    for r in range(result.num_ranks):
        ops = [span.op for span in result.spans(r)]
        for i, op in enumerate(ops):
            start, end = times[op]
            during = max(bursts(op), grows(op), 0)
            events[r] += [(start, during, 0), (end, grows(op) - during, 0)]
            if op in landed:
                held_to = max(times[ops[i + 1]][1] if i + 1 < len(ops) else end, landed[op])
                events[r] += [(end, 0, weight(op)), (held_to, 0, -weight(op))]
                channels.setdefault((r, rank_of_stage[reader(op).stage]), []).append(op)
    for (_, dst), sent in channels.items():
        posted = first
        for op in sent:
            # until the reader starts; a B's gradient until the B ends
            used = times[reader(op)][1 if reader(op).kind is Kind.B else 0]
            events[dst] += [(posted, 0, weight(op)), (used, 0, -weight(op))]
            posted = landed[op]
        events[dst] += [(posted, 0, weight(sent[0])), (last, 0, -weight(sent[0]))]
    both, alone = [], []
    for ev in events:
        tape = msgs = top = top_msgs = 0
        for t in sorted({e[0] for e in ev}):
            tape += sum(e[1] for e in ev if e[0] == t)
            msgs += sum(e[2] for e in ev if e[0] == t)
            top, top_msgs = max(top, tape + msgs), max(top_msgs, msgs)
        both.append(top)
        alone.append(top_msgs)
    return both, alone


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 1_000_000), num_ranks=st.integers(1, 4), extra_stages=st.integers(0, 4),
       num_mb=st.integers(1, 5), split_p=st.floats(0, 1), latency=st.sampled_from([0.0, 50.0, 2000.0]))
def test_random_plans_hold_the_tapes_and_messages_the_rules_give(seed, num_ranks, extra_stages, num_mb, split_p, latency):
    from octoplan.costs import stage_costs

    rng = random.Random(seed)
    num_stages = num_ranks + extra_stages
    placement, orders = _random_valid_plan(rng, num_ranks=num_ranks, num_stages=num_stages, num_mb=num_mb, split_p=split_p)
    layers = tuple(Layer(f"l{i}", "layer", rng.uniform(0.1, 5), rng.uniform(0.1, 5), rng.uniform(0.1, 5), 1000,
                         rng.choice([0, 3_000, 4_000_000]), rng.choice([0, 10_000, 5_000_000]),
                         w_saved_bytes=rng.choice([None, 0, 1_000]), pending_w_bytes=rng.choice([0, 2_000]))
                   for i in range(num_stages))
    profile = Profile(model=ModelRef("t"), layers=layers)
    plan = Plan(
        model=ModelRef("t"),
        cluster=Cluster(gpus=num_ranks, gpus_per_node=2, latency_us=latency),
        parallel=Parallel(pp=num_ranks, dp=1, microbatches=num_mb),
        stages=tuple(Stage(s, s + 1, placement[s], recompute=rng.random() < 0.2) for s in range(num_stages)),
        schedule=tuple(tuple(ops) for ops in orders),
    )
    result = simulate(plan, profile)
    both, alone = _memory_by_sweep(result, stage_costs(plan.stages, LayerTable(profile)), placement, num_mb)
    assert list(result.peak_message_bytes) == alone
    assert [peak - static for peak, static in zip(result.peak_memory_bytes, result.static_memory_bytes)] == both
    assert all(tape <= total for tape, total in zip(result.peak_activation_bytes, both))


def test_a_wait_after_a_first_op_of_no_time_is_between_ops_not_before_the_first():
    a, b = _two_layer_profile().layers
    profile = Profile(model=ModelRef("t"), layers=(replace(a, forward_ms=0.0), b))
    plan = hand_plan([(0, 1, 0), (1, 2, 1)], ["0F0 0B0", "1F0 1B0"], cluster=Cluster(gpus=2, **SLOW_LINK), microbatches=1)
    result = simulate(plan, profile)
    # 0F0 [0,0]; its activation [0,3]; 1F0 [3,4] 1B0 [4,8]; the gradient back [8,11]; 0B0 [11,13]
    assert result.op_times()[Op(0, Kind.B, 0)] == (11, 13)
    # rank 0 started at 0 and then waited 11 ms: between its ops, although the wait starts at 0
    assert [result.idle_parts(r) for r in range(2)] == [(0, 11, 0), (3, 0, 5)]


def test_a_measured_fused_backward_prices_b_while_i_and_w_keep_theirs():
    # As above, with fused backwards measured: layer a's B 1.5 (I + W is 2), layer b's 3 (4).
    a, b = _two_layer_profile().layers
    profile = Profile(model=ModelRef("t"), layers=(replace(a, backward_ms=1.5), replace(b, backward_ms=3.0)))
    plan = hand_plan([(0, 1, 0), (1, 2, 1)], ["0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1"],
                 cluster=Cluster(gpus=2, **SLOW_LINK), microbatches=2)
    # rank 1: 1F0 [5,6] 1F1 [8,9] 1B0 [9,12] 1B1 [12,15]; gradients back [12,15], [15,18];
    # rank 0: 0B0 [15,16.5] 0B1 [18,19.5].
    assert simulate(plan, profile).op_times() == {
        Op(0, Kind.F, 0): (0, 2), Op(0, Kind.F, 1): (2, 4), Op(0, Kind.B, 0): (15, 16.5), Op(0, Kind.B, 1): (18, 19.5),
        Op(1, Kind.F, 0): (5, 6), Op(1, Kind.F, 1): (8, 9), Op(1, Kind.B, 0): (9, 12), Op(1, Kind.B, 1): (12, 15),
    }
    # the lower bound takes each layer's cheaper backward: 2 x max((3.5 + 4) / 2, 4) = 8 ms
    assert simulate(plan, profile).lower_bound_ms == pytest.approx(8.0)
    one_rank = hand_plan([(0, 2, 0)], ["0F0 0B0 0F1 0I1 0W1"], cluster=Cluster(gpus=1, **SLOW_LINK), microbatches=2)
    # F 3, fused B 4.5, then F 3, I 3, W 3: a split backward still costs I + W.
    assert simulate(one_rank, profile).iteration_ms == pytest.approx(3 + 4.5 + 3 + 3 + 3)


def test_same_rank_stages_pass_without_transfer_and_split_backward_frees_at_w():
    profile = _two_layer_profile()
    plan = hand_plan([(0, 1, 0), (1, 2, 0)], ["0F0 1F0 1I0 0I0 1W0 0W0"], cluster=Cluster(gpus=1, **SLOW_LINK), microbatches=1)
    result = simulate(plan, profile)
    assert [(str(s.op), s.start_ms, s.end_ms) for s in result.spans()] == [
        ("0F0", 0, 2), ("1F0", 2, 3), ("1I0", 3, 5), ("0I0", 5, 6), ("1W0", 6, 8), ("0W0", 8, 9),
    ]
    assert result.transfers == []
    assert result.bubble_ratio == 0
    # 0F0 holds layer a's 100 bytes, 1F0 layer b's 1000 (its input among them). Without a
    # w_saved_bytes figure a layer's I frees nothing (profiles written before it was
    # measured): the Ws free each stage's.
    assert result.peak_memory_bytes == (100 + 1000,)


def test_an_i_frees_what_its_w_does_not_read_and_peaks_while_it_walks_the_layers():
    # Three layers (activation, of it what W reads, the gradients I captures for W):
    # (100, 30, 20), (200, 50, 400), (300, 40, 10). I takes them from the last: before each frees
    # its share it holds its captured gradients too; it ends holding 120 + 430 = 550.
    layers = tuple(replace(Layer(name, "layer", 1.0, 1.0, 1.0, 0, act, 8), w_saved_bytes=kept, pending_w_bytes=pend)
                   for name, act, kept, pend in (("a", 100, 30, 20), ("b", 200, 50, 400), ("c", 300, 40, 10)))
    profile = Profile(model=ModelRef("t"), layers=layers)
    cost = LayerTable(profile).stage(0, 3)
    # walking down: c adds 10 (peak 10) then ends at -250; b adds 400 (peak 150), ends at 0;
    # a adds 20 (peak 20 < 150) and ends at -50
    assert (cost.activation_bytes, cost.w_held_bytes, cost.pending_w_bytes, cost.i_peak_bytes, cost.i_delta_bytes) == \
        (600, 120, 430, 150, -50)
    plan = hand_plan([(0, 3, 0)], ["0F0 0I0 0F1 0I1 0W0 0W1"], cluster=Cluster(gpus=1), microbatches=2)
    # F0 600; I0 peaks at 750 and leaves 550; F1 1150; I1 peaks at 1300, leaves 1100; Ws free it all
    assert simulate(plan, profile).peak_memory_bytes == (1300,)
    # the same layers without the w_saved figure keep everything until W: 600 + 430, twice
    old = Profile(model=ModelRef("t"), layers=tuple(replace(layer, w_saved_bytes=None) for layer in layers))
    assert simulate(plan, old).peak_memory_bytes == (2 * (600 + 430),)


def test_inter_node_links_are_slower():
    profile = _two_layer_profile()
    schedule = ["0F0 0B0", "1F0 1B0"]
    same = simulate(hand_plan([(0, 1, 0), (1, 2, 1)], schedule, cluster=Cluster(gpus=2, **SLOW_LINK), microbatches=1), profile)
    split = simulate(hand_plan([(0, 1, 0), (1, 2, 1)], schedule,
                           cluster=Cluster(gpus=2, **{**SLOW_LINK, "gpus_per_node": 1}), microbatches=1), profile)
    # 1 + 2 MB / 0.5 GB/s = 5 ms each way instead of 3.
    assert same.iteration_ms == 2 + 3 + 1 + 4 + 3 + 2
    assert split.iteration_ms == 2 + 5 + 1 + 4 + 5 + 2


def test_data_parallel_allreduce_after_the_last_backward_counts_in_the_iteration():
    # pp 2 x dp 2, 2 GPUs per node, pp-inner: pipeline pairs share a node (intra), each dp
    # group spans both nodes (inter, 0.5 GB/s). Stage 0 holds 4 MB of parameters.
    profile = _two_layer_profile(params=(4_000_000, 0))
    plan = hand_plan([(0, 1, 0), (1, 2, 1)], ["0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1"],
                 cluster=Cluster(gpus=4, **{**SLOW_LINK, "gpus_per_node": 2}), microbatches=2, dp=2)
    result = simulate(plan, profile)
    # Compute ends at 22 as with dp 1; the ring: 2(dp-1) latencies + 2(dp-1)/dp * 4 MB / 0.5 GB/s.
    assert [(a.rank, a.stage, a.start_ms, a.end_ms) for a in result.allreduces] == [(0, 0, 22, 32), (1, 1, 17, 17)]
    assert result.iteration_ms == 32
    # after its last op, rank 0 waits 10 ms for its all-reduce; rank 1 is done at 17
    assert [result.idle_parts(r) for r in range(2)] == [(0, 14, 10), (5, 2, 15)]
    # static memory: weights + grads + Adam (fp32 profile: 16 bytes per parameter).
    # On top, the same tapes and messages as with dp 1 (the timeline is the same).
    assert result.peak_memory_bytes[0] == static_bytes(4_000_000, dtype_bytes=4) + 6_000_000 + 2 * 100 == 22_000_200
    assert result.static_memory_bytes[0] == 16_000_000


def test_a_cycle_is_a_deadlock_naming_what_each_rank_waits_for():
    profile = _two_layer_profile()
    plan = hand_plan([(0, 1, 0), (1, 2, 1)], ["0F0 0B0 0F1 0B1", "1F1 1F0 1B0 1B1"], cluster=Cluster(gpus=2), microbatches=2)
    with pytest.raises(DeadlockError) as info:
        simulate(plan, profile)
    assert str(info.value) == "deadlock: rank 0 waits at 0B0 for 1B0 (rank 1); rank 1 waits at 1F1 for 0F1 (rank 0)"


def test_efficiency_and_lower_bound_follow_spec_section_7():
    profile = make_profile([(1, 1, 1), (6, 0, 0), (1, 1, 1)])
    plan = hand_plan([(0, 2, 0), (2, 3, 1)], ["0F0 0B0", "1F0 1B0"], cluster=Cluster(gpus=2, latency_us=0), microbatches=1)
    result = simulate(plan, profile)
    # sum 12 / pp 2 = 6, largest layer 6: bound = 1 microbatch x 6.
    assert result.lower_bound_ms == 6
    assert result.efficiency == pytest.approx(6 / result.iteration_ms)


def _random_valid_plan(rng: random.Random, *, num_ranks: int, num_stages: int, num_mb: int, split_p: float) -> tuple[list, list]:
    """A random placement and random per-rank orders that can run: ops are drawn one at a
    time from those whose dependencies are already drawn, and appended to their rank."""
    placement = list(range(num_ranks)) + [rng.randrange(num_ranks) for _ in range(num_stages - num_ranks)]
    rng.shuffle(placement)
    split = {(s, m): rng.random() < split_p for s in range(num_stages) for m in range(num_mb)}
    done: set[Op] = set()
    remaining = []
    for s in range(num_stages):
        for m in range(num_mb):
            remaining.append(Op(s, Kind.F, m))
            remaining.extend([Op(s, Kind.I, m), Op(s, Kind.W, m)] if split[s, m] else [Op(s, Kind.B, m)])

    def ready(op: Op) -> bool:
        s, k, m = op
        if k is Kind.F:
            return s == 0 or Op(s - 1, Kind.F, m) in done
        if k is Kind.W:
            return Op(s, Kind.I, m) in done
        downstream = s == num_stages - 1 or Op(s + 1, Kind.I, m) in done or Op(s + 1, Kind.B, m) in done
        return Op(s, Kind.F, m) in done and downstream

    orders: list[list[Op]] = [[] for _ in range(num_ranks)]
    while remaining:
        candidates = [op for op in remaining if ready(op)]
        op = rng.choice(candidates)
        remaining.remove(op)
        done.add(op)
        orders[placement[op.stage]].append(op)
    return placement, orders


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 1_000_000), num_ranks=st.integers(1, 4), extra_stages=st.integers(0, 4),
       num_mb=st.integers(1, 5), split_p=st.floats(0, 1), latency=st.sampled_from([0.0, 50.0, 2000.0]),
       dp=st.integers(1, 2))
def test_random_valid_plans_never_deadlock_nor_beat_the_lower_bound(seed, num_ranks, extra_stages, num_mb, split_p, latency, dp):
    rng = random.Random(seed)
    num_stages = num_ranks + extra_stages
    placement, orders = _random_valid_plan(rng, num_ranks=num_ranks, num_stages=num_stages, num_mb=num_mb, split_p=split_p)
    profile = make_profile([(rng.uniform(0.1, 5), rng.uniform(0.1, 5), rng.uniform(0.1, 5)) for _ in range(num_stages)],
                           out=rng.choice([0, 10_000, 5_000_000]), act=1, params=1000)
    plan = Plan(
        model=ModelRef("t"),
        cluster=Cluster(gpus=num_ranks * dp, gpus_per_node=2, latency_us=latency),
        parallel=Parallel(pp=num_ranks, dp=dp, microbatches=num_mb),
        stages=tuple(Stage(s, s + 1, placement[s]) for s in range(num_stages)),
        schedule=tuple(tuple(ops) for ops in orders),
    )
    result = simulate(plan, profile)
    assert result.iteration_ms >= result.lower_bound_ms - 1e-9
    assert 0 <= result.bubble_ratio < 1
    # Every dependency holds in the timeline.
    times = result.op_times()
    for (s, k, m), (start, end) in times.items():
        layer = profile.layers[s]  # one layer per stage: an op lasts its layer's time of its kind
        assert end - start == pytest.approx({Kind.F: layer.forward_ms, Kind.I: layer.backward_input_ms,
                                             Kind.W: layer.backward_weight_ms, Kind.B: layer.b_ms}[k])
        if k is Kind.F and s > 0:
            assert start >= times[Op(s - 1, Kind.F, m)][1] - 1e-9
        if k is Kind.W:
            assert start >= times[Op(s, Kind.I, m)][1] - 1e-9
        if k in (Kind.I, Kind.B):
            assert start >= times[Op(s, Kind.F, m)][1] - 1e-9
            if s + 1 < num_stages:
                downstream = times.get(Op(s + 1, Kind.I, m)) or times[Op(s + 1, Kind.B, m)]
                assert start >= downstream[1] - 1e-9
    # Ops on one rank never overlap.
    for rank in range(num_ranks):
        spans = result.spans(rank)
        assert all(b.start_ms >= a.end_ms - 1e-9 for a, b in zip(spans, spans[1:]))
        # its idle parts are the idle time before its first op, between its ops and after its last
        before, between, after = result.idle_parts(rank)
        assert before == pytest.approx(spans[0].start_ms) and after == pytest.approx(result.iteration_ms - spans[-1].end_ms)
        assert before + between + after == pytest.approx(result.iteration_ms - result.busy_ms[rank])


def test_op_overhead_is_added_to_every_op_once():
    # 1F1B on 2 ranks, F = 1, B = 2 per stage, free links, 0.5 ms per op:
    # (M + p - 1) x (F + B + 2 x 0.5) = 5 x 4.
    profile = make_profile([(1, 1, 1)] * 2)
    cluster = Cluster(gpus=2, latency_us=0, intra_node_gbps=1e12, op_overhead_us=500.0)
    plan = hand_plan([(0, 1, 0), (1, 2, 1)], ["0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3", "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3"],
                 cluster=cluster, microbatches=4)
    result = simulate(plan, profile)
    assert result.iteration_ms == pytest.approx(5 * 4)
    # the bound: 4 microbatches x (3 ms of layers per rank + F's and B's 0.5 ms each) = 16 ms
    assert result.lower_bound_ms == pytest.approx(16.0) and result.efficiency == pytest.approx(16 / 20)
    split = hand_plan([(0, 1, 0), (1, 2, 1)], ["0F0 0I0 0W0", "1F0 1I0 1W0"], cluster=cluster, microbatches=1)
    # 0F0 [0, 1.5], 1F0 [1.5, 3], 1I0 [3, 4.5], 1W0 [4.5, 6]
    assert simulate(split, profile).op_times()[Op(1, Kind.W, 0)] == pytest.approx((4.5, 6.0))


@settings(max_examples=300, deadline=None)
@given(pp=st.integers(1, 12), dp=st.integers(1, 40), per_node=st.integers(1, 16),
       order=st.sampled_from(["pp-inner", "dp-inner"]), data=st.data())
def test_transfer_and_all_reduce_times_match_every_replica_checked(pp, dp, per_node, order, data):
    # The cost functions look at one node's worth of replicas (transfers) or the first and last
    # one (all-reduce), so huge dp stays cheap; they must equal the check of every replica.
    from octoplan.costs import allreduce_ms, transfer_ms

    cluster = Cluster(gpus=pp * dp, gpus_per_node=per_node, intra_node_gbps=100.0, inter_node_gbps=10.0, latency_us=5.0)
    parallel = Parallel(pp=pp, dp=dp, microbatches=1, rank_order=order)
    src, dst = data.draw(st.integers(0, pp - 1)), data.draw(st.integers(0, pp - 1))

    def gbps(a: int, b: int) -> float:
        return cluster.intra_node_gbps if cluster.node_of(a) == cluster.node_of(b) else cluster.inter_node_gbps

    slowest = min(gbps(parallel.global_rank(src, d), parallel.global_rank(dst, d)) for d in range(dp))
    expected = 0.0 if src == dst else 0.005 + 1e6 / (slowest * 1e9) * 1e3
    assert transfer_ms(cluster, parallel, src, dst, 1e6) == pytest.approx(expected)
    nodes = {cluster.node_of(parallel.global_rank(src, d)) for d in range(dp)}
    ring = 100.0 if len(nodes) == 1 else 10.0
    expected = 0.0 if dp == 1 else 2 * (dp - 1) * 0.005 + 2 * (dp - 1) / dp * 1e6 / (ring * 1e9) * 1e3
    assert allreduce_ms(cluster, parallel, src, 1e6) == pytest.approx(expected)


def test_a_peak_exactly_at_the_gpus_memory_fits():
    """memory_gb 4.1 is 4,100,000,000 bytes: int() truncated it to one byte less, and a rank
    peaking at exactly 4.1 GB (static 4 x 10^9: fp32 weights, gradients and Adam's two moments
    of 10^9 parameter bytes; one layer's 10^8 activations) did not fit."""
    assert Cluster(gpus=1, memory_gb=4.1).memory_bytes == 4_100_000_000
    profile = make_profile([(1, 1, 1)], act=10**8, params=10**9)
    plan = hand_plan([(0, 1, 0)], ["0F0 0B0"], cluster=Cluster(gpus=1, memory_gb=4.1), microbatches=1)
    result = simulate(plan, profile)
    assert max(result.peak_memory_bytes) == 4_100_000_000 and result.memory_limit_bytes == 4_100_000_000
    assert result.fits_memory
