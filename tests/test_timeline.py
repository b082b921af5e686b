"""The timeline views: exact terminal rows, well-formed SVG, trace round trip, measured check."""

from __future__ import annotations

import io
import json
import xml.etree.ElementTree as ET

import pytest
from rich.console import Console

from octoplan.baseline import make_baseline
from octoplan.errors import InputError
from octoplan.ops import Kind, Op, parse_op
from octoplan.plan import Cluster
from octoplan.profile import Layer, ModelRef, Profile
from octoplan.simulator import Span, simulate
from octoplan.timeline import compare_measured, render_comparison, render_terminal, write_svg, write_trace
from octoplan.timeline.terminal import rank_cells

SVG_NS = "{http://www.w3.org/2000/svg}"


def _unit_profile(num_layers: int) -> Profile:
    """F = I = W = 1 ms per layer, nothing to send: a transfer costs exactly the latency."""
    layers = tuple(Layer(f"l{i}", "block", 1.0, 1.0, 1.0, 1000, 1000, 0) for i in range(num_layers))
    return Profile(model=ModelRef("unit"), layers=layers)


def _hetero_profile(num_blocks: int) -> Profile:
    layers = [Layer("embed", "embedding", 3.0, 1.0, 2.0, 10**8, 10**6, 10**6)]
    layers += [Layer(f"b{i}", "block", 1.0, 1.1, 0.9, 10**7, 10**6, 10**6) for i in range(num_blocks)]
    layers += [Layer("head", "head", 4.0, 3.0, 3.0, 10**8, 10**6, 10**6)]
    return Profile(model=ModelRef("hetero"), layers=tuple(layers))


def _plan(profile: Profile, schedule: str, gpus: int, microbatches: int, **kwargs):
    plan = make_baseline(profile, schedule=schedule, gpus=gpus, microbatches=microbatches, **kwargs)
    return plan, simulate(plan, profile)


def _plain(renderable, width: int) -> list[str]:
    console = Console(width=width, file=io.StringIO(), color_system=None, record=True, legacy_windows=False)
    console.print(renderable)
    return console.export_text().splitlines()


# ---------------------------------------------------------------------------- terminal


def test_gpipe_two_ranks_rows_are_exact():
    # GPipe, 2 ranks, 2 microbatches, F = 1 ms, B = 2 ms, zero-cost transfers:
    # r0: F0 [0,1] F1 [1,2] idle B0 [5,7] B1 [7,9];  r1: idle F0 [1,2] F1 [2,3] B0 [3,5] B1 [5,7] idle.
    plan, result = _plan(_unit_profile(2), "gpipe", 2, 2, cluster=Cluster(gpus=2, latency_us=0))
    assert result.iteration_ms == 9.0
    lines = _plain(render_terminal(plan, result, width=21), 80)  # 18 cells of 0.5 ms
    assert lines[0] == "unit · gpipe · pp 2 …"  # the header is cut to the width
    assert lines[1] == "r0 F0F1······B0  B1  "
    assert lines[2] == "r1 ··F0F1B0  B1  ····"
    assert lines[3] == "   ┌─────────┬───────"
    assert lines[4] == "   0 ms      5"
    rest = " ".join(line.strip() for line in lines[5:])
    assert rest == (
        "F  forward    B backward (I+W)   · idle iteration 9 ms · bubble ratio 33.3% · "
        "efficiency 66.7% (lower bound 6 ms)"
    )
    assert max(len(line) for line in lines) <= 21


def test_gpipe_two_ranks_one_cell_per_ms():
    plan, result = _plan(_unit_profile(2), "gpipe", 2, 2, cluster=Cluster(gpus=2, latency_us=0))
    lines = _plain(render_terminal(plan, result, width=12), 80)  # 9 cells of 1 ms
    assert lines[1:3] == ["r0 FF···B0B1", "r1 ·FFB0B1··"]


def test_width_none_fills_the_console():
    plan, result = _plan(_hetero_profile(6), "1f1b", 4, 8)
    lines = _plain(render_terminal(plan, result), 57)
    assert [len(line) for line in lines[1:5]] == [57] * 4
    assert [line[:3] for line in lines[1:5]] == ["r0 ", "r1 ", "r2 ", "r3 "]


def test_width_is_capped_by_the_console():
    plan, result = _plan(_hetero_profile(6), "1f1b", 4, 8)
    capped = _plain(render_terminal(plan, result, width=120), 60)
    assert capped == _plain(render_terminal(plan, result, width=60), 60)
    assert all(len(line) <= 60 for line in capped)


