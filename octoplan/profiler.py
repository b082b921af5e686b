"""Measuring a model file (docs/FORMATS.md section 4) layer by layer into a profile (docs/FORMATS.md section 2).

Each layer is built with the seeding of FORMATS.md section 4 and fed the real output of the layer before it (the
first layer gets microbatch 0 of step 0 on replica 0), so shapes and data are those of training.

The times are the layers' *in sequence* (:mod:`octoplan.sequence_timing`): all layers
run in model order as octorun runs a stage holding them all, with a mark at each layer boundary
(the clock's reading on a CPU, a CUDA event on a GPU, read after one synchronize at the end). A
layer timed alone starts cold and pays its own launches, where in a run its work queues behind
the previous layer's and finds the caches as that layer left them: timed alone, small layers were
12-46% off on an H200, and the layers summed to 0.84-1.26x the whole model on a CPU. Each timed repeat
runs, in turn, F then B over all layers, F then I then W over all layers, and the whole model;
repeat r of every layer comes before repeat r + 1 of any, so a drift in the machine's speed moves
all layers alike. Per layer, the least of ``repeat`` repeats after ``warmup`` untimed ones
(:func:`~octoplan.sequence_timing.least`: noise only adds to a repeat):

- ``forward_ms``: the layer's forward with autograd recording (the last layer's includes
  ``loss_fn``);
- ``backward_input_ms``: :func:`backward_input`, the gradient w.r.t. the layer's floating inputs
  (0 when it has none, e.g. token ids);
- ``backward_weight_ms``: :func:`backward_weight`, the gradient w.r.t. the layer's parameters;
- ``backward_ms``: both in one ``torch.autograd.grad`` pass, which is what a B op runs. A layer
  with no floating inputs (the first) has no I, so its W and B are one pass and carry one figure,
  the least of both measurements' samples.

The profile also records each layer's spread over the repeats (``relative_spread``), the
whole model's time from the same run against the layers' sum, and, as a cross-check, each layer
timed alone (``isolated``: ``repeat`` calls of each of F, I, W and B in a row after ``warmup``
ones, and after any leading runs still far slower than the rest, see :meth:`_Clock.samples_ms`).

Why a split backward instead of two plain ``torch.autograd.grad`` calls: ``grad(out, params)``
after ``grad(out, input)`` walks the layer's graph again down to its first parameter, so inside a
transformer block it redoes almost all of the input-gradient work (measured here: I + W about 1.5
times a fused backward). :func:`backward_input` instead records, while it computes the input
gradient, the gradient arriving at each autograd node where a parameter branch leaves the
input's path; :func:`backward_weight` starts from those nodes and runs only the parameter
branches. I + W then costs about one fused backward, which is what the zero-bubble schedules
assume. The same pair of functions is what a runtime should call for I and W ops, so that the
profile describes the work it does.

Activation bytes are the storages a layer keeps from its F to its backward, each counted once:
what autograd saves during the forward (saved-tensor hooks) and the layer's floating inputs,
without parameters, buffers or the layer's own output (the next layer's input). Of these,
``w_saved_bytes`` stay from an I to its W (the rest octorun releases at I), and the gradients I
captures for W add ``pending_w_bytes`` (see :meth:`_LayerRun.memory`). On the CPU the thread count is fixed (default
:data:`DEFAULT_CPU_THREADS`) and recorded, because timings depend on it.

Contract violations of the model file are :class:`~octoplan.errors.InputError` naming the file
and the layer; the profiler logs, never prints.
"""

from __future__ import annotations

import gc
import logging
import os
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Sequence

import torch
import yaml

from octoplan.errors import MODEL_CODE_FAILURES, InputError, where_raised
from octoplan.headroom import SHRINK_FIX, memory_capped, bytes_left, out_of_memory
from octoplan.host_malloc import steady_malloc
from octoplan.modelfile import ModelFile, as_args, load_model_file
from octoplan.precision import DEFAULT_PRECISION, PROFILE_DTYPE, autocast, check_precision
from octoplan.profile import MAX_MICROBATCH_SIZE, Layer, LayerTimes, ModelRef, Profile, TiedParameter, WholeModelCheck
from octoplan.splitgrad import PendingWeightGrads, SavedTensors, backward_input, backward_weight
from octoplan.sequence_timing import SPREAD_WARNING, Chain, in_sequence_times, least, relative_spread, time_in_sequence
from octoplan.yamlio import read_yaml_value

__all__ = [
    "DEFAULT_CPU_THREADS",
    "SPREAD_WARNING",
    "relative_spread",
    "PendingWeightGrads",
    "profile_model_file",
    "measure_whole_model_ms",
    "parse_config_overrides",
    "backward_input",
    "backward_weight",
]

log = logging.getLogger(__name__)

# One thread: what torchrun gives each CPU rank by default (OMP_NUM_THREADS=1), and the least
# disturbed by other processes on a shared machine.
DEFAULT_CPU_THREADS = 1

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float64: "float64"}


# --------------------------------------------------------------------------- config overrides


