"""Chrome trace-event JSON (Perfetto, chrome://tracing) and the check of a measured trace.

Written format — ``octorun --trace`` writes its measured op events the same way, so that a
prediction and a measurement open side by side and compare op by op:

- pid 0 "compute": one complete event (``"ph": "X"``) per op; name is the op string
  (``0F3``), cat its kind (``F``/``I``/``W``/``B``), tid the pipeline rank, ts and dur in
  microseconds, args ``{stage, mb}``.
- pid 1 "transfers": ``send 0F3 -> r1`` events. The tid is one per directed rank pair
  (``src * pp + dst``, named ``r0 -> r1``): the simulator lets a rank send forward and backward
  at once, and trace viewers need the events of one thread to nest, so each link is a thread;
  sorting by tid still groups a source rank's links together.
- pid 2 "dp all-reduce": ``allreduce s3`` events, tid the pipeline rank.

Time 0 is the first op's start. ``compare_measured`` reads any trace whose complete events are
named like ops; events repeated over several steps are matched to the plan's ops step by step.
"""

from __future__ import annotations

import json
import logging
import math
from collections import defaultdict
from pathlib import Path
from typing import Any, NamedTuple

from rich.table import Table

from octoplan.errors import InputError
from octoplan.inputs import parse_json, read_input_text
from octoplan.ops import Kind, Op, parse_op
from octoplan.outputs import write_text
from octoplan.plan import Plan, Stage
from octoplan.simulator import SimResult
from octoplan.timeline._layout import KIND_ORDER, describe_plan, spans_by_rank, time_origin

__all__ = ["trace_events", "write_trace", "compare_measured", "render_comparison", "measured_ops", "measured_steps", "MeasuredOp", "check_order"]

log = logging.getLogger(__name__)

COMPUTE_PID, TRANSFER_PID, ALLREDUCE_PID = 0, 1, 2
_US_PER_MS = 1000.0


def _meta(name: str, pid: int, tid: int, value: Any) -> dict[str, Any]:
    """A metadata event: ``process_name``/``thread_name`` take a name, ``*_sort_index`` a number.
    Process-level ones carry tid 0, as Chrome's own traces do."""
    key = "sort_index" if name.endswith("sort_index") else "name"
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": {key: value}}


def _recompute_args(stage: Stage) -> dict[str, Any]:
    """A recomputing stage's ops say so in their args, and how many of its layers run again."""
    if not stage.recompute:
        return {}
    return {"recompute": True, **({} if stage.recompute_layers is None else {"recompute_layers": stage.recompute_layers})}


def trace_events(plan: Plan, result: SimResult) -> list[dict[str, Any]]:
    """Every trace event of the simulated iteration: metadata first, then ops, sends, all-reduces."""
    pp = result.num_ranks
    rank_spans = spans_by_rank(result)
    t0 = time_origin(rank_spans)

    def us(ms: float) -> float:
        return (ms - t0) * _US_PER_MS

    events: list[dict[str, Any]] = [
        _meta("process_name", COMPUTE_PID, 0, "compute"),
        _meta("process_sort_index", COMPUTE_PID, 0, COMPUTE_PID),
    ]
    for rank in range(pp):
        events.append(_meta("thread_name", COMPUTE_PID, rank, f"rank {rank}"))
        events.append(_meta("thread_sort_index", COMPUTE_PID, rank, rank))
    for span in (span for spans in rank_spans for span in spans):
        op = span.op
        events.append({
            "name": str(op), "cat": op.kind.value, "ph": "X", "pid": COMPUTE_PID, "tid": span.rank,
            "ts": us(span.start_ms), "dur": (span.end_ms - span.start_ms) * _US_PER_MS,
            # a recomputing stage's I and B include its forward run again
            "args": {"stage": op.stage, "mb": op.mb, **_recompute_args(plan.stages[op.stage])},
        })

    transfers = result.transfers
    if transfers:
        events.append(_meta("process_name", TRANSFER_PID, 0, "transfers"))
        events.append(_meta("process_sort_index", TRANSFER_PID, 0, TRANSFER_PID))
        for src, dst in sorted({(t.src_rank, t.dst_rank) for t in transfers}):
            tid = src * pp + dst
            events.append(_meta("thread_name", TRANSFER_PID, tid, f"r{src} -> r{dst}"))
            events.append(_meta("thread_sort_index", TRANSFER_PID, tid, tid))
        for t in transfers:
            events.append({
                "name": f"send {t.op} -> r{t.dst_rank}", "cat": "send", "ph": "X", "pid": TRANSFER_PID,
                "tid": t.src_rank * pp + t.dst_rank, "ts": us(t.start_ms), "dur": (t.end_ms - t.start_ms) * _US_PER_MS,
                "args": {"op": str(t.op), "src": t.src_rank, "dst": t.dst_rank},
            })

    if result.allreduces:
        events.append(_meta("process_name", ALLREDUCE_PID, 0, "dp all-reduce"))
        events.append(_meta("process_sort_index", ALLREDUCE_PID, 0, ALLREDUCE_PID))
        for rank in sorted({ar.rank for ar in result.allreduces}):
            events.append(_meta("thread_name", ALLREDUCE_PID, rank, f"rank {rank}"))
        for ar in result.allreduces:
            events.append({
                "name": f"allreduce s{ar.stage}", "cat": "allreduce", "ph": "X", "pid": ALLREDUCE_PID,
                "tid": ar.rank, "ts": us(ar.start_ms), "dur": (ar.end_ms - ar.start_ms) * _US_PER_MS,
                "args": {"stage": ar.stage},
            })
    return events


