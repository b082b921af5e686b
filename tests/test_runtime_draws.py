"""A layer's random draws in octorun's training forward (FORMATS.md section 4): keyed by the run's
seed, the step, the microbatch's position in the global batch and the layer's index, so that
wherever a plan cuts the layers, whichever rank runs them, whatever else drew numbers before,
and with or without recomputation, each layer draws the masks one process would draw."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import runtime_helpers as h
from octorun.stage import StageExecutor

SEED = 7


def _layers() -> list[nn.Module]:
    torch.manual_seed(3)
    return [nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.5)) for _ in range(4)]


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(5, 6, generator=generator), torch.randn(5, 6, generator=generator)


def _run(cuts: list[int], *, recompute: set[int] = frozenset(), draws: tuple[int, int] = (2, 3)):
    """The 4 layers cut into stages at ``cuts``, F through every stage and then I+W (B on the
    last) back; the process generator is reseeded and drawn from between ops, as other
    microbatches' work would. Returns the loss and every parameter's gradient."""
    layers = _layers()
    bounds = [0, *cuts, len(layers)]
    stages = [StageExecutor(layers[a:b], first=a == 0, last=b == len(layers), loss_fn=_loss, loss_scale=1.0,
                            recompute=index in recompute, layer_indices=range(a, b), seed=SEED)
              for index, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    value, target = _batch()
    tapes = []
    for index, stage in enumerate(stages):
        torch.manual_seed(100 + index)
        value, tape = stage.forward(value, target if stage.last else None, draws=draws)
        tapes.append(tape)
        torch.rand(7)
    grads = None
    for stage, tape in zip(reversed(stages), reversed(tapes)):
        torch.rand(3)
        if stage.last:
            grads = stage.backward(tape, None)
        else:
            grads = stage.backward_input(tape, grads)
            torch.rand(5)
            stage.backward_weight(tape)
    return tapes[-1].loss, [p.grad for layer in layers for p in layer.parameters()]


def _one_process(draws: tuple[int, int] = (2, 3)):
    """The same layers in one process, each seeded by the spec's formula before its forward."""
    layers = _layers()
    value, target = _batch()
    for index, layer in enumerate(layers):
        h.seed_draws(seed=SEED, step=draws[0], position=draws[1], layer=index)
        value = layer(value)
    loss = _loss(value, target)
    loss.backward()
    return loss.detach(), [p.grad for layer in layers for p in layer.parameters()]


@pytest.mark.parametrize("cuts,recompute", [([], set()), ([2], set()), ([1, 3], {1}), ([1, 2, 3], {0, 2})],
                         ids=["one stage", "two stages", "three, the middle recomputing", "four, two recomputing"])
def test_each_layer_draws_its_own_masks_wherever_the_plan_cuts(cuts, recompute):
    want_loss, want_grads = _one_process()
    loss, grads = _run(cuts, recompute=recompute)
    assert torch.equal(loss, want_loss)
    for got, want in zip(grads, want_grads, strict=True):
        assert torch.equal(got, want)


def test_another_position_or_step_draws_other_masks():
    """The key really reaches the masks: replica 1's microbatch 0 (another position) and the
    next step each give another loss than position 3 of step 2; the same key the same one."""
    loss, _ = _run([2])
    assert torch.equal(_run([2])[0], loss)
    assert not torch.equal(_run([2], draws=(2, 4))[0], loss)
    assert not torch.equal(_run([2], draws=(3, 3))[0], loss)
