"""Two torchrun launchers on this machine stand in for two nodes (c10d rendezvous on 127.0.0.1):
a plan tuned for nodes of 2 GPUs trains exactly as it does under one launcher, and a launch
whose nodes disagree with the plan's stops before training, naming both numbers."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import socket
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


def _one_process_nodes(args: list[list[str]]) -> list[tuple[int, list[str]]]:
    """Two launchers of one process each; node i runs ``octorun *args[i]``. Returns each
    launcher's exit code and the `octorun:` lines of its log. The job's --init-timeout is the
    default 300 s: a node still waiting for its peer to form the group would outlast the
    deadline here."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    env["OMP_NUM_THREADS"] = "1"
    port = h.free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "octopipe-test", "-m", "octorun",
         *args[node]],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=h.ROOT, env=env) for node in (0, 1)]
    results = []
    for proc in procs:
        _, err = proc.communicate(timeout=150)
        results.append((proc.returncode, [line for line in err.splitlines() if line.startswith("octorun:")]))
    return results


def _pp2_plan(folder: Path, name: str = "plan.yaml", schedule: str = "1f1b") -> Path:
    model_path, config = h.model_spec("tiny", folder)
    plan = h.baseline_plan(schedule, model_path, config, folder, gpus=2, pp=2, microbatches=2)
    plan = dataclasses.replace(plan, cluster=dataclasses.replace(plan.cluster, gpus_per_node=1))
    save_plan(plan, folder / name)
    return folder / name


_HOST = re.escape(socket.gethostname())


def test_a_node_whose_own_plan_is_missing_says_so_and_the_other_stops_at_once_saying_why(tmp_path):
    plan, nope = _pp2_plan(tmp_path), tmp_path / "nope.yaml"
    (code0, said0), (code1, said1) = _one_process_nodes([[str(plan), "--steps", "1"], [str(nope), "--steps", "1"]])
    # whichever global rank the rendezvous gives it, the node with the bad path names the file
    line = f"{nope}: no such plan file (check the path)"
    assert said1 == [f"octorun: {line}"], said1
    # the other node heard of it when the processes met, before any group formed: it ends at
    # once (not at --init-timeout), and its log names the node and the cause
    assert len(said0) == 1 and re.fullmatch(rf"octorun: rank [01] \(node 1, host {_HOST}\): {re.escape(line)}", said0[0]), said0
    assert code0 != 0 and code1 != 0


@pytest.mark.parametrize("differs", ["plan", "--steps"])
def test_nodes_launched_with_another_plan_or_options_stop_before_training(tmp_path, differs):
    plan = _pp2_plan(tmp_path)
    if differs == "plan":
        other = _pp2_plan(tmp_path, "other.yaml", schedule="gpipe")
        args = [[str(plan), "--steps", "1"], [str(other), "--steps", "1"]]
    else:
        args = [[str(plan), "--steps", "1"], [str(plan), "--steps", "2"]]
    results = _one_process_nodes(args)
    assert all(code != 0 for code, _ in results)
    # rank 0 (the rendezvous's choice of node) is the reference: the other node is the one that
    # differs. Its line names it and rank 0, so both nodes' logs hold that same line, once
    said = [lines for _, lines in results]
    assert said[0] == said[1] and len(said[0]) == 1, said
    bad = int(re.search(r"rank 1 \(node (\d)", said[0][0]).group(1))
    good = 1 - bad
    me, them = rf"rank 1 \(node {bad}, host {_HOST}\)", rf"rank 0\S* \(node {good}, host {_HOST}\)"
    if differs == "plan":
        expected = (rf"{re.escape(args[bad][0])}: given to {me} is another plan than {them} "
                    r"\(give every node the same plan file\)")
    else:
        expected = (rf"--steps: is {bad + 1} on {me} but {good + 1} on {them} "
                    r"\(launch every process with the same plan, model file and options\)")
    assert re.fullmatch(f"octorun: {expected}", said[0][0]), said


def test_nodes_that_save_into_folders_of_their_own_stop_before_training(tmp_path):
    """Each node's --save is a folder on its own disk (here two folders of one machine): every
    checkpoint would lack the other node's shares, and rank 0 would report it saved. Both stop
    at the start, each log saying why once; nothing is written."""
    plan = _pp2_plan(tmp_path)
    results = _one_process_nodes([[str(plan), "--steps", "1", "--save", str(tmp_path / f"disk{node}")] for node in (0, 1)])
    assert all(code != 0 for code, _ in results)
    said = [lines for _, lines in results]
    assert said[0] == said[1] and len(said[0]) == 1, said
    assert re.fullmatch(rf"octorun: --save: is another folder on rank 1 \({re.escape(str(tmp_path))}/disk[01]\) than on "
                        rf"rank 0 \({re.escape(str(tmp_path))}/disk[01]\): their shares of every checkpoint would be missing "
                        r"from it \(give every node the same folder: one node, or a file system all nodes share\)", said[0][0])
    assert [p.name for p in tmp_path.glob("disk*/*")] == []


@contextlib.contextmanager
def _read_only_view(folder: Path, view: Path):
    """``view``: ``folder`` through a read-only bind mount, as a node whose shared file system is
    mounted read-only sees it. Skips the test where mounting is not allowed (not root, or no
    CAP_SYS_ADMIN)."""
    view.mkdir()
    if subprocess.run(["mount", "--bind", str(folder), str(view)], capture_output=True).returncode != 0:
        pytest.skip("needs a bind mount (root with CAP_SYS_ADMIN)")
    try:
        if subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], capture_output=True).returncode != 0:
            pytest.skip("needs a read-only remount (root with CAP_SYS_ADMIN)")
        yield view
    finally:
        subprocess.run(["umount", str(view)], capture_output=True)


def test_a_node_that_sees_the_save_folder_read_only_stops_before_training(tmp_path):
    """Node 1 sees the shared folder through a read-only mount: without the check the job
    trains until its first save and fails there, leaving a partial checkpoint; with it both
    nodes stop at the start with one line naming the rank, and nothing is written."""
    plan, shared = _pp2_plan(tmp_path), tmp_path / "shared"
    shared.mkdir()
    with _read_only_view(shared, tmp_path / "read-only") as view:
        results = _one_process_nodes([[str(plan), "--steps", "1", "--save", str(folder)] for folder in (shared, view)])
    assert all(code != 0 for code, _ in results)
    said = [lines for _, lines in results]
    assert said[0] == said[1] and len(said[0]) == 1, said
    # the rendezvous may make node 1 rank 0, which then cannot leave its marker
    assert said[0][0] == (f"octorun: --save: cannot be written on rank 1 ({view}: Read-only file system) (give every node "
                          "write access to the folder: a read-write mount of the shared file system)") or re.fullmatch(
        rf"octorun: {re.escape(str(view))}: cannot write the checkpoint: Read-only file system \({re.escape(str(view))}/"
        r"\.octorun-marker-[0-9a-f]{16}\) \(give --save a folder this job can write, with room for a checkpoint\)", said[0][0]), said
    assert list(shared.iterdir()) == []
