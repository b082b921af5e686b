"""The layers timed in sequence, as they run in training (:func:`time_in_sequence`).

Every layer of a model runs in order the way octorun runs a stage holding them all, with a
timing mark at each layer boundary: on a CPU the clock's reading, on a GPU a CUDA event recorded
on the stream, all read after one synchronize at the end. Each round runs F then B over all
layers, F then I then W, and the whole model; round r of every layer comes before round r + 1
of any (round-robin), so a drift in the machine's speed moves all layers alike.
:mod:`octoplan.profiler` builds the layers, times each alone as a cross-check, and writes the
profile from these samples.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch

from octoplan.modelfile import as_args
from octoplan.precision import autocast
from octoplan.profile import LayerTimes
from octoplan.splitgrad import PendingWeightGrads, SavedTensors, backward_input, backward_weight, root_edge

__all__ = ["SPREAD_WARNING", "least", "relative_spread", "Chain", "SequenceSamples", "time_in_sequence", "in_sequence_times"]

# (layer index, layer name, the last layer's outputs, targets) -> the loss, as the profiler computes it
LossFn = Callable[[int, str, Any, Any], torch.Tensor]


class Clock(Protocol):
    """What the marks need of the profiler's clock."""

    cuda: bool

    def now_ns(self) -> int: ...

    def sync(self) -> None: ...


SPREAD_WARNING = 0.10
"""A layer whose :func:`relative_spread` is above this is reported as unsteady: its repeats
disagree by more than a tenth, so its median (and the plan built on it) is less sure."""


def relative_spread(samples: Sequence[float]) -> float:
    """``(p90 - p10) / median`` of a layer's per-repeat times (a profile's ``spread``).

    The deciles interpolate between the sorted samples (``statistics.quantiles``, inclusive), so
    with 10 repeats one stall moves p90 by a tenth of its excess only: a steady layer on a busy
    machine stays steady. 0 for fewer than two samples or a median of 0."""
    if len(samples) < 2:
        return 0.0
    median = statistics.median(samples)
    if median <= 0:
        return 0.0
    deciles = statistics.quantiles(samples, n=10, method="inclusive")
    return (deciles[-1] - deciles[0]) / median


class Marks:
    """Time stamps taken at layer boundaries inside one pass, read as durations afterwards.

    CPU: the clock's reading at each mark. CUDA: an event recorded on the current stream at each
    mark, read after the one synchronize that ends all the runs, so that no mark waits for the
    GPU and each layer's kernels queue behind the previous layer's, as they do in training."""

    def __init__(self, clock: Clock):
        self.clock = clock
        self.stamps: list[Any] = []

    def __call__(self) -> None:
        if self.clock.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.stamps.append(event)
        else:
            self.stamps.append(self.clock.now_ns())

    def durations_ms(self) -> list[float]:
        """The time between consecutive marks; on CUDA only after ``clock.sync()``."""
        pairs = zip(self.stamps, self.stamps[1:])
        if self.clock.cuda:
            return [start.elapsed_time(end) for start, end in pairs]
        return [(end - start) / 1e6 for start, end in pairs]


@dataclass
class Tape:
    """What one layer's forward in the chain leaves for its backward (octorun.stage's tape)."""

    inputs: list[torch.Tensor]  # floating inputs, detached leaves requiring grad
    roots: list[Any]  # GradientEdge per floating output (None where it carries no gradient), or the loss's
    saved: SavedTensors
    loss_grad: torch.Tensor | None = None  # the last layer's: the loss's gradient, ones


