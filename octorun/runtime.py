"""The octorun interpreter: trains a plan's model with torch.distributed, one process per GPU.

Each process finds its (pp_rank, dp_rank) from the plan, builds only the layers of its own
stages (seeded per SPEC section 4), and runs its pipeline rank's lowered program
(:mod:`octorun.lowering`) op by op: before an op it takes the messages the op needs from the
mailbox, after it it starts the sends; adjacent stages on one rank hand values over directly.
With dp > 1, a stage's gradient all-reduce starts right after its last weight-gradient op and is
waited for only before the optimizer step. Every wait has a deadline (:mod:`octorun.watchdog`).

Assumptions: the launcher (torchrun) sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT; without them octorun runs as a single process. The loss of the last stage is scaled
by 1 / (microbatches * dp), so the summed gradients are those of the mean loss and the data-
parallel all-reduce is a plain SUM.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import socket
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from octoplan.costs import LayerTable, op_ms, plan_stage_costs
from octoplan.errors import InputError
from octoplan.modelfile import ModelFile, as_args, load_model_file, microbatch_seed
from octoplan.ops import Kind, Op
from octoplan.outputs import StreamedOutput, check_distinct, check_writable, partial_path, write_text
from octoplan.plan import (MAX_GPUS, MAX_MICROBATCHES, Plan, load_plan, load_plan_profile, plan_microbatch_size,
                           resolve_profile_path, resolve_written_path)
from octoplan.validate import check_runnable
from octorun.comm import RECEIVE_LAST_RESORT, Channel, SendFailed, Transport, wait_work
from octorun.lowering import ACT, Lowered, Message, RankProgram, lower
from octorun.native_stderr import native_stderr_held
from octorun.activations import ActivationMeter
from octorun.stage import StageExecutor, Tape
from octorun.watchdog import EXIT_BAD_INPUT, Watchdog, gist

__all__ = ["RunConfig", "StepMetrics", "RunResult", "Prepared", "prepare", "run", "summarize_step", "LaunchError",
           "LAUNCH_VARIABLES", "OPTIMIZERS"]

log = logging.getLogger(__name__)

OPTIMIZERS = ("sgd", "adamw")
# Far beyond any run of one octorun job, small enough that a typo is caught (a job of 10**20
# steps would only ever end by being killed)
MAX_STEPS = 10**7
# The largest --seed whose every microbatch seed (SPEC section 4) stays a signed 64-bit integer,
# at the last step, replica and microbatch these limits allow
MAX_SEED = ((2**63 - 1 - microbatch_seed(seed=0, step=MAX_STEPS - 1, replica=MAX_GPUS - 1, mb=MAX_MICROBATCHES - 1))
            // microbatch_seed(seed=1, step=0, replica=0, mb=0))


@dataclass(frozen=True)
class RunConfig:
    plan_path: str
    steps: int = 1
    seed: int = 0
    optimizer: str = "sgd"
    lr: float = 1e-3
    metrics_path: str | None = None
    trace_path: str | None = None
    timeout_s: float = 300.0
    backend: str = "auto"  # auto: nccl when CUDA is available, else gloo
    replay_time_scale: float | None = None  # run the plan's profile through the replay model
    dynamic_shapes: bool = False  # send every message's layout every step, not only in step 0
    activation_memory: bool = False  # count the activation bytes the tapes hold (octorun.activations)


class LaunchError(RuntimeError):
    """The processes could not start the job together (not bad input: exit 1)."""


@dataclass(frozen=True)
class StepMetrics:
    step: int
    loss: float  # mean over all microbatches of all replicas
    iteration_ms: float  # first op start to last op end, or to the last gradient all-reduce's end when
    # dp > 1: the span the simulator's iteration_ms predicts (SPEC section 7, docs/SPEC_ADDITIONS.md)
    step_ms: float  # the whole step on the slowest rank: ops, waits, all-reduce, optimizer
    bubble_ratio: float  # 1 - busy compute time / (ranks x iteration_ms)
    predicted_iteration_ms: float | None = None
    # with --activation-memory: per pipeline rank, the most activation bytes its tapes held at
    # once (the same on every replica), and the plan's prediction of it where the plan has one
    peak_activation_bytes: tuple[int, ...] | None = None
    predicted_peak_activation_bytes: tuple[int, ...] | None = None
    # and the most that tapes and the transport's messages held together (octorun.activations),
    # which the simulator's peak_memory_bytes less the static bytes predicts
    peak_with_message_bytes: tuple[int, ...] | None = None
    predicted_peak_with_message_bytes: tuple[int, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {
            "step": self.step,
            "loss": self.loss,
            "iteration_ms": round(self.iteration_ms, 4),
            "step_ms": round(self.step_ms, 4),
            "bubble_ratio": round(self.bubble_ratio, 6),
        }
        if self.predicted_iteration_ms is not None:
            out["predicted_iteration_ms"] = self.predicted_iteration_ms
        if self.peak_activation_bytes is not None:
            out["peak_activation_bytes"] = list(self.peak_activation_bytes)
        for name in ("predicted_peak_activation_bytes", "peak_with_message_bytes", "predicted_peak_with_message_bytes"):
            if getattr(self, name) is not None:
                out[name] = list(getattr(self, name))
        return out


@dataclass(frozen=True)
class RunResult:
    """What one process returns. ``metrics`` is filled on global rank 0 only."""

    global_rank: int
    pp_rank: int
    dp_rank: int
    metrics: tuple[StepMetrics, ...]
    state: dict[int, dict[str, torch.Tensor]]  # layer index -> its state_dict on CPU (own stages)


@dataclass(frozen=True)
class Prepared:
    """Everything read from files and derived from the plan before any process group exists."""

    plan: Plan
    plan_path: str
    model: ModelFile
    microbatch_size: int
    lowered: Lowered


def prepare(config: RunConfig) -> Prepared:
    """Read and check the plan, its profile and its model file; lower the plan.

    Raises :class:`InputError` for anything the user must fix.
    """
    if config.optimizer not in OPTIMIZERS:
        raise InputError(None, "--optimizer", f"is {config.optimizer!r}", f"use one of {', '.join(OPTIMIZERS)}")
    if not 1 <= config.steps <= MAX_STEPS:
        raise InputError(None, "--steps", f"is {config.steps}", f"train 1 to {MAX_STEPS} steps")
    if not (math.isfinite(config.timeout_s) and config.timeout_s > 0):
        raise InputError(None, "--timeout", f"is {config.timeout_s}", "give a positive number of seconds")
    if not (math.isfinite(config.lr) and config.lr >= 0):
        raise InputError(None, "--lr", f"is {config.lr}", "give a learning rate >= 0")
    if not 0 <= config.seed <= MAX_SEED:
        raise InputError(None, "--seed", f"is {config.seed}", f"give a seed from 0 to {MAX_SEED}")
    for flag, path in (("--metrics", config.metrics_path), ("--trace", config.trace_path)):
        if path and Path(path).is_dir():
            raise InputError(path, None, f"{flag} names a folder", "give a file path")
    if config.replay_time_scale is not None and not (math.isfinite(config.replay_time_scale) and config.replay_time_scale >= 0):
        raise InputError(None, "--replay", f"is {config.replay_time_scale}", "give a finite time scale >= 0")
    plan = load_plan(config.plan_path)
    # a replay first: where the plan's profile is gone, it says that --replay needs it
    replayed = _replay_model(plan, config) if config.replay_time_scale is not None else None
    microbatch_size = plan_microbatch_size(plan, config.plan_path)
    check_runnable(plan, file=config.plan_path)
    if replayed is not None:
        model = replayed
    else:
        model = load_model_file(_model_path(plan, config.plan_path), plan.model.config, seed=config.seed)
    num_layers = model.num_layers()
    if plan.stages[-1].end != num_layers:
        raise InputError(config.plan_path, "stages", f"cover {plan.stages[-1].end} layers but {model.path} has {num_layers}",
                         "re-plan from a profile of this model file")
    # --metrics grows as METRICS.partial first (octoplan.outputs.StreamedOutput): that file
    # is an output too
    partial = partial_path(config.metrics_path) if config.metrics_path else None
    check_distinct({"--metrics": config.metrics_path, "--metrics (while it is written)": partial,
                    "--trace": config.trace_path})
    # the files the job reads, which no output may overwrite (the model file too)
    inputs = (config.plan_path, resolve_profile_path(plan, config.plan_path),
              None if config.replay_time_scale is not None else model.path)
    for flag, path in (("--metrics", config.metrics_path), ("--metrics (while it is written)", partial),
                       ("--trace", config.trace_path)):
        if path:  # last: a file is created only once everything else is known to be good
            check_writable(path, flag, inputs=inputs)
    return Prepared(plan=plan, plan_path=config.plan_path, model=model,
                    microbatch_size=microbatch_size, lowered=lower(plan))




def _replay_model(plan: Plan, config: RunConfig) -> ModelFile:
    """The replay model of the plan's own profile: every op sleeps its profiled time (scaled),
    so CPU processes emulate the plan's GPUs — for plans of models too large to run here."""
    from octorun import replay

    profile_path = resolve_profile_path(plan, config.plan_path)
    if profile_path is None:
        problem = f"profile {plan.profile!r} not found" if plan.profile else "is missing"
        raise InputError(config.plan_path, "profile", problem, "--replay needs the plan's profile")
    profile = load_plan_profile(plan, config.plan_path)  # the hash and layer count must still match
    # a replayed op sleeps its profiled time x scale; one longer than --timeout would trip the
    # watchdog of every process waiting on it, blaming a wait instead of the scale
    costs = plan_stage_costs(plan, LayerTable(profile))
    longest_s = max(op_ms(costs[op.stage], op.kind) for ops in plan.schedule for op in ops) * config.replay_time_scale / 1000
    if longest_s >= config.timeout_s:
        raise InputError(None, "--replay", f"{config.replay_time_scale:g} makes the longest op sleep {longest_s:.3g} s, "
                         f"not under --timeout {config.timeout_s:g} s", "use a smaller scale or a longer --timeout")
    return load_model_file(replay.__file__, {"profile": str(profile_path), "time_scale": config.replay_time_scale}, seed=config.seed)