def test_multi_stage_ranks_get_full_op_labels():
    plan, result = _plan(_unit_profile(4), "zbv", 2, 2, cluster=Cluster(gpus=2, latency_us=0))
    lines = _plain(render_terminal(plan, result, width=3 + 8 * int(result.iteration_ms)), 400)
    # r0 holds stages 0 and 3 (V placement): its labels name the stage.
    assert result.iteration_ms == 14.0
    assert lines[1] == "r0 " + "".join(f"{op:<8}" if op else "·" * 8 for op in (
        "0F0", "0F1", None, "3F0", "3I0", "3W0", "3F1", "3I1", "3W1", "0I0", "0W0", None, "0I1", "0W1"))
    assert "chunk" in lines[-2]


def test_cells_show_what_covers_most():
    f, i, w = Op(0, Kind.F, 0), Op(0, Kind.I, 0), Op(0, Kind.W, 0)
    # cell 0: F 0.3, I 0.2, W 0.2, idle 0.3 -> busy, F wins; cell 1: F 0.4, idle 0.6 -> idle;
    # cell 2: W 0.5, idle 0.5 -> busy (ties go to busy), the op itself.
    spans = [Span(0, f, 0.0, 0.3), Span(0, i, 0.3, 0.5), Span(0, w, 0.5, 0.7), Span(0, Op(0, Kind.F, 1), 1.0, 1.4),
             Span(0, Op(0, Kind.W, 1), 2.5, 3.0)]
    cells = rank_cells(spans, t0=0.0, cell_ms=1.0, num_cells=3)
    assert cells == [f, None, Op(0, Kind.W, 1)]
    # Two F ops: the larger one names the cell.
    many = [Span(0, Op(0, Kind.F, 0), 0.0, 0.25), Span(0, Op(0, Kind.F, 1), 0.25, 0.75)]
    assert rank_cells(many, t0=0.0, cell_ms=1.0, num_cells=1) == [Op(0, Kind.F, 1)]
    # F wins by kind (0.5) but the largest op is a B (0.375): the cell shows the kind only.
    split = [Span(0, Op(0, Kind.F, 0), 0.0, 0.25), Span(0, Op(0, Kind.B, 0), 0.25, 0.625), Span(0, Op(0, Kind.F, 1), 0.625, 0.875)]
    assert rank_cells(split, t0=0.0, cell_ms=1.0, num_cells=1) == [Kind.F]


# ---------------------------------------------------------------------------- SVG


def test_svg_is_well_formed_with_one_rect_per_op(tmp_path):
    plan, result = _plan(_hetero_profile(6), "zb-h1", 4, 8)
    path = tmp_path / "t.svg"
    write_svg(plan, result, path, title="zb-h1 check")
    root = ET.parse(path).getroot()
    rects = root.iter(f"{SVG_NS}rect")
    ops = [r for r in rects if r.get("class") == "op"]
    assert len(ops) == sum(len(ops) for ops in plan.schedule)
    texts = [t.text for t in root.iter(f"{SVG_NS}text")]
    assert texts[0] == "zb-h1 check — hetero · zb-h1 · pp 4 · 8 microbatches · 4 stages"
    assert texts[1].startswith(f"iteration {result.iteration_ms:.4g} ms · bubble ratio {result.bubble_ratio:.1%}")
    assert [f"rank {r}" for r in range(4)] == [t for t in texts if t and t.startswith("rank ")]
    assert any(r.get("class") == "bubble" for r in root.iter(f"{SVG_NS}rect"))
    critical = [r for r in root.iter(f"{SVG_NS}rect") if r.get("class") == "critical"]
    assert len(critical) == len(result.critical_path) > 0
    lines = [ln for ln in root.iter(f"{SVG_NS}line") if ln.get("class") == "transfer"]
    assert len(lines) == len(result.transfers) > 0
    # Op boxes sit where the simulator put them: the last op of rank 3 ends at the plot's right edge.
    last = max(ops, key=lambda r: float(r.get("x")) + float(r.get("width")))
    first = min(ops, key=lambda r: float(r.get("x")))
    span_px = float(last.get("x")) + float(last.get("width")) - float(first.get("x"))
    assert span_px == pytest.approx(1200.0, abs=0.02)


