"""The bundled example models (examples/models/{tiny_gpt,vlm,hybrid}.py) against FORMATS.md section 4.

Each model must load through octoplan.modelfile, chain its layers into a scalar loss, rebuild
bitwise-identically from a seed, survive the runtime's per-layer I/W split with the same
gradients as one whole backward, and actually learn from its SPEC-seeded data stream.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from octoplan.errors import InputError
from octoplan.modelfile import ModelFile, as_args, load_model_file, microbatch_seed

MODELS = Path(__file__).resolve().parents[1] / "examples" / "models"

# name -> (expected layer kinds in order, vocab for the near-uniform initial loss)
EXAMPLES = {
    "tiny_gpt": (["embedding"] + ["transformer"] * 4 + ["head"], 8192),
    "vlm": (["embedding", "vision", "vision", "projector", "decoder", "decoder", "decoder", "head"], 4096),
    "hybrid": (["embedding", "mamba", "attention", "mamba", "moe", "mamba", "attention", "mamba", "moe", "head"], 4096),
}
# The loss of knowing only which tokens occur, not the sequence structure: ln(data_vocab = 256)
# for the counting sequences; at most ln(8 classes x 16 caption tokens) for the VLM.
UNIGRAM_NATS = {"tiny_gpt": math.log(256), "hybrid": math.log(256), "vlm": math.log(8 * 16)}
MICROBATCH = 4


pytestmark = pytest.mark.usefixtures("one_thread")


def _load(name: str, config: dict | None = None, *, seed: int = 0) -> ModelFile:
    return load_model_file(MODELS / f"{name}.py", config, seed=seed)


def _build(model: ModelFile) -> list[torch.nn.Module]:
    return [model.build_layer(i) for i in range(model.num_layers())]


def _forward(layers: list[torch.nn.Module], inputs):
    value = inputs
    for layer in layers:
        value = layer(*as_args(value))
    return value


def _floats(value) -> list[torch.Tensor]:
    return [t for t in as_args(value) if t.is_floating_point()]


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_obeys_model_contract(name: str) -> None:
    kinds, vocab = EXAMPLES[name]
    model = _load(name)
    module = model.module
    assert isinstance(module.CONFIG, dict) and module.CONFIG
    assert model.num_layers() == len(kinds)
    assert [module.layer_kind(i, **model.config) for i in range(len(kinds))] == kinds
    names = [module.layer_name(i, **model.config) for i in range(len(kinds))]
    assert len(set(names)) == len(names)

    layers = _build(model)
    inputs, targets = model.sample_batch(MICROBATCH, step=0, replica=0, mb=0)
    logits = _forward(layers, inputs)
    assert logits.shape == (*targets.shape, vocab) and logits.dtype == torch.float32
    loss = model.loss(logits, targets)
    assert loss.dim() == 0
    # An untrained model predicts close to uniformly over its vocabulary.
    assert abs(loss.item() - math.log(vocab)) < 1.0
    loss.backward()
    for i, layer in enumerate(layers):
        for pname, param in layer.named_parameters():
            assert param.grad is not None and torch.isfinite(param.grad).all(), f"layer {i} {pname}"
            assert param.grad.abs().sum() > 0, f"layer {i} {pname} got a zero gradient"


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_build_and_data_are_deterministic(name: str) -> None:
    first = [layer.state_dict() for layer in _build(_load(name))]
    again = [layer.state_dict() for layer in _build(_load(name))]
    other = [layer.state_dict() for layer in _build(_load(name, seed=1))]
    for a, b, c in zip(first, again, other):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[key], b[key]) for key in a)
        assert any(not torch.equal(a[key], c[key]) for key in a if a[key].is_floating_point())

    model = _load(name)
    x1, y1 = model.sample_batch(MICROBATCH, step=3, replica=1, mb=2)
    x2, y2 = model.sample_batch(MICROBATCH, step=3, replica=1, mb=2)
    x3, _ = model.sample_batch(MICROBATCH, step=3, replica=1, mb=3)
    assert all(torch.equal(a, b) for a, b in zip(as_args(x1), as_args(x2))) and torch.equal(y1, y2)
    assert not all(torch.equal(a, b) for a, b in zip(as_args(x1), as_args(x3)))
    # every coordinate of the seed draws other data: another replica, step or --seed
    for other in (model.sample_batch(MICROBATCH, step=3, replica=0, mb=2), model.sample_batch(MICROBATCH, step=4, replica=1, mb=2),
                  _load(name, seed=1).sample_batch(MICROBATCH, step=3, replica=1, mb=2)):
        assert not all(torch.equal(a, b) for a, b in zip(as_args(x1), as_args(other[0])))


def test_microbatch_seed_is_the_formula_of_formats():
    # FORMATS.md section 4: ((seed * 1_000_003 + t) * 1_009 + d) * 10_007 + j, worked by hand
    assert microbatch_seed(seed=0, step=0, replica=0, mb=0) == 0
    assert microbatch_seed(seed=0, step=0, replica=0, mb=5) == 5
    assert microbatch_seed(seed=0, step=0, replica=2, mb=0) == 20_014
    assert microbatch_seed(seed=0, step=1, replica=0, mb=0) == 10_097_063
    assert microbatch_seed(seed=1, step=2, replica=3, mb=4) == ((1_000_005 * 1_009) + 3) * 10_007 + 4 == 10_097_113_515_340


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_per_layer_input_weight_split_matches_full_backward(name: str) -> None:
    """The runtime's convention: each layer gets a detached input; I then W per layer."""
    model = _load(name)
    layers = _build(model)
    inputs, targets = model.sample_batch(MICROBATCH, step=0, replica=0, mb=0)

    reference = model.loss(_forward(layers, inputs), targets)
    expected = torch.autograd.grad(reference, [p for layer in layers for p in layer.parameters()])

    layer_inputs, layer_outputs = [], []
    value = inputs
    for layer in layers:
        args = tuple(t.detach().requires_grad_() if t.is_floating_point() else t for t in as_args(value))
        value = layer(*args)
        layer_inputs.append(args)
        layer_outputs.append(value)
    loss = model.loss(value, targets)
    torch.testing.assert_close(loss, reference, rtol=0, atol=0)

    grads_out = list(torch.autograd.grad(loss, _floats(value)))
    weight_grads: list[tuple[torch.Tensor, ...]] = [()] * len(layers)
    for i in reversed(range(len(layers))):
        outs, ins = _floats(layer_outputs[i]), _floats(layer_inputs[i])
        # I: the gradient for the previous layer (the first layer may have only token ids).
        input_grads = torch.autograd.grad(outs, ins, grads_out, retain_graph=True) if ins else ()
        weight_grads[i] = torch.autograd.grad(outs, list(layers[i].parameters()), grads_out)  # W
        grads_out = list(input_grads)
    split = [g for grads in weight_grads for g in grads]
    assert len(split) == len(expected)
    for got, want in zip(split, expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_trains_on_its_data_stream(name: str) -> None:
    """Adam on the SPEC-seeded stream (two microbatches a step) clearly lowers the loss.

    Measured (torch 2.13, CPU): first-5 / last-5 mean losses gpt 8.29 / 3.03, vlm 7.04 / 0.10,
    hybrid 7.79 / 2.20."""
    model = _load(name)
    layers = _build(model)
    optimizer = torch.optim.Adam([p for layer in layers for p in layer.parameters()], lr=3e-3)
    num_mbs = 2
    losses = []
    for step in range(30):
        optimizer.zero_grad()
        total = 0.0
        for mb in range(num_mbs):
            inputs, targets = model.sample_batch(MICROBATCH, step=step, replica=0, mb=mb)
            loss = model.loss(_forward(layers, inputs), targets) / num_mbs  # SPEC: mean over microbatches
            loss.backward()
            total += loss.item()
        optimizer.step()
        losses.append(total)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.8 * first, losses
    # Below the unigram loss: it learned the structure, not just which tokens occur.
    assert last < UNIGRAM_NATS[name], losses


def test_tiny_gpt_head_costs_several_blocks() -> None:
    """The heterogeneity the example exists for: the head's FLOPs and the embedding's bytes."""
    model = _load("tiny_gpt")
    layers = _build(model)
    inputs, _ = model.sample_batch(MICROBATCH, step=0, replica=0, mb=0)
    flops = []
    value = inputs
    for layer in layers:
        with FlopCounterMode(display=False) as counter:
            value = layer(*as_args(value))
        flops.append(counter.get_total_flops())
    block_flops = max(flops[1:-1])
    assert flops[-1] > 4 * block_flops
    params = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    assert min(params[0], params[-1]) > 4 * max(params[1:-1])


def test_hybrid_moe_routes_to_top_k_experts() -> None:
    model = _load("hybrid")
    moe = model.build_layer(4)
    assert type(moe).__name__ == "MoEBlock" and len(moe.experts) == 4
    x = torch.randn(2, 8, 128)
    calls = []
    hooks = [expert.register_forward_hook(lambda m, a, out: calls.append(a[0].shape[0])) for expert in moe.experts]
    y = moe(x)
    for hook in hooks:
        hook.remove()
    assert y.shape == x.shape
    assert sum(calls) == 2 * 8 * 2  # every token visits exactly top_k = 2 experts
    # The router trains through the routing weights in the output.
    (router_grad,) = torch.autograd.grad(y.square().sum(), [moe.router.weight])
    assert router_grad.abs().sum() > 0

    # One token visits 2 of the 4 experts; the idle two stay in the graph (as the per-layer W,
    # a grad over all the layer's parameters, needs) with zero gradients.
    one = moe(torch.randn(1, 1, 128))
    grads = torch.autograd.grad(one.sum(), [expert.up.weight for expert in moe.experts])
    assert sorted(bool(g.abs().sum() > 0) for g in grads) == [False, False, True, True]


def test_vlm_passes_token_ids_through_the_encoder() -> None:
    model = _load("vlm")
    (images, ids), targets = model.sample_batch(MICROBATCH, step=0, replica=0, mb=0)
    assert images.shape == (MICROBATCH, 3, 32, 32) and ids.dtype == torch.int64
    assert torch.equal(ids[:, 1:], targets[:, :-1]) and (ids[:, 0] == 0).all()
    value = (images, ids)
    for i in range(3):  # patch embedding and two vision blocks
        value = model.build_layer(i)(*value)
        assert isinstance(value, tuple) and value[1] is ids
        assert value[0].shape == (MICROBATCH, 16, 96)
    hidden = model.build_layer(3)(*value)
    assert hidden.shape == (MICROBATCH, 16 + 16, 128)


@pytest.mark.parametrize(
    ("name", "config", "field"),
    [
        ("tiny_gpt", {"hiden": 64}, "build_layer"),
        ("tiny_gpt", {"heads": 3}, "config.heads"),
        ("vlm", {"patch": 5}, "config.patch"),
        ("hybrid", {"pattern": "max"}, "config.pattern"),
        ("hybrid", {"top_k": 5}, "config.top_k"),
    ],
)
def test_bad_config_is_an_input_error(name: str, config: dict, field: str) -> None:
    model = _load(name, config)
    with pytest.raises(InputError) as excinfo:
        model.build_layer(0)
    assert excinfo.value.field == field
