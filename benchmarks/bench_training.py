"""octorun as a trainer: what bf16, AdamW, clipping and metrics cost per step; checkpoint save and
load; a long soak (memory, step time, messages).

Every job runs in-process on N gloo processes (like ``tests/runtime_helpers.launch``: one process
group per batch of jobs, so a batch pays the start-up of torch and the rendezvous once), each
process calling :func:`octorun.runtime.run` for each job of the batch in turn. A *probe*
(:class:`_Probe`), installed in each worker before the first job, wraps four methods of octorun
from outside (octorun's code is not changed) and records per rank:

- each step's start and end (``time.perf_counter``) and the process's resident memory (VmRSS of
  ``/proc/self/status``) after each step;
- the wall time of each checkpoint save and restore (``_Interpreter.save`` / ``restore``: the
  state dict built, DCP's write or read, the publishing rename), and the payload bytes saved;
- every message the transport sends, receives and hands to an op, and, once the run is over,
  what the transport still holds: sends not let go, received messages no op took, receiver
  threads still running, and with ``--activation-memory`` the bytes the meter still counts.

Parts (each a function returning plain data; ``main`` prints markdown tables and writes JSON):

``overhead``     one tuned 8-rank plan of an analytic profile, replayed (``--replay SCALE``: every
                 op sleeps its profiled time x SCALE); jobs interleaved A B A B ...: A plain (fp32,
                 SGD, no clipping, no --metrics), B the trainer (bf16, AdamW with weight decay,
                 --grad-clip, --metrics). Median ``step_ms`` of each over the steps after warm-up,
                 and B / A - 1 per pair of neighbouring jobs. Under a replay the layers only sleep
                 and their few element-wise ops are not among those autocast lowers, so bf16 costs
                 its autocast regions only, not bf16 arithmetic.
``checkpoints``  save and load time (median of a few) and bytes per rank of the example models
                 under a 4-rank 1F1B plan, at their own size and at GPU size with short sequences
                 (as many parameters, little compute per step), and of the replayed analytic
                 profile (whose replay layers hold one small vector each, not the profile's
                 ``param_bytes``). Each restore is checked bit for bit against the state saved.
``soak``         a few hundred steps of the trainer on the replayed tuned plan: per rank, VmRSS
                 after warm-up within 5%; the median step time of the first and the last 50 steps
                 and a least-squares slope; every message sent, received and taken as the plan's
                 lowering says, and nothing left at the end.

Command line (docs/BENCHMARKS.md has the runs and their results)::

    .venv/bin/python benchmarks/bench_training.py all --out out/bench-training
    .venv/bin/python benchmarks/bench_training.py overhead --rounds 6
    .venv/bin/python benchmarks/bench_training.py soak --steps 300
    .venv/bin/python benchmarks/bench_training.py all --quick      # seconds: the smoke test's sizes
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import logging
import multiprocessing
import os
import re
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

__all__ = [
    "SOURCE",
    "Sizes",
    "FULL",
    "QUICK",
    "TrainJob",
    "run_jobs",
    "tuned_replay_plan",
    "trainer_config",
    "bench_overhead",
    "bench_checkpoints",
    "bench_soak",
    "slope_per_step",
    "relative_range",
    "report",
    "main",
]

log = logging.getLogger("benchmarks.bench_training")

SOURCE = "profiles/gemma2-27b-h100.yaml"  # an analytic profile, replayed as in bench_runtime.py


@dataclass(frozen=True)
class Sizes:
    """How big each part runs: the full benchmark, or the smoke test's seconds-long version."""

    gpus: int  # processes of the replayed tuned plan (pp = gpus)
    microbatches: int
    tune_max_plans: int  # the tuner's budget in simulated plans: the same plan on any machine, any load
    tune_quick: bool  # a one-climb search without CP-SAT (the smoke test's seconds)
    overhead_scale: float  # --replay time scale of the overhead part
    soak_scale: float
    rounds: int  # A/B pairs
    warmup: int  # steps dropped before timing
    steps: int  # timed steps per overhead job
    soak_steps: int
    soak_warmup: int
    soak_window: int  # steps whose median is compared at the start and the end of the soak
    checkpoint_saves: int
    checkpoint_loads: int
    large_models: tuple[str, ...]  # examples also run at GPU size (LARGE_SHORT)


# At scale 0.22 (bench_runtime's for this profile) the tuned plan's ops last 2-50 ms and a step
# about 1.1 s; the soak runs at 0.1 (about 0.5 s a step) to fit 300 steps into a few minutes.
FULL = Sizes(gpus=8, microbatches=16, tune_max_plans=1500, tune_quick=False, overhead_scale=0.22, soak_scale=0.1,
             rounds=6, warmup=3, steps=10, soak_steps=300, soak_warmup=20, soak_window=50,
             checkpoint_saves=5, checkpoint_loads=5, large_models=("tiny_gpt",))
QUICK = Sizes(gpus=4, microbatches=8, tune_max_plans=20, tune_quick=True, overhead_scale=0.01, soak_scale=0.01,
              rounds=2, warmup=1, steps=3, soak_steps=40, soak_warmup=5, soak_window=10,
              checkpoint_saves=2, checkpoint_loads=2, large_models=())


# ---------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------


def slope_per_step(values: Sequence[float]) -> float:
    """The least-squares slope of ``values`` against their index (units per step)."""
    count = len(values)
    if count < 2:
        return 0.0
    mean_x, mean_y = (count - 1) / 2, statistics.fmean(values)
    sxx = sum((x - mean_x) ** 2 for x in range(count))
    return sum((x - mean_x) * (y - mean_y) for x, y in enumerate(values)) / sxx


