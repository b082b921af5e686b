"""octorun.agreement: the processes of a job meet on a store before the process group forms, and
all go on or all stop, each node's log saying why once. Here threads stand in for processes,
each with its own client of one store, and name their nodes themselves."""

from __future__ import annotations

import dataclasses
import datetime
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

import runtime_helpers as h

from octoplan.errors import InputError
from octoplan.plan import save_plan
from octorun import agreement
from octorun.runtime import RunConfig

FAST = datetime.timedelta(seconds=20)


def _meet(verdicts: list[dict], *, timeout: datetime.timedelta = FAST, ended: list[float] | None = None) -> list[object]:
    """Each verdict (rank i's: error, parts, node, the world it was launched with if not the
    number of verdicts, and the seconds it comes late) meets the others; what each rank's
    agree() returned (None) or raised; ``ended`` gets the seconds at which each rank's call ended."""
    world = len(verdicts)
    host = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False, timeout=timeout)
    outcomes: list[object] = [None] * world
    ends = [0.0] * world
    started = time.monotonic()

    def one(rank: int) -> None:
        store = dist.TCPStore("127.0.0.1", host.port, world, is_master=False, timeout=timeout)
        verdict = verdicts[rank]
        time.sleep(verdict.get("late", 0.0))
        try:
            agreement.agree(dist.PrefixStore("test/", store), rank=rank, world=verdict.get("world", world),
                            error=verdict.get("error"),
                            parts=verdict.get("parts", {"plan": "p", "--steps": "4"}), plan_path=f"plan{rank}.yaml",
                            model_path="model.py", timeout=timeout, node=verdict["node"],
                            speaks_alone=verdict.get("alone", False))
        except Exception as exc:  # what the test checks
            outcomes[rank] = exc
        ends[rank] = time.monotonic() - started

    threads = [threading.Thread(target=one, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)
    if ended is not None:
        ended[:] = ends
    return outcomes


def _lines(outcomes: list[object]) -> list[str | None]:
    assert all(isinstance(o, agreement.JobStopped) for o in outcomes), outcomes
    return [o.line for o in outcomes]


def test_good_input_everywhere_goes_on():
    assert _meet([{"node": "node 0"}, {"node": "node 0"}, {"node": "node 1"}, {"node": "node 1"}]) == [None] * 4


def test_bad_input_on_one_process_stops_all_and_each_node_says_why_once():
    missing = InputError("plan.yaml", None, "no such plan file", "check the path")
    verdicts = [{"node": "node 0"}, {"node": "node 0"}, {"node": "node 1"}, {"node": "node 1", "error": missing, "parts": None}]
    lines = _lines(_meet(verdicts))
    # node 1: its own error, once (by rank 3 if it spoke first, else by rank 2 naming rank 3)
    assert sorted(line for line in lines[2:] if line) in (["plan.yaml: no such plan file (check the path)"],
                                                         ["rank 3: plan.yaml: no such plan file (check the path)"])
    assert sum(line is not None for line in lines[2:]) == 1
    # node 0: the node and process that stopped the job, once
    assert [line for line in lines[:2] if line] == ["rank 3 (node 1): plan.yaml: no such plan file (check the path)"]


def test_another_plan_or_option_than_rank_0s_is_bad_input_of_the_process_that_differs():
    verdicts = [{"node": "node 0"}, {"node": "node 1", "parts": {"plan": "p", "--steps": "5"}},
                {"node": "node 2", "parts": {"plan": "q", "--steps": "4"}}]
    lines = _lines(_meet(verdicts))
    assert lines[1] == ("--steps: is 5 on rank 1 (node 1) but 4 on rank 0 (node 0) "
                        "(launch every process with the same plan, model file and options)")
    assert lines[2] == "plan2.yaml: given to rank 2 (node 2) is another plan than rank 0's (node 0) (give every node the same plan file)"
    # rank 0's node repeats the first to have said it (either of the two), which names its rank
    # and node already
    assert lines[0] in lines[1:]


def test_a_launch_variable_of_one_process_is_said_by_that_process_alone():
    bad = InputError(None, "LOCAL_RANK", "is 7, outside 0..1", "launch with torchrun")
    verdicts = [{"node": "node 0"}, {"node": "node 0", "error": bad, "parts": None, "alone": True},
                {"node": "node 1"}]
    lines = _lines(_meet(verdicts))
    # its own node's log has it once, from itself; the other node's names it
    assert lines[:2] == [None, "LOCAL_RANK: is 7, outside 0..1 (launch with torchrun)"]
    assert lines[2] == "rank 1 (node 0): LOCAL_RANK: is 7, outside 0..1 (launch with torchrun)"


@pytest.mark.parametrize("worlds", [[2, 3], [3, 2]])
def test_a_process_launched_with_another_world_size_stops_the_processes_that_came_at_once(worlds):
    """Rank 1 thinks the job has 3 processes where rank 0 has 2, or the other way round (rank 0
    then waits for a third that never comes): both stop with rank 1's error, well before the
    deadline, rank 0's node naming it."""
    slow = datetime.timedelta(seconds=30)
    started = time.monotonic()
    lines = _lines(_meet([{"node": "node 0", "world": worlds[0]}, {"node": "node 1", "world": worlds[1]}], timeout=slow))
    assert time.monotonic() - started < 10
    line = (f"WORLD_SIZE: is {worlds[1]} on rank 1 (node 1) but {worlds[0]} on rank 0 (node 0) "
            "(launch every process with the same plan, model file and options)")
    assert lines == [line, line]


def test_a_process_that_rank_0_counts_and_that_comes_after_the_one_with_another_world_still_hears():
    """Rank 0 and rank 2 count 3 processes, rank 1 counts 2 and comes first; rank 2 comes a
    second later, within the grace rank 1 gives the others: all three hear rank 1's error, and
    rank 0 (whose process may host the store) waits until rank 2 has read it."""
    ended: list[float] = []
    lines = _lines(_meet([{"node": "node 0", "world": 3}, {"node": "node 1", "world": 2},
                          {"node": "node 2", "world": 3, "late": 1.0}], ended=ended))
    assert ended[0] >= 1.0, ended
    line = ("WORLD_SIZE: is 2 on rank 1 (node 1) but 3 on rank 0 (node 0) "
            "(launch every process with the same plan, model file and options)")
    assert lines == [line] * 3


def test_a_process_that_comes_after_the_meeting_ended_stops_too():
    """Past the grace, the process with another world ends the meeting for those that came; one
    that comes later is not waited for, and stops with the line it finds."""
    lines = _lines(_meet([{"node": "node 0", "world": 3}, {"node": "node 1", "world": 2},
                          {"node": "node 2", "world": 3, "late": 7.0}]))
    assert lines[0] == lines[1] == lines[2] and lines[0].startswith("WORLD_SIZE: is 2 on rank 1 (node 1)"), lines


def test_where_rank_0s_own_input_is_bad_a_process_with_another_world_is_not_blamed():
    """Rank 0 counts 3 processes against a plan of 2 (its own error says so); rank 1 counts the
    plan's 2: it is right, and its node prints rank 0's error, not a WORLD_SIZE line of its own."""
    wrong = InputError("plan.yaml", "cluster.gpus", "the plan needs 2 processes but WORLD_SIZE is 3", "launch 2")
    started = time.monotonic()
    lines = _lines(_meet([{"node": "node 0", "world": 3, "error": wrong, "parts": None}, {"node": "node 1", "world": 2}],
                         timeout=datetime.timedelta(seconds=30)))
    assert time.monotonic() - started < 10
    assert lines == ["plan.yaml: cluster.gpus: the plan needs 2 processes but WORLD_SIZE is 3 (launch 2)",
                     "rank 0 (node 0): plan.yaml: cluster.gpus: the plan needs 2 processes but WORLD_SIZE is 3 (launch 2)"]


def test_a_process_that_never_comes_ends_the_meeting_at_the_deadline():
    world = 2
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False, timeout=FAST)
    with pytest.raises(agreement.NotAllCame, match=r"^1 of 2 processes came$"):
        agreement.agree(dist.PrefixStore("alone/", store), rank=0, world=world, error=None, parts={"plan": "p"},
                        plan_path="plan.yaml", model_path="model.py", timeout=datetime.timedelta(seconds=1), node="node 0")


