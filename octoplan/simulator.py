"""The graph-based simulator: plan + costs -> timeline (docs/FORMATS.md section 7).

Nodes are compute ops and the transfers between ranks; edges are data dependencies and each
rank's order. Because every rank runs its list in order, and the transfers of one directed rank
pair leave in the order their producing ops run, every start time is a longest path in a DAG:
the simulator advances each rank as far as the ops already timed allow, parks it on the op it
needs, and wakes it when that op is timed — no event queue, each op touched once. Ranks left
parked with nothing to wake them are a deadlock, reported with the op each rank waits on.

Pure: no I/O, no printing. The hot loop works on flat integer keys
``(stage * 4 + kind) * microbatches + mb`` rather than on :class:`Op` objects, so that a
49k-op plan simulates in well under a second (see benchmarks/bench_simulator.py).
"""

from __future__ import annotations

import itertools
from array import array
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple, Sequence

import numpy as np

from octoplan.costs import LayerTable, StageCost, allreduce_ms, lower_bound_ms, stage_costs, tied_allreduce_ms, transfer_ms
from octoplan.memory import static_bytes
from octoplan.ops import Kind, Op
from octoplan.plan import Plan
from octoplan.profile import Profile, TiedParameter

__all__ = [
    "DeadlockError",
    "SimResult",
    "Span",
    "Transfer",
    "Bubble",
    "AllReduce",
    "TiedAllReduce",
    "simulate",
    "simulate_costs",
]

_KINDS = (Kind.F, Kind.I, Kind.W, Kind.B)
_KIND_CODE = {Kind.F: 0, Kind.I: 1, Kind.W: 2, Kind.B: 3}


class DeadlockError(RuntimeError):
    """The per-rank orders and the dependencies form a cycle.

    ``waits`` lists, for each rank that cannot go on, ``(rank, op, needed_op, needed_rank)``.
    """

    def __init__(self, waits: list[tuple[int, Op, Op, int]]):
        self.waits = waits
        parts = [f"rank {r} waits at {op} for {need} (rank {nr})" for r, op, need, nr in waits]
        super().__init__("deadlock: " + "; ".join(parts))


class Span(NamedTuple):
    rank: int
    op: Op
    start_ms: float
    end_ms: float


class Transfer(NamedTuple):
    src_rank: int
    dst_rank: int
    op: Op  # the op whose output (activation or gradient) travels
    start_ms: float
    end_ms: float


class AllReduce(NamedTuple):
    rank: int
    stage: int
    start_ms: float
    end_ms: float


class TiedAllReduce(NamedTuple):
    """The sum of a tied tensor's gradient copies (``Profile.tied[group]``) over the pipeline
    ranks that hold one, in every data-parallel replica at once."""

    group: int
    ranks: tuple[int, ...]
    start_ms: float
    end_ms: float


class Bubble(NamedTuple):
    """An idle gap on a rank and what it waited for.

    ``reason``: ``dependency`` (the needed op was still running or not yet started),
    ``transfer`` (the needed op had finished but its data was still on the wire),
    ``drain`` (the rank was done and waited for the iteration to end).
    """

    rank: int
    start_ms: float
    end_ms: float
    reason: str
    waits_for: Op | None
    from_rank: int | None

    @property
    def duration_ms(self) -> float:
        return self.end_ms - self.start_ms


