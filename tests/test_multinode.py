"""Two torchrun launchers on this machine stand in for two nodes (c10d rendezvous on 127.0.0.1):
a plan tuned for nodes of 2 GPUs trains exactly as it does under one launcher, and a launch
whose nodes disagree with the plan's stops before training, naming both numbers."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import runtime_helpers as h
from octoplan.plan import save_plan

pytestmark = pytest.mark.slow  # fresh interpreters under torchrun: tens of seconds on 2 cores

LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _plan(folder: Path, gpus_per_node: int) -> Path:
    model_path, config = h.model_spec("tiny", folder)
    plan = h.baseline_plan("1f1b", model_path, config, folder, gpus=4, pp=2, microbatches=4)
    plan = dataclasses.replace(plan, cluster=dataclasses.replace(plan.cluster, gpus_per_node=gpus_per_node))
    path = folder / f"plan-{gpus_per_node}.yaml"
    save_plan(plan, path)
    return path


def _torchrun(args: list[str], plan: Path, metrics: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *args, "-m", "octorun", str(plan), "--steps", "3",
         "--optimizer", "adamw", "--lr", "0.01", "--grad-clip", "1.0", "--metrics", str(metrics), "--timeout", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=h.ROOT, env=env,
    )


def _two_nodes(plan: Path, metrics: Path) -> list[tuple[int, str, str]]:
    port = h.free_port()
    procs = [_torchrun(["--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "octopipe-test"], plan, metrics)
             for node in (0, 1)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        results.append((proc.returncode, out, err))
    return results


def test_two_launchers_train_exactly_like_one(tmp_path):
    plan = _plan(tmp_path, gpus_per_node=2)
    results = _two_nodes(plan, tmp_path / "two.jsonl")
    assert [code for code, _, _ in results] == [0, 0], "\n".join(err for _, _, err in results)
    one = _torchrun(["--standalone", "--nproc-per-node", "4"], _plan(tmp_path, gpus_per_node=4), tmp_path / "one.jsonl")
    _, err = one.communicate(timeout=240)
    assert one.returncode == 0, err
    # the node that hosts global rank 0 writes the metrics
    two = [json.loads(line) for line in (tmp_path / "two.jsonl").read_text().splitlines()]
    single = [json.loads(line) for line in (tmp_path / "one.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in two] == [r["loss"] for r in single]  # bit for bit
    assert [r["grad_norm"] for r in two] == [r["grad_norm"] for r in single]


def test_a_launch_of_other_nodes_than_the_plans_exits_2(tmp_path):
    plan = _plan(tmp_path, gpus_per_node=4)  # tuned for one node of 4, launched as 2 x 2
    results = _two_nodes(plan, tmp_path / "m.jsonl")
    assert [code for code, _, _ in results] != [0, 0]
    lines = [line for _, _, err in results for line in err.splitlines() if line.startswith("octorun:")]
    assert lines, [err for _, _, err in results]
    assert all("cluster.gpus_per_node" in line and "4 GPUs per node" in line and "started 2" in line for line in lines), lines
    assert not (tmp_path / "m.jsonl").exists()


def test_a_node_whose_own_plan_is_missing_says_so_and_the_other_ends_too(tmp_path):
    model_path, config = h.model_spec("tiny", tmp_path)
    plan = h.baseline_plan("1f1b", model_path, config, tmp_path, gpus=2, pp=2, microbatches=2)
    plan = dataclasses.replace(plan, cluster=dataclasses.replace(plan.cluster, gpus_per_node=1))
    save_plan(plan, tmp_path / "plan.yaml")
    plan = tmp_path / "plan.yaml"
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    env["OMP_NUM_THREADS"] = "1"
    port = h.free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "octopipe-test", "-m", "octorun",
         str(plan if node == 0 else tmp_path / "nope.yaml"), "--steps", "1", "--init-timeout", "10"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=h.ROOT, env=env) for node in (0, 1)]
    (_, err0), (_, err1) = [p.communicate(timeout=120) for p in procs]
    code0, code1 = procs[0].returncode, procs[1].returncode
    # whichever global rank the rendezvous gives it, the node with the bad path names the file
    said = [line for line in err1.splitlines() if line.startswith("octorun:")]
    assert said == [f"octorun: {tmp_path / 'nope.yaml'}: no such plan file (check the path)"], err1
    # the other node ends too: at --init-timeout, or sooner when the node that left hosted the
    # rendezvous store (which node binds the endpoint first is a race)
    assert code1 != 0 and code0 != 0, err0