def parse_config_overrides(items: list[str]) -> dict[str, Any]:
    """``["hidden=256", "name=x"]`` -> ``{"hidden": 256, "name": "x"}``; values are YAML scalars,
    read as the files are (``noise=5e-1`` is a number, as ``noise: 5e-1`` in a plan's config)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise InputError(None, "--config", f"{item!r} is not key=value", "write e.g. --config hidden=256")
        try:
            value = read_yaml_value(text) if text.strip() else None
        except yaml.YAMLError:
            raise InputError(None, "--config", f"value of {key!r} is not valid YAML: {text!r}", "quote or fix the value") from None
        if value is None:
            raise InputError(None, "--config", f"{key!r} has no value", f"write {key}=VALUE")
        if not isinstance(value, (bool, int, float, str)):
            raise InputError(None, "--config", f"value of {key!r} is a {type(value).__name__}, not a scalar", "give a number, bool or string")
        if key in out:  # which one was meant is not ours to guess, as for a key a file writes twice
            raise InputError(None, "--config", f"{key!r} is given twice ({out[key]!r} and {value!r})", "give each key once")
        out[key] = value
    return out


# --------------------------------------------------------------------------- timing


SETTLED_RATIO = 1.5
"""A first timed call over this many times the fastest later one is still warming up."""


# Wall time over counted CPU time past which a profile on the thread's CPU clock is said to
# leave waits out (_Clock.waiting_ratio)
WAITING_RATIO = 4.0


class _Clock:
    """Median time of a callable on one device.

    CUDA: events around the call. CPU with one thread: the calling thread's CPU time, because
    every op and (for CPU tensors) the autograd engine run on that thread, and CPU time does
    not count the slices other processes take on a shared machine, which wall time does. CPU
    with more threads: wall time (the pool's threads work in parallel). ``clock="wall"``: wall
    time on either device (on CUDA each reading waits for the GPU first), for models that sleep
    or wait, such as the replay model, whose time no CUDA event sees.
    """

    def __init__(self, device: torch.device, *, threads: int, clock: str = "auto"):
        self.on_gpu = device.type == "cuda"
        if self.on_gpu and clock == "cpu":
            raise InputError(None, "--clock", "cpu times this process's thread, which does not see the GPU's work",
                             "use auto or wall, or --device cpu")
        self.cuda = self.on_gpu and clock == "auto"  # whether the readings are CUDA events
        if self.cuda:
            self.kind = "cuda-events"
        elif clock == "wall" or threads != 1 or self.on_gpu:
            self.kind = "wall"
        else:
            self.kind = "thread-cpu-time"
        if self.kind == "thread-cpu-time":
            self.now_ns = time.thread_time_ns
        elif self.on_gpu:
            self.now_ns = self._synced_wall_ns
        else:
            self.now_ns = time.perf_counter_ns
        # On the thread's CPU clock, the wall time of the same calls too: a layer that sleeps or
        # waits (the replay model, I/O) spends time this clock does not count (waiting_ratio)
        self.timed_ns = 0
        self.timed_wall_ns = 0

    @staticmethod
    def _synced_wall_ns() -> int:
        torch.cuda.synchronize()  # the GPU's queued work ends before the reading, not after it
        return time.perf_counter_ns()

    def sync(self) -> None:
        if self.on_gpu:
            torch.cuda.synchronize()

    def once_ms(self, fn: Callable[[], Any]) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        wall = time.perf_counter_ns()
        begin = self.now_ns()
        fn()
        elapsed = self.now_ns() - begin
        self.timed_ns += elapsed
        self.timed_wall_ns += time.perf_counter_ns() - wall
        return elapsed / 1e6

    def waiting_ratio(self) -> float | None:
        """On the thread's CPU clock: the timed calls' wall time over the time counted; None on
        the others, which count waits. A busy machine takes a share of the wall time (about 2x
        with two runnable processes a core); a layer that sleeps takes far more."""
        if self.kind != "thread-cpu-time" or self.timed_ns <= 0:
            return None
        return self.timed_wall_ns / self.timed_ns

    def samples_ms(self, fn: Callable[[], Any], *, repeat: int, warmup: int) -> list[float]:
        """``repeat`` timed calls after ``warmup`` untimed ones, the leading slow ones replaced.

        A fixed warm-up is not always enough: on the CPU a layer's first timed calls can still
        run several times slower than the rest (measured: an embedding's weight gradient at
        about 1.7 ms for its first 2-3 timed calls, then 0.25 ms, the allocator settling on a
        new buffer size), and when they make up half the samples they move the median. So while
        the first sample is over :data:`SETTLED_RATIO` times the fastest of the others, it
        counts as warm-up: it is dropped and one more call is timed, at most ``repeat`` more
        in all. A slow call in the middle (a stall) is left to the median."""
        for _ in range(warmup):
            fn()
        self.sync()
        samples = [self.once_ms(fn) for _ in range(repeat)]
        for _ in range(repeat):
            if len(samples) < 2 or samples[0] <= SETTLED_RATIO * min(samples[1:]):
                break
            samples = [*samples[1:], self.once_ms(fn)]
        return samples

    def median_ms(self, fn: Callable[[], Any], *, repeat: int, warmup: int) -> float:
        return statistics.median(self.samples_ms(fn, repeat=repeat, warmup=warmup))


class _QuietGC:
    """Collector paused while timing: a collection landing in one sample is noise, not cost."""

    def __enter__(self) -> None:
        gc.collect()
        self.was_enabled = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: Any) -> None:
        if self.was_enabled:
            gc.enable()


class _Threads:
    """Fix the CPU thread count for the measurement and restore the caller's afterwards."""

    def __init__(self, device: torch.device, threads: int | None):
        self.device = device
        self.threads = threads or DEFAULT_CPU_THREADS
        if self.threads < 1:
            raise InputError(None, "--threads", f"is {threads}", "give a positive thread count")

    def __enter__(self) -> int:
        self.before = torch.get_num_threads()
        if self.device.type == "cpu":
            torch.set_num_threads(self.threads)
        return torch.get_num_threads()

    def __exit__(self, *exc: Any) -> None:
        torch.set_num_threads(self.before)


# --------------------------------------------------------------------------- helpers


def _resolve_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise InputError(None, "--device", f"{device!r} is not a device", "use cpu or cuda") from None
    if resolved.type not in ("cpu", "cuda"):
        raise InputError(None, "--device", f"{device!r} is not supported", "use cpu or cuda")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise InputError(None, "--device", "CUDA is not available on this machine", "use --device cpu")
    return resolved


def _device_info(device: torch.device) -> dict[str, Any]:
    # GB = 1e9 bytes, the unit of the plan's cluster.memory_gb that the simulator's limit reads
    # (a GiB here would let plans overfill the GPU by 7%)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {"name": props.name, "memory_gb": round(props.total_memory / 1e9, 1)}
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: leave the size out
        return {"name": "cpu"}
    return {"name": "cpu", "memory_gb": round(total / 1e9, 1)}


def _check_positive(value: int, field_name: str, minimum: int, maximum: int | None = None) -> None:
    if not isinstance(value, int) or value < minimum:
        raise InputError(None, field_name, f"is {value!r}", f"give an integer >= {minimum}")
    if maximum is not None and value > maximum:  # before a batch of that many samples is built
        raise InputError(None, field_name, f"is {value}", f"use {minimum} to {maximum}")


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to_device(v, device) for v in value)
    return value