@dataclass(frozen=True)
class SimResult:
    """The timeline of one iteration and its summary figures.

    Large per-op data is kept as flat arrays; :meth:`spans`, :attr:`bubbles`,
    :attr:`critical_path` decode it on demand so that the tuner pays only for the summary.
    """

    iteration_ms: float
    bubble_ratio: float
    lower_bound_ms: float
    peak_memory_bytes: tuple[int, ...]
    memory_limit_bytes: int
    # the part of each rank's peak that its weights, gradients and optimizer state take
    static_memory_bytes: tuple[int, ...]
    # per rank, the most bytes its tapes hold at once (what ``octorun --activation-memory``
    # measures; ``peak_memory_bytes`` adds the messages beside them), and the most its
    # transport holds: messages received and not yet used, the receive buffers posted ahead,
    # sends not yet let go (:func:`_message_peaks`)
    peak_activation_bytes: tuple[int, ...]
    peak_message_bytes: tuple[int, ...]
    busy_ms: tuple[float, ...]
    allreduces: tuple[AllReduce, ...]
    tied_allreduces: tuple[TiedAllReduce, ...]
    _schedule: tuple[tuple[Op, ...], ...] = field(repr=False)
    _rank_of_stage: tuple[int, ...] = field(repr=False)
    _keys: tuple[list[int], ...] = field(repr=False)
    _start: list[float] = field(repr=False)
    _end: list[float] = field(repr=False)
    _xfer_start: list[float] = field(repr=False)
    _arrive: list[float] = field(repr=False)
    _cross: list[int] = field(repr=False)
    _num_mb: int = field(repr=False)

    @property
    def efficiency(self) -> float:
        return self.lower_bound_ms / self.iteration_ms if self.iteration_ms > 0 else 1.0

    @property
    def fits_memory(self) -> bool:
        return max(self.peak_memory_bytes) <= self.memory_limit_bytes

    @property
    def peak_with_message_bytes(self) -> tuple[int, ...]:
        """Per rank, the most its tapes and its messages hold together (``peak_memory_bytes``
        less the static bytes): what ``octorun --activation-memory`` measures as its second figure."""
        return tuple(peak - static for peak, static in zip(self.peak_memory_bytes, self.static_memory_bytes))

    def prediction(self) -> dict:
        """A plan's ``predicted`` section (docs/FORMATS.md): the figures octorun sets its
        measurements beside."""
        out = {
            "iteration_ms": round(self.iteration_ms, 4),
            "bubble_ratio": round(self.bubble_ratio, 4),
            "efficiency": round(self.efficiency, 4),
            "peak_activation_bytes": list(self.peak_activation_bytes),
            "peak_with_message_bytes": list(self.peak_with_message_bytes),
        }
        if self.tied_allreduces:
            out["tied_allreduce_ms"] = self.tied_allreduce_ms
        return out

    @property
    def tied_allreduce_ms(self) -> list[float]:
        """Each tied all-reduce's duration (start to end), in the profile's group order: only
        the groups held on more than one rank have one."""
        return [round(ar.end_ms - ar.start_ms, 6) for ar in self.tied_allreduces]

    @property
    def num_ranks(self) -> int:
        return len(self._schedule)

    @property
    def busiest_rank(self) -> int:
        """The rank that computes longest (the lowest such rank on a tie)."""
        return max(range(self.num_ranks), key=lambda r: (self.busy_ms[r], -r))

    def _op(self, key: int) -> Op:
        code, mb = divmod(key, self._num_mb)
        stage, kind = divmod(code, 4)
        return Op(stage, _KINDS[kind], mb)

    def spans(self, rank: int | None = None) -> list[Span]:
        ranks = range(self.num_ranks) if rank is None else (rank,)
        out = []
        for r in ranks:
            for op, key in zip(self._schedule[r], self._keys[r]):
                out.append(Span(r, op, self._start[key], self._end[key]))
        return out

    def op_times(self) -> dict[Op, tuple[float, float]]:
        return {span.op: (span.start_ms, span.end_ms) for span in self.spans()}

    @cached_property
    def transfers(self) -> list[Transfer]:
        out = []
        num_stages = len(self._rank_of_stage)
        for r in range(self.num_ranks):
            for op, key in zip(self._schedule[r], self._keys[r]):
                if op.kind is Kind.W:
                    continue
                dst_stage = op.stage + 1 if op.kind is Kind.F else op.stage - 1
                if not 0 <= dst_stage < num_stages:
                    continue
                dst = self._rank_of_stage[dst_stage]
                if dst != r:
                    out.append(Transfer(r, dst, op, self._xfer_start[key], self._arrive[key]))
        return out

    @cached_property
    def bubbles(self) -> list[Bubble]:
        """Every idle gap of every rank between the iteration's start and end."""
        eps = 1e-9
        out = []
        for r in range(self.num_ranks):
            t = 0.0
            for op, key in zip(self._schedule[r], self._keys[r]):
                start = self._start[key]
                if start > t + eps:
                    cross = self._cross[key]
                    need = self._op(cross) if cross >= 0 else None
                    from_rank = self._rank_of_stage[need.stage] if need is not None else None
                    # Whichever part of the wait was longer names it: the needed op still
                    # running (dependency), or its output still on the wire (transfer).
                    reason = "dependency"
                    if cross >= 0 and from_rank != r:
                        wire_wait = start - max(self._end[cross], t)
                        if wire_wait > self._end[cross] - t:
                            reason = "transfer"
                    out.append(Bubble(r, t, start, reason, need, from_rank))
                t = self._end[key]
            if self.iteration_ms > t + eps:
                out.append(Bubble(r, t, self.iteration_ms, "drain", None, None))
        return out

    def idle_parts(self, rank: int) -> tuple[float, float, float]:
        """``rank``'s idle time in three parts: before its first op (the pipeline filling up to
        it), between its ops (waits on other ranks' ops and transfers), after its last op (the
        pipeline draining, and the all-reduce). They call for different fixes: warm-up idle
        shrinks only if the rank holds less work or starts from earlier stages, idle between
        ops if the ranks it waits on get lighter or its order changes."""
        return self._idle_parts[rank]

    @cached_property
    def first_start_ms(self) -> list[float]:
        """Per rank, when its first op starts (0 for a rank without ops)."""
        return [self._start[keys[0]] if keys else 0.0 for keys in self._keys]

    @cached_property
    def _idle_parts(self) -> list[tuple[float, float, float]]:
        parts = [[0.0, 0.0, 0.0] for _ in range(self.num_ranks)]  # one pass over the bubbles
        # the wait before a rank's first op, even when an op of no time at 0 came first
        first_start = self.first_start_ms
        for bubble in self.bubbles:
            if bubble.reason == "drain":
                part = 2
            else:
                part = 0 if bubble.end_ms <= first_start[bubble.rank] + 1e-9 else 1
            parts[bubble.rank][part] += bubble.duration_ms
        return [(before, between, after) for before, between, after in parts]

    @cached_property
    def critical_path(self) -> list[Op]:
        """The chain of ops that decides the iteration time, first op first.

        From the op that ends last, step back to whichever predecessor released it: the
        dependency whose data arrived just as the op started, else the rank's previous op when
        it ended just then (where both did, the dependency: the path follows the data).
        """
        eps = 1e-9
        last_key, last_end, last_rank = -1, -1.0, -1
        for r in range(self.num_ranks):
            if self._keys[r]:
                key = self._keys[r][-1]
                if self._end[key] > last_end:
                    last_key, last_end, last_rank = key, self._end[key], r
        if last_key < 0:
            return []
        position = {key: (r, i) for r in range(self.num_ranks) for i, key in enumerate(self._keys[r])}
        path = []
        key, rank = last_key, last_rank
        while True:
            path.append(self._op(key))
            r, i = position[key]
            start = self._start[key]
            cross = self._cross[key]
            if cross >= 0 and abs(self._arrive[cross] - start) <= eps and start > eps:
                key = cross
                continue
            if i > 0:
                prev = self._keys[r][i - 1]
                if abs(self._end[prev] - start) <= eps:
                    key = prev
                    continue
            break
        path.reverse()
        return path

    def summary(self) -> dict:
        """FORMATS.md section 7's figures."""
        return {
            "iteration_ms": round(self.iteration_ms, 6),
            "bubble_ratio": round(self.bubble_ratio, 6),
            "lower_bound_ms": round(self.lower_bound_ms, 6),
            "efficiency": round(self.efficiency, 6),
            "peak_memory_bytes": list(self.peak_memory_bytes),
            "peak_activation_bytes": list(self.peak_activation_bytes),
            "peak_message_bytes": list(self.peak_message_bytes),
            "fits_memory": self.fits_memory,
            "memory_limit_bytes": self.memory_limit_bytes,
            "busy_ms": [round(b, 6) for b in self.busy_ms],
            # per rank: idle before its first op, between its ops, after its last (idle_parts)
            "idle_ms": [[round(ms, 6) for ms in self.idle_parts(r)] for r in range(self.num_ranks)],
            # present only where a tied tensor's copies are summed across ranks
            **({"tied_allreduce_ms": self.tied_allreduce_ms} if self.tied_allreduces else {}),
        }