def write_trace(plan: Plan, result: SimResult, path: str | Path) -> None:
    """Write the simulated iteration as Chrome trace-event JSON (see the module docstring)."""
    doc = {
        "traceEvents": trace_events(plan, result),
        "displayTimeUnit": "ms",
        "otherData": {
            "source": "octoplan simulate",
            "plan": describe_plan(plan),
            "iteration_ms": result.iteration_ms,
            "bubble_ratio": result.bubble_ratio,
        },
    }
    write_text(path, json.dumps(doc, separators=(",", ":")) + "\n")
    log.info("wrote trace %s (%d events)", path, len(doc["traceEvents"]))


# ---------------------------------------------------------------------------- measured traces


def replay_time_scale(path: Path) -> float | None:
    """The ``--replay`` scale an octorun trace says its ops slept at (``otherData``); None for a
    run of real work, or a trace that does not say."""
    doc = _read_document(path)
    other = doc.get("otherData") if isinstance(doc, dict) else None
    scale = other.get("replay_time_scale") if isinstance(other, dict) else None
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        return None
    try:
        return float(scale)
    except OverflowError:  # an integer of hundreds of digits
        raise InputError(str(path), "otherData.replay_time_scale", "is too large to be a scale",
                         "pass the trace octorun --trace wrote") from None


def check_replay_at_scale_1(path: Path, what: str) -> None:
    """:class:`InputError` for the trace of a ``--replay`` at another scale than 1: each of its
    ops slept that many times its profile's time, so no op's time is the plan's. ``what``: the
    verb of the fix (``compare``, ``calibrate from``)."""
    scale = replay_time_scale(path)
    if scale is not None and scale != 1.0:
        raise InputError(str(path), "otherData.replay_time_scale",
                         f"is {scale:g}: its ops slept {scale:g} x the profile's times",
                         f"{what} a trace of octorun --replay at its default scale of 1, or of a run of real work")


def _read_document(path: Path) -> Any:
    file = str(path)
    if not path.exists():
        raise InputError(file, 0, "no such file", "pass the trace octorun --trace wrote")
    raw = read_input_text(path, field=0, fix="pass a Chrome trace-event JSON file")
    return parse_json(raw, file=file, field=0, fix="pass a Chrome trace-event JSON file")


def _read_events(path: Path, doc: Any = None) -> list[Any]:
    file = str(path)
    doc = _read_document(path) if doc is None else doc
    # The trace-event format allows a bare event array as well as {"traceEvents": [...]}.
    if isinstance(doc, dict):
        if "traceEvents" not in doc:
            raise InputError(file, "traceEvents", "is missing", 'write {"traceEvents": [...]}')
        events = doc["traceEvents"]
    else:
        events = doc
    if not isinstance(events, list):
        raise InputError(file, "traceEvents", "must be a list of events", 'write {"traceEvents": [...]}')
    return events


class MeasuredOp(NamedTuple):
    thread: str  # pid and tid: one process's rank
    process: str  # pid alone (octorun: the data-parallel replica)
    lane: str  # tid alone (octorun: the pipeline rank)
    step: int | None  # args.step when the writer gave it
    op: Op
    start_ms: float
    dur_ms: float


# The largest time or duration (microseconds) a measured op may have: 11.6 days, far beyond a
# step, far below where sums of such times lose all precision.
_MAX_TRACE_US = 1e12


