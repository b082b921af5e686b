"""Training precision: what ``--precision fp32|bf16`` means, in one place for the profiler and
the runtime, so that a layer is measured exactly as it will run.

bf16 is the standard mixed-precision recipe: parameters, their gradients and the optimizer's
state stay fp32 ("master" weights); each layer's forward runs under :func:`torch.autocast` with
bfloat16, so matrix products compute (and autograd saves their inputs) in bf16; the backward runs
outside autocast and produces fp32 gradients, which the data-parallel all-reduce sums in fp32.
No loss scaling: bf16 has fp32's exponent range.

One autocast region per layer call (not per stage): the profiler times one layer at a time, and
autocast caches each weight's bf16 copy for the length of a region, so per-layer regions make the
bytes the runtime saves per microbatch those the profiler measured.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import ContextManager

import torch

__all__ = ["PRECISIONS", "DEFAULT_PRECISION", "PROFILE_DTYPE", "autocast", "check_precision"]

PRECISIONS = ("fp32", "bf16")
DEFAULT_PRECISION = "fp32"
# the profile's ``dtype`` field for each precision: the dtype layers compute in
PROFILE_DTYPE = {"fp32": "float32", "bf16": "bfloat16"}


def check_precision(value: str, flag: str = "--precision") -> str:
    from octoplan.errors import InputError

    if value not in PRECISIONS:
        raise InputError(None, flag, f"is {value!r}", f"use one of {', '.join(PRECISIONS)}")
    return value


def autocast(device: torch.device | str, precision: str) -> ContextManager:
    """The context one layer's forward runs in at ``precision`` on ``device``."""
    if precision == "fp32":
        return nullcontext()
    device_type = torch.device(device).type
    return torch.autocast(device_type=device_type, dtype=torch.bfloat16)
