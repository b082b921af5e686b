"""Checkpoints: a run resumed from step 3 of 6 under the same plan continues bit for bit (fp32
and bf16, losses and weights, token data read on where it stopped); under another plan of the
same model (pp, dp, placement, schedule, world size) it continues within 1e-6; bad checkpoints
stop the run with one line and touch nothing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import runtime_helpers as h
from octoplan.plan import save_plan
from training_helpers import ADAMW, Jobs, write_tokens

STEPS = 6
SAVED = 3  # the checkpoint the resumed runs start from


def _case(jobs: Jobs, name: str, schedule: str, *, pp: int, config: dict, microbatches: int = 4, **run) -> None:
    jobs.add(name, schedule, pp=pp, config=config, microbatches=microbatches, steps=STEPS, **run)


@pytest.fixture(scope="module")
def world4(tmp_path_factory) -> Jobs:
    jobs = Jobs(tmp_path_factory.mktemp("resume4"), 4)
    tokens = str(write_tokens(jobs.folder / "tokens.bin"))
    ck = jobs.folder / "ck"
    common = {"data_path": tokens}
    # the uninterrupted runs, saving every 3 steps
    _case(jobs, "full", "1f1b", pp=4, config={}, save_dir=str(ck / "full"), save_every=SAVED, keep=2, **common)
    _case(jobs, "full-bf16", "1f1b", pp=4, config={}, precision="bf16", save_dir=str(ck / "bf16"), save_every=SAVED, **common)
    _case(jobs, "full-tied", "1f1b", pp=4, config={"tie": True}, save_dir=str(ck / "tied"), save_every=SAVED, **common)
    # dropout: the resumed steps draw the masks the uninterrupted run drew only if every rank's
    # generator is restored
    _case(jobs, "full-dropout", "1f1b", pp=4, config={"dropout": 0.5}, save_dir=str(ck / "dropout"), save_every=SAVED,
          **common)
    # batch statistics under data parallelism: each replica's running means are its own samples'
    _case(jobs, "full-bn-pp2dp2", "1f1b", pp=2, config={"batchnorm": True}, microbatches=2, save_dir=str(ck / "bn"),
          save_every=SAVED, **common)
    step3 = f"step_{SAVED:08d}"
    _case(jobs, "same-bn-pp2dp2", "1f1b", pp=2, config={"batchnorm": True}, microbatches=2, resume=str(ck / "bn" / step3),
          **common)
    # resumed under the same plan: bit for bit
    _case(jobs, "same", "1f1b", pp=4, config={}, resume=str(ck / "full" / step3), **common)
    _case(jobs, "same-dropout", "1f1b", pp=4, config={"dropout": 0.5}, resume=str(ck / "dropout" / step3), **common)
    _case(jobs, "same-bf16", "1f1b", pp=4, config={}, precision="bf16", resume=str(ck / "bf16" / step3), **common)
    # resumed under other plans of the same world: pp 2 x dp 2 with ZB-V (the embedding and the
    # head on one rank), and interleaved 1F1B; the global batch (8 samples) stays
    _case(jobs, "zbv-pp2dp2", "zbv", pp=2, config={}, microbatches=2, resume=str(ck / "full" / step3), **common)
    _case(jobs, "tied-zbv-pp2dp2", "zbv", pp=2, config={"tie": True}, microbatches=2,
          resume=str(ck / "tied" / step3), **common)
    # --resume auto with nothing saved yet is a fresh start; then it picks up the newest
    _case(jobs, "auto-fresh", "1f1b", pp=4, config={}, save_dir=str(ck / "auto"), resume="auto", **common)
    return jobs


def _final(jobs: Jobs, name: str) -> dict[int, dict]:
    merged: dict[int, dict] = {}
    launched = jobs.run()
    assert launched.exitcodes == [0] * jobs.world, "\n".join(launched.logs)
    for rank in range(jobs.world):
        out = launched.result(name, rank)
        if out["dp_rank"] == 0:
            merged.update(out["state"])
    return merged


def _losses(jobs: Jobs, name: str) -> dict[int, float]:
    return {m.step: m.loss for m in jobs.run().result(name, 0)["metrics"]}


@pytest.mark.slow
@pytest.mark.parametrize("full,resumed", [("full", "same"), ("full-bf16", "same-bf16"), ("full-dropout", "same-dropout")])
def test_resume_under_the_same_plan_is_bit_identical(world4, full, resumed):
    whole, cont = _losses(world4, full), _losses(world4, resumed)
    assert sorted(cont) == list(range(SAVED, STEPS))  # --steps counts from step 0
    assert [cont[s] for s in cont] == [whole[s] for s in cont]  # ==: bit for bit
    a, b = _final(world4, full), _final(world4, resumed)
    assert all(torch.equal(a[i][k], b[i][k]) for i in a for k in a[i])


@pytest.mark.slow
def test_replicas_hold_one_set_of_buffers_and_resume_it_bit_for_bit(world4):
    """BatchNorm's running statistics under pp 2 x dp 2: each replica updates them from its own
    samples, then takes replica 0's after every update (DDP's broadcast_buffers), so both
    replicas end alike and the checkpoint holds one replica's set. Without it the replicas'
    statistics drifted apart, the checkpoint (one copy a key) mixed them key by key, and a
    resume under the same plan ended with other statistics than the uninterrupted run."""
    launched = world4.run()
    assert launched.exitcodes == [0] * world4.world, "\n".join(launched.logs)
    for name in ("full-bn-pp2dp2", "same-bn-pp2dp2"):
        by_pp: dict[int, dict[int, dict]] = {}
        for rank in range(world4.world):
            out = launched.result(name, rank)
            by_pp.setdefault(out["pp_rank"], {})[out["dp_rank"]] = out["state"]
        for replicas in by_pp.values():
            assert all(torch.equal(replicas[0][i][k], replicas[1][i][k]) for i in replicas[0] for k in replicas[0][i])
    whole, cont = _losses(world4, "full-bn-pp2dp2"), _losses(world4, "same-bn-pp2dp2")
    assert [cont[s] for s in cont] == [whole[s] for s in cont]
    a, b = _final(world4, "full-bn-pp2dp2"), _final(world4, "same-bn-pp2dp2")
    assert any(k.endswith("running_mean") for i in a for k in a[i])
    assert all(torch.equal(a[i][k], b[i][k]) for i in a for k in a[i])


@pytest.mark.slow
@pytest.mark.parametrize("full,resumed", [("full", "zbv-pp2dp2"), ("full-tied", "tied-zbv-pp2dp2")])
def test_resume_under_another_plan_matches(world4, full, resumed):
    whole, cont = _losses(world4, full), _losses(world4, resumed)
    assert sorted(cont) == list(range(SAVED, STEPS))
    assert [cont[s] for s in cont] == pytest.approx([whole[s] for s in cont], abs=1e-6)
    assert h.max_abs_diff(_final(world4, resumed), _final(world4, full)) <= 1e-6


@pytest.mark.slow
def test_a_save_slower_than_the_timeout_completes(tmp_path):
    """A shard that takes longer to write than --timeout allows a step: the other rank waits for
    it in the save's collectives up to --init-timeout, not --timeout (which ended the job)."""
    jobs = Jobs(tmp_path, 2)
    root = tmp_path / "ck"
    _case(jobs, "slow", "1f1b", pp=2, config={}, save_dir=str(root), save_every=1, init_timeout_s=60)
    job = jobs.jobs[0]
    jobs.jobs[0] = dataclasses.replace(job, config=dataclasses.replace(job.config, timeout_s=2.0, steps=2),
                                       fault={"kind": "slow-save", "rank": 1, "seconds": 5.0})
    launched = jobs.run()
    assert launched.exitcodes == [0, 0], "\n".join(launched.logs)
    assert h.saved_entries(root) == ["step_00000001", "step_00000002"]