def measured_ops(path: Path, plan: Plan) -> list[MeasuredOp]:
    """Every op event of a measured trace, in file order; anything else is skipped."""
    file = str(path)
    stage_count, num_mb = plan.num_stages, plan.microbatches
    doc = _read_document(path)
    other = doc.get("otherData") if isinstance(doc, dict) else None
    other = other if isinstance(other, dict) else {}
    # octorun names the model it ran, and writes one step: an op twice on a rank is no run's
    model = other.get("model")
    if other.get("source") == "octorun" and model is not None and model != plan.model.name:
        raise InputError(file, "otherData.model", f"is {model!r:.80}, and the plan's model is {plan.model.name!r:.80}",
                         "pass a trace of a run of this plan")
    one_step = 0 if other.get("source") == "octorun" else None
    out = []
    for index, event in enumerate(_read_events(path, doc)):
        if not isinstance(event, dict) or event.get("ph") != "X":
            continue
        name = event.get("name")
        if not isinstance(name, str):
            continue
        try:
            op = parse_op(name)
        except ValueError:
            continue  # sends, all-reduces, anything that is not an op
        where = f"traceEvents[{index}]"
        values = []
        for key in ("ts", "dur"):
            value = event.get(key)
            # (an int is finite however long: isfinite would convert it to a float, and overflow)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                    isinstance(value, float) and not math.isfinite(value)):
                raise InputError(file, f"{where}.{key}", f"of op {name} is {value!r}", "give a number of microseconds")
            if abs(value) > _MAX_TRACE_US:  # no run's clock reads that: the file is not a trace of one
                shown = f"{value:g}" if isinstance(value, float) or value.bit_length() < 1000 else f"a {len(str(value))}-digit number of"
                raise InputError(file, f"{where}.{key}", f"of op {name} is {shown} us, more than {_MAX_TRACE_US:g} "
                                 "(11.6 days)", "pass the trace octorun --trace wrote")
            values.append(float(value))
        ts, dur = values
        if dur < 0:
            raise InputError(file, f"{where}.dur", f"of op {name} is negative ({dur})", "give a duration >= 0")
        if op.stage >= stage_count or op.mb >= num_mb:
            raise InputError(
                file, f"{where}.name", f"op {name} is not in the plan ({stage_count} stages, {num_mb} microbatches)",
                "compare the trace with the plan it was measured with",
            )
        args = event.get("args")
        step = args.get("step") if isinstance(args, dict) else None
        process, lane = repr(event.get("pid", 0)), repr(event.get("tid", 0))
        out.append(MeasuredOp(f"{process}/{lane}", process, lane,
                              step if isinstance(step, int) and not isinstance(step, bool) else one_step,
                             op, ts / _US_PER_MS, dur / _US_PER_MS))
    if not out:
        raise InputError(file, "traceEvents", "holds no op events", 'expect "ph": "X" events named like 0F3 (octorun --trace)')
    return out


def measured_steps(path: Path, plan: Plan) -> list[tuple[int, MeasuredOp]]:
    """Every op event of a measured trace with its step, in the order the ops started: the
    event's ``args.step`` when it has one, else the n-th event of an op on one thread is that
    op in step n."""
    occurrences: dict[tuple[str, Op], int] = defaultdict(int)
    stepped = []
    for event in sorted(measured_ops(path, plan), key=lambda e: e.start_ms):
        step = event.step
        if step is None:
            step = occurrences[(event.thread, event.op)]
            occurrences[(event.thread, event.op)] += 1
        stepped.append((step, event))
    return stepped


def check_order(plan: Plan, stepped: list[tuple[int, MeasuredOp]], file: str) -> None:
    """Each op must run on its stage's pipeline rank (the event's tid, as octorun writes it), and
    each step's ops on each thread, in the order they started, must come in the order the plan's
    schedule gives their rank (a trace may miss ops, never reorder or repeat them): the trace of
    another plan with the same ops in another order or placement is refused, not compared."""
    position = {op: (rank, index) for rank, ops in enumerate(plan.schedule) for index, op in enumerate(ops)}
    last: dict[tuple[str, int], tuple[MeasuredOp, int]] = {}
    fix = "compare the trace with the plan it was measured with"
    for step, event in sorted(stepped, key=lambda item: item[1].start_ms):
        if event.op not in position:
            raise InputError(file, "traceEvents", f"op {event.op} is not in the plan's schedule", fix)
        rank, index = position[event.op]
        if event.lane != repr(rank):  # octorun writes the pipeline rank as the thread (tid)
            raise InputError(file, "traceEvents", f"op {event.op} ran on tid {event.lane}, but the plan puts stage "
                             f"{event.op.stage} on pipeline rank {rank}", fix)
        before = last.get((event.thread, step))
        if before is not None and index <= before[1]:
            problem = (f"op {event.op} appears twice in step {step} on {event.thread}" if index == before[1] else
                       f"op {event.op} ran after op {before[0].op} on {event.thread} in step {step}, "
                       f"but the plan's rank {rank} runs {event.op} before {before[0].op}")
            raise InputError(file, "traceEvents", problem, fix)
        last[(event.thread, step)] = (event, index)