def _tensors(value: Any) -> list[torch.Tensor] | None:
    """The tensors of a layer output (a tensor or a non-empty tuple of tensors), else None."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return list(value)
    return None


def _describe(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__} of ({', '.join(type(v).__name__ for v in value)})"
    return type(value).__name__


def _tensor_bytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _storage_bytes(tensors: Iterable[torch.Tensor], *, excluded: Iterable[torch.Tensor] = ()) -> int:
    """The bytes of the distinct storages under ``tensors``, those of ``excluded`` left out."""
    skip = {t.untyped_storage().data_ptr() for t in excluded}
    sizes = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(n for ptr, n in sizes.items() if ptr not in skip)


def _layer_inputs(previous: Any, *, first: bool) -> tuple[torch.Tensor, ...]:
    """A layer's arguments: detached, floating ones requiring grad, so that the layer's
    backward stops at its own input (the runtime does the same per stage). The first layer's
    inputs are data: nothing upstream wants their gradient, so they require none (its I is 0)."""
    args = []
    for value in as_args(previous):
        value = value.detach()
        if value.is_floating_point() and not first:
            value.requires_grad_(True)
        args.append(value)
    return tuple(args)


def _exc_text(exc: BaseException) -> str:
    """``Type: message`` on one line (the CLI prints one line), shortened if long, and the line
    of the model's code it was raised in (:func:`~octoplan.errors.where_raised`)."""
    text = " ".join(str(exc).split())
    if len(text) > 300:
        text = text[:297] + "..."
    return (f"{type(exc).__name__}: {text}" if text else type(exc).__name__) + where_raised(exc)


def _fail(mf: ModelFile, field_name: str, problem: str, exc: BaseException, fix: str) -> InputError:
    if isinstance(exc, InputError):  # the model file already said what is wrong
        return exc.in_file(mf.path)
    # out of memory is the size's fault, not the code's: "fix build_layer" would mislead
    return InputError(mf.path, field_name, f"{problem}: {_exc_text(exc)}", SHRINK_FIX if out_of_memory(exc) else fix)


def _optional(mf: ModelFile, name: str, index: int) -> str | None:
    fn = getattr(mf.module, name, None)
    if not callable(fn):
        return None
    try:
        value = fn(index, **mf.config)
    except MODEL_CODE_FAILURES as exc:
        raise _fail(mf, f"{name}({index})", "raised", exc, f"fix {name}") from None
    if not isinstance(value, str) or not value:
        raise InputError(mf.path, f"{name}({index})", f"returned {value!r}", "return a non-empty string")
    return value


def _name_and_kind(mf: ModelFile, index: int, total: int, layer: torch.nn.Module) -> tuple[str, str]:
    name = _optional(mf, "layer_name", index) or type(layer).__name__
    kind = _optional(mf, "layer_kind", index)
    if kind is None:
        if index == total - 1:
            kind = "head"
        elif index == 0 and any(isinstance(m, torch.nn.Embedding) for m in layer.modules()):
            kind = "embedding"
        else:
            kind = "layer"
    if kind == "embedding" and index != 0:
        raise InputError(mf.path, f"layer_kind({index})", "'embedding' is reserved for the first layer", "use another kind")
    if kind == "head" and index != total - 1:
        raise InputError(mf.path, f"layer_kind({index})", "'head' is reserved for the last layer", "use another kind")
    return name, kind


