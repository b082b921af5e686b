"""The octorun interpreter: trains a plan's model with torch.distributed, one process per GPU.

Each process finds its (pp_rank, dp_rank) from the plan, builds only the layers of its own
stages (seeded per FORMATS.md section 4), and runs its pipeline rank's lowered program
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

import contextlib
import datetime
import json
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from octoplan.costs import LayerTable, op_ms, plan_stage_costs
from octoplan.errors import MODEL_CODE_FAILURES, InputError
from octoplan.hf import model_source_files
from octoplan.host_malloc import steady_malloc
from octoplan.modelfile import ModelFile, as_args, load_model_file, microbatch_seed
from octoplan.ops import Kind, Op
from octoplan.outputs import StreamedOutput, check_distinct, check_writable, partial_path, write_text
from octoplan.precision import autocast, check_precision
from octoplan.plan import (MAX_GPUS, MAX_MICROBATCHES, Plan, load_plan, load_plan_profile, plan_microbatch_size,
                           resolve_profile_path, resolve_written_path)
from octoplan.validate import check_runnable
from octorun.comm import RECEIVE_LAST_RESORT, Channel, SendFailed, Transport, wait_work
from octorun.lowering import ACT, Instr, Lowered, Message, RankProgram, forward_only, lower
from octorun.native_stderr import native_stderr_held
from octorun.optim import OPTIMIZERS, OptimizerConfig, build_optimizer, check_optimizer_config, clip_factor, lr_at, squared_norms
from octorun.tied import TiedGroup, model_state, parameter_key, tie_local, tied_groups
from octorun import agreement
from octorun.activations import ActivationMeter
from octorun.stage import StageExecutor, Tape, floating, persistent_buffers
from octorun.watchdog import EXIT_BAD_INPUT, Watchdog, gist, timed_out

__all__ = ["RunConfig", "StepMetrics", "RunResult", "Prepared", "prepare", "run", "summarize_step", "step_line", "LaunchError", "NonFiniteStep",
           "LAUNCH_VARIABLES", "OPTIMIZERS", "free_port"]

log = logging.getLogger(__name__)

# Far beyond any run of one octorun job, small enough that a typo is caught (a job of 10**20
# steps would only ever end by being killed)
MAX_STEPS = 10**7
DEFAULT_KEEP = 2  # checkpoints kept in --save when --keep is not given
# A wait of more than 11 days is a typo: the process group's store and the launcher's clocks take
# waits in milliseconds and overflow on values not far above (1e10 s), and would hang that long
MAX_TIMEOUT_S = 1e6
# The largest --seed whose every microbatch seed (docs/FORMATS.md section 4) stays a signed 64-bit integer,
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
    print_steps: bool = False  # global rank 0 prints each step's line (step_line) as the step ends
    precision: str = "fp32"  # octoplan.precision: fp32, or bf16 autocast over fp32 master weights
    # the optimizer step (octorun.optim): --optimizer and --lr above, and
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float | None = None
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    min_lr: float = 0.0
    decay_steps: int | None = None
    skip_nonfinite: bool = False
    # real data (octorun.data): a token file, read in windows; None: the model's sample_batch
    data_path: str | None = None
    data_dtype: str | None = None
    # evaluation (octorun.evaluation): a held-out token file, and when and how much of it to read
    eval_data_path: str | None = None
    eval_every: int | None = None  # also after every N steps; None: after the last step only
    eval_batches: int | None = None  # global batches per evaluation; None: every whole one the file holds
    # checkpoints (octorun.checkpoint)
    save_dir: str | None = None
    save_every: int | None = None  # also at the last step; None: only at the last step
    keep: int | None = None  # None: DEFAULT_KEEP (--keep given only with --save)
    resume: str | None = None  # a checkpoint folder, a folder of them, or "auto" (--save's latest)
    # a checkpoint (or a folder of them) whose weights alone a fresh start takes: the optimizer,
    # the schedule and the data start afresh; a run that resumes ignores it
    init_from: str | None = None
    init_timeout_s: float | None = None  # the deadline until the first step ends (None: max(--timeout, 300))

    @property
    def checkpoints_kept(self) -> int:
        """``--keep`` as it acts: :data:`DEFAULT_KEEP` where it is not given."""
        return DEFAULT_KEEP if self.keep is None else self.keep

    @property
    def first_timeout_s(self) -> float:
        return self.init_timeout_s if self.init_timeout_s is not None else max(self.timeout_s, 300.0)

    @property
    def optim(self) -> OptimizerConfig:
        return OptimizerConfig(name=self.optimizer, lr=self.lr, weight_decay=self.weight_decay, betas=tuple(self.betas),
                               grad_clip=self.grad_clip, schedule=self.lr_schedule, warmup_steps=self.warmup_steps,
                               min_lr=self.min_lr, decay_steps=self.decay_steps, skip_nonfinite=self.skip_nonfinite)


class LaunchError(RuntimeError):
    """The processes could not start the job together (not bad input: exit 1)."""


class NonFiniteStep(RuntimeError):
    """A step's loss or gradient norm is not finite (without --skip-nonfinite): every rank
    learns it from the same all-reduce and stops at the same step (exit 1)."""


@dataclass(frozen=True)
class StepMetrics:
    step: int
    loss: float  # mean over all microbatches of all replicas
    iteration_ms: float  # first op start to last op end, or to the last gradient all-reduce's end when
    # dp > 1: the span the simulator's iteration_ms predicts (FORMATS.md section 7, docs/FORMATS.md)
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
    lr: float | None = None  # the learning rate this step's update used
    grad_norm: float | None = None  # the global gradient 2-norm before clipping
    skipped_steps: int = 0  # updates skipped so far for non-finite values (--skip-nonfinite)
    # where an evaluation followed the step (--eval-data): the mean loss of its microbatches, and
    # its time on the slowest process
    eval_loss: float | None = None
    eval_ms: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {
            "step": self.step,
            "loss": self.loss,
            "lr": self.lr,
            "grad_norm": self.grad_norm,
            "skipped_steps": self.skipped_steps,
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
        if self.eval_loss is not None:
            out["eval_loss"] = self.eval_loss
            out["eval_ms"] = round(self.eval_ms, 4)
        return out


@dataclass(frozen=True)
class RunResult:
    """What one process returns. ``metrics`` is filled on global rank 0 only."""

    global_rank: int
    pp_rank: int
    dp_rank: int
    metrics: tuple[StepMetrics, ...]
    state: dict[int, dict[str, torch.Tensor]]  # layer index -> its state_dict on CPU (own stages)
    # stopped on SIGTERM before --steps: the transport's receivers still wait for the steps that
    # were to come, so the process must end with os._exit, not an interpreter shutdown
    stopped_early: bool = False


@dataclass(frozen=True)
class Prepared:
    """Everything read from files and derived from the plan before any process group exists."""

    plan: Plan
    plan_path: str
    model: ModelFile
    microbatch_size: int
    lowered: Lowered
    tied: tuple[TiedGroup, ...] = ()  # the model file's tied parameters
    data: Any = None  # --data's token file (octorun.data.TokenData)
    evaluation: Any = None  # --eval-data's token file and schedule (octorun.evaluation.Evaluation)
    resume_from: Path | None = None  # the checkpoint --resume names (None: a fresh start)
    init_from: Path | None = None  # the checkpoint --init-from names
    profile_precision: str | None = None  # what the plan's profile was measured at (None: no profile to read, or a replay)
    profile_threads: int | None = None  # the CPU threads the profile timed its layers with (None: not recorded, a replay)


def prepare(config: RunConfig) -> Prepared:
    """Read and check the plan, its profile and its model file; lower the plan.

    Raises :class:`InputError` for anything the user must fix.
    """
    if not 1 <= config.steps <= MAX_STEPS:
        raise InputError(None, "--steps", f"is {config.steps}", f"train 1 to {MAX_STEPS} steps")
    check_optimizer_config(config.optim, steps=config.steps)
    check_precision(config.precision)
    for flag, value in (("--timeout", config.timeout_s), ("--init-timeout", config.first_timeout_s)):
        if not _valid_timeout(value):
            raise InputError(None, flag, f"is {value:g}", f"give a number of seconds above 0 and at most {MAX_TIMEOUT_S:.0f}")
    _check_checkpoint_flags(config)
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
        model = load_model_file(model_path(plan, config.plan_path), plan.model.config, seed=config.seed)
    num_layers = model.num_layers()
    if plan.stages[-1].end != num_layers:
        raise InputError(config.plan_path, "stages", f"cover {plan.stages[-1].end} layers but {model.path} has {num_layers}",
                         "re-plan from a profile of this model file")
    # --metrics grows as METRICS.partial first (octoplan.outputs.StreamedOutput): that file
    # is an output too
    partial = partial_path(config.metrics_path) if config.metrics_path else None
    check_distinct({"--metrics": config.metrics_path, "--metrics (while it is written)": partial,
                    "--trace": config.trace_path, "--save": config.save_dir}, folders=("--save",))
    # the files the job reads, which no output may overwrite: the model's files and the token
    # file (with its Megatron index) too
    data_files: tuple[str | Path, ...] = ()
    for path in (config.data_path, config.eval_data_path):
        if path is not None:
            from octoplan.tokenfile import index_path  # numpy: only for runs that read a token file

            data_files += (path, index_path(path))
    inputs = (config.plan_path, resolve_profile_path(plan, config.plan_path),
              *(() if config.replay_time_scale is not None else model_source_files(model.path)), *data_files)
    for flag, path in (("--metrics", config.metrics_path), ("--metrics (while it is written)", partial),
                       ("--trace", config.trace_path)):
        if path:  # last: a file is created only once everything else is known to be good
            check_writable(path, flag, inputs=inputs)
    data = None
    if config.data_path is not None:
        if config.replay_time_scale is not None:
            raise InputError(None, "--data", "cannot feed a --replay run (its layers only sleep)", "drop --data or --replay")
        from octorun.data import TokenData  # numpy's memmap: only for runs that read a token file

        data = TokenData.open(config.data_path, model, seed=config.seed, dtype=config.data_dtype)
    evaluation = None
    if config.eval_data_path is not None:
        if config.replay_time_scale is not None:
            raise InputError(None, "--eval-data", "cannot feed a --replay run (its layers only sleep)",
                             "drop --eval-data or --replay")
        from octorun.evaluation import Evaluation

        evaluation = Evaluation.open(config, model, global_batch=plan.microbatches * microbatch_size * plan.parallel.dp)
    if config.init_from is not None and config.save_dir is not None:
        # before --resume auto looks in --save: there it would find the --init-from checkpoints
        # themselves, resume them as this run's own, and prune them (--keep). A path that holds
        # no checkpoint (gone since a first attempt) is judged as given: a resume never reads it.
        from octorun import checkpoint

        given = Path(config.init_from)
        try:
            taken = checkpoint.resolve(str(given), save_root=None, flag="--init-from") if given.exists() else given
        except InputError:
            taken = given
        _check_init_apart(given, taken, config.save_dir)
    resume_from = None
    if config.resume is not None:
        from octorun import checkpoint  # torch.distributed.checkpoint: only for runs that use it

        resume_from = checkpoint.resolve(config.resume, save_root=config.save_dir)
        if resume_from is not None:
            checkpoint.check_compatible(checkpoint.read_meta(resume_from),
                                        {**model_identity(model, num_layers), "optimizer": config.optimizer,
                                         "resolved_config": _recorded_config(model, config),
                                         **_data_identity(config.seed, data)},
                                        resume_from)
    if config.save_dir is not None:
        from octorun import checkpoint

        checkpoint.check_save_root(config.save_dir, {**model_identity(model, num_layers),
                                                     "resolved_config": _recorded_config(model, config)})
    init_from = None
    if config.init_from is not None and resume_from is None:  # a run that resumes never reads it
        from octorun import checkpoint

        init_from = checkpoint.resolve(config.init_from, save_root=None, flag="--init-from")
        checkpoint.check_compatible(checkpoint.read_meta(init_from), model_identity(model, num_layers), init_from,
                                    weights_only=True)
    return Prepared(plan=plan, plan_path=config.plan_path, model=model,
                    microbatch_size=microbatch_size, lowered=lower(plan), tied=tied_groups(model),
                    data=data, evaluation=evaluation, resume_from=resume_from, init_from=init_from,
                    # a replay only sleeps its ops: its precision is the profile's by construction
                    **({} if replayed is not None else _profile_settings(plan, config.plan_path)))


def _profile_settings(plan: Plan, plan_path: str) -> dict[str, Any]:
    """What the plan's profile measured its layers under: the precision, and on a CPU the
    threads; nothing where the profile cannot be read (a plan runs without its profile)."""
    try:
        profile = load_plan_profile(plan, plan_path)
    except InputError:
        return {}
    threads = (profile.extra.get("profiler") or {}).get("threads") if isinstance(profile.extra, dict) else None
    return {"profile_precision": profile.precision,
            "profile_threads": threads if isinstance(threads, int) and threads >= 1 else None}


def _valid_timeout(seconds: float) -> bool:
    return math.isfinite(seconds) and 0 < seconds <= MAX_TIMEOUT_S


def _check_checkpoint_flags(config: RunConfig) -> None:
    if config.save_every is not None and not 1 <= config.save_every <= MAX_STEPS:
        raise InputError(None, "--save-every", f"is {config.save_every}", "give a number of steps >= 1")
    if config.save_every is not None and config.save_dir is None:
        raise InputError(None, "--save-every", "needs --save DIR", "add --save DIR")
    if config.keep is not None and not 1 <= config.keep <= 10_000:
        raise InputError(None, "--keep", f"is {config.keep}", "keep 1 or more checkpoints")
    # options of checkpoints or data that would be ignored without a word
    if config.eval_every is not None and not 1 <= config.eval_every <= MAX_STEPS:
        raise InputError(None, "--eval-every", f"is {config.eval_every}", f"give a number of steps from 1 to {MAX_STEPS}")
    if config.eval_batches is not None and not 1 <= config.eval_batches <= MAX_STEPS:
        raise InputError(None, "--eval-batches", f"is {config.eval_batches}",
                         f"give a number of global batches from 1 to {MAX_STEPS}")
    for flag, value, needed, other in (("--keep", config.keep, config.save_dir, "--save DIR"),
                                       ("--data-dtype", config.data_dtype, config.data_path or config.eval_data_path,
                                        "--data FILE or --eval-data FILE"),
                                       ("--eval-every", config.eval_every, config.eval_data_path, "--eval-data FILE"),
                                       ("--eval-batches", config.eval_batches, config.eval_data_path, "--eval-data FILE")):
        if value is not None and needed is None:
            raise InputError(None, flag, f"needs {other}", f"add {other} or drop {flag}")
    if config.resume == "auto" and config.save_dir is None:
        raise InputError(None, "--resume", "auto needs --save DIR (it resumes from that folder's latest checkpoint)",
                         "add --save DIR, or give --resume a checkpoint folder")
    if config.save_dir is not None and Path(config.save_dir).exists() and not Path(config.save_dir).is_dir():
        raise InputError(config.save_dir, "--save", "is a file, not a folder", "give a folder for the checkpoints")


def _check_init_apart(init_from: Path, checkpoint: Path, save_dir: str) -> None:
    """--save must not be the --init-from folder, nor the folder that holds the checkpoint it
    names (``checkpoint``, its newest where it names a folder of them): the run's own saves
    would prune it (--keep), and --resume auto would take it for one of the run's own."""
    root = Path(save_dir).resolve()
    if root in (init_from.resolve(), checkpoint.resolve(), checkpoint.resolve().parent):
        raise InputError(save_dir, "--save", f"holds the --init-from checkpoint {init_from}: the run's saves would "
                         "prune it, and --resume auto would resume from it", "give --save a folder of this run's own")