@pytest.mark.slow
def test_checkpoints_hold_the_data_position_and_keep_the_newest(world4):
    root = world4.folder / "ck" / "full"
    world4.run()
    assert h.saved_entries(root) == [f"step_{SAVED:08d}", f"step_{STEPS:08d}"]
    meta = json.loads((root / f"step_{SAVED:08d}" / "octopipe.json").read_text())["meta"]
    assert meta["step"] == SAVED and meta["consumed_samples"] == SAVED * 8 and meta["num_layers"] == 6
    # auto with no checkpoint: a fresh start from step 0 equal to the uninterrupted run
    assert _losses(world4, "auto-fresh") == _losses(world4, "full")
    assert (world4.folder / "ck" / "auto" / f"step_{STEPS:08d}").is_dir()


@pytest.mark.slow
def test_resume_on_a_smaller_world(world4, tmp_path):
    """A checkpoint of 4 processes resumed by 2 (pp 2, 4 microbatches): within 1e-6."""
    world4.run()
    jobs = Jobs(tmp_path, 2)
    tokens = str(world4.folder / "tokens.bin")
    _case(jobs, "pp2", "1f1b", pp=2, config={}, resume=str(world4.folder / "ck" / "full" / f"step_{SAVED:08d}"),
          data_path=tokens)
    cont, whole = _losses(jobs, "pp2"), _losses(world4, "full")
    assert [cont[s] for s in cont] == pytest.approx([whole[s] for s in cont], abs=1e-6)
    assert h.max_abs_diff(_final(jobs, "pp2"), _final(world4, "full")) <= 1e-6