def relative_range(values: Sequence[float]) -> float:
    """(max - min) / min: how far a series that should stay flat moved."""
    low = min(values)
    return (max(values) - low) / low if low > 0 else float("inf")


def _round(value: float, digits: int = 4) -> float:
    return round(value, digits)


# ---------------------------------------------------------------------------------------------
# Jobs on N gloo processes, with a probe in each
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainJob:
    name: str
    config: Any  # octorun.runtime.RunConfig


def _vm_rss_kb() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


@dataclass
class _Probe:
    """What one worker records about the job it runs (see the module docstring)."""

    step_began: list[float] = field(default_factory=list)
    cpu_began: list[float] = field(default_factory=list)  # the process's CPU seconds (all its threads)
    step_ended: list[float] = field(default_factory=list)
    rss_kb: list[int] = field(default_factory=list)
    save_s: list[float] = field(default_factory=list)
    restore_s: list[float] = field(default_factory=list)
    saved_payload_bytes: int | None = None
    sent: int = 0
    received: int = 0
    taken: int = 0
    interpreter: Any = None

    def install(self) -> None:
        """Wrap octorun's methods (in this process only) so that they report to this probe."""
        from octorun import comm, runtime

        probe = self
        step, save, restore = runtime._Interpreter.step, runtime._Interpreter.save, runtime._Interpreter.restore
        send, put, take = comm.Transport.send, comm.Mailbox.put, comm.Mailbox.take

        def timed_step(interpreter, number):
            probe.interpreter = interpreter
            probe.step_began.append(time.perf_counter())
            probe.cpu_began.append(time.process_time())
            record = step(interpreter, number)
            probe.step_ended.append(time.perf_counter())
            probe.rss_kb.append(_vm_rss_kb())
            return record

        def timed_save(interpreter, number, *args, **named):
            began = time.perf_counter()
            save(interpreter, number, *args, **named)
            probe.save_s.append(time.perf_counter() - began)
            probe.saved_payload_bytes = _payload_bytes(interpreter._checkpoint_state())

        def timed_restore(interpreter, path):
            probe.interpreter = interpreter
            began = time.perf_counter()
            restore(interpreter, path)
            probe.restore_s.append(time.perf_counter() - began)

        def counted_send(transport, message, tensors, **named):
            send(transport, message, tensors, **named)
            probe.sent += 1

        def counted_put(mailbox, *args, **kwargs):
            put(mailbox, *args, **kwargs)
            probe.received += 1  # receiver threads: a += under the GIL between two puts of one thread

        def counted_take(mailbox, *args, **kwargs):
            value = take(mailbox, *args, **kwargs)
            probe.taken += 1
            return value

        runtime._Interpreter.step, runtime._Interpreter.save, runtime._Interpreter.restore = timed_step, timed_save, timed_restore
        comm.Transport.send, comm.Mailbox.put, comm.Mailbox.take = counted_send, counted_put, counted_take

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]

    def leftovers(self, steps_run: int) -> dict[str, Any]:
        """After the run: the messages the plan's lowering says this rank sends and receives in
        ``steps_run`` steps, what the probe counted, and what the transport still holds."""
        interpreter = self.interpreter
        if interpreter is None:  # no step ran and nothing restored
            return {}
        program = interpreter.program
        out: dict[str, Any] = {
            "expected_sent": steps_run * sum(len(instr.sends) for instr in program.instrs),
            "expected_received": steps_run * sum(len(instr.recvs) for instr in program.instrs),
            "sent": self.sent, "received": self.received, "taken": self.taken,
        }
        transport = interpreter.transport
        if transport is not None:
            for thread in transport._threads:
                thread.join(5.0)  # they end after the last step's messages; a live one is a leftover
            out.update(sends_pending=transport.sends_in_flight, unclaimed=len(transport.mailbox._items),
                       receivers_running=sum(thread.is_alive() for thread in transport._threads),
                       receiver_errors=len(transport.mailbox._errors))
        meter = interpreter.meter
        if meter is not None:
            out.update(meter_tape_bytes=meter.current, meter_message_bytes=meter.current_with_messages - meter.current)
        return out


def _payload_bytes(state: dict[str, Any]) -> int:
    import torch

    return sum(value.numel() * value.element_size() for value in state.values() if isinstance(value, torch.Tensor))