def changed_settings(saved: dict[str, Any], now: dict[str, Any], prefix: str = "") -> list[str]:
    """``key old -> new`` for each setting of ``now`` that the checkpoint's ``saved`` meta holds
    with another value (nested keys dotted: ``lr_schedule.steps 6 -> 20``); settings an older
    checkpoint did not record are not compared."""
    changed = []
    for key, value in now.items():
        if key not in saved:
            continue
        old = saved[key]
        if isinstance(value, dict) and isinstance(old, dict):
            changed += changed_settings(old, value, f"{prefix}{key}.")
        elif old != value:
            changed.append(f"{prefix}{key} {old} -> {value}")
    return changed


def model_identity(model: ModelFile, num_layers: int) -> dict[str, Any]:
    """What a checkpoint records of its model, and what a resume checks: the same model name
    and layer count (parameter shapes are checked key by key as the state loads)."""
    return {"model": model.name, "num_layers": num_layers}


def _recorded_config(model: ModelFile, config: RunConfig) -> dict[str, Any] | None:
    """The model config a checkpoint records and a resume compares (ModelFile.resolved_config);
    None under --replay, whose model is the profile's and whose config is the run's scales."""
    return None if config.replay_time_scale is not None else model.resolved_config()


def _data_identity(seed: int, data: Any) -> dict[str, Any]:
    """What a checkpoint records of its token file, and what a resume that reads one checks: the
    file (its fingerprint and sampled digest), the seed of its window order and the windows' length (the model's
    tokens_per_sample: the order is one of that many windows). ``consumed_samples`` is a position
    in that order, so under another seed, file or length the resumed run would read windows the
    run before it already read, and skip others. Empty without ``--data``."""
    return {} if data is None else {"seed": seed, "data_fingerprint": data.fingerprint(),
                                    "data_sampled_digest": data.sampled_digest(),
                                    "tokens_per_sample": data.tokens_per_sample}


def _replay_model(plan: Plan, config: RunConfig) -> ModelFile:
    """The replay model of the plan's own profile: every op sleeps its profiled time (scaled),
    so CPU processes emulate the plan's GPUs — for plans of models too large to run here."""
    from octorun import replay

    profile_path = resolve_profile_path(plan, config.plan_path)
    if profile_path is None:
        problem = f"profile {plan.profile!r} not found" if plan.profile else "is missing"
        raise InputError(config.plan_path, "profile", problem, "--replay needs the plan's profile")
    profile = load_plan_profile(plan, config.plan_path)  # the hash and layer count must still match
    # A replayed op sleeps its profiled time x scale, and a rank waits for its input as long as
    # the ops before it on other ranks sleep: a wait the plan predicts longer than --timeout (at
    # that scale) would trip the watchdog of the waiting process, blaming a wait, not the scale.
    from octoplan.simulator import simulate

    costs = plan_stage_costs(plan, LayerTable(profile))
    longest_op_ms = max(op_ms(costs[op.stage], op.kind) for ops in plan.schedule for op in ops)
    longest_wait_ms = max((b.end_ms - b.start_ms for b in simulate(plan, profile).bubbles if b.reason != "drain"), default=0.0)
    scale = config.replay_time_scale / 1000
    for what, ms in (("makes the longest op sleep", longest_op_ms), ("makes the plan's longest wait for an input",
                                                                     longest_wait_ms)):
        if ms * scale >= config.timeout_s:
            raise InputError(None, "--replay", f"{config.replay_time_scale:g} {what} {ms * scale:.3g} s, not under "
                             f"--timeout {config.timeout_s:g} s", "use a smaller scale or a longer --timeout")
    return load_model_file(replay.__file__, {"profile": str(profile_path), "time_scale": config.replay_time_scale},
                           seed=config.seed, folder_importable=False)


def model_path(plan: Plan, plan_path: str) -> str:
    source = plan.model.source
    if not source:
        raise InputError(plan_path, "model.source", "is missing: an analytic plan has no model to train",
                         "plan from a profile made by octoplan profile MODEL.py")
    if source.startswith("hf:"):  # a Hugging Face model folder (octoplan.hf), found as written paths are
        from octoplan.hf import resolve_hf_source

        folder = resolve_hf_source(source, plan_path)
        if folder is None:
            raise InputError(plan_path, "model.source", f"model folder {source!r} not found",
                             "run from the project folder or fix the path")
        return folder
    found = resolve_written_path(source, plan_path)
    if found is not None:
        return str(found)
    raise InputError(plan_path, "model.source", f"model file {source!r} not found", "run from the project folder or fix the path")