def simulate(plan: Plan, profile: Profile, *, optimizer: str = "adam-mixed", table: LayerTable | None = None) -> SimResult:
    """Simulate one iteration of ``plan`` with ``profile``'s costs on the plan's cluster."""
    table = table or LayerTable(profile)
    costs = stage_costs(plan.stages, table)
    return simulate_costs(
        plan,
        costs,
        lower_bound=lower_bound_ms(profile, pp=plan.pp, microbatches=plan.microbatches,
                                   op_overhead_ms=plan.cluster.op_overhead_us / 1000.0),
        dtype_bytes=profile.param_dtype_bytes,
        optimizer=optimizer,
        tied=profile.tied,
    )


def simulate_costs(
    plan: Plan,
    costs: Sequence[StageCost],
    *,
    lower_bound: float = 0.0,
    dtype_bytes: int = 2,
    optimizer: str = "adam-mixed",
    tied: Sequence[TiedParameter] = (),
) -> SimResult:
    """Simulate with explicit per-stage costs (the tuner's entry point). ``dtype_bytes``: the
    bytes of one parameter (``Profile.param_dtype_bytes``); ``tied``: the profile's tied
    tensors (``Profile.tied``).

    Four phases: every op's static data by flat key (:func:`_op_table`), each rank's static
    memory (:func:`_static_memory`), the ranks run to the end (:func:`_run_ranks`, the hot
    loop), then the all-reduces and memory peaks that follow from the op times."""
    num_mb = plan.microbatches
    num_ranks = plan.pp
    rank_of_stage = tuple(stage.rank for stage in plan.stages)
    cluster = plan.cluster
    ops = _op_table(plan, costs, rank_of_stage)
    keys = ops.keys
    # per tied tensor, the stage of each member: a rank holding several members holds one tensor
    tied_stages = [[_stage_of_layer(plan, layer) for layer in group.layers] for group in tied]
    static = _static_memory(costs, rank_of_stage, num_ranks, tied, tied_stages, dtype_bytes=dtype_bytes, optimizer=optimizer)
    run = _run_ranks(ops, static, num_ranks=num_ranks, num_mb=num_mb, rank_of_stage=rank_of_stage)
    start, end, free, busy = run.start, run.end, run.free, run.busy

    last_end = max((free[r] for r in range(num_ranks) if keys[r]), default=0.0)
    allreduces = _dp_allreduces(plan, keys, end, costs, rank_of_stage, tied, tied_stages)
    if allreduces:
        last_end = max([last_end] + [ar.end_ms for ar in allreduces])
    tied_allreduces = _tied_allreduces(plan, free, allreduces, tied, tied_stages, rank_of_stage, has_ops=[bool(k) for k in keys])
    last_end = max([last_end] + [ar.end_ms for ar in tied_allreduces])

    first_start = min((start[k[0]] for k in keys if k), default=0.0)
    iteration = last_end - first_start
    tape_peak = [peak - base for peak, base in zip(run.peak_mem, static)]
    with_messages, message_peak = _memory_peaks(ops, run, costs, num_mb=num_mb, first_start=first_start, last_end=last_end)
    # the main loop's tape peak also holds the bursts of ops that take no time, which the
    # sweep's instants merge away
    peak_mem = [base + max(tape, both) for base, tape, both in zip(static, tape_peak, with_messages)]
    idle = sum(iteration - b for b in busy)
    bubble_ratio = idle / (num_ranks * iteration) if iteration > 0 else 0.0
    return SimResult(
        iteration_ms=iteration,
        bubble_ratio=bubble_ratio,
        lower_bound_ms=lower_bound,
        peak_memory_bytes=tuple(int(m) for m in peak_mem),
        memory_limit_bytes=cluster.memory_bytes,
        static_memory_bytes=tuple(int(m) for m in static),
        peak_activation_bytes=tuple(int(m) for m in tape_peak),
        peak_message_bytes=tuple(int(m) for m in message_peak),
        busy_ms=tuple(busy),
        allreduces=tuple(allreduces),
        tied_allreduces=tuple(tied_allreduces),
        _schedule=plan.schedule,
        _rank_of_stage=rank_of_stage,
        _keys=tuple(keys),
        _start=start,
        _end=end,
        _xfer_start=run.xstart,
        _arrive=run.arrive,
        _cross=ops.cross,
        _num_mb=num_mb,
    )


