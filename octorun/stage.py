"""Executing one stage's layers: F, and the per-layer I/W split of the backward.

Assumptions (shared with the profiler): each layer's forward input is detached and, for floating
tensors, made to require grad, so a layer's backward touches that layer only. ``I`` walks the
stage's layers from last to first with :func:`octoplan.splitgrad.backward_input`, which also
captures where each layer's parameter branches leave the input path; ``W`` later runs only
those branches (:func:`octoplan.splitgrad.backward_weight`) and accumulates into ``.grad`` —
the same split the profiler measures, so I + W costs about one fused backward. ``B`` does both
in one autograd pass per layer. Values are a Tensor or a tuple of Tensors; integer tensors pass
through without gradients. The gradient travelling between stages is a tuple with one tensor
per floating tensor of the stage input, in order (zeros where the input was unused).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from octoplan.modelfile import as_args
from octoplan.splitgrad import PendingWeightGrads, backward_input, backward_weight

__all__ = ["StageExecutor", "Tape", "floating"]


def floating(values: Sequence[Any]) -> list[torch.Tensor]:
    """The floating-point tensors of a value tuple, in order: the ones that carry gradients."""
    return [v for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()]


@dataclass
class _LayerTape:
    inputs: list[torch.Tensor]  # the detached floating inputs (leaves that require grad)
    outputs: list[torch.Tensor]  # floating outputs (the scaled loss for the model's last layer)
    grad_outputs: list[torch.Tensor] | None = None
    pending: PendingWeightGrads | None = None  # left by I for W


@dataclass
class Tape:
    """What F of one (stage, mb) keeps for its backward ops."""

    layers: list[_LayerTape] = field(default_factory=list)
    loss: torch.Tensor | None = None  # unscaled, detached; last stage only


def _zeros_for_none(grads: Sequence[torch.Tensor | None], like: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, like))


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
    ):
        self.layers = list(layers)
        self.first = first
        self.last = last
        self.loss_fn = loss_fn
        self.loss_scale = loss_scale
        self.params = [[p for p in layer.parameters() if p.requires_grad] for layer in self.layers]

    def forward(self, value: Any, targets: Any = None) -> tuple[Any, Tape]:
        """Run the stage; returns (output value, or None on the last stage; tape)."""
        tape = Tape()
        for index, layer in enumerate(self.layers):
            args = as_args(value)
            if not (self.first and index == 0):  # the model's inputs need no gradient
                args = tuple(
                    a.detach().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a
                    for a in args
                )
            inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
            value = layer(*args)
            if self.last and index == len(self.layers) - 1:
                loss = self.loss_fn(value, targets)
                tape.loss = loss.detach()
                tape.layers.append(_LayerTape(inputs, [loss * self.loss_scale]))
                return None, tape
            tape.layers.append(_LayerTape(inputs, floating(as_args(value))))
        return value, tape

    def backward_input(self, tape: Tape, grad_output: Sequence[torch.Tensor] | None) -> tuple[torch.Tensor, ...]:
        """I: gradients w.r.t. the stage's floating inputs; keeps each layer's output gradient."""
        grads = self._output_grads(tape, grad_output)
        for layer_tape, params in zip(reversed(tape.layers), reversed(self.params)):
            layer_tape.grad_outputs = list(grads)
            outs, gouts = self._differentiable(layer_tape)
            if outs:
                found, layer_tape.pending = backward_input(outs, gouts, layer_tape.inputs, params)
                grads = _zeros_for_none(found, layer_tape.inputs)
            else:
                grads = tuple(torch.zeros_like(t) for t in layer_tape.inputs)
        return grads

    def backward_weight(self, tape: Tape) -> None:
        """W: parameter gradients from the kept output gradients, accumulated into ``.grad``."""
        for layer_tape in tape.layers:
            if layer_tape.pending is not None:
                _accumulate(layer_tape.pending.params, backward_weight(layer_tape.pending))
            layer_tape.pending = None  # free the graph
            layer_tape.outputs = layer_tape.grad_outputs = layer_tape.inputs = []

    def backward(self, tape: Tape, grad_output: Sequence[torch.Tensor] | None) -> tuple[torch.Tensor, ...]:
        """B: I and W fused, one autograd pass per layer."""
        grads = self._output_grads(tape, grad_output)
        for layer_tape, params in zip(reversed(tape.layers), reversed(self.params)):
            layer_tape.grad_outputs = list(grads)
            outs, gouts = self._differentiable(layer_tape)
            targets = layer_tape.inputs + params
            if outs and targets:
                found = torch.autograd.grad(outs, targets, gouts, allow_unused=True)
                grads = _zeros_for_none(found[: len(layer_tape.inputs)], layer_tape.inputs)
                _accumulate(params, found[len(layer_tape.inputs):])
            else:
                grads = tuple(torch.zeros_like(t) for t in layer_tape.inputs)
            layer_tape.outputs = layer_tape.grad_outputs = layer_tape.inputs = []
        return grads

    def _output_grads(self, tape: Tape, grad_output: Sequence[torch.Tensor] | None) -> tuple[torch.Tensor, ...]:
        if self.last:
            return (torch.ones_like(tape.layers[-1].outputs[0]),)
        if grad_output is None:
            raise RuntimeError("a stage that is not the last needs the gradient of its output")
        return tuple(grad_output)

    @staticmethod
    def _differentiable(layer_tape: _LayerTape) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The (output, gradient) pairs autograd can use: outputs that depend on something learnable."""
        pairs = [(o, g) for o, g in zip(layer_tape.outputs, layer_tape.grad_outputs or ()) if o.requires_grad]
        return [o for o, _ in pairs], [g for _, g in pairs]


def _accumulate(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    for param, grad in zip(params, grads):
        if grad is None:
            continue
        if param.grad is None:
            param.grad = grad
        else:
            param.grad.add_(grad)