def _build(mf: ModelFile, index: int, device: torch.device, room: _Room | None = None) -> torch.nn.Module:
    """Layer ``index`` on ``device``; ``room``: the whole model is being built there, layer by
    layer, and each one is counted against what is left."""
    # built under the memory cap (octoplan.headroom) where the whole model is built
    capped = memory_capped(device) if room is not None else nullcontext()
    try:
        with capped:
            layer = mf.build_layer(index)
    except MODEL_CODE_FAILURES as exc:
        raise _fail(mf, f"build_layer({index})", "raised", exc, "fix build_layer") from None
    if any(t.is_meta for t in (*layer.parameters(), *layer.buffers())):  # .to() would fail: no data to copy
        raise InputError(mf.path, f"build_layer({index})", "returned a layer on the meta device (no values)",
                         "build the layer with real tensors (the profiler runs it)")
    try:
        layer = layer.to(device)
    except MODEL_CODE_FAILURES as exc:  # a GPU too small for the layer
        raise _fail(mf, f"build_layer({index})", f"cannot be moved to {device}", exc, "fix build_layer") from None
    if room is not None:
        room.count(index, layer)
    return layer


class _Room:
    """Building a whole model on one device, layer by layer: stops with a line naming the size
    before the device runs out (on a CPU, the kernel's OOM killer would end the process with no
    message; octoplan.headroom). What must still fit after layer i is one more layer like it,
    and after the last one the model's gradients. Each storage counts once (a table several
    layers share), and only trainable parameters get gradients."""

    def __init__(self, mf: ModelFile, total: int, device: torch.device):
        self.mf, self.total, self.device = mf, total, device
        self.held = 0  # bytes of the storages built so far
        self.trainable = 0  # of them, the trainable parameters': their gradients' bytes
        self._seen: set[int] = set()

    def count(self, index: int, layer: torch.nn.Module) -> None:
        size = 0
        for tensor in (*layer.parameters(), *layer.buffers()):
            storage = tensor.untyped_storage()
            if storage.data_ptr() in self._seen or storage.nbytes() == 0:
                continue
            self._seen.add(storage.data_ptr())
            size += storage.nbytes()
            if isinstance(tensor, torch.nn.Parameter) and tensor.requires_grad:
                self.trainable += storage.nbytes()
        self.held += size
        left = bytes_left(self.device)
        last = index == self.total - 1
        need = self.trainable if last else size
        if left is not None and left < need:
            rest = "its gradients" if last else "the rest of the model, its gradients"
            raise InputError(self.mf.path, f"build_layer({index})",
                             f"the first {index + 1} of {self.total} layers hold {self.held / 1e9:.2f} GB, and "
                             f"{max(left, 0) / 1e9:.2f} GB is left on {self.device}: {rest} and activations cannot fit",
                             SHRINK_FIX)


def _clock_for(mf: ModelFile, clock: str) -> str:
    """``--clock`` as given, or for ``auto`` the model file's ``PROFILE_CLOCK``."""
    return mf.profile_clock if clock == "auto" else clock


def _first_batch(mf: ModelFile, microbatch_size: int, device: torch.device) -> tuple[Any, Any]:
    try:
        inputs, targets = mf.sample_batch(microbatch_size, step=0, replica=0, mb=0)
    except MODEL_CODE_FAILURES as exc:
        raise _fail(mf, "sample_batch", "raised", exc, "fix sample_batch") from None
    if _tensors(inputs) is None:
        raise InputError(mf.path, "sample_batch", f"inputs are a {_describe(inputs)}", "return a tensor or a tuple of tensors as inputs")
    for what, value in (("inputs", inputs), ("targets", targets)):
        if any(isinstance(t, torch.Tensor) and t.is_meta for t in (value if isinstance(value, (tuple, list)) else (value,))):
            raise InputError(mf.path, "sample_batch", f"returned {what} on the meta device (no values)",
                             "return tensors with values")
    _check_batch_follows_its_size(mf, microbatch_size, (inputs, targets))
    return _to_device(inputs, device), _to_device(targets, device)


def _shapes(batch: Any) -> list[tuple[int, ...]]:
    """The shapes of a batch's tensors: (inputs, targets), each a tensor or a tuple or list of them."""
    parts = [part for value in batch for part in (value if isinstance(value, (tuple, list)) else (value,))]
    return [tuple(part.shape) for part in parts if isinstance(part, torch.Tensor)]


def _check_batch_follows_its_size(mf: ModelFile, microbatch_size: int, batch: tuple[Any, Any]) -> None:
    """A sample_batch that ignores its microbatch_size would have every layer timed, and every
    plan's batch counted, at a size the model never drew: one more sample must change a shape.
    A model that takes only some sizes (even ones, for pairs) may refuse one more: then nothing
    is known, and nothing is said."""
    try:
        larger = mf.sample_batch(microbatch_size + 1, step=0, replica=0, mb=0)
    except (InputError, *MODEL_CODE_FAILURES) as exc:
        log.debug("sample_batch(%d) raised, so whether it follows its size is not checked: %s", microbatch_size + 1, exc)
        return
    if _shapes(larger) == _shapes(batch):
        raise InputError(mf.path, "sample_batch", f"returned the same shapes for microbatch_size {microbatch_size} and "
                         f"{microbatch_size + 1}", "draw microbatch_size samples, its first argument")


def _loss(mf: ModelFile, index: int, name: str, outputs: Any, targets: Any) -> torch.Tensor:
    try:
        loss = mf.loss(outputs, targets)
    except MODEL_CODE_FAILURES as exc:
        raise _fail(mf, "loss_fn", f"failed on the output of layer {index} ({name})", exc, "fix loss_fn") from None
    if not loss.requires_grad:
        raise InputError(mf.path, "loss_fn", "returned a loss that does not depend on the model", "compute it from the outputs")
    return loss


# --------------------------------------------------------------------------- one layer