def test_svg_stays_well_formed_with_characters_xml_cannot_hold(tmp_path):
    """A plan file named with an escape character drew a picture no XML reader could open."""
    plan, result = _plan(_hetero_profile(6), "zb-h1", 4, 8)
    path = tmp_path / "t.svg"
    write_svg(plan, result, path, title="plan\x1b[1m\x00.yaml <&>")
    texts = [t.text for t in ET.parse(path).getroot().iter(f"{SVG_NS}text")]
    assert texts[0].startswith("plan\\x1b[1m\\x00.yaml <&> — hetero")


def test_svg_draws_allreduces_for_dp(tmp_path):
    plan, result = _plan(_hetero_profile(6), "1f1b", 4, 4, pp=2)
    assert plan.parallel.dp == 2 and result.allreduces
    path = tmp_path / "dp.svg"
    write_svg(plan, result, path)
    root = ET.parse(path).getroot()
    assert len([r for r in root.iter(f"{SVG_NS}rect") if r.get("class") == "allreduce"]) == len(result.allreduces)


# ---------------------------------------------------------------------------- trace


def _load_events(path):
    return json.loads(path.read_text())["traceEvents"]


def test_trace_round_trips_every_op_exactly(tmp_path):
    plan, result = _plan(_hetero_profile(6), "zb-h1", 4, 8)
    path = tmp_path / "t.json"
    write_trace(plan, result, path)
    doc = json.loads(path.read_text())
    assert doc["displayTimeUnit"] == "ms"
    events = doc["traceEvents"]
    ops = [e for e in events if e["ph"] == "X" and e["pid"] == 0]
    spans = {span.op: span for span in result.spans()}
    assert sorted(e["name"] for e in ops) == sorted(str(op) for op in spans)
    for event in ops:
        span = spans[parse_op(event["name"])]
        assert event["tid"] == span.rank
        assert event["cat"] == span.op.kind.value
        assert event["ts"] == span.start_ms * 1000.0
        assert event["dur"] == (span.end_ms - span.start_ms) * 1000.0
        assert event["args"] == {"stage": span.op.stage, "mb": span.op.mb}
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert [names[(0, r)] for r in range(4)] == ["rank 0", "rank 1", "rank 2", "rank 3"]
    sends = [e for e in events if e["ph"] == "X" and e["pid"] == 1]
    assert len(sends) == len(result.transfers)
    by_name = {e["name"]: e for e in sends}
    for t in result.transfers:
        event = by_name[f"send {t.op} -> r{t.dst_rank}"]
        assert (event["tid"], event["ts"], event["dur"]) == (
            t.src_rank * 4 + t.dst_rank, t.start_ms * 1000.0, (t.end_ms - t.start_ms) * 1000.0)
        assert names[(1, event["tid"])] == f"r{t.src_rank} -> r{t.dst_rank}"


def test_trace_holds_allreduces_on_their_own_pid(tmp_path):
    plan, result = _plan(_hetero_profile(6), "1f1b", 4, 4, pp=2)
    path = tmp_path / "dp.json"
    write_trace(plan, result, path)
    reduces = [e for e in _load_events(path) if e["ph"] == "X" and e["pid"] == 2]
    assert sorted((e["tid"], e["name"]) for e in reduces) == sorted((a.rank, f"allreduce s{a.stage}") for a in result.allreduces)
    # The all-reduce outlasts the ops; the measured span of op events compares with the ops' span.
    last_op_end = max(span.end_ms for span in result.spans())
    assert result.iteration_ms > last_op_end
    rows = compare_measured(plan, result, path)
    assert rows[-1]["predicted_ms"] == pytest.approx(last_op_end) and rows[-1]["abs_error_ms"] == pytest.approx(0.0, abs=1e-9)


# ---------------------------------------------------------------------------- compare_measured


@pytest.fixture()
def zb_trace(tmp_path):
    plan, result = _plan(_hetero_profile(6), "zb-h1", 4, 8)
    path = tmp_path / "pred.json"
    write_trace(plan, result, path)
    return plan, result, path


def test_compare_same_trace_gives_zero_error(zb_trace):
    plan, result, path = zb_trace
    rows = compare_measured(plan, result, path)
    assert [row["kind"] for row in rows] == ["F", "I", "W", "iteration"]
    assert [row["count"] for row in rows] == [32, 32, 32, 1]
    for row in rows:
        assert row["abs_error_ms"] == pytest.approx(0.0, abs=1e-9)
        assert row["rel_error"] == pytest.approx(0.0, abs=1e-9)
    assert rows[-1]["predicted_ms"] == result.iteration_ms
    assert rows[-1]["measured_ms"] == pytest.approx(result.iteration_ms, rel=1e-12)
    f_mean = sum(s.end_ms - s.start_ms for s in result.spans() if s.op.kind is Kind.F) / 32
    assert rows[0]["predicted_ms"] == pytest.approx(f_mean)


