"""The optimizer step of one rank: AdamW or SGD over fp32 master parameters, the learning-rate
schedule, gradient clipping on the global norm, and the non-finite guard.

What crosses ranks: every pipeline rank holds only its stages' parameters, so the global
gradient norm is a sum over ranks. One all-reduce per step carries, per stage, the sum of squares
of the gradients that stage owns (each parameter counted once: a data-parallel replica's copy
only on replica 0, a tied tensor only on the stage of its canonical member) and whether a
non-finite value appeared in that stage's forward; every rank then takes the same decision
(clip by the same factor, skip or stop) from the same numbers.

The norm is computed as torch.nn.utils.clip_grad_norm_ computes it on one process: each
gradient's 2-norm, then the 2-norm of those norms (here: the norms squared, summed in float64),
and the clip factor ``min(1, max_norm / (norm + 1e-6))`` multiplies every gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from octoplan.errors import InputError

__all__ = ["OptimizerConfig", "SCHEDULES", "OPTIMIZERS", "lr_at", "build_optimizer", "check_optimizer_config",
           "squared_norms", "clip_factor"]

OPTIMIZERS = ("sgd", "adamw")
SCHEDULES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class OptimizerConfig:
    name: str = "sgd"  # sgd is plain: no momentum, no weight decay
    lr: float = 1e-3
    weight_decay: float = 0.0  # AdamW's decoupled decay, on matrices only (ndim >= 2)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float | None = None  # max global 2-norm; None: no clipping
    schedule: str = "constant"
    warmup_steps: int = 0
    min_lr: float = 0.0
    # the steps the schedule spans (None: the run's --steps); a run that stops early to be
    # resumed elsewhere keeps the one curve of the whole training
    decay_steps: int | None = None
    skip_nonfinite: bool = False  # skip the update of a step with a non-finite loss or gradient


def check_optimizer_config(config: OptimizerConfig, *, steps: int) -> None:
    """Every field a user can get wrong, as one line naming the flag."""
    if config.name not in OPTIMIZERS:
        raise InputError(None, "--optimizer", f"is {config.name!r}", f"use one of {', '.join(OPTIMIZERS)}")
    if not (math.isfinite(config.lr) and config.lr >= 0):
        raise InputError(None, "--lr", f"is {config.lr}", "give a learning rate >= 0")
    if not (math.isfinite(config.weight_decay) and config.weight_decay >= 0):
        raise InputError(None, "--weight-decay", f"is {config.weight_decay}", "give a decay >= 0")
    if config.weight_decay and config.name != "adamw":
        raise InputError(None, "--weight-decay", "needs --optimizer adamw", "add --optimizer adamw or drop --weight-decay")
    if len(config.betas) != 2 or not all(math.isfinite(b) and 0 <= b < 1 for b in config.betas):
        raise InputError(None, "--betas", f"is {' '.join(map(str, config.betas))}", "give two numbers in [0, 1), e.g. --betas 0.9 0.95")
    if config.grad_clip is not None and not (math.isfinite(config.grad_clip) and config.grad_clip > 0):
        raise InputError(None, "--grad-clip", f"is {config.grad_clip}", "give a positive max norm")
    if config.schedule not in SCHEDULES:
        raise InputError(None, "--lr-schedule", f"is {config.schedule!r}", f"use one of {', '.join(SCHEDULES)}")
    if config.decay_steps is not None and not 1 <= config.decay_steps <= 10**9:
        raise InputError(None, "--decay-steps", f"is {config.decay_steps}", "give the schedule's length in steps, >= 1")
    span = config.decay_steps or steps
    if config.warmup_steps < 0:
        raise InputError(None, "--warmup-steps", f"is {config.warmup_steps}", "give 0 or more steps")
    if config.warmup_steps > span:
        length = "--decay-steps" if config.decay_steps else "--steps"
        raise InputError(None, "--warmup-steps", f"is {config.warmup_steps}, more than the schedule's {span} steps "
                         f"({length})", f"give a number from 0 to {span}, or a longer {length}")
    if not (math.isfinite(config.min_lr) and 0 <= config.min_lr <= config.lr):
        raise InputError(None, "--min-lr", f"is {config.min_lr}", f"give 0 to --lr ({config.lr:g})")
    # options that would be ignored without a word (as --weight-decay with sgd, above)
    if tuple(config.betas) != OptimizerConfig.betas and config.name != "adamw":
        raise InputError(None, "--betas", "needs --optimizer adamw", "add --optimizer adamw or drop --betas")
    if config.schedule == "constant":
        for flag, given in (("--min-lr", config.min_lr != 0), ("--decay-steps", config.decay_steps is not None)):
            if given:
                raise InputError(None, flag, "shapes a falling schedule, and --lr-schedule is constant",
                                 f"add --lr-schedule cosine (or linear), or drop {flag}")


def lr_at(config: OptimizerConfig, step: int, total_steps: int) -> float:
    """The learning rate of ``step`` (0-based) in a run of ``total_steps`` (``decay_steps`` when set).

    Warm-up rises linearly to ``lr`` over the first ``warmup_steps`` steps (step k uses
    lr * (k + 1) / warmup, so no step trains at 0); then ``constant`` stays, ``linear`` and
    ``cosine`` fall from ``lr`` to ``min_lr`` at the last step (a single step after warm-up
    trains at ``lr``; steps past the last at ``min_lr``).
    """
    total_steps = config.decay_steps or total_steps
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    if config.schedule == "constant":
        return config.lr
    decay_steps = total_steps - config.warmup_steps
    into = step - config.warmup_steps
    if into >= decay_steps:  # past the schedule's span (a run longer than --decay-steps)
        progress = 1.0
    else:  # a span of one step is its first: it trains at lr, as Megatron-LM's does
        progress = 0.0 if decay_steps == 1 else into / (decay_steps - 1)
    if config.schedule == "linear":
        factor = 1.0 - progress
    else:
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr + (config.lr - config.min_lr) * factor


def build_optimizer(params: Sequence[torch.nn.Parameter], config: OptimizerConfig) -> torch.optim.Optimizer | None:
    """The optimizer of one rank's unique trainable parameters (None when it has none).

    AdamW's weight decay applies to matrices and embeddings (ndim >= 2), not to biases and
    norm scales, as Megatron-LM and nanoGPT decay them.
    """
    if not params:
        return None
    if config.name == "sgd":
        return torch.optim.SGD(params, lr=config.lr, momentum=0, weight_decay=0)
    decayed = [p for p in params if p.dim() >= 2]
    kept = [p for p in params if p.dim() < 2]
    groups = [group for group in ({"params": decayed, "weight_decay": config.weight_decay},
                                  {"params": kept, "weight_decay": 0.0}) if group["params"]]
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps)


def squared_norms(grads: Iterable[torch.Tensor | None]) -> torch.Tensor:
    """The sum over ``grads`` of each one's 2-norm squared, in float64 (on the gradients' device)."""
    total = None
    for grad in grads:
        if grad is None:
            continue
        term = torch.linalg.vector_norm(grad).double().square()  # in the gradient's dtype, as torch's clip does
        total = term if total is None else total + term
    return torch.zeros((), dtype=torch.float64) if total is None else total


def clip_factor(total_norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: 1 below the limit."""
    return min(1.0, max_norm / (total_norm + 1e-6))
