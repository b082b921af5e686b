"""octorun as a trainer: the optimizer step (AdamW with weight decay, clipping on the global
norm, the learning-rate schedule), mixed precision, tied parameters across stages and the
non-finite guard — each against a single-process reference of the same model.

The jobs of one world size run in one launch (tests/runtime_helpers.launch), so the processes
start once for the whole module.
"""

from __future__ import annotations

import json

import math
from pathlib import Path

import pytest
import torch

import runtime_helpers as h
from octorun.optim import OptimizerConfig, clip_factor, lr_at
from training_helpers import ADAMW, STEPS, TOL, Jobs, write_tokens


# -- the schedule, by hand ---------------------------------------------------------------------
def test_learning_rate_schedules_by_hand():
    constant = OptimizerConfig(lr=0.1, warmup_steps=2)
    assert [lr_at(constant, s, 6) for s in range(6)] == pytest.approx([0.05, 0.1, 0.1, 0.1, 0.1, 0.1])
    # linear: after 2 warm-up steps, 0.1 at step 2 falling to min_lr 0.01 at step 5 (3 steps of 0.03)
    linear = OptimizerConfig(lr=0.1, warmup_steps=2, schedule="linear", min_lr=0.01)
    assert [lr_at(linear, s, 6) for s in range(6)] == pytest.approx([0.05, 0.1, 0.1, 0.07, 0.04, 0.01])
    # cosine without warm-up over 5 steps: progress 0, 1/4, 1/2, 3/4, 1
    cosine = OptimizerConfig(lr=1.0, schedule="cosine", min_lr=0.0)
    expected = [0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(5)]
    assert [lr_at(cosine, s, 5) for s in range(5)] == pytest.approx(expected)
    assert lr_at(cosine, 2, 5) == pytest.approx(0.5)
    # --decay-steps: the schedule's length whatever this run's --steps (a run stopped and resumed
    # keeps one schedule): linear over 5 steps, from 1 to 0 in steps of 1/4, in runs of 3 and 8
    decayed = OptimizerConfig(lr=1.0, schedule="linear", decay_steps=5)
    assert [lr_at(decayed, s, 3) for s in range(3)] == pytest.approx([1.0, 0.75, 0.5])
    assert [lr_at(decayed, s, 8) for s in range(8)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0, 0.0, 0.0, 0.0])
    # a span of one step (the default --steps 1; or warm-up 3 of 4 steps) is its first step: lr,
    # not min_lr, which would leave a one-step cosine run at lr 0; steps after it take min_lr
    assert lr_at(OptimizerConfig(lr=0.1, schedule="cosine"), 0, 1) == pytest.approx(0.1)
    warm3 = OptimizerConfig(lr=0.1, schedule="linear", warmup_steps=3, min_lr=0.01, decay_steps=4)
    assert [lr_at(warm3, s, 6) for s in range(6)] == pytest.approx([0.1 / 3, 0.2 / 3, 0.1, 0.1, 0.01, 0.01])


def test_a_warm_up_longer_than_the_schedule_names_the_range_and_the_length():
    """--warmup-steps 5 with --steps 4: the line says what the schedule's length is and where
    it comes from (it read "give 0 to the schedule's 4 steps", taken for "give 0")."""
    from octoplan.errors import InputError
    from octorun.optim import check_optimizer_config

    with pytest.raises(InputError) as caught:
        check_optimizer_config(OptimizerConfig(lr=0.1, warmup_steps=5), steps=4)
    assert caught.value.line() == ("--warmup-steps: is 5, more than the schedule's 4 steps (--steps) "
                                   "(give a number from 0 to 4, or a longer --steps)")
    with pytest.raises(InputError, match=r"schedule's 3 steps \(--decay-steps\)"):
        check_optimizer_config(OptimizerConfig(lr=0.1, warmup_steps=5, decay_steps=3), steps=10)
    check_optimizer_config(OptimizerConfig(lr=0.1, warmup_steps=4), steps=4)  # the whole schedule: allowed
    with pytest.raises(InputError) as negative:
        check_optimizer_config(OptimizerConfig(lr=0.1, warmup_steps=-1), steps=4)
    assert negative.value.line() == "--warmup-steps: is -1 (give 0 or more steps)"