def _state_digest(state: dict[int, dict[str, Any]]) -> str:
    """A hash of every tensor's bytes, by layer and name: equal digests, bit-identical states."""
    import torch

    digest = hashlib.sha256()
    for index in sorted(state):
        for name in sorted(state[index]):
            tensor = state[index][name]
            digest.update(f"{index}/{name}/{tensor.dtype}/{list(tensor.shape)}".encode())
            digest.update(tensor.contiguous().view(-1).view(dtype=torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _worker(rank: int, world: int, port: int, jobs: list[TrainJob], folder: str) -> None:
    log_file = open(os.path.join(folder, f"rank{rank}.log"), "w")
    os.dup2(log_file.fileno(), 1)
    os.dup2(log_file.fileno(), 2)
    sys.stdout = sys.stderr = log_file
    # like torchrun: the launcher hosts the store, so it outlives any worker
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True", OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    from octorun.runtime import run

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    probe = _Probe()
    probe.install()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    for job in jobs:
        probe.reset()
        began = time.perf_counter()
        result = run(job.config)
        wall_s = time.perf_counter() - began
        steps_run = len(probe.step_began)
        record = {
            "job": job.name, "rank": rank, "pp_rank": result.pp_rank, "wall_s": wall_s,
            "step_began": probe.step_began, "cpu_began": probe.cpu_began, "step_ended": probe.step_ended, "rss_kb": probe.rss_kb,
            "save_s": probe.save_s, "restore_s": probe.restore_s, "saved_payload_bytes": probe.saved_payload_bytes,
            "messages": probe.leftovers(steps_run), "state_digest": _state_digest(result.state),
            "metrics": [m.to_dict() for m in result.metrics],
        }
        Path(folder, f"{job.name}.rank{rank}.json").write_text(json.dumps(record))
        print(f"job {job.name}: {wall_s:.2f} s", flush=True)
    dist.barrier()
    log_file.flush()
    os._exit(0)  # skip interpreter teardown: the process group's threads need not be joined


# Scheduling priority of the measured processes (a nice value; None: leave as is), as in
# bench_runtime.py: on a machine whose cores other jobs keep busy, a rank waking from a sleep
# waits for a core, and the benchmark measures the neighbours; a negative value (root only)
# lets the ranks, which mostly sleep, wake at once.
NICE: int | None = None


def run_jobs(world: int, jobs: Sequence[TrainJob], folder: str | Path, *, timeout_s: float = 900.0) -> dict[str, list[dict]]:
    """Run ``jobs`` one after another on ``world`` fresh gloo processes (forked, at :data:`NICE`;
    each with one intra-op thread). Returns, per job name, each rank's record (global rank order).
    Raises ``RuntimeError`` with the ranks' logs' tails when a process fails or outlives ``timeout_s``."""
    import torch._dynamo  # noqa: F401  (AdamW imports it: seconds per process if each child did it)
    from torch.distributed import TCPStore

    from octorun.runtime import free_port

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    context = multiprocessing.get_context("fork")
    procs = [context.Process(target=_worker, args=(rank, world, port, list(jobs), str(folder)), daemon=True)
             for rank in range(world)]
    started = time.monotonic()
    from benchmarks.bench_runtime import priority

    with priority(NICE):  # the children keep the value they were forked with
        for proc in procs:
            proc.start()
    # created after forking: no child inherits a copy of the store's server
    store = TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=timeout_s))
    for proc in procs:
        proc.join(max(started + timeout_s - time.monotonic(), 0.01))
    failed = []
    for rank, proc in enumerate(procs):
        if proc.is_alive():
            proc.kill()  # only the processes this function started
            proc.join(5)
            failed.append(f"rank {rank} still running after {timeout_s:g} s")
        elif proc.exitcode != 0:
            failed.append(f"rank {rank} exited {proc.exitcode}")
    del store
    if failed:
        tails = "\n".join(f"--- rank {r}\n" + (folder / f"rank{r}.log").read_text()[-1500:] for r in range(world)
                          if (folder / f"rank{r}.log").exists())
        raise RuntimeError(f"{'; '.join(failed)}\n{tails}")
    return {job.name: [json.loads((folder / f"{job.name}.rank{r}.json").read_text()) for r in range(world)] for job in jobs}


# ---------------------------------------------------------------------------------------------
# Plans and configurations
# ---------------------------------------------------------------------------------------------


def tuned_replay_plan(source: str | Path, out: str | Path, *, gpus: int, microbatches: int, max_plans: int,
                      quick: bool = False) -> Path:
    """``octoplan tune`` of ``source`` for ``gpus`` GPUs (pp = gpus, one node, memory that never
    binds: the replay holds a few KB whatever the profile says), written to ``out``; an existing
    ``out`` of the same settings is reused (tuning takes a minute on a loaded 2-core machine)."""
    from octoplan.plan import Cluster, load_plan, save_plan
    from octoplan.profile import load_profile
    from octoplan.tuner import TuneOptions, tune

    out = Path(out)
    settings = {"source": str(Path(source).resolve()), "gpus": gpus, "microbatches": microbatches,
                "max_plans": max_plans, "quick": quick}
    stamp = out.with_suffix(".settings.json")
    if out.exists() and stamp.exists() and json.loads(stamp.read_text()) == settings:
        load_plan(out)  # still a valid plan
        return out
    options = TuneOptions(gpus=gpus, pp=gpus, microbatches=microbatches, max_plans=max_plans, time_limit_s=600.0, chunks_max=3)
    if quick:
        options = replace(options, chunks_max=2, use_cpsat=False, max_starts=1, max_configs=1)
    cluster = Cluster(gpus=gpus, gpus_per_node=gpus, memory_gb=1e4)
    result = tune(load_profile(source), cluster, options, profile_path=settings["source"])
    out.parent.mkdir(parents=True, exist_ok=True)
    save_plan(result.plan, out)
    stamp.write_text(json.dumps(settings))
    return out


# Variants of the overhead part: RunConfig fields over the plain run (fp32, SGD, no clip, no metrics).
TRAINER = {"precision": "bf16", "optimizer": "adamw", "weight_decay": 0.1, "betas": (0.9, 0.95), "grad_clip": 1.0}
VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "full": {**TRAINER, "metrics": True},
    "bf16": {"precision": "bf16"},
    "adamw-clip": {"optimizer": "adamw", "weight_decay": 0.1, "betas": (0.9, 0.95), "grad_clip": 1.0},
    "metrics": {"metrics": True},
}