# -- bad checkpoints: one line, exit 2, nothing touched ------------------------------------------
def _octorun(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.run([sys.executable, "-m", "octorun", *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=120)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> tuple[Path, Path]:
    """A one-process plan of the 6-layer model with a checkpoint at step 2, and one of 8 layers."""
    folder = tmp_path_factory.mktemp("bad")
    jobs = Jobs(folder, 1)
    for name, depth, tie, seq, dropout in (("d6", 6, False, 5, 0.0), ("d8", 8, False, 5, 0.0), ("d6-tied", 6, True, 5, 0.0),
                                           ("d6-seq7", 6, False, 7, 0.0), ("d6-dropout", 6, False, 5, 0.5)):
        plan = h.baseline_plan("1f1b", jobs.model, {"vocab": 11, "hidden": 8, "depth": depth, "seq": seq, "tie": tie,
                                                      "poison": -1, "dropout": dropout}, folder / name, gpus=1, pp=1,
                               microbatches=2)
        save_plan(plan, folder / f"{name}.yaml")
    done = _octorun(str(folder / "d6.yaml"), "--steps", "2", "--save", str(folder / "ck"), cwd=h.ROOT)
    assert done.returncode == 0, done.stderr
    # one step on a token file, read in the order of --seed 3
    done = _octorun(str(folder / "d6.yaml"), "--steps", "1", "--save", str(folder / "ck-data"), "--seed", "3",
                    "--data", str(write_tokens(folder / "tokens.bin")), cwd=h.ROOT)
    assert done.returncode == 0, done.stderr
    write_tokens(folder / "other-tokens.bin", seed=6)
    return folder, folder / "ck" / "step_00000002"


def test_a_resume_with_nothing_left_to_train_ends_well_and_says_what_it_did_not_write(one_rank, tmp_path):
    """A restart script rerun after its job ended: the checkpoint is at --steps already. The run
    exits 0 and says so; no step ran, so the metrics hold no line and the trace asked for is not
    written (the old one stays as it was), which the warning names."""
    folder, good = one_rank
    metrics, trace = tmp_path / "m.jsonl", tmp_path / "t.json"
    trace.write_text("the last run's trace")
    done = _octorun(str(folder / "d6.yaml"), "--steps", "2", "--resume", str(good), "--metrics", str(metrics),
                    "--trace", str(trace), cwd=h.ROOT)
    assert done.returncode == 0, done.stderr
    assert f"the checkpoint is at step 2, not below --steps 2: nothing to train; --trace {trace} is not written" in done.stderr
    assert trace.read_text() == "the last run's trace" and metrics.read_text() == ""


@pytest.mark.parametrize("output", ["--metrics", "--save"])
def test_an_output_the_filesystem_stops_taking_is_one_line(one_rank, output, tmp_path):
    """A full disk, here a file size limit of 1 KiB (ulimit -f 1): the metrics file stops taking
    lines after a few steps, the checkpoint's data file at once. One line naming the output,
    exit 2, not an OSError or torch's C++ enforce message (and not the flush that fails again
    as the file closes, which took the first error's place)."""
    import resource

    folder, _ = one_rank
    out = tmp_path / ("m.jsonl" if output == "--metrics" else "ck")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run([sys.executable, "-m", "octorun", str(folder / "d6.yaml"), "--steps", "12", output, str(out)],
                          capture_output=True, text=True, cwd=h.ROOT, env=env, timeout=120,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024)))
    assert done.returncode == 2, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    if output == "--metrics":
        assert line.endswith(f"{out}.partial: --metrics cannot be written: File too large (give a writable file path)")
    else:  # which write fails first decides the words: an OSError's, or torch's file writer's
        assert f"{out}/step_00000012.partial: could not be written by rank 0: " in line
        assert "RuntimeError" not in line and "enforce" not in line


