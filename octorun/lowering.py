"""Lowering: a plan's compute op lists -> each pipeline rank's communication program.

This is the one place that decides which tensors travel between pipeline ranks. A plan lists
compute ops only (SPEC section 1); for every rank, :func:`lower` derives

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

:func:`check_runnable` replays the per-rank orders against the SPEC dependencies with unbounded,
asynchronous sends — the runtime's own model — and raises :class:`ScheduleError` naming the op
each rank is stuck on when the orders cannot run to the end. Both are pure functions of the plan:
no torch, no I/O.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from octoplan.ops import Kind, Op
from octoplan.plan import Plan

__all__ = [
    "ACT",
    "GRAD",
    "Message",
    "Instr",
    "RankProgram",
    "Lowered",
    "ScheduleError",
    "lower",
    "check_runnable",
    "dependencies",
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


class ScheduleError(ValueError):
    """The per-rank orders cannot run to the end; the message names what each rank waits for."""


def dependencies(plan: Plan, op: Op) -> list[Op]:
    """The ops that ``op`` needs (SPEC section 1), given which backward form the plan uses."""
    last = plan.num_stages - 1
    if op.kind is Kind.F:
        return [Op(op.stage - 1, Kind.F, op.mb)] if op.stage > 0 else []
    if op.kind is Kind.W:
        return [Op(op.stage, Kind.I, op.mb)]
    deps = [Op(op.stage, Kind.F, op.mb)]
    if op.stage < last:
        deps.append(_input_grad_op(plan, op.stage + 1, op.mb))
    return deps


def _input_grad_op(plan: Plan, stage: int, mb: int) -> Op:
    """The op computing stage ``stage``'s input gradient: its I, or its B when it is fused."""
    i_op = Op(stage, Kind.I, mb)
    rank = plan.stages[stage].rank
    return i_op if i_op in set(plan.schedule[rank]) else Op(stage, Kind.B, mb)


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


def check_runnable(plan: Plan) -> None:
    """Raise :class:`ScheduleError` unless every rank's op list can run to the end.

    Replays the orders with the runtime's semantics: a rank runs its next op as soon as the ops
    it depends on have run anywhere (sends never block). If no rank can move, the error lists,
    per rank, the op it is stuck on and the op (and rank) that op waits for.
    """
    done: set[Op] = set()
    position = [0] * plan.pp
    remaining = sum(len(ops) for ops in plan.schedule)
    while remaining:
        moved = False
        for rank, ops in enumerate(plan.schedule):
            while position[rank] < len(ops):
                op = ops[position[rank]]
                if not all(dep in done for dep in dependencies(plan, op)):
                    break
                done.add(op)
                position[rank] += 1
                remaining -= 1
                moved = True
        if not moved:
            waits = []
            for rank, ops in enumerate(plan.schedule):
                if position[rank] < len(ops):
                    op = ops[position[rank]]
                    missing = [dep for dep in dependencies(plan, op) if dep not in done]
                    needs = ", ".join(f"{dep} on rank {plan.stages[dep.stage].rank}" for dep in missing)
                    waits.append(f"rank {rank} stuck at {op} (step {position[rank]}) waiting for {needs}")
            raise ScheduleError("schedule cannot run to the end: " + "; ".join(waits))