def _model_path(plan: Plan, plan_path: str) -> str:
    source = plan.model.source
    if not source:
        raise InputError(plan_path, "model.source", "is missing: an analytic plan has no model to train",
                         "plan from a profile made by octoplan profile MODEL.py")
    found = resolve_written_path(source, plan_path)
    if found is not None:
        return str(found)
    raise InputError(plan_path, "model.source", f"model file {source!r} not found", "run from the project folder or fix the path")


# ---------------------------------------------------------------------------------------------
# Process group and channels
# ---------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ensure_env() -> None:
    """Without torchrun, run as a world of one."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


LAUNCH_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR")


def _check_env(plan: Plan, plan_path: str) -> int:
    """The launcher's variables, read before torch.distributed would fail on them with a
    traceback or wait for peers that cannot exist; returns WORLD_SIZE."""
    fix = "launch with torchrun, or leave RANK and WORLD_SIZE unset to run one process"

    def whole(name: str, low: int, high: int) -> int:
        text = os.environ.get(name)
        if text is None:
            raise InputError(None, name, "is not set", fix)
        try:
            value = int(text)
        except ValueError:
            raise InputError(None, name, f"is {text!r}, not a whole number", fix) from None
        if not low <= value <= high:
            raise InputError(None, name, f"is {value}, outside {low}..{high}", fix)
        return value

    world = whole("WORLD_SIZE", 1, MAX_GPUS)
    if world != plan.cluster.gpus:
        raise InputError(
            plan_path, "cluster.gpus",
            f"the plan needs {plan.cluster.gpus} processes (pp {plan.pp} x dp {plan.parallel.dp}) but WORLD_SIZE is {world}",
            f"launch with torchrun --nproc-per-node {plan.cluster.gpus}",
        )
    whole("RANK", 0, world - 1)
    if "LOCAL_RANK" in os.environ:
        whole("LOCAL_RANK", 0, world - 1)
    whole("MASTER_PORT", 1, 65535)
    if not os.environ.get("MASTER_ADDR"):
        raise InputError(None, "MASTER_ADDR", "is not set", fix)
    return world


@dataclass
class _Groups:
    outgoing: dict[int, Channel]
    incoming: dict[int, Channel]
    dp_group: Any
    control: Any  # gloo group over the world: barriers, gathers of metrics and traces
    store: Any


def _make_groups(prepared: Prepared, *, backend: str, timeout: datetime.timedelta) -> _Groups:
    """Create every group in the same order on every process (new_group is collective)."""
    parallel = prepared.plan.parallel
    me = dist.get_rank()
    pp_rank, dp_rank = parallel.coordinates(me)
    program = prepared.lowered.programs[pp_rank]
    outgoing: dict[int, Channel] = {}
    incoming: dict[int, Channel] = {}
    # Forming a channel waits for its peer this long at most; past the deadline the compute
    # thread enforces, so a failure names the op that waits, not a thread.
    channel_timeout = timeout * 2 + datetime.timedelta(seconds=30)
    for dp in range(parallel.dp):
        for src_pp, dst_pp in prepared.lowered.channels:
            src, dst = parallel.global_rank(src_pp, dp), parallel.global_rank(dst_pp, dp)
            data = dist.new_group([src, dst], timeout=channel_timeout, backend=backend)
            meta = data if backend == "gloo" else dist.new_group([src, dst], timeout=channel_timeout, backend="gloo")
            if me == src:
                outgoing[dst] = Channel(src, dst, data, meta, program.outgoing[dst_pp])
            elif me == dst:
                incoming[src] = Channel(src, dst, data, meta, program.incoming[src_pp])
    dp_group = None
    if parallel.dp > 1:
        for pp in range(parallel.pp):
            group = dist.new_group([parallel.global_rank(pp, d) for d in range(parallel.dp)], timeout=timeout, backend=backend)
            if pp == pp_rank:
                dp_group = group
    if backend == "nccl":
        for channel in incoming.values():
            _unbounded_receives(channel.data_group)
    control = None if backend == "gloo" else dist.new_group(timeout=timeout, backend="gloo")
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # private API: without it the watchdog still has its deadlines
        store = None
    return _Groups(outgoing=outgoing, incoming=incoming, dp_group=dp_group, control=control, store=store)


def _unbounded_receives(group: Any) -> None:
    """Lift a connected channel group's timeout to :data:`RECEIVE_LAST_RESORT`, as each
    receive's own wait does (octorun.comm): NCCL's watchdog would otherwise abort a receive
    posted ahead of need once the group's timeout passed. The group is created with a finite
    one, so that forming it still fails in time when a peer is gone."""
    try:
        dist.distributed_c10d._set_pg_timeout(RECEIVE_LAST_RESORT, group)
    except Exception as exc:  # private API: gloo's receives do not need it
        log.debug("could not lift a channel's timeout: %s", exc)


# ---------------------------------------------------------------------------------------------
# The interpreter
# ---------------------------------------------------------------------------------------------


@dataclass
class _StepState:
    inputs: dict[tuple[int, int], Any] = field(default_factory=dict)  # (stage, mb) -> stage input
    targets: dict[int, Any] = field(default_factory=dict)  # mb -> targets (last stage)
    grads: dict[tuple[int, int], tuple[torch.Tensor, ...]] = field(default_factory=dict)  # output grads
    tapes: dict[tuple[int, int], Tape] = field(default_factory=dict)
    losses: list[torch.Tensor] = field(default_factory=list)


class _Timer:
    """Per-op start/end times in seconds since the step's aligned start (CUDA events on GPU)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.spans: list[tuple[Op, Any, Any]] = []
        self.origin: Any = None
        self.origin_host = 0.0

    def begin_step(self) -> None:
        self.spans = []
        self.origin_host = time.perf_counter()
        if self.cuda:
            self.origin = torch.cuda.Event(enable_timing=True)
            self.origin.record()

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter() - self.origin_host

    def add(self, op: Op, start: Any, end: Any) -> None:
        self.spans.append((op, start, end))

    def resolve(self) -> list[tuple[Op, float, float]]:
        if self.cuda:
            torch.cuda.synchronize()
        return [(op, self._elapsed(s), self._elapsed(e)) for op, s, e in self.spans]

    def seconds(self, mark: Any) -> float:
        """One :meth:`mark` as seconds since the step's start."""
        if self.cuda:
            torch.cuda.synchronize()
        return self._elapsed(mark)

    def _elapsed(self, mark: Any) -> float:
        return self.origin.elapsed_time(mark) / 1e3 if self.cuda else mark