class _OpTable(NamedTuple):
    """A plan's ops by flat key ``(stage * 4 + kind) * microbatches + mb``: what the main loop
    reads of each (every list has an entry per key, run by the plan or not)."""

    keys: list[list[int]]  # per rank, its ops' keys in its order
    present: bytearray  # 1 where the plan runs the op
    dur: list[float]
    cross: list[int]  # the op of another stage it needs (-1: none)
    local: list[int]  # the op of its own stage it needs (-1: none)
    dest: list[int]  # the rank its output travels to (-1: none, or its own)
    wire: list[float]  # that transfer's time
    act: list[int]  # activation bytes the op allocates (F, +) or frees (B/W, -)
    burst: list[int]  # bytes it holds above its start only while it runs (an I; a recomputing B)


def _op_table(plan: Plan, costs: Sequence[StageCost], rank_of_stage: Sequence[int]) -> _OpTable:
    """Per key: duration, the cross-stage dependency, the same-stage dependency, where the op's
    output goes (destination rank and wire time), and its memory."""
    num_mb = plan.microbatches
    num_stages = len(plan.stages)
    cluster, parallel = plan.cluster, plan.parallel
    size = num_stages * 4 * num_mb
    dur = [0.0] * size
    cross = [-1] * size
    local = [-1] * size
    dest = [-1] * size
    wire = [0.0] * size
    act = [0] * size
    burst = [0] * size
    present = bytearray(size)
    keys: list[list[int]] = []
    for ops in plan.schedule:
        rank_keys = []
        for stage, kind, mb in ops:
            key = (stage * 4 + _KIND_CODE[kind]) * num_mb + mb
            rank_keys.append(key)
            present[key] = 1
        keys.append(rank_keys)

    xfer_cache: dict[tuple[int, int, int], float] = {}

    def wire_ms(src: int, dst: int, num_bytes: int) -> float:
        cache_key = (src, dst, num_bytes)
        value = xfer_cache.get(cache_key)
        if value is None:
            value = xfer_cache[cache_key] = transfer_ms(cluster, parallel, src, dst, num_bytes)
        return value

    for stage in range(num_stages):
        cost = costs[stage]
        rank = rank_of_stage[stage]
        base = stage * 4 * num_mb
        overhead = cluster.op_overhead_us / 1000.0
        f_ms, i_ms, w_ms = cost.forward_ms + overhead, cost.backward_input_ms + overhead, cost.backward_weight_ms + overhead
        next_rank = rank_of_stage[stage + 1] if stage + 1 < num_stages else -1
        prev_rank = rank_of_stage[stage - 1] if stage > 0 else -1
        fwd_wire = wire_ms(rank, next_rank, cost.output_bytes) if next_rank >= 0 else 0.0
        bwd_wire = wire_ms(rank, prev_rank, costs[stage - 1].output_bytes) if prev_rank >= 0 else 0.0
        b_ms = cost.b_ms + overhead
        # I frees all but what its W reads and adds the gradients W starts from, peaking while
        # it runs; with recomputation I and B first rebuild the activations (octoplan.costs.StageCost)
        f_act, i_act, w_act, b_act = (cost.activation_bytes, cost.i_delta_bytes,
                                      -(cost.w_held_bytes + cost.pending_w_bytes), -cost.activation_bytes)
        i_burst, b_burst = cost.recompute_bytes + cost.i_peak_bytes, cost.recompute_bytes
        for mb in range(num_mb):
            kf = base + mb
            ki = base + num_mb + mb
            kw = base + 2 * num_mb + mb
            kb = base + 3 * num_mb + mb
            dur[kf], dur[ki], dur[kw], dur[kb] = f_ms, i_ms, w_ms, b_ms
            act[kf], act[ki], act[kw], act[kb] = f_act, i_act, w_act, b_act  # W exists only where I does
            burst[ki], burst[kb] = i_burst, b_burst
            if stage > 0:
                cross[kf] = ((stage - 1) * 4) * num_mb + mb
            if stage + 1 < num_stages:
                nb = (stage + 1) * 4 * num_mb
                downstream = nb + num_mb + mb if present[nb + num_mb + mb] else nb + 3 * num_mb + mb
                cross[ki] = cross[kb] = downstream
            local[ki] = local[kb] = kf
            local[kw] = ki
            if next_rank >= 0 and next_rank != rank:
                dest[kf], wire[kf] = next_rank, fwd_wire
            if prev_rank >= 0 and prev_rank != rank:
                dest[ki], wire[ki] = prev_rank, bwd_wire
                dest[kb], wire[kb] = prev_rank, bwd_wire
    return _OpTable(keys, present, dur, cross, local, dest, wire, act, burst)