def _row(kind: str, predicted: list[float], measured: list[float]) -> dict[str, Any]:
    n = len(predicted)
    mean_p = sum(predicted) / n
    mean_m = sum(measured) / n
    abs_err = sum(abs(m - p) for p, m in zip(predicted, measured)) / n
    return {
        "kind": kind,
        "count": n,
        "predicted_ms": mean_p,
        "measured_ms": mean_m,
        "abs_error_ms": abs_err,
        # Relative figures mean nothing against a prediction of 0 ms.
        "rel_error": abs_err / mean_p if mean_p > 0 else None,
        "bias": mean_m / mean_p - 1.0 if mean_p > 0 else None,
    }


def _predicted_op_span(result: SimResult) -> float:
    """First op start to last op end: ``iteration_ms`` less any all-reduce that outlasts the ops,
    so that it compares with the span of measured op events."""
    spans = result.spans()
    if not spans:
        return 0.0
    return max(s.end_ms for s in spans) - min(s.start_ms for s in spans)


def compare_measured(plan: Plan, result: SimResult, trace_path: str | Path) -> list[dict[str, Any]]:
    """Predicted against measured op durations, per op kind and for the whole iteration.

    Each row: ``kind`` (``F``, ``I``, ``W``, ``B`` or ``iteration``), ``count`` (measured op
    events matched; for ``iteration`` the number of measured steps; its prediction is the span
    of the simulated ops, which is ``iteration_ms`` unless a dp all-reduce outlasts the last
    op), ``predicted_ms`` and
    ``measured_ms`` (means), ``abs_error_ms`` (mean of |measured - predicted| per event),
    ``rel_error`` (abs_error_ms / predicted_ms) and ``bias`` (measured_ms / predicted_ms - 1;
    positive: the simulator is optimistic), both ``None`` where the prediction is 0 ms. Kinds
    the trace lacks get no row.

    Steps: an event's ``args.step`` when it has one, else the n-th event of an op on one
    thread (pid, tid) is that op in step n, so a trace of several steps compares every step. A
    step's measured iteration is the span of its op events over all threads, which assumes the
    writer stamped every process from one clock. Ops of the plan missing from the trace are
    logged and left out, and so is the iteration row then. A trace of ``octorun --replay`` at a
    scale other than 1 is refused (:class:`InputError`).
    """
    path = Path(trace_path)
    check_replay_at_scale_1(path, "compare")
    predicted = {span.op: span.end_ms - span.start_ms for span in result.spans()}
    per_kind: dict[Kind, tuple[list[float], list[float]]] = {kind: ([], []) for kind in KIND_ORDER}
    step_bounds: dict[int, list[float]] = {}
    seen_ops: set[Op] = set()
    stepped = measured_steps(path, plan)
    check_order(plan, stepped, str(path))
    for step, event in stepped:
        op = event.op
        seen_ops.add(op)
        p_list, m_list = per_kind[op.kind]
        p_list.append(predicted[op])
        m_list.append(event.dur_ms)
        end_ms = event.start_ms + event.dur_ms
        bounds = step_bounds.setdefault(step, [event.start_ms, end_ms])
        bounds[0] = min(bounds[0], event.start_ms)
        bounds[1] = max(bounds[1], end_ms)
    rows = [_row(kind.value, p, m) for kind, (p, m) in per_kind.items() if p]
    missing = len(predicted) - len(seen_ops)
    if missing:  # the measured span is of the ops present, the predicted one of them all
        log.warning("%s: %d of the plan's %d ops are not in the trace; compared the rest, without the iteration",
                    path, missing, len(predicted))
        return rows
    spans = [end - start for start, end in (step_bounds[step] for step in sorted(step_bounds))]
    rows.append(_row("iteration", [_predicted_op_span(result)] * len(spans), spans))
    return rows


def render_comparison(rows: list[dict[str, Any]], *, title: str | None = None) -> Table:
    """The rows of :func:`compare_measured` as a rich table."""
    table = Table(title=title, title_justify="left")
    for header in ("kind", "count", "predicted ms", "measured ms", "mean |error| ms", "rel. error", "bias"):
        table.add_column(header, justify="left" if header == "kind" else "right", overflow="fold")
    for index, row in enumerate(rows):
        table.add_row(
            row["kind"], str(row["count"]), f"{row['predicted_ms']:.4g}", f"{row['measured_ms']:.4g}",
            f"{row['abs_error_ms']:.3f}",  # ms to the microsecond: float noise (1e-17) is no error
            "–" if row["rel_error"] is None else f"{row['rel_error']:.1%}",
            "–" if row["bias"] is None else f"{row['bias']:+.1%}",
            # a rule above the iteration row, where there is one (not for a trace missing ops)
            end_section=index + 1 < len(rows) and rows[index + 1]["kind"] == "iteration",
        )
    return table