def test_compare_scaled_trace_gives_ten_percent(zb_trace, tmp_path):
    plan, result, path = zb_trace
    doc = json.loads(path.read_text())
    for event in doc["traceEvents"]:
        if event["ph"] == "X":
            event["ts"] *= 1.1
            event["dur"] *= 1.1
    scaled = tmp_path / "slow.json"
    scaled.write_text(json.dumps(doc))
    rows = compare_measured(plan, result, scaled)
    for row in rows:
        assert row["rel_error"] == pytest.approx(0.1, rel=1e-9)
        assert row["bias"] == pytest.approx(0.1, rel=1e-9)
        assert row["measured_ms"] == pytest.approx(1.1 * row["predicted_ms"], rel=1e-12)
    table = _plain(render_comparison(rows), 100)
    assert any("iteration" in line and "10.0%" in line and "+10.0%" in line for line in table)


def test_compare_several_steps_and_other_pids(zb_trace, tmp_path):
    plan, result, path = zb_trace
    ops = [e for e in _load_events(path) if e["ph"] == "X" and e["pid"] == 0]
    step_us = result.iteration_ms * 1000 + 500
    events = []
    for step in range(3):
        for e in ops:
            # A measured trace: one pid per process, extra fields, step k's durations 1 + k/10.
            events.append({**e, "pid": 7, "ts": e["ts"] + step * step_us, "dur": e["dur"] * (1 + step / 10), "args": {}})
    events.append({"name": "optimizer", "ph": "X", "pid": 7, "tid": 0, "ts": 0, "dur": 5})
    measured = tmp_path / "steps.json"
    measured.write_text(json.dumps(events))  # the bare-array form of the format
    rows = compare_measured(plan, result, measured)
    by_kind = {row["kind"]: row for row in rows}
    assert by_kind["F"]["count"] == 96 and by_kind["iteration"]["count"] == 3
    assert by_kind["F"]["rel_error"] == pytest.approx(0.1)  # mean of 0, 0.1, 0.2
    assert by_kind["W"]["measured_ms"] == pytest.approx(1.1 * by_kind["W"]["predicted_ms"])


def test_compare_takes_steps_from_args(zb_trace, tmp_path):
    plan, result, path = zb_trace
    ops = [e for e in _load_events(path) if e["ph"] == "X" and e["pid"] == 0]
    # Two data-parallel replicas (a process each, as octorun writes them), 1 ms apart, both
    # in step 0, and the trace's step 3 alone: the steps are the events' own
    events = [{**e, "pid": replica, "ts": e["ts"] + replica * 1000, "args": {"step": 0}} for replica in (0, 1) for e in ops]
    events += [{**e, "ts": e["ts"] + 10_000_000, "args": {"step": 3}} for e in ops]
    measured = tmp_path / "replicas.json"
    measured.write_text(json.dumps({"traceEvents": events}))
    rows = compare_measured(plan, result, measured)
    assert rows[-1]["kind"] == "iteration" and rows[-1]["count"] == 2
    assert rows[-1]["measured_ms"] == pytest.approx(result.iteration_ms + 0.5)  # the mean of (it + 1) and it
    assert rows[0]["count"] == 96 and rows[0]["abs_error_ms"] == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("change, needle", [
    ("repeat", "op 0F0 appears twice in step 0 on 0/0"),
    ("swap", "but the plan's rank 0 runs"),
    ("moved", "op 0F0 ran on tid 1, but the plan puts stage 0 on pipeline rank 0"),
])
def test_compare_refuses_a_trace_in_another_order(zb_trace, tmp_path, change, needle):
    """The trace of another plan with the same ops (or one op twice, or on another rank) is
    refused, not compared: each rank runs its own ops in the plan's order, once a step."""
    plan, result, path = zb_trace
    ops = sorted((e for e in _load_events(path) if e["ph"] == "X" and e["pid"] == 0 and e["tid"] == 0), key=lambda e: e["ts"])
    if change == "repeat":  # rank 0's first op again, before its second, all in step 0
        events = [{**e, "args": {"step": 0}} for e in [ops[0], {**ops[0], "ts": ops[0]["ts"] + 1}, *ops[1:]]]
    elif change == "moved":  # rank 0's first op reported on rank 1's thread, in its order there
        events = [{**ops[0], "tid": 1}, *ops[1:]]
    else:  # the first two ops of rank 0 swap places in time
        first, second = ops[0], ops[1]
        events = [{**second, "ts": first["ts"]}, {**first, "ts": first["ts"] + second["dur"]}] + ops[2:]
    measured = tmp_path / "other.json"
    measured.write_text(json.dumps({"traceEvents": events}))
    with pytest.raises(InputError, match=needle):
        compare_measured(plan, result, measured)