def trainer_config(plan: str | Path, *, steps: int, folder: Path, name: str, variant: dict[str, Any],
                   replay_scale: float | None, **extra: Any) -> Any:
    """The RunConfig of one job: ``variant``'s fields (``metrics: True`` writes FOLDER/NAME.metrics.jsonl)."""
    from octorun.runtime import RunConfig

    fields = {k: v for k, v in variant.items() if k != "metrics"}
    metrics = str(folder / f"{name}.metrics.jsonl") if variant.get("metrics") else None
    return RunConfig(plan_path=str(plan), steps=steps, lr=1e-3, metrics_path=metrics, timeout_s=120.0,
                     replay_time_scale=replay_scale, **fields, **extra)


def _step_series(records: list[dict], warmup: int) -> dict[str, list[float]]:
    """A job's per-step figures after ``warmup``: octorun's ``step_ms`` (rank 0's metrics: the
    slowest rank's step, from the step's barrier to its optimizer's end) and ``period_ms`` (on
    rank 0, one step's start to the next's: everything between steps too, such as gathering and
    writing the metrics); the last step has no period."""
    rank0 = records[0]
    began = rank0["step_began"]
    # CPU: per step, the busiest rank's process CPU time from one step's start to the next
    cpu = [[1000 * (b - a) for a, b in zip(r["cpu_began"], r["cpu_began"][1:])] for r in records if "cpu_began" in r]
    return {"step_ms": [m["step_ms"] for m in rank0["metrics"]][warmup:],
            "period_ms": [1000 * (b - a) for a, b in zip(began, began[1:])][warmup:],
            "cpu_ms": [max(per_rank) for per_rank in zip(*cpu)][warmup:] if cpu else []}


# ---------------------------------------------------------------------------------------------
# 1. Overhead per step
# ---------------------------------------------------------------------------------------------


def bench_overhead(out: str | Path, sizes: Sizes, *, variants: Sequence[str] = ("plain", "full"),
                   source: str = SOURCE) -> dict[str, Any]:
    """Interleaved jobs of the same replayed plan: ``sizes.rounds`` rounds of each variant in
    turn, every other round in reverse order (A B, B A, A B ...), so that a load that rises or
    falls during a round weighs on both variants alike; each round is one pair."""
    out = Path(out) / "overhead"
    plan = tuned_replay_plan(source, Path(out).parent / f"tuned-{sizes.gpus}.yaml", gpus=sizes.gpus,
                             microbatches=sizes.microbatches, max_plans=sizes.tune_max_plans, quick=sizes.tune_quick)
    jobs = [TrainJob(f"{variant}-{round_}", trainer_config(plan, steps=sizes.warmup + sizes.steps, folder=out,
                                                           name=f"{variant}-{round_}", variant=VARIANTS[variant],
                                                           replay_scale=sizes.overhead_scale))
            for round_ in range(sizes.rounds) for variant in (variants if round_ % 2 == 0 else variants[::-1])]
    began = time.monotonic()
    results = run_jobs(sizes.gpus, jobs, out)
    series = {job.name: _step_series(results[job.name], sizes.warmup) for job in jobs}
    base = variants[0]
    rows = []
    for variant in variants:
        row: dict[str, Any] = {"variant": variant, "fields": {k: list(v) if isinstance(v, tuple) else v
                                                              for k, v in VARIANTS[variant].items()}}
        for measure in ("step_ms", "period_ms", "cpu_ms"):
            pooled = [ms for r in range(sizes.rounds) for ms in series[f"{variant}-{r}"][measure]]
            per_round = [statistics.median(series[f"{variant}-{r}"][measure]) for r in range(sizes.rounds)]
            row[measure] = {"median": _round(statistics.median(pooled), 3), "per_round": [_round(x, 3) for x in per_round]}
            # against the base variant's job of the same round (run just before or after it)
            ratios = [statistics.median(series[f"{variant}-{r}"][measure]) / statistics.median(series[f"{base}-{r}"][measure]) - 1
                      for r in range(sizes.rounds)]
            row[measure]["vs_base"] = {"pooled": _round(row[measure]["median"] / statistics.median(
                [ms for r in range(sizes.rounds) for ms in series[f"{base}-{r}"][measure]]) - 1),
                "pairs_median": _round(statistics.median(ratios)), "pairs_min": _round(min(ratios)),
                "pairs_max": _round(max(ratios)), "pairs": [_round(x) for x in ratios]}
        rows.append(row)
    # the noise floor: the base variant against itself, from one round to the next
    base_medians = [statistics.median(series[f"{base}-{r}"]["step_ms"]) for r in range(sizes.rounds)]
    noise = [b / a - 1 for a, b in zip(base_medians, base_medians[1:])]
    from octoplan.plan import load_plan

    loaded = load_plan(plan)
    return {"plan": str(plan), "source": source, "gpus": sizes.gpus, "microbatches": sizes.microbatches,
            "stages": len(loaded.stages), "ops_per_rank": max(len(ops) for ops in loaded.schedule),
            "replay_scale": sizes.overhead_scale, "rounds": sizes.rounds, "warmup": sizes.warmup, "steps": sizes.steps,
            "base": base, "rows": rows, "noise_base_vs_itself": [_round(x) for x in noise], "wall_s": round(time.monotonic() - began, 1)}