def _static_memory(costs: Sequence[StageCost], rank_of_stage: Sequence[int], num_ranks: int,
                   tied: Sequence[TiedParameter], tied_stages: list[list[int]], *, dtype_bytes: int,
                   optimizer: str) -> list[int]:
    """Per rank, the bytes its weights, gradients, optimizer state and buffers take: its stages',
    a tied tensor it holds for several members once."""
    static = [0] * num_ranks
    for stage in range(len(rank_of_stage)):
        static[rank_of_stage[stage]] += static_bytes(costs[stage].param_bytes, dtype_bytes=dtype_bytes,
                                                     optimizer=optimizer) + costs[stage].buffer_bytes
    for group, stages in zip(tied, tied_stages):
        for r in range(num_ranks):
            copies = sum(rank_of_stage[stage] == r for stage in stages)
            if copies > 1:
                static[r] -= static_bytes(group.bytes * (copies - 1), dtype_bytes=dtype_bytes, optimizer=optimizer)
    return static


class _Run(NamedTuple):
    """The main loop's outcome: per key, when each op started and ended, when its output
    arrived and its transfer started; per rank, when it was last free, how long it was busy,
    and the most memory it held."""

    start: array
    end: array
    arrive: array
    xstart: list[float]
    free: list[float]
    busy: list[float]
    peak_mem: list[int]


