"""Activation recomputation in octorun: a recomputing stage gives the same gradients as one that
keeps its activations, keeps none of them after F, and leaves the global RNG stream alone; and
pipelined training with recomputing stages equals the single-process reference.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from torch import nn

import runtime_helpers as h
from octoplan.modelfile import load_model_file
from octoplan.plan import load_plan, save_plan
from octorun.runtime import RunConfig
from octorun.stage import StageExecutor

TOL = 1e-5
STEPS = 2
LR = {"sgd": 0.1, "adamw": 0.01}


pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------------
# One stage: recompute against keeping the activations
# ---------------------------------------------------------------------------------------------


def _two_stages(model, *, recompute: bool, some: int | None = None) -> tuple[list[nn.Module], list[StageExecutor]]:
    """Fresh layers (build_layer seeds each one, so every call builds the same weights), cut in
    two; ``some``: only each stage's first ``some`` layers recompute."""
    layers = [model.build_layer(i) for i in range(model.num_layers())]
    cut = len(layers) // 2
    return layers, [
        StageExecutor(layers[:cut], first=True, last=False, loss_fn=model.loss, loss_scale=0.25, recompute=recompute,
                      recompute_layers=some),
        StageExecutor(layers[cut:], first=False, last=True, loss_fn=model.loss, loss_scale=0.25, recompute=recompute,
                      recompute_layers=some),
    ]


def _train_two_stages(model, batch, *, recompute: bool, split: bool, some: int | None = None):
    """F of both stages, then I+W or B; returns (loss, F's output, the gradient message, params, tape lengths after F)."""
    layers, stages = _two_stages(model, recompute=recompute, some=some)
    out, tape0 = stages[0].forward(batch[0])
    none, tape1 = stages[1].forward(out, batch[1])
    assert none is None
    kept = (len(tape0.layers), len(tape1.layers))
    if split:
        message = stages[1].backward_input(tape1, None)
        assert all(p.grad is None for layer in layers for p in layer.parameters())  # I leaves weights alone
        assert len(tape1.layers) == len(stages[1].layers)  # I rebuilt the tape, and left it for W
        assert stages[0].backward_input(tape0, message) == ()  # the model's input gets no gradient
        stages[1].backward_weight(tape1)
        stages[0].backward_weight(tape0)
    else:
        message = stages[1].backward(tape1, None)
        assert stages[0].backward(tape0, message) == ()
    params = [p for layer in layers for p in layer.parameters()]
    return tape1.loss, out, message, params, kept


@pytest.mark.parametrize("name", ["tiny_gpt", "tiny"])
@pytest.mark.parametrize("split", [True, False], ids=["I+W", "B"])
@pytest.mark.parametrize("some", [None, 1], ids=["all layers", "the first layer"])
def test_recomputed_gradients_are_bit_identical(tmp_path, name, split, some):
    model_path, config = h.model_spec(name, tmp_path)
    model = load_model_file(model_path, config)
    batch = model.sample_batch(2, step=0, replica=0, mb=0)
    loss, out, message, params, kept = _train_two_stages(model, batch, recompute=False, split=split)
    loss_r, out_r, message_r, params_r, kept_r = _train_two_stages(model, batch, recompute=True, split=split, some=some)
    count = model.num_layers()
    assert count >= 4  # two layers per stage at least, so that one can keep its tape
    assert kept == (count // 2, count - count // 2)  # without recompute F keeps every layer's tape
    if some is None:
        assert kept_r == (0, 0)  # with recompute F keeps no per-layer activations
    else:  # only the recomputed first layer of each stage keeps none
        assert kept_r == (count // 2 - 1, count - count // 2 - 1)
    assert torch.equal(loss_r, loss)
    assert len(_floats(out_r)) == len(_floats(out)) > 0
    for a, b in zip(_floats(out_r), _floats(out)):
        assert torch.equal(a, b)  # the value F sends on is the same
    assert len(message_r) == len(message) > 0  # the gradient w.r.t. the second stage's input
    for a, b in zip(message_r, message):
        assert torch.equal(a, b)
    grads = [(p.grad, q.grad) for p, q in zip(params, params_r)]
    assert any(g is not None for g, _ in grads)
    for want, got in grads:
        assert (want is None) == (got is None)
        if want is not None:
            assert torch.equal(got, want)


def _floats(value) -> list[torch.Tensor]:
    values = value if isinstance(value, tuple) else (value,)
    return [v for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()]


def _dropout_layers() -> list[nn.Module]:
    torch.manual_seed(5)
    return [
        nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Dropout(0.5)),
        nn.Sequential(nn.Linear(12, 12), nn.Dropout(0.5), nn.Tanh()),
        nn.Linear(12, 3),
    ]


def _dropout_run(*, recompute: bool, last: bool, split: bool, dropout: bool = True, some: int | None = None):
    """One stage with dropout: F, unrelated random draws, then I+W or B; and the RNG's next number."""
    layers = _dropout_layers()
    if not dropout:
        for layer in layers:
            layer.eval()
    stage = StageExecutor(layers, first=False, last=last, loss_fn=lambda out, target: ((out - target) ** 2).mean(),
                          loss_scale=0.5, recompute=recompute, recompute_layers=some)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, generator=generator)
    target = torch.randn(4, 3, generator=generator)
    grad_output = None if last else (torch.randn(4, 3, generator=generator),)
    torch.manual_seed(1234)
    out, tape = stage.forward(x, target if last else None)
    kept = len(tape.layers)
    noise = torch.rand(3)  # other microbatches' work between F and the backward draws numbers too
    if split:
        grad_input = stage.backward_input(tape, grad_output)
        stage.backward_weight(tape)
    else:
        grad_input = stage.backward(tape, grad_output)
    after = torch.rand(4)
    params = [p.grad for layer in layers for p in layer.parameters()]
    return out, tape.loss, grad_input, params, kept, noise, after


