"""Smoke test of benchmarks/bench_training.py: its statistics exactly, and each part end to end
at the ``--quick`` sizes (4 gloo processes, a few steps) with the checks it reports.

The timings themselves are the benchmark's business (the machine is shared); the tests check
what does not depend on load: which runs happened, the ratios computed from their medians, the
bytes a checkpoint holds, that a restore is bit-identical, and that every message is accounted
for.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import bench_training as bench  # noqa: E402


def test_slope_and_range_of_a_series():
    assert bench.slope_per_step([1.0, 3.0, 5.0, 7.0]) == 2.0
    assert bench.slope_per_step([5.0, 5.0, 5.0]) == 0.0
    # x 0..3, y 2, 0, 4, 2: sum((x - 1.5)(y - 2)) = 0 + 1 + 1 + 0 = 2 over sum((x - 1.5)^2) = 5
    assert bench.slope_per_step([2.0, 0.0, 4.0, 2.0]) == pytest.approx(0.4)
    assert bench.slope_per_step([9.0]) == 0.0
    assert bench.relative_range([100, 104, 102]) == pytest.approx(0.04)


def _record(rank: int, *, step_ms: list[float], rss_kb: list[int], unclaimed: int = 0) -> dict:
    began = [0.5 * i for i in range(len(step_ms))]
    messages = {"expected_sent": 6, "expected_received": 6, "sent": 6, "received": 6, "taken": 6, "sends_pending": 0,
                "unclaimed": unclaimed, "receivers_running": 0, "receiver_errors": 0, "meter_tape_bytes": 0,
                "meter_message_bytes": 0}
    metrics = [{"step": i, "step_ms": ms, "peak_activation_bytes": [10, 20],
                "peak_with_message_bytes": [12 + (i % 2), 22]} for i, ms in enumerate(step_ms)] if rank == 0 else []
    return {"rank": rank, "step_began": began, "rss_kb": rss_kb, "messages": messages, "metrics": metrics}


def test_soak_summary_by_hand():
    step_ms = [50.0, 10.0, 11.0, 12.0, 13.0, 14.0]  # the first dropped as warm-up
    records = [_record(0, step_ms=step_ms, rss_kb=[900, 1000, 1010, 1020, 1030, 1040]),
               _record(1, step_ms=step_ms, rss_kb=[900, 1000, 1100, 1000, 1000, 1000])]
    summary = bench.soak_summary(records, warmup=1, window=2)
    assert summary["timed_steps"] == 5
    assert summary["step_ms"]["first_window_median"] == 10.5 and summary["step_ms"]["last_window_median"] == 13.5
    assert summary["step_ms"]["slope_ms_per_100_steps"] == 100.0
    assert [m["range"] for m in summary["rss"]] == [0.04, 0.1]
    assert summary["rss_flat"] is False  # rank 1 moved 10%
    assert summary["messages_accounted"] is True
    assert summary["tape_peak_steady"] is True and summary["message_peak_not_growing"] is True
    assert summary["message_peak_min_bytes"] == [12, 22] and summary["message_peak_max_bytes"] == [13, 22]
    records[1]["messages"]["unclaimed"] = 1  # one message received that no op took
    assert bench.soak_summary(records, warmup=1, window=2)["messages_accounted"] is False


@pytest.mark.slow
def test_overhead_runs_interleaved_pairs_and_reports_their_ratios(tmp_path):
    result = bench.bench_overhead(tmp_path, bench.QUICK)
    sizes = bench.QUICK
    assert [row["variant"] for row in result["rows"]] == ["plain", "full"]
    assert result["gpus"] == 4 and result["rounds"] == sizes.rounds
    plain, full = result["rows"]
    assert plain["step_ms"]["vs_base"]["pairs"] == [0.0] * sizes.rounds
    # the ratios come from each job's own steps after warm-up (rank 0's metrics)
    series = {}
    for variant in ("plain", "full"):
        for r in range(sizes.rounds):
            record = json.loads((tmp_path / "overhead" / f"{variant}-{r}.rank0.json").read_text())
            assert len(record["metrics"]) == sizes.warmup + sizes.steps
            series[variant, r] = [m["step_ms"] for m in record["metrics"]][sizes.warmup:]
    pairs = [statistics.median(series["full", r]) / statistics.median(series["plain", r]) - 1 for r in range(sizes.rounds)]
    assert full["step_ms"]["vs_base"]["pairs"] == [round(x, 4) for x in pairs]
    pooled = statistics.median([x for r in range(sizes.rounds) for x in series["full", r]])
    assert full["step_ms"]["median"] == round(pooled, 3)
    # only the trainer's jobs wrote --metrics, one line per step
    for r in range(sizes.rounds):
        assert not (tmp_path / "overhead" / f"plain-{r}.metrics.jsonl").exists()
        lines = (tmp_path / "overhead" / f"full-{r}.metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines] == list(range(sizes.warmup + sizes.steps))
        assert json.loads(lines[-1])["grad_norm"] > 0
    assert "autocast" in bench.overhead_table(result)


def _expected_payload(plan_path: str) -> list[int]:
    """Per rank, by hand: every layer's state_dict, AdamW's two moments and its float32 step per
    trainable parameter, and the CPU RNG state."""
    from octoplan.modelfile import load_model_file
    from octoplan.plan import load_plan

    plan = load_plan(plan_path)
    model = load_model_file(plan.model.source, plan.model.config)
    rng = torch.get_rng_state().numel()
    out = [rng] * plan.cluster.gpus
    for stage in plan.stages:
        for index in stage.layers:
            layer = model.build_layer(index)
            out[stage.rank] += sum(t.numel() * t.element_size() for t in layer.state_dict().values())
            out[stage.rank] += sum(2 * p.numel() * p.element_size() + 4 for p in layer.parameters() if p.requires_grad)
    return out


@pytest.mark.slow
def test_checkpoints_saved_loaded_bit_for_bit_with_the_bytes_each_rank_holds(tmp_path):
    result = bench.bench_checkpoints(tmp_path, bench.QUICK)
    assert [row["case"] for row in result["rows"]] == ["tiny_gpt", "hybrid", "vlm"]
    for row in result["rows"]:
        assert len(row["save_s"]) == bench.QUICK.checkpoint_saves and len(row["load_s"]) == bench.QUICK.checkpoint_loads
        assert all(s > 0 for s in row["save_s"] + row["load_s"])
        assert row["restored_identical"] is True
        payload = [r["payload_bytes"] for r in row["per_rank"]]
        assert payload == _expected_payload(row["plan"])
        # DCP adds a record per tensor: never fewer bytes than the tensors themselves
        assert all(r["file_bytes"] >= r["payload_bytes"] for r in row["per_rank"])
        assert row["total_bytes"] == sum(r["file_bytes"] for r in row["per_rank"]) + row["index_bytes"] + \
            len((Path(row["plan"]).parent / f"{row['case']}-saved" / f"step_{bench.QUICK.checkpoint_saves:08d}"
                 / "octopipe.json").read_bytes())
    assert "bit for bit" in bench.checkpoints_table(result)


@pytest.mark.slow
def test_soak_accounts_for_every_message_and_keeps_memory_flat(tmp_path):
    result = bench.bench_soak(tmp_path, bench.QUICK)
    assert result["steps"] == 40 and result["timed_steps"] == 40 - bench.QUICK.soak_warmup
    assert result["messages_accounted"] is True
    messages = result["messages"]
    assert len(messages) == 4 and all(m["expected_sent"] > 0 or m["expected_received"] > 0 for m in messages)
    # what one rank sends another receives: the job's totals agree
    assert result["sent_total"] == result["received_total"] == sum(m["expected_sent"] for m in messages)
    assert result["rss_flat"] is True, result["rss"]
    assert result["tape_peak_steady"] is True
    assert "accounted for: yes" in bench.soak_table(result)