class _Interpreter:
    def __init__(self, prepared: Prepared, config: RunConfig, *, groups: _Groups, watchdog: Watchdog,
                 device: torch.device, model: ModelFile):
        self.plan = prepared.plan
        self.config = config
        self.mbs = prepared.microbatch_size
        self.groups = groups
        self.watchdog = watchdog
        self.device = device
        self.model = model
        self.me = dist.get_rank()
        self.world = dist.get_world_size()
        self.pp_rank, self.dp_rank = self.plan.parallel.coordinates(self.me)
        self.program: RankProgram = prepared.lowered.programs[self.pp_rank]
        self.rank_of = [stage.rank for stage in self.plan.stages]
        self.last_stage = self.plan.num_stages - 1
        self.layers: dict[int, torch.nn.Module] = {}
        self.executors: dict[int, StageExecutor] = {}
        scale = 1.0 / (self.plan.microbatches * self.plan.parallel.dp)
        built: dict[int, list[torch.nn.Module]] = {}
        for s in self.program.stages:
            built[s] = []
            for index in self.plan.stages[s].layers:
                self.watchdog.doing(f"building layer {index}")
                built[s].append(model.build_layer(index).to(device))
                self.layers[index] = built[s][-1]
        self.meter = ActivationMeter(t for layer in self.layers.values() for t in (*layer.parameters(), *layer.buffers())) \
            if config.activation_memory else None
        for s, mods in built.items():
            stage = self.plan.stages[s]
            self.executors[s] = StageExecutor(mods, first=s == 0, last=s == self.last_stage,
                                              loss_fn=model.loss, loss_scale=scale, recompute=stage.recompute,
                                              recompute_layers=stage.recompute_layers, meter=self.meter)
        params = _unique_trainable(self.layers.values())
        self.optimizer: torch.optim.Optimizer | None = None  # a rank of parameterless layers has none
        if params and config.optimizer == "sgd":
            self.optimizer = torch.optim.SGD(params, lr=config.lr, momentum=0, weight_decay=0)
        elif params:
            self.optimizer = torch.optim.AdamW(params, lr=config.lr)
        self.transport = Transport(outgoing=groups.outgoing, incoming=groups.incoming, device=device,
                                   steps=config.steps, timeout_s=config.timeout_s, static_shapes=not config.dynamic_shapes,
                                   meter=self.meter)
        self.timer = _Timer(device)

    # -- helpers ------------------------------------------------------------------------------
    def _global(self, pp_rank: int) -> int:
        return self.plan.parallel.global_rank(pp_rank, self.dp_rank)

    def _where(self) -> str:
        return f"(pp rank {self.pp_rank}, dp rank {self.dp_rank})"

    def _to_device(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to(self.device)
        if isinstance(value, (tuple, list)):
            return type(value)(self._to_device(v) for v in value)
        return value

    def _control_barrier(self, what: str) -> None:
        self.watchdog.doing(what)
        try:
            dist.barrier(group=self.groups.control)
        except Exception as exc:
            self.watchdog.fail(f"{what}: {gist(exc)}")

    # -- one step -----------------------------------------------------------------------------
    def step(self, step: int) -> dict[str, Any]:
        state = _StepState()
        stages = set(self.program.stages)
        self.watchdog.doing(f"sampling the batches of step {step}")
        for mb in range(self.plan.microbatches):
            if 0 in stages or self.last_stage in stages:
                inputs, targets = self.model.sample_batch(self.mbs, step=step, replica=self.dp_rank, mb=mb)
                if 0 in stages:
                    state.inputs[(0, mb)] = self._to_device(inputs)
                if self.last_stage in stages:
                    state.targets[mb] = self._to_device(targets)
        self._control_barrier(f"waiting at the barrier before step {step}")
        started = time.perf_counter()
        if self.meter is not None:
            self.meter.reset()
        self.timer.begin_step()
        reductions: list[tuple[Any, torch.Tensor, list[torch.Tensor], int]] = []
        for instr in self.program.instrs:
            op = instr.op
            self.watchdog.doing(f"letting go of the sends before op {op} of step {step}")
            self._check_sends(step, self.transport.begin_op, self.watchdog.deadline())
            # the received messages' holds in the meter: each stays until its op has run (an
            # F's input is its tape's by then, a gradient the backward's to read until it ends)
            reading = [hold for message in instr.recvs for hold in self._receive(step, op, message, state)]
            self.watchdog.doing(f"running op {op} of step {step}")
            begin = self.timer.mark()
            try:
                outgoing = self._run_op(op, state)
            except InputError as exc:  # the model file's fault (a loss that is not a scalar ...)
                self.watchdog.fail(f"op {op} of step {step}: {exc.line()}", code=EXIT_BAD_INPUT)
            except Exception as exc:
                self.watchdog.fail(f"op {op} of step {step} raised {gist(exc)}")
            self.timer.add(op, begin, self.timer.mark())
            del reading
            for message in instr.sends:
                try:
                    self.transport.send(message, outgoing, dst=self._global(message.dst), step=step)
                except (TypeError, ValueError) as exc:  # a dtype gloo cannot send, a shape that changed
                    self.watchdog.fail(f"op {op} of step {step}: {exc}")
            if instr.allreduce_stage is not None and self.groups.dp_group is not None:
                started_reduction = self._start_allreduce(instr.allreduce_stage)
                if started_reduction is not None:
                    reductions.append(started_reduction)
        deadline = self.watchdog.deadline()
        self.watchdog.doing(f"waiting for the sends of step {step} to complete")
        self._check_sends(step, self.transport.wait_sends, deadline)
        for work, flat, grads, stage in reductions:
            self.watchdog.doing(f"waiting for the gradient all-reduce of stage {stage}, step {step}")
            try:
                finished = wait_work(work, max(deadline - time.monotonic(), 0.001), polled=self.device.type == "cuda")
            except RuntimeError as exc:
                self.watchdog.fail(f"gradient all-reduce of stage {stage}, step {step}, failed: {gist(exc)}")
            if not finished:
                self.watchdog.fail(f"gradient all-reduce of stage {stage}, step {step}, "
                                   f"did not finish within {self.config.timeout_s:g} s")
            for grad, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                grad.copy_(reduced)
        # when the last all-reduce was seen done: the simulator's iteration ends there too
        reduced_at = self.timer.mark() if reductions else None
        self.watchdog.doing(f"running the optimizer of step {step}")
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        spans = self.timer.resolve()
        step_s = time.perf_counter() - started
        loss_sum = float(sum(loss.item() for loss in state.losses))
        return {
            "rank": self.me, "pp_rank": self.pp_rank, "dp_rank": self.dp_rank,
            "loss_sum": loss_sum, "loss_count": len(state.losses), "step_s": step_s,
            "spans": [(op.stage, op.kind.value, op.mb, start, end) for op, start, end in spans],
            "reduced_s": None if reduced_at is None else self.timer.seconds(reduced_at),
            "origin_s": self.timer.origin_host, "host": socket.gethostname(),
            "peak_activation_bytes": None if self.meter is None else self.meter.peak,
            "peak_with_message_bytes": None if self.meter is None else self.meter.peak_with_messages,
        }

    def _check_sends(self, step: int, wait, deadline: float) -> None:
        """``wait(deadline=deadline)``, a wait of the transport's for sends; a send it reports
        late or failed ends the job."""
        try:
            late = wait(deadline=deadline)
        except SendFailed as exc:  # a peer that died closed the connection: not a timeout
            self.watchdog.fail(f"step {step}: {exc} (global rank {self._global(exc.message.dst)})")
        if late is not None:
            self.watchdog.fail(f"step {step}: the send of the {late} (global rank {self._global(late.dst)}) "
                               f"did not complete within {self.config.timeout_s:g} s")

    def _receive(self, step: int, op: Op, message: Message, state: _StepState) -> list:
        """Take ``message`` for ``op`` into the step's state; returns its holds in the meter."""
        src = self._global(message.src)
        self.watchdog.doing(f"op {op} of step {step} waiting for the {message} (global rank {src})")
        try:
            value, holds = self.transport.mailbox.take(step, message, src=src, deadline=self.watchdog.deadline())
        except TimeoutError:
            self.watchdog.fail(
                f"op {op} of step {step} waited {self.config.timeout_s:g} s for the {message} (global rank {src}) {self._where()}"
            )
        except ConnectionError as exc:
            self.watchdog.fail(f"op {op} of step {step} cannot receive the {message} (global rank {src}): {exc}")
        if message.kind == ACT:
            state.inputs[(message.stage, message.mb)] = value[0] if len(value) == 1 else value
        else:
            state.grads[(message.stage, message.mb)] = value
        return holds

    def _run_op(self, op: Op, state: _StepState) -> tuple[torch.Tensor, ...]:
        """Run one compute op; returns the tensors its sends carry (if any)."""
        executor = self.executors[op.stage]
        key = (op.stage, op.mb)
        if op.kind is Kind.F:
            targets = state.targets.pop(op.mb) if op.stage == self.last_stage else None
            output, tape = executor.forward(state.inputs.pop(key), targets)
            state.tapes[key] = tape
            if tape.loss is not None:
                state.losses.append(tape.loss)
                return ()
            if op.stage + 1 <= self.last_stage and self.rank_of[op.stage + 1] == self.pp_rank:
                state.inputs[(op.stage + 1, op.mb)] = output
            return tuple(as_args(output))
        if op.kind is Kind.W:
            executor.backward_weight(state.tapes.pop(key))
            return ()
        grad_output = None if op.stage == self.last_stage else state.grads.pop(key)
        if op.kind is Kind.I:
            grads = executor.backward_input(state.tapes[key], grad_output)
        else:
            grads = executor.backward(state.tapes.pop(key), grad_output)
        if op.stage > 0 and self.rank_of[op.stage - 1] == self.pp_rank:
            state.grads[(op.stage - 1, op.mb)] = grads
        return grads

    def _start_allreduce(self, stage: int) -> tuple[Any, torch.Tensor, list[torch.Tensor], int] | None:
        """Start the stage's gradient all-reduce; None for a stage without trainable parameters,
        which has nothing to reduce (every replica holds the same layers, so all skip it alike,
        and the simulator prices it at nothing)."""
        grads = []
        for layer_index in self.plan.stages[stage].layers:
            for param in self.layers[layer_index].parameters():
                if not param.requires_grad:
                    continue
                if param.grad is None:  # keep the flat layout identical on every replica
                    param.grad = torch.zeros_like(param)
                grads.append(param.grad)
        if not grads:
            return None
        flat = torch._utils._flatten_dense_tensors(grads)
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.groups.dp_group, async_op=True)
        return work, flat, grads, stage

    # -- the run ------------------------------------------------------------------------------
    def train(self) -> tuple[StepMetrics, ...]:
        self.transport.start()
        metrics: list[StepMetrics] = []
        metrics_file = StreamedOutput(self.config.metrics_path, flag="--metrics") if self.config.metrics_path and self.me == 0 else None
        try:
            for step in range(self.config.steps):
                record = self.step(step)
                self.watchdog.doing(f"gathering the metrics of step {step}")
                gathered = [None] * self.world if self.me == 0 else None
                try:
                    dist.gather_object(record, gathered, dst=0, group=self.groups.control)
                except Exception as exc:
                    self.watchdog.fail(f"gathering the metrics of step {step}: {gist(exc)}")
                if self.me != 0:
                    continue
                _align_clocks(gathered)
                step_metrics = self._summarize(step, gathered)
                metrics.append(step_metrics)
                log.info("step %d loss %.6f iteration %.2f ms", step, step_metrics.loss, step_metrics.iteration_ms)
                if metrics_file:
                    metrics_file.write_line(json.dumps(step_metrics.to_dict()))
                if self.config.trace_path and step == self.config.steps - 1:
                    _write_trace(self.config.trace_path, gathered)
            if metrics_file:
                metrics_file.commit()
        finally:
            if metrics_file:
                metrics_file.close()
        return tuple(metrics)

    def _summarize(self, step: int, records: list[dict[str, Any]]) -> StepMetrics:
        # A replay at another time scale is not the plan's predicted iteration any more.
        scaled = self.config.replay_time_scale not in (None, 1.0)
        predicted = None if scaled else (self.plan.predicted or {}).get("iteration_ms")
        metrics = summarize_step(step, records, predicted if isinstance(predicted, (int, float)) else None)
        if self.meter is None:
            return metrics
        measured, predicted_peaks = {}, {}
        for name in ("peak_activation_bytes", "peak_with_message_bytes"):
            peaks = [0] * self.plan.pp  # per pipeline rank: the most on any replica
            for record in records:
                peaks[record["pp_rank"]] = max(peaks[record["pp_rank"]], record[name])
            measured[name] = tuple(peaks)
            given = (self.plan.predicted or {}).get(name)
            valid = isinstance(given, list) and len(given) == self.plan.pp and all(isinstance(b, int) for b in given)
            predicted_peaks[name] = tuple(given) if valid else None
        return replace(metrics, **measured, **{f"predicted_{name}": value for name, value in predicted_peaks.items()})

    def state(self) -> dict[int, dict[str, torch.Tensor]]:
        return {i: {k: v.detach().cpu().clone() for k, v in layer.state_dict().items()} for i, layer in self.layers.items()}


