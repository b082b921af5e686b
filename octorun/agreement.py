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
import socket
from pathlib import Path
from typing import Any

from octoplan.errors import InputError
from octoplan.plan import Plan, plan_to_dict
from octoplan.yamlio import file_sha256
from octorun.watchdog import gist

# The options every process must run with alike (RunConfig field: its flag). --timeout and the
# output paths may differ from node to node; --save, --data and --resume must at least be given
# on every node or on none (their paths are each node's own), and --data's files must match
# (their fingerprint holds the token type, which --data-dtype may name or leave to the file).
AGREED_OPTIONS = {
    "steps": "--steps", "seed": "--seed", "optimizer": "--optimizer", "lr": "--lr", "weight_decay": "--weight-decay",
    "betas": "--betas", "grad_clip": "--grad-clip", "lr_schedule": "--lr-schedule", "warmup_steps": "--warmup-steps",
    "min_lr": "--min-lr", "decay_steps": "--decay-steps", "skip_nonfinite": "--skip-nonfinite",
    "precision": "--precision", "replay_time_scale": "--replay", "dynamic_shapes": "--dynamic-shapes",
    "activation_memory": "--activation-memory", "save_every": "--save-every", "keep": "--keep",
}
GIVEN_OR_NOT = {"save_dir": "--save", "data_path": "--data", "resume": "--resume"}
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


def identity(config: Any, plan: Plan, model_path: str, backend: str, data: Any = None) -> dict[str, str]:
    """What every process must share, by name: the plan's contents, the model file's bytes (a
    digest of each), the training options as they would be printed, and the token file
    (``data``, octorun.data.TokenData: its fingerprint; each node may read its own copy)."""
    parts = {
        "plan": _digest(json.dumps(plan_to_dict(plan), sort_keys=True, default=str).encode()),
        # a Hugging Face model ("hf:FOLDER") is its folder, which the plan's source names
        "model file": file_sha256(model_path) if Path(model_path).is_file() else model_path,
        "--backend": backend,
    }
    for name, flag in AGREED_OPTIONS.items():
        value = getattr(config, name)
        parts[flag] = " ".join(map(str, value)) if isinstance(value, (tuple, list)) else str(value)
    for name, flag in GIVEN_OR_NOT.items():
        parts[flag] = "given" if getattr(config, name) is not None else "not given"
    if data is not None:
        parts["--data"] = data.fingerprint()
    return parts


def mismatch(mine: dict[str, str], first: dict[str, str], first_where: str, *, rank: int, node: str, plan_path: str,
             model_path: str) -> InputError | None:
    """How this process's identity differs from rank 0's, as the error this process reports
    (any process of its node may print it, so it names the rank)."""
    here = f"rank {rank} ({node})"
    there = f"rank 0's ({first_where})"
    for name, value in mine.items():
        theirs = first.get(name)
        if theirs == value:
            continue
        if name == "plan":
            return InputError(plan_path, None, f"given to {here} is another plan than {there}",
                              "give every node the same plan file")
        if name == "model file":
            return InputError(model_path, None, f"run by {here} differs from the model file of {there}",
                              "give every node the same model file")
        return InputError(None, name, f"is {value} on {here} but {theirs} on rank 0 ({first_where})", SAME_EVERYWHERE_FIX)
    return None


def meeting_store(store: Any) -> Any:
    """The keys of this process's next meeting on the job's ``store``."""
    import torch.distributed as dist

    return dist.PrefixStore(f"inputs/{next(_MEETINGS)}/", store)


def agree(store: Any, *, rank: int, world: int, error: InputError | None, parts: dict[str, str] | None,
          plan_path: str, model_path: str | None, timeout: datetime.timedelta, speaks_alone: bool = False,
          node: str | None = None) -> None:
    """Meet every process of the job on ``store`` (:func:`meeting_store`); return when every
    input is good.

    ``error`` is this process's own bad input (None: it read everything well) and ``parts`` its
    :func:`identity` (None where its input could not be read). ``speaks_alone``: this process
    reports its own error whatever its node's other processes found (a launch variable of its
    own); ``node``: this process's node (:func:`where`). Raises :class:`JobStopped` when any
    process's input is bad, and :class:`NotAllCame` when the processes did not all meet in time.
    """
    node = node or where()
    keys = store
    try:
        if rank == 0:
            keys.set("rank0", json.dumps({"where": node, "parts": parts}))
        first = json.loads(keys.get("rank0"))  # waits for rank 0 (the store's deadline)
        if error is None and rank != 0 and parts is not None and first["parts"] is not None:
            error = mismatch(parts, first["parts"], first["where"], rank=rank, node=node, plan_path=plan_path,
                             model_path=model_path or "")
        speaker = keys.compare_set(f"speaker/{node}", "", str(rank)) == str(rank).encode()
        if error is not None:
            keys.compare_set(f"bad/{node}", "", f"rank {rank}: {error.line()}")
            keys.compare_set("bad", "", f"rank {rank} ({node}): {error.line()}")
        _all_reach(keys, "arrived", world, timeout)
        if not keys.check(["bad"]):
            return
        own_node = keys.get(f"bad/{node}").decode() if keys.check([f"bad/{node}"]) else None
        first_bad = keys.get("bad").decode()
    except Exception as exc:
        raise NotAllCame(gist(exc)) from None
    # nobody leaves before all have read: the store may live in a process that leaves. A
    # failure here only ends the wait: this process read what it needs
    with contextlib.suppress(Exception):
        _all_reach(keys, "read", world, timeout)
    if error is not None and (speaks_alone or speaker):
        raise JobStopped(error.line())
    if not speaker:
        raise JobStopped(None)
    # the speaker's own input was good: its node's first bad process, else the job's first
    raise JobStopped(own_node if own_node is not None else first_bad)


def _all_reach(keys: Any, point: str, world: int, timeout: datetime.timedelta) -> None:
    """A barrier on the store: the last process to reach ``point`` opens it for all."""
    if keys.add(point, 1) == world:
        keys.set(f"{point}/all", "1")
    keys.wait([f"{point}/all"], timeout)


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]