@pytest.mark.parametrize("case", ["missing", "partial", "other-model", "missing-shard", "auto-without-save",
                                  "other-seed", "other-data", "other-seq", "tied-head", "other-config", "init-missing", "init-other-model",
                                  "init-tied-head", "init-save-beside", "init-save-beside-resumed", "save-is-metrics"])
def test_bad_checkpoints_exit_2_in_one_line(one_rank, case, tmp_path):
    folder, good = one_rank
    plan, resume = folder / "d6.yaml", str(good)
    extra: list[str] = []
    flag = "--init-from" if case.startswith("init-") else "--resume"
    if case == "init-missing":
        resume = str(tmp_path / "nothing-here")
    elif case == "init-other-model":
        plan = folder / "d8.yaml"
    elif case == "init-tied-head":
        plan = folder / "d6-tied.yaml"
    elif case == "init-save-beside":  # the run's saves would prune the checkpoint it starts from
        extra = ["--save", str(good.parent)]
    elif case == "init-save-beside-resumed":  # and --resume auto would take it for the run's own, then prune it
        extra = ["--save", str(good.parent), "--resume", "auto"]
    elif case == "save-is-metrics":  # refused before training, not once its metrics cannot replace the folder
        extra = ["--save", str(tmp_path / "m.jsonl")]
    elif case == "missing":
        resume = str(tmp_path / "nothing-here")
    elif case == "partial":
        partial = tmp_path / "step_00000002.partial"
        partial.mkdir()
        resume = str(partial)
    elif case == "other-model":
        plan = folder / "d8.yaml"
    elif case == "tied-head":  # the same layers with the head tied to the embedding: another config
        plan = folder / "d6-tied.yaml"
    elif case == "other-config":  # the same shapes, another model: resumed without a word before
        plan = folder / "d6-dropout.yaml"
    elif case == "missing-shard":
        broken = tmp_path / "step_00000002"
        broken.mkdir()
        for file in good.iterdir():
            if not file.name.endswith(".distcp"):
                (broken / file.name).write_bytes(file.read_bytes())
        resume = str(broken)
    elif case == "auto-without-save":
        resume = "auto"
    elif case in ("other-seed", "other-data", "other-seq"):
        # other-seq: the same file and seed in windows of 8 tokens, not 6 (a model without weights
        # that depend on seq, as a rotary one): another order of windows
        resume = str(folder / "ck-data" / "step_00000001")
        extra = ["--data", str(folder / ("other-tokens.bin" if case == "other-data" else "tokens.bin")), "--seed",
                 "4" if case == "other-seed" else "3"]
        plan = folder / ("d6-seq7.yaml" if case == "other-seq" else "d6.yaml")
    metrics = tmp_path / "m.jsonl"
    done = _octorun(str(plan), "--steps", "3", flag, resume, "--metrics", str(metrics), *extra, cwd=h.ROOT)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("octorun: "), done.stderr
    assert "Traceback" not in done.stderr
    assert not metrics.exists() and not Path(f"{metrics}.partial").exists()
    assert list(tmp_path.glob("m.rank*")) == []  # no activity record either: the line says it all
    expected = {"missing": "nothing-here", "partial": "partial", "other-model": "layers",
                "missing-shard": ".distcp", "auto-without-save": "--save", "other-seed": "resume with --seed 3",
                "other-data": "trained on a file of 3000 uint16 tokens",
                "other-seq": "tokens_per_sample: the checkpoint read its token file in windows of 6 tokens, this run's "
                             "model reads 8",
                "tied-head": "resolved_config: the checkpoint's model was trained with tie=False (now True)",
                "other-config": "resolved_config: the checkpoint's model was trained with dropout=0.0 (now 0.5) (resume "
                                "under a plan of the model config the checkpoint was trained with, or take its weights "
                                "alone with --init-from)",
                "init-missing": "nothing-here: --init-from: does not exist", "init-other-model": "layers",
                "init-tied-head": "no layer of this model takes it",
                "init-save-beside": "--save: holds the --init-from checkpoint",
                "init-save-beside-resumed": "--save: holds the --init-from checkpoint",
                "save-is-metrics": "--save names the path --metrics names too"}[case]
    assert expected in lines[0], lines[0]
    assert good.is_dir() and (good / "octopipe.json").exists()  # the checkpoint given is as it was
    if case.startswith("init-") and not case.startswith("init-save-beside"):
        assert "(give --init-from " in lines[0], lines[0]  # the fix names the flag given


