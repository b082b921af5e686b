"""The replay model: a model file that takes exactly the times a profile says it takes.

Given any profile (measured or analytic, e.g. a 70B model on an H100), this builds a chain of
tiny layers whose forward, input-gradient and weight-gradient each *sleep* for ``time_scale``
times the profile's ``forward_ms``, ``backward_input_ms`` and ``backward_weight_ms``. The runtime
can then execute a plan for a model it could never hold, on a laptop, and the measured
iteration can be compared with the simulator's prediction.

Config (the keyword arguments of every function, e.g. a profile's ``model.config``):

    profile      path of the profile YAML to replay (relative to the working directory); required
    time_scale   multiplies every time (default 1.0)
    bytes_scale  multiplies each layer's ``output_bytes`` to size the float32 tensor it passes on
                 (default 1e-3, at least ``MIN_ELEMENTS`` elements per sample), so transfers
                 keep the profile's proportions while staying small

Layer i is a :class:`ReplayLayer`. Its output is ``input_path(resize(x)) + weight_path(w)``:

- ``resize`` averages (shrink) or repeats (grow) the (mbs, n_in) input into (mbs, n_out), with
  no parameters;
- ``input_path`` is the identity whose backward sleeps ``backward_input_ms``;
- ``weight_path`` is the identity on the layer's weight (a real (n_out,) parameter, so SGD
  changes it) whose backward sleeps ``backward_weight_ms``; forward sleeps ``forward_ms``.

The two sleeps sit on separate branches of the graph, and autograd runs only the nodes that lead
to the tensors asked for: ``torch.autograd.grad(out, x)`` sleeps the input time only,
``torch.autograd.grad(out, layer.parameters())`` the weight time only, and a fused backward both.
This is exactly the per-layer I/W split the runtime and the profiler use (the profiler's
boundary-capture W, which restarts at the add where the weight branch leaves the input path, also
sleeps the weight time only).
When the profile measured a fused backward (a layer's ``backward_ms``), a pass that runs both
branches (a B op) sleeps that in all, shared between the branches in proportion to their own
times. The first layer's input is data, so it has only the weight branch: there every pass
sleeps the weight time, which is also what the profiler measures as its fused backward.

The times are wall-clock sleeps on the host: a clock that counts only CPU time (octoplan's
profiler on a CPU with one thread) sees none of them, so ``PROFILE_CLOCK`` has the profiler time
this model by the wall clock.

Sizes: the tensor after layer i has ``max(MIN_ELEMENTS, round(output_bytes * bytes_scale / 4 /
microbatch_size))`` elements per sample, ``microbatch_size`` being the profile's. The profile
does not record the model's input, so ``sample_batch`` gives a (mbs, n) float tensor with layer
0's output size, and targets shaped like the last layer's output; ``loss_fn`` is the mean squared
difference.

Optional hooks (docs/FORMATS.md section 4): ``layer_kind`` / ``layer_name`` return the replayed
profile's ``kind`` / ``name``, so profiling this model reproduces the profile's layer names.
"""

from __future__ import annotations

import functools
import os
import time
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from octoplan.errors import InputError
from octoplan.profile import Profile, load_profile

__all__ = [
    "NAME",
    "PROFILE_CLOCK",
    "CONFIG",
    "MIN_ELEMENTS",
    "num_layers",
    "build_layer",
    "sample_batch",
    "loss_fn",
    "layer_kind",
    "layer_name",
    "ReplayLayer",
]

NAME = "replay"
PROFILE_CLOCK = "wall"  # its layers sleep: a clock of CPU time would see none of it
MIN_ELEMENTS = 8
CONFIG = {"profile": None, "time_scale": 1.0, "bytes_scale": 1e-3}


@dataclass(frozen=True)
class _Replay:
    profile: Profile
    time_scale: float
    bytes_scale: float

    def elements(self, index: int) -> int:
        """Elements per sample of the tensor layer ``index`` outputs (and layer index+1 reads)."""
        layer = self.profile.layers[index]
        scaled = layer.output_bytes * self.bytes_scale / 4 / self.profile.microbatch_size
        return max(MIN_ELEMENTS, round(scaled))


@functools.lru_cache(maxsize=16)
def _load(path: str, mtime_ns: int) -> Profile:
    del mtime_ns  # part of the cache key only: an edited profile is read again
    return load_profile(path)


