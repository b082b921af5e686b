"""octorun.checkpoint: a checkpoint keyed by global layer index loads under any other split of
the layers and any world size, bit for bit; replicas are written once; a save is atomic; every
bad input is one InputError, raised on every rank alike, before anything in memory changes.

Multi-process cases fork 2-3 gloo processes (the parent never forms a process group); the
others run the module in one process, as it supports without torch.distributed."""

from __future__ import annotations

import datetime
import errno
import json
import zlib
import re
import multiprocessing
import os
import pickle
import random
import shutil
import sys
import time
import traceback
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import runtime_helpers as h
from octoplan.errors import InputError
from octorun import checkpoint

# -- the state of a tiny model, by global layer index ---------------------------------------------


def layer_state(i: int) -> dict[str, Any]:
    """Layer ``i``'s share of a checkpoint: distinct values per layer, tensors and objects."""
    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4) + 100 * i
    return {
        f"model/layers.{i}.weight": weight,
        f"model/layers.{i}.bias": torch.full((4,), i + 0.25, dtype=torch.float64),
        f"optim/layers.{i}.weight/exp_avg": weight / 3,
        f"optim/layers.{i}.weight/step": torch.tensor(float(i + 7)),
        f"extra/layers.{i}": {"index": i, "name": f"layer{i}", "blob": bytes(range(i, i + 5)), "ratio": i / 7},
    }


def rank_state(rank: int) -> dict[str, Any]:
    """What a rank keeps of its own: RNG states, a tensor and an object."""
    return {f"rng/rank{rank}/cpu": torch.Generator().manual_seed(rank).get_state(),
            f"rng/rank{rank}/python": random.Random(rank).getstate()}


TIED = {"model/tied.embed": torch.linspace(-1, 1, 10), "counters": {"consumed_samples": 640, "skipped": 1}}


def expected(layers, rank: int | None = None, *, tied: bool = False) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for i in layers:
        state.update(layer_state(i))
    if rank is not None:
        state.update(rank_state(rank))
    if tied:
        state.update(TIED)
    return state


def blank(state: dict[str, Any]) -> dict[str, Any]:
    """The same keys, tensors zeroed (same shapes and dtypes), objects None."""
    return {key: torch.zeros_like(value) if isinstance(value, torch.Tensor) else None for key, value in state.items()}