def _unique_trainable(layers) -> list[torch.nn.Parameter]:
    """The trainable parameters of ``layers``, each once: a module two layers of one rank share
    (a tied embedding and head) would otherwise be stepped twice by the optimizer."""
    return list({id(p): p for layer in layers for p in layer.parameters() if p.requires_grad}.values())


def summarize_step(step: int, records: list[dict[str, Any]], predicted_ms: float | None) -> StepMetrics:
    """One step's metrics from every process's record (clocks already aligned). The iteration
    runs from the first op's start to the last op's end or, with data parallelism, to the end
    of the last gradient all-reduce if later, as the simulator counts it."""
    count = sum(r["loss_count"] for r in records)
    loss = sum(r["loss_sum"] for r in records) / max(count, 1)
    spans = [s for r in records for s in r["spans"]]
    first = min((s[3] for s in spans), default=0.0)
    ends = [s[4] for s in spans] + [r["reduced_s"] for r in records if r.get("reduced_s") is not None]
    iteration_s = max(max(ends, default=0.0) - first, 1e-12)
    busy_s = sum(s[4] - s[3] for s in spans)
    return StepMetrics(
        step=step, loss=loss, iteration_ms=iteration_s * 1e3,
        step_ms=max(r["step_s"] for r in records) * 1e3,
        bubble_ratio=1.0 - busy_s / (len(records) * iteration_s),
        predicted_iteration_ms=None if predicted_ms is None else float(predicted_ms),
    )


