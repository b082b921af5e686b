"""One stage's F / I / W / B against plain autograd of the whole model, in one process."""

from __future__ import annotations

import pytest
import torch

import runtime_helpers as h
from octoplan.modelfile import as_args, load_model_file
from octorun.stage import StageExecutor


pytestmark = pytest.mark.usefixtures("one_thread")


def _setup(tmp_path, name):
    model_path, config = h.model_spec(name, tmp_path)
    model = load_model_file(model_path, config)
    layers = [model.build_layer(i) for i in range(model.num_layers())]
    cut = len(layers) // 2
    stages = [
        StageExecutor(layers[:cut], first=True, last=False, loss_fn=model.loss, loss_scale=0.25),
        StageExecutor(layers[cut:], first=False, last=True, loss_fn=model.loss, loss_scale=0.25),
    ]
    return model, layers, stages


def _reference_grads(model, layers, batch):
    inputs, targets = batch
    value = inputs
    for layer in layers:
        value = layer(*as_args(value))
    loss = model.loss(value, targets) * 0.25
    params = [p for layer in layers for p in layer.parameters()]
    return loss.item() / 0.25, torch.autograd.grad(loss, params, allow_unused=True)


@pytest.mark.parametrize("name", ["tiny", "vlm", "hybrid"])
@pytest.mark.parametrize("split", [True, False], ids=["I+W", "B"])
def test_stage_backward_equals_autograd(tmp_path, name, split):
    model, layers, stages = _setup(tmp_path, name)
    batch = model.sample_batch(2, step=0, replica=0, mb=0)
    loss, expected = _reference_grads(model, layers, batch)
    out, tape0 = stages[0].forward(batch[0])
    none, tape1 = stages[1].forward(out, batch[1])
    assert none is None and tape1.loss.item() == pytest.approx(loss, abs=1e-6)
    if split:
        grad = stages[1].backward_input(tape1, None)
        assert all(p.grad is None for layer in layers for p in layer.parameters())  # I leaves weights alone
        assert stages[0].backward_input(tape0, grad) == ()  # the model's input gets no gradient
        stages[1].backward_weight(tape1)
        stages[0].backward_weight(tape0)
    else:
        stages[0].backward(tape0, stages[1].backward(tape1, None))
    params = [p for layer in layers for p in layer.parameters()]
    for param, want in zip(params, expected):
        if want is None:
            assert param.grad is None
        else:
            torch.testing.assert_close(param.grad, want, rtol=0, atol=1e-6)


def test_stage_gradient_message_has_one_tensor_per_floating_input(tmp_path):
    model, layers, stages = _setup(tmp_path, "tiny")  # the boundary carries (float hidden, int64 ids)
    inputs, targets = model.sample_batch(2, step=0, replica=0, mb=0)
    out, _ = stages[0].forward(inputs)
    assert [t.dtype for t in out] == [torch.float32, torch.int64]
    _, tape = stages[1].forward(out, targets)
    grads = stages[1].backward_input(tape, None)
    assert len(grads) == 1 and grads[0].shape == out[0].shape and grads[0].abs().sum() > 0


def test_weight_gradients_accumulate_over_microbatches(tmp_path):
    model, layers, stages = _setup(tmp_path, "tiny")
    batches = [model.sample_batch(2, step=0, replica=0, mb=m) for m in range(2)]
    expected = [torch.zeros_like(p) for layer in layers for p in layer.parameters()]
    for batch in batches:
        _, grads = _reference_grads(model, layers, batch)
        for acc, g in zip(expected, grads):
            acc += g
    for batch in batches:
        out, tape0 = stages[0].forward(batch[0])
        _, tape1 = stages[1].forward(out, batch[1])
        stages[0].backward(tape0, stages[1].backward(tape1, None))
    for param, want in zip([p for layer in layers for p in layer.parameters()], expected):
        torch.testing.assert_close(param.grad, want, rtol=0, atol=1e-6)