def _run_ranks(ops: _OpTable, static: Sequence[int], *, num_ranks: int, num_mb: int,
               rank_of_stage: Sequence[int]) -> _Run:
    """Every rank run through its list in order (the module's docstring); ``DeadlockError``
    where ranks are left waiting on each other."""
    keys, dur, cross, local = ops.keys, ops.dur, ops.cross, ops.local
    dest, wire, act, burst = ops.dest, ops.wire, ops.act, ops.burst
    size = len(dur)
    bursts = any(burst)  # whether any op holds memory only while it runs (an I, a recomputing B)
    # typed arrays: numpy reads them without a copy (_message_peaks)
    start = array("d", bytes(8 * size))
    end = array("d", bytes(8 * size))
    arrive = array("d", bytes(8 * size))
    xstart = [0.0] * size
    done = bytearray(size)
    ptr = [0] * num_ranks
    free = [0.0] * num_ranks
    busy = [0.0] * num_ranks
    cur_mem = list(static)
    peak_mem = list(static)
    link_free = [[0.0] * num_ranks for _ in range(num_ranks)]
    remaining = sum(len(k) for k in keys)
    lengths = [len(k) for k in keys]

    # A worklist of ranks that may advance: a rank runs until it needs an op that has not run
    # yet, parks itself on that op, and is woken when the op runs. Each op is touched once.
    waiter = [-1] * size
    work = list(range(num_ranks - 1, -1, -1))
    # `while True`, not `while work`: CPython 3.11 specializes a function's bytecode after 8
    # calls or 8 unconditional backward jumps, and a `while` condition jumps back conditionally;
    # so written, a process's first 7 simulations ran unspecialized, about 1.5x slower
    while True:
        if not work:
            break
        r = work.pop()
        seq = keys[r]
        p = ptr[r]
        n = lengths[r]
        t = free[r]
        b = busy[r]
        mem = cur_mem[r]
        peak = peak_mem[r]
        links = link_free[r]
        while p < n:
            k = seq[p]
            c = cross[k]
            s = t
            if c >= 0:
                if not done[c]:
                    waiter[c] = r
                    break
                a = arrive[c]
                if a > s:
                    s = a
            lk = local[k]
            if lk >= 0 and not done[lk]:
                waiter[lk] = r
                break
            e = s + dur[k]
            start[k] = s
            end[k] = e
            done[k] = 1
            d = dest[k]
            if d >= 0:
                ts = links[d]
                if e > ts:
                    ts = e
                xstart[k] = ts
                te = ts + wire[k]
                links[d] = te
                arrive[k] = te
            else:
                arrive[k] = e
            w = waiter[k]
            if w >= 0 and w != r:
                work.append(w)
            if bursts:
                up = burst[k]
                if up and mem + up > peak:
                    peak = mem + up
            delta = act[k]
            if delta:
                mem += delta
                if mem > peak:
                    peak = mem
            b += e - s
            t = e
            p += 1
        remaining -= p - ptr[r]
        ptr[r] = p
        free[r] = t
        busy[r] = b
        cur_mem[r] = mem
        peak_mem[r] = peak
    if remaining:
        raise DeadlockError(_waits(keys, ptr, cross, local, done, num_mb, rank_of_stage))
    return _Run(start, end, arrive, xstart, free, busy, peak_mem)


def _dp_allreduces(plan: Plan, keys: Sequence[Sequence[int]], end: Sequence[float], costs: Sequence[StageCost],
                   rank_of_stage: Sequence[int], tied: Sequence[TiedParameter],
                   tied_stages: list[list[int]]) -> list[AllReduce]:
    """The data-parallel gradient all-reduces (none without data parallelism): each stage's
    starts after its last backward op on the rank, one at a time per rank, overlapping the
    rank's remaining compute."""
    allreduces: list[AllReduce] = []
    cluster, parallel = plan.cluster, plan.parallel
    if parallel.dp == 1:
        return allreduces
    for r in range(plan.pp):
        ready = []
        for op, key in zip(plan.schedule[r], keys[r]):
            if op.kind is not Kind.F:
                ready.append((op.stage, end[key]))
        last_bwd: dict[int, float] = {}
        for stage, t_end in ready:
            last_bwd[stage] = max(last_bwd.get(stage, 0.0), t_end)
        channel = 0.0
        order = sorted(last_bwd.items(), key=lambda item: item[1])
        reduced = _reduced_bytes(r, [stage for stage, _ in order], costs, rank_of_stage, tied, tied_stages)
        for stage, t_ready in order:
            t0 = max(t_ready, channel)
            channel = t0 + allreduce_ms(cluster, parallel, r, reduced[stage])
            allreduces.append(AllReduce(r, stage, t0, channel))
    return allreduces


def _memory_peaks(ops: _OpTable, run: _Run, costs: Sequence[StageCost], *, num_mb: int, first_start: float,
                  last_end: float) -> tuple[list[int], list[int]]:
    """:func:`_message_peaks` of the run, from the ops' data per (stage, kind)."""
    num_stages = len(costs)
    # per (stage, kind): what an op's output message weighs (an F's activation, an I's or B's
    # gradient), and what it does to its rank's tape
    msg_bytes = [0] * (4 * num_stages)
    for stage in range(num_stages):
        msg_bytes[4 * stage] = costs[stage].output_bytes
        msg_bytes[4 * stage + 1] = msg_bytes[4 * stage + 3] = costs[stage - 1].output_bytes if stage > 0 else 0
    by_code = [code * num_mb for code in range(4 * num_stages)]
    return _message_peaks(
        ops.keys, run.start, run.end, run.arrive, ops.present, num_mb=num_mb, act=[ops.act[k] for k in by_code],
        burst=[ops.burst[k] for k in by_code], dest=[ops.dest[k] for k in by_code], msg_bytes=msg_bytes,
        first_start=first_start, last_end=last_end)


