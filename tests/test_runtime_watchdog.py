"""Failures end every octorun process quickly, with one line that names the op and the rank;
bad input exits 2 with one line and no traceback."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

import runtime_helpers as h
from octoplan.errors import InputError
from octoplan.plan import save_plan
from octorun.runtime import RunConfig, prepare, run

ROOT = Path(__file__).resolve().parent.parent


def _two_rank_plan(folder: Path, name: str = "plan", schedule=("0F0 0F1 0F2 0B0 0B1 0B2", "1F0 1B0 1F1 1B1 1F2 1B2")) -> Path:
    model_path, config = h.model_spec("tiny", folder)
    plan = h.make_plan(model_path, config, stages=h.even_stages(6, [0, 1]), schedule=list(schedule), microbatches=3)
    path = folder / f"{name}.yaml"
    save_plan(plan, path)
    return path


def _octorun(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    clean.update(env or {})
    return subprocess.run([sys.executable, "-m", "octorun", *args], capture_output=True, text=True, cwd=ROOT, env=clean, timeout=120)


def test_world_size_mismatch_exits_2_with_one_line(tmp_path):
    plan = _two_rank_plan(tmp_path)
    done = _octorun(str(plan))  # no torchrun: a world of one process
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"octorun: {plan}: cluster.gpus: the plan needs 2 processes (pp 2 x dp 1) but WORLD_SIZE is 1 "
        "(launch with torchrun --nproc-per-node 2)"
    ]


def test_peers_that_never_come_end_in_one_line_without_c10d_stacks(tmp_path):
    # rank 1 alone: c10d's C++ side logs two lines and a stack per attempt to reach rank 0's
    # store; octorun's own line says the same, so only it is left
    plan = _two_rank_plan(tmp_path)
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(h.free_port())}
    done = _octorun(str(plan), "--init-timeout", "1", env=env)
    assert done.returncode == 1
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr[:2000]
    assert re.fullmatch(r"octorun: rank 1: the 2 processes did not form a group within --init-timeout 1 s: DistNetworkError: "
                        r".*127\.0\.0\.1, \d+\)\.", done.stderr.strip()), done.stderr


@pytest.mark.parametrize("fails, replay", [(False, True), (True, True), (False, False)])
def test_native_stderr_is_dropped_when_the_step_fails_or_the_caller_says(fails, replay):
    # what code writes to fd 2 under the guard: written out as it was after a step that ends
    # well (after what was written before), dropped with a step that raises, or always when the
    # caller says it can only be noise
    script = (
        "import os, sys\n"
        "from octorun.native_stderr import native_stderr_held\n"
        "os.write(2, b'before\\n')\n"
        "try:\n"
        f"    with native_stderr_held(replay={replay}):\n"
        "        os.write(2, b'native\\n' * 20000)\n"
        f"        if {fails}: raise RuntimeError('x')\n"
        "except RuntimeError:\n"
        "    pass\n"
        "os.write(2, b'after\\n')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr[-500:]
    middle = ["native"] * 20000 if replay and not fails else []
    assert done.stderr.decode().splitlines() == ["before", *middle, "after"]


def test_an_interrupt_while_the_hold_unwinds_leaves_the_real_stderr_in_place():
    """c10d's retries end in an error, and a Ctrl-C that came during them is raised at the first
    Python line after: in the hold's own flush. The real stderr is put back all the same, and
    restore_stderr (which octorun's Ctrl-C handler calls) puts it back from inside a hold."""
    script = (
        "import os, sys\n"
        "from octorun.native_stderr import native_stderr_held, restore_stderr\n"
        "class Interrupting:\n"
        "    def __init__(self, stream): self.stream = stream\n"
        "    def flush(self): sys.stderr = self.stream; raise KeyboardInterrupt\n"
        "    def __getattr__(self, name): return getattr(self.stream, name)\n"
        "try:\n"
        "    with native_stderr_held(replay=False):\n"
        "        sys.stderr = Interrupting(sys.stderr)\n"
        "        raise RuntimeError('the connection failed')\n"
        "except KeyboardInterrupt:\n"
        "    os.write(2, b'interrupted\\n')\n"
        "with native_stderr_held(replay=False):\n"
        "    restore_stderr()\n"
        "    os.write(2, b'said at once\\n')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr[-500:]
    assert done.stderr.decode().splitlines() == ["interrupted", "said at once"]


def test_bad_plan_file_exits_2_with_one_line(tmp_path):
    missing = _octorun(str(tmp_path / "missing.yaml"))
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [f"octorun: {tmp_path / 'missing.yaml'}: no such plan file (check the path)"]
    bad_flag = _octorun(str(tmp_path / "missing.yaml"), "--optimizer", "lamb")
    assert bad_flag.returncode == 2 and len(bad_flag.stderr.strip().splitlines()) == 1 and "lamb" in bad_flag.stderr


def test_schedule_that_cannot_run_is_bad_input_naming_the_ops(tmp_path):
    plan = _two_rank_plan(tmp_path, schedule=("0F0 0B0 0F1 0B1 0F2 0B2", "1F0 1F1 1B0 1B1 1F2 1B2"))
    with pytest.raises(InputError) as info:
        prepare(RunConfig(plan_path=str(plan)))
    assert info.value.field == "schedule"
    assert "deadlock: rank 0 waits at 0B0 for 1B0 (rank 1); rank 1 waits at 1F1 for 0F1 (rank 0)" in info.value.line()


def test_world_size_is_checked_before_any_process_group(tmp_path, monkeypatch):
    plan = _two_rank_plan(tmp_path)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(InputError, match="the plan needs 2 processes .* but WORLD_SIZE is 4"):
        run(RunConfig(plan_path=str(plan)))


def test_plan_with_wrong_layer_count_is_bad_input(tmp_path):
    model_path, config = h.model_spec("tiny", tmp_path)
    plan = h.make_plan(model_path, config, stages=[(0, 3, 0), (3, 5, 1)], schedule=["0F0 0B0", "1F0 1B0"], microbatches=1)
    save_plan(plan, tmp_path / "short.yaml")
    with pytest.raises(InputError, match="stages: cover 5 layers but .* has 6"):
        prepare(RunConfig(plan_path=str(tmp_path / "short.yaml")))


@pytest.mark.parametrize("old, new, line", [
    ("return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))",
     "return nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction='none')",
     "op 0F0 of step 0: {model}: loss_fn: returned (2, 5), not a scalar tensor (reduce the loss with .mean())"),
    ("    return ids, targets\n", "    return ids\n",
     "while sampling the batches of step 0: {model}: sample_batch: must return (inputs, targets) (return a 2-tuple)"),
])
def test_a_model_file_found_wrong_while_training_exits_2_with_one_line(tmp_path, old, new, line):
    """The model file's fault, seen only once the job runs (a loss that is not a scalar, a
    batch that is not a pair), is still bad input: exit 2, one line naming the file, the field
    and the fix, and nothing left behind: no activity record, no metrics file begun."""
    model_path, config = h.model_spec("tiny", tmp_path)
    source = model_path.read_text()
    assert old in source
    model_path.write_text(source.replace(old, new))
    plan = h.make_plan(model_path, config, stages=[(0, 6, 0)], schedule=["0F0 0B0"], microbatches=1)
    save_plan(plan, tmp_path / "one.yaml")
    before = sorted(path.name for path in tmp_path.iterdir())
    done = _octorun(str(tmp_path / "one.yaml"), "--metrics", str(tmp_path / "m.jsonl"))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [f"octorun: rank 0: {line.format(model=model_path)}"]
    assert sorted(path.name for path in tmp_path.iterdir()) == before


def test_counts_beyond_any_run_and_a_replay_without_a_profile_are_bad_input(tmp_path):
    plan = _two_rank_plan(tmp_path)
    with pytest.raises(InputError, match=r"--steps: is 100000000000000000000 \(train 1 to 10000000 steps\)"):
        prepare(RunConfig(plan_path=str(plan), steps=10**20))
    data = yaml.safe_load(plan.read_text())
    data["microbatch_size"] = 10**12
    plan.write_text(yaml.safe_dump(data))
    with pytest.raises(InputError, match="microbatch_size: is 1000000000000"):
        prepare(RunConfig(plan_path=str(plan)))
    data["microbatch_size"] = 2
    plan.write_text(yaml.safe_dump(data))
    with pytest.raises(InputError, match=r"profile: is missing \(--replay needs the plan's profile\)"):
        prepare(RunConfig(plan_path=str(plan), replay_time_scale=1.0))


def test_a_run_that_fails_leaves_an_old_metrics_file_as_it_was(tmp_path):
    model_path, config = h.model_spec("tiny", tmp_path)
    source = model_path.read_text().replace("def loss_fn(logits, targets):\n",
                                            "_CALLS = []\n\ndef loss_fn(logits, targets):\n"
                                            "    _CALLS.append(1)\n"
                                            "    if len(_CALLS) == 2:\n"
                                            "        raise RuntimeError('the second step breaks')\n")
    model_path.write_text(source)
    plan = h.make_plan(model_path, config, stages=[(0, 6, 0)], schedule=["0F0 0B0"], microbatches=1)
    save_plan(plan, tmp_path / "one.yaml")
    metrics = tmp_path / "m.jsonl"
    metrics.write_text("OLD\n")
    done = _octorun(str(tmp_path / "one.yaml"), "--steps", "3", "--metrics", str(metrics))
    assert done.returncode == 1 and "the second step breaks" in done.stderr, done.stderr
    assert metrics.read_text() == "OLD\n"
    assert [json.loads(line)["step"] for line in (tmp_path / "m.jsonl.partial").read_text().splitlines()] == [0]
    done = _octorun(str(tmp_path / "one.yaml"), "--steps", "1", "--metrics", str(metrics))  # _CALLS starts anew
    assert done.returncode == 0, done.stderr
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [0]
    assert not (tmp_path / "m.jsonl.partial").exists()


def test_metrics_and_trace_overwrite_no_input_and_not_each_other(tmp_path):
    plan = _two_rank_plan(tmp_path)
    model = tmp_path / "tiny_model.py"
    source = model.read_text()
    for flag, target in (("metrics_path", model), ("trace_path", plan)):
        with pytest.raises(InputError, match=f"names the input file {target}"):
            prepare(RunConfig(plan_path=str(plan), **{flag: str(target)}))
    # the token file and its Megatron index are inputs too
    tokens, index = tmp_path / "corpus.bin", tmp_path / "corpus.idx"
    for target in (tokens, index):
        target.write_bytes(b"\x01\x00" * 64)
        with pytest.raises(InputError, match=f"names the input file {target}"):
            prepare(RunConfig(plan_path=str(plan), data_path=str(tokens), metrics_path=str(target)))
        assert target.read_bytes() == b"\x01\x00" * 64
    # an index not there yet: a metrics file written as corpus.idx would be read as one next time
    index.unlink()
    with pytest.raises(InputError, match=f"--metrics names {index}, where this command looks for an input"):
        prepare(RunConfig(plan_path=str(plan), data_path=str(tokens), metrics_path=str(index)))
    assert not index.exists()
    with pytest.raises(InputError, match="--trace names the file --metrics names too"):
        prepare(RunConfig(plan_path=str(plan), metrics_path=str(tmp_path / "m"), trace_path=str(tmp_path / "m")))
    # the file --metrics grows in until the run ends (METRICS.partial) is an output as well
    with pytest.raises(InputError, match=r"--trace names the file --metrics \(while it is written\) names too"):
        prepare(RunConfig(plan_path=str(plan), metrics_path=str(tmp_path / "m"), trace_path=str(tmp_path / "m.partial")))
    odd = tmp_path / "m2.partial"  # a plan so named, with --metrics m2
    odd.write_text(plan.read_text())
    with pytest.raises(InputError, match=f"--metrics \\(while it is written\\) names the input file {odd}"):
        prepare(RunConfig(plan_path=str(odd), metrics_path=str(tmp_path / "m2")))
    assert model.read_text() == source


def _launch_fault(tmp_path: Path, fault: dict, *, timeout_s: float = 5.0, rank_timeouts: dict[int, float] | None = None) -> h.Launch:
    plan = _two_rank_plan(tmp_path)
    # one deadline from the start: the faults strike in step 0, under the first step's deadline
    job = h.Job("faulty", RunConfig(plan_path=str(plan), steps=2, timeout_s=timeout_s, init_timeout_s=timeout_s), fault=fault,
                rank_overrides={rank: {"timeout_s": seconds, "init_timeout_s": seconds}
                                for rank, seconds in (rank_timeouts or {}).items()})
    return h.launch(2, [job], tmp_path / "out", timeout_s=60)


def test_process_that_dies_ends_the_others_with_a_message(tmp_path):
    launched = _launch_fault(tmp_path, {"rank": 1, "kind": "die", "op": "1B1"}, timeout_s=20)
    assert launched.exitcodes[1] == 17  # the process that vanished
    assert launched.exitcodes[0] == 1, launched.logs
    line = launched.logs[0].strip().splitlines()[-1]
    # rank 0 waits for a gradient of rank 1 (1B0's may die unsent with its process) when it
    # vanishes, or for a send to it that the closed connection failed: either way a failure
    # that names the peer, not a timeout
    assert re.fullmatch(
        r"octorun: rank 0: op 0B([01]) of step 0 cannot receive the gradient out of stage 0 mb \1 from rank 1 to rank 0 "
        r"\(global rank 1\): RuntimeError: (Read error \S+: Connection reset by peer|Connection closed by peer \S+)"
        r"(; global rank 1 \(pid \d+\) is gone)?", line
    ) or re.fullmatch(
        r"octorun: rank 0: step 0: the send of the activation into stage 1 mb [12] from rank 0 to rank 1 failed: "
        r"RuntimeError: .+ \(global rank 1\)(; global rank 1 \(pid \d+\) is gone)?", line
    ), line
    assert launched.seconds < 20  # the closed connection is noticed long before the deadline


def test_op_that_raises_stops_every_rank(tmp_path):
    launched = _launch_fault(tmp_path, {"rank": 0, "kind": "raise", "op": "0F1"}, timeout_s=20)
    assert launched.exitcodes == [1, 1]
    assert "octorun: rank 0: op 0F1 of step 0 raised RuntimeError: injected failure" in launched.logs[0]
    assert "octorun: rank 1: stopping because rank 0 failed: op 0F1 of step 0 raised RuntimeError: injected failure" in launched.logs[1]


def test_missing_message_times_out_naming_the_op_and_the_peer(tmp_path):
    # rank 0 never sends the last activation: rank 1 waits past the deadline at 1F2. Rank 0 then
    # waits at 0B2 for 1B2's gradient, starting a moment later; on a loaded machine its own
    # deadline could still pass first, so it gets a longer one: rank 1's must be the one that ends the run
    began = time.monotonic()
    launched = _launch_fault(tmp_path, {"rank": 0, "kind": "drop-send", "message": ("act", 1, 2)}, timeout_s=3,
                             rank_timeouts={0: 20})
    assert launched.exitcodes == [1, 1], launched.logs
    assert (
        "octorun: rank 1: op 1F2 of step 0 waited 3 s for the activation into stage 1 mb 2 from rank 0 to rank 1 (global rank 0)"
        in launched.logs[1]
    )
    assert "stopping because rank 1 failed" in launched.logs[0]
    assert time.monotonic() - began < 30


def test_a_rank_stuck_in_its_own_op_is_named_by_the_rank_waiting_for_it(tmp_path):
    """Rank 0 never finishes op 0F1, alive (its heartbeat goes on): rank 1, past its deadline
    waiting for 0F1's activation, names rank 0 and the op it is stuck in, not just the wait."""
    launched = _launch_fault(tmp_path, {"rank": 0, "kind": "stuck-op", "op": "0F1"}, timeout_s=3, rank_timeouts={0: 60})
    assert launched.exitcodes == [1, 1], launched.logs
    line = next(line for line in launched.logs[1].splitlines() if line.startswith("octorun: rank 1: "))
    assert line.startswith("octorun: rank 1: op 1F1 of step 0 waited 3 s for the activation into stage 1 mb 1"), line
    assert line.endswith("; global rank 0 was running op 0F1 of step 0 all the while, waiting on no peer (stuck in its own "
                         "work)"), line
    assert "stopping because rank 1 failed" in launched.logs[0]


def test_out_of_order_message_is_a_protocol_error_not_wrong_data(tmp_path):
    # rank 0 skips the activation of mb 0: rank 1 receives mb 1's where it expects mb 0's
    launched = _launch_fault(tmp_path, {"rank": 0, "kind": "drop-send", "message": ("act", 1, 0)}, timeout_s=10)
    assert launched.exitcodes == [1, 1], launched.logs
    assert (
        "octorun: rank 1: op 1F0 of step 0 cannot receive the activation into stage 1 mb 0 from rank 0 to rank 1 (global rank 0): "
        "RuntimeError: protocol error: expected the activation into stage 1 mb 0 from rank 0 to rank 1, received act 1.1 instead"
    ) in launched.logs[1]


def test_a_shape_that_changes_after_step_0_fails_naming_the_message(tmp_path):
    # static shapes (the default) send no layout after step 0: a message whose shape changed must
    # stop the run with a pointer to --dynamic-shapes, never be received into the wrong size
    model_path, config = h.model_spec("tiny-vary", tmp_path)
    plan = h.make_plan(model_path, config, stages=h.even_stages(6, [0, 1]), schedule=["0F0 0F1 0F2 0B0 0B1 0B2", "1F0 1B0 1F1 1B1 1F2 1B2"],
                       microbatches=3)
    save_plan(plan, tmp_path / "vary.yaml")
    job = h.Job("vary", RunConfig(plan_path=str(tmp_path / "vary.yaml"), steps=3, timeout_s=20))
    launched = h.launch(2, [job], tmp_path / "out", timeout_s=60)
    assert launched.exitcodes == [1, 1], launched.logs
    line = next(line for line in launched.logs[0].splitlines() if line.startswith("octorun: rank 0:"))
    assert re.fullmatch(
        r"octorun: rank 0: op 0F(\d) of step (1|2): the activation into stage 1 mb \1 from rank 0 to rank 1 of step \2 has tensors "
        r"float32\[2, (\d), 8\], int64\[2, \3\], in step 0 float32\[2, (?!\3)(\d), 8\], int64\[2, \4\]; "
        r"run octorun with --dynamic-shapes for a model whose shapes change between steps", line), line
    assert "stopping because rank 0 failed" in launched.logs[1]


def test_a_lost_store_names_its_host(monkeypatch):
    """The store is where peers are looked up, so when it is gone no dead peer can be named:
    the line says where it lived (MASTER_ADDR: the first node's launcher, or rank 0)."""
    import threading

    from octorun.watchdog import Watchdog

    class GoneStore:
        def __getattr__(self, name):  # add, check, get: every call fails as a closed connection does
            def gone(*args):
                raise RuntimeError("Connection closed by peer")
            return gone

    said, done = [], threading.Event()
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    monkeypatch.setattr(Watchdog, "_exit", lambda self, problem, code=1: (said.append(problem), done.set()))
    watchdog = Watchdog(global_rank=2, timeout_s=5, store=GoneStore())
    watchdog.doing("running op 1F0")
    watchdog.start()
    assert done.wait(10)
    watchdog.stop()
    assert said[0] == ("lost contact with the job's rendezvous store (RuntimeError) while running op 1F0: its host "
                       "(10.1.2.3, the first node's launcher or rank 0) is gone or unreachable")


class _Store:
    """The job's rendezvous store, as far as failing reads and writes it."""

    def __init__(self):
        self.values: dict[str, bytes] = {}

    def check(self, keys):
        return all(key in self.values for key in keys)

    def get(self, key):
        return self.values[key]

    def set(self, key, value):
        self.values[key] = value.encode()

    def add(self, key, amount):
        self.values[key] = str(int(self.values.get(key, b"0")) + amount).encode()
        return int(self.values[key])


def test_a_rank_that_finds_bad_input_after_a_peer_spoke_still_exits_2(monkeypatch):
    """A save that cannot be written is bad input on every rank: the rank whose failure reached
    the store second said so under the first one's words, and exited 1 (torchrun then named
    that rank's 1 as the job's cause)."""
    from octorun.watchdog import ABORT_KEY, EXIT_BAD_INPUT, Watchdog

    exits = []

    def leave(problem, *, code=1, quiet=False):
        exits.append((problem, code))
        raise SystemExit(code)

    dog = Watchdog(global_rank=1, timeout_s=5.0, store=_Store(), world=2)
    dog.store.set(dog.key(ABORT_KEY), "rank 0 failed: ck: --save cannot be written: File too large")
    monkeypatch.setattr(dog, "_exit", leave)
    with pytest.raises(SystemExit):
        dog.fail("ck: --save cannot be written: File too large", code=EXIT_BAD_INPUT)
    assert exits == [("stopping because rank 0 failed: ck: --save cannot be written: File too large; this rank then "
                      "saw: ck: --save cannot be written: File too large", EXIT_BAD_INPUT)]


def test_peers_of_a_rank_that_found_bad_input_exit_2_with_it(monkeypatch):
    """A rank that finds bad input once the job runs (a model folder's missing tensor, as it
    builds its stage) exits 2, and its status goes to the store before its words: the peers
    that hear of it exit 2 too (they exited 1, and torchrun named their 1 as the job's cause).
    A failure's peers exit 1, and a record without a status (an older peer's) reads as one."""
    from octorun.watchdog import ABORT_CODE_KEY, EXIT_BAD_INPUT, EXIT_FAILURE, Watchdog

    store = _Store()
    failing, peer = (Watchdog(global_rank=rank, timeout_s=5.0, store=store, world=2) for rank in (2, 0))
    monkeypatch.setattr(failing, "_exit", lambda problem, *, code=1, quiet=False: (_ for _ in ()).throw(SystemExit(code)))
    assert peer.abort_seen() is None
    with pytest.raises(SystemExit):
        failing.fail("hf:llama: model.layers.2.mlp.up_proj.weight: missing", code=EXIT_BAD_INPUT)
    assert peer.abort_seen() == ("rank 2 failed: hf:llama: model.layers.2.mlp.up_proj.weight: missing", EXIT_BAD_INPUT)
    store.values = {}
    crashing = Watchdog(global_rank=1, timeout_s=5.0, store=store, world=2)
    monkeypatch.setattr(crashing, "_exit", lambda problem, *, code=1, quiet=False: (_ for _ in ()).throw(SystemExit(code)))
    monkeypatch.setattr(crashing, "_diagnosis", lambda problem, *, waited: "")
    with pytest.raises(SystemExit):
        crashing.fail("op 1F0 of step 0 raised RuntimeError: boom")
    assert peer.abort_seen()[1] == EXIT_FAILURE
    del store.values[peer.key(ABORT_CODE_KEY)]
    assert peer.abort_seen()[1] == EXIT_FAILURE


def test_bad_input_found_after_the_launch_is_said_once_a_node(monkeypatch):
    """Ranks 0 and 1 on node 0, ranks 2 and 3 on node 1 (torchrun's GROUP_RANK); rank 1 finds
    bad input as the job runs. It says so; of its peers, which hear of it through their
    watchdogs, only the first on the other node says why it stops, and every one exits 2 (the
    record keeps each rank's words). A failure's peers each say what they were doing, as a
    hang or a crash is traced."""
    from octorun.watchdog import EXIT_BAD_INPUT, EXIT_FAILURE, Watchdog

    class Store(_Store):  # the watchdogs' threads share it
        lock = threading.Lock()

        def add(self, key, amount):
            with self.lock:
                return super().add(key, amount)

    for code in (EXIT_BAD_INPUT, EXIT_FAILURE):
        store, exits, left = Store(), {}, threading.Semaphore(0)
        dogs = {}
        for rank in range(4):
            monkeypatch.setenv("GROUP_RANK", str(rank // 2))
            dogs[rank] = Watchdog(global_rank=rank, timeout_s=5.0, store=store, world=4)

            def leave(problem, *, code=1, quiet=False, rank=rank):
                exits[rank] = (code, quiet)
                left.release()
                if threading.current_thread() is threading.main_thread():
                    raise SystemExit(code)
            monkeypatch.setattr(dogs[rank], "_exit", leave)
        monkeypatch.setattr(dogs[1], "_diagnosis", lambda problem, *, waited: "")
        with pytest.raises(SystemExit):
            dogs[1].fail("hf:llama: model.layers.2.mlp.up_proj.weight: missing", code=code)
        for rank in (0, 2, 3):
            dogs[rank].start()
        for _ in range(4):
            assert left.acquire(timeout=10)
        for dog in dogs.values():
            dog.stop()
        assert {rank: seen for rank, (seen, _) in exits.items()} == dict.fromkeys(range(4), code)
        said = sorted(rank for rank, (_, quiet) in exits.items() if not quiet)
        if code == EXIT_BAD_INPUT:
            assert said in ([1, 2], [1, 3]), exits
        else:
            assert said == [0, 1, 2, 3]


def test_a_send_that_gloo_timed_out_names_the_peers_that_stopped(monkeypatch):
    """gloo's own deadline on a send to a stopped peer (SIGSTOP during an evaluation, whose sends
    are the first to wait on it) is a wait that failed: the line names the peers whose
    heartbeat stood still, as a receive that waited too long does. A send to a peer whose
    connection closed is no wait: its peer's death is found otherwise."""
    from octorun import runtime
    from octorun.comm import SendFailed
    from octorun.lowering import Message

    failed = []

    class Dog:
        timeout_s = 15.0

        def fail(self, problem, *, code=1, waited=False):
            failed.append((problem, waited))
            raise SystemExit(code)

    stub = type("Stub", (), {"watchdog": Dog(), "_global": staticmethod(lambda rank: rank)})()
    message = Message("act", 3, 0, 1, 2)
    for problem, waited in (("RuntimeError: Timed out waiting 14999ms for send operation to complete", True),
                            ("RuntimeError: Connection closed by peer", False)):
        def wait(*, deadline, problem=problem):
            raise SendFailed(message, problem)
        with pytest.raises(SystemExit):
            runtime._Interpreter._check_sends(stub, "evaluation batch 4 after step 3", wait, 0.0)
        assert failed[-1] == (f"evaluation batch 4 after step 3: the send of the {message} failed: {problem} "
                              f"(global rank 2)", waited)


def test_two_replicas_that_find_the_same_bad_input_at_once_say_it_once(monkeypatch):
    """Both last-stage replicas of one node find the same bad loss at the same moment: each
    looks for an abort before either has written one. The one that claims the node speaks;
    the other exits 2 in silence."""
    from octorun.watchdog import ABORT_KEY, EXIT_BAD_INPUT, Watchdog

    class Simultaneous(_Store):  # neither sees the other's abort yet
        def check(self, keys):
            return False if keys == [dog.key(ABORT_KEY)] else super().check(keys)

    store, exits = Simultaneous(), {}
    monkeypatch.setenv("GROUP_RANK", "0")
    dogs = {rank: Watchdog(global_rank=rank, timeout_s=5.0, store=store, world=4) for rank in (1, 3)}
    dog = dogs[1]
    for rank, each in dogs.items():
        def leave(problem, *, code=1, quiet=False, rank=rank):
            exits[rank] = (code, quiet)
            raise SystemExit(code)
        monkeypatch.setattr(each, "_exit", leave)
    for rank in (1, 3):
        with pytest.raises(SystemExit):
            dogs[rank].fail("model.py: loss_fn: returned (2, 5), not a scalar tensor", code=EXIT_BAD_INPUT)
    assert exits == {1: (EXIT_BAD_INPUT, False), 3: (EXIT_BAD_INPUT, True)}
