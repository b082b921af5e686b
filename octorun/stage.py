"""Executing one stage's layers: F, and the per-layer I/W split of the backward.

Assumptions (shared with the profiler): each layer's forward input is detached and, for floating
tensors, made to require grad, so a layer's backward touches that layer only. ``I`` walks the
stage's layers from last to first with :func:`octoplan.splitgrad.backward_input`, which also
captures where each layer's parameter branches leave the input path; ``W`` later runs only
those branches (:func:`octoplan.splitgrad.backward_weight`) and accumulates into ``.grad`` —
the same split the profiler measures, so I + W costs about one fused backward. ``B`` does both
in one autograd pass per layer.

What a tape holds: each layer's floating inputs, the tensors autograd saved in its forward
(in :class:`octoplan.splitgrad.SavedTensors` boxes) and, for its outputs, only their gradient
edges, so a stage's output is not held once it is sent on. After a layer's I the tape keeps
only what its W reads: the boxes of the weight branches, the gradients I captured, and the
inputs (the graph W runs holds them anyway); the rest is released there and then.

Values are a Tensor or a tuple of Tensors; integer tensors pass through without gradients. The gradient travelling between stages is a tuple with one tensor
per floating tensor of the stage input, in order (zeros where the input was unused).

Activation recomputation (``recompute=True``, a plan stage's ``recompute: true``): F runs the
stage under :func:`torch.no_grad`, so no layer keeps activations or a graph; its tape holds only
what it takes to run the same forward again: the stage input (detached), the targets, the RNG
states at the start of F (the CPU generator's, and that of each CUDA device holding the stage's
weights or input) and F's ``draws`` key, if any. The stage's first backward op, I or B, first
rebuilds the tape by running the one forward implementation again with grad enabled, on the
stashed input and with those RNG states restored inside :func:`torch.random.fork_rng` (so dropout draws the same masks, and the global RNG stream
afterwards is the same as without recomputation); then it does exactly what it does without
recomputation, and W uses what I left. The rebuilt graph is the one F would have kept — the same
layers, input, parameters (no optimizer step happens between a microbatch's F and its backward)
and random draws — so the gradients are identical, as long as the layers compute the same values
with and without grad mode (torch's kernels do on CPU; a layer that changes state in its forward,
such as BatchNorm's running statistics, would do so twice). The price is one more stage forward
per microbatch, which the planner's cost model (octoplan.costs) charges to the first backward op.

With ``recompute_layers=k`` (a plan stage's ``recompute_layers``) only the stage's first k layers
work that way: F runs them under :func:`torch.no_grad` and the rest with their tapes, as without
recomputation, and the rebuild runs only those k layers again, from the stash, putting their
tapes in front of the kept ones. Each layer's input is a detached leaf either way, so the kept
tapes do not care that their input now comes from a rebuilt layer: the values are the same.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.autograd.graph import GradientEdge

from octoplan.modelfile import as_args, forward_seed
from octoplan.precision import autocast
from octoplan.splitgrad import PendingWeightGrads, SavedTensors, backward_input, backward_weight, root_edge
from octorun.activations import ActivationMeter, Hold

__all__ = ["StageExecutor", "Tape", "floating"]


def floating(values: Sequence[Any]) -> list[torch.Tensor]:
    """The floating-point tensors of a value tuple, in order: the ones that carry gradients."""
    return [v for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()]


@dataclass
class _LayerTape:
    inputs: list[torch.Tensor]  # the detached floating inputs (leaves that require grad)
    # where the backward starts, one per floating output (None where it carries no gradient;
    # the scaled loss for the model's last layer): edges, so the tape holds no output storage
    roots: list[GradientEdge | None]
    saved: SavedTensors | None = None  # what autograd saved in the layer's forward
    pending: PendingWeightGrads | None = None  # left by I for W
    held: list[Hold] = field(default_factory=list)  # with a meter: what this tape keeps counts there


@dataclass
class _Stash:
    """What F of a recomputing stage keeps to run the same forward again."""

    value: Any  # the stage input, its tensors detached
    targets: Any
    cpu_rng: torch.Tensor  # torch.get_rng_state() at the start of F
    cuda_rng: dict[int, torch.Tensor]  # CUDA device index -> its RNG state at the start of F
    draws: tuple[int, int] | None = None  # F's (step, position): the rebuild seeds each layer alike
    held: list[Hold] = field(default_factory=list)


@dataclass
class Tape:
    """What F of one (stage, mb) keeps for its backward ops."""

    layers: list[_LayerTape] = field(default_factory=list)
    loss: torch.Tensor | None = None  # unscaled, detached; last stage only
    stash: _Stash | None = None  # recompute only: until the first backward op rebuilds ``layers``


def _zeros_for_none(grads: Sequence[torch.Tensor | None], like: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The input gradients a layer's backward hands on, each in a storage of its own size."""
    return tuple(torch.zeros_like(t) if g is None else compact(g) for g, t in zip(grads, like))