def _stage_of_layer(plan: Plan, layer: int) -> int:
    return next(s for s, stage in enumerate(plan.stages) if stage.start <= layer < stage.end)


def _reduced_bytes(rank: int, order: list[int], costs: Sequence[StageCost], rank_of_stage: Sequence[int],
                   tied: Sequence[TiedParameter], tied_stages: list[list[int]]) -> dict[int, int]:
    """The bytes each stage of ``rank`` all-reduces over dp, its all-reduces in ``order``: its
    parameters, a tied tensor the rank holds for several members once, with the stage whose
    all-reduce comes last (after every backward that adds to it), as octorun assigns it."""
    reduced = {stage: costs[stage].param_bytes for stage in order}
    for group, stages in zip(tied, tied_stages):
        here = [stage for stage in stages if rank_of_stage[stage] == rank]
        if len(here) < 2:
            continue
        for stage in here:
            reduced[stage] -= group.bytes
        owner = max(here, key=order.index)
        reduced[owner] += group.bytes
    return reduced


def _tied_allreduces(plan: Plan, free: Sequence[float], allreduces: Sequence[AllReduce], tied: Sequence[TiedParameter],
                     tied_stages: list[list[int]], rank_of_stage: Sequence[int], *, has_ops: Sequence[bool]) -> list[TiedAllReduce]:
    """The tied tensors' gradient sums, as octorun runs them after a step's ops: each rank, once
    its ops and its data-parallel all-reduces are done, joins the groups it holds a member of,
    one after the other in the profile's order, each a blocking all-reduce among the pipeline
    ranks holding a member (none where one rank holds them all). A group's sum starts when the
    last of its ranks joins."""
    ready = [free[r] if has_ops[r] else 0.0 for r in range(len(free))]
    for ar in allreduces:
        ready[ar.rank] = max(ready[ar.rank], ar.end_ms)
    out = []
    for index, (group, stages) in enumerate(zip(tied, tied_stages)):
        ranks = tuple(sorted({rank_of_stage[stage] for stage in stages}))
        if len(ranks) < 2:
            continue
        begin = max(ready[r] for r in ranks)
        finish = begin + tied_allreduce_ms(plan.cluster, plan.parallel, ranks, group.bytes)
        for r in ranks:
            ready[r] = finish
        out.append(TiedAllReduce(index, ranks, begin, finish))
    return out


