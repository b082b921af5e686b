"""--init-from: a fresh start that takes a checkpoint's weights and nothing else (fine-tuning, a
new dataset). Against a one-process reference that starts from the same weights with a fresh
AdamW and its own schedule, on the data of steps 0, 1, 2: within 1e-5 per step under two plans
and with a tied head. A run that --resume finds a checkpoint for continues its own instead.
"""

from __future__ import annotations

import json

import pytest

import runtime_helpers as h
from octorun.optim import OptimizerConfig
from training_helpers import ADAMW, TOL, Jobs

STEPS = 3
# the fine-tuning run's own optimizer: another learning rate, decay and schedule than ADAMW's
FINE = OptimizerConfig(name="adamw", lr=0.01, weight_decay=0.05, betas=(0.9, 0.95), schedule="linear",
                       warmup_steps=1, min_lr=0.001)


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> Jobs:
    jobs = Jobs(tmp_path_factory.mktemp("init2"), 2)
    ck = jobs.folder / "ck"
    for tie, suffix in ((False, ""), (True, "-tied")):
        # the run whose weights the others start from: 3 steps, saved at the last
        jobs.add(f"pre{suffix}", "1f1b", pp=2, config={"tie": tie}, steps=STEPS, save_dir=str(ck / f"pre{suffix}"))
        # the folder of checkpoints: its newest is taken
        jobs.add(f"init{suffix}", "1f1b", pp=2, config={"tie": tie}, optim=FINE, steps=STEPS,
                 init_from=str(ck / f"pre{suffix}"))
    # another plan: ZB-V puts the embedding and the head on rank 0
    jobs.add("init-zbv", "zbv", pp=2, config={}, optim=FINE, steps=STEPS, init_from=str(ck / "pre" / "step_00000003"))
    # under a restarting launcher: the first attempt starts from the weights and saves; the next
    # resumes its own checkpoint and does not read --init-from
    restart = {"optim": FINE, "save_dir": str(ck / "fine"), "save_every": 1, "resume": "auto",
               "init_from": str(ck / "pre"), "decay_steps": STEPS}
    jobs.add("first-attempt", "1f1b", pp=2, config={}, steps=2, **restart)
    # (by then the pre-trained checkpoint has moved away: a resuming run never reads it)
    jobs.add("next-attempt", "1f1b", pp=2, config={}, steps=STEPS, **{**restart, "init_from": str(ck / "moved-away")})
    return jobs


def _losses(jobs: Jobs, name: str) -> list[float]:
    return [m.loss for m in jobs.results(name)[0]]


def _final_state(jobs: Jobs, name: str) -> dict[int, dict]:
    merged: dict[int, dict] = {}
    for state in jobs.results(name)[1][0].values():  # replica 0's ranks
        merged.update(state)
    return merged


def _fine_tuned(jobs: Jobs, pre: str) -> h.Reference:
    """One process, starting from the weights ``pre`` ended with, a fresh AdamW of FINE."""
    config, plan, _, _ = jobs.cases[pre]
    return h.reference(jobs.model, config, steps=STEPS, microbatches=plan.microbatches, dp=1, microbatch_size=2,
                       optimizer=FINE.name, lr=FINE.lr, optim=FINE, initial=_final_state(jobs, pre))


@pytest.mark.slow
@pytest.mark.parametrize("pre,init", [("pre", "init"), ("pre", "init-zbv"), ("pre-tied", "init-tied")])
def test_init_from_takes_the_weights_alone(world2, pre, init):
    ref = _fine_tuned(world2, pre)
    assert _losses(world2, init) == pytest.approx(ref.losses, abs=TOL)
    assert h.max_abs_diff(_final_state(world2, init), ref.state) <= TOL
    # the pieces a resume would carry over all show in the losses: the weights alone give the
    # pre-trained run's data of step 0 another loss than the model file's own initialization
    fresh = h.reference(world2.model, world2.cases[pre][0], steps=STEPS, microbatches=4, dp=1, microbatch_size=2,
                        optimizer=FINE.name, lr=FINE.lr, optim=FINE)
    assert abs(fresh.losses[0] - ref.losses[0]) > 100 * TOL
    # and the pre-trained run's own last step saw other data and another optimizer step
    assert abs(_losses(world2, pre)[-1] - ref.losses[0]) > 100 * TOL