def test_identity_holds_the_plan_the_model_file_and_every_shared_option_but_no_path(tmp_path):
    model_path, config = h.model_spec("tiny", tmp_path)
    plan = h.baseline_plan("1f1b", model_path, config, tmp_path, gpus=2, pp=2, microbatches=2)
    base = RunConfig(plan_path="a/plan.yaml")
    parts = agreement.identity(base, plan, model_path, "gloo")
    assert set(parts) == {"plan", "model file", "--backend", *agreement.AGREED_OPTIONS.values(),
                          *agreement.GIVEN_OR_NOT.values()}
    # paths and deadlines are each node's own
    elsewhere = dataclasses.replace(base, plan_path="b/plan.yaml", metrics_path="m.jsonl", trace_path="t.json",
                                    timeout_s=60.0, init_timeout_s=900.0)
    assert agreement.identity(elsewhere, plan, model_path, "gloo") == parts
    # each option that must agree is told apart, alone
    changed = {"steps": 2, "seed": 1, "optimizer": "adamw", "lr": 0.5, "weight_decay": 0.1, "betas": (0.8, 0.9),
               "grad_clip": 1.0, "lr_schedule": "cosine", "warmup_steps": 1, "min_lr": 1e-5, "decay_steps": 3,
               "skip_nonfinite": True, "precision": "bf16", "replay_time_scale": 1.0, "dynamic_shapes": True,
               "activation_memory": True, "save_every": 1, "keep": 3,
               "eval_every": 2, "save_dir": "ckpt", "data_path": "tokens.bin", "resume": "auto",
               "init_from": "ckpt/step_00000001", "eval_data_path": "held_out.bin"}
    assert set(changed) == set(agreement.AGREED_OPTIONS) | set(agreement.GIVEN_OR_NOT)
    for name, value in changed.items():
        other = agreement.identity(dataclasses.replace(base, **{name: value}), plan, model_path, "gloo")
        flag = {**agreement.AGREED_OPTIONS, **agreement.GIVEN_OR_NOT}[name]
        assert [key for key in parts if parts[key] != other[key]] == [flag], name
        error = agreement.mismatch(other, parts, "node 0", rank=1, node="node 1", plan_path="p.yaml", model_path="m.py")
        assert error is not None and error.field == flag
    assert agreement.identity(base, plan, model_path, "nccl")["--backend"] == "nccl"
    assert agreement.identity(dataclasses.replace(base, keep=2), plan, model_path, "gloo") == parts  # the default
    # a token file: its fingerprint and sampled digest (octorun.data.TokenData), where its path
    # alone was compared

    class Tokens:
        def __init__(self, text, sampled="abc"):
            self.text, self.sampled = text, sampled

        def fingerprint(self):
            return self.text

        def sampled_digest(self):
            return self.sampled

    given = dataclasses.replace(base, data_path="tokens.bin")
    one, other, inside = (agreement.identity(given, plan, model_path, "gloo", tokens) for tokens in
                          (Tokens("1000 tokens"), Tokens("999 tokens"), Tokens("1000 tokens", "abd")))
    assert one["--data"] == "1000 tokens, sampled abc" and [key for key in one if one[key] != other[key]] == ["--data"]
    assert [key for key in one if one[key] != inside[key]] == ["--data"]
    # a held-out file likewise, with the global batches an evaluation reads as they act (every
    # process must pass the same messages): not given and given as the default are one run

    class Held:
        def __init__(self, tokens, batches):
            self.data, self.batches = tokens, batches

    judged = dataclasses.replace(base, eval_data_path="held_out.bin")
    held = agreement.identity(judged, plan, model_path, "gloo", None, Held(Tokens("50 tokens"), 3))
    assert held["--eval-data"] == "50 tokens, sampled abc" and held["--eval-batches"] == "3"
    for changed_held in (Held(Tokens("51 tokens"), 3), Held(Tokens("50 tokens"), 2)):
        differs = agreement.identity(judged, plan, model_path, "gloo", None, changed_held)
        assert len([key for key in held if held[key] != differs[key]]) == 1
    other_plan = dataclasses.replace(plan, schedule=plan.schedule[::-1])
    assert [k for k, v in agreement.identity(base, other_plan, model_path, "gloo").items() if parts[k] != v] == ["plan"]
    Path(model_path).write_text(Path(model_path).read_text() + "\n# edited on one node\n")
    assert [k for k, v in agreement.identity(base, plan, model_path, "gloo").items() if parts[k] != v] == ["model file"]