# ---------------------------------------------------------------------------------------------
# Process group and channels
# ---------------------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on now: for a one-machine rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ensure_env() -> None:
    """Without torchrun, run as a world of one."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    for given, missing in (("RANK", "WORLD_SIZE"), ("WORLD_SIZE", "RANK")):
        if given in os.environ and missing not in os.environ:  # half a launch: never a world of one
            raise InputError(None, missing, f"is not set but {given} is",
                             "launch with torchrun, or leave RANK and WORLD_SIZE unset to run one process")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))


LAUNCH_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR")


def _check_env(plan: Plan, plan_path: str, *, replay: bool = False) -> int:
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
    if "LOCAL_WORLD_SIZE" in os.environ and not replay:
        # the plan placed its stages for nodes of gpus_per_node ranks (its transfers' prices and
        # its rank order assume them); a launch of other nodes would run another plan than tuned.
        # A replay emulates the plan's nodes and may run them all on one launcher.
        local = whole("LOCAL_WORLD_SIZE", 1, world)
        expected = min(plan.cluster.gpus_per_node, plan.cluster.gpus)
        if local != expected:
            raise InputError(plan_path, "cluster.gpus_per_node",
                             f"the plan has {plan.cluster.gpus_per_node} GPUs per node ({expected} processes per launcher) "
                             f"but this launcher started {local} (LOCAL_WORLD_SIZE)",
                             f"launch --nproc-per-node {expected} on each of {math.ceil(plan.cluster.gpus / expected)} nodes, "
                             f"or tune for --gpus-per-node {local}")
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
    # per tied group held on more than one pipeline rank: the group of this replica's ranks that
    # hold a member (None where this rank holds none, or one rank holds them all)
    tied: list[Any]
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
    tied = []
    for group in prepared.tied:
        mine = None
        for dp in range(parallel.dp):
            ranks = sorted({parallel.global_rank(plan_rank, dp) for plan_rank in _member_ranks(prepared.plan, group)})
            if len(ranks) > 1:
                made = dist.new_group(ranks, timeout=timeout, backend=backend)
                if me in ranks:
                    mine = made
        tied.append(mine)
    if backend == "nccl":
        for channel in incoming.values():
            _unbounded_receives(channel.data_group)
    control = None if backend == "gloo" else dist.new_group(timeout=timeout, backend="gloo")
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # private API: without it the watchdog still has its deadlines
        store = None
    return _Groups(outgoing=outgoing, incoming=incoming, dp_group=dp_group, control=control, store=store, tied=tied)


def _backend(asked: str) -> str:
    backend = asked
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise InputError(None, "--backend", f"is {backend!r}", "use auto, gloo or nccl")
    if backend == "nccl" and not torch.cuda.is_available():
        raise InputError(None, "--backend", "is nccl but this machine has no CUDA device", "use --backend gloo")
    return backend


@dataclass(frozen=True)
class _MeetingPlace:
    """The store where the job's processes meet: first to agree on their input
    (octorun.agreement), then to form the process group."""

    store: Any
    rank: int
    world: int
    wait_s: float  # how long this process waits for the others


# How long a process whose own input is bad waits for its peers to hear of it, when no torchrun
# launcher vouches that they were started (a manual launch of one rank must not sit out
# --init-timeout to report a typo). Under torchrun the peers exist: it waits --init-timeout.
UNVOUCHED_PEERS_WAIT_S = 5.0


def _meeting_place(owns_group: bool, error: InputError | None, init_timeout_s: float) -> _MeetingPlace | None:
    """Where this process meets its peers; None for a process alone, or one whose launch
    variables name no job to meet (its own error says which)."""
    if not owns_group:  # a group formed by the caller (tests run several jobs in one)
        if dist.get_world_size() == 1:
            return None
        try:
            store = dist.distributed_c10d._get_default_store()
        except Exception:  # private API: without it, a peer's bad input ends this one at --init-timeout
            return None
        return _MeetingPlace(store=store, rank=dist.get_rank(), world=dist.get_world_size(), wait_s=init_timeout_s)
    launch = _launch_of_env()
    if launch is None:
        return None
    rank, world, address, port = launch
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    wait_s = init_timeout_s if error is None or agent_store else min(init_timeout_s, UNVOUCHED_PEERS_WAIT_S)
    timeout = datetime.timedelta(seconds=wait_s)
    try:
        with native_stderr_held(replay=False):  # c10d's retries while the store's host was not up yet
            if agent_store:
                # Under torchrun the workers share the launcher's store, which outlives a restart
                # (--max-restarts): the keys of the attempt that failed (its ranks' addresses)
                # would mislead the next one's rendezvous. Each attempt gets keys of its own.
                attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
                store = dist.PrefixStore(f"octorun/attempt{attempt}/",
                                         dist.TCPStore(address, port, world, is_master=False, timeout=timeout))
            else:  # rank 0 hosts it, as torch's env:// rendezvous does
                store = dist.TCPStore(address, port, world, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    except Exception as exc:
        if error is not None:  # no peer will hear of it: this process says it, whatever its rank
            raise agreement.JobStopped(error.line()) from None
        raise _not_formed(world, init_timeout_s, gist(exc)) from None
    return _MeetingPlace(store=store, rank=rank, world=world, wait_s=wait_s)


def _launch_of_env() -> tuple[int, int, str, int] | None:
    """(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) when the variables are all there and sound;
    :func:`_check_env` says what is wrong with them otherwise."""
    try:
        rank, world, port = (int(os.environ[name]) for name in ("RANK", "WORLD_SIZE", "MASTER_PORT"))
        address = os.environ["MASTER_ADDR"]
    except (KeyError, ValueError):
        return None
    # a RANK past its own WORLD_SIZE still meets the others: rank 0 may count it (its WORLD_SIZE
    # is the typo), and would otherwise wait for it until --init-timeout
    if not (1 <= world <= MAX_GPUS and 0 <= rank < MAX_GPUS and 1 <= port <= 65535 and address):
        return None
    return rank, world, address, port


def _agree(place: _MeetingPlace, config: RunConfig, error: InputError | None, prepared: Prepared | None,
           *, backend: str | None) -> None:
    """Every process learns whether any process's input is bad, or differs from rank 0's
    (octorun.agreement): all go on, or all stop."""
    parts = None
    if prepared is not None and backend is not None:
        parts = agreement.identity(config, prepared.plan, prepared.model.path, backend, prepared.data, prepared.evaluation)
    try:
        with native_stderr_held():
            agreement.agree(agreement.meeting_store(place.store), rank=place.rank, world=place.world, error=error, parts=parts,
                            plan_path=config.plan_path, model_path=None if prepared is None else prepared.model.path,
                            timeout=datetime.timedelta(seconds=place.wait_s),
                            speaks_alone=error is not None and error.field in LAUNCH_VARIABLES)
    except agreement.NotAllCame as exc:
        if error is not None:  # the peers did not come to hear it: this process says it, whatever its rank
            raise agreement.JobStopped(error.line()) from None
        raise _not_formed(place.world, place.wait_s, str(exc)) from None


def _not_formed(world: int, seconds: float, why: str) -> LaunchError:
    return LaunchError(f"the {world} processes did not form a group within --init-timeout {seconds:g} s: {why}")


def _init_process_group(backend: str, world: int, timeout: datetime.timedelta, place: _MeetingPlace | None) -> None:
    """The default process group, formed on the store where the processes met."""
    # torch.distributed.nn.functional takes ``group.WORLD`` as its functions' default argument
    # when it is first imported, and torch imports it lazily (the optimizer's first step loads
    # dynamo, which loads it). Imported once the group exists, it would hold the default group
    # past destroy_process_group: its gloo threads then outlive the run, and the interpreter's
    # exit now and then tears them down running (SIGABRT, "terminate called without an active
    # exception", after a run that had ended well). Imported first, its defaults are None.
    import torch.distributed.nn.functional  # noqa: F401
    if place is None:
        dist.init_process_group(backend, timeout=timeout)
        return
    dist.init_process_group(backend, store=dist.PrefixStore("group/", place.store), rank=place.rank, world_size=world,
                            timeout=timeout)


def _stage_of_layer(plan: Plan, layer: int) -> int:
    return next(index for index, stage in enumerate(plan.stages) if layer in stage.layers)


def _member_ranks(plan: Plan, group: TiedGroup) -> set[int]:
    """The pipeline ranks holding a member of ``group``."""
    return {plan.stages[_stage_of_layer(plan, layer)].rank for layer in group.layers}


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
    evaluating: bool = False  # a forward-only pass of an evaluation (octorun.evaluation): no tapes
    step: int = 0  # the step trained, or evaluated after: with a microbatch's position, what F's layers are seeded by
    eval_batch: int = 0  # an evaluation's global batch of the held-out file


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
        self.tied = prepared.tied
        self.watchdog.doing("tying the model file's tied parameters")
        tied_keys = tie_local(model.path, self.layers, self.tied, lambda index: model.build_layer(index).to(device))
        self.meter = ActivationMeter(t for layer in self.layers.values() for t in (*layer.parameters(), *layer.buffers())) \
            if config.activation_memory else None
        for s, mods in built.items():
            stage = self.plan.stages[s]
            self.executors[s] = StageExecutor(mods, first=s == 0, last=s == self.last_stage,
                                              loss_fn=model.loss, loss_scale=scale, recompute=stage.recompute,
                                              recompute_layers=stage.recompute_layers, meter=self.meter,
                                              precision=config.precision, layer_indices=stage.layers, seed=config.seed)
        self.params = _unique_trainable(self.layers.values())
        # every parameter's checkpoint key, by global layer index (a tied one by its canonical member's)
        self.param_keys = {id(p): tied_keys.get(id(p), parameter_key(i, name))
                           for i in sorted(self.layers) for name, p in self.layers[i].named_parameters()}
        self.reduce_params, self.norm_params = self._assign_parameters(tied_keys)
        # the buffers a checkpoint holds (BatchNorm's running statistics): each replica updates
        # them from its own samples, so after every update all take replica 0's, as DDP's
        # broadcast_buffers does; else a checkpoint (one copy per key) mixed replicas key by key
        self.synced_layers = [self.layers[i] for i in sorted(self.layers)] if self.groups.dp_group is not None else []
        self.optim_config = config.optim
        self.optimizer = build_optimizer(self.params, self.optim_config)  # None on a rank without parameters
        self.first_step = 0  # a resumed run starts later (restore)
        self.initialized_from: str | None = None  # the checkpoint whose weights a fresh start took (--init-from)
        self.consumed_samples = 0  # samples of the data read before first_step
        self.saved_metrics: dict[str, Any] | None = None  # a resumed checkpoint's metrics of its step (restore)
        self.skipped_steps = 0
        self.stopping = False  # a rank got SIGTERM: finish this step, save, leave
        self.data = prepared.data
        self.global_batch = self.plan.microbatches * self.mbs * self.plan.parallel.dp
        # per stage of this rank: whether a non-finite value came out of its forward this step
        self.nonfinite_forward = {s: torch.zeros((), dtype=torch.bool, device=device) for s in self.program.stages}
        self.transport: Transport | None = None  # made in train(), once the first step is known
        self.rounds_begun = 0  # rounds of messages begun in this run: training steps and evaluation passes
        self.evaluation = prepared.evaluation  # --eval-data (octorun.evaluation.Evaluation), or None
        self.eval_program = None if self.evaluation is None else forward_only(self.program)
        self.timer = _Timer(device)

    def _assign_parameters(self, tied_keys: dict[int, str]) -> tuple[dict[int, list], dict[int, list]]:
        """Which stage's gradient all-reduce carries each parameter, and which stage's norm counts it.

        A parameter two stages of this rank share (a tied one) goes with the stage whose
        all-reduce starts last in the program, after every backward that adds to it. The norm
        counts each tensor once in the whole job: a tied tensor only on its canonical member's
        stage, and a replicated one only on data-parallel replica 0.
        """
        reduce_order = {instr.allreduce_stage: n for n, instr in enumerate(self.program.instrs) if instr.allreduce_stage is not None}
        holders: dict[int, list[int]] = {}
        by_id: dict[int, torch.nn.Parameter] = {}
        for s in self.program.stages:
            for index in self.plan.stages[s].layers:
                for p in self.layers[index].parameters():
                    if p.requires_grad and s not in holders.setdefault(id(p), []):
                        holders[id(p)].append(s)
                        by_id[id(p)] = p
        reduce_params: dict[int, list] = {s: [] for s in self.program.stages}
        norm_params: dict[int, list] = {s: [] for s in self.program.stages}
        for pid, stages in holders.items():
            reduce_params[max(stages, key=lambda s: reduce_order.get(s, -1))].append(by_id[pid])
            if self.dp_rank != 0:
                continue
            key = tied_keys.get(pid)
            if key is None:
                norm_params[stages[0]].append(by_id[pid])
            else:  # the canonical member's stage, wherever it is
                canonical_layer = int(key.split(".")[1])
                stage = _stage_of_layer(self.plan, canonical_layer)
                if stage in norm_params:
                    norm_params[stage].append(by_id[pid])
        return reduce_params, norm_params

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
            self.watchdog.fail_on(what, exc)

    # -- one step -----------------------------------------------------------------------------
    def _sample(self, step: int, mb: int) -> tuple[Any, Any]:
        """Microbatch ``mb`` of this replica in ``step``: windows of the token file, or the model's
        synthetic sample_batch."""
        if self.data is None:
            return self.model.sample_batch(self.mbs, step=step, replica=self.dp_rank, mb=mb)
        consumed = self.consumed_samples + (step - self.first_step) * self.global_batch
        return self.data.microbatch(consumed=consumed, replica=self.dp_rank, mb=mb,
                                    microbatches=self.plan.microbatches, microbatch_size=self.mbs)

    def _next_round(self) -> int:
        """The transport's number for the round of messages about to begin."""
        self.rounds_begun += 1
        return self.rounds_begun - 1

    def _feed(self, state: _StepState, what: str, sample) -> None:
        """The first stage's inputs and the last stage's targets of every microbatch, where this
        rank holds them: ``sample(mb)`` gives them."""
        stages = set(self.program.stages)
        if 0 not in stages and self.last_stage not in stages:
            return
        self.watchdog.doing(f"sampling the batches of {what}")
        for mb in range(self.plan.microbatches):
            inputs, targets = sample(mb)
            if 0 in stages:
                state.inputs[(0, mb)] = self._to_device(inputs)
            if self.last_stage in stages:
                state.targets[mb] = self._to_device(targets)

    def step(self, step: int) -> dict[str, Any]:
        state = _StepState(step=step)
        local = self._next_round()
        self._feed(state, f"step {step}", lambda mb: self._sample(step, mb))
        for flag in self.nonfinite_forward.values():
            flag.zero_()
        self._control_barrier(f"waiting at the barrier before step {step}")
        started = time.perf_counter()
        if self.meter is not None:
            self.meter.reset()
        self.timer.begin_step()
        reductions: list[tuple[Any, torch.Tensor, list[torch.Tensor], int]] = []
        self._run_program(self.program.instrs, f"step {step}", local, state, reductions)
        deadline = self.watchdog.deadline()
        for work, flat, params, sent, stage in reductions:
            self._wait_reduction(work, f"gradient all-reduce of stage {stage}, step {step}", deadline)
            *reduced, used = torch._utils._unflatten_dense_tensors(flat, sent)
            for param, grad, value, replicas_with_grad in zip(params, sent, reduced, used.tolist()):
                param.grad = grad.copy_(value) if replicas_with_grad else None
        self._reduce_tied(step, deadline)
        # when the last all-reduce was seen done: the simulator's iteration ends there too
        reduced_at = self.timer.mark() if reductions or any(g is not None for g in self.groups.tied) else None
        self.watchdog.doing(f"running the optimizer of step {step}")
        update = self._update(step, state)
        self._sync_buffers(step)
        spans = self.timer.resolve()
        step_s = time.perf_counter() - started
        loss_sum = float(sum(loss.item() for loss in state.losses))
        return {
            "rank": self.me, "pp_rank": self.pp_rank, "dp_rank": self.dp_rank,
            "loss_sum": loss_sum, "loss_count": len(state.losses), "step_s": step_s, **update,
            "spans": [(op.stage, op.kind.value, op.mb, start, end) for op, start, end in spans],
            "reduced_s": None if reduced_at is None else self.timer.seconds(reduced_at),
            "origin_s": self.timer.origin_host, "host": socket.gethostname(),
            "peak_activation_bytes": None if self.meter is None else self.meter.peak,
            "peak_with_message_bytes": None if self.meter is None else self.meter.peak_with_messages,
        }

    def _run_program(self, instrs: Sequence[Instr], what: str, local: int, state: _StepState,
                     reductions: list) -> None:
        """Run ``instrs`` (a rank program's, or its forward-only one's) as round ``local`` of the
        transport, then wait for its sends; ``what`` names the round in every activity and error
        ("step 3"). A training step's all-reduces start into ``reductions`` as their stages' last
        weight-gradient ops end."""
        for instr in instrs:
            op = instr.op
            self.watchdog.doing(f"letting go of the sends before op {op} of {what}")
            self._check_sends(what, self.transport.begin_op, self.watchdog.deadline())
            # the received messages' holds in the meter: each stays until its op has run (an
            # F's input is its tape's by then, a gradient the backward's to read until it ends)
            reading = [hold for message in instr.recvs for hold in self._receive(what, local, op, message, state)]
            self.watchdog.doing(f"running op {op} of {what}")
            begin = None if state.evaluating else self.timer.mark()
            try:
                outgoing = self._run_op(op, state)
            except InputError as exc:  # the model file's fault (a loss that is not a scalar ...)
                self.watchdog.fail(f"op {op} of {what}: {exc.line()}", code=EXIT_BAD_INPUT)
            except Exception as exc:
                self.watchdog.fail(f"op {op} of {what} raised {gist(exc)}")
            if begin is not None:
                self.timer.add(op, begin, self.timer.mark())
            del reading
            for message in instr.sends:
                try:
                    self.transport.send(message, outgoing, dst=self._global(message.dst), step=local, what=what)
                except (TypeError, ValueError) as exc:  # a dtype gloo cannot send, a shape that changed
                    self.watchdog.fail(f"op {op} of {what}: {exc}")
            if instr.allreduce_stage is not None and self.groups.dp_group is not None:
                started_reduction = self._start_allreduce(instr.allreduce_stage)
                if started_reduction is not None:
                    reductions.append(started_reduction)
        deadline = self.watchdog.deadline()
        self.watchdog.doing(f"waiting for the sends of {what} to complete")
        self._check_sends(what, self.transport.wait_sends, deadline)

    def evaluate(self, step: int) -> dict[str, Any]:
        """The evaluation after ``step`` (octorun.evaluation): --eval-batches forward-only passes
        of the plan, every layer in eval mode meanwhile. Returns this rank's loss sum and count
        (on the last stage's rank) and its seconds."""
        started = time.perf_counter()
        modes = [(module, module.training) for layer in self.layers.values() for module in layer.modules()]
        for module, _ in modes:
            module.train(False)
        losses: list[torch.Tensor] = []
        # a layer that draws random numbers in eval mode too (F.dropout's default): its draws
        # leave the process's generators as they were (training reseeds each layer anyway, and a
        # checkpoint saves the same generator state with or without an evaluation)
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type=self.device.type if devices else "cuda"):
            self._evaluate_batches(step, losses)
        for module, training in modes:  # each module as the model file left it (one built in eval mode stays so)
            module.train(training)
        return {"eval_loss_sum": float(sum(loss.item() for loss in losses)), "eval_loss_count": len(losses),
                "eval_s": time.perf_counter() - started}

    def _evaluate_batches(self, step: int, losses: list[torch.Tensor]) -> None:
        """The forward-only passes of the evaluation after ``step``; each last stage's losses
        into ``losses``."""
        for batch in range(self.evaluation.batches):
            what = f"evaluation batch {batch} after step {step}"
            state = _StepState(evaluating=True, step=step, eval_batch=batch)
            self._feed(state, what, lambda mb: self.evaluation.microbatch(
                batch=batch, replica=self.dp_rank, mb=mb, microbatches=self.plan.microbatches,
                microbatch_size=self.mbs))
            self._run_program(self.eval_program.instrs, what, self._next_round(), state, [])  # (no all-reduce in it)
            losses += state.losses

    def _sync_buffers(self, step: int) -> None:
        """Every replica takes data-parallel replica 0's persistent buffers of its layers (one
        broadcast per dtype). Looked up each time: a recomputing stage's rebuild replaces them."""
        synced = persistent_buffers(self.synced_layers)
        if not synced:
            return
        source = self.plan.parallel.global_rank(self.pp_rank, 0)
        self.watchdog.doing(f"taking replica 0's buffers after step {step}")
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for buffer in synced:
            by_dtype.setdefault(buffer.dtype, []).append(buffer)
        deadline = self.watchdog.deadline()
        for dtype, buffers in by_dtype.items():
            flat = torch._utils._flatten_dense_tensors(buffers)
            try:
                work = dist.broadcast(flat, src=source, group=self.groups.dp_group, async_op=True)
            except Exception as exc:
                self.watchdog.fail_on(f"broadcasting replica 0's buffers after step {step}", exc)
            self._wait_reduction(work, f"broadcast of replica 0's {str(dtype).removeprefix('torch.')} buffers, step {step}",
                                 deadline)
            if self.dp_rank != 0:
                for buffer, value in zip(buffers, torch._utils._unflatten_dense_tensors(flat, buffers)):
                    buffer.copy_(value)

    def _wait_reduction(self, work: Any, what: str, deadline: float) -> None:
        self.watchdog.doing(f"waiting for the {what}")
        try:
            finished = wait_work(work, max(deadline - time.monotonic(), 0.001), polled=self.device.type == "cuda")
        except RuntimeError as exc:
            self.watchdog.fail_on(f"{what} failed", exc)
        if not finished:
            self.watchdog.fail_waiting(f"{what} did not finish within {self.watchdog.timeout_s:g} s")

    def _reduce_tied(self, step: int, deadline: float) -> None:
        """Sum each tied tensor's gradient over the ranks of this replica that hold a copy."""
        for index, (group, process_group) in enumerate(zip(self.tied, self.groups.tied)):
            if process_group is None:
                continue
            canonical = parameter_key(*group.canonical)
            param = next(p for p in self.params if self.param_keys[id(p)] == canonical)
            # a copy no microbatch used still takes part, with zeros; where no copy was used
            # the gradient stays None (the flag's sum), as for an unused parameter on one process
            grad = torch.zeros_like(param) if param.grad is None else param.grad
            used = _used_flags([param], grad)
            what = f"all-reduce of tied group {index} ({canonical}), step {step}"
            works = [dist.all_reduce(t, op=dist.ReduceOp.SUM, group=process_group, async_op=True) for t in (grad, used)]
            for work in works:
                self._wait_reduction(work, what, deadline)
            param.grad = grad if used.item() else None

    def _update(self, step: int, state: _StepState) -> dict[str, Any]:
        """The optimizer step, after one all-reduce that tells every rank the global gradient
        norm and where non-finite values appeared (octorun.optim)."""
        stages = self.plan.num_stages
        summary = torch.zeros(2 * stages + 2, dtype=torch.float64)
        summary[2 * stages + 1] = float(_STOP_REQUESTED.is_set())  # a SIGTERM this rank got: every rank stops after this step
        for s in self.program.stages:
            grads = [p.grad for p in self.norm_params[s]]
            summary[s] = squared_norms(grads).cpu() if grads else 0.0
            summary[stages + s] = float(self.nonfinite_forward[s].item())
        summary[2 * stages] = float(sum(loss.item() for loss in state.losses))
        self.watchdog.doing(f"summing the gradient norm of step {step}")
        try:
            work = dist.all_reduce(summary, op=dist.ReduceOp.SUM, group=self.groups.control, async_op=True)
        except Exception as exc:
            self.watchdog.fail_on(f"summing the gradient norm of step {step}", exc)
        self._wait_reduction(work, f"sum of the gradient norm of step {step}", self.watchdog.deadline())
        self.stopping = self.stopping or summary[2 * stages + 1].item() > 0
        norm = math.sqrt(summary[:stages].sum().item()) if torch.isfinite(summary[:stages]).all() else math.nan
        loss_finite = math.isfinite(summary[2 * stages].item())
        lr = lr_at(self.optim_config, step, self.config.steps)
        if not (math.isfinite(norm) and loss_finite):
            where = self._nonfinite_origin(summary)
            if not self.optim_config.skip_nonfinite:
                raise NonFiniteStep(f"step {step}: non-finite {'loss' if not loss_finite else 'gradient norm'}; "
                                    f"it first appeared {where} (--skip-nonfinite skips such updates)")
            self.skipped_steps += 1
            if self.me == 0:  # every rank skips alike: one line says so
                log.warning("step %d: non-finite values (first %s); update skipped", step, where)
            if self.optimizer is not None:
                self.optimizer.zero_grad(set_to_none=True)
            return {"grad_norm": norm, "lr": lr, "skipped_steps": self.skipped_steps}
        if self.optim_config.grad_clip is not None:
            factor = clip_factor(norm, self.optim_config.grad_clip)
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(factor)
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": norm, "lr": lr, "skipped_steps": self.skipped_steps}

    def _nonfinite_origin(self, summary: torch.Tensor) -> str:
        """Where a non-finite value showed first: the first stage whose forward produced one,
        else the last stage whose gradients hold one (the backward runs from the last stage)."""
        stages = self.plan.num_stages

        def described(s: int) -> str:
            stage = self.plan.stages[s]
            return f"stage {s} (layers {stage.start}-{stage.end - 1}, pp rank {stage.rank})"

        forward = [s for s in range(stages) if summary[stages + s].item() > 0]
        if forward:
            return f"in the forward of {described(forward[0])}"
        backward = [s for s in range(stages) if not math.isfinite(summary[s].item())]
        if backward:
            return f"in the gradients of {described(backward[-1])}"
        return "in the loss"

    def _check_sends(self, what: str, wait, deadline: float) -> None:
        """``wait(deadline=deadline)``, a wait of the transport's for sends in round ``what``
        ("step 3"); a send it reports late or failed ends the job."""
        try:
            late = wait(deadline=deadline)
        except SendFailed as exc:  # a peer that died closed the connection, or gloo's own deadline passed
            self.watchdog.fail(f"{what}: {exc} (global rank {self._global(exc.message.dst)})", waited=timed_out(exc))
        if late is not None:
            self.watchdog.fail_waiting(f"{what}: the send of the {late} (global rank {self._global(late.dst)}) "
                               f"did not complete within {self.watchdog.timeout_s:g} s")

    def _receive(self, what: str, local: int, op: Op, message: Message, state: _StepState) -> list:
        """Take ``message`` for ``op`` into the round's state; returns its holds in the meter."""
        src = self._global(message.src)
        self.watchdog.doing(f"op {op} of {what} waiting for the {message} (global rank {src})")
        try:
            value, holds = self.transport.mailbox.take(local, message, src=src, deadline=self.watchdog.deadline())
        except TimeoutError:
            self.watchdog.fail_waiting(
                f"op {op} of {what} waited {self.watchdog.timeout_s:g} s for the {message} (global rank {src}) {self._where()}"
            )
        except ConnectionError as exc:
            self.watchdog.fail(f"op {op} of {what} cannot receive the {message} (global rank {src}): {exc}")
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
            if state.evaluating:
                # keyed as a training forward is, in a namespace of its own: the evaluation after
                # step S seeds with step -(S + 1), and its microbatch's place in the held-out batches
                position = (state.eval_batch * self.plan.parallel.dp + self.dp_rank) * self.plan.microbatches + op.mb
                output, loss = executor.evaluate(state.inputs.pop(key), targets, draws=(-(state.step + 1), position))
            else:
                position = self.dp_rank * self.plan.microbatches + op.mb  # its place in the global batch
                output, tape = executor.forward(state.inputs.pop(key), targets, draws=(state.step, position))
                state.tapes[key] = tape
                loss = tape.loss
                # on the device, without a sync: read once, at the step's end (octorun.optim)
                flag = self.nonfinite_forward[op.stage]
                for value in (loss,) if loss is not None else floating(as_args(output)):
                    flag.logical_or_(~torch.isfinite(value).all())
            if loss is not None:
                state.losses.append(loss)
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

    def _start_allreduce(self, stage: int) -> tuple[Any, torch.Tensor, list[torch.nn.Parameter], list[torch.Tensor], int] | None:
        """Start the stage's gradient all-reduce; None for a stage without trainable parameters,
        which has nothing to reduce (every replica holds the same layers, so all skip it alike,
        and the simulator prices it at nothing)."""
        params = self.reduce_params[stage]
        if not params:
            return None
        # A replica without a parameter's gradient sends zeros, so that the flat layout is the
        # same on every replica, and a flag per parameter says which replicas had one: where
        # none had, the gradient is None again after the reduce, and the optimizer leaves the
        # parameter alone (no weight decay, no moment update) as it does on one process.
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
        sent = [*grads, _used_flags(params, grads[0])]
        flat = torch._utils._flatten_dense_tensors(sent)
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.groups.dp_group, async_op=True)
        return work, flat, params, sent, stage

    # -- the run ------------------------------------------------------------------------------
    def train(self) -> tuple[StepMetrics, ...]:
        steps = range(self.first_step, self.config.steps)
        # a resume at --steps or beyond, with --eval-data, evaluates the checkpoint's weights and
        # trains nothing (Megatron-LM's --skip-train)
        evaluating_only = not steps and self.evaluation is not None
        rounds = (lambda: (False for _ in steps)) if self.evaluation is None else (lambda: self.evaluation.rounds(steps))
        self.transport = Transport(outgoing=self.groups.outgoing, incoming=self.groups.incoming, device=self.device,
                                   rounds=rounds, timeout_s=self.config.timeout_s,
                                   static_shapes=not self.config.dynamic_shapes, meter=self.meter)
        self.transport.start()
        metrics: list[StepMetrics] = []
        metrics_file, held_back = None, []
        if self.config.metrics_path and self.me == 0:
            # read before the file is begun anew
            earlier = _earlier_metrics(self.config.metrics_path, self.first_step, self.saved_metrics)
            metrics_file = StreamedOutput(self.config.metrics_path, flag="--metrics")
            self.watchdog.on_bad_input.append(lambda: _remove_if_empty(metrics_file.partial))
            if evaluating_only:  # the last line gets the evaluation (_evaluate_checkpoint)
                earlier, held_back = earlier[:-1], earlier[-1:]
            for line in earlier:
                metrics_file.write_line(line)
        try:
            for step in steps:
                try:
                    record = self.step(step)
                except NonFiniteStep:
                    if metrics_file:  # the steps before it are kept: what a user reads to see the run go wrong
                        metrics_file.commit()
                    raise
                gathered = self._gather(record, f"the metrics of step {step}")
                step_metrics = None
                if self.me == 0:
                    _align_clocks(gathered)
                    step_metrics = self._summarize(step, gathered)
                # the checkpoint before the evaluation, with the step's metrics: an evaluation
                # that fails (a model that cannot run in eval mode) or a process killed during
                # it costs neither the checkpoint nor the step's metrics line (a resume takes it
                # from the checkpoint)
                if self._save_due(step) or (self.stopping and self.config.save_dir is not None):
                    self.save(step, step_metrics)
                # not when a SIGTERM stops the run: its grace period is the checkpoint's (every
                # rank knows alike, from the update's all-reduce)
                if self.evaluation is not None and self.evaluation.due(step, steps[-1]) and not self.stopping:
                    evaluated = self._gather(self.evaluate(step), f"the evaluation after step {step}")
                    if self.me == 0:
                        eval_loss, eval_ms = _evaluation_summary(evaluated)
                        step_metrics = replace(step_metrics, eval_loss=eval_loss, eval_ms=eval_ms)
                if self.me == 0:
                    metrics.append(step_metrics)
                    log.info("step %d loss %.6f iteration %.2f ms", step, step_metrics.loss, step_metrics.iteration_ms)
                    if self.config.print_steps:  # as it ends: a long run shows its progress
                        print(step_line(step_metrics), flush=True)
                    if metrics_file:
                        metrics_file.write_line(json.dumps(step_metrics.to_dict()))
                    if self.config.trace_path and step == self.config.steps - 1:
                        _write_trace(self.config.trace_path, gathered, self.config.replay_time_scale, self.plan.model.name)
                if step == steps[0]:
                    _lower_timeouts(self.watchdog, self.groups, self.config.timeout_s)
                if self.stopping:
                    if self.me == 0:
                        saved = f"; resume with --resume {self.config.save_dir}" if self.config.save_dir else \
                            " (no --save: nothing was saved)"
                        log.warning("stopped after step %d on SIGTERM%s", step, saved)
                    break
            if evaluating_only:
                self._evaluate_checkpoint(metrics_file, held_back)
            if metrics_file:
                metrics_file.commit()
        finally:
            if metrics_file:
                metrics_file.close()
        return tuple(metrics)

    def _gather(self, record: dict[str, Any], what: str) -> list[dict[str, Any]] | None:
        """Every process's ``record``, on global rank 0 (None elsewhere)."""
        self.watchdog.doing(f"gathering {what}")
        gathered = [None] * self.world if self.me == 0 else None
        try:
            dist.gather_object(record, gathered, dst=0, group=self.groups.control)
        except Exception as exc:
            self.watchdog.fail_on(f"gathering {what}", exc)
        return gathered

    def _evaluate_checkpoint(self, metrics_file: StreamedOutput | None, held_back: list[str]) -> None:
        """The evaluation of a resume that has no step to train: of the weights the checkpoint's
        last step left. Its loss joins that step's line of ``--metrics`` (``held_back``, the
        file's last line, replacing an earlier evaluation's), or where the file has none, the
        checkpoint's line of the step (``step_metrics``), or a line of its own for a checkpoint
        without one."""
        step = self.first_step - 1
        try:
            record = self.evaluate(step)
        except BaseException:  # the metrics file loses nothing
            for line in held_back if metrics_file else ():
                metrics_file.write_line(line)
            raise
        gathered = self._gather(record, f"the evaluation after step {step}")
        if self.me != 0:
            return
        eval_loss, eval_ms = _evaluation_summary(gathered)
        if self.config.print_steps:
            print(f"evaluation after step {step}: eval loss {eval_loss:.6f} ({eval_ms:.0f} ms)", flush=True)
        if metrics_file is None:
            return
        line = json.loads(held_back[-1]) if held_back else {}
        if line.get("step") != step:  # a file without the step's line: the checkpoint's own, where it has one
            for earlier in held_back:
                metrics_file.write_line(earlier)
            saved = self.saved_metrics
            line = dict(saved) if isinstance(saved, dict) and saved.get("step") == step else {"step": step}
        metrics_file.write_line(json.dumps({**line, "eval_loss": eval_loss, "eval_ms": round(eval_ms, 4)}))

    # -- checkpoints (octorun.checkpoint) --------------------------------------------------------
    def _save_due(self, step: int) -> bool:
        if self.config.save_dir is None:
            return False
        every = self.config.save_every
        return step == self.config.steps - 1 or (every is not None and (step + 1) % every == 0)

    def _layout(self) -> dict[str, Any]:
        """The plan's shape, as a checkpoint records it: a resume under the same layout also
        restores every rank's RNG state (other layouts have other ranks)."""
        return {"pp": self.plan.pp, "dp": self.plan.parallel.dp, "rank_order": self.plan.parallel.rank_order,
                "stages": [[st.start, st.end, st.rank] for st in self.plan.stages]}

    def sampling(self) -> dict[str, int]:
        """How a global batch is cut: without --data, the model's sample_batch draws each
        microbatch from a generator seeded by (step, replica, microbatch), so another cut draws
        other samples."""
        return {"dp": self.plan.parallel.dp, "microbatches": self.plan.microbatches, "microbatch_size": self.mbs}

    def _model_state(self) -> dict[str, Any]:
        """This rank's parameters and buffers as a checkpoint keys them (``model/`` and the global
        layer index; a tied parameter by its canonical member), the tensors themselves: a load
        copies into them."""
        return model_state(self.layers, self.param_keys)

    def _checkpoint_state(self) -> dict[str, Any]:
        """This rank's share of the checkpoint, keyed by global layer index: parameters (a tied
        one by its canonical member), buffers, the optimizer's state, the RNG states."""
        state = self._model_state()
        if self.optimizer is not None and isinstance(self.optimizer, torch.optim.AdamW):
            for p in self.params:
                moments = self.optimizer.state[p]
                if not moments:  # not stepped yet (or never given a gradient): the state AdamW starts from
                    moments.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                                   exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format))
                for name, value in moments.items():
                    state[f"optim/{self.param_keys[id(p)]}/{name}"] = value
        state[f"rng/rank{self.me}/cpu"] = torch.get_rng_state()
        if self.device.type == "cuda":
            state[f"rng/rank{self.me}/cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def settings(self) -> dict[str, Any]:
        """The training settings a checkpoint records and a resume compares with its own (a
        change is allowed, and said: octorun.runtime.changed_settings)."""
        optim = self.optim_config
        schedule: dict[str, Any] = {"schedule": optim.schedule, "lr": optim.lr, "warmup_steps": optim.warmup_steps}
        if optim.schedule != "constant":  # where the rate decays: to what, and over how many steps
            schedule.update(min_lr=optim.min_lr, steps=optim.decay_steps or self.config.steps)
        return {
            "global_batch": self.global_batch,
            "seed": self.config.seed,
            "precision": self.config.precision,
            "lr_schedule": schedule,
            "weight_decay": optim.weight_decay,
            "betas": list(optim.betas),
            "grad_clip": optim.grad_clip,
            # a replayed run's ops sleep the profile's times x this (null: a run of real compute)
            "replay_time_scale": self.config.replay_time_scale,
        }

    def save(self, step: int, step_metrics: StepMetrics | None = None) -> None:
        """The checkpoint after ``step``; ``step_metrics`` (global rank 0's, whose meta is kept)
        is the step's ``--metrics`` line, for a resume whose metrics file never got it."""
        meta = {
            **model_identity(self.model, self.plan.stages[-1].end),
            "model_config": dict(self.plan.model.config),  # export --format hf writes config.json from it
            "resolved_config": _recorded_config(self.model, self.config),  # what a resume and an export compare
            "step": step + 1,  # the next step to run
            "consumed_samples": self.consumed_samples + (step + 1 - self.first_step) * self.global_batch,
            "skipped_steps": self.skipped_steps,
            "optimizer": self.optim_config.name,
            **self.settings(),
            "data": self.config.data_path,
            "tokens_per_sample": None if self.data is None else self.data.tokens_per_sample,
            "data_fingerprint": None if self.data is None else self.data.fingerprint(),
            "data_sampled_digest": None if self.data is None else self.data.sampled_digest(),
            "plan": self.config.plan_path,
            "layout": self._layout(),
            # how sample_batch's draws were cut (without --data they are seeded per replica and microbatch)
            "sampling": self.sampling(),
            "init_from": self.initialized_from,
            "step_metrics": None if step_metrics is None else step_metrics.to_dict(),
        }
        from octorun import checkpoint

        # named as the folder is: by the steps done, one more than the last step's number
        self.watchdog.doing(f"saving the checkpoint after step {step} ({checkpoint.folder_name(step + 1)})")
        started = time.perf_counter()
        # a slow shard is waited for up to --init-timeout; a hung peer still ends the job in --timeout
        with self.watchdog.watching_beats(), _save_timeouts(self.groups, self.config.first_timeout_s,
                                                              self.watchdog.timeout_s):
            path = checkpoint.save(self.config.save_dir, step + 1, self._checkpoint_state(), meta=meta,
                                   group=self.groups.control, keep=self.config.checkpoints_kept)
        if self.me == 0:
            log.warning("saved %s (%.2f s)", path, time.perf_counter() - started)

    def restore(self, path: Path) -> None:
        """Load a checkpoint written under any plan of this model; continue at its step."""
        from octorun import checkpoint

        meta = checkpoint.read_meta(path)
        self.watchdog.doing(f"loading the checkpoint {path}")
        state = self._checkpoint_state()
        # seq and weights may differ from the checkpoint's (no weight depends on them), but where
        # one does (learned positions), its shape is the first mismatch: say so
        saved, ours = meta.get("resolved_config") or {}, _recorded_config(self.model, self.config) or {}
        moved = [f"{key}={saved[key]} (now {ours.get(key)})" for key in checkpoint.CONFIG_KEYS_APART
                 if key in saved and key in ours and saved[key] != ours[key]]
        fix = {"other_model_fix": f"the checkpoint was trained with {', '.join(moved)}, and a tensor's shape "
                                  "follows it here: resume under a plan of the checkpoint's"} if moved else {}
        missing = checkpoint.load(path, state, group=self.groups.control, optional_prefixes=("rng/",),
                                  whole_prefixes=("model/",), **fix)  # an optim/ key alone: a parameter now frozen
        if meta.get("layout") == self._layout() and not any(key.startswith(f"rng/rank{self.me}/") for key in missing):
            torch.set_rng_state(state[f"rng/rank{self.me}/cpu"])
            if self.device.type == "cuda":
                torch.cuda.set_rng_state(state[f"rng/rank{self.me}/cuda"], self.device)
        self.first_step = int(meta["step"])
        self.consumed_samples = int(meta["consumed_samples"])
        self.skipped_steps = int(meta.get("skipped_steps", 0))
        self.initialized_from = meta.get("init_from")  # the run's lineage goes on in its later saves
        self.saved_metrics = meta.get("step_metrics")  # the --metrics line of the step before first_step

    def load_weights(self, path: Path) -> None:
        """Take the weights of the checkpoint at ``path`` (written under any plan of this model),
        nothing else: the optimizer, the schedule, the RNG and the data start afresh at step 0.
        Every parameter and buffer must be in it, and it must hold no other model's."""
        from octorun import checkpoint

        self.watchdog.doing(f"loading the weights of {path}")
        checkpoint.load(path, self._model_state(), group=self.groups.control, whole_prefixes=("model/",),
                        other_model_fix="give --init-from a checkpoint of this model (the same config)")
        self.initialized_from = str(path)

    def _summarize(self, step: int, records: list[dict[str, Any]]) -> StepMetrics:
        # A replay at another time scale is not the plan's predicted iteration any more.
        scaled = self.config.replay_time_scale not in (None, 1.0)
        predicted = None if scaled else (self.plan.predicted or {}).get("iteration_ms")
        metrics = summarize_step(step, records, predicted if isinstance(predicted, (int, float)) else None)
        mine = records[0]  # every rank took the same update: the same norm, lr and count
        metrics = replace(metrics, lr=mine["lr"], grad_norm=mine["grad_norm"], skipped_steps=mine["skipped_steps"])
        if self.meter is None:
            return metrics
        measured, predicted_peaks = {}, {}
        for name in ("peak_activation_bytes", "peak_with_message_bytes"):
            peaks = [0] * self.plan.pp  # per pipeline rank: the most on any replica
            for record in records:
                peaks[record["pp_rank"]] = max(peaks[record["pp_rank"]], record[name])
            measured[name] = tuple(peaks)
            # under --replay the tensors are the profile's bytes scaled down (bytes_scale): not the plan's
            given = None if self.config.replay_time_scale is not None else (self.plan.predicted or {}).get(name)
            valid = isinstance(given, list) and len(given) == self.plan.pp and all(isinstance(b, int) for b in given)
            predicted_peaks[name] = tuple(given) if valid else None
        return replace(metrics, **measured, **{f"predicted_{name}": value for name, value in predicted_peaks.items()})

    def state(self) -> dict[int, dict[str, torch.Tensor]]:
        return {i: {k: v.detach().cpu().clone() for k, v in layer.state_dict().items()} for i, layer in self.layers.items()}


def _evaluation_summary(records: list[dict[str, Any]]) -> tuple[float, float]:
    """An evaluation's loss (the mean over every last stage's microbatches) and its time on the
    slowest process, in ms, from every process's record."""
    count = sum(r["eval_loss_count"] for r in records)
    return sum(r["eval_loss_sum"] for r in records) / max(count, 1), max(r["eval_s"] for r in records) * 1e3


def _used_flags(params: Sequence[torch.nn.Parameter], like: torch.Tensor) -> torch.Tensor:
    """1 for each parameter that has a gradient here, 0 for one without, in ``like``'s dtype and
    device (summed over the replicas, it counts those that had one)."""
    return torch.tensor([float(p.grad is not None) for p in params], dtype=like.dtype, device=like.device)


def _unique_trainable(layers) -> list[torch.nn.Parameter]:
    """The trainable parameters of ``layers``, each once: a module two layers of one rank share
    (a tied embedding and head) would otherwise be stepped twice by the optimizer."""
    return list({id(p): p for layer in layers for p in layer.parameters() if p.requires_grad}.values())


def step_line(m: StepMetrics) -> str:
    """The line ``octorun`` prints for a step."""
    predicted = f" (predicted {m.predicted_iteration_ms:.2f} ms)" if m.predicted_iteration_ms is not None else ""
    skipped = f"  skipped {m.skipped_steps}" if m.skipped_steps else ""
    evaluated = f"  eval loss {m.eval_loss:.6f} ({m.eval_ms:.0f} ms)" if m.eval_loss is not None else ""
    return (f"step {m.step}: loss {m.loss:.6f}  lr {m.lr:.3g}  grad norm {m.grad_norm:.4g}{skipped}  "
            f"iteration {m.iteration_ms:.2f} ms{predicted}  bubble {m.bubble_ratio:.3f}{evaluated}")


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


def _write_trace(path: str, records: list[dict[str, Any]], replay_time_scale: float | None, model_name: str) -> None:
    """Chrome trace-event JSON of the last step; time 0 is the first op's start. ``otherData``
    names the model and says whether the ops were replayed and at what scale of the profile's
    times."""
    first = min((s[3] for r in records for s in r["spans"]), default=0.0)
    events = []
    for record in sorted(records, key=lambda r: r["rank"]):
        for stage, kind, mb, start, end in record["spans"]:
            events.append({
                "name": f"{stage}{kind}{mb}", "ph": "X", "pid": record["dp_rank"], "tid": record["pp_rank"],
                "ts": round((start - first) * 1e6, 3), "dur": round((end - start) * 1e6, 3), "cat": kind,
                "args": {"stage": stage, "mb": mb, "rank": record["rank"]},
            })
    other = {"source": "octorun", "model": model_name, "replay_time_scale": replay_time_scale}
    write_text(path, json.dumps({"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}), flag="--trace")


def run(config: RunConfig) -> RunResult:
    """Train ``config.steps`` steps of the plan on this process's share of the job.

    Raises :class:`agreement.JobStopped` for bad input found before training starts, on this
    process or a peer (:class:`InputError` where no peer could hear of it). Failures once the job
    runs end the process (and the job) through the watchdog, never with a hang.
    """
    steady_malloc()  # host allocations as the profiler's (octoplan.host_malloc)
    error: InputError | None = None
    try:
        prepared = prepare(config)
        plan = prepared.plan
        _ensure_env()
        world = _check_env(plan, config.plan_path, replay=config.replay_time_scale is not None)
        backend = _backend(config.backend)
    except InputError as exc:  # told to the peers first: they stop too, rather than wait for this process
        error = exc
    except OSError as exc:
        if exc.filename is None:  # not a path's: a failure of the run itself
            raise
        # a path the job reads or writes that the file system refuses (too long a name, no
        # permission): bad input, as octoplan treats it
        error = InputError(str(exc.filename), None, exc.strerror or str(exc), "check the path")
    # two deadlines, as torchtitan has: a generous one until the first step ends (the process
    # group forms, stages build, a checkpoint loads, step 0 sends every layout), --timeout after
    init_timeout_s = config.first_timeout_s
    if not _valid_timeout(init_timeout_s):  # bad input (prepare said so): meet with the default
        init_timeout_s = 300.0
    owns_group = not dist.is_initialized()
    place = _meeting_place(owns_group, error, init_timeout_s)
    if place is not None and (place.world > 1 or place.rank > 0):  # (not a process alone)
        _agree(place, config, error, None if error is not None else prepared,
               backend=None if error is not None else backend)
    if error is not None:
        raise error
    timeout = datetime.timedelta(seconds=init_timeout_s)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    elif prepared.profile_threads and "OMP_NUM_THREADS" not in os.environ:
        # the threads the profile timed the layers with, so that the plan's times hold: a process
        # alone (no torchrun, which sets OMP_NUM_THREADS=1 for several) would take every core
        torch.set_num_threads(prepared.profile_threads)
    if owns_group:
        try:
            with native_stderr_held():
                _init_process_group(backend, world, timeout, place)
        except Exception as exc:  # peers that never came, an address in use: one line, not a trace
            raise _not_formed(world, init_timeout_s, gist(exc)) from None
    elif dist.get_world_size() != world:
        raise InputError(config.plan_path, "cluster.gpus", "does not match the running process group", "launch a matching job")
    me = dist.get_rank()
    watchdog = Watchdog(global_rank=me, timeout_s=init_timeout_s, world=world, record_path=_record_path(config, me))
    groups = _make_groups(prepared, backend=backend, timeout=timeout)
    watchdog.store = groups.store
    watchdog.register()
    watchdog.open_record()
    watchdog.start()
    _stop_on_sigterm()
    if config.save_dir is not None or config.resume is not None or config.init_from is not None:
        from octorun import checkpoint  # DCP: imported by the runs that use it
    if config.save_dir is not None:
        watchdog.on_bad_input.append(checkpoint.let_go_of_roots)
        try:
            checkpoint.check_one_root(config.save_dir, group=groups.control)
        except InputError:
            # every rank found the same and stops alike: each node says it once (octorun.cli),
            # with nobody to tell through the watchdog
            watchdog.stop()
            watchdog.close_record(keep=False)
            _leave_together(groups, owns_group)
            raise
        except Exception as exc:
            watchdog.fail_on("checking --save", exc)
    try:
        interpreter = _Interpreter(prepared, config, groups=groups, watchdog=watchdog, device=device, model=prepared.model)
    except InputError as exc:
        watchdog.fail(exc.line(), code=EXIT_BAD_INPUT)
    except MODEL_CODE_FAILURES as exc:
        watchdog.fail(f"building the stages failed while {watchdog.activity}: {gist(exc)}")
    if config.resume is not None:
        resumed = None if prepared.resume_from is None else int(checkpoint.read_meta(prepared.resume_from)["step"])
        try:
            checkpoint.agree(resumed, group=groups.control,
                             save=None if prepared.resume_from is None else checkpoint.saved_by(prepared.resume_from))
            if prepared.resume_from is not None:
                interpreter.restore(prepared.resume_from)
                if me == 0:
                    log.warning("resumed from %s at step %d", prepared.resume_from, interpreter.first_step)
                    chosen = config.resume == "auto" or Path(config.resume).resolve() != prepared.resume_from.resolve()
                    for damaged in checkpoint.damaged_after(prepared.resume_from.parent, resumed) if chosen else ():
                        log.warning("passed over %s, a later checkpoint that is not complete (a file of it is gone)",
                                    damaged)
                    saved = checkpoint.read_meta(prepared.resume_from)
                    # (a resume with nothing left to train, one that only evaluates, trains on nothing)
                    trains = interpreter.first_step < config.steps
                    changed = changed_settings(saved, interpreter.settings()) if trains else []
                    if changed:  # allowed (a new learning rate, a longer run), but never unsaid
                        log.warning("this run's settings differ from the checkpoint's: %s; the run goes on with its own",
                                    ", ".join(changed))
                    changed_data = _changed_data(saved, prepared.data, interpreter) if trains else None
                    if changed_data:
                        log.warning("%s", changed_data)
        except InputError as exc:
            watchdog.fail(exc.line(), code=EXIT_BAD_INPUT)
        except Exception as exc:
            watchdog.fail(f"loading the checkpoint {prepared.resume_from} failed: {gist(exc)}")
        if me == 0 and interpreter.first_step >= config.steps:
            # a restart script rerun after the job ended: not an error, but nothing is measured,
            # so a --trace asked for is not written (an old one stays as it was)
            untraced = f"; --trace {config.trace_path} is not written" if config.trace_path else ""
            evaluated = "; evaluating its weights on --eval-data" if prepared.evaluation is not None else ""
            log.warning("the checkpoint is at step %d, not below --steps %d: nothing to train%s%s", interpreter.first_step,
                        config.steps, evaluated, untraced)
    if prepared.init_from is not None:  # set only where nothing was resumed (prepare)
        try:
            checkpoint.agree(int(checkpoint.read_meta(prepared.init_from)["step"]), group=groups.control,
                             save=checkpoint.saved_by(prepared.init_from), flag="--init-from")
            interpreter.load_weights(prepared.init_from)
            if me == 0:
                log.warning("took the weights of %s; the optimizer, the learning-rate schedule and the data start at "
                            "step 0", prepared.init_from)
        except InputError as exc:
            watchdog.fail(exc.line(), code=EXIT_BAD_INPUT)
        except Exception as exc:
            watchdog.fail(f"loading the weights of {prepared.init_from} failed: {gist(exc)}")
    elif config.init_from is not None and me == 0:
        log.warning("resumed from %s: --init-from %s is for a fresh start and is not read", prepared.resume_from,
                    config.init_from)
    if me == 0 and prepared.data is not None and prepared.data.num_windows < interpreter.global_batch:
        # each step then reads some windows twice or more
        log.warning("%s holds %d windows of %d tokens, fewer than one global batch of %d samples: each step reads "
                    "some of them more than once", prepared.data.path, prepared.data.num_windows,
                    prepared.data.tokens_per_sample, interpreter.global_batch)
    if me == 0 and prepared.evaluation is not None and prepared.data is not None and \
            _same_file(prepared.evaluation.data.path, prepared.data.path):
        log.warning("--eval-data is the --data file: the evaluation measures the loss on the training data")
    if me == 0 and config.replay_time_scale is not None and config.precision != "fp32":
        log.warning("--precision %s changes nothing under --replay: its layers sleep the profile's times", config.precision)
    if me == 0 and prepared.profile_precision not in (None, config.precision):
        # a run of another precision than its profile's: the plan's times and memory are not its own
        log.warning("the plan's profile was measured at --precision %s, this run is %s: the plan's predicted times and "
                    "activation bytes are %s's (run with --precision %s, or profile at %s)", prepared.profile_precision,
                    config.precision, prepared.profile_precision, prepared.profile_precision, config.precision)
    try:
        metrics = interpreter.train()
    except NonFiniteStep as exc:
        watchdog.stop()  # every rank stops here, at the same step: nobody is to be told
        if me == 0:
            sys.stderr.write(f"octorun: {exc}\n")
        sys.stderr.flush()
        os._exit(1)
    except InputError as exc:  # the model file's fault, found as it runs (sample_batch's return ...)
        watchdog.fail(f"while {watchdog.activity}: {exc.line()}", code=EXIT_BAD_INPUT)
    except MODEL_CODE_FAILURES as exc:  # anything unexpected (the model file's exit too) ends the whole job, with its reason
        watchdog.fail_on(f"failed while {watchdog.activity}", exc)
    # Peers that finish may close the store; stop polling it, then meet once more (with a
    # deadline: the control group's timeout) so nobody leaves while another still sends.
    watchdog.stop()
    try:
        dist.barrier(group=groups.control)
    except Exception as exc:
        watchdog.fail_on("final barrier", exc)
    result = RunResult(global_rank=me, pp_rank=interpreter.pp_rank, dp_rank=interpreter.dp_rank,
                       metrics=metrics, state=interpreter.state(), stopped_early=interpreter.stopping)
    if owns_group and not result.stopped_early:
        dist.destroy_process_group()
    watchdog.close_record(keep=False)  # the record is for runs that fail
    return result


def _changed_data(saved: dict[str, Any], data: Any, interpreter: "_Interpreter") -> str | None:
    """What a resume trains on that the checkpoint did not, said as a warning; None where it
    reads on as the uninterrupted run would."""
    trained_on = saved.get("data")
    if trained_on and data is None:  # a restart script that lost its --data
        return f"the checkpoint was trained on --data {trained_on}; this run has no --data and trains on the model's " \
               "sample_batch"
    if not trained_on and data is not None:
        return f"the checkpoint was trained on the model's sample_batch; this run reads --data {data.path} from " \
               f"sample {interpreter.consumed_samples} on"
    if not trained_on and saved.get("sampling") not in (None, interpreter.sampling()):
        # a resume under another plan is the same math on the same samples only with --data
        return "without --data, the model's sample_batch draws each microbatch by its step, replica and index: this " \
               f"plan's {_cut(interpreter.sampling())} draws other samples than the checkpoint's {_cut(saved['sampling'])}"
    return None


def _cut(sampling: dict[str, int]) -> str:
    return f"{sampling['dp']} replica(s) x {sampling['microbatches']} microbatches of {sampling['microbatch_size']}"


def _remove_if_empty(path: Path) -> None:
    if path.stat().st_size == 0:
        path.unlink()


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _leave_together(groups: _Groups, owns_group: bool) -> None:
    """Meet once more and take the group down, as a run's end does, before every process leaves
    with the same error: the store may live in one of them. Failing here only ends the wait."""
    with contextlib.suppress(Exception):
        dist.barrier(group=groups.control)
    if owns_group:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


# Set by SIGTERM (what a cluster scheduler sends before preemption): the rank finishes its step;
# the step's all-reduce tells every rank, and all of them save and leave after that same step.
_STOP_REQUESTED = threading.Event()


def _stop_on_sigterm() -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers belong to the main thread
    _STOP_REQUESTED.clear()
    signal.signal(signal.SIGTERM, lambda signum, frame: _STOP_REQUESTED.set())


def _earlier_metrics(path: str, first_step: int, saved: dict[str, Any] | None = None) -> list[str]:
    """A resumed run's metrics keep the lines of the steps before it: those the interrupted run
    wrote (its PATH.partial, newest) or an earlier run ended with (PATH), so that a run restarted
    any number of times ends with one line per step. ``saved`` is the checkpoint's line of the
    step it was saved after: a file whose line of that step has another loss, or that stops
    before the step ahead of it, is another run's and is not kept; where the files hold earlier lines but not that one (the process died
    between the save and the line, during an evaluation), it is ``saved``, without the
    evaluation's figures. Empty for a run from step 0; a file of no earlier line is another
    segment's."""
    if first_step <= 0:
        return []
    last = first_step - 1
    if not (isinstance(saved, dict) and saved.get("step") == last):
        saved = None
    lines: dict[int, str] = {}
    for source in (Path(path), partial_path(path)):
        try:
            text = source.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        found: dict[int, tuple[str, dict]] = {}
        for line in text.splitlines():
            try:
                record = json.loads(line)
                step = record["step"]
            except (ValueError, KeyError, TypeError, RecursionError):
                continue  # a line cut by a crash, or not ours
            if isinstance(step, int) and 0 <= step < first_step:
                found[step] = (line, record)
        if saved is not None and "loss" in found.get(last, (None, {}))[1] and \
                json.dumps(found[last][1]["loss"]) != json.dumps(saved.get("loss")):
            log.warning("%s holds another run's metrics (its step %d has loss %s, the checkpoint's %s): its lines are "
                        "not kept", source, last, found[last][1].get("loss"), saved.get("loss"))
            continue
        if found and max(found) < last - 1:
            # this run wrote a line of every step before the checkpoint's (that one a process
            # killed during an evaluation misses): a file that stops sooner is another run's
            log.warning("%s holds another run's metrics (its last line is of step %d; the checkpoint is after step %d): "
                        "its lines are not kept", source, max(found), last)
            continue
        lines.update((step, line) for step, (line, _) in found.items())
    if lines and last not in lines and saved is not None:
        lines[last] = json.dumps(saved)
    return [lines[step] for step in sorted(lines)]


def _record_path(config: RunConfig, rank: int) -> str | None:
    """Where a rank keeps the record of its last activities: beside --metrics (out/train.jsonl:
    out/train.rank3.ops.txt), while the run lasts, and after it when it failed."""
    if not config.metrics_path:
        return None
    path = Path(config.metrics_path)
    return str(path.with_name(f"{path.stem}.rank{rank}.ops.txt"))


def _lower_timeouts(watchdog: Watchdog, groups: _Groups, timeout_s: float) -> None:
    """After the first step: --timeout for every wait from here on (the watchdog's deadlines and
    the collectives' own timeouts, through a private API where torch has it)."""
    if watchdog.timeout_s == timeout_s:
        return
    watchdog.timeout_s = timeout_s
    _set_group_timeouts(groups, timeout_s)


@contextlib.contextmanager
def _save_timeouts(groups: _Groups, save_timeout_s: float, timeout_s: float):
    """A checkpoint's save waits in collectives while the slowest rank writes its shard, which
    takes as long as the storage needs, not as long as a step: --init-timeout for those waits
    (the first step's allowance, which also covers loading one), then --timeout again."""
    if save_timeout_s <= timeout_s:
        yield
        return
    _set_group_timeouts(groups, save_timeout_s)
    try:
        yield
    finally:
        _set_group_timeouts(groups, timeout_s)


def _set_group_timeouts(groups: _Groups, timeout_s: float) -> None:
    timeout = datetime.timedelta(seconds=timeout_s)
    lowered: list[Any] = [None]  # None: the default group
    for group in (groups.control, groups.dp_group, *groups.tied):
        if group is not None and all(group is not other for other in lowered):
            lowered.append(group)
    for group in lowered:
        try:
            dist.distributed_c10d._set_pg_timeout(timeout, group)
        except Exception as exc:  # private API: the watchdog's deadlines still hold
            log.debug("could not set a group's timeout: %s", exc)