def test_adamw_decays_matrices_only_with_the_configs_betas_and_eps():
    from octorun.optim import build_optimizer

    weight, bias, scale = (torch.nn.Parameter(torch.ones(shape)) for shape in ((3, 2), (3,), (2,)))
    config = OptimizerConfig(name="adamw", lr=0.5, weight_decay=0.1, betas=(0.8, 0.9), eps=1e-5)
    opt = build_optimizer([weight, bias, scale], config)
    groups = [(group["weight_decay"], [id(p) for p in group["params"]]) for group in opt.param_groups]
    assert sorted(groups) == [(0.0, [id(bias), id(scale)]), (0.1, [id(weight)])]
    assert {(g["lr"], g["betas"], g["eps"]) for g in opt.param_groups} == {(0.5, (0.8, 0.9), 1e-5)}
    assert build_optimizer([], config) is None
    sgd = build_optimizer([weight], OptimizerConfig(name="sgd", lr=0.5))
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["momentum"] == 0


def test_clip_factor_is_torchs():
    grads = [torch.tensor([3.0, 0.0]), torch.tensor([[4.0]])]  # norm 5
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    norm = torch.nn.utils.clip_grad_norm_(params, 2.0)
    assert float(norm) == 5.0
    factor = clip_factor(5.0, 2.0)
    assert factor == pytest.approx(2.0 / (5.0 + 1e-6))
    assert torch.equal(params[0].grad, grads[0] * factor)
    assert clip_factor(1.0, 2.0) == 1.0


