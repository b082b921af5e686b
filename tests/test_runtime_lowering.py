"""The lowering pass (compute ops -> per-rank communication program) and the wire header."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest
import torch

import runtime_helpers as h
from octoplan.ops import Kind
from octorun.comm import HEADER_SLOTS, decode_header, encode_header, layout_of
from octoplan.validate import check_runnable
from octorun.lowering import Message, forward_only, lower

MODEL = Path("/nonexistent/model.py")  # lowering never reads the model


def _plan(ranks, schedule, microbatches, dp=1):
    return h.make_plan(MODEL, {}, stages=[(i, i + 1, r) for i, r in enumerate(ranks)], schedule=schedule,
                       microbatches=microbatches, dp=dp)


def test_two_rank_1f1b_program_is_exact():
    plan = _plan([0, 1], ["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"], 2)
    lowered = lower(plan)
    assert lowered.channels == ((0, 1), (1, 0))
    assert str(lowered.programs[0]) == (
        "rank 0: 0F0 SEND_act1.0->1 | 0F1 SEND_act1.1->1 | RECV_grad0.0<-1 0B0 | RECV_grad0.1<-1 0B1 ALLREDUCE0"
    )
    assert str(lowered.programs[1]) == (
        "rank 1: RECV_act1.0<-0 1F0 | 1B0 SEND_grad0.0->0 | RECV_act1.1<-0 1F1 | 1B1 SEND_grad0.1->0 ALLREDUCE1"
    )
    assert lowered.programs[1].incoming == {0: (Message("act", 1, 0, 0, 1), Message("act", 1, 1, 0, 1))}
    assert lowered.programs[0].incoming == {1: (Message("grad", 0, 0, 1, 0), Message("grad", 0, 1, 1, 0))}


def test_adjacent_stages_on_one_rank_exchange_no_message():
    # V placement: stages 1 and 2 share rank 1; stage 3 comes back to rank 0
    plan = _plan([0, 1, 1, 0], ["0F0 3F0 3I0 3W0 0B0", "1F0 2F0 2B0 1B0"], 1)
    lowered = lower(plan)
    messages = [m for p in lowered.programs for i in p.instrs for m in i.sends]
    assert sorted(messages) == sorted([
        Message("act", 1, 0, 0, 1), Message("act", 3, 0, 1, 0), Message("grad", 2, 0, 0, 1), Message("grad", 0, 0, 1, 0),
    ])
    # the last weight op of each stage starts that stage's all-reduce (3W0, not 3I0)
    assert [i.allreduce_stage for i in lowered.programs[0].instrs] == [None, None, None, 3, 0]


def test_an_evaluation_runs_the_forwards_and_their_activations_alone():
    # the V above: rank 0 runs 0F0 then 3F0, rank 1 1F0 then 2F0; no gradient, no all-reduce,
    # and no channel that carried only gradients (none here: both directions carry activations)
    plan = _plan([0, 1, 1, 0], ["0F0 3F0 3I0 3W0 0B0", "1F0 2F0 2B0 1B0"], 1)
    programs = [forward_only(program) for program in lower(plan).programs]
    assert str(programs[0]) == "rank 0: 0F0 SEND_act1.0->1 | RECV_act3.0<-1 3F0"
    assert str(programs[1]) == "rank 1: RECV_act1.0<-0 1F0 | 2F0 SEND_act3.0->0"
    assert programs[0].incoming == {1: (Message("act", 3, 0, 1, 0),)}
    assert programs[0].outgoing == {1: (Message("act", 1, 0, 0, 1),)}
    one_way = forward_only(lower(_plan([0, 1], ["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"], 2)).programs[0])
    assert one_way.incoming == {}  # rank 1 sends rank 0 gradients only


@pytest.mark.parametrize("seed", range(30))
def test_an_evaluation_of_a_runnable_plan_runs_to_the_end(seed):
    """Each rank's forwards in the plan's order, each waiting for the forward before it: run
    as a list machine (every rank runs its next op once its input is there), no rank stops
    short, and each channel's activations leave in the order the receiver expects them."""
    plan = _random_plan(seed)
    programs = [forward_only(program) for program in lower(plan).programs]
    done, position, sent = set(), [0] * plan.pp, {}
    progressed = True
    while progressed:
        progressed = False
        for rank, program in enumerate(programs):
            if position[rank] == len(program.instrs):
                continue
            instr = program.instrs[position[rank]]
            op = instr.op
            if op.stage > 0 and (op.stage - 1, op.mb) not in done:
                continue
            done.add((op.stage, op.mb))
            for message in instr.sends:
                sent.setdefault((message.src, message.dst), []).append(message)
            position[rank] += 1
            progressed = True
    assert position == [len(p.instrs) for p in programs]
    assert len(done) == plan.num_stages * plan.microbatches
    for program in programs:
        for src, messages in program.incoming.items():
            assert sent[(src, program.rank)] == list(messages)