def assert_identical(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
        else:
            assert type(got[key]) is type(value) and got[key] == value, key


# -- launching gloo processes ----------------------------------------------------------------------

Scenario = Callable[[int, int], Any]  # (rank, world) -> a picklable result


def _child(rank: int, world: int, port: int, scenario: Scenario, folder: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    log = open(os.path.join(folder, f"log{rank}.txt"), "w")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    try:
        outcome = ("ok", scenario(rank, world))
    except InputError as exc:
        outcome = ("InputError", exc.file, exc.field, exc.problem, exc.line())
    except BaseException:
        outcome = ("crash", traceback.format_exc())
    with open(os.path.join(folder, f"result{rank}.pkl"), "wb") as out:
        pickle.dump(outcome, out)
    log.flush()
    os._exit(0)  # no teardown of the process group's threads


def launch(world: int, scenario: Scenario, folder: Path, *, timeout_s: float = 60.0,
           kill_when: Callable[[], bool] | None = None) -> list[tuple] | None:
    """Run ``scenario`` on ``world`` forked gloo processes; each rank's outcome. With
    ``kill_when``, SIGKILL every process as soon as it holds, and return None."""
    folder.mkdir(parents=True, exist_ok=True)
    ctx = multiprocessing.get_context("fork")
    port = h.free_port()
    procs = [ctx.Process(target=_child, args=(rank, world, port, scenario, str(folder)), daemon=True)
             for rank in range(world)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout_s
    if kill_when is not None:
        while not kill_when() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert kill_when(), f"the condition to kill on never held: {_logs(folder, world)}"
        for proc in procs:
            proc.kill()  # only the processes this test started
            proc.join(10)
        return None
    for proc in procs:
        proc.join(max(deadline - time.monotonic(), 0.01))
    hung = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
    for rank in hung:
        procs[rank].kill()
        procs[rank].join(10)
    assert not hung, f"ranks {hung} still ran after {timeout_s} s: {_logs(folder, world)}"
    assert [p.exitcode for p in procs] == [0] * world, _logs(folder, world)
    outcomes = [pickle.loads((folder / f"result{rank}.pkl").read_bytes()) for rank in range(world)]
    crashes = [o[1] for o in outcomes if o[0] == "crash"]
    assert not crashes, crashes[0]
    return outcomes


def _logs(folder: Path, world: int) -> str:
    return "\n".join(f"rank {r}: {(folder / f'log{r}.txt').read_text()[-3000:]}"
                     for r in range(world) if (folder / f"log{r}.txt").exists())


def values(outcomes: list[tuple]) -> list[Any]:
    assert all(o[0] == "ok" for o in outcomes), outcomes
    return [o[1] for o in outcomes]


META = {"model": "tiny", "num_layers": 4, "consumed_samples": 640}


# -- multi-process ---------------------------------------------------------------------------------

def test_a_checkpoint_loads_under_another_split_and_world(tmp_path):
    """Saved with rank 0 holding layers 0-1 and rank 1 layers 2-3 (the tied embedding on both);
    loaded with rank 0 holding layer 0 and rank 1 layers 1-3, then on a world of 3: every value
    bit for bit, tensors filled in place, and only the RNG state of a rank the saving world
    lacked reported missing."""
    root = tmp_path / "ckpt"
    saved_layers = {0: [0, 1], 1: [2, 3]}

    def save(rank, world):
        return str(checkpoint.save(root, 10, expected(saved_layers[rank], rank, tied=True), meta=META, group=None, keep=2))

    assert values(launch(2, save, tmp_path / "save")) == [str(root / "step_00000010")] * 2
    assert checkpoint.read_meta(root / "step_00000010") == {**META, "step": 10}

    def loader(layers_of, tied_on):
        def load(rank, world):
            state = blank(expected(layers_of[rank], rank, tied=rank in tied_on))
            tensors = {key: value for key, value in state.items() if isinstance(value, torch.Tensor)}
            missing = checkpoint.load(root / "step_00000010", state, group=None, optional_prefixes=("rng/",))
            in_place = all(state[key] is tensor for key, tensor in tensors.items())
            return state, missing, in_place
        return load

    two = {0: [0], 1: [1, 2, 3]}
    for rank, (state, missing, in_place) in enumerate(values(launch(2, loader(two, {1}), tmp_path / "load2"))):
        assert_identical(state, expected(two[rank], rank, tied=rank == 1))
        assert missing == set() and in_place

    three = {0: [0], 1: [1, 2], 2: [3]}
    results = values(launch(3, loader(three, {0, 2}), tmp_path / "load3"))
    for rank, (state, missing, in_place) in enumerate(results):
        want = expected(three[rank], rank, tied=rank in (0, 2))
        if rank == 2:  # the saving world had no rank 2: its RNG states stay as they were (zero)
            assert missing == {"rng/rank2/cpu", "rng/rank2/python"}
            want.update(blank(rank_state(2)))
        else:
            assert missing == set()
        assert_identical(state, want)
        assert in_place


def test_replicas_are_written_once(tmp_path):
    """Two ranks holding the same 1 MiB tensor under one key (data-parallel replicas) write
    it once: the checkpoint's data files hold about 1 MiB, not 2."""
    root = tmp_path / "ckpt"
    shared = torch.arange(262144, dtype=torch.float32)  # 1 MiB

    def save(rank, world):
        checkpoint.save(root, 1, {"model/layers.0.weight": shared.clone(), **rank_state(rank)}, meta=META, group=None, keep=2)

    values(launch(2, save, tmp_path / "save"))
    sizes = checkpoint.checkpoint_bytes(root / "step_00000001")
    data_bytes = sum(size for name, size in sizes.items() if name.endswith(".distcp"))
    assert 2**20 <= data_bytes < 2**20 + 2**17, sizes
    state = blank({"model/layers.0.weight": shared})
    assert checkpoint.load(root / "step_00000001", state, group=None) == set()
    assert torch.equal(state["model/layers.0.weight"], shared)


def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path):
    """Both ranks are SIGKILLed inside DCP's write of step 2, after their data files are
    written: step 1 stays the latest, the .partial folder is no checkpoint, and the next save
    (step 3) succeeds and removes it."""
    root = tmp_path / "ckpt"
    markers = tmp_path / "markers"
    markers.mkdir()

    def save_at(step):
        def save(rank, world):
            return str(checkpoint.save(root, step, expected([rank], rank), meta={**META, "step": step}, group=None, keep=2))
        return save

    values(launch(2, save_at(1), tmp_path / "save1"))

    def stalled(rank, world):
        write = dcp.FileSystemWriter.write_data

        def write_then_stall(self, plan, planner):
            done = write(self, plan, planner)
            done.wait()
            (markers / f"rank{rank}").touch()
            time.sleep(600)  # killed here
            return done

        dcp.FileSystemWriter.write_data = write_then_stall
        return save_at(2)(rank, world)

    launch(2, stalled, tmp_path / "save2", kill_when=lambda: len(list(markers.iterdir())) == 2)
    partial = root / "step_00000002.partial"
    assert h.saved_entries(partial) == ["__0_0.distcp", "__1_0.distcp"]  # no .metadata, no octopipe.json
    assert checkpoint.latest(root) == (1, root / "step_00000001")
    assert checkpoint.resolve("auto", save_root=str(root)) == root / "step_00000001"
    with pytest.raises(InputError) as caught:
        checkpoint.resolve(str(partial), save_root=None)
    assert caught.value.field in (".metadata", "octopipe.json") and "unfinished save" in caught.value.problem

    values(launch(2, save_at(3), tmp_path / "save3"))
    assert h.saved_entries(root) == ["step_00000001", "step_00000003"]
    assert checkpoint.latest(root) == (3, root / "step_00000003")


def test_errors_are_raised_on_every_rank_alike(tmp_path):
    """Only rank 1 asks for a key the checkpoint lacks, only rank 0 for one of another shape:
    both ranks raise the same InputError (none waits for the other), and neither rank's
    tensors change. A save into a folder that cannot be made fails on both ranks alike."""
    root = tmp_path / "ckpt"
    checkpoint.save(root, 5, expected([0, 1]), meta=META, group=None, keep=2)
    path = root / "step_00000005"

    def load(rank, world):
        state = blank(expected([rank]))
        if rank == 0:
            state["model/layers.0.weight"] = torch.zeros(3, 5)
        else:
            state["model/layers.9.weight"] = torch.zeros(3, 4)
        try:
            checkpoint.load(path, state, group=None)
        except InputError:
            assert all(not value.any() for value in state.values() if isinstance(value, torch.Tensor))
            raise

    outcomes = launch(2, load, tmp_path / "load")
    assert outcomes[0] == outcomes[1]
    kind, file, field, problem, line = outcomes[0]
    assert (kind, file, field) == ("InputError", str(path), "model/layers.9.weight")  # missing keys come first
    assert problem == "is not in the checkpoint: it holds another model's state"

    blocker = tmp_path / "a-file"
    blocker.write_text("")

    def save(rank, world):
        checkpoint.save(blocker / "ckpt", 1, expected([rank]), meta=META, group=None, keep=2)

    outcomes = launch(2, save, tmp_path / "save")
    assert outcomes[0] == outcomes[1] and outcomes[0][0] == "InputError"
    assert outcomes[0][1] == str(blocker / "ckpt") and "cannot write the checkpoint" in outcomes[0][3]


def _each_rank_finds(check: Callable[[Any], None], cases: list[list[Any]]) -> Callable[[int, int], list]:
    """A rank's run of ``check`` on its own value of each case: None where it passed, else the
    error's field and problem."""
    def run(rank: int, world: int) -> list:
        found = []
        for case in cases:
            try:
                check(case[rank])
                found.append(None)
            except InputError as exc:
                found.append((exc.field, exc.problem))
        return found
    return run


def test_agree_names_the_ranks_that_disagree(tmp_path):
    agree = _each_rank_finds(lambda found: checkpoint.agree(found[0], group=None, save=found[1]),
                             [[(20, "a"), (20, "a"), (20, "a")], [(20, "a"), (20, "a"), (10, "b")],
                              [(None, None), (4, "a"), (None, None)], [(None, None)] * 3,
                              # two nodes given two saves of one step (another run's, a stale copy)
                              [(4, "a"), (4, "b"), (4, "a")]])

    results = values(launch(3, agree, tmp_path / "agree"))
    assert results[0] == results[1] == results[2]
    prefix = "the ranks would resume from different checkpoints: "
    assert results[0] == [
        None,
        ("--resume", prefix + "ranks 0,1 found step 20, rank 2 found step 10"),
        ("--resume", prefix + "ranks 0,2 found no checkpoint, rank 1 found step 4"),
        None,
        ("--resume", prefix + "ranks 0,2 found step 4 (save a), rank 1 found step 4 (save b)"),
    ]


def test_saved_by_tells_two_saves_of_one_step_apart_and_copies_alike(tmp_path):
    import shutil

    for run in ("x", "y"):
        checkpoint.save(tmp_path / run, 1, expected([0]), meta=META, group=None, keep=2)
    x, y = tmp_path / "x" / "step_00000001", tmp_path / "y" / "step_00000001"
    shutil.copytree(x, tmp_path / "copy")
    assert checkpoint.saved_by(x) == checkpoint.saved_by(tmp_path / "copy") != checkpoint.saved_by(y)
    assert len(checkpoint.saved_by(x)) == 12


def test_ranks_must_save_into_one_folder_whatever_each_calls_it(tmp_path):
    """Three ranks, each with its own --save path: the same folder (rank 1 through a link) is
    fine; rank 2's other folder (a node's local disk) is bad input on every rank alike, naming
    it; nothing is left behind (no marker, nor the folders made for it, parents included: the
    first save makes them)."""
    shared, local = tmp_path / "runs" / "today" / "shared", tmp_path / "local"
    (tmp_path / "link").symlink_to(shared, target_is_directory=True)

    check = _each_rank_finds(lambda root: checkpoint.check_one_root(root, group=None),
                             [[shared, tmp_path / "link", shared], [shared, tmp_path / "link", local]])

    results = values(launch(3, check, tmp_path / "check"))
    assert results[0] == results[1] == results[2]
    assert results[0] == [None, ("--save", f"is another folder on rank 2 ({local}) than on rank 0 ({shared}): "
                                           "their shares of every checkpoint would be missing from it")]
    assert not (tmp_path / "runs").exists() and not local.exists()


def test_the_folders_made_for_the_check_are_only_those_it_made(tmp_path, monkeypatch):
    """``typo/../mine/ck``: ``typo/../mine`` is the user's own (empty) folder ``mine``, which
    the check must not take for one it made and remove; ``typo`` and ``ck`` it made, and
    removes. A marker the disk refuses (a full disk) leaves nothing behind either."""
    monkeypatch.chdir(tmp_path)
    Path("mine").mkdir()
    checkpoint.check_one_root("typo/../mine/ck", group=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"] and not any(Path("mine").iterdir())
    refused = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    with mock.patch.object(Path, "write_text", side_effect=refused), pytest.raises(InputError, match="No space left"):
        checkpoint.check_one_root("new/ck", group=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]
    with pytest.raises(InputError):  # a file where a folder should be: nothing made stays
        Path("afile").write_text("x")
        checkpoint.check_one_root("made/../afile/ck", group=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "mine"]


def test_a_rank_that_cannot_write_the_save_folder_stops_every_rank(tmp_path):
    """Rank 1 sees the folder but may not write in it (a node with a read-only mount; the tests
    run as root, who writes anywhere, so that process's file writes are refused instead):
    every rank stops alike before training, naming it; each probe file is removed (the
    folder made for the check is gone, so it was empty)."""
    shared = tmp_path / "shared"

    def check(case: tuple[Path, bool]) -> None:
        root, read_only = case
        refused = OSError(errno.EROFS, os.strerror(errno.EROFS))
        with mock.patch.object(Path, "write_bytes", side_effect=refused) if read_only else nullcontext():
            checkpoint.check_one_root(root, group=None)

    cases = [[(shared, False)] * 3, [(shared, False), (shared, True), (shared, False)]]
    results = values(launch(3, _each_rank_finds(check, cases), tmp_path / "check"))
    assert results[0] == results[1] == results[2]
    assert results[0] == [None, ("--save", f"cannot be written on rank 1 ({shared}: {os.strerror(errno.EROFS)})")]
    assert not shared.exists()


# -- one process -----------------------------------------------------------------------------------

def test_objects_round_trip_in_one_process(tmp_path):
    """Without torch.distributed: ints, dicts, bytes of an RNG state, a Python RNG state, a
    0-d tensor; a dict value stays one key (not flattened into its items)."""
    rng_bytes = bytes(torch.Generator().manual_seed(3).get_state().numpy())
    state = {"count": 12, "nested": {"a": [1, 2.5, "x", None], "b": (1, 2)}, "rng/bytes": rng_bytes,
             "rng/python": random.Random(5).getstate(), "zero_d": torch.tensor(2.5), "empty": torch.zeros(0, 3)}
    path = checkpoint.save(tmp_path, 7, state, meta={"model": "m"}, group=None, keep=2)
    got = blank(state)
    assert checkpoint.load(path, got, group=None) == set()
    assert_identical(got, state)
    assert checkpoint.read_meta(path) == {"model": "m", "step": 7}
    record = json.loads((path / "octopipe.json").read_text())
    assert re.fullmatch(r"[0-9a-f]{16}", record.pop("save_id"))  # random per save: saved_by tells saves apart
    assert set(record.pop("crc32")) == {"__0_0.distcp"}  # one data file, one rank
    assert record == {"format": "octopipe-checkpoint", "version": 1, "step": 7, "meta": {"model": "m"}}


def test_keep_prunes_the_oldest(tmp_path):
    for step in (1, 2, 3, 4):
        checkpoint.save(tmp_path, step, {"x": torch.tensor([step])}, meta={}, group=None, keep=2)
    assert h.saved_entries(tmp_path) == ["step_00000003", "step_00000004"]
    checkpoint.save(tmp_path, 5, {"x": torch.tensor([5])}, meta={}, group=None, keep=1)
    assert h.saved_entries(tmp_path) == ["step_00000005"]
    # a run resumed from an earlier step: what it saves stays, even behind a later step
    checkpoint.save(tmp_path, 2, {"x": torch.tensor([2])}, meta={}, group=None, keep=1)
    assert h.saved_entries(tmp_path) == ["step_00000002", "step_00000005"]
    # the same step again replaces it
    checkpoint.save(tmp_path, 2, {"x": torch.tensor([22])}, meta={}, group=None, keep=2)
    state = {"x": torch.tensor([0])}
    checkpoint.load(tmp_path / "step_00000002", state, group=None)
    assert state["x"].tolist() == [22] and h.saved_entries(tmp_path) == ["step_00000002", "step_00000005"]
    with pytest.raises(ValueError):
        checkpoint.save(tmp_path, 6, {}, meta={}, group=None, keep=0)


def test_a_save_clears_what_interrupted_saves_left(tmp_path):
    checkpoint.save(tmp_path, 1, {"x": torch.tensor([1])}, meta={}, group=None, keep=2)
    (tmp_path / "step_00000009.partial").mkdir()
    (tmp_path / "step_00000009.partial" / "__0_0.distcp").write_bytes(b"junk")
    # a crash between moving a same-step checkpoint aside and renaming its successor
    (tmp_path / "step_00000001").rename(tmp_path / "step_00000001.replaced")
    # the moved-aside folder is step 1's only copy: --resume auto takes it
    assert checkpoint.latest(tmp_path) == (1, tmp_path / "step_00000001.replaced")
    state = {"x": torch.tensor([0])}
    checkpoint.load(checkpoint.resolve("auto", save_root=tmp_path), state, group=None)
    assert state["x"].tolist() == [1]
    (tmp_path / "mine.partial").mkdir()  # not a name a save makes: left alone
    checkpoint.save(tmp_path, 2, {"x": torch.tensor([2])}, meta={}, group=None, keep=2)
    assert h.saved_entries(tmp_path) == ["mine.partial", "step_00000001", "step_00000002"]


def test_resolve(tmp_path):
    missing = tmp_path / "nothing"
    assert checkpoint.resolve("auto", save_root=str(missing)) is None
    assert checkpoint.latest(missing) is None
    empty = tmp_path / "empty"
    empty.mkdir()
    assert checkpoint.resolve("auto", save_root=str(empty)) is None
    (empty / "step_00000003.partial").mkdir()
    assert checkpoint.resolve("auto", save_root=str(empty)) is None
    with pytest.raises(InputError) as caught:
        checkpoint.resolve(str(empty), save_root=None)
    assert caught.value.field == "--resume" and "step_00000003.partial" in caught.value.problem
    with pytest.raises(InputError) as caught:
        checkpoint.resolve(str(missing), save_root=None)
    assert (caught.value.file, caught.value.field, caught.value.problem) == (str(missing), "--resume", "does not exist")
    with pytest.raises(InputError) as caught:
        checkpoint.resolve("auto", save_root=None)
    assert caught.value.field == "--resume"

    root = tmp_path / "root"
    for step in (8, 12):
        checkpoint.save(root, step, {"x": torch.tensor([step])}, meta={}, group=None, keep=2)
    assert checkpoint.resolve("auto", save_root=str(root)) == root / "step_00000012"
    assert checkpoint.resolve(str(root), save_root=None) == root / "step_00000012"
    assert checkpoint.resolve(str(root / "step_00000008"), save_root=None) == root / "step_00000008"
    (root / "notes.txt").write_text("")
    with pytest.raises(InputError) as caught:
        checkpoint.resolve(str(root / "notes.txt"), save_root=None)
    assert caught.value.problem == "is a file, not a checkpoint folder"


@pytest.fixture
def saved(tmp_path) -> Path:
    return checkpoint.save(tmp_path / "ckpt", 5, expected([0, 1]), meta=META, group=None, keep=2)


def _load_error(path, state, **kwargs) -> InputError:
    before = {key: value.clone() for key, value in state.items() if isinstance(value, torch.Tensor)}
    with pytest.raises(InputError) as caught:
        checkpoint.load(path, state, group=None, **kwargs)
    for key, value in before.items():  # nothing in memory changed
        assert torch.equal(state[key], value), key
    return caught.value


def test_read_meta_rejects_what_is_no_complete_checkpoint(saved, tmp_path):
    with pytest.raises(InputError) as caught:
        checkpoint.read_meta(tmp_path / "gone")
    assert (caught.value.file, caught.value.problem) == (str(tmp_path / "gone"), "does not exist")
    foreign = tmp_path / "foreign"
    shutil.copytree(saved, foreign)
    (foreign / ".metadata").unlink()
    with pytest.raises(InputError) as caught:
        checkpoint.read_meta(foreign)
    assert caught.value.field == ".metadata" and "not a complete octopipe checkpoint" in caught.value.problem
    (saved / "octopipe.json").write_text("{not json")
    with pytest.raises(InputError) as caught:
        checkpoint.read_meta(saved)
    assert caught.value.file == str(saved / "octopipe.json") and caught.value.problem.startswith("is not JSON")
    (saved / "octopipe.json").write_text(json.dumps({"format": "other", "step": 5, "meta": {}}))
    with pytest.raises(InputError) as caught:
        checkpoint.read_meta(saved)
    assert caught.value.field == "format"
    (saved / "octopipe.json").write_text(json.dumps({"format": checkpoint.FORMAT, "version": 2, "step": 5, "meta": {}}))
    with pytest.raises(InputError) as caught:
        checkpoint.read_meta(saved)
    assert caught.value.field == "version"
    (saved / "octopipe.json").unlink()
    with pytest.raises(InputError) as caught:
        checkpoint.read_meta(saved)
    assert caught.value.field == "octopipe.json"
    # and load refuses it before touching anything
    assert _load_error(saved, blank(expected([0]))).field == "octopipe.json"


def test_a_save_folder_of_another_models_checkpoints_is_refused(saved):
    """--save into a folder of another model's checkpoints replaced the one of the same step and
    pruned the rest (--keep) with exit 0; now the run refuses the folder before it trains. This
    model's own checkpoints are its to continue or replace, and .partial leftovers its own."""
    root = saved.parent
    checkpoint.check_save_root(root, {"model": "tiny", "num_layers": 4})
    checkpoint.check_save_root(root / "absent", {"model": "other", "num_layers": 4})
    for model, what in (({"model": "other", "num_layers": 4}, "model ('tiny', this run's is 'other')"),
                        ({"model": "tiny", "num_layers": 6}, "layer count (4, this run's is 6)")):
        with pytest.raises(InputError) as caught:
            checkpoint.check_save_root(root, model)
        assert (caught.value.file, caught.value.field) == (str(saved), "--save")
        assert caught.value.problem.startswith(f"holds a checkpoint of another {what}")
    (saved / "octopipe.json").write_text("{damaged")
    with pytest.raises(InputError) as caught:
        checkpoint.check_save_root(root, {"model": "tiny", "num_layers": 4})
    assert caught.value.file == str(saved / "octopipe.json") and "whose saves would replace or prune it" in caught.value.problem


def test_a_missing_or_truncated_data_file_is_named(saved):
    data = saved / "__0_0.distcp"
    content = data.read_bytes()
    data.write_bytes(content[: len(content) // 2])
    error = _load_error(saved, blank(expected([0])))
    assert error.field == "__0_0.distcp" and error.problem.startswith("is truncated")
    data.unlink()
    error = _load_error(saved, blank(expected([1])))
    assert (error.file, error.field) == (str(saved), "__0_0.distcp")
    assert error.problem.startswith("is missing (it holds 5 entries, e.g. extra/layers.1)")


def test_a_file_vanishing_during_the_read_is_named(saved, monkeypatch):
    """DCP's own failure (a file gone between the check and the read) becomes one InputError
    naming the file, not DCP's CheckpointException (a BaseException) with its tracebacks."""
    monkeypatch.setattr(checkpoint, "_check_files", lambda folder, index, keys: {})
    (saved / "__0_0.distcp").unlink()
    with pytest.raises(InputError) as caught:
        checkpoint.load(saved, blank(expected([0])), group=None)
    assert (caught.value.file, caught.value.field) == (str(saved), "__0_0.distcp")
    assert "could not be read by rank 0" in caught.value.problem



def test_torchs_file_writer_refusing_a_write_is_bad_input(tmp_path):
    """torch's serializer reports a write the filesystem refused (a full disk, a file size limit)
    as a RuntimeError from C++ with its errno lost: still the folder's fault, in one line."""
    from torch.distributed.checkpoint.api import CheckpointException

    refused = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    error = checkpoint._failed(tmp_path, "written", CheckpointException("save failed", {0: refused}))
    assert isinstance(error, InputError) and error.file == str(tmp_path)
    assert error.problem == "could not be written by rank 0: torch's file writer failed (unexpected pos 704 vs 598)"
    # anything else a rank raised while writing stays a failure of the run, with every reason
    other = checkpoint._failed(tmp_path, "written", CheckpointException("save failed", {1: ValueError("odd")}))
    assert not isinstance(other, InputError) and "rank 1: ValueError: odd" in str(other)


def test_damaged_bytes_of_the_right_size_are_bad_input(saved):
    """A shard whose bytes changed keeps its size: the CRC-32 the save recorded names it before
    anything loads, even where the bytes still decode (a flipped bit inside a weight)."""
    data = saved / "__0_0.distcp"
    content = bytearray(data.read_bytes())
    recorded = json.loads((saved / "octopipe.json").read_text())["crc32"]
    assert recorded == {"__0_0.distcp": f"{zlib.crc32(content):08x}"}
    content[len(content) // 3] ^= 0x01
    data.write_bytes(bytes(content))
    error = _load_error(saved, blank(expected([0])))
    assert (error.file, error.field) == (str(saved), "__0_0.distcp")
    assert error.problem == f"is damaged: its bytes' CRC-32 is {zlib.crc32(content):08x}, the save recorded {recorded['__0_0.distcp']}"


@pytest.mark.parametrize("crcs", [["00000000"], "00000000", {"__0_0.distcp": 7}])
def test_a_damaged_crc_record_is_bad_input_not_a_skipped_check(saved, crcs):
    """A record whose crc32 is not a mapping of names to CRC-32s would have left the shards'
    bytes unchecked: it is named before anything loads."""
    record = json.loads((saved / "octopipe.json").read_text())
    (saved / "octopipe.json").write_text(json.dumps({**record, "crc32": crcs}))
    with pytest.raises(InputError) as caught:
        checkpoint.read_meta(saved)
    assert (caught.value.file, caught.value.field) == (str(saved / "octopipe.json"), "crc32")
    assert caught.value.problem.endswith("not a mapping of file names to CRC-32s")


@pytest.mark.parametrize("text,field,problem", [
    ("[" * 100_000 + "]" * 100_000, None, "is nested too deeply to be read"),
    ('{"step": ' + "9" * 5000 + "}", None, "cannot be read: Exceeds the limit"),
])
def test_a_record_json_cannot_hold_is_bad_input_not_a_traceback(saved, text, field, problem):
    """Nesting past the parser's recursion, or an integer past Python's 4,300-digit limit for
    converting one: each raised out of json.loads as RecursionError / ValueError (exit 1)."""
    (saved / "octopipe.json").write_text(text)
    with pytest.raises(InputError) as caught:
        checkpoint.read_meta(saved)
    assert (caught.value.file, caught.value.field) == (str(saved / "octopipe.json"), field)
    assert caught.value.problem.startswith(problem)


@pytest.mark.parametrize("key,value", [("consumed_samples", float("nan")), ("consumed_samples", "x"),
                                       ("consumed_samples", -1), ("skipped_steps", 1.5)])
def test_a_damaged_count_is_bad_input(saved, key, value):
    """A resume continues from the record's counts: one that is no count of 0 or more (NaN
    failed the load as 'cannot convert float NaN to integer', -1 read data from before the
    file's start) is named before anything loads."""
    record = json.loads((saved / "octopipe.json").read_text())
    record["meta"][key] = value
    (saved / "octopipe.json").write_text(json.dumps(record))
    with pytest.raises(InputError) as caught:
        checkpoint.read_meta(saved)
    assert (caught.value.file, caught.value.field) == (str(saved / "octopipe.json"), f"meta.{key}")


def test_damaged_bytes_of_a_checkpoint_without_crcs_fail_the_read_as_bad_input(saved):
    """A checkpoint written before the CRC-32s were (or a shard overwritten with noise) is found
    by the read itself: still one InputError naming the folder and the way out."""
    record = json.loads((saved / "octopipe.json").read_text())
    del record["crc32"]
    (saved / "octopipe.json").write_text(json.dumps(record))
    data = saved / "__0_0.distcp"
    data.write_bytes(bytes(range(256)) * (data.stat().st_size // 256) + b"\0" * (data.stat().st_size % 256))
    with pytest.raises(InputError) as caught:
        checkpoint.load(saved, blank(expected([0])), group=None)
    assert caught.value.file == str(saved) and "a file is damaged" in caught.value.problem
    assert "--resume" in caught.value.fix

def test_another_models_keys_and_shapes_are_named(saved):
    state = blank(expected([0, 1, 2, 3]))
    error = _load_error(saved, state)
    assert error.field == "extra/layers.2"
    assert error.problem == ("is not in the checkpoint, nor are 9 more keys this model needs (e.g. extra/layers.3, "
                             "model/layers.2.bias, model/layers.2.weight): it holds another model's state")
    state = blank(expected([0, 1]))
    state["model/layers.1.weight"] = torch.zeros(3, 8)
    error = _load_error(saved, state)
    assert (error.field, error.problem) == ("model/layers.1.weight",
                                            "is [3, 4] float32 in the checkpoint but [3, 8] float32 in this model")
    state = blank(expected([0]))
    state["model/layers.0.bias"] = torch.zeros(4, dtype=torch.float32)
    state["extra/layers.0"] = torch.zeros(1)
    error = _load_error(saved, state)
    assert (error.field, error.problem) == ("extra/layers.0",
                                            "is an object in the checkpoint but [1] float32 in this model (1 more keys differ too)")


def test_a_whole_model_takes_every_key_of_its_checkpoint(saved, tmp_path):
    """Under whole_prefixes the ranks together are the whole model: keys of the checkpoint no
    rank takes (a run of the model with its head tied, resuming an untied run) are another
    model's, named before anything loads; a model that takes them all loads, split over ranks."""
    error = _load_error(saved, blank(expected([0])), whole_prefixes=("model/", "optim/"))
    assert (error.file, error.field) == (str(saved), "model/layers.1.bias")
    assert error.problem == ("is in the checkpoint but no layer of this model takes it, nor 3 more of its keys (e.g. "
                             "model/layers.1.weight, optim/layers.1.weight/exp_avg, optim/layers.1.weight/step): it "
                             "holds another model's state "
                             "(another config: a tied or untied head, other parameters)")
    # only the prefixes named: extra/ keys may stay behind, and a part of a model loads without them
    checkpoint.load(saved, blank({k: v for k, v in expected([0, 1]).items() if not k.startswith("extra/")}), group=None,
                    whole_prefixes=("model/", "optim/"))
    checkpoint.load(saved, blank(expected([0])), group=None)
    # octorun holds only model/ whole: a parameter now frozen takes its weight, not its moments
    frozen = {k: v for k, v in expected([0, 1]).items() if not k.startswith(("extra/", "optim/layers.0"))}
    checkpoint.load(saved, blank(frozen), group=None, whole_prefixes=("model/",))

    def split(rank, world):  # two ranks take a layer each: together, the whole checkpoint
        checkpoint.load(saved, blank(expected([rank])), group=None, whole_prefixes=("model/", "optim/"))

    assert values(launch(2, split, tmp_path / "split")) == [None, None]

    def one_layer_short(rank, world):  # both ranks take layer 0: layer 1's keys are left
        try:
            checkpoint.load(saved, blank(expected([0])), group=None, whole_prefixes=("model/", "optim/"))
        except InputError as exc:
            return exc.field

    assert values(launch(2, one_layer_short, tmp_path / "short")) == ["model/layers.1.bias"] * 2


def test_optional_keys_may_be_missing_but_others_not(saved):
    state = blank(expected([1]))
    state.update({"rng/rank4/cpu": torch.ones(3, dtype=torch.uint8), "rng/rank4/python": "untouched"})
    assert checkpoint.load(saved, state, group=None, optional_prefixes=("rng/",)) == {"rng/rank4/cpu", "rng/rank4/python"}
    assert state["rng/rank4/cpu"].tolist() == [1, 1, 1] and state["rng/rank4/python"] == "untouched"
    want = expected([1])
    assert_identical({key: state[key] for key in want}, want)
    error = _load_error(saved, blank({"rng/rank4/cpu": torch.ones(3)}))
    assert error.field == "rng/rank4/cpu"
    # an optional value of another shape or kind is skipped alike (an RNG state of another device)
    state = {"extra/layers.0": torch.ones(2), "model/layers.0.weight": torch.ones(5)}
    assert checkpoint.load(saved, state, group=None, optional_prefixes=("extra/", "model/")) == set(state)
    assert state["extra/layers.0"].tolist() == [1, 1] and state["model/layers.0.weight"].tolist() == [1] * 5


def test_check_compatible_names_what_differs(tmp_path):
    checkpoint.check_compatible({"model": "tiny", "num_layers": 4, "step": 3}, {"model": "tiny", "num_layers": 4}, tmp_path)
    with pytest.raises(InputError) as caught:
        checkpoint.check_compatible({"model": "tiny", "num_layers": 4}, {"model": "big", "num_layers": 4}, tmp_path)
    assert (caught.value.file, caught.value.field) == (str(tmp_path), "model")
    assert caught.value.problem == "the checkpoint's model is 'tiny', this run's is 'big'"
    with pytest.raises(InputError) as caught:
        checkpoint.check_compatible({"model": "tiny", "num_layers": 4}, {"model": "tiny", "num_layers": 6}, tmp_path)
    assert caught.value.field == "num_layers" and "layer count is 4, this run's is 6" in caught.value.problem
    # the optimizer state is the optimizer's: AdamW's moments mean nothing to SGD, and SGD's
    # checkpoint has none for AdamW
    with pytest.raises(InputError) as caught:
        checkpoint.check_compatible({"model": "tiny", "optimizer": "sgd"}, {"model": "tiny", "optimizer": "adamw"}, tmp_path)
    assert caught.value.field == "optimizer" and caught.value.fix.startswith("give --optimizer sgd")


def test_check_compatible_holds_a_token_files_position_to_its_order(tmp_path):
    """A checkpoint's consumed_samples is a place in its token file's window order, which the file
    and the seed fix: a resume that reads a token file must read the same one in the same order.
    The file may have moved (the path is not judged), a run without --data is not judged on the
    data, and a checkpoint from before fingerprints were recorded is judged on its seed alone."""
    file = "a file of 3000 uint16 tokens (digest 0123456789ab)"
    saved = {"model": "tiny", "num_layers": 4, "seed": 3, "data": "old/place/tokens.bin", "data_fingerprint": file}
    now = {"model": "tiny", "num_layers": 4, "seed": 3, "data_fingerprint": file}
    checkpoint.check_compatible(saved, now, tmp_path)
    checkpoint.check_compatible(saved, {"model": "tiny", "num_layers": 4}, tmp_path)  # no --data now
    checkpoint.check_compatible({**saved, "data": None, "data_fingerprint": None}, {**now, "seed": 4}, tmp_path)
    with pytest.raises(InputError) as caught:
        checkpoint.check_compatible(saved, {**now, "seed": 4}, tmp_path)
    assert (caught.value.file, caught.value.field) == (str(tmp_path), "seed")
    assert caught.value.fix.startswith("resume with --seed 3")
    with pytest.raises(InputError) as caught:
        checkpoint.check_compatible(saved, {**now, "data_fingerprint": "a file of 2999 uint16 tokens (digest 0123456789ab)"},
                                    tmp_path)
    assert caught.value.field == "data_fingerprint" and "old/place/tokens.bin" in caught.value.problem
    # the same length and ends, other blocks inside (a file edited in place)
    sampled = {**saved, "data_sampled_digest": "aaaaaaaaaaaa"}
    checkpoint.check_compatible(sampled, {**now, "data_sampled_digest": "aaaaaaaaaaaa"}, tmp_path)
    with pytest.raises(InputError) as caught:
        checkpoint.check_compatible(sampled, {**now, "data_sampled_digest": "bbbbbbbbbbbb"}, tmp_path)
    assert caught.value.field == "data_sampled_digest" and caught.value.problem.endswith("it was changed inside")
    checkpoint.check_compatible(saved, {**now, "data_sampled_digest": "bbbbbbbbbbbb"}, tmp_path)  # saved before it
    older = {key: value for key, value in saved.items() if key != "data_fingerprint"}
    checkpoint.check_compatible(older, {**now, "data_fingerprint": "another file"}, tmp_path)
    with pytest.raises(InputError):
        checkpoint.check_compatible(older, {**now, "seed": 4}, tmp_path)


def test_checkpoint_bytes_lists_every_file(saved):
    sizes = checkpoint.checkpoint_bytes(saved)
    assert sorted(sizes) == [".metadata", "__0_0.distcp", "octopipe.json"]
    assert sizes["octopipe.json"] == (saved / "octopipe.json").stat().st_size
    assert all(size > 0 for size in sizes.values())


def test_model_state_keys_a_parameter_by_its_first_name_and_a_tied_one_by_its_canonical_key():
    from octorun.tied import model_state

    class Aliased(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(2, 2)
            self.b = self.a  # one module under two names: one tensor in the checkpoint
            self.register_buffer("count", torch.zeros(1))

    layers = {0: Aliased(), 3: torch.nn.Linear(2, 2)}
    state = model_state(layers, {})
    assert sorted(state) == ["model/layers.0.a.bias", "model/layers.0.a.weight", "model/layers.0.count",
                             "model/layers.3.bias", "model/layers.3.weight"]
    assert state["model/layers.0.a.weight"] is not None
    tied = model_state(layers, {id(layers[3].weight): "layers.0.a.weight"})
    assert "model/layers.3.weight" not in tied and sorted(tied)[:2] == ["model/layers.0.a.bias", "model/layers.0.a.weight"]


def test_a_save_into_a_root_another_process_holds_is_bad_input_and_writes_nothing(tmp_path):
    """The first save takes the root (it did not exist when the run began): where another
    process holds it by then, the save is refused, naming the holder, before anything is
    written or any unfinished save (perhaps the other run's) is removed."""
    import subprocess

    root = tmp_path / "ck"
    (root / "step_00000003.partial").mkdir(parents=True)  # the other run's save under way
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                               "f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX)\n"
                               "f.seek(0); f.truncate(); f.write(f'pid {os.getpid()} on here'); f.flush()\n"
                               "print('held', flush=True); time.sleep(120)", str(root / checkpoint.LOCK_FILE)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(InputError, match=rf"another run saves into it now \(pid {holder.pid} on here, holding "):
            checkpoint.save(root, 1, {"model/layers.0.weight": torch.ones(2)}, meta={**META, "step": 1}, group=None,
                            keep=2)
        assert sorted(path.name for path in root.iterdir()) == [checkpoint.LOCK_FILE, "step_00000003.partial"]
    finally:
        holder.kill()
        holder.wait()
    assert checkpoint.save(root, 1, {"model/layers.0.weight": torch.ones(2)}, meta={**META, "step": 1}, group=None,
                           keep=2).name == "step_00000001"