def test_compare_leaves_out_the_iteration_where_ops_are_missing(zb_trace, tmp_path, caplog):
    """The measured span of the ops present is not the predicted span of them all: a trace of
    half the microbatches read as an iteration 49% faster than predicted."""
    plan, result, path = zb_trace
    kept = [e for e in _load_events(path) if e["ph"] == "X" and e["pid"] == 0 and e["tid"] != 3]
    measured = tmp_path / "three_ranks.json"
    measured.write_text(json.dumps({"traceEvents": kept}))
    with caplog.at_level("WARNING"):
        rows = compare_measured(plan, result, measured)
    assert [row["kind"] for row in rows] == ["F", "I", "W"]
    assert [row["count"] for row in rows] == [24, 24, 24]
    assert "24 of the plan's 96 ops are not in the trace" in caplog.text


def test_compare_refuses_a_replay_at_another_time_scale(zb_trace, tmp_path):
    plan, result, path = zb_trace
    doc = json.loads(path.read_text())
    for scale, refused in ((0.1, True), (1.0, False)):
        doc["otherData"] = {"replay_time_scale": scale}
        measured = tmp_path / f"replay{scale}.json"
        measured.write_text(json.dumps(doc))
        if refused:
            with pytest.raises(InputError) as info:
                compare_measured(plan, result, measured)
            assert info.value.field == "otherData.replay_time_scale" and "slept 0.1 x" in str(info.value)
        else:
            assert compare_measured(plan, result, measured)[-1]["abs_error_ms"] == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize(
    "content, needle",
    [
        (None, "no such file"),
        ("{not json", "is not JSON"),
        ('{"events": []}', "traceEvents: is missing"),
        ('{"traceEvents": {}}', "traceEvents: must be a list"),
        ('{"traceEvents": [{"name": "optimizer", "ph": "X", "ts": 0, "dur": 1}]}', "holds no op events"),
        ('{"traceEvents": [{"name": "0F0", "ph": "X", "ts": 0, "dur": "1"}]}', "traceEvents[0].dur: of op 0F0 is '1'"),
        ('{"traceEvents": [{"name": "0F0", "ph": "X", "ts": 0}]}', "traceEvents[0].dur"),
        ('{"traceEvents": [{"name": "0F0", "ph": "X", "ts": 0, "dur": -3}]}', "is negative"),
        ('{"traceEvents": [{"name": "9F0", "ph": "X", "ts": 0, "dur": 1}]}', "op 9F0 is not in the plan"),
        ('{"traceEvents": [{"name": "0B0", "ph": "X", "ts": 0, "dur": 1}]}', "op 0B0 is not in the plan's schedule"),
    ],
)
def test_compare_bad_trace_names_the_file(zb_trace, tmp_path, content, needle):
    plan, result, _ = zb_trace
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(InputError) as info:
        compare_measured(plan, result, path)
    assert info.value.file == str(path)
    assert needle in str(info.value)


# ---------------------------------------------------------------------------- scale


def test_32_ranks_128_microbatches_render_completely(tmp_path):
    plan, result = _plan(_hetero_profile(62), "zb-h1", 32, 128)
    lines = _plain(render_terminal(plan, result, width=160), 160)
    write_svg(plan, result, tmp_path / "big.svg")
    write_trace(plan, result, tmp_path / "big.json")
    assert [line[:4] for line in lines[1:33]] == [f"r{r}".rjust(3) + " " for r in range(32)]
    assert all(len(line) == 160 for line in lines[1:33])
    root = ET.parse(tmp_path / "big.svg").getroot()
    assert len([r for r in root.iter(f"{SVG_NS}rect") if r.get("class") == "op"]) == 32 * 128 * 3
