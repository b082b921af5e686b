"""Lowering: a plan's compute op lists -> each pipeline rank's communication program.

This is the one place that decides which tensors travel between pipeline ranks. A plan lists
compute ops only (FORMATS.md section 1); for every rank, :func:`lower` derives

* before each op, the messages it must have received (its inputs from another rank);
* after each op, the messages it sends (its outputs another rank needs);
* for every directed channel ``src -> dst``, the order in which ``src`` sends — the receiver
  posts its receives in exactly this order, which is what NCCL requires (it ignores tags) and
  what lets a receiver drain a channel ahead of need;
* for every stage, the position of its last weight-gradient op (W or B), where the data-parallel
  gradient all-reduce of that stage may start.

Two kinds of message exist: ``act`` (the input of stage ``s`` for microbatch ``mb``, produced by
``F(s-1, mb)``) and ``grad`` (the gradient of stage ``s``'s output, produced by ``I``/``B`` of
stage ``s+1``). Adjacent stages on one rank hand tensors over directly: no message.

Whether the orders can run to the end at all is checked before lowering, by the planner's own
validator (:func:`octoplan.validate.check_runnable`): the runtime's sends never block, which is
the simulator's model too. Lowering is a pure function of the plan: no torch, no I/O.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace

from octoplan.ops import Kind, Op
from octoplan.plan import Plan

__all__ = [
    "ACT",
    "GRAD",
    "Message",
    "Instr",
    "RankProgram",
    "Lowered",
    "lower",
    "forward_only",
]

ACT = "act"
GRAD = "grad"


@dataclass(frozen=True, order=True)
class Message:
    """One tensor (or tuple of tensors) travelling between two pipeline ranks.

    ``kind`` is ``act`` (input of ``stage``) or ``grad`` (gradient of ``stage``'s output).
    """

    kind: str
    stage: int
    mb: int
    src: int
    dst: int

    def __str__(self) -> str:
        what = "activation into" if self.kind == ACT else "gradient out of"
        return f"{what} stage {self.stage} mb {self.mb} from rank {self.src} to rank {self.dst}"

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.kind, self.stage, self.mb)


@dataclass(frozen=True)
class Instr:
    """One compute op with the messages it waits for before and sends after."""

    op: Op
    recvs: tuple[Message, ...]
    sends: tuple[Message, ...]
    allreduce_stage: int | None = None  # stage whose last weight-gradient op this is

    def __str__(self) -> str:
        parts = [f"RECV_{m.kind}{m.stage}.{m.mb}<-{m.src}" for m in self.recvs]
        parts.append(str(self.op))
        parts += [f"SEND_{m.kind}{m.stage}.{m.mb}->{m.dst}" for m in self.sends]
        if self.allreduce_stage is not None:
            parts.append(f"ALLREDUCE{self.allreduce_stage}")
        return " ".join(parts)


@dataclass(frozen=True)
class RankProgram:
    """Everything one pipeline rank executes per step."""

    rank: int
    instrs: tuple[Instr, ...]
    stages: tuple[int, ...]
    incoming: dict[int, tuple[Message, ...]]  # src rank -> messages in the order src sends them
    outgoing: dict[int, tuple[Message, ...]]  # dst rank -> messages in the order sent

    def __str__(self) -> str:
        return f"rank {self.rank}: " + " | ".join(str(i) for i in self.instrs)


@dataclass(frozen=True)
class Lowered:
    programs: tuple[RankProgram, ...]  # indexed by pipeline rank
    channels: tuple[tuple[int, int], ...]  # directed (src, dst) pairs that carry messages, sorted


def lower(plan: Plan) -> Lowered:
    """Derive every rank's communication program from the plan's compute op lists."""
    last = plan.num_stages - 1
    rank_of = [stage.rank for stage in plan.stages]
    instrs: dict[int, list[Instr]] = {}
    outgoing: dict[int, dict[int, list[Message]]] = defaultdict(lambda: defaultdict(list))
    for rank, ops in enumerate(plan.schedule):
        last_weight_op: dict[int, int] = {}
        for index, op in enumerate(ops):
            if op.kind in (Kind.W, Kind.B):
                last_weight_op[op.stage] = index
        rank_instrs = []
        for index, op in enumerate(ops):
            recvs: list[Message] = []
            sends: list[Message] = []
            if op.kind is Kind.F:
                if op.stage > 0 and rank_of[op.stage - 1] != rank:
                    recvs.append(Message(ACT, op.stage, op.mb, rank_of[op.stage - 1], rank))
                if op.stage < last and rank_of[op.stage + 1] != rank:
                    sends.append(Message(ACT, op.stage + 1, op.mb, rank, rank_of[op.stage + 1]))
            elif op.kind in (Kind.I, Kind.B):
                if op.stage < last and rank_of[op.stage + 1] != rank:
                    recvs.append(Message(GRAD, op.stage, op.mb, rank_of[op.stage + 1], rank))
                if op.stage > 0 and rank_of[op.stage - 1] != rank:
                    sends.append(Message(GRAD, op.stage - 1, op.mb, rank, rank_of[op.stage - 1]))
            for message in sends:
                outgoing[rank][message.dst].append(message)
            allreduce = op.stage if last_weight_op.get(op.stage) == index else None
            rank_instrs.append(Instr(op=op, recvs=tuple(recvs), sends=tuple(sends), allreduce_stage=allreduce))
        instrs[rank] = rank_instrs
    programs = []
    for rank in range(plan.pp):
        incoming = {src: tuple(msgs[rank]) for src, msgs in sorted(outgoing.items()) if msgs.get(rank)}
        programs.append(
            RankProgram(
                rank=rank,
                instrs=tuple(instrs[rank]),
                stages=tuple(plan.stages_of(rank)),
                incoming=incoming,
                outgoing={dst: tuple(msgs) for dst, msgs in sorted(outgoing[rank].items())},
            )
        )
    channels = tuple(sorted((src, dst) for src, per in outgoing.items() for dst, msgs in per.items() if msgs))
    return Lowered(programs=tuple(programs), channels=channels)


def forward_only(program: RankProgram) -> RankProgram:
    """``program`` as an evaluation runs it (octorun ``--eval-data``): its F ops in the plan's
    order, each with the activations it receives and sends; no backward, no gradient message, no
    all-reduce.

    It runs to the end wherever the plan's orders do: an F waits only for the F of the stage
    before it, and every rank keeps its Fs in the plan's order, so a wait here that could never
    end would be one in the plan's own orders too."""
    def activations(channels: dict[int, tuple[Message, ...]]) -> dict[int, tuple[Message, ...]]:
        kept = {peer: tuple(m for m in messages if m.kind == ACT) for peer, messages in channels.items()}
        return {peer: messages for peer, messages in kept.items() if messages}

    return RankProgram(
        rank=program.rank,
        instrs=tuple(replace(instr, allreduce_stage=None) for instr in program.instrs if instr.op.kind is Kind.F),
        stages=program.stages,
        incoming=activations(program.incoming),
        outgoing=activations(program.outgoing),
    )