def test_init_from_a_folder_of_checkpoints_beside_the_saves_is_taken(one_rank, tmp_path):
    """--init-from runs/pretrain (its checkpoints inside) with --save runs: the saves prune and
    resume only runs/step_*, so the pretrained ones are safe, and the run starts."""
    folder, good = one_rank
    pretrain = tmp_path / "runs" / "pretrain"
    shutil.copytree(good, pretrain / good.name)
    done = _octorun(str(folder / "d6.yaml"), "--steps", "1", "--init-from", str(pretrain), "--save",
                    str(tmp_path / "runs"), "--resume", "auto", cwd=h.ROOT)
    assert done.returncode == 0, done.stderr
    assert f"took the weights of {pretrain / good.name}" in done.stderr
    assert h.saved_entries(tmp_path / "runs") == ["pretrain", "step_00000001"]
    assert (pretrain / good.name / "octopipe.json").exists()


def test_changed_settings_name_each_change_that_the_checkpoint_recorded():
    from octorun.runtime import changed_settings

    saved = {"seed": 3, "precision": "fp32", "lr_schedule": {"schedule": "cosine", "lr": 0.01, "steps": 6},
             "betas": [0.9, 0.95]}
    now = {"seed": 3, "precision": "bf16", "lr_schedule": {"schedule": "cosine", "lr": 0.01, "steps": 20},
           "betas": [0.9, 0.95], "grad_clip": 1.0}  # grad_clip: a checkpoint from before it was recorded
    assert changed_settings(saved, now) == ["precision fp32 -> bf16", "lr_schedule.steps 6 -> 20"]
    assert changed_settings(saved, saved) == []