def _replay(profile: str | None = None, time_scale: float = 1.0, bytes_scale: float = 1e-3) -> _Replay:
    if not profile:
        raise InputError(None, "config.profile", "is not set", "set model.config.profile to the profile YAML to replay")
    try:
        mtime_ns = os.stat(profile).st_mtime_ns
    except OSError:
        raise InputError(str(profile), None, "no such profile to replay", "check config.profile of the replay model") from None
    for field, value in (("time_scale", time_scale), ("bytes_scale", bytes_scale)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise InputError(None, f"config.{field}", f"is {value!r}", "give a number >= 0")
    return _Replay(profile=_load(str(profile), mtime_ns), time_scale=float(time_scale), bytes_scale=float(bytes_scale))


class _Sleeper:
    """Sleeps that last their time on average, as the GPU op they stand for would.

    ``time.sleep`` wakes late: tens of microseconds on an idle machine, 0.3-2 ms on a loaded
    2-core box, where a woken process waits for a core. Left alone, every replayed op inherits
    that, and so would every fidelity figure measured with the replay. Each sleep is therefore
    shortened by the lateness the earlier sleeps of this process showed (a running estimate;
    each step moves it by at most ``STEP_S``, so one stall of a loaded machine cannot zero the
    following sleeps), never below zero.
    """

    GAIN = 0.2
    STEP_S = 0.001

    def __init__(self, clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep):
        self.clock = clock
        self.sleep = sleep
        self.early_s = 0.0  # how much earlier than asked to wake up

    def __call__(self, ms: float, *, since: float | None = None) -> None:
        """Sleep ``ms``, counted from ``since`` (a ``clock()`` reading) when given: the work
        done since then is absorbed into the sleep instead of adding to it."""
        if ms <= 0:
            return
        wanted = ms / 1000.0
        end = (self.clock() if since is None else since) + wanted
        self.sleep(max(0.0, end - self.clock() - self.early_s))
        late = self.clock() - end
        self.early_s = max(0.0, self.early_s + self.GAIN * max(-self.STEP_S, min(self.STEP_S, late)))


_sleep_ms = _Sleeper()


class _Branches:
    """The two backward branches of one forward of a layer. In a pass that runs both (a B op)
    they share the fused time, each in proportion to its own; a pass that runs one (an I or a
    W op) sleeps that branch's own time.

    A pass's sleeps are counted from the moment the layer's backward begins (the add that joins
    the branches), so the layer's own CPU work in that pass (the add's, the resize's) is absorbed
    into its time rather than added to it, as the forward's is. Without that, a B op ran over its
    profiled time by about 0.2 ms per layer on an idle CPU (benchmarks/bench_replay_absorb.py), and a stage
    of many layers over by more than one of few."""

    def __init__(self, input_ms: float, weight_ms: float, fused_ms: float | None):
        self.own_ms = (input_ms, weight_ms)
        self.fused_ms = fused_ms
        self.nodes: list[weakref.ref | None] = [None, None]  # the branches' autograd nodes
        self.since: float | None = None  # where this pass's next sleep is counted from
        self.waiting: set[int] = set()  # the branches this pass runs that have not slept yet

    def watch(self, *outputs: torch.Tensor) -> None:
        self.nodes = [None if out.grad_fn is None else weakref.ref(out.grad_fn) for out in outputs]

    def begin_pass(self, _grads=None) -> None:
        """Pre-hook of the joining add: a pass through this layer starts its clock here."""
        self.since = _sleep_ms.clock()
        self.waiting = {branch for branch, ref in enumerate(self.nodes) if self._runs(ref)}

    @staticmethod
    def _runs(ref: weakref.ref | None) -> bool:
        node = None if ref is None else ref()
        return node is not None and torch._C._will_engine_execute_node(node)

    def sleep(self, branch: int) -> None:
        """Sleep this branch's share, counted on from where the pass's clock stands; a pass that
        did not enter through the add (a W restarted below it) sleeps from now."""
        ms = self.sleep_ms(branch)
        since = self.since if branch in self.waiting else None
        self.waiting.discard(branch)
        _sleep_ms(ms, since=since)
        # the next branch of this pass starts where this one was due to end, not where it woke
        self.since = since + ms / 1000.0 if since is not None and self.waiting else None

    def sleep_ms(self, branch: int) -> float:
        own = self.own_ms[branch]
        ref = self.nodes[1 - branch]
        other = None if ref is None else ref()
        # private, but torch.utils.checkpoint relies on it too: does this pass run the other node?
        if self.fused_ms is None or other is None or not torch._C._will_engine_execute_node(other):
            return own
        split = sum(self.own_ms)
        return self.fused_ms * own / split if split > 0 else self.fused_ms / 2


class _SleepOnBackward(torch.autograd.Function):
    """Identity whose backward sleeps: the cost of one branch of a layer's backward."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, branches: _Branches, branch: int) -> torch.Tensor:
        ctx.branches, ctx.branch = branches, branch
        return tensor.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.branches.sleep(ctx.branch)
        return grad, None, None


class ReplayLayer(nn.Module):
    """One profile layer: sleeps its forward time, and its I and W times on separate branches."""

    def __init__(
        self, *, name: str, kind: str, in_elements: int, out_elements: int, forward_ms: float, input_ms: float, weight_ms: float,
        fused_ms: float | None = None,
    ):
        super().__init__()
        self.name = name
        self.kind = kind
        self.out_elements = out_elements
        self.forward_ms = forward_ms
        self.input_ms = input_ms
        self.weight_ms = weight_ms
        self.fused_ms = fused_ms
        self.weight = nn.Parameter(0.1 * torch.randn(out_elements))
        # Resizing by index (never a pooling op or a matmul): on a CPU those run on the thread
        # pool even for a few elements, and waking pool threads after a sleep can cost more than
        # the sleep on a busy machine. Every input element reaches the output either way.
        if out_elements >= in_elements:  # grow: output j repeats input j * n_in // n_out
            self.register_buffer("pick", torch.arange(out_elements) * in_elements // out_elements, persistent=False)
        else:  # shrink: input j joins bucket j * n_out // n_in, each bucket averaged
            bucket = torch.arange(in_elements) * out_elements // in_elements
            self.register_buffer("bucket", bucket, persistent=False)
            self.register_buffer("inverse_count", 1.0 / torch.bincount(bucket).float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the layer's own CPU work first, then the sleep to the forward time counted from entry:
        # work that runs slowly after a wake-up (a cold core) is absorbed, not added
        began = _sleep_ms.clock()
        branches = _Branches(self.input_ms, self.weight_ms, self.fused_ms)
        # the input branch's sleep comes before the resize, so in the backward it runs after the
        # resize's gradient and absorbs it too
        slept = _SleepOnBackward.apply(x, branches, 0)
        weighted = _SleepOnBackward.apply(self.weight, branches, 1)
        branches.watch(slept, weighted)
        out = self._resize(slept) + weighted
        if out.grad_fn is not None:
            out.grad_fn.register_prehook(branches.begin_pass)
        _sleep_ms(self.forward_ms, since=began)
        return out

    def _resize(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "pick"):
            return x.index_select(1, self.pick)
        summed = x.new_zeros(x.shape[0], self.out_elements).index_add(1, self.bucket, x)
        return summed * self.inverse_count

    def extra_repr(self) -> str:
        return (
            f"{self.name!r}, kind={self.kind!r}, out={self.out_elements}, F={self.forward_ms:.3g} ms, "
            f"I={self.input_ms:.3g} ms, W={self.weight_ms:.3g} ms"
            + ("" if self.fused_ms is None else f", B={self.fused_ms:.3g} ms")
        )


def num_layers(**config) -> int:
    return _replay(**config).profile.num_layers


def layer_kind(index: int, **config) -> str:
    return _replay(**config).profile.layers[index].kind


def layer_name(index: int, **config) -> str:
    return _replay(**config).profile.layers[index].name


def build_layer(index: int, **config) -> nn.Module:
    replay = _replay(**config)
    if not 0 <= index < replay.profile.num_layers:
        raise IndexError(f"layer {index} out of range 0..{replay.profile.num_layers - 1}")
    layer = replay.profile.layers[index]
    scale = replay.time_scale
    return ReplayLayer(
        name=layer.name,
        kind=layer.kind,
        in_elements=replay.elements(max(index - 1, 0)),
        out_elements=replay.elements(index),
        forward_ms=scale * layer.forward_ms,
        input_ms=scale * layer.backward_input_ms,
        weight_ms=scale * layer.backward_weight_ms,
        fused_ms=None if layer.backward_ms is None else scale * layer.backward_ms,
    )


def sample_batch(microbatch_size: int, generator: torch.Generator, **config) -> tuple[torch.Tensor, torch.Tensor]:
    replay = _replay(**config)
    inputs = torch.randn(microbatch_size, replay.elements(0), generator=generator)
    targets = torch.randn(microbatch_size, replay.elements(replay.profile.num_layers - 1), generator=generator)
    return inputs, targets


def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs - targets).pow(2).mean()