@pytest.mark.parametrize("last", [False, True], ids=["middle", "last"])
@pytest.mark.parametrize("split", [True, False], ids=["I+W", "B"])
@pytest.mark.parametrize("some", [None, 1], ids=["all layers", "the first layer"])
def test_recompute_restores_the_rng_for_dropout(last, split, some):
    # with some=1 the recomputed first layer's dropout draws again and the kept second one's
    # does not: the rebuild must replay exactly the first layer's draws
    out, loss, grad_input, grads, kept, noise, after = _dropout_run(recompute=False, last=last, split=split)
    out_r, loss_r, grad_input_r, grads_r, kept_r, noise_r, after_r = _dropout_run(recompute=True, last=last, split=split,
                                                                                  some=some)
    assert kept == 3 and kept_r == (0 if some is None else 3 - some)
    if last:
        assert out is None and out_r is None and torch.equal(loss_r, loss)
    else:
        assert torch.equal(out_r, out)
    assert len(grad_input_r) == len(grad_input) == 1
    assert torch.equal(grad_input_r[0], grad_input[0])
    for want, got in zip(grads, grads_r):
        assert want is not None and got is not None
        assert torch.equal(got, want)
    # dropout really changes the gradients (so the equalities above needed the same masks)
    plain = _dropout_run(recompute=False, last=last, split=split, dropout=False)[3]
    assert not torch.equal(plain[0], grads[0])
    # the global RNG stream is as without recomputation, between F and the backward and after it
    assert torch.equal(noise_r, noise)
    assert torch.equal(after_r, after)


@pytest.mark.parametrize("split", [True, False], ids=["I+W", "B"])
@pytest.mark.parametrize("some", [None, 1], ids=["all layers", "the first layer"])
def test_a_recomputed_forward_leaves_batchnorms_statistics_as_f_left_them(split, some):
    """BatchNorm updates its running statistics (and its count) in every training forward: a
    recomputing stage's rebuild ran it a second time, so they moved twice a microbatch and an
    evaluation (which reads them) depended on the plan. They are now as without recompute."""
    def run(recompute: bool):
        torch.manual_seed(3)
        layers = [nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8)), nn.Sequential(nn.BatchNorm1d(8), nn.Linear(8, 3))]
        stage = StageExecutor(layers, first=False, last=True, loss_fn=lambda out, target: ((out - target) ** 2).mean(),
                              loss_scale=0.5, recompute=recompute, recompute_layers=some)
        generator = torch.Generator().manual_seed(0)
        for _ in range(2):  # two microbatches
            _, tape = stage.forward(torch.randn(5, 6, generator=generator), torch.randn(5, 3, generator=generator))
            if split:
                stage.backward_input(tape, None)
                stage.backward_weight(tape)
            else:
                stage.backward(tape, None)
        return {f"{i}.{k}": v.clone() for i, layer in enumerate(layers) for k, v in layer.state_dict().items()}, \
            [p.grad.clone() for layer in layers for p in layer.parameters()]

    (plain, plain_grads), (again, again_grads) = run(False), run(True)
    assert any(k.endswith("num_batches_tracked") and int(v) == 2 for k, v in again.items())
    assert all(torch.equal(plain[k], again[k]) for k in plain)
    assert all(torch.equal(a, b) for a, b in zip(plain_grads, again_grads))


def test_recompute_without_rng_restore_would_differ():
    """The check above has teeth: re-running the forward with a different RNG state changes the grads."""
    grad_input = _dropout_run(recompute=False, last=True, split=False)[2]
    layers = _dropout_layers()
    stage = StageExecutor(layers, first=False, last=True, loss_fn=lambda o, t: ((o - t) ** 2).mean(), loss_scale=0.5,
                          recompute=True)
    generator = torch.Generator().manual_seed(0)
    x, target = torch.randn(4, 6, generator=generator), torch.randn(4, 3, generator=generator)
    torch.manual_seed(1234)
    _, tape = stage.forward(x, target)
    tape.stash.cpu_rng = torch.Generator().manual_seed(99).get_state()  # as if F's state were lost
    grads_other = stage.backward(tape, None)
    assert not torch.equal(grads_other[0], grad_input[0])