@pytest.mark.slow  # a fresh interpreter, and the seconds it gives peers to come
def test_a_lone_process_of_a_manual_launch_reports_its_bad_input_whatever_its_rank(tmp_path):
    """Rank 1 of 2, started by hand with no rank 0 and a plan path that does not exist: nobody
    hears of its error, so it says it itself (no node's first process is there to)."""
    env = {k: v for k, v in os.environ.items() if k not in ("GROUP_RANK", "TORCHELASTIC_USE_AGENT_STORE")}
    env.update(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(h.free_port()),
               OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "octorun", str(tmp_path / "nope.yaml")], capture_output=True, text=True,
                          cwd=h.ROOT, env=env, timeout=120)
    assert (done.returncode, done.stderr) == (2, f"octorun: {tmp_path / 'nope.yaml'}: no such plan file (check the path)\n")


# c10d's TCPStore client logs each failed try to reach the store's host to fd 2 (two lines and
# a C++ stack) before it tries again; here the store is made to log so, then connect
_MEET_AFTER_RETRIES = """
import os
import torch.distributed as dist
from octorun import runtime
real = dist.TCPStore
def store_after_retries(*args, **kwargs):
    os.write(2, b"[W c10d] TCP client failed to connect/validate to host - retrying\\n")
    return real(*args, **kwargs)
dist.TCPStore = store_after_retries
place = runtime._meeting_place(True, None, 20.0)
print("met", place.rank, place.world, flush=True)
"""


