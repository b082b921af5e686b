"""Each process's verdict on its own input, shared before the job forms its process group.

Every process reads the plan, the model file and the options itself. When one of them finds bad
input (a plan path that is missing on one node only), or was launched with another plan, model
file or options than rank 0, it must not simply leave: its peers would wait for it until
--init-timeout and then blame the launch, and a different plan or option would surface as a
hang. So all processes first meet on the store the process group forms on, each says whether
its input is good, and then either all go on or all stop with exit 2. Each node's log says why
the job stopped, once: its own error, or the first error of a peer.

The meeting costs a handful of store requests per process whatever the job's size: counters and
first-writer-wins keys (``compare_set``), never a key per rank that every rank reads.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import itertools
import json
import os
import secrets
import socket
from pathlib import Path
from typing import Any, Callable

from octoplan.errors import InputError
from octoplan.plan import Plan, plan_to_dict
from octoplan.yamlio import file_sha256
from octorun.watchdog import gist

# The options every process must run with alike (RunConfig field: its flag). --timeout and the
# output paths may differ from node to node; --save, --data, --resume and --init-from must at least be given
# on every node or on none (their paths are each node's own), and --data's files must match
# (their fingerprint holds the token type, which --data-dtype may name or leave to the file).
AGREED_OPTIONS = {
    "steps": "--steps", "seed": "--seed", "optimizer": "--optimizer", "lr": "--lr", "weight_decay": "--weight-decay",
    "betas": "--betas", "grad_clip": "--grad-clip", "lr_schedule": "--lr-schedule", "warmup_steps": "--warmup-steps",
    "min_lr": "--min-lr", "decay_steps": "--decay-steps", "skip_nonfinite": "--skip-nonfinite",
    "precision": "--precision", "replay_time_scale": "--replay", "dynamic_shapes": "--dynamic-shapes",
    "activation_memory": "--activation-memory", "save_every": "--save-every", "keep": "--keep",
    "eval_every": "--eval-every",
}
GIVEN_OR_NOT = {"save_dir": "--save", "data_path": "--data", "resume": "--resume", "init_from": "--init-from",
                "eval_data_path": "--eval-data"}
SAME_EVERYWHERE_FIX = "launch every process with the same plan, model file and options"

# A process may run several jobs in one process group (the tests do): each meets under keys of
# its own. Every process runs the same jobs in the same order, so the counts agree.
_MEETINGS = itertools.count()


class JobStopped(Exception):
    """Some process's input was bad, so every process stops with exit 2. ``line`` is what this
    process writes to its log; None where another process of its node writes it."""

    def __init__(self, line: str | None):
        super().__init__(line or "bad input on another process")
        self.line = line


class NotAllCame(Exception):
    """The processes did not all meet within the deadline (a peer that crashed or never started)."""


def where() -> str:
    """This process's node, as its log and its peers' name it: torchrun's node rank (several
    launchers may share a host, as in tests) and the host."""
    host = socket.gethostname()
    group = os.environ.get("GROUP_RANK")
    return f"node {group}, host {host}" if group is not None else f"host {host}"


def identity(config: Any, plan: Plan, model_path: str, backend: str, data: Any = None,
             evaluation: Any = None) -> dict[str, str]:
    """What every process must share, by name: the plan's contents, the model file's bytes (a
    digest of each), the training options as they would be printed, and the token files
    (``data``, octorun.data.TokenData, and ``evaluation``'s, octorun.evaluation.Evaluation: their
    fingerprints; each node may read its own copy). The evaluation's batches are compared as
    they act: every process must pass the same messages."""
    parts = {
        "plan": _digest(json.dumps(plan_to_dict(plan), sort_keys=True, default=str).encode()),
        # a Hugging Face model ("hf:FOLDER") is its folder, which the plan's source names
        "model file": file_sha256(model_path) if Path(model_path).is_file() else model_path,
        "--backend": backend,
    }
    for name, flag in AGREED_OPTIONS.items():
        # --keep as it acts: not given and given as the default are the same run
        value = config.checkpoints_kept if name == "keep" else getattr(config, name)
        parts[flag] = " ".join(map(str, value)) if isinstance(value, (tuple, list)) else str(value)
    for name, flag in GIVEN_OR_NOT.items():
        parts[flag] = "given" if getattr(config, name) is not None else "not given"
    if data is not None:
        parts["--data"] = f"{data.fingerprint()}, sampled {data.sampled_digest()}"
    if evaluation is not None:
        parts["--eval-data"] = f"{evaluation.data.fingerprint()}, sampled {evaluation.data.sampled_digest()}"
        parts["--eval-batches"] = str(evaluation.batches)
    return parts


def mismatch(mine: dict[str, str], first: dict[str, str], first_where: str, *, rank: int, node: str, plan_path: str,
             model_path: str) -> InputError | None:
    """How this process's identity differs from rank 0's, as the error this process reports
    (any process of its node may print it, so it names the rank)."""
    here = f"rank {rank} ({node})"
    there = f"rank 0's ({first_where})"  # "another plan than rank 0's", "differs from rank 0's"
    for name, value in mine.items():
        theirs = first.get(name)
        if theirs == value:
            continue
        if name == "plan":
            return InputError(plan_path, None, f"given to {here} is another plan than {there}",
                              "give every node the same plan file")
        if name == "model file":
            return InputError(model_path, None, f"run by {here} differs from {there}",
                              "give every node the same model file")
        return InputError(None, name, f"is {value} on {here} but {theirs} on rank 0 ({first_where})", SAME_EVERYWHERE_FIX)
    return None


def meeting_store(store: Any) -> Any:
    """The keys of this process's next meeting on the job's ``store``."""
    import torch.distributed as dist

    return dist.PrefixStore(f"inputs/{next(_MEETINGS)}/", store)


def agree(store: Any, *, rank: int, world: int, error: InputError | None, parts: dict[str, str] | None,
          plan_path: str, model_path: str | None, timeout: datetime.timedelta, speaks_alone: bool = False,
          node: str | None = None, grace: datetime.timedelta = datetime.timedelta(seconds=5)) -> None:
    """Meet every process of the job on ``store`` (:func:`meeting_store`); return when every
    input is good.

    ``error`` is this process's own bad input (None: it read everything well) and ``parts`` its
    :func:`identity` (None where its input could not be read). ``speaks_alone``: this process
    reports its own error whatever its node's other processes found (a launch variable of its
    own); ``node``: this process's node (:func:`where`). A process launched with another
    ``world`` than rank 0's waits ``grace`` for the others, then ends the meeting for those that
    came (rank 0 may count processes that never come). Raises :class:`JobStopped` when any
    process's input is bad, and :class:`NotAllCame` when the processes did not all meet in time.
    """
    node = node or where()
    keys = store
    try:
        if rank == 0:
            keys.set("rank0", json.dumps({"where": node, "parts": parts, "world": world, "bad": error is not None}))
        try:
            first = json.loads(keys.get("rank0"))  # waits for rank 0 (the store's deadline)
        except Exception as exc:
            raise _not_all_came(exc, lambda: "rank 0 did not come") from None
        job_world = first.get("world", world)
        other_world = world != job_world
        # a line that names this rank and node already (a mismatch) is not prefixed with them again
        names_itself = False
        if error is None and other_world and not first.get("bad"):
            # (where rank 0's own input is bad, its error says what is wrong: not this process)
            error = InputError(None, "WORLD_SIZE", f"is {world} on rank {rank} ({node}) but {job_world} on rank 0 "
                               f"({first['where']})", SAME_EVERYWHERE_FIX)
            names_itself = True
        elif error is None and rank != 0 and parts is not None and first["parts"] is not None:
            error = mismatch(parts, first["parts"], first["where"], rank=rank, node=node, plan_path=plan_path,
                             model_path=model_path or "")
            names_itself = error is not None
        speaker = keys.compare_set(f"speaker/{node}", "", str(rank)) == str(rank).encode()
        if error is not None:
            # a process that speaks alone has put its line in its node's log itself: its node's
            # speaker is told so (an empty line), not handed the same line to print again
            keys.compare_set(f"bad/{node}", "", "" if speaks_alone else _said_by(f"rank {rank}", error, names_itself))
            keys.compare_set("bad", "", _said_by(f"rank {rank} ({node})", error, names_itself))
        # a process whose input is bad ends the meeting at its deadline for those that came (the
        # job stops either way): so does rank 0, which may host the store and must not leave first
        came, counted = _arrive(keys, rank=rank, job_world=job_world, timeout=grace if other_world else timeout,
                                end_at_deadline=other_world or error is not None)
        if not counted:
            # the meeting ended before this process came (or it is a rank rank 0 does not count):
            # nobody waits for it to read, and the store's host may be gone
            raise JobStopped(error.line() if error is not None else _late_line(keys))
        if not keys.check(["bad"]):
            return
        own_node = keys.get(f"bad/{node}").decode() if keys.check([f"bad/{node}"]) else None
        first_bad = keys.get("bad").decode()
    except (NotAllCame, JobStopped):
        raise
    except Exception as exc:
        raise NotAllCame(gist(exc)) from None
    # nobody leaves before all that came have read: the store may live in a process that leaves.
    # A failure here only ends the wait: this process read what it needs
    with contextlib.suppress(Exception):
        if keys.add("read", 1) == came:
            keys.set("read/all", "1")
        keys.wait(["read/all"], timeout)
    if error is not None and (speaks_alone or speaker):
        raise JobStopped(error.line())
    if not speaker:
        raise JobStopped(None)
    # the speaker's own input was good: its node's first bad process (none to print when that
    # process spoke for itself), else the job's first
    if own_node is not None:
        raise JobStopped(own_node or None)
    raise JobStopped(first_bad)


# Added to the count of arrivals by the process that ends the meeting, in one atomic step: every
# arrival counted before it is in, every one after it is late (a count this large never comes)
_CLOSED = 1 << 40


def _arrive(keys: Any, *, rank: int, job_world: int, timeout: datetime.timedelta,
            end_at_deadline: bool) -> tuple[int, bool]:
    """Count this process in and wait for the meeting to end: when rank 0's ``job_world``
    processes have come, or, with ``end_at_deadline`` (this process's world is not rank 0's, or
    its input is bad), at ``timeout`` for those that came by then. Returns how many came and whether this process
    is one of them (ranks outside rank 0's world never are)."""
    arrival = keys.add("arrived", 1) if rank < job_world else None
    if arrival == job_world:
        _end_meeting(keys)
    try:
        keys.wait(["came"], timeout)
    except Exception as exc:
        if not end_at_deadline:
            raise _not_all_came(exc, lambda: f"{int(keys.add('arrived', 0)) % _CLOSED} of {job_world} processes came") from None
        _end_meeting(keys)
    came = int(keys.get("came"))
    return came, arrival is not None and arrival <= came


def _end_meeting(keys: Any) -> None:
    """Close the count of arrivals (once: whoever calls first) and publish it."""
    token = secrets.token_hex(8)
    if keys.compare_set("closing", "", token) != token.encode():
        return
    keys.set("came", str(keys.add("arrived", _CLOSED) - _CLOSED))


def _late_line(keys: Any) -> str:
    """What a process that came after the meeting ended says (its own input was good)."""
    with contextlib.suppress(Exception):
        if keys.check(["bad"]):
            return keys.get("bad").decode()
    return "the other processes stopped before this one came (their launch differed from rank 0's)"


def _said_by(who: str, error: InputError, names_itself: bool) -> str:
    return error.line() if names_itself else f"{who}: {error.line()}"


def _not_all_came(exc: Exception, late: Callable[[], str]) -> NotAllCame:
    """``late()`` where the store's wait ran out (its message names internal keys, which tell a
    user nothing); the store's own error where it failed otherwise (a peer that hosted it left)."""
    if "timeout" in str(exc).lower():
        with contextlib.suppress(Exception):
            return NotAllCame(late())
    return NotAllCame(f"the store they meet on failed: {gist(exc)}")


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]