# -- multi-process jobs against the reference --------------------------------------------------
@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> Jobs:
    batch = Jobs(tmp_path_factory.mktemp("training"), 4)
    tokens = str(write_tokens(batch.folder / "tokens.bin"))
    held_out = str(write_tokens(batch.folder / "held_out.bin", count=200, seed=6))  # 39 windows: 4 global batches of 8
    # one global batch of 8 samples: pp 4 x 4 microbatches of 2, and pp 2 x dp 2 x 2 microbatches;
    # both evaluate 2 global batches of held_out.bin after steps 1 and 3
    evaluated = {"eval_data_path": held_out, "eval_every": 2, "eval_batches": 2}
    batch.add("data-pp4", "1f1b", pp=4, config={}, data_path=tokens, save_dir=str(batch.folder / "ck-data"), **evaluated)
    batch.add("data-pp2dp2", "1f1b", pp=2, config={}, microbatches=2, data_path=tokens, **evaluated)
    # dropout under two plans of one global batch: 1F1B pp 4, and a ZB-V pp 2 x dp 2 whose
    # stages 1 and 2 (rank 1's) recompute, the masks drawn again in another op
    batch.add("dropout-data-pp4", "1f1b", pp=4, config={"dropout": 0.5}, data_path=tokens)
    batch.add("dropout-data-zbv-pp2dp2", "zbv", pp=2, config={"dropout": 0.5}, microbatches=2, data_path=tokens,
              recompute=(1, 2))
    # data-pp4's last checkpoint resumed at its --steps under a ZB-V pp 2 x dp 2 (another
    # program: both ranks' first F is an evaluation's): nothing to train, one evaluation
    batch.add("eval-only-zbv-pp2dp2", "zbv", pp=2, config={}, microbatches=2, data_path=tokens,
              resume=str(batch.folder / "ck-data"), metrics_path=str(batch.folder / "eval-only.jsonl"),
              eval_data_path=held_out, eval_batches=2)
    # a V (activations pass both ways between two ranks) whose blocks drop out: the evaluation,
    # after the last step only, reads every whole global batch of 16 (2) and drops nothing
    batch.add("eval-dropout-zbv-pp4", "zbv", pp=4, config={"depth": 10, "dropout": 0.5}, microbatches=8, steps=2,
              eval_data_path=held_out)
    # dropout that draws in eval mode too: evaluations after every step leave the training's
    # random draws as they were
    draws = {"dropout": 0.5, "draws_in_eval": True}
    batch.add("draws-pp4", "1f1b", pp=4, config=draws, steps=3)
    # the same under two plans of one global batch, evaluated after every step: the eval-mode
    # draws are keyed as the training's are, so both plans evaluate alike
    for name, schedule, pp, microbatches in (("draws-data-pp4", "1f1b", 4, 4), ("draws-data-zbv-pp2dp2", "zbv", 2, 2)):
        batch.add(name, schedule, pp=pp, config=draws, microbatches=microbatches, steps=2, data_path=tokens,
                  eval_data_path=held_out, eval_every=1, eval_batches=2)
    batch.add("draws-eval-pp4", "1f1b", pp=4, config=draws, steps=3, eval_data_path=held_out, eval_every=1, eval_batches=1)
    batch.add("adamw-clip-pp2dp2", "1f1b", pp=2, config={})
    batch.add("adamw-clip-zbv-pp2dp2", "zbv", pp=2, config={})
    batch.add("unused-pp2dp2", "1f1b", pp=2, config={"unused": True})
    batch.add("tied-1f1b-pp4", "1f1b", pp=4, config={"tie": True})
    batch.add("tied-zbv-pp4", "zbv", pp=4, config={"tie": True, "depth": 10}, microbatches=8)  # embed and head on rank 0
    batch.add("tied-1f1b-pp2dp2", "1f1b", pp=2, config={"tie": True})
    batch.add("bf16-1f1b-pp4", "1f1b", pp=4, config={}, precision="bf16")
    batch.add("fp32-1f1b-pp4", "1f1b", pp=4, config={})
    batch.add("poison-skip-pp4", "1f1b", pp=4, config={"poison": 3},
              optim=OptimizerConfig(name="adamw", lr=0.02, skip_nonfinite=True))
    return batch


def _merged(replica: dict[int, dict]) -> dict[int, dict]:
    merged: dict[int, dict] = {}
    for state in replica.values():
        merged.update(state)
    return merged


@pytest.mark.slow
@pytest.mark.parametrize("name", ["adamw-clip-pp2dp2", "adamw-clip-zbv-pp2dp2", "unused-pp2dp2", "tied-1f1b-pp4", "tied-zbv-pp4",
                                  "tied-1f1b-pp2dp2"])
def test_optimizer_step_equals_single_process(jobs, name):
    """Losses, the global grad norm (torch's clip_grad_norm_ on the whole model), the lr and the
    weights after AdamW with weight decay, clipping and a cosine schedule; with tied weights, the
    single-process model holds the embedding and the head as one Parameter."""
    metrics, replicas = jobs.results(name)
    ref = jobs.reference(name)
    assert [m.loss for m in metrics] == pytest.approx(ref.losses, abs=TOL)
    assert [m.grad_norm for m in metrics] == pytest.approx(ref.grad_norms, rel=1e-6)
    assert ref.grad_norms[0] > ADAMW.grad_clip  # the clip acts
    assert [m.lr for m in metrics] == pytest.approx(ref.lrs, rel=1e-12)
    for replica in replicas.values():
        assert h.max_abs_diff(_merged(replica), ref.state) <= TOL