def test_rebuild_frees_the_stash_and_w_uses_what_i_left(tmp_path):
    model_path, config = h.model_spec("tiny", tmp_path)
    model = load_model_file(model_path, config)
    inputs, targets = model.sample_batch(2, step=0, replica=0, mb=0)
    _, stages = _two_stages(model, recompute=True)
    out, tape0 = stages[0].forward(inputs)
    _, tape1 = stages[1].forward(out, targets)
    assert tape1.stash is not None and tape1.stash.targets is targets
    assert all(not t.requires_grad for t in _floats(out))  # F ran without building a graph
    stages[1].backward_input(tape1, None)
    # I left each layer what its W needs, and no root: the tape holds no output
    assert tape1.stash is None and all(layer.pending is not None and layer.roots == [] for layer in tape1.layers)
    stages[1].backward_weight(tape1)
    assert all(layer.pending is None and layer.inputs == [] for layer in tape1.layers)


# ---------------------------------------------------------------------------------------------
# End to end: octorun on two gloo processes with recomputing stages
# ---------------------------------------------------------------------------------------------


def _recompute(plan, stages: set[int] | None = None, some: int | None = None):
    """``plan`` with ``recompute: true`` on ``stages`` (all when None), of their first ``some``
    layers (all when None)."""
    return dataclasses.replace(plan, stages=tuple(
        dataclasses.replace(s, recompute=stages is None or i in stages,
                            recompute_layers=some if stages is None or i in stages else None)
        for i, s in enumerate(plan.stages)))


def test_pipelined_training_with_recompute_equals_reference(tmp_path, monkeypatch):
    rebuilds = tmp_path / "rebuilds"
    rebuilds.mkdir()
    original = StageExecutor._rebuild

    def counting(self, tape):  # forked workers inherit this: one line per rebuilt tape
        if tape.stash is not None:
            with open(rebuilds / f"pid{os.getpid()}", "a") as file:
                file.write("x\n")
        return original(self, tape)

    monkeypatch.setattr(StageExecutor, "_rebuild", counting)
    gpt_path, gpt_config = h.model_spec("tiny_gpt", tmp_path)
    tiny_path, tiny_config = h.model_spec("tiny", tmp_path)
    cases = {  # name -> (plan, model path, config, optimizer, recomputing stages)
        # zero bubble: I and W split, the rebuilt tape lives from I to W
        "gpt-zb-h1-all": (_recompute(h.baseline_plan("zb-h1", gpt_path, gpt_config, tmp_path, gpus=2, pp=2, microbatches=4)),
                          gpt_path, gpt_config, "sgd", 2),
        # only each stage's first layer recomputes; the others keep their tapes from F
        "gpt-zb-h1-first": (_recompute(h.baseline_plan("zb-h1", gpt_path, gpt_config, tmp_path, gpus=2, pp=2, microbatches=4),
                                       some=1), gpt_path, gpt_config, "sgd", 2),
        # 1F1B: fused B on a recomputing last stage next to one that keeps its activations
        "gpt-1f1b-last": (_recompute(h.baseline_plan("1f1b", gpt_path, gpt_config, tmp_path, gpus=2, pp=2, microbatches=4), {1}),
                          gpt_path, gpt_config, "sgd", 1),
        # a tuple boundary (float hidden, int64 ids); V placement: two stages per rank, mixed I+W and B
        "tiny-v-shape": (_recompute(h.hand_plans(tiny_path, tiny_config, 6)["v-shape-iw"][0], {0, 2}),
                         tiny_path, tiny_config, "adamw", 2),
    }
    jobs = []
    for name, (plan, _, _, optimizer, _) in cases.items():
        path = tmp_path / f"{name}.yaml"
        save_plan(plan, path)
        assert load_plan(path).stages == plan.stages  # recompute and recompute_layers survive the file
        jobs.append(h.Job(name, RunConfig(plan_path=str(path), steps=STEPS, optimizer=optimizer, lr=LR[optimizer], timeout_s=30)))
    launched = h.launch(2, jobs, tmp_path / "out", timeout_s=90)
    assert launched.exitcodes == [0, 0], "\n".join(launched.logs)
    for name, (plan, model_path, config, optimizer, recomputing) in cases.items():
        ref = h.reference(model_path, config, steps=STEPS, microbatches=plan.microbatches, dp=1, microbatch_size=2,
                          optimizer=optimizer, lr=LR[optimizer])
        metrics = launched.result(name, 0)["metrics"]
        assert [m.loss for m in metrics] == pytest.approx(ref.losses, abs=TOL), name
        state = {}
        for rank in range(2):
            state.update(launched.result(name, rank)["state"])
        assert h.max_abs_diff(state, ref.state) <= TOL, name
    if os.environ.get("OCTORUN_TEST_START", "fork") == "fork":  # spawned workers do not inherit the counter
        lines = sum(len(p.read_text().splitlines()) for p in rebuilds.iterdir())
        expected = sum(STEPS * plan.microbatches * count for plan, _, _, _, count in cases.values())
        assert lines == expected  # every recomputing (stage, microbatch) ran its forward again, once