@dataclass
class _Step:
    """One recorded forward of a layer: what its backward starts from."""

    output: Any
    roots: list[torch.Tensor]  # tensors the backward starts from (the loss for the last layer)
    grads: list[torch.Tensor]
    saved: SavedTensors  # what autograd saved, in the boxes octorun's tapes use


class _LayerRun:
    """One layer on its real input: runs F, I and W the way the runtime does."""

    def __init__(self, mf: ModelFile, *, index: int, total: int, name: str, layer: torch.nn.Module, args: tuple, targets: Any, seed: int,
                 device: torch.device | None = None, precision: str = DEFAULT_PRECISION):
        self.mf, self.index, self.total, self.name = mf, index, total, name
        # the context each forward of the layer (the loss with the last) runs in, as in octorun
        self.region = lambda: autocast(device or torch.device("cpu"), precision)
        self.layer, self.args, self.targets = layer, args, targets
        self.last = index == total - 1
        self.params = [p for p in layer.parameters() if p.requires_grad]
        self.grad_inputs = [a for a in args if a.requires_grad]
        self.static = [*layer.parameters(), *layer.buffers()]  # never activations
        self.generator = torch.Generator().manual_seed(seed * 7919 + index)

    def forward(self) -> _Step:
        saved = SavedTensors()  # octorun's F records into boxes too: the timed forward pays for them
        with saved.recording(), self.region():
            output = self.layer(*self.args)
            if self.last:
                loss = _loss(self.mf, self.index, self.name, output, self.targets)
        if self.last:
            return _Step(output, [loss], [torch.ones_like(loss)], saved)
        roots = [t for t in as_args(output) if t.requires_grad]
        return _Step(output, roots, [], saved)

    def first_forward(self) -> _Step:
        """The checked forward: contract errors name the layer; records what autograd saves."""
        saved = SavedTensors()
        try:
            with saved.recording(), self.region():
                output = self.layer(*self.args)
        except MODEL_CODE_FAILURES as exc:
            raise self._input_error(exc) from None
        if _tensors(output) is None:
            raise InputError(
                self.mf.path,
                f"layer {self.index} ({self.name})",
                f"returned a {_describe(output)}",
                "return a tensor or a tuple of tensors",
            )
        if self.last:
            with saved.recording(), self.region():
                loss = _loss(self.mf, self.index, self.name, output, self.targets)
            return _Step(output, [loss], [torch.ones_like(loss)], saved)
        roots = [t for t in as_args(output) if t.requires_grad]
        # Random, not ones: a uniform gradient through a normalization cancels to ~0 and
        # denormal numbers are slow on CPUs.
        grads = [torch.randn(t.shape, generator=self.generator, dtype=t.dtype).to(t.device) for t in roots]
        return _Step(output, roots, grads, saved)

    def memory(self, step: _Step, pending: PendingWeightGrads) -> dict[str, int]:
        """The layer's memory figures (profile fields), from its first forward and the I that
        marked what only I reads (``pending``), each storage counted once.

        ``activation_bytes``: what the layer keeps from its F to its backward: what autograd
        saves (the targets too, on the last layer) and its floating inputs, which octorun's tape
        keeps as the leaves the backward ends at. Its own floating outputs are not in it, even
        where it holds them: they are the next layer's input and count there. Parameters and
        buffers are never activations. ``pending_w_bytes``: the gradients I captured for W. Of
        the activations, ``w_saved_bytes`` stay from I to W: the saved
        tensors W reads, and the inputs where the graph W runs holds them;
        ``input_freed_bytes`` are the inputs the layer lets go at its I. Its own outputs it
        holds itself (saved by its autograd, or its input passed through) are
        ``output_saved_bytes``, ``output_w_bytes`` of them until W: the memory model needs them
        where no next layer on the rank holds the output, or that layer lets go of it sooner.
        """
        own = [] if self.last else [t for t in as_args(step.output) if t.is_floating_point()]
        own_keys = {t.untyped_storage().data_ptr() for t in own}
        static = self.static
        held = [*(box.tensor for box in step.saved.boxes), *self.grad_inputs]
        kept = step.saved.kept() + (self.grad_inputs if pending.keeps_inputs else [])
        kept_keys = {t.untyped_storage().data_ptr() for t in kept}

        def mine(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
            return [t for t in tensors if t.untyped_storage().data_ptr() in own_keys]

        return {
            "activation_bytes": _storage_bytes(held, excluded=[*static, *own]),
            "pending_w_bytes": _storage_bytes(pending.gradients(), excluded=static),
            "w_saved_bytes": _storage_bytes(kept, excluded=[*static, *own]),
            "input_freed_bytes": _storage_bytes(
                [t for t in self.grad_inputs if t.untyped_storage().data_ptr() not in kept_keys], excluded=[*static, *own]),
            "output_saved_bytes": _storage_bytes(mine(held), excluded=static),
            "output_w_bytes": _storage_bytes(mine(kept), excluded=static),
        }

    def _input_error(self, exc: BaseException) -> InputError:
        if isinstance(exc, InputError):
            return exc.in_file(self.mf.path)
        field_name = f"layer {self.index} ({self.name})"
        if not isinstance(exc, Exception):  # sys.exit and the like
            return InputError(self.mf.path, field_name, f"exits in its forward: {_exc_text(exc)}",
                              "raise an exception instead: an exit would end the whole run")
        # the forward's own bug or inputs it cannot take: the exception tells which, so both are named
        source = "sample_batch's inputs" if self.index == 0 else f"layer {self.index - 1}'s output"
        problem = f"its forward raised on {source}"
        fix = (f"fix the forward, or make {source} match its arguments (inputs arrive as tensors of their "
               "own: a forward must not change them in place)")
        overrides = sorted(set(self.mf.config) - {"seq", "weights"}) if self.mf.path.startswith("hf:") else []
        if out_of_memory(exc):
            fix = SHRINK_FIX
        elif overrides:  # transformers' own forward, not the user's: what they changed is the config
            fix = (f"the forward is transformers' own: check the --config overrides ({', '.join(overrides)}) against "
                   "each other and the model (heads dividing the hidden size, experts per token within the experts)")
        return InputError(self.mf.path, field_name, f"{problem}: {_exc_text(exc)}", fix)

    def flops(self) -> float | None:
        try:
            from torch.utils.flop_counter import FlopCounterMode

            counter = FlopCounterMode(display=False)
            with counter:
                self.forward()
            return float(counter.get_total_flops())
        except Exception as exc:  # the count is optional: an op it cannot trace is no error
            log.debug("no FLOP count for layer %d: %s", self.index, exc)
            return None

    def backward_input(self, step: _Step) -> tuple[tuple, PendingWeightGrads]:
        """I, marking the saved tensors only it reads, as octorun's I does (it then releases them)."""
        return backward_input(step.roots, step.grads, self.grad_inputs, self.params, saved=step.saved)

    def backward_fused(self, step: _Step) -> tuple:
        """A B op: the input and parameter gradients in one pass, as octorun's stages run it."""
        return torch.autograd.grad(step.roots, [*self.grad_inputs, *self.params], step.grads or None,
                                   retain_graph=True, allow_unused=True)


def _measure_layer(run: _LayerRun, *, clock: _Clock, repeat: int, warmup: int) -> tuple[Layer, Any]:
    """One layer's profile entry (kind left blank) and its output, the next layer's input."""
    step = run.first_forward()
    flops = run.flops()
    field_name = f"layer {run.index} ({run.name})"
    try:
        with _QuietGC():
            forward_ms = clock.median_ms(run.forward, repeat=repeat, warmup=warmup)
            _, pending = run.backward_input(step)
            memory = run.memory(step, pending)
            if run.grad_inputs and step.roots:
                input_ms = clock.median_ms(lambda: run.backward_input(step), repeat=repeat, warmup=warmup)
            else:  # token ids (or an output with no gradient): there is no I work
                input_ms = 0.0
            weight_samples = fused_samples = [0.0]
            if run.params and step.roots:
                weight_samples = clock.samples_ms(lambda: backward_weight(pending), repeat=repeat, warmup=warmup)
            if (run.grad_inputs or run.params) and step.roots:
                fused_samples = clock.samples_ms(lambda: run.backward_fused(step), repeat=repeat, warmup=warmup)
            if run.grad_inputs:
                weight_ms, fused_ms = statistics.median(weight_samples), statistics.median(fused_samples)
            else:
                # No floating inputs (token ids, the model's data): W and B run the same autograd
                # pass, so they get one figure, the median of both passes' samples. Two medians
                # of one pass differ by noise alone, and a B priced below the W the runtime runs
                # mispriced the plan: B ops on stage 0 that cost several times their plan.
                weight_ms = fused_ms = statistics.median(weight_samples + fused_samples)
    except InputError:
        raise
    except MODEL_CODE_FAILURES as exc:
        raise InputError(run.mf.path, field_name, f"failed during measurement: {_exc_text(exc)}", "fix the layer") from None
    layer = Layer(
        name=run.name,
        kind="",  # filled by the caller
        forward_ms=forward_ms,
        backward_input_ms=input_ms,
        backward_weight_ms=weight_ms,
        backward_ms=fused_ms,
        param_bytes=_tensor_bytes(list(run.layer.parameters())),
        buffer_bytes=_tensor_bytes(list(run.layer.buffers())),
        activation_bytes=memory.pop("activation_bytes"),
        output_bytes=_tensor_bytes(_tensors(step.output) or []),
        flops=flops,
        **memory,
    )
    return layer, step.output


def _tied_parameters(mf: ModelFile) -> tuple[TiedParameter, ...]:
    """The model file's tied groups, each member checked against its built layer (it exists,
    and every member has the first one's shape), with one member's bytes."""
    groups = mf.tied_groups()
    if not groups:
        return ()
    built: dict[int, dict[str, torch.nn.Parameter]] = {}
    out = []
    with torch.random.fork_rng(devices=[]):  # building reseeds; the measurement's stream stays as it was
        for g, group in enumerate(groups):
            found = []
            for layer, name in group:
                if layer not in built:
                    built[layer] = dict(_build(mf, layer, torch.device("cpu")).named_parameters(remove_duplicate=False))
                param = built[layer].get(name)
                if param is None:
                    names = ", ".join(list(built[layer])[:6]) or "none"
                    raise InputError(mf.path, f"tied_parameters group {g}", f"layer {layer} has no parameter {name!r}",
                                     f"name a parameter as the layer's named_parameters() spells it (it has: {names})")
                found.append(param)
            (first_layer, first_name), first = group[0], found[0]
            for (layer, name), param in zip(group[1:], found[1:]):
                if param.shape != first.shape:
                    raise InputError(mf.path, f"tied_parameters group {g}",
                                     f"layer {layer}'s {name} has shape {tuple(param.shape)} but layer {first_layer}'s "
                                     f"{first_name} has {tuple(first.shape)}", "tie parameters of one shape")
            out.append(TiedParameter(tuple(group), first.numel() * first.element_size()))
    return tuple(out)


def _dtype_name(parameters: list[tuple[torch.dtype, int]]) -> str:
    """The floating dtype holding most of the parameters' bytes (not most tensors: a bf16 matrix
    beside two fp32 norms is a bf16 layer), from (dtype, bytes) per parameter."""
    held: dict[torch.dtype, int] = {}
    for dtype, nbytes in parameters:
        if dtype.is_floating_point:
            held[dtype] = held.get(dtype, 0) + nbytes
    if not held:
        return "float32"
    common = max(held, key=lambda dtype: (held[dtype], str(dtype)))
    return _DTYPE_NAMES.get(common, str(common).removeprefix("torch."))


# --------------------------------------------------------------------------- public entry points


def profile_model_file(
    path: str,
    *,
    config: dict | None = None,
    microbatch_size: int = 4,
    repeat: int = 10,
    warmup: int = 3,
    device: str | None = None,
    threads: int | None = None,
    seed: int = 0,
    on_layer: Callable[[int, int, str], None] | None = None,
    clock: str = "auto",
    precision: str = DEFAULT_PRECISION,
    on_loaded: Callable[[ModelFile], None] | None = None,
) -> Profile:
    """Measure every layer of the model file at ``path`` into a :class:`Profile`.

    The times are the layers' in sequence, ``repeat`` round-robin repeats after ``warmup`` (module
    docstring); each layer's spread over them, the layers timed alone (``isolated``) and the whole
    model timed in the same run (``whole_model``) are recorded beside them.

    ``config`` overrides the file's ``CONFIG``; ``device`` defaults to CUDA when available;
    ``threads`` (CPU only) defaults to :data:`DEFAULT_CPU_THREADS`. ``on_layer(index, total,
    name)`` is called after each layer is measured, ``on_loaded(model_file)`` once the file is
    loaded, before anything is measured. ``clock``: ``auto`` (CUDA events on a GPU,
    the thread's CPU time on one CPU thread, else wall time), ``wall`` (always wall time: for
    layers that sleep or wait, like the replay model's) or ``cpu``. ``precision``
    (:mod:`octoplan.precision`): ``bf16`` runs every forward under bf16 autocast, as octorun
    ``--precision bf16`` does, and records ``dtype: bfloat16`` and ``precision: bf16``; the
    parameters stay fp32. The model file's tied parameters are checked (each member exists, the
    shapes agree) before anything is measured, and recorded. Bad model files raise
    :class:`InputError`.
    """
    if clock not in ("auto", "wall", "cpu"):
        raise InputError(None, "--clock", f"is {clock!r}", "use auto, wall or cpu")
    check_precision(precision)
    _check_positive(microbatch_size, "--microbatch-size", 1, MAX_MICROBATCH_SIZE)
    _check_positive(repeat, "--repeat", 1)
    _check_positive(warmup, "--warmup", 0)
    dev = _resolve_device(device)
    malloc = steady_malloc()  # before the model's tensors: each process allocates alike
    mf = load_model_file(path, config, seed=seed, config_given=True)
    if on_loaded is not None:
        on_loaded(mf)
    tied = _tied_parameters(mf)
    with _Threads(dev, threads) as used_threads:
        total = mf.num_layers()
        timer = _Clock(dev, threads=used_threads, clock=_clock_for(mf, clock))
        inputs, targets = _first_batch(mf, microbatch_size, dev)
        previous = inputs
        isolated: list[Layer] = []
        modules: list[torch.nn.Module] = []
        names: list[str] = []
        dtypes: list[tuple[torch.dtype, int]] = []
        # Each layer alone on its real input first: its bytes, and its times as the cross-check
        # of the in-sequence ones below; any contract error names the layer here.
        room = _Room(mf, total, dev)
        for index in range(total):
            module = _build(mf, index, dev, room)
            name, kind = _name_and_kind(mf, index, total, module)
            dtypes.extend((p.dtype, p.numel() * p.element_size()) for p in module.parameters())
            run = _LayerRun(
                mf,
                index=index,
                total=total,
                name=name,
                layer=module,
                args=_layer_inputs(previous, first=index == 0),
                targets=targets if index == total - 1 else None,
                seed=seed,
                device=dev,
                precision=precision,
            )
            layer, output = _measure_layer(run, clock=timer, repeat=repeat, warmup=warmup)
            isolated.append(replace(layer, kind=kind))
            modules.append(module)
            names.append(name)
            previous = output
            del run
            if on_layer is not None:
                on_layer(index, total, name)
        del previous
        chain = Chain(lambda index, name, outputs, wanted: _loss(mf, index, name, outputs, wanted),
                      modules, names, inputs, targets, dev, precision)
        try:
            with _QuietGC():
                samples = time_in_sequence(chain, clock=timer, repeat=repeat, warmup=warmup)
        except InputError:
            raise
        except MODEL_CODE_FAILURES as exc:
            if chain.changed_inputs and "inplace operation" in str(exc):
                # the backward that failed is the holder's; the culprit changed an input after it
                holder = chain.current
                later = [index for index in chain.changed_inputs if index > holder]
                culprit = later[0] if later else chain.changed_inputs[0]
                held = f"layer {holder}" if later else "a layer before it"
                raise InputError(mf.path, f"layer {culprit} ({names[culprit]})", "changes its input in place, which "
                                 f"{held} holds for its backward ({_exc_text(exc)})",
                                 "compute on a copy (x = x + 1, not x += 1): a forward must not change its inputs in "
                                 "place") from None
            raise InputError(mf.path, f"layer {chain.current} ({names[chain.current]})",
                             f"failed when run in sequence: {_exc_text(exc)}", "fix the layer") from None
        del chain, modules
    layers = []
    for index, alone in enumerate(isolated):
        times = in_sequence_times(samples, index)
        layers.append(replace(
            alone, forward_ms=times.forward_ms, backward_input_ms=times.backward_input_ms,
            backward_weight_ms=times.backward_weight_ms, backward_ms=times.backward_ms,
            spread=relative_spread(samples.f_plus_b[index]),
            isolated=LayerTimes(alone.forward_ms, alone.backward_input_ms, alone.backward_weight_ms, alone.b_ms),
        ))
        log.info("layer %d/%d %s: F %.3f ms, I %.3f ms, W %.3f ms, B %.3f ms in sequence (alone: F %.3f, B %.3f); spread %.1f%%",
                 index + 1, total, alone.name, times.forward_ms, times.backward_input_ms, times.backward_weight_ms,
                 times.backward_ms, alone.forward_ms, alone.b_ms, 100 * layers[-1].spread)
    waiting = timer.waiting_ratio()
    if waiting is not None and waiting > WAITING_RATIO:
        log.warning("the layers took %.1fx longer by the wall clock than the CPU time this clock counts: they wait (sleep, "
                    "I/O, another device), and these times leave the waits out; profile with --clock wall", waiting)
    whole_ms = least(samples.whole)  # as the layers' times: the least repeat
    whole_model = WholeModelCheck(
        ms=whole_ms, layers_sum_ms=sum(layer.forward_ms + layer.b_ms for layer in layers),
        in_sequence_ms=least(samples.passes),
        isolated_sum_ms=sum(layer.isolated.f_plus_b_ms for layer in layers),
    ) if whole_ms > 0 else None
    # Kept in the profile (FORMATS.md section 2 allows extra fields): timings mean little without them.
    settings: dict[str, Any] = {"repeat": repeat, "warmup": warmup, "seed": seed, "clock": timer.kind}
    if dev.type == "cpu":
        settings["threads"] = used_threads
    settings["malloc"] = malloc  # octoplan.host_malloc
    settings["torch"] = str(torch.__version__)
    settings["split_backward"] = "boundary-capture"  # how I and W were separated (module docstring)
    settings["layer_times"] = "in-sequence"  # how F, I, W and B were timed (module docstring)
    return Profile(
        model=ModelRef(name=str(mf.name), source=str(path), config=dict(mf.config)),
        layers=tuple(layers),
        device=_device_info(dev),
        microbatch_size=microbatch_size,
        # under autocast the layers compute in bfloat16 over fp32 parameters
        dtype=_dtype_name(dtypes) if precision == "fp32" else PROFILE_DTYPE[precision],
        extra={"profiler": settings},
        precision=precision,
        tied=tied,
        whole_model=whole_model,
    )


def measure_whole_model_ms(
    path: str,
    *,
    config: dict | None = None,
    microbatch_size: int = 4,
    repeat: int = 10,
    device: str | None = None,
    seed: int = 0,
    warmup: int = 3,
    threads: int | None = None,
    clock: str = "auto",
    precision: str = DEFAULT_PRECISION,
) -> float:
    """Median time of one training microbatch of the whole model: all layers chained as usual,
    the loss, one fused ``backward()``. The reference the per-layer sum should approach; timed
    with the same ``clock`` as :func:`profile_model_file`, each layer's forward (the last one's
    with the loss) in its own autocast region at ``precision``, as octorun runs it."""
    if clock not in ("auto", "wall", "cpu"):
        raise InputError(None, "--clock", f"is {clock!r}", "use auto, wall or cpu")
    check_precision(precision)
    _check_positive(microbatch_size, "--microbatch-size", 1, MAX_MICROBATCH_SIZE)
    _check_positive(repeat, "--repeat", 1)
    dev = _resolve_device(device)
    steady_malloc()  # as the profile's own (octoplan.host_malloc)
    mf = load_model_file(path, config, seed=seed, config_given=True)
    with _Threads(dev, threads) as used_threads:
        total = mf.num_layers()
        room = _Room(mf, total, dev)
        modules = [_build(mf, i, dev, room) for i in range(total)]
        params = [p for m in modules for p in m.parameters()]
        inputs, targets = _first_batch(mf, microbatch_size, dev)

        def step() -> None:
            for p in params:
                p.grad = None
            value: Any = inputs
            for index, module in enumerate(modules):
                with autocast(dev, precision):
                    value = module(*as_args(value))
                    if index == total - 1:
                        loss = mf.loss(value, targets)
            loss.backward()

        try:
            with _QuietGC():
                return _Clock(dev, threads=used_threads, clock=_clock_for(mf, clock)).median_ms(
                    step, repeat=repeat, warmup=warmup)
        except InputError as exc:
            raise exc.in_file(mf.path) from None
        except MODEL_CODE_FAILURES as exc:
            raise InputError(mf.path, None, f"the whole model failed: {_exc_text(exc)}", "profile it for the failing layer") from None