def test_a_resume_with_nothing_to_train_and_eval_data_evaluates_its_weights(one_rank, tmp_path):
    """A run evaluated after its last step, then its checkpoint resumed at --steps with the same
    --eval-data (Megatron-LM's --skip-train): no step, one evaluation of the same weights on the
    same batches, the same loss to the bit; the metrics keep their lines, the last one with the
    new evaluation's figures."""
    folder, _ = one_rank
    held, metrics, ck = write_tokens(tmp_path / "held.bin", count=200, seed=6), tmp_path / "m.jsonl", tmp_path / "ck"
    args = (str(folder / "d6.yaml"), "--steps", "2", "--eval-data", str(held), "--metrics", str(metrics))
    done = _octorun(*args, "--save", str(ck), cwd=h.ROOT)
    assert done.returncode == 0, done.stderr
    trained = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [("eval_loss" in line) for line in trained] == [False, True]
    done = _octorun(*args, "--resume", str(ck), cwd=h.ROOT)
    assert done.returncode == 0, done.stderr
    assert "the checkpoint is at step 2, not below --steps 2: nothing to train; evaluating its weights on --eval-data" \
        in done.stderr
    assert f"evaluation after step 1: eval loss {trained[1]['eval_loss']:.6f}" in done.stdout
    assert not [line for line in done.stdout.splitlines() if line.startswith("step ")]
    evaluated = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert evaluated[0] == trained[0]
    assert {**evaluated[1], "eval_ms": None} == {**trained[1], "eval_ms": None}
    # and a later resume that trains on keeps those lines as this run's own
    done = _octorun(str(folder / "d6.yaml"), "--steps", "3", *args[3:], "--resume", str(ck), cwd=h.ROOT)
    assert done.returncode == 0 and "another run" not in done.stderr, done.stderr
    assert [json.loads(line) for line in metrics.read_text().splitlines()][:2] == evaluated


def test_a_process_killed_during_an_evaluation_loses_no_metrics_line(one_rank, tmp_path):
    """Killed (SIGKILL) as the evaluation after step 1 begins, its checkpoint saved but the step's
    metrics line not yet written: the resume takes that line from the checkpoint, so the run
    ends with one line per step, the losses of a run never killed; step 1's line has no
    evaluation (none finished), the last step's is the uninterrupted run's."""
    folder, _ = one_rank
    held = write_tokens(tmp_path / "held.bin", count=200, seed=6)
    common = (str(folder / "d6.yaml"), "--steps", "3", "--eval-data", str(held), "--eval-every", "2", "--save-every", "2")
    clean, killed = tmp_path / "clean.jsonl", tmp_path / "killed.jsonl"
    done = _octorun(*common, "--save", str(tmp_path / "clean"), "--metrics", str(clean), cwd=h.ROOT)
    assert done.returncode == 0, done.stderr
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run([sys.executable, str(Path(__file__).parent / "fault_injection.py"), "--fault",
                           "attempt=0,rank=0,step=1,at=evaluate,signal=KILL", "--", *common, "--save",
                           str(tmp_path / "ck"), "--metrics", str(killed)], capture_output=True, text=True, cwd=h.ROOT,
                          env=env, timeout=120)
    assert done.returncode == -9, done.stderr
    assert [json.loads(line)["step"] for line in Path(f"{killed}.partial").read_text().splitlines()] == [0]
    done = _octorun(*common, "--save", str(tmp_path / "ck"), "--metrics", str(killed), "--resume", "auto", cwd=h.ROOT)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in killed.read_text().splitlines()]
    expected = [json.loads(line) for line in clean.read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2]
    assert [line["loss"] for line in lines] == [line["loss"] for line in expected]
    assert [("eval_loss" in line) for line in lines] == [False, False, True]
    assert [("eval_loss" in line) for line in expected] == [False, True, True]
    assert lines[2]["eval_loss"] == expected[2]["eval_loss"]