@pytest.mark.slow
def test_a_restarted_run_continues_its_own_checkpoint(world2):
    first, after = _losses(world2, "first-attempt"), {m.step: m.loss for m in world2.results("next-attempt")[0]}
    whole = _losses(world2, "init")
    assert first == whole[:2]  # the same plan: bit for bit
    assert after == {2: whole[2]}  # resumed at step 2 from its own save, not restarted from the weights
    root = world2.folder / "ck"
    meta = json.loads((root / "fine" / "step_00000003" / "octopipe.json").read_text())["meta"]
    assert meta["init_from"] == str(root / "pre" / "step_00000003")  # the lineage goes on through the resume


def _octoplan(*args) -> "subprocess.CompletedProcess":
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "octoplan", *map(str, args)], capture_output=True, text=True,
                          cwd=h.ROOT, timeout=120)


def test_export_safetensors_writes_the_checkpoints_weights_for_a_module_list(world2, tmp_path):
    """The pre-trained checkpoints (pp 2 1F1B) written as one safetensors file, through another
    plan of the model (ZB-V) and through their own: a ModuleList of the model file's layers
    takes it strictly, and holds the weights the runs ended with, bit for bit; a tied head is
    written under its own key too, equal to the embedding. In bfloat16 on asking. A checkpoint of
    another model config is refused in one line, and no file is written."""
    import torch
    from safetensors.torch import load_file

    from octoplan.modelfile import load_model_file

    world2.run()  # (the jobs run once, as the first test needs them)
    for pre, plan in (("pre", "init-zbv"), ("pre-tied", "pre-tied")):
        out = tmp_path / f"{pre}.safetensors"
        done = _octoplan("export", world2.folder / f"{plan}.yaml", "--format", "safetensors", "--checkpoint",
                         world2.folder / "ck" / pre, "-o", out)
        assert done.returncode == 0, done.stderr
        assert "(after 3 steps)" in done.stdout
        model = load_model_file(world2.model, world2.cases[plan][0])
        whole = torch.nn.Module()
        whole.layers = torch.nn.ModuleList(model.build_layer(i) for i in range(model.num_layers()))
        whole.load_state_dict(load_file(out))  # strict: every key, no other
        final = _final_state(world2, pre)
        for index, layer in enumerate(whole.layers):
            assert layer.state_dict().keys() == final[index].keys()
            assert all(torch.equal(value, final[index][name]) for name, value in layer.state_dict().items())
    assert torch.equal(whole.layers[0].emb.weight, whole.layers[5].out.weight)  # the tied pair, both keys
    half = tmp_path / "half.safetensors"
    assert _octoplan("export", world2.folder / "pre.yaml", "--format", "safetensors", "--checkpoint",
                     world2.folder / "ck" / "pre", "--dtype", "bfloat16", "-o", half).returncode == 0
    assert {tensor.dtype for tensor in load_file(half).values()} == {torch.bfloat16}
    refused = _octoplan("export", world2.folder / "pre.yaml", "--format", "safetensors", "--checkpoint",
                        world2.folder / "ck" / "pre-tied", "-o", tmp_path / "no.safetensors")
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "tie" in refused.stderr and not (tmp_path / "no.safetensors").exists()
    assert list(tmp_path.glob(".no.safetensors*")) == []
    # nothing the export reads is written over: a file of the checkpoint, the model file
    meta = world2.folder / "ck" / "pre" / "step_00000003" / "octopipe.json"
    for target, problem in ((meta, "-o: is inside the checkpoint"), (world2.model, "which writing would destroy")):
        before = target.read_bytes()
        refused = _octoplan("export", world2.folder / "pre.yaml", "--format", "safetensors", "--checkpoint",
                            world2.folder / "ck" / "pre", "-o", target)
        assert refused.returncode == 2 and problem in refused.stderr, refused.stderr
        assert target.read_bytes() == before
