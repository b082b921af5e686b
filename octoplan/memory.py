"""The memory model: what one GPU holds while it runs its stages.

Per rank, per stage it holds:
- *static* bytes for the whole iteration: weights, gradients and optimizer state (here), and
  the layers' buffers (``buffer_bytes``, held as they are). The default
  state model is mixed-precision Adam (Megatron-LM's and DeepSpeed's default): weights and
  gradients in the profile's dtype, plus an fp32 master copy and fp32 Adam moments m and v —
  16 bytes per parameter for bf16/fp16 profiles, and 16 for fp32 profiles too (4 + 4 + 8, no
  master copy needed). ``sgd`` keeps no moments. No ZeRO sharding across dp is assumed.
  A profile measured under bf16 autocast (``precision: bf16``) keeps fp32 parameters, so its
  ``param_bytes`` are fp32 bytes (:attr:`octoplan.profile.Profile.param_dtype_bytes` is 4):
  fp32 weights + fp32 gradients + two fp32 moments, 16 bytes per parameter (8 with ``sgd``),
  as octorun trains it — not half of that for its ``dtype: bfloat16``.
  A tied tensor (``Profile.tied``) that one rank holds for several of its layers is one tensor
  there: the rank counts it once (the simulator subtracts the copies its layers' figures repeat).
- *activations*: a stage's ``activation_bytes`` (summed over its layers, each layer's input
  among them) per microbatch, held from the start of its F. A B frees them. A split
  backward's I frees, layer by layer from the last, all but what W reads (``w_saved_bytes``)
  and keeps the gradients W starts from (``pending_w_bytes``): its W frees those. The stage's
  output no tape holds once sent, so two consecutive stages on one rank share nothing but the
  second's input. A stage that recomputes holds only its input that long, and its rebuilt
  activations from its I on (or during its B) as above (:class:`octoplan.costs.StageCost`;
  the simulator applies all of it, with the peak an I reaches while it runs, and ``octorun
  --activation-memory`` measures the same quantity: ``tests/test_activation_memory.py``).
- *messages*: what the transport keeps beside the tapes — received tensors not yet used, the
  receive posted ahead on each incoming channel, sends not yet let go. The simulator counts
  them in the peak from the timeline (``octoplan.simulator._message_peaks``); the meter does not.
"""

from __future__ import annotations

__all__ = ["OPTIMIZER_STATE_MODELS", "static_bytes"]

OPTIMIZER_STATE_MODELS = ("adam-mixed", "sgd")


def static_bytes(param_bytes: int, *, dtype_bytes: int, optimizer: str = "adam-mixed") -> int:
    """Weights + gradients + optimizer state of ``param_bytes`` worth of parameters, each
    ``dtype_bytes`` long (a profile's :attr:`~octoplan.profile.Profile.param_dtype_bytes`)."""
    num_params = param_bytes / dtype_bytes
    weights_and_grads = 2 * param_bytes
    master_copy = 4 * num_params if dtype_bytes < 4 else 0
    if optimizer == "adam-mixed":
        state = 8 * num_params + master_copy
    elif optimizer == "sgd":
        state = master_copy
    else:
        raise ValueError(f"unknown optimizer state model {optimizer!r}; use one of {OPTIMIZER_STATE_MODELS}")
    return int(weights_and_grads + state)