def _align_clocks(records: list[dict[str, Any]]) -> None:
    """Put every rank's op times on one clock.

    Each rank times its ops from the moment it left the step's barrier, and ranks leave it a
    few milliseconds apart. On one host ``perf_counter`` is the system's monotonic clock, shared
    by all processes, so each rank's times are shifted by how much later it left the barrier.
    Across hosts the clocks are unrelated and the barrier exit stays the common origin (good to
    about a network latency).
    """
    if len({r["host"] for r in records}) != 1:
        return
    origin = min(r["origin_s"] for r in records)
    for record in records:
        shift = record["origin_s"] - origin
        record["spans"] = [(stage, kind, mb, start + shift, end + shift) for stage, kind, mb, start, end in record["spans"]]
        if record.get("reduced_s") is not None:
            record["reduced_s"] += shift


def _write_trace(path: str, records: list[dict[str, Any]]) -> None:
    """Chrome trace-event JSON of the last step; time 0 is the first op's start."""
    first = min((s[3] for r in records for s in r["spans"]), default=0.0)
    events = []
    for record in sorted(records, key=lambda r: r["rank"]):
        for stage, kind, mb, start, end in record["spans"]:
            events.append({
                "name": f"{stage}{kind}{mb}", "ph": "X", "pid": record["dp_rank"], "tid": record["pp_rank"],
                "ts": round((start - first) * 1e6, 3), "dur": round((end - start) * 1e6, 3), "cat": kind,
                "args": {"stage": stage, "mb": mb, "rank": record["rank"]},
            })
    write_text(path, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}), flag="--trace")