def _message_peaks(keys, start, end, arrive, present, *, num_mb: int, act, burst, dest, msg_bytes,
                   first_start: float, last_end: float) -> tuple[list[int], list[int]]:
    """Per rank, the most bytes its tapes and its transport hold together, and the most its
    transport holds alone, as octorun's transport keeps messages (octorun/comm.py):
    - a receiver thread per incoming channel posts the buffer of the channel's next message
      as soon as the one before it has landed (the first of a step's: while the step before
      ends, so from the iteration's start; and after the last has landed, the next step's
      first), and the buffer stays until the op that uses it starts (an F's input then becomes
      its tape's, an I's gradient is among what it keeps for its W), or for a B's gradient
      until the B ends;
    - a sender lets go of a message's tensors once the send is done, when it turns to its
      second op after the one that produced them (so at the end of the op between), or at the
      step's end.
    Tapes change as in the main loop: during an op by the larger of its burst and its growth,
    after it by its delta. Events at one instant apply together (a freed input and a new F's
    activations are one storage handed over).

    Vectorized (numpy): a plan has a few events per op, and this pass must not cost the tuner
    more than a fraction of the simulation itself."""
    num_ranks = len(keys)
    flat = list(itertools.chain.from_iterable(keys))
    total = len(flat)
    if total == 0:
        return [0] * num_ranks, [0] * num_ranks
    lengths = np.fromiter((len(seq) for seq in keys), dtype=np.int64, count=num_ranks)
    key = np.array(flat, dtype=np.int64)
    code = key // num_mb  # stage * 4 + kind (act, burst, dest and msg_bytes are per code)
    rank = np.repeat(np.arange(num_ranks, dtype=np.int64), lengths)
    start_all = np.frombuffer(start, dtype=np.float64)
    st = start_all[key]
    end_all = np.frombuffer(end, dtype=np.float64)
    en = end_all[key]
    grow = np.array(act, dtype=np.int64)[code]
    up = np.maximum(np.maximum(np.array(burst, dtype=np.int64)[code], grow), 0)
    dst_of = np.array(dest, dtype=np.int64)[code]
    times = [st, en]
    ranks = [rank, rank]
    tape = [up, grow - up]
    msgs = [np.zeros(total, dtype=np.int64), np.zeros(total, dtype=np.int64)]

    def add(t, r, delta) -> None:
        times.append(t)
        ranks.append(r)
        tape.append(np.zeros(len(delta), dtype=np.int64))
        msgs.append(delta)

    # sends: held from the producer's end to the end of the rank's next op (or its own end, the
    # step's last), and at least until the transfer lands
    sent = np.nonzero(dst_of >= 0)[0]
    if len(sent):
        produced = key[sent]
        size = np.array(msg_bytes, dtype=np.int64)[code[sent]]
        landed = np.frombuffer(arrive, dtype=np.float64)[produced]
        is_last = np.zeros(total, dtype=bool)
        is_last[(np.cumsum(lengths) - 1)[lengths > 0]] = True
        following = np.where(is_last[sent], sent, sent + 1)
        add(en[sent], rank[sent], size)
        add(np.maximum(en[following], landed), rank[sent], -size)
        # receives: each message's buffer until the op that reads it takes it over. An F's
        # output is the next stage's F's input, its tape's from the F's start. A gradient is
        # the previous stage's I's or B's: an I keeps what its W needs of it (for a layer that
        # ends in a matrix product, the gradient itself) among the bytes it holds for W, from
        # its start; a B reads it until it ends and keeps nothing
        kind = code[sent] % 4
        forward = kind == 0
        below = produced - 4 * num_mb + num_mb * (1 - kind)  # the I of the stage before
        as_i = np.frombuffer(present, dtype=np.uint8)[np.where(forward, 0, below)] == 1
        reader = np.where(forward, produced + 4 * num_mb, np.where(as_i, below, below + 2 * num_mb))
        by_b = ~forward & ~as_i
        used = np.where(by_b, end_all[reader], start_all[reader])
        # channels (src, dst) carry their messages in the order the sender runs them
        dst = dst_of[sent]
        channel = rank[sent] * num_ranks + dst
        order = np.argsort(channel, kind="stable")
        channel, size, dst, landed, used = channel[order], size[order], dst[order], landed[order], used[order]
        first_of_channel = np.ones(len(channel), dtype=bool)
        first_of_channel[1:] = channel[1:] != channel[:-1]
        posted = np.empty(len(channel))
        posted[1:] = landed[:-1]
        posted[first_of_channel] = first_start
        add(posted, dst, size)
        add(used, dst, -size)
        # after a channel's last message lands, the buffer of the next step's first
        last_of_channel = np.ones(len(channel), dtype=bool)
        last_of_channel[:-1] = first_of_channel[1:]
        add(landed[last_of_channel], dst[last_of_channel], size[first_of_channel])
        add(np.full(int(last_of_channel.sum()), last_end), dst[last_of_channel], -size[first_of_channel])

    t = np.concatenate(times)
    r = np.concatenate(ranks)
    # by rank, then time: a sort by time, then a stable one by rank (a radix sort on narrow ints)
    order = np.argsort(t)
    narrow = np.int16 if num_ranks < 1 << 15 else np.int32
    order = order[np.argsort(r[order].astype(narrow), kind="stable")]
    t, r = t[order], r[order]
    # the level after every event of one (rank, instant): each group's last entry
    group_end = np.ones(len(t), dtype=bool)
    group_end[:-1] = (r[1:] != r[:-1]) | (t[1:] != t[:-1])
    bounds = np.searchsorted(r, np.arange(num_ranks + 1))
    has = bounds[1:] > bounds[:-1]
    peaks = []
    message_deltas = np.concatenate(msgs)[order]
    for deltas in (np.concatenate(tape)[order] + message_deltas, message_deltas):
        level = np.cumsum(deltas)
        # each rank's levels from zero: less what the ranks before it left
        level -= np.repeat(np.concatenate(([0], level))[bounds[:-1]], np.diff(bounds))
        masked = np.where(group_end, level, 0)
        best = np.zeros(num_ranks, dtype=np.int64)
        best[has] = np.maximum.reduceat(masked, bounds[:-1][has])
        peaks.append(np.maximum(best, 0).tolist())
    return peaks[0], peaks[1]


def _waits(keys, ptr, cross, local, done, num_mb, rank_of_stage) -> list[tuple[int, Op, Op, int]]:
    def decode(key: int) -> Op:
        code, mb = divmod(key, num_mb)
        stage, kind = divmod(code, 4)
        return Op(stage, _KINDS[kind], mb)

    waits = []
    for r, seq in enumerate(keys):
        if ptr[r] >= len(seq):
            continue
        key = seq[ptr[r]]
        need = cross[key] if cross[key] >= 0 and not done[cross[key]] else local[key]
        need_op = decode(need)
        waits.append((r, decode(key), need_op, rank_of_stage[need_op.stage]))
    return waits