def test_earlier_metrics_of_another_run_are_not_spliced_in(tmp_path, caplog):
    """--metrics at a path an older experiment's file holds: the interrupted run's .partial has
    steps 0 and 1, the checkpoint is after step 2 and carries that step's line. The old file's
    step 2 (another loss) is not taken in between; the checkpoint's line is. A file of this
    run's own lines is kept whole, its evaluation figures too."""
    from octorun.runtime import _earlier_metrics

    metrics = tmp_path / "m.jsonl"
    mine = [{"step": step, "loss": 2.5 - step / 10} for step in range(3)]
    metrics.write_text("".join(json.dumps({"step": step, "loss": 99.0}) + "\n" for step in range(5)))
    Path(f"{metrics}.partial").write_text("".join(json.dumps(line) + "\n" for line in mine[:2]))
    kept = _earlier_metrics(str(metrics), 3, mine[2])
    assert [json.loads(line) for line in kept] == mine
    assert "holds another run's metrics (its step 2 has loss 99.0, the checkpoint's 2.3)" in caplog.text
    evaluated = {**mine[2], "eval_loss": 1.9}
    metrics.write_text("".join(json.dumps(line) + "\n" for line in [*mine[:2], evaluated]))
    Path(f"{metrics}.partial").unlink()
    assert [json.loads(line) for line in _earlier_metrics(str(metrics), 3, mine[2])] == [*mine[:2], evaluated]
    # a file that stops two steps or more before the checkpoint's is another run's too (a killed
    # evaluation costs this run the line of the checkpoint's step alone)
    later = {"step": 4, "loss": 2.0}
    assert _earlier_metrics(str(metrics), 5, later) == []
    assert "its last line is of step 2; the checkpoint is after step 4" in caplog.text
    assert [json.loads(line) for line in _earlier_metrics(str(metrics), 4, {"step": 3, "loss": 2.1})] == \
        [*mine[:2], evaluated, {"step": 3, "loss": 2.1}]


def test_a_resume_that_changes_what_it_trains_on_says_so(one_rank, tmp_path):
    """The checkpoint at step 2 was trained on the model's sample_batch. Resumed with --data, the
    file is read from the samples the checkpoint consumed on; resumed without --data under a plan
    that cuts the global batch otherwise, sample_batch (seeded per replica and microbatch) draws
    other samples. Each is said; the same cut says nothing."""
    folder, good = one_rank
    spec = {"vocab": 11, "hidden": 8, "depth": 6, "seq": 5, "tie": False, "poison": -1, "dropout": 0.0}
    plan = h.baseline_plan("1f1b", folder / "train_model.py", spec, tmp_path / "mb4", gpus=1, pp=1, microbatches=4)
    save_plan(plan, tmp_path / "mb4.yaml")
    tokens = str(folder / "tokens.bin")
    with_data = _octorun(str(folder / "d6.yaml"), "--steps", "3", "--resume", str(good), "--data", tokens, cwd=h.ROOT)
    assert with_data.returncode == 0, with_data.stderr
    assert f"the checkpoint was trained on the model's sample_batch; this run reads --data {tokens} from sample 8 on" \
        in with_data.stderr
    other_cut = _octorun(str(tmp_path / "mb4.yaml"), "--steps", "3", "--resume", str(good), cwd=h.ROOT)
    assert other_cut.returncode == 0, other_cut.stderr
    assert ("without --data, the model's sample_batch draws each microbatch by its step, replica and index: this "
            "plan's 1 replica(s) x 4 microbatches of 2 draws other samples than the checkpoint's 1 replica(s) x 2 "
            "microbatches of 2") in " ".join(other_cut.stderr.split())
    same_cut = _octorun(str(folder / "d6.yaml"), "--steps", "3", "--resume", str(good), cwd=h.ROOT)
    assert same_cut.returncode == 0 and "sample_batch" not in same_cut.stderr, same_cut.stderr
    # a resume that only evaluates trains on nothing: nothing to say of what
    held = write_tokens(tmp_path / "held.bin", count=200, seed=6)
    evaluating = _octorun(str(tmp_path / "mb4.yaml"), "--steps", "2", "--resume", str(good), "--data", tokens,
                          "--eval-data", str(held), cwd=h.ROOT)
    assert evaluating.returncode == 0, evaluating.stderr
    assert "sample_batch" not in evaluating.stderr and "settings differ" not in evaluating.stderr, evaluating.stderr