def run(config: RunConfig) -> RunResult:
    """Train ``config.steps`` steps of the plan on this process's share of the job.

    Raises :class:`InputError` for bad input found before training starts. Failures once the job
    runs end the process (and the job) through the watchdog, never with a hang.
    """
    prepared = prepare(config)
    plan = prepared.plan
    _ensure_env()
    world = _check_env(plan, config.plan_path)
    backend = config.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise InputError(None, "--backend", f"is {backend!r}", "use auto, gloo or nccl")
    if backend == "nccl" and not torch.cuda.is_available():
        raise InputError(None, "--backend", "is nccl but this machine has no CUDA device", "use --backend gloo")
    timeout = datetime.timedelta(seconds=config.timeout_s)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    owns_group = not dist.is_initialized()
    if owns_group:
        try:
            with native_stderr_held():
                dist.init_process_group(backend, timeout=timeout)
        except Exception as exc:  # peers that never came, an address in use: one line, not a trace
            raise LaunchError(f"the {world} processes did not form a group within --timeout {config.timeout_s:g} s: "
                              f"{gist(exc)}") from None
    elif dist.get_world_size() != world:
        raise InputError(config.plan_path, "cluster.gpus", "does not match the running process group", "launch a matching job")
    me = dist.get_rank()
    watchdog = Watchdog(global_rank=me, timeout_s=config.timeout_s)
    groups = _make_groups(prepared, backend=backend, timeout=timeout)
    watchdog.store = groups.store
    watchdog.start()
    try:
        interpreter = _Interpreter(prepared, config, groups=groups, watchdog=watchdog, device=device, model=prepared.model)
    except InputError as exc:
        watchdog.fail(exc.line(), code=EXIT_BAD_INPUT)
    except Exception as exc:
        watchdog.fail(f"building the stages failed while {watchdog.activity}: {gist(exc)}")
    try:
        metrics = interpreter.train()
    except InputError as exc:  # the model file's fault, found as it runs (sample_batch's return ...)
        watchdog.fail(f"while {watchdog.activity}: {exc.line()}", code=EXIT_BAD_INPUT)
    except Exception as exc:  # anything unexpected still ends the whole job, with its reason
        watchdog.fail(f"failed while {watchdog.activity}: {gist(exc)}")
    # Peers that finish may close the store; stop polling it, then meet once more (with a
    # deadline: the control group's timeout) so nobody leaves while another still sends.
    watchdog.stop()
    try:
        dist.barrier(group=groups.control)
    except Exception as exc:
        watchdog.fail(f"final barrier: {gist(exc)}")
    result = RunResult(global_rank=me, pp_rank=interpreter.pp_rank, dp_rank=interpreter.dp_rank,
                       metrics=metrics, state=interpreter.state())
    if owns_group:
        dist.destroy_process_group()
    return result