@pytest.mark.slow
def test_a_parameter_no_replica_used_stays_as_it_was(jobs):
    """A block's parameter that the forward never reads gets no gradient on any replica, so
    AdamW leaves it alone, as on one process: were it reduced as a zero gradient, weight decay
    would shrink it by (1 - lr x wd) every step and AdamW would count steps for it."""
    _, replicas = jobs.results("unused-pp2dp2")
    spares = [layer["spare"] for replica in replicas.values() for layer in _merged(replica).values() if "spare" in layer]
    assert len(spares) == 2 * 4  # the 4 blocks of depth 6, on each of the 2 replicas
    assert all(torch.equal(spare, torch.ones(8, 8)) for spare in spares)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tied-1f1b-pp4", "tied-1f1b-pp2dp2"])
def test_tied_copies_stay_identical(jobs, name):
    """The embedding's matrix on the first rank and the head's on the last: bit for bit the same
    after every step, because they start equal and take the same summed gradient."""
    _, replicas = jobs.results(name)
    depth = jobs.cases[name][0]["depth"]
    for replica in replicas.values():
        merged = _merged(replica)
        assert torch.equal(merged[0]["emb.weight"], merged[depth - 1]["out.weight"])


@pytest.mark.slow
def test_bf16_tracks_fp32_and_its_own_reference(jobs):
    """bf16 autocast over fp32 masters: within 1e-3 of the same recipe on one process, and within
    2% of the fp32 run's losses (bf16 rounds every product to 8 bits of mantissa)."""
    bf16, replicas = jobs.results("bf16-1f1b-pp4")
    fp32, _ = jobs.results("fp32-1f1b-pp4")
    ref = jobs.reference("bf16-1f1b-pp4")
    assert [m.loss for m in bf16] == pytest.approx(ref.losses, rel=1e-3)
    assert [m.loss for m in bf16] == pytest.approx([m.loss for m in fp32], rel=2e-2)
    assert [m.loss for m in bf16] != [m.loss for m in fp32]  # bf16 did compute in bf16
    for replica in replicas.values():  # the masters stay fp32
        assert all(t.dtype == torch.float32 for state in replica.values() for layer in state.values() for t in layer.values())


@pytest.mark.slow
def test_skip_nonfinite_skips_every_poisoned_update(jobs):
    metrics, replicas = jobs.results("poison-skip-pp4")
    assert [m.skipped_steps for m in metrics] == list(range(1, STEPS + 1))
    assert all(math.isnan(m.loss) for m in metrics)
    config = jobs.cases["poison-skip-pp4"][0]
    from octoplan.modelfile import load_model_file

    model = load_model_file(jobs.model, config)
    initial = {i: model.build_layer(i).state_dict() for i in range(config["depth"])}
    merged = _merged(replicas[0])
    assert h.max_abs_diff(merged, initial) == 0.0  # no update took
    assert all(torch.equal(merged[i][key], initial[i][key]) for i in initial for key in initial[i])


@pytest.mark.slow
def test_nonfinite_stops_every_rank_naming_step_and_stage(tmp_path):
    batch = Jobs(tmp_path, 4)
    batch.add("poison-stop-pp4", "1f1b", pp=4, config={"poison": 3})  # layer 3: stage 2 of 6 layers on 4 ranks
    launched = batch.run()
    assert launched.exitcodes == [1, 1, 1, 1], "\n".join(launched.logs)
    plan = batch.cases["poison-stop-pp4"][1]
    stage = next(i for i, s in enumerate(plan.stages) if 3 in s.layers)
    lines = [line for log in launched.logs for line in log.splitlines() if "non-finite" in line]
    assert len(lines) == 1, launched.logs  # one line for the whole job
    first = plan.stages[stage]
    assert lines[0] == (f"octorun: step 0: non-finite loss; it first appeared in the forward of stage {stage} "
                        f"(layers {first.start}-{first.end - 1}, pp rank {first.rank}) (--skip-nonfinite skips such updates)")