def overhead_table(result: dict[str, Any]) -> str:
    lines = [f"{result['gpus']}-rank tuned plan of {Path(result['source']).stem} ({result['stages']} stages, "
             f"{result['ops_per_rank']} ops on the busiest rank, {result['microbatches']} microbatches), "
             f"--replay {result['replay_scale']:g}; {result['rounds']} rounds of interleaved jobs (A B, B A, ...), "
             f"{result['steps']} timed steps each after {result['warmup']} warm-up steps.",
             "",
             f"| variant | step_ms median | vs {result['base']}: pooled | pairs: median (min … max) "
             "| period_ms median | vs base: pooled | pairs: median (min … max) | CPU ms per step, busiest rank "
             "| CPU vs base, pairs: median (min … max) | that extra CPU as a share of the base's step |",
             "|---|---:|---:|---|---:|---:|---|---:|---|---:|"]
    base_step = result["rows"][0]["step_ms"]["median"]
    base_cpu = result["rows"][0]["cpu_ms"]["median"]

    def pct(x: float) -> str:
        return f"{100 * x:+.2f}%"

    for row in result["rows"]:
        cells = []
        for measure in ("step_ms", "period_ms"):
            m, v = row[measure], row[measure]["vs_base"]
            cells.append(f"{m['median']:.1f} | {pct(v['pooled'])} | {pct(v['pairs_median'])} "
                         f"({pct(v['pairs_min'])} … {pct(v['pairs_max'])})")
        cpu, v = row["cpu_ms"]["median"], row["cpu_ms"]["vs_base"]
        cells.append(f"{cpu:.1f} | {pct(v['pairs_median'])} ({pct(v['pairs_min'])} … {pct(v['pairs_max'])}) "
                     f"| {pct(v['pairs_median'] * base_cpu / base_step)}")
        lines.append(f"| {row['variant']} | " + " | ".join(cells) + " |")
    noise = result["noise_base_vs_itself"]
    if noise:
        lines += ["", f"Noise floor: {result['base']} against its own previous round: "
                      + ", ".join(pct(x) for x in noise) + "."]
    lines += ["", "step_ms: octorun's (the slowest rank, barrier to optimizer's end); period_ms: rank 0's step start "
                  "to the next (gathering and writing the metrics too); CPU: the process's CPU time (all threads) "
                  "from one step's start to the next, on the rank that used most. On a loaded machine a step's wall "
                  "time moves with the neighbours; the extra CPU is what the variant itself costs, an upper bound of "
                  "what it adds to the step where all of it lies on the critical path."]
    lines += ["", "Under --replay every layer only sleeps; its few element-wise ops (index_select, add) are not ops "
                  "autocast lowers to bf16, so bf16 here costs its autocast regions (one per layer call), not bf16 "
                  "arithmetic. AdamW and clipping work on the replay's small weight vectors; the gradient-norm "
                  "all-reduce runs every step with or without --grad-clip (it also detects non-finite values)."]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# 2. Checkpoints
# ---------------------------------------------------------------------------------------------


# The bundled examples at GPU size (benchmarks/bench_profiler.py's LARGE) with short sequences:
# as many parameters (the checkpoint's size), a small fraction of the compute per step.
LARGE_SHORT = {
    "tiny_gpt": {"vocab": 32768, "hidden": 2048, "heads": 16, "seq": 16},
    "vlm": {"image_size": 28, "patch": 14, "vision_hidden": 1024, "hidden": 2048, "heads": 16, "vocab": 32768, "text_len": 16},
    "hybrid": {"vocab": 32768, "hidden": 2048, "heads": 16, "seq": 16, "expert_hidden": 4096},
}


@dataclass(frozen=True)
class CheckpointCase:
    name: str
    plan: Path
    replay_scale: float | None = None