def compact(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, copied where it is a view into a larger storage (the input gradients of a
    layer that concatenates its inputs are slices of one gradient; a layer may return a slice
    of a wider output). What a tape keeps of it (an I's captured gradient, a recomputing
    stage's stash) then holds the tensor's bytes, as the profile measures them, and not the
    whole storage for as long as the tape lives."""
    if tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
        return tensor.clone(memory_format=torch.contiguous_format)
    return tensor


class StageExecutor:
    """F / I / W / B of one stage on one rank."""

    def __init__(
        self,
        layers: Sequence[torch.nn.Module],
        *,
        first: bool,
        last: bool,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        loss_scale: float,
        recompute: bool = False,
        recompute_layers: int | None = None,
        meter: ActivationMeter | None = None,
        precision: str = "fp32",
        layer_indices: Sequence[int] | None = None,
        seed: int = 0,
    ):
        self.layers = list(layers)
        # the model's index of each layer and the run's --seed: what a keyed F seeds each layer's
        # random draws with (forward_seed), so a layer draws alike wherever a plan puts it
        self.layer_indices = list(range(len(self.layers)) if layer_indices is None else layer_indices)
        self.seed = seed
        self.precision = precision  # each layer's forward runs in octoplan.precision.autocast
        self.meter = meter
        self.first = first
        self.last = last
        self.loss_fn = loss_fn
        self.loss_scale = loss_scale
        self.recompute = recompute
        # how many of the first layers F runs without their tapes, to run them again later
        self.recompute_layers = (len(self.layers) if recompute_layers is None else min(recompute_layers, len(self.layers))) \
            if recompute else 0
        self.params = [[p for p in layer.parameters() if p.requires_grad] for layer in self.layers]
        # the state the recomputed layers' forward updates (BatchNorm's running statistics): F
        # updated it once, so the rebuild leaves it as F left it
        self._recomputed_slots = list(persistent_buffer_slots(self.layers[:self.recompute_layers]))
        # CUDA devices of the stage's weights, whose RNG state a recomputed forward restores
        self._cuda_devices = {
            _device_index(t) for layer in self.layers for t in (*layer.parameters(), *layer.buffers()) if t.is_cuda
        }

    def forward(self, value: Any, targets: Any = None, draws: tuple[int, int] | None = None) -> tuple[Any, Tape]:
        """Run the stage; returns (output value, or None on the last stage; tape).

        ``draws``: (step, the microbatch's position in the step's global batch). Each layer then
        runs with torch's generators seeded by :func:`octoplan.modelfile.forward_seed`, so its
        dropout masks are the same under any plan and in one process (FORMATS.md section 4).
        Without it the layers draw on from the process's generators.

        With ``recompute`` the tape keeps no activations of the recomputed layers, only the stash
        to run them again.
        """
        if not self.recompute:
            return self._forward(value, targets, draws=draws)
        devices = self._devices(value)
        stash = _Stash(value=_detached(value), targets=targets, cpu_rng=torch.get_rng_state(),
                       cuda_rng={d: torch.cuda.get_rng_state(d) for d in sorted(devices)}, draws=draws)
        if not self.first:  # the first stage's stash is the microbatch itself, not an activation
            stash.held = self._hold(as_args(stash.value))
        with torch.no_grad():
            output, tape = self._forward(value, targets, stop=self.recompute_layers, draws=draws)
        kept = Tape()
        if self.recompute_layers < len(self.layers):  # the layers after the recomputed ones keep their tapes
            output, kept = self._forward(output, targets, begin=self.recompute_layers, draws=draws)
        return output, Tape(layers=kept.layers, loss=tape.loss if kept.loss is None else kept.loss, stash=stash)

    def evaluate(self, value: Any, targets: Any = None, draws: tuple[int, int] | None = None) -> tuple[Any, torch.Tensor | None]:
        """The stage's forward in an evaluation (octorun.evaluation): under no_grad, at the run's
        precision, keeping nothing for a backward, its layers seeded by ``draws`` as in
        :meth:`forward`. Returns (output, or None on the last stage; the loss there, else None)."""
        with torch.no_grad():
            output, tape = self._forward(value, targets, draws=draws)
        return output, tape.loss

    def _devices(self, value: Any) -> set[int]:
        """The CUDA devices whose generators the stage's layers may draw from: those of its
        weights and of its input."""
        return self._cuda_devices | {_device_index(t) for t in as_args(value) if isinstance(t, torch.Tensor) and t.is_cuda}

    def _forward(self, value: Any, targets: Any, *, begin: int = 0, stop: int | None = None,
                 draws: tuple[int, int] | None = None) -> tuple[Any, Tape]:
        """The one forward implementation, of layers ``begin`` to ``stop`` (the stage's end):
        F, and the rebuild of a recomputing stage's tapes."""
        tape = Tape()
        devices = sorted(self._devices(value)) if draws is not None else []
        for index in range(begin, len(self.layers) if stop is None else stop):
            layer = self.layers[index]
            if draws is not None:
                # the generators themselves, not torch.manual_seed: that one also visits every
                # other device type, 100x the cost (about 1 us for the CPU's generator)
                seed = forward_seed(seed=self.seed, step=draws[0], position=draws[1], layer=self.layer_indices[index])
                torch.default_generator.manual_seed(seed)
                for device in devices:
                    torch.cuda.default_generators[device].manual_seed(seed)
            args = as_args(value)
            if not (self.first and index == 0):  # the model's inputs need no gradient
                args = tuple(
                    a.detach().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a
                    for a in args
                )
            inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
            grad = torch.is_grad_enabled()  # off in a recomputing F, which keeps no tape
            saved = SavedTensors(None if self.meter is None else self.meter.hold_one) if grad else None
            ends_model = self.last and index == len(self.layers) - 1
            with saved.recording() if grad else nullcontext(), self._autocast(layer, args):
                value = layer(*args)
                loss = self.loss_fn(value, targets) if ends_model else None
            if ends_model:
                tape.loss = loss.detach()
                if grad:  # the scaled loss, a backward root of 4 bytes, is not an activation
                    tape.layers.append(_LayerTape(inputs, [root_edge(loss * self.loss_scale)], saved, held=self._hold(inputs)))
                return None, tape
            if grad:  # without grad a tape would only keep outputs alive
                roots = [root_edge(t) for t in floating(as_args(value))]
                tape.layers.append(_LayerTape(inputs, roots, saved, held=self._hold(inputs)))
        return value, tape

    def _autocast(self, layer: torch.nn.Module, args: Sequence[Any]):
        if self.precision == "fp32":
            return nullcontext()
        return autocast(_device_of(layer, args), self.precision)

    def _hold(self, tensors: Sequence[Any]) -> list[Hold]:
        return [] if self.meter is None else self.meter.hold(tensors)

    def _rebuild(self, tape: Tape) -> None:
        """Recompute: run F again with grad, from the stash and with its RNG states, filling the tape."""
        stash = tape.stash
        if stash is None:
            return
        with torch.random.fork_rng(devices=list(stash.cuda_rng), device_type="cuda"):
            torch.set_rng_state(stash.cpu_rng)
            for device, state in stash.cuda_rng.items():
                torch.cuda.set_rng_state(state, device)
            kept = [module._buffers[name].clone() for module, name in self._recomputed_slots]
            with torch.enable_grad():
                _, rebuilt = self._forward(stash.value, stash.targets, stop=self.recompute_layers, draws=stash.draws)
            # F's values back as the modules' buffers: new tensors, since the rebuilt graph saved
            # the ones it updated (autograd refuses a saved tensor changed in place)
            for (module, name), value in zip(self._recomputed_slots, kept):
                module._buffers[name] = value
        tape.layers = rebuilt.layers + tape.layers  # tape.loss stays F's (the same value)
        tape.stash = None  # from here on the tape is the one F keeps without recompute

    def backward_input(self, tape: Tape, grad_output: Sequence[torch.Tensor] | None) -> tuple[torch.Tensor, ...]:
        """I: gradients w.r.t. the stage's floating inputs. Each layer then keeps only what its W
        reads: the saved tensors of its weight branches, the gradients arriving there, and
        its inputs, which the graph W runs holds anyway (:mod:`octoplan.splitgrad`)."""
        self._rebuild(tape)
        grads = self._output_grads(tape, grad_output)
        for layer_tape, params in zip(reversed(tape.layers), reversed(self.params)):
            roots, gouts = self._differentiable(layer_tape, grads)
            if roots:
                found, pending = backward_input(roots, gouts, layer_tape.inputs, params, saved=layer_tape.saved)
                grads = _zeros_for_none(found, layer_tape.inputs)
                # the gradients captured for W are held until W; they exist before the frees below
                holds = self._hold(pending.gradients())
                if pending.keeps_inputs:
                    holds += layer_tape.held
                else:
                    layer_tape.inputs = []
                layer_tape.pending, layer_tape.held = pending, holds
            else:
                grads = tuple(torch.zeros_like(t) for t in layer_tape.inputs)
                layer_tape.inputs, layer_tape.held = [], []
            layer_tape.roots = []
            if layer_tape.saved is not None:
                layer_tape.saved.release()
        return grads

    def backward_weight(self, tape: Tape) -> None:
        """W: parameter gradients from what I captured, accumulated into ``.grad``."""
        for layer_tape in tape.layers:
            if layer_tape.pending is not None:
                _accumulate(layer_tape.pending.params, backward_weight(layer_tape.pending))
            layer_tape.pending = layer_tape.saved = None  # free the graph
            layer_tape.roots = layer_tape.inputs = layer_tape.held = []

    def backward(self, tape: Tape, grad_output: Sequence[torch.Tensor] | None) -> tuple[torch.Tensor, ...]:
        """B: I and W fused, one autograd pass per layer."""
        self._rebuild(tape)
        grads = self._output_grads(tape, grad_output)
        for layer_tape, params in zip(reversed(tape.layers), reversed(self.params)):
            roots, gouts = self._differentiable(layer_tape, grads)
            targets = layer_tape.inputs + params
            if roots and targets:
                found = torch.autograd.grad(roots, targets, gouts, allow_unused=True)
                grads = _zeros_for_none(found[: len(layer_tape.inputs)], layer_tape.inputs)
                _accumulate(params, found[len(layer_tape.inputs):])
            else:
                grads = tuple(torch.zeros_like(t) for t in layer_tape.inputs)
            layer_tape.saved = None
            layer_tape.roots = layer_tape.inputs = layer_tape.held = []
        return grads

    def _output_grads(self, tape: Tape, grad_output: Sequence[torch.Tensor] | None) -> tuple[torch.Tensor, ...]:
        if self.last:
            return (torch.ones_like(tape.loss),)
        if grad_output is None:
            raise RuntimeError("a stage that is not the last needs the gradient of its output")
        return tuple(grad_output)

    @staticmethod
    def _differentiable(layer_tape: _LayerTape, grads: Sequence[torch.Tensor]) -> tuple[list[GradientEdge], list[torch.Tensor]]:
        """The (root, gradient) pairs autograd can use: outputs that depend on something learnable."""
        pairs = [(root, g) for root, g in zip(layer_tape.roots, grads) if root is not None]
        return [root for root, _ in pairs], [g for _, g in pairs]


def persistent_buffer_slots(layers: Sequence[torch.nn.Module]) -> Iterator[tuple[torch.nn.Module, str]]:
    """(module, name) of each buffer of ``layers`` that their state_dicts hold, in layer order. A
    non-persistent buffer (a rotary table, a mask) is derived from the config, not learned."""
    for layer in layers:
        for module in layer.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and name not in module._non_persistent_buffers_set:
                    yield module, name


def persistent_buffers(layers: Sequence[torch.nn.Module]) -> list[torch.Tensor]:
    """The tensors of :func:`persistent_buffer_slots`, each once."""
    found = {id(module._buffers[name]): module._buffers[name] for module, name in persistent_buffer_slots(layers)}
    return list(found.values())


def _device_of(layer: torch.nn.Module, args: Sequence[Any]) -> torch.device:
    """Where a layer computes: its weights' device, else its input's (a parameterless layer)."""
    for tensor in (*layer.parameters(), *(a for a in args if isinstance(a, torch.Tensor))):
        return tensor.device
    return torch.device("cpu")


def _device_index(tensor: torch.Tensor) -> int:
    return tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()


def _detached(value: Any) -> Any:
    """``value`` with its tensors detached, and compact: the stash keeps no graph of an earlier
    stage alive, nor more of a wider tensor than the stage's input."""
    if isinstance(value, torch.Tensor):
        return compact(value.detach())
    if isinstance(value, (tuple, list)):
        return tuple(compact(v.detach()) if isinstance(v, torch.Tensor) else v for v in value)  # as_args spreads it alike
    return value


def _accumulate(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    for param, grad in zip(params, grads):
        if grad is None:
            continue
        if param.grad is None:
            # A copy, never autograd's result itself: for ``x + p`` with ``p`` of the output's
            # shape autograd hands back the upstream gradient unchanged, which is also the
            # layer's input gradient (sent on, or handed to the stage before). Adding the next
            # microbatch into it in place would change those too.
            param.grad = grad.clone()
        else:
            param.grad.add_(grad)