def _token_reference(jobs, name: str = "data-pp4") -> tuple[list[float], list[float | None]]:
    """One process trained as data-pp4 and data-pp2dp2 train (or ``name``'s model config): each
    step reads TokenData.windows(step * 8, 8) in microbatches of 2, each layer's forward seeded
    as FORMATS.md section 4 says. Returns each step's loss, and the held-out loss after steps 1
    and 3 (None after the others), as --eval-every 2 evaluates."""
    from octoplan.modelfile import load_model_file
    from octorun.data import TokenData

    config = jobs.cases[name][0]
    model = load_model_file(jobs.model, config)
    data = TokenData.open(str(jobs.folder / "tokens.bin"), model, seed=0)
    layers = [model.build_layer(i) for i in range(config["depth"])]
    params = [p for layer in layers for p in layer.parameters()]
    opt = h.reference_optimizer(params, ADAMW)
    expected, evaluated = [], []
    for step in range(STEPS):
        windows = data.windows(step * 8, 8)
        losses = []
        for mb in range(4):
            value, targets = model.batch_from_tokens(windows[2 * mb: 2 * mb + 2])
            for index, layer in enumerate(layers):
                h.seed_draws(seed=0, step=step, position=mb, layer=index)
                value = layer(value)
            losses.append(model.loss(value, targets))
        loss = torch.stack(losses).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, ADAMW.grad_clip)
        for group in opt.param_groups:
            group["lr"] = lr_at(ADAMW, step, STEPS)
        opt.step()
        opt.zero_grad()
        expected.append(loss.item())
        evaluated.append(_held_out_loss(jobs, model, layers, batches=2, global_batch=8) if step in (1, 3) else None)
    return expected, evaluated


@pytest.mark.slow
def test_token_data_reads_one_global_batch_whatever_pp_and_dp(jobs):
    """pp 4 and pp 2 x dp 2 read the same 8 windows per step: their losses agree, and equal a
    single process that reads TokenData.windows(step * 8, 8) in microbatches of 2."""
    pp4, _ = jobs.results("data-pp4")
    pp2dp2, _ = jobs.results("data-pp2dp2")
    expected, _ = _token_reference(jobs)
    assert [m.loss for m in pp4] == pytest.approx(expected, abs=TOL)
    assert [m.loss for m in pp2dp2] == pytest.approx(expected, abs=TOL)


@pytest.mark.slow
def test_dropout_draws_alike_under_any_plan_and_in_one_process(jobs):
    """Dropout 0.5 in every block: 1F1B pp 4 and a ZB-V pp 2 x dp 2 with two recomputing stages
    draw every layer's masks by step, position in the global batch and layer, so both equal one
    process that seeds each layer's forward so (a mask drawn from each rank's generator, as
    before, gave losses apart by far more than TOL)."""
    expected, _ = _token_reference(jobs, "dropout-data-pp4")
    undropped, _ = _token_reference(jobs)
    assert min(abs(a - b) for a, b in zip(expected, undropped)) > 1e-2  # the masks matter
    for name in ("dropout-data-pp4", "dropout-data-zbv-pp2dp2"):
        metrics, _ = jobs.results(name)
        assert [m.loss for m in metrics] == pytest.approx(expected, abs=TOL), name


def _held_out_loss(jobs, model, layers, *, batches: int, global_batch: int, train_mode: bool = False) -> float:
    """The mean loss of microbatches of 2 over the first ``batches`` global batches of
    held_out.bin in its seed-0 window order, every layer in eval mode (or, with ``train_mode``,
    in train mode), without gradients."""
    from octorun.data import TokenData

    held_out = TokenData.open(str(jobs.folder / "held_out.bin"), model, seed=0)
    windows = held_out.windows(0, batches * global_batch)
    losses = []
    with torch.no_grad():
        for layer in layers:
            layer.train(train_mode)
        for first in range(0, len(windows), 2):
            value, targets = model.batch_from_tokens(windows[first: first + 2])
            for layer in layers:
                value = layer(value)
            losses.append(model.loss(value, targets))
        for layer in layers:
            layer.train()
    return torch.stack(losses).mean().item()