def _checkpoint_cases(out: Path, sizes: Sizes, *, source: str) -> list[CheckpointCase]:
    from octoplan.plan import save_plan
    from tests.runtime_helpers import EXAMPLE_CONFIGS, EXAMPLES, baseline_plan

    from octoplan.modelfile import load_model_file

    cases = []
    sized = {}
    for model in ("tiny_gpt", "hybrid", "vlm"):
        # quick: the tests' tiny configs; full: each example's own default size, then GPU-sized
        sized[model] = EXAMPLE_CONFIGS[model] if sizes.tune_quick else dict(load_model_file(EXAMPLES / f"{model}.py").config)
    sized.update({f"{model}-large": LARGE_SHORT[model] for model in sizes.large_models})
    for name, config in sized.items():
        model = name.removesuffix("-large")
        plan = baseline_plan("1f1b", EXAMPLES / f"{model}.py", config, out, gpus=4, pp=4, microbatches=4, microbatch_size=1)
        path = out / f"{name}.yaml"
        save_plan(plan, path)
        cases.append(CheckpointCase(name, path))
    if not sizes.tune_quick:
        replayed = tuned_replay_plan(source, out.parent / "tuned-4.yaml", gpus=4, microbatches=8,
                                     max_plans=sizes.tune_max_plans // 4, quick=False)
        cases.append(CheckpointCase(f"{Path(source).stem} (replay)", replayed, replay_scale=0.01))
    return cases


def bench_checkpoints(out: str | Path, sizes: Sizes, *, source: str = SOURCE) -> dict[str, Any]:
    """Per case: one job of ``checkpoint_saves`` AdamW steps saving after each (keep 2), then
    ``checkpoint_loads`` jobs that restore the last one and train no further step, each checked
    bit for bit against the state the saving job ended with."""
    from octoplan.plan import load_plan
    from octorun import checkpoint

    out = Path(out) / "checkpoints"
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    began = time.monotonic()
    for case in _checkpoint_cases(out, sizes, source=source):
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", case.name)
        save_dir = out / f"{slug}-saved"
        shutil.rmtree(save_dir, ignore_errors=True)  # this benchmark's own folder, from an earlier run
        # a GPU-sized model writes GBs per save: fewer of them
        steps = min(sizes.checkpoint_saves, 3) if case.name.endswith("-large") else sizes.checkpoint_saves
        loads = min(sizes.checkpoint_loads, 3) if case.name.endswith("-large") else sizes.checkpoint_loads
        variant = {"optimizer": "adamw", "weight_decay": 0.1}
        jobs = [TrainJob(f"{slug}-save", trainer_config(case.plan, steps=steps, folder=out, name=f"{slug}-save",
                                                        variant=variant, replay_scale=case.replay_scale,
                                                        save_dir=str(save_dir), save_every=1, keep=2))]
        jobs += [TrainJob(f"{slug}-load-{n}", trainer_config(case.plan, steps=steps, folder=out, name=f"{slug}-load-{n}",
                                                             variant=variant, replay_scale=case.replay_scale,
                                                             resume=str(save_dir)))
                 for n in range(loads)]
        world = load_plan(case.plan).cluster.gpus
        results = run_jobs(world, jobs, out / f"{slug}-runs")
        saver = results[jobs[0].name]
        # a collective: the slowest rank's time is the job's
        save_s = [max(r["save_s"][n] for r in saver) for n in range(steps)]
        load_s = [max(r["restore_s"][0] for r in results[job.name]) for job in jobs[1:]]
        identical = all(r["state_digest"] == saver[r["rank"]]["state_digest"] for job in jobs[1:] for r in results[job.name])
        final = checkpoint.latest(save_dir)[1]
        files = checkpoint.checkpoint_bytes(final)
        per_rank = []
        for r in saver:
            name = f"__{r['rank']}_0.distcp"
            per_rank.append({"rank": r["rank"], "file_bytes": files.get(name, 0), "payload_bytes": r["saved_payload_bytes"],
                             "rss_mb": round(max(r["rss_kb"]) / 1024, 1)})
        rows.append({
            "case": case.name, "plan": str(case.plan), "ranks": world, "saves": steps, "loads": loads,
            "save_s": [round(s, 4) for s in save_s], "load_s": [round(s, 4) for s in load_s],
            "save_median_s": round(statistics.median(save_s), 4), "load_median_s": round(statistics.median(load_s), 4),
            "total_bytes": sum(files.values()), "index_bytes": files.get(".metadata", 0), "per_rank": per_rank,
            "restored_identical": identical,
        })
        if case.replay_scale is not None:
            rows[-1]["real_model_bytes_per_rank"] = _real_checkpoint_bytes(case.plan)
        log.info("checkpoint %s: save %.3f s, load %.3f s, %d bytes", case.name, rows[-1]["save_median_s"],
                 rows[-1]["load_median_s"], rows[-1]["total_bytes"])
    return {"rows": rows, "wall_s": round(time.monotonic() - began, 1)}


def _real_checkpoint_bytes(plan_path: str | Path) -> list[int]:
    """Per rank, what octorun would save of the profiled model itself: fp32 master weights and
    AdamW's two fp32 moments per parameter, from the profile's ``param_bytes``."""
    from octoplan.plan import load_plan, load_plan_profile

    plan = load_plan(plan_path)
    profile = load_plan_profile(plan, plan_path)
    out = [0] * plan.cluster.gpus
    for stage in plan.stages:
        params = sum(profile.layers[i].param_bytes for i in stage.layers) // profile.param_dtype_bytes
        out[stage.rank] += 12 * params
    return out


def checkpoints_table(result: dict[str, Any]) -> str:
    lines = ["| model | ranks | save s: median (min–max) | load s: median (min–max) | file bytes per rank "
             "| payload, all ranks | total bytes | save GB/s | restored bit for bit |",
             "|---|---:|---|---|---|---:|---:|---:|---|"]
    notes = []
    for row in result["rows"]:
        per_rank = ", ".join(_size(r["file_bytes"]) for r in row["per_rank"])
        payload = sum(r["payload_bytes"] or 0 for r in row["per_rank"])
        lines.append(f"| {row['case']} | {row['ranks']} | {row['save_median_s']:.3f} ({min(row['save_s']):.3f}–"
                     f"{max(row['save_s']):.3f}) | {row['load_median_s']:.3f} ({min(row['load_s']):.3f}–{max(row['load_s']):.3f}) "
                     f"| {per_rank} | {_size(payload)} | {_size(row['total_bytes'])} "
                     f"| {row['total_bytes'] / row['save_median_s'] / 1e9:.2f} | {'yes' if row['restored_identical'] else 'NO'} |")
        if "real_model_bytes_per_rank" in row:
            notes.append(f"The real model of {row['case']} under the same plan would save "
                         + ", ".join(_size(b) for b in row["real_model_bytes_per_rank"])
                         + " per rank (fp32 weights and AdamW's two moments, from the profile's param_bytes).")
    lines += ["", "Payload: the tensors of the ranks' shares (parameters, AdamW's two moments and step, the RNG "
                  "state); DCP's files add a torch.save record per tensor. The replayed profile's layers hold one "
                  "small weight vector each (octorun/replay.py), not the profile's param_bytes: its row measures "
                  "the replay's state, not the real model's. Each row: one job saving after each of its steps "
                  "(keep 2: a save also prunes the oldest), then jobs that restore the last checkpoint and train "
                  "no further step; a job's time is its slowest rank's. The first save of a process also pays "
                  "DCP's first-call set-up.", *notes]
    return "\n".join(lines)


def _size(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


# ---------------------------------------------------------------------------------------------
# 3. Soak
# ---------------------------------------------------------------------------------------------


RSS_LIMIT = 0.05  # resident memory after warm-up may move this much (relative range)


def bench_soak(out: str | Path, sizes: Sizes, *, source: str = SOURCE, steps: int | None = None) -> dict[str, Any]:
    """The trainer (bf16, AdamW, clipping, metrics, --activation-memory for the meter's counts)
    for ``steps`` steps on the replayed tuned plan."""
    out = Path(out) / "soak"
    steps = steps or sizes.soak_steps
    plan = tuned_replay_plan(source, Path(out).parent / f"tuned-{sizes.gpus}.yaml", gpus=sizes.gpus,
                             microbatches=sizes.microbatches, max_plans=sizes.tune_max_plans, quick=sizes.tune_quick)
    job = TrainJob("soak", trainer_config(plan, steps=steps, folder=out, name="soak", variant=VARIANTS["full"],
                                          replay_scale=sizes.soak_scale, activation_memory=True))
    began = time.monotonic()
    records = run_jobs(sizes.gpus, [job], out, timeout_s=max(900.0, 5.0 * steps))["soak"]
    return soak_summary(records, warmup=sizes.soak_warmup, window=sizes.soak_window) | {
        "plan": str(plan), "replay_scale": sizes.soak_scale, "steps": steps, "wall_s": round(time.monotonic() - began, 1)}


def soak_summary(records: list[dict], *, warmup: int, window: int) -> dict[str, Any]:
    """Memory, time and message figures of a soak's per-rank records (see :func:`bench_soak`)."""
    series = _step_series(records, warmup)
    step_ms = series["step_ms"]
    window = min(window, len(step_ms) // 2)
    first, last = statistics.median(step_ms[:window]), statistics.median(step_ms[-window:])
    memory = []
    for r in records:
        rss = r["rss_kb"][warmup:]
        memory.append({"rank": r["rank"], "first_mb": round(rss[0] / 1024, 1), "last_mb": round(rss[-1] / 1024, 1),
                       "max_mb": round(max(rss) / 1024, 1), "range": _round(relative_range(rss)),
                       "slope_kb_per_100_steps": round(100 * slope_per_step(rss), 1)})
    messages = [r["messages"] | {"rank": r["rank"]} for r in records]
    accounted = all(m["sent"] == m["expected_sent"] and m["received"] == m["taken"] == m["expected_received"]
                    and m["sends_pending"] == 0 and m["unclaimed"] == 0 and m["receivers_running"] == 0
                    and m["receiver_errors"] == 0 and m.get("meter_message_bytes", 0) == 0 and m.get("meter_tape_bytes", 0) == 0
                    for m in messages)
    return {
        "warmup": warmup, "window": window, "timed_steps": len(step_ms),
        "step_ms": {"first_window_median": round(first, 3), "last_window_median": round(last, 3),
                    "change": _round(last / first - 1), "slope_ms_per_100_steps": round(100 * slope_per_step(step_ms), 3),
                    "median": round(statistics.median(step_ms), 3)},
        "rss": memory, "rss_flat": all(m["range"] <= RSS_LIMIT for m in memory),
        "messages": messages, "messages_accounted": accounted,
        "sent_total": sum(m["sent"] for m in messages), "received_total": sum(m["received"] for m in messages),
        **_peak_summary(records[0]["metrics"]),
    }


def _peak_summary(metrics: list[dict]) -> dict[str, Any]:
    """The meter's per-step peaks (``--activation-memory``), per pipeline rank, from step 1 on
    (step 0 also carries the layout headers). The tapes' peak is a function of the plan: the
    same every step. The peak with messages also counts the messages that arrived before their
    op needed them, which depends on timing: it may move by a message or two from step to step,
    but a leak would make it grow past anything the early steps saw: the median of the second
    half of the steps must not exceed the largest value of the first half."""
    tapes = [tuple(m["peak_activation_bytes"]) for m in metrics[1:] if m.get("peak_activation_bytes") is not None]
    with_messages = [m["peak_with_message_bytes"] for m in metrics[1:] if m.get("peak_with_message_bytes") is not None]
    if not tapes or not with_messages:
        return {}
    half = len(with_messages) // 2
    per_rank = list(zip(*with_messages))
    return {
        "tape_peak_steady": len(set(tapes)) == 1, "tape_peak_bytes": list(tapes[-1]),
        "message_peak_min_bytes": [min(series) for series in per_rank],
        "message_peak_max_bytes": [max(series) for series in per_rank],
        "message_peak_not_growing": all(statistics.median(series[half:]) <= max(series[:half]) for series in per_rank)
        if half else True,
    }


def soak_table(result: dict[str, Any]) -> str:
    t = result["step_ms"]
    lines = [f"{result['steps']} steps, --replay {result['replay_scale']:g}, bf16 + AdamW + --grad-clip + --metrics + "
             f"--activation-memory; {result['warmup']} warm-up steps dropped, windows of {result['window']} steps.",
             "",
             f"step_ms: first window median {t['first_window_median']:.1f}, last {t['last_window_median']:.1f} "
             f"({100 * t['change']:+.2f}%), least-squares slope {t['slope_ms_per_100_steps']:+.2f} ms per 100 steps "
             f"(median {t['median']:.1f} ms).",
             "",
             "| rank | VmRSS after warm-up MB | at the end MB | max MB | range | slope KB / 100 steps "
             "| sent (expected) | received = taken (expected) | left at the end |",
             "|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for mem, msg in zip(result["rss"], result["messages"]):
        left = (f"{msg['sends_pending']} sends, {msg['unclaimed']} unclaimed, {msg['receivers_running']} receivers, "
                f"{msg.get('meter_message_bytes', 0)} B")
        lines.append(f"| {mem['rank']} | {mem['first_mb']:.1f} | {mem['last_mb']:.1f} | {mem['max_mb']:.1f} "
                     f"| {100 * mem['range']:.2f}% | {mem['slope_kb_per_100_steps']:+.1f} "
                     f"| {msg['sent']} ({msg['expected_sent']}) | {msg['received']} = {msg['taken']} ({msg['expected_received']}) "
                     f"| {left} |")
    lines += ["", f"Memory flat within {100 * RSS_LIMIT:.0f}%: {'yes' if result['rss_flat'] else 'NO'}; every message "
                  f"accounted for: {'yes' if result['messages_accounted'] else 'NO'} ({result['sent_total']} sent, "
                  f"{result['received_total']} received)."]
    if "tape_peak_steady" in result:
        lines += ["", "--activation-memory, per rank from step 1 on: the tapes' peak "
                      + ("the same every step (" if result["tape_peak_steady"] else "NOT the same every step (last: ")
                      + ", ".join(_size(b) for b in result["tape_peak_bytes"]) + "); tapes and messages "
                      + ", ".join(f"{_size(lo)}–{_size(hi)}" for lo, hi in zip(result["message_peak_min_bytes"],
                                                                            result["message_peak_max_bytes"]))
                      + (", not growing (the second half's median at most the first half's largest)" if result["message_peak_not_growing"]
                         else ", GROWING") + ": messages that arrive before their op needs them move it by a message or two."]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def report(results: dict[str, Any]) -> str:
    nice = results.get("args", {}).get("nice")
    parts = [f"bench_training ({results.get('started', '')}, load average {results.get('load_average', '?')}"
             + ("" if nice is None else f", ranks at nice {nice}") + ")"]
    if "overhead" in results:
        parts.append("## Overhead per step\n\n" + overhead_table(results["overhead"]))
    if "checkpoints" in results:
        parts.append("## Checkpoints\n\n" + checkpoints_table(results["checkpoints"]))
    if "soak" in results:
        parts.append("## Soak\n\n" + soak_table(results["soak"]))
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bench", choices=["overhead", "checkpoints", "soak", "all", "report"],
                        help="report: print the tables of an earlier run's JSON (OUT/BENCH.json, or --json)")
    parser.add_argument("--json", help="with report: the results file")
    parser.add_argument("--quick", action="store_true", help="the smoke test's sizes: 4 ranks, a few steps")
    parser.add_argument("--source", default=SOURCE, help="the profile replayed in the overhead and soak parts")
    parser.add_argument("--rounds", type=int, help="overhead: interleaved rounds (default 6, quick 2)")
    parser.add_argument("--variants", default="plain,full",
                        help=f"overhead: comma-separated, the first is the base (of {', '.join(VARIANTS)})")
    parser.add_argument("--steps", type=int, help="soak: steps (default 300, quick 40)")
    parser.add_argument("--large", help="checkpoints: the examples also run at GPU size, comma-separated "
                        f"(default tiny_gpt, quick none; of {', '.join(LARGE_SHORT)}; 'none')")
    parser.add_argument("--nice", type=int, help="run the measured processes at this nice value (e.g. -10; needs root)")
    parser.add_argument("--out", default="out/bench-training")
    args = parser.parse_args(argv)
    global NICE
    NICE = args.nice
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("octoplan.tuner").setLevel(logging.WARNING)
    out = Path(args.out)
    if args.bench == "report":
        print(report(json.loads(Path(args.json or out / "all.json").read_text())))
        return 0
    sizes = QUICK if args.quick else FULL
    if args.rounds:
        sizes = replace(sizes, rounds=args.rounds)
    if args.large is not None:
        large = tuple(m.strip() for m in args.large.split(",") if m.strip() and m.strip() != "none")
        if any(m not in LARGE_SHORT for m in large):
            parser.error(f"--large: give names of {', '.join(LARGE_SHORT)}, or none")
        sizes = replace(sizes, large_models=large)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or len(variants) < 2:
        parser.error(f"--variants: give two or more of {', '.join(VARIANTS)} (unknown: {', '.join(unknown) or 'none'})")
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                               "load_average": round(os.getloadavg()[0], 2), "sizes": vars(sizes),
                               "args": vars(args)}
    if args.bench in ("overhead", "all"):
        results["overhead"] = bench_overhead(out, sizes, variants=variants, source=args.source)
    if args.bench in ("checkpoints", "all"):
        results["checkpoints"] = bench_checkpoints(out, sizes, source=args.source)
    if args.bench in ("soak", "all"):
        results["soak"] = bench_soak(out, sizes, source=args.source, steps=args.steps)
    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    (out / f"{args.bench}.json").write_text(json.dumps(results, indent=2))
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