def _random_plan(seed: int):
    rng = random.Random(seed)
    pp = rng.randint(1, 4)
    num_stages = rng.randint(pp, 3 * pp)
    ranks = list(range(pp)) + [rng.randrange(pp) for _ in range(num_stages - pp)]
    rng.shuffle(ranks)
    microbatches = rng.randint(1, 5)
    schedule = h.list_schedule(ranks, microbatches, split=lambda s, m: rng.random() < 0.5, rng=rng)
    return _plan(ranks, schedule, microbatches)


@pytest.mark.parametrize("seed", range(40))
def test_every_message_is_sent_once_received_once_in_sender_order(seed):
    plan = _random_plan(seed)
    check_runnable(plan)
    lowered = lower(plan)
    rank_of = [s.rank for s in plan.stages]
    sent = Counter(m for p in lowered.programs for i in p.instrs for m in i.sends)
    received = Counter(m for p in lowered.programs for i in p.instrs for m in i.recvs)
    assert sent == received and set(sent.values()) <= {1}
    # exactly the stage boundaries that cross ranks carry messages, both ways, per microbatch
    crossings = sum(1 for s in range(plan.num_stages - 1) if rank_of[s] != rank_of[s + 1])
    assert len(sent) == 2 * crossings * plan.microbatches
    for program in lowered.programs:
        for src, messages in program.incoming.items():
            assert messages == lowered.programs[src].outgoing[program.rank]
            assert all(m.src == src and m.dst == program.rank for m in messages)
        # every message is received before the op that consumes it, by that op
        for instr in program.instrs:
            for m in instr.recvs:
                assert (m.stage, m.mb) == (instr.op.stage, instr.op.mb)
                assert (instr.op.kind is Kind.F) == (m.kind == "act")


def test_header_round_trips_tuples_of_any_dtype():
    tensors = [torch.zeros(2, 3, 4), torch.zeros(5, dtype=torch.int64), torch.zeros((), dtype=torch.bfloat16), torch.zeros(0, 7)]
    message = Message("grad", 3, 12, 1, 0)
    key, layout = decode_header(encode_header(message, tensors))
    assert key == ("grad", 3, 12)
    assert layout == layout_of(tensors) == tuple((t.dtype, tuple(t.shape)) for t in tensors)
    assert decode_header(encode_header(message, []))[1] == ()


def test_header_overflow_is_an_error_not_a_truncation():
    with pytest.raises(ValueError, match="header words"):
        encode_header(Message("act", 1, 0, 0, 1), [torch.zeros([1] * 8)] * (HEADER_SLOTS // 10 + 1))


def test_baseline_schedules_lower(tmp_path):
    pytest.importorskip("octoplan.baseline")
    model_path, config = h.model_spec("tiny10", tmp_path)
    for schedule in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv", "dualpipev"):
        plan = h.baseline_plan(schedule, model_path, config, tmp_path, gpus=4, pp=4, microbatches=8)
        check_runnable(plan)
        lowered = lower(plan)
        crossings = sum(1 for s in range(plan.num_stages - 1) if plan.stages[s].rank != plan.stages[s + 1].rank)
        assert sum(len(m) for p in lowered.programs for m in p.incoming.values()) == 2 * crossings * 8
        if schedule in ("zbv", "dualpipev"):  # V: the two middle stages share the last rank
            assert crossings == plan.num_stages - 2


def test_random_plans_pass_the_planners_structure_check():
    # the generator used throughout these tests emits plans the planner's own checks accept
    from octoplan.plan import check_structure

    for seed in range(10):
        check_structure(_random_plan(seed))