def test_a_process_that_reached_the_store_after_retries_says_nothing_of_them():
    """Once the store is reached, c10d's failed tries before it mean nothing: none of them
    reaches stderr (a process that started before rank 0 was up printed ~20 lines of them)."""
    env = {k: v for k, v in os.environ.items() if k not in ("GROUP_RANK", "TORCHELASTIC_USE_AGENT_STORE")}
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(h.free_port()),
               OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", _MEET_AFTER_RETRIES], cwd=h.ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (0, "met 0 2\n", ""), done.stderr[-3000:]


@pytest.mark.slow  # two fresh interpreters
@pytest.mark.parametrize("worlds", [("2", "3"), ("3", "2"), ("2", "1")])
def test_a_manual_launch_whose_ranks_count_other_worlds_stops_both_at_once(tmp_path, worlds):
    """One rank started with another WORLD_SIZE than the other's, for a plan of 2 (rank 1 with
    WORLD_SIZE 1 is past its own world, yet rank 0 counts it): rank 0 hosts the store and stays
    until rank 1 has read the verdict; both stop with exit 2 within seconds (rank 0 counting 3
    waits for a third for 5 s), and their host's log has the wrong rank's error once."""
    plan = h.baseline_plan("1f1b", *h.model_spec("tiny", tmp_path), tmp_path, gpus=2, pp=2, microbatches=2)
    save_plan(plan, tmp_path / "plan.yaml")
    env = {k: v for k, v in os.environ.items() if k not in ("GROUP_RANK", "TORCHELASTIC_USE_AGENT_STORE")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(h.free_port()), OMP_NUM_THREADS="1")
    started = time.monotonic()
    ranks = [subprocess.Popen([sys.executable, "-m", "octorun", str(tmp_path / "plan.yaml"), "--init-timeout", "60"],
                              cwd=h.ROOT, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": world},
                              stderr=subprocess.PIPE, text=True)
             for rank, world in enumerate(worlds)]
    said = [process.communicate(timeout=120)[1] for process in ranks]
    assert [process.returncode for process in ranks] == [2, 2] and time.monotonic() - started < 45, said
    wrong = 1 - worlds.index("2")
    line = (f"{tmp_path / 'plan.yaml'}: cluster.gpus: the plan needs 2 processes (pp 2 x dp 1) but WORLD_SIZE is "
            f"{worlds[wrong]} (launch with torchrun --nproc-per-node 2)")
    assert sorted(said) in (["", f"octorun: rank {wrong}: {line}\n"], ["", f"octorun: {line}\n"]), said