def test_a_resume_at_another_seq_whose_weights_follow_seq_names_it(tmp_path):
    """seq may change across a resume (no weight depends on it: rotary positions), but learned
    positions are a weight of shape [seq, hidden]: the shape that differs is refused, and the fix
    names the seq the checkpoint was trained at rather than a damaged checkpoint."""
    jobs = Jobs(tmp_path, 1)
    for name, seq in (("seq5", 5), ("seq7", 7)):
        plan = h.baseline_plan("1f1b", jobs.model, {"vocab": 11, "hidden": 8, "depth": 6, "seq": seq, "positions": True},
                               tmp_path / name, gpus=1, pp=1, microbatches=2)
        save_plan(plan, tmp_path / f"{name}.yaml")
    done = _octorun(str(tmp_path / "seq5.yaml"), "--steps", "1", "--save", str(tmp_path / "ck"), cwd=h.ROOT)
    assert done.returncode == 0, done.stderr
    done = _octorun(str(tmp_path / "seq7.yaml"), "--steps", "2", "--resume", str(tmp_path / "ck"), cwd=h.ROOT)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "model/layers.0.pos" in lines[0], done.stderr
    assert lines[0].endswith("(the checkpoint was trained with seq=5 (now 7), and a tensor's shape follows it here: "
                             "resume under a plan of the checkpoint's)"), lines[0]


def test_a_save_root_holding_another_model_configs_checkpoint_is_refused(one_rank):
    """--save into a folder of checkpoints of the same layers under another config (dropout 0.0,
    now 0.5: the same shapes): this run's saves would replace the one of the same step and prune
    the rest. Refused before training, as a resume of it is; the checkpoint stays as it was."""
    folder, good = one_rank
    before = sorted(path.name for path in good.parent.iterdir())
    done = _octorun(str(folder / "d6-dropout.yaml"), "--steps", "2", "--save", str(good.parent), cwd=h.ROOT)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--save: holds a checkpoint of another model config (trained with dropout=0.0 (now 0.5))" \
        in lines[0], done.stderr
    assert sorted(path.name for path in good.parent.iterdir()) == before and (good / "octopipe.json").exists()


def test_a_resume_that_passes_over_a_damaged_later_checkpoint_says_so(one_rank, tmp_path):
    """A folder of checkpoints whose newest lost a file: the resume takes the newest complete one,
    and names the one it passed over (a .partial save is an unfinished one, expected, and not
    named)."""
    folder, good = one_rank
    root = tmp_path / "ck"
    shutil.copytree(good, root / "step_00000002")
    shutil.copytree(good, root / "step_00000003")
    (root / "step_00000003" / "octopipe.json").unlink()
    (root / "step_00000004.partial").mkdir()
    done = _octorun(str(folder / "d6.yaml"), "--steps", "3", "--resume", str(root), cwd=h.ROOT)
    assert done.returncode == 0, done.stderr
    assert f"resumed from {root / 'step_00000002'} at step 2" in done.stderr
    assert f"passed over {root / 'step_00000003'}, a later checkpoint that is not complete" in done.stderr
    assert "step_00000004" not in done.stderr


def test_a_save_root_another_live_run_holds_is_refused_and_freed_when_it_ends(one_rank, tmp_path):
    """Another process holds the root's lock (a run saving into it now): this run is refused
    before training, naming it, and writes nothing there; once that process is gone (however it
    ended: the kernel lets go of its lock), the root is this run's."""
    folder, _ = one_rank
    root = tmp_path / "ck"
    root.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time\n"
                               "f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX)\n"
                               "f.seek(0); f.truncate(); f.write('pid 4242 on elsewhere\\n'); f.flush()\n"
                               "print('held', flush=True); time.sleep(120)", str(root / ".octorun.lock")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        done = _octorun(str(folder / "d6.yaml"), "--steps", "2", "--save", str(root), cwd=h.ROOT)
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and f"{root}: --save: another run saves into it now (pid 4242 on elsewhere, holding " \
            ".octorun.lock)" in lines[0], done.stderr
        assert sorted(path.name for path in root.iterdir()) == [".octorun.lock"]
    finally:
        holder.kill()
        holder.wait()
    done = _octorun(str(folder / "d6.yaml"), "--steps", "2", "--save", str(root), cwd=h.ROOT)
    assert done.returncode == 0, done.stderr
    assert (root / "step_00000002" / "octopipe.json").exists()