def _zeros_for_none(found: Sequence[torch.Tensor | None], like: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Gradients handed to the previous layer: zeros where an input was not used."""
    return tuple(torch.zeros_like(t) if g is None else g for g, t in zip(found, like))


class Chain:
    """Every layer of the model run in sequence, as octorun runs a stage holding them all
    (octorun.stage): each layer's input detached and, where floating, made a leaf that requires
    grad; each forward in its own autocast region, recording what autograd saves into boxes;
    the backward one autograd call per layer, from the last layer to the first, each handing the
    gradients of its inputs down to the layer before.

    Why one call per layer and not one ``backward()`` over the whole chain with hooks at the
    boundaries: the per-layer calls are what the runtime executes for a B, I or W op, per-call
    costs included, so the times measured here are the work a plan's ops do. They are also
    separable by construction: a layer's call returns before the next one starts, on the CPU
    thread and (for the events) on the GPU's stream, whereas inside one ``backward()`` the
    autograd engine orders nodes by itself and a boundary hook only says when one gradient was
    ready. What this leaves out is what the runtime adds around a stage (sends, receives, the
    runtime's own bookkeeping): a plan's ``op_overhead_us`` and ``latency_us``."""

    def __init__(self, loss: LossFn, modules: list[torch.nn.Module], names: list[str], inputs: Any, targets: Any,
                 device: torch.device, precision: str):
        self.loss, self.modules, self.names = loss, modules, names
        self.inputs, self.targets = inputs, targets
        self.device, self.precision = device, precision
        self.params = [[p for p in module.parameters() if p.requires_grad] for module in modules]
        self.current = 0  # the layer running now, named when it fails
        # the layers whose forward changed an input in place (an integer one: a floating input is
        # a leaf that autograd refuses to see changed): the backward of the layer before, which
        # may hold that tensor, then fails in its own name, and the blame belongs here
        self.changed_inputs: list[int] = []

    @property
    def last(self) -> int:
        return len(self.modules) - 1

    def forward(self, mark: Callable[[], None]) -> list[Tape]:
        """F of every layer, with a mark before the first and after each one (the last one's
        includes the loss)."""
        value, tapes = self.inputs, []
        mark()
        for index, module in enumerate(self.modules):
            self.current = index
            args = as_args(value)
            if index:  # the model's inputs are data: they need no gradient
                args = tuple(a.detach().requires_grad_(a.is_floating_point()) for a in args)
            saved = SavedTensors()
            versions = [a._version for a in args]
            with saved.recording(), autocast(self.device, self.precision):
                value = module(*args)
                if index == self.last:
                    loss = self.loss(index, self.names[index], value, self.targets)
            if index and [a._version for a in args] != versions and index not in self.changed_inputs:
                self.changed_inputs.append(index)
            inputs = [a for a in args if a.requires_grad]
            if index == self.last:
                tapes.append(Tape(inputs, [root_edge(loss)], saved, torch.ones_like(loss)))
            else:
                tapes.append(Tape(inputs, [root_edge(t) for t in as_args(value) if t.is_floating_point()], saved))
            mark()
        return tapes

    @staticmethod
    def _differentiable(tape: Tape, grads: Sequence[torch.Tensor] | None) -> tuple[list[Any], list[torch.Tensor]]:
        """The (root, gradient) pairs autograd can use: outputs that carry a gradient."""
        if tape.loss_grad is not None:
            return tape.roots, [tape.loss_grad]
        pairs = [(root, g) for root, g in zip(tape.roots, grads or ()) if root is not None]
        return [root for root, _ in pairs], [g for _, g in pairs]

    def backward_fused(self, tapes: list[Tape], mark: Callable[[], None]) -> None:
        """B of every layer, last to first: one ``torch.autograd.grad`` per layer for its inputs
        and parameters together; a mark before the first and after each one."""
        grads: tuple[torch.Tensor, ...] | None = None
        mark()
        for index in reversed(range(len(tapes))):
            self.current = index
            tape = tapes[index]
            roots, gouts = self._differentiable(tape, grads)
            targets = [*tape.inputs, *self.params[index]]
            if roots and targets:
                found = torch.autograd.grad(roots, targets, gouts, allow_unused=True)
                grads = _zeros_for_none(found[: len(tape.inputs)], tape.inputs)
            else:
                grads = tuple(torch.zeros_like(t) for t in tape.inputs)
            mark()

    def backward_input(self, tapes: list[Tape], mark: Callable[[], None]) -> list[PendingWeightGrads | None]:
        """I of every layer, last to first (:func:`backward_input`), releasing what only I reads
        as octorun's I op does; returns what each layer's W needs."""
        grads: tuple[torch.Tensor, ...] | None = None
        pending: list[PendingWeightGrads | None] = [None] * len(tapes)
        mark()
        for index in reversed(range(len(tapes))):
            self.current = index
            tape = tapes[index]
            roots, gouts = self._differentiable(tape, grads)
            if roots:
                found, pending[index] = backward_input(roots, gouts, tape.inputs, self.params[index], saved=tape.saved)
                grads = _zeros_for_none(found, tape.inputs)
                tape.saved.release()
            else:
                grads = tuple(torch.zeros_like(t) for t in tape.inputs)
            mark()
        return pending

    def backward_weight(self, pending: list[PendingWeightGrads | None], mark: Callable[[], None]) -> None:
        """W of every layer, first to last as octorun's W op walks a stage; a mark before the
        first and after each one."""
        mark()
        for index, layer_pending in enumerate(pending):
            self.current = index
            if layer_pending is not None:
                backward_weight(layer_pending)
            mark()

    def whole(self) -> None:
        """The reference: the model as plain PyTorch trains it, the layers chained without
        detaching, the loss, one ``backward()``; each layer's forward in its autocast region.
        Call :meth:`clear_grads` before, so that the backward's gradients are new tensors each
        time rather than added to the last ones."""
        value: Any = self.inputs
        for index, module in enumerate(self.modules):
            self.current = index
            with autocast(self.device, self.precision):
                value = module(*as_args(value))
                if index == self.last:
                    loss = self.loss(index, self.names[index], value, self.targets)
        loss.backward()

    def clear_grads(self) -> None:
        for params in self.params:
            for p in params:
                p.grad = None


@dataclass
class SequenceSamples:
    """Per-layer samples of the in-sequence runs, one per timed repeat (two for F: both passes
    run the same forward), and the whole model's."""

    forward: list[list[float]]
    fused: list[list[float]]
    input: list[list[float]]
    weight: list[list[float]]
    f_plus_b: list[list[float]]  # per repeat, the fused pass's F + B: what the spread is of
    passes: list[float]  # per repeat, the fused pass's F and B of all layers, start to end
    whole: list[float]
    has_inputs: list[bool]  # the layer has floating inputs (an I to do)
    has_params: list[bool]
    has_roots: list[bool]  # its output carries a gradient (any backward to do)


def time_in_sequence(chain: Chain, *, clock: _Clock, repeat: int, warmup: int) -> SequenceSamples:
    """``warmup`` untimed and ``repeat`` timed rounds; each round runs, in turn, the chain's F
    then B, its F then I then W, and the whole model. Round r of every layer and of the whole
    model comes before round r + 1 of any, so a drift in the machine's speed (a neighbour's
    load, the clock frequency) moves every layer alike and the layers' shares keep still."""
    n = len(chain.modules)
    rounds: list[dict[str, Marks]] = []
    for r in range(warmup + repeat):
        marks = {name: Marks(clock) for name in ("F1", "B", "F2", "I", "W", "whole")}
        tapes = chain.forward(marks["F1"])
        if r == 0:
            shape = ([bool(t.inputs) for t in tapes], [bool(p) for p in chain.params],
                     [any(root is not None for root in t.roots) for t in tapes])
        chain.backward_fused(tapes, marks["B"])
        tapes = chain.forward(marks["F2"])
        pending = chain.backward_input(tapes, marks["I"])
        chain.backward_weight(pending, marks["W"])
        del tapes, pending
        chain.clear_grads()
        marks["whole"]()
        chain.whole()
        marks["whole"]()
        chain.clear_grads()
        if r >= warmup:
            rounds.append(marks)
    clock.sync()  # the events' times are read only now
    forward, fused, inputs, weight, f_plus_b = ([[] for _ in range(n)] for _ in range(5))
    passes, whole = [], []
    for marks in rounds:
        f1, f2 = marks["F1"].durations_ms(), marks["F2"].durations_ms()
        b, i = marks["B"].durations_ms()[::-1], marks["I"].durations_ms()[::-1]  # marked last layer first
        w = marks["W"].durations_ms()
        for index in range(n):
            forward[index] += [f1[index], f2[index]]
            fused[index].append(b[index])
            inputs[index].append(i[index])
            weight[index].append(w[index])
            f_plus_b[index].append(f1[index] + b[index])
        passes.append(sum(f1) + sum(b))
        whole += marks["whole"].durations_ms()
    return SequenceSamples(forward, fused, inputs, weight, f_plus_b, passes, whole, *shape)


def least(samples: Sequence[float]) -> float:
    """The time a profile keeps of a layer's repeats: the least.

    A repeat runs a fixed amount of work, and whatever else shares the machine (another
    process, a clock that slows, a cache another job emptied) only ever adds to it, so the
    least repeat is the closest to the work itself. It is also the figure that repeats: three
    back-to-back profiles of each example model on this project's shared CPU moved a layer's
    share of the sum by 3.4-6.6% with the least repeat, against 12.3-22.4% with the median
    (docs/BENCHMARKS.md, "Profiler accuracy"). The spread (:func:`relative_spread`) still says how
    far the repeats fell apart."""
    return min(samples)


def in_sequence_times(samples: SequenceSamples, index: int) -> LayerTimes:
    """A layer's F, I, W and B, the least of its in-sequence samples (:func:`least`), by the
    rules of the isolated timing: no I without floating inputs (the first layer's are data), no
    W without parameters, no backward where the output carries no gradient; and where there is
    no I, W and B are one autograd pass and get one figure, the least of both passes' samples."""
    backward = samples.has_roots[index]
    has_inputs, has_params = samples.has_inputs[index] and backward, samples.has_params[index] and backward
    forward_ms = least(samples.forward[index])
    input_ms = least(samples.input[index]) if has_inputs else 0.0
    weight_ms = least(samples.weight[index]) if has_params else 0.0
    fused_ms = least(samples.fused[index]) if has_inputs or has_params else 0.0
    if has_params and not has_inputs:
        weight_ms = fused_ms = least(samples.weight[index] + samples.fused[index])
    return LayerTimes(forward_ms, input_ms, weight_ms, fused_ms)


