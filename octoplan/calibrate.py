"""What a transfer and the runtime around each op really cost, read from a measured octorun
trace: the cluster figures (``latency_us``, ``op_overhead_us``) to plan with on that machine.

The planner predicts with the cluster's latency per transfer and its fixed cost per op (FORMATS.md
sections 3 and 7). Their true values depend on the machine and on how many processes share it
(CPU stand-ins for GPUs), so they are best measured in a job of the same processes as the runs
the plans are for. One step of any plan's trace holds what is needed:

- per op, its measured duration less the profile's (``excess``: work around the op's compute;
  the profile's times are what ``octorun --replay`` sleeps at its default scale of 1);
- when an op's input message was due before the rank finished its previous op, the gap
  between the two ops is the runtime's own time (``gap``: recording the op, posting its sends,
  taking the next op's input);
- when the op waited for its message, the time from the producing op's end on the other rank to
  its start is the ``wait``: the producer's gap (it posts the send after the op's end), the
  transfer itself (the trace's messages: with ``--replay`` a thousandth of the profile's bytes,
  so next to nothing on the wire) and the hand-over to the consumer. Both directions of each
  rank pair are averaged, so that an offset between the two ranks' clocks cancels (octorun puts
  the ranks of one host on one clock; across hosts the barrier exit is the common origin).

The simulator charges the per-op cost inside each op and starts a transfer at the op's end, so
the figures to plan with are: per op, the mean gap plus the median excess; per transfer, the
median over rank pairs of the two-way wait, less the mean gap (already charged to the
producing op).
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from octoplan.costs import LayerTable, op_ms, plan_stage_costs
from octoplan.errors import InputError
from octoplan.ops import Kind, Op
from octoplan.plan import CLUSTER_RANGES, Plan
from octoplan.profile import Profile
from octoplan.timeline.trace import check_order, check_replay_at_scale_1, measured_steps

__all__ = ["OpSplit", "TraceSplit", "Calibration", "split_trace", "calibrate", "calibration_of"]


@dataclass(frozen=True)
class OpSplit:
    """One measured op: where its time went."""

    thread: str  # the process (pid/tid) that ran it: one rank of one pipeline
    op: Op
    excess_ms: float  # measured duration - the profile's
    layers: int  # how many layers its stage holds
    gap_ms: float | None  # runtime time before it, when nothing held it up
    transfer_ms: float | None  # producer's end -> its start, when it waited for the message
    producer_thread: str | None  # where that message came from


@dataclass(frozen=True)
class TraceSplit:
    ops: list[OpSplit]
    iteration_ms: float  # first op start to last op end
    wait_ms: float | None  # producer's end -> consumer's start when it waited: median, both ways where it can
    offsets_ms: dict[str, float]  # per thread pair with waits both ways, "a-b": half the difference of the two

    @property
    def pairs(self) -> int:
        """Thread pairs with waits both ways."""
        return len(self.offsets_ms)

    @property
    def gap_ms_by_thread(self) -> dict[str, float]:
        """The gaps summed per thread."""
        out: dict[str, float] = defaultdict(float)
        for o in self.ops:
            if o.gap_ms is not None:
                out[o.thread] += o.gap_ms
        return dict(out)

    @property
    def gaps(self) -> list[float]:
        return [o.gap_ms for o in self.ops if o.gap_ms is not None]

    @property
    def transfers(self) -> list[float]:
        return [o.transfer_ms for o in self.ops if o.transfer_ms is not None]


def _producer(plan: Plan, op: Op, present: set[Op]) -> Op | None:
    """The op on another rank whose message ``op`` waits for, or None (first stage's forward,
    last stage's backward, or a neighbour on the same rank, which hands over directly)."""
    if op.kind is Kind.F and op.stage > 0:
        src = Op(op.stage - 1, Kind.F, op.mb)
    elif op.kind in (Kind.I, Kind.B) and op.stage < plan.num_stages - 1:
        src = Op(op.stage + 1, Kind.I, op.mb)
        if src not in present:
            src = Op(op.stage + 1, Kind.B, op.mb)
    else:
        return None
    return src if plan.stages[src.stage].rank != plan.stages[op.stage].rank else None


def _two_way_wait(waits: dict[tuple[str, str], list[float]]) -> tuple[float | None, dict[str, float]]:
    """Per pair of threads with waits both ways, the mean of the two directions' median waits
    is free of their clock offset; the wait is the median of those means (of all waits when no
    pair has both directions). Also each pair's offset, half the difference."""
    means, offsets = [], {}
    for (a, b), there in sorted(waits.items()):
        if a < b and (b, a) in waits:
            t, back = statistics.median(there), statistics.median(waits[(b, a)])
            means.append((t + back) / 2)
            offsets[f"{a}-{b}"] = (t - back) / 2
    if means:
        return max(0.0, statistics.median(means)), offsets
    every = [x for xs in waits.values() for x in xs]
    return (max(0.0, statistics.median(every)) if every else None), offsets


def _check_matches(plan: Plan, events: list, file: str) -> None:
    scheduled = {op for rank_ops in plan.schedule for op in rank_ops}
    seen = set()
    for e in events:
        fix = "calibrate with the plan the trace was measured with"
        if e.op not in scheduled:
            raise InputError(file, "traceEvents", f"op {e.op} is not in the plan's schedule", fix)
        rank = plan.stages[e.op.stage].rank
        if e.lane != repr(rank):
            raise InputError(file, "traceEvents", f"op {e.op} ran on tid {e.lane}, but the plan puts stage "
                             f"{e.op.stage} on pipeline rank {rank}", fix)
        if (e.thread, e.op) in seen:
            raise InputError(file, "traceEvents", f"op {e.op} appears twice in one step on {e.thread}",
                             'give each step its own "args": {"step": N}, or one step per trace')
        seen.add((e.thread, e.op))
    by_thread: dict[str, list] = {}
    for e in events:
        by_thread.setdefault(e.thread, []).append(e)
    for thread, ops in by_thread.items():
        ops.sort(key=lambda e: e.start_ms)
        for before, after in zip(ops, ops[1:]):
            # a microsecond of slack for the trace format's rounding
            if after.start_ms < before.start_ms + before.dur_ms - 1e-3:
                raise InputError(file, "traceEvents", f"op {after.op} starts before op {before.op} ends on {thread}, "
                                 "but one rank runs one op at a time", "give the trace of a real run (octorun --trace)")
    replicas = {e.process for e in events}
    if len(replicas) > plan.parallel.dp:  # (fewer may be a simulated trace, whose ops share one process)
        raise InputError(file, "traceEvents", f"holds the ops of {len(replicas)} data-parallel replicas (processes), "
                         f"but the plan has dp {plan.parallel.dp}", "calibrate with the plan the trace was measured with")
    if len({e.lane for e in events}) < 2:
        raise InputError(file, "traceEvents", "holds the ops of one pipeline rank only",
                         "calibrate from a trace of every rank (octorun --trace writes them all)")
    missing = scheduled - {e.op for e in events}
    if missing:  # e.g. the trace of a smaller plan, whose ops are all among this plan's
        example = min(missing, key=lambda op: (op.stage, op.mb, op.kind.value))
        raise InputError(file, "traceEvents", f"holds {len(scheduled) - len(missing)} of the plan's {len(scheduled)} ops "
                         f"(op {example} is missing)", "calibrate with the plan the trace was measured with")


def split_trace(plan: Plan, profile: Profile, trace_path: str | Path) -> TraceSplit:
    """Split the last measured step of ``trace_path`` (octorun ``--trace``) op by op.

    An op waited for its message when the producer ended after the rank's previous op did (or
    the op is the rank's first): that wait is a transfer. An op whose message was due (producer's
    end + the wait those transfers show) by the end of the previous op, or that needs none,
    follows a gap of pure runtime time. An op in between is neither: its message may still have
    been on its way. A trace that does not match the plan (an op on another rank than the plan
    puts its stage, an op the schedule does not have, an op twice in one step, one rank's ops
    only) is an :class:`InputError`."""
    stepped = measured_steps(Path(trace_path), plan)
    # one step: the last
    last = max(step for step, _ in stepped)
    events = [e for step, e in stepped if step == last]
    _check_matches(plan, events, str(trace_path))
    check_order(plan, stepped, str(trace_path))

    costs = plan_stage_costs(plan, LayerTable(profile))
    # the producer runs in the same pipeline replica: the trace's process id (octorun: dp rank)
    by_key = {(e.process, e.op): e for e in events}
    present = {e.op for e in events}
    per_thread: dict[str, list] = defaultdict(list)
    for e in events:
        per_thread[e.thread].append(e)
    # (event, previous op's end on its thread, producer event, its end: when the message was
    # sent, the wait for it when the op waited)
    rows = []
    waits: dict[tuple[str, str], list[float]] = defaultdict(list)
    for thread, thread_events in sorted(per_thread.items()):
        prev_end = None
        for e in thread_events:  # already in start order
            producer_op = _producer(plan, e.op, present)
            producer = by_key.get((e.process, producer_op)) if producer_op is not None else None
            ready = producer.start_ms + producer.dur_ms if producer is not None else None
            transfer = None
            if ready is not None and (prev_end is None or ready > prev_end):
                transfer = e.start_ms - ready
                waits[(producer.thread, thread)].append(transfer)
            rows.append((e, prev_end, producer, ready, transfer))
            prev_end = e.start_ms + e.dur_ms
    wait, offsets = _two_way_wait(waits)

    ops = []
    for e, prev_end, producer, ready, transfer in rows:
        gap = None
        if transfer is None and prev_end is not None and (ready is None or ready + (wait or 0.0) <= prev_end):
            gap = e.start_ms - prev_end
        stage = plan.stages[e.op.stage]
        ops.append(OpSplit(e.thread, e.op, e.dur_ms - op_ms(costs[e.op.stage], e.op.kind), stage.end - stage.start,
                           gap, transfer, producer.thread if transfer is not None else None))
    iteration = max(e.start_ms + e.dur_ms for e in events) - min(e.start_ms for e in events)
    return TraceSplit(ops, iteration, wait, offsets)


@dataclass(frozen=True)
class Calibration:
    """The cluster figures one measured step implies (all in ms)."""

    latency_ms: float | None  # None: no op waited for a message both ways (or at all)
    gap_ms: float  # mean runtime gap between two ops of a rank
    excess_ms: float  # median measured - profiled op duration
    counts: dict[str, int]  # ops, gaps and transfers the figures come from

    @property
    def op_overhead_ms(self) -> float:
        return max(0.0, self.gap_ms + self.excess_ms)

    def flags(self) -> str:
        """The cluster options of FORMATS.md section 5 that plan for what was measured."""
        out = [f"--op-overhead-us {1000 * self.op_overhead_ms:.0f}"]
        if self.latency_ms is not None:
            out.insert(0, f"--latency-us {1000 * self.latency_ms:.0f}")
        return " ".join(out)


def calibrate(plan: Plan, profile: Profile, trace_path: str | Path, *, plan_path: str | Path | None = None) -> Calibration:
    """The cluster figures the last measured step of ``trace_path`` implies (:func:`calibration_of`).
    ``plan_path``: where ``plan`` was read, named when the plan itself cannot be calibrated from."""
    if plan.parallel.pp < 2:  # the plan's fault, whatever its trace holds
        raise InputError(None if plan_path is None else str(plan_path), "parallel.pp",
                         f"is {plan.parallel.pp}: nothing is sent between ranks",
                         "calibrate from the trace of a plan with 2 or more pipeline ranks")
    # every op's excess over the profile's time would be scale - 1 of it
    check_replay_at_scale_1(Path(trace_path), "calibrate from")
    return within_cluster_ranges(calibration_of(split_trace(plan, profile, trace_path)), trace_path)


def within_cluster_ranges(found: Calibration, trace_path: str | Path) -> Calibration:
    """``found``, unless a figure is one no cluster option accepts: then the trace's times are
    not those of a run (:class:`InputError`)."""
    for name, ms in (("latency_us", found.latency_ms), ("op_overhead_us", found.op_overhead_ms)):
        high = CLUSTER_RANGES[name][1]
        if ms is not None and not 1000 * ms <= high:
            raise InputError(str(trace_path), "traceEvents", f"imply {name} {1000 * ms:.3g}, beyond the {high:g} any plan "
                             "accepts", "pass the trace octorun --trace wrote for this plan")
    return found


def calibration_of(split: TraceSplit) -> Calibration:
    gaps = split.gaps
    gap = statistics.fmean(gaps) if gaps else 0.0
    return Calibration(
        # the producer's gap is in the wait, and the simulator charges it to the producing op
        latency_ms=None if split.wait_ms is None else max(0.0, split.wait_ms - gap),
        gap_ms=gap,
        excess_ms=statistics.median(o.excess_ms for o in split.ops),
        counts={"ops": len(split.ops), "gaps": len(gaps), "transfers": len(split.transfers), "pairs": split.pairs},
    )