@pytest.mark.slow
def test_evaluation_is_the_held_out_loss_of_the_weights_after_its_step(jobs):
    """--eval-every 2 --eval-batches 2 over 4 steps: after steps 1 and 3 the held-out loss of
    the single-process model trained as far, under pp 4 and pp 2 x dp 2 alike; the steps
    between carry none. The evaluation changes nothing: the training losses that follow it are
    the reference's (the test above)."""
    _, expected = _token_reference(jobs)
    for name in ("data-pp4", "data-pp2dp2"):
        metrics, _ = jobs.results(name)
        assert [m.eval_loss for m in metrics] == pytest.approx(expected, abs=TOL), name
        assert [m.eval_ms is not None for m in metrics] == [False, True, False, True]
        assert [("eval_loss" in m.to_dict()) for m in metrics] == [False, True, False, True]
    assert expected[3] < expected[1]  # it learns


def test_a_resume_with_nothing_to_train_evaluates_the_checkpoint(jobs):
    """The checkpoint after data-pp4's last step, resumed at its --steps under another plan with
    --eval-data: no step trains, and the one evaluation is the held-out loss of the weights
    after step 3, as data-pp4's own evaluation after that step was. A --metrics file that held
    no line of the step gets the checkpoint's line of it, with this evaluation."""
    _, expected = _token_reference(jobs)
    metrics, _ = jobs.results("eval-only-zbv-pp2dp2")
    assert metrics == []
    trained, _ = jobs.results("data-pp4")
    lines = [json.loads(line) for line in (jobs.folder / "eval-only.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [3] and lines[0]["loss"] == trained[3].loss
    assert lines[0]["eval_loss"] == pytest.approx(expected[3], abs=TOL)


@pytest.mark.slow
def test_evaluation_drops_nothing_and_reads_every_whole_global_batch(jobs):
    """A V whose blocks drop out half their values: the evaluation after the last step equals
    the final weights' held-out loss in eval mode over both whole global batches of 16 (of 39
    windows); in train mode the loss would differ."""
    from octoplan.modelfile import load_model_file

    metrics, replicas = jobs.results("eval-dropout-zbv-pp4")
    config = jobs.cases["eval-dropout-zbv-pp4"][0]
    model = load_model_file(jobs.model, config)
    layers = [model.build_layer(i) for i in range(config["depth"])]
    for index, layer in enumerate(layers):
        layer.load_state_dict(_merged(replicas[0])[index])
    assert [m.eval_loss is None for m in metrics] == [True, False]
    assert metrics[-1].eval_loss == pytest.approx(_held_out_loss(jobs, model, layers, batches=2, global_batch=16), abs=TOL)
    torch.manual_seed(0)  # the same windows with dropout acting: another loss
    dropped = _held_out_loss(jobs, model, layers, batches=2, global_batch=16, train_mode=True)
    assert abs(dropped - metrics[-1].eval_loss) > 1e-2


def test_held_out_files_that_cannot_serve_an_evaluation_are_refused_before_launch(tmp_path):
    """A held-out file of fewer windows than one global batch, and --eval-batches beyond the
    file: one line each, before any process starts."""
    from octoplan.errors import InputError
    from octoplan.plan import save_plan
    from octorun.runtime import RunConfig, prepare
    from training_helpers import MODEL

    model = tmp_path / "train_model.py"
    model.write_text(MODEL)
    config = {"vocab": 11, "hidden": 8, "depth": 6, "seq": 5, "tie": False, "poison": -1, "unused": False}
    plan = tmp_path / "plan.yaml"
    save_plan(h.baseline_plan("1f1b", model, config, tmp_path, gpus=2, pp=2, microbatches=4), plan)  # 8 samples a batch
    small = write_tokens(tmp_path / "small.bin", count=36)  # 7 windows of 6 tokens
    with pytest.raises(InputError) as short:
        prepare(RunConfig(plan_path=str(plan), eval_data_path=str(small)))
    assert short.value.line() == (f"{small}: size: holds 7 windows of 6 tokens, fewer than one global batch of 8 "
                                  "samples (--eval-data) (give a longer held-out token file)")
    held_out = write_tokens(tmp_path / "held_out.bin", count=200)  # 39 windows: 4 global batches
    with pytest.raises(InputError) as many:
        prepare(RunConfig(plan_path=str(plan), eval_data_path=str(held_out), eval_batches=5))
    assert many.value.line() == (f"--eval-batches: is 5, but {held_out} holds 4 global batches of 8 samples "
                                 "(39 windows) (give at most 4, or a longer --eval-data)")
    assert prepare(RunConfig(plan_path=str(plan), eval_data_path=str(held_out))).evaluation.batches == 4
    assert prepare(RunConfig(plan_path=str(plan), eval_data_path=str(held_out), eval_batches=4)).evaluation.batches == 4


def test_an_id_beyond_the_vocab_anywhere_an_evaluation_reads_is_refused_before_launch(tmp_path, monkeypatch):
    """The held-out windows are known before the launch: an id beyond the vocab past the prefix
    checked as a token file opens (here 16 tokens) is refused then, not after the training's
    steps at the first evaluation (which failed the job and lost that step's checkpoint)."""
    import numpy as np

    from octoplan.errors import InputError
    from octoplan.plan import save_plan
    from octorun import data as data_module
    from octorun.runtime import RunConfig, prepare
    from training_helpers import MODEL

    monkeypatch.setattr(data_module, "VOCAB_CHECK_TOKENS", 16)
    model = tmp_path / "train_model.py"
    model.write_text(MODEL)
    config = {"vocab": 11, "hidden": 8, "depth": 6, "seq": 5, "tie": False, "poison": -1, "unused": False}
    plan = tmp_path / "plan.yaml"
    save_plan(h.baseline_plan("1f1b", model, config, tmp_path, gpus=2, pp=2, microbatches=4), plan)
    held_out = write_tokens(tmp_path / "held_out.bin", count=200)
    ids = np.fromfile(held_out, dtype="<u2")
    ids[150] = 99
    ids.tofile(held_out)
    with pytest.raises(InputError) as caught:
        prepare(RunConfig(plan_path=str(plan), eval_data_path=str(held_out)))
    assert (caught.value.file, caught.value.field) == (str(held_out), "token 150")


@pytest.mark.slow
def test_an_evaluation_that_draws_in_eval_mode_is_alike_under_any_plan(jobs):
    """F.dropout in eval mode draws in the evaluation too: keyed by the step, the position in
    the held-out batches and the layer, pp 4 and ZB-V pp 2 x dp 2 evaluate alike (each plan drew
    from its ranks' generators before: 11.238 against 11.387 after one step)."""
    pp4, _ = jobs.results("draws-data-pp4")
    zbv, _ = jobs.results("draws-data-zbv-pp2dp2")
    assert [m.loss for m in zbv] == pytest.approx([m.loss for m in pp4], abs=TOL)
    assert all(m.eval_loss is not None for m in pp4)
    assert [m.eval_loss for m in zbv] == pytest.approx([m.eval_loss for m in pp4], abs=TOL)


@pytest.mark.slow
def test_an_evaluation_leaves_the_trainings_random_draws_alone(jobs):
    """A block whose dropout draws in eval mode (F.dropout): the evaluation after every step
    runs under a forked generator, so the training after it draws what it would have drawn
    without it (it drew other masks, and the losses moved)."""
    plain, _ = jobs.results("draws-pp4")
    evaluated, _ = jobs.results("draws-eval-pp4")
    assert [m.loss for m in evaluated] == [m.loss for m in plain]
    assert all(m.eval_loss is not None for m in evaluated)
