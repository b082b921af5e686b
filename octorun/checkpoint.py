"""Checkpoints of a training run, written and read with torch.distributed.checkpoint (DCP).

A checkpoint is keyed by global layer index (``model/layers.7.attn.weight``,
``optim/layers.7.attn.weight/exp_avg``), never by stage or rank, so one written under one plan
loads under any other plan of the same model: DCP's planner matches keys, whoever holds them.
The caller builds the flat ``{key: tensor or object}`` dict of what its rank holds; several
ranks may hold one key with one value (data-parallel replicas, tied weights) and DCP writes it
once. Objects (ints, dicts, bytes) are pickled by ``torch.save`` and read back with
``weights_only=True``: plain data loads, a checkpoint cannot run code.

Layout of ``ROOT``::

    ROOT/step_00000010/             one complete checkpoint
        __0_0.distcp ...            DCP's files, one per rank that wrote something
        .metadata                   DCP's index of keys, shapes and where each is stored
        octopipe.json               {"format", "version", "step", "save_id", "meta", "crc32"}; written last
    ROOT/step_00000020.partial/     a save in progress, or one a crash interrupted

A save is atomic: every rank writes into ``step_N.partial``, DCP's finish step writes
``.metadata``, then the group's first rank writes ``octopipe.json``, renames the folder to its
final name and prunes old checkpoints. Only a folder with its final name, ``.metadata`` and
``octopipe.json`` counts, so a crash at any moment leaves the earlier checkpoints intact; the
next save removes the ``.partial`` folders it finds.

Assumptions: every rank sees ``ROOT`` and can write there (one node, or a shared filesystem;
each node may name it by another path), which :func:`check_one_root` checks at a run's start; one job saves into a
``ROOT`` at a time. Every function that takes ``group`` is collective over
it (``None``: the default group; without torch.distributed initialized, one process). Errors
the user must fix raise :class:`InputError` on every rank of the group alike, never on one rank
alone, which would leave the others waiting in a collective.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import socket
import time
import warnings
import zlib
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from octoplan.errors import InputError
from octoplan.inputs import parse_json
from octoplan.outputs import make_folders, remove_empty

__all__ = [
    "CONFIG_KEYS_APART",
    "config_differences",
    "FORMAT", "VERSION", "META_FILE", "save", "latest", "resolve", "read_meta", "load", "agree",
    "check_compatible", "check_save_root", "checkpoint_bytes", "folder_name",
]

log = logging.getLogger(__name__)

FORMAT = "octopipe-checkpoint"
VERSION = 1
META_FILE = "octopipe.json"
_DCP_INDEX = ".metadata"  # DCP's own file name (FileSystemWriter writes it in its finish step)
_PARTIAL = ".partial"
_REPLACED = ".replaced"  # a complete checkpoint of the same step, moved aside while a new one takes its name
_FINAL_NAME = re.compile(r"step_(\d{8,})")


def _folder_fix(flag: str) -> str:
    return f"give {flag} a checkpoint folder (ROOT/step_00000010) or the folder holding them"


_RESUME_FIX = _folder_fix("--resume")
_OTHER_MODEL_FIX = "resume from a complete checkpoint of this model, or start afresh without --resume"


def folder_name(step: int) -> str:
    """The final folder name of the checkpoint of ``step`` (eight digits sort as numbers do)."""
    return f"step_{step:08d}"


# -- collectives that also work in one process ----------------------------------------------------

def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _gather(obj: Any, group: Any) -> list[Any]:
    """``obj`` of every rank of ``group``, in group-rank order."""
    if not _distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


@contextmanager
def _dcp_call() -> Iterator[None]:
    """Around a DCP call: in one process (no torch.distributed), DCP warns that it assumes just
    that on every call; it is this module's documented use, not news."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _is_first(group: Any) -> bool:
    return not _distributed() or dist.get_rank(group) == 0


def _on_first(group: Any, work: Callable[[], None]) -> None:
    """Run ``work`` on the group's first rank; every rank returns, or every rank raises its error.

    The broadcast doubles as a barrier: no rank goes on before the work is done."""
    failure: Exception | None = None
    if _is_first(group):
        try:
            work()
        except Exception as exc:  # sent to the other ranks, which would otherwise wait forever
            failure = exc
    if _distributed():
        box = [_portable(failure)]
        dist.broadcast_object_list(box, group_src=0, group=group)
        if failure is None and box[0] is not None:
            failure = _rebuilt(box[0])
    if failure is not None:
        raise failure


def _portable(exc: Exception | None) -> tuple | None:
    """An error as plain data: an InputError does not survive pickling (its constructor takes
    the four parts, its args hold the joined line)."""
    if exc is None:
        return None
    if isinstance(exc, InputError):
        return ("input", exc.file, exc.field, exc.problem, exc.fix)
    return ("other", f"{type(exc).__name__}: {exc}")


def _rebuilt(parts: tuple) -> Exception:
    if parts[0] == "input":
        return InputError(*parts[1:])
    return RuntimeError(f"on the first rank: {parts[1]}")


# -- finding checkpoints ----------------------------------------------------------------------------

def _step_of(folder: Path) -> int | None:
    """The step of a folder with a final checkpoint name, else None (``.partial``, foreign)."""
    match = _FINAL_NAME.fullmatch(folder.name)
    return int(match.group(1)) if match else None


def _is_complete(folder: Path) -> bool:
    return folder.is_dir() and (folder / META_FILE).is_file() and (folder / _DCP_INDEX).is_file()


def _complete(root: Path) -> list[tuple[int, Path]]:
    """Every complete checkpoint in ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        step = _step_of(entry)
        if step is None and entry.name.endswith(_REPLACED):
            # a save of the same step cut short between moving the old copy aside and naming the
            # new one: the moved-aside folder is that step's only complete copy (the next save
            # gives it back its name)
            final = root / entry.name.removesuffix(_REPLACED)
            step = None if final.exists() else _step_of(final)
        if step is not None and _is_complete(entry):
            found.append((step, entry))
    return sorted(found)


def latest(root: str | os.PathLike) -> tuple[int, Path] | None:
    """The newest complete checkpoint in ``root`` as (step, folder); None if there is none
    (``root`` missing or empty, or holding only ``.partial`` folders). The folder may be a
    ``.replaced`` one that an interrupted save left as its step's only copy."""
    found = _complete(Path(root))
    return found[-1] if found else None


def damaged_after(root: str | os.PathLike, step: int) -> list[Path]:
    """The folders of ``root`` named as checkpoints of a later step than ``step`` that are not
    complete (a file of theirs gone: damaged, since a save renames its folder only when done),
    oldest first: what a resume from ``root`` passed over."""
    folder = Path(root)
    if not folder.is_dir():
        return []
    return sorted(entry for entry in folder.iterdir()
                  if (later := _step_of(entry)) is not None and later > step and not _is_complete(entry))


def check_save_root(root: str | os.PathLike, model: dict[str, Any]) -> None:
    """:class:`InputError` where ``root`` (``--save``) holds a complete checkpoint of another
    model than ``model`` (``model`` name, ``num_layers`` and ``resolved_config`` but for
    :data:`CONFIG_KEYS_APART`, as a resume compares them) or one whose record cannot be read:
    this run's saves would replace the one of the same step and prune the others (``--keep``)."""
    for _, path in _complete(Path(root)):
        fix = f"give --save a folder of this model's checkpoints or a new one, or move {path} away"
        try:
            meta = read_meta(path)
        except InputError as exc:
            raise InputError(exc.file, exc.field, f"{exc.problem}; it lies in --save, whose saves would replace or "
                             "prune it", fix) from None
        for key, what in (("model", "model"), ("num_layers", "layer count")):
            if key in meta and meta[key] != model[key]:
                raise InputError(str(path), "--save", f"holds a checkpoint of another {what} ({meta[key]!r}, this "
                                 f"run's is {model[key]!r}): this run's saves would replace it or prune it (--keep)",
                                 fix)
        saved, ours = meta.get("resolved_config"), model.get("resolved_config")
        differences = config_differences(saved, ours) if isinstance(saved, dict) and isinstance(ours, dict) else []
        if differences:
            raise InputError(str(path), "--save", f"holds a checkpoint of another model config (trained with "
                             f"{differences[0]}): this run's saves would replace it or prune it (--keep)", fix)


def resolve(spec: str, *, save_root: str | os.PathLike | None, flag: str = "--resume") -> Path | None:
    """The checkpoint ``--resume spec`` (or another ``flag``'s) names.

    ``"auto"`` (``--resume`` only): the latest complete checkpoint in ``save_root``, or None for a
    fresh start. A path: a checkpoint folder itself, or a folder holding ``step_*`` folders (its
    latest). Raises :class:`InputError`, naming ``flag``, when the path holds no complete
    checkpoint."""
    if spec == "auto" and flag == "--resume":
        if save_root is None:
            raise InputError(None, "--resume", "auto needs --save DIR (it resumes from that folder's latest checkpoint)",
                             "add --save DIR, or give --resume a checkpoint folder")
        found = latest(save_root)
        return None if found is None else found[1]
    path = Path(spec)
    if not path.exists():
        raise InputError(spec, flag, "does not exist", _folder_fix(flag))
    if not path.is_dir():
        raise InputError(spec, flag, "is a file, not a checkpoint folder", _folder_fix(flag))
    if _looks_like_checkpoint(path):
        read_meta(path)  # raises naming what is missing
        return path
    found = latest(path)
    if found is None:
        unfinished = sorted(p.name for p in path.iterdir() if p.name.endswith(_PARTIAL))
        problem = "holds no complete checkpoint (no step_* folder with octopipe.json and .metadata)"
        if unfinished:
            problem += f"; only unfinished saves: {', '.join(unfinished)}"
        raise InputError(spec, flag, problem, _folder_fix(flag))
    return found[1]


def _looks_like_checkpoint(path: Path) -> bool:
    """A folder meant as one checkpoint (complete or not), rather than a folder of them."""
    name = path.name.removesuffix(_PARTIAL)
    return (_FINAL_NAME.fullmatch(name) is not None or (path / META_FILE).exists()
            or (path / _DCP_INDEX).exists())


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The caller's ``meta`` dict saved with the checkpoint at ``path``, plus ``"step"``.

    Raises :class:`InputError` if ``path`` is not a complete octopipe checkpoint: missing,
    an unfinished save, a foreign folder, a garbled or newer ``octopipe.json``."""
    folder = Path(path)
    where = str(folder)
    if not folder.is_dir():
        raise InputError(where, None, "is not a checkpoint folder" if folder.exists() else "does not exist", _RESUME_FIX)
    unfinished = folder.name.endswith(_PARTIAL)
    for name in (META_FILE, _DCP_INDEX):
        if not (folder / name).is_file():
            if unfinished:
                problem = "is missing: this is an unfinished save (the run stopped while writing it)"
            else:
                problem = "is missing: not a complete octopipe checkpoint"
            raise InputError(where, name, problem, "resume from a complete checkpoint (a step_* folder without .partial)")
    meta_path = folder / META_FILE
    try:
        text = meta_path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(str(meta_path), None, f"cannot be read: {exc}", "resume from another checkpoint") from None
    record = parse_json(text, file=str(meta_path), fix="resume from another checkpoint")
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise InputError(str(meta_path), "format", f"is not {FORMAT!r}: not an octopipe checkpoint",
                         "resume from a folder octorun --save wrote")
    version, step, meta = record.get("version"), record.get("step"), record.get("meta")
    if not isinstance(version, int) or isinstance(version, bool) or version > VERSION:
        raise InputError(str(meta_path), "version", f"is {version!r}; this octorun reads up to {VERSION}",
                         "use the octorun that wrote the checkpoint")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise InputError(str(meta_path), "step", f"is {step!r}, not a step number", "resume from another checkpoint")
    if not isinstance(meta, dict):
        raise InputError(str(meta_path), "meta", f"is {type(meta).__name__}, not a mapping", "resume from another checkpoint")
    for key in ("consumed_samples", "skipped_steps"):  # counts a resume continues from
        value = meta.get(key, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise InputError(str(meta_path), f"meta.{key}", f"is {value!r:.60}, not a count of 0 or more",
                             "resume from another checkpoint: this one's record is damaged")
    crcs = record.get("crc32", {})  # absent from checkpoints written before the CRC-32s were
    if not isinstance(crcs, dict) or not all(isinstance(value, str) for value in crcs.values()):
        # a damaged record would otherwise leave the files' bytes unchecked
        raise InputError(str(meta_path), "crc32", f"is {crcs!r:.60}, not a mapping of file names to CRC-32s",
                         "resume from another checkpoint: this one's record is damaged")
    return {**meta, "step": step}


# the config keys no weight depends on (octoplan's own: the tokens per sample, where the first
# weights came from), which a resume or an export may change
CONFIG_KEYS_APART = ("seq", "weights")


def config_differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Each key of two model configs (ModelFile.resolved_config) whose values differ, beyond
    :data:`CONFIG_KEYS_APART`, as ``key=SAVED (now NOW)``, sorted."""
    keys = sorted((set(saved) | set(now)) - set(CONFIG_KEYS_APART))
    missing = "(none)"
    return [f"{key}={saved.get(key, missing)} (now {now.get(key, missing)})" for key in keys
            if saved.get(key, missing) != now.get(key, missing)]


def check_compatible(meta_saved: dict[str, Any], meta_now: dict[str, Any], path: str | os.PathLike, *,
                     weights_only: bool = False, flag: str = "--init-from", ours: str = "this run's") -> None:
    """Raise :class:`InputError` if the checkpoint at ``path`` is of another model than this run's
    (its ``model`` name or ``num_layers`` differ, or its ``resolved_config`` beyond
    :data:`CONFIG_KEYS_APART`) or was trained with another ``optimizer`` (whose
    state the run cannot take up), or if both read a token file and the file
    (``data_fingerprint``, ``data_sampled_digest``), the windows' length (``tokens_per_sample``) or the seed of their
    order (``seed``) differ: the checkpoint's
    position in the data belongs to its own order. A checkpoint lacking a field is not judged on
    it, and a run without ``--data`` is not judged on the data. ``weights_only`` (``--init-from``,
    which takes the weights alone, and ``export --format hf``; ``flag`` names the option that gave
    the checkpoint, ``ours`` what it is compared with): only the model is judged."""
    for key, what in (("model", "model"), ("num_layers", "layer count")):
        if key in meta_saved and key in meta_now and meta_saved[key] != meta_now[key]:
            raise InputError(str(path), key, f"the checkpoint's {what} is {meta_saved[key]!r}, {ours} is {meta_now[key]!r}",
                             f"give {flag} a checkpoint of this model" if weights_only else
                             "resume from a checkpoint of this model, or start afresh without --resume")
    if weights_only:
        return
    saved_config, config = meta_saved.get("resolved_config"), meta_now.get("resolved_config")
    if isinstance(saved_config, dict) and isinstance(config, dict):
        differences = config_differences(saved_config, config)
        if differences:
            raise InputError(str(path), "resolved_config", f"the checkpoint's model was trained with {differences[0]}"
                             f"{f' and {len(differences) - 1} more differences' if len(differences) > 1 else ''}",
                             "resume under a plan of the model config the checkpoint was trained with, or take its "
                             "weights alone with --init-from")
    if "optimizer" in meta_saved and "optimizer" in meta_now and meta_saved["optimizer"] != meta_now["optimizer"]:
        raise InputError(str(path), "optimizer", f"the checkpoint was trained with {meta_saved['optimizer']}, this run's "
                         f"--optimizer is {meta_now['optimizer']}",
                         f"give --optimizer {meta_saved['optimizer']}: the checkpoint holds that optimizer's state")
    if not meta_saved.get("data") or "data_fingerprint" not in meta_now:
        return
    saved_file = meta_saved.get("data_fingerprint")
    if saved_file is not None and saved_file != meta_now["data_fingerprint"]:
        raise InputError(str(path), "data_fingerprint",
                         f"the checkpoint was trained on {saved_file} ({meta_saved['data']}), this run's --data is "
                         f"{meta_now['data_fingerprint']}",
                         "give --data the token file the checkpoint was trained on: its position is a place in that file's order")
    sampled = meta_saved.get("data_sampled_digest")
    if sampled is not None and meta_now.get("data_sampled_digest") not in (None, sampled):
        raise InputError(str(path), "data_sampled_digest",
                         f"this run's --data holds as many tokens as the checkpoint's ({meta_saved['data']}), alike at "
                         f"both ends, but blocks sampled through it differ (digest {meta_now['data_sampled_digest']}, "
                         f"the checkpoint's {sampled}): it was changed inside",
                         "give --data the token file the checkpoint was trained on: its position is a place in that file's order")
    saved_length, length = meta_saved.get("tokens_per_sample"), meta_now.get("tokens_per_sample")
    if saved_length is not None and length is not None and saved_length != length:
        raise InputError(str(path), "tokens_per_sample",
                         f"the checkpoint read its token file in windows of {saved_length} tokens, this run's model "
                         f"reads {length}", "resume under the model config the checkpoint was trained with (its seq): "
                         "in windows of another length the run would read some tokens twice and skip others")
    if "seed" in meta_saved and meta_saved["seed"] != meta_now["seed"]:
        raise InputError(str(path), "seed", f"the checkpoint read its token file in the order of --seed {meta_saved['seed']}, "
                         f"this run's is --seed {meta_now['seed']}",
                         f"resume with --seed {meta_saved['seed']}: in another order the run would read some windows twice and skip others")


def checkpoint_bytes(path: str | os.PathLike) -> dict[str, int]:
    """Bytes of every file in the checkpoint folder, by its path relative to the folder."""
    folder = Path(path)
    return {p.relative_to(folder).as_posix(): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


# -- one run a root -------------------------------------------------------------------------------

LOCK_FILE = ".octorun.lock"
_HELD: dict[Path, tuple[Any, bool]] = {}  # root (resolved) -> (the open lock file held for life, made here)


def hold_root(root: Path) -> None:
    """Make this process (a job's first rank) the one that saves into ``root``: an exclusive
    ``flock`` on ``root/.octorun.lock``, which the kernel lets go when the process ends, however
    it ends (a crashed, killed or preempted run holds nothing, and ``torchrun --max-restarts``
    takes it again). Two runs saving into one root at once would remove each other's partial
    saves and prune each other's checkpoints: a root another live process holds is bad input. On
    a file system without locks (some network mounts) the root goes unguarded, as without this."""
    key = root.resolve()
    if key in _HELD:
        return
    try:
        import fcntl
    except ImportError:  # not POSIX
        return
    made = not (root / LOCK_FILE).exists()
    try:
        handle = open(root / LOCK_FILE, "a+", encoding="utf-8")
    except OSError as exc:
        raise _unwritable(root, exc) from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "a live process"
        handle.close()
        raise InputError(str(root), "--save", f"another run saves into it now ({holder}, holding {LOCK_FILE}): the "
                         "two would remove each other's saves and prune each other's checkpoints",
                         "give this run a --save folder of its own, or stop the other run first") from None
    except OSError as exc:
        log.debug("%s: no lock on this file system (%s); the root goes unguarded", root, exc)
        handle.close()
        return
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    handle.flush()
    _HELD[key] = (handle, made)


def let_go_of_roots() -> None:
    """Let go of every root this process holds, removing the lock files it made: for a run that
    bad input ends, which leaves nothing behind."""
    for key, (handle, made) in list(_HELD.items()):
        if made:
            with suppress(OSError):
                (key / LOCK_FILE).unlink()
        handle.close()
        del _HELD[key]


# -- saving ----------------------------------------------------------------------------------------

def save(root: str | os.PathLike, step: int, state: dict[str, Any], *, meta: dict[str, Any], group: Any,
         keep: int) -> Path:
    """Write ``state`` (this rank's share) as the checkpoint of ``step`` in ``root``; collective.

    ``meta`` (the group's first rank's is kept) must be JSON; ``read_meta`` returns it with
    ``"step"`` added. Keeps the ``keep`` newest complete checkpoints by step, and always the one
    just written. Returns the final folder, ``root/step_<step:08d>``."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, not {step!r}")
    if keep < 1:
        raise ValueError(f"keep must be at least 1, not {keep}")
    if meta.get("step", step) != step:
        raise ValueError(f"meta['step'] is {meta['step']!r} but the checkpoint is of step {step}")
    root = Path(root)
    final = root / folder_name(step)
    partial = root / (final.name + _PARTIAL)
    # save_id: two saves of one step differ in their octopipe.json even with equal meta
    # (saved_by below tells nodes given different copies apart)
    record: dict[str, Any] = {"format": FORMAT, "version": VERSION, "step": step, "save_id": secrets.token_hex(8),
                              "meta": meta}

    def prepare() -> None:
        json.dumps(record)  # first: meta that is not JSON stops the save before anything is written
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise _unwritable(root, exc) from None
        hold_root(root)  # before removing unfinished saves: they may be another live run's
        try:
            _remove_unfinished(root)
            partial.mkdir()
        except OSError as exc:
            raise _unwritable(root, exc) from None

    _on_first(group, prepare)
    try:
        with _dcp_call():
            written = dcp.save(state, storage_writer=dcp.FileSystemWriter(partial, single_file_per_rank=True, sync_files=True),
                     planner=DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
                     process_group=group)
    except CheckpointException as exc:  # a BaseException: turn it into an error callers catch
        raise _failed(partial, "written", exc) from None
    # each data file's CRC-32, the files shared out over the ranks: a resume finds damaged
    # bytes by them before it loads anything (a size check sees only cut files)
    files = sorted({info.relative_path for info in (written.storage_data or {}).values()})
    me, world = (dist.get_rank(group), dist.get_world_size(group)) if _distributed() else (0, 1)
    crcs: dict[str, str] = {}
    for shares in _gather({name: _crc32(partial / name) for name in files[me::world]}, group):
        crcs.update(shares)

    def publish() -> None:
        try:
            _write_synced(partial / META_FILE, json.dumps({**record, "crc32": crcs}, indent=1))
            _fsync_dir(partial)
            replaced = root / (final.name + _REPLACED)
            if final.exists():  # the same step saved again (a resumed run): the new one wins
                if replaced.exists():
                    shutil.rmtree(replaced)
                final.rename(replaced)
            partial.rename(final)
            _fsync_dir(root)
            if replaced.exists():
                shutil.rmtree(replaced)
            _prune(root, final, keep)
        except OSError as exc:
            raise _unwritable(root, exc) from None

    _on_first(group, publish)
    return final


def _remove_unfinished(root: Path) -> None:
    """Remove what interrupted saves left: ``.partial`` folders, and ``.replaced`` ones whose
    step has a complete checkpoint again (else the moved-aside one is the only copy: restore it)."""
    for entry in root.iterdir():
        if not entry.is_dir():
            continue
        # only names a save makes: a user's own "notes.partial" stays
        if entry.name.endswith(_PARTIAL) and _FINAL_NAME.fullmatch(entry.name.removesuffix(_PARTIAL)):
            shutil.rmtree(entry)
        elif entry.name.endswith(_REPLACED) and _FINAL_NAME.fullmatch(entry.name.removesuffix(_REPLACED)):
            final = root / entry.name.removesuffix(_REPLACED)
            if final.exists():
                shutil.rmtree(entry)
            else:
                entry.rename(final)


def _prune(root: Path, kept: Path, keep: int) -> None:
    found = _complete(root)
    newer = [path.name for step, path in found if step > _step_of(kept)]
    if newer:
        # Left alone (another run's, resumed from an earlier step): but --resume auto picks the newest.
        log.warning("%s holds checkpoints of later steps than %s (%s): --resume auto would resume from %s",
                    root, kept.name, ", ".join(newer), newer[-1])
    survivors = {path for _, path in found[-keep:]} | {kept}
    for _, path in found:
        if path not in survivors:
            # renamed first: a deletion cut short leaves an unfinished save, not a checkpoint with holes
            doomed = path.with_name(path.name + _PARTIAL)
            path.rename(doomed)
            shutil.rmtree(doomed)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (its directory entry)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unwritable(root: Path, exc: OSError) -> InputError:
    reason = exc.strerror or str(exc)
    where = exc.filename or root
    return InputError(str(root), None, f"cannot write the checkpoint: {reason} ({where})",
                      "give --save a folder this job can write, with room for a checkpoint")


def _failed(folder: Path, verb: str, exc: CheckpointException) -> Exception:
    """One error for a DCP failure: an InputError naming the file for a filesystem's refusal or
    for damaged bytes found on reading, else a RuntimeError with every failed rank's reason."""
    reasons = []
    for rank, failure in sorted(exc.failures.items()):
        error = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(error, OSError):
            name = Path(error.filename).name if error.filename else None
            return InputError(str(folder), name, f"could not be {verb} by rank {rank}: {error.strerror or error}",
                              "check the folder's files, space and permissions")
        if verb == "written" and "inline_container" in str(error):
            # torch's file writer reports a refused write (a full disk, a file size limit) as a
            # RuntimeError from C++ ("failed writing file", "unexpected pos"), its errno lost
            detail = " ".join(str(error).split()).split("] ", 1)[-1].strip(" .")
            return InputError(str(folder), None, f"could not be written by rank {rank}: torch's file writer failed "
                              f"({detail})", "check the folder's free space and its file size limit: ulimit -f")
        if verb == "read":
            # the files passed the check (present, their sizes those the index names), so a
            # read that still fails to decode them means their bytes are damaged: bad input
            return InputError(str(folder), None, f"could not be read by rank {rank}: a file is damaged "
                              f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})",
                              "resume from another checkpoint (--resume DIR), or from the one before it")
        reasons.append(f"rank {rank}: {type(error).__name__}: {error}")
    return RuntimeError(f"the checkpoint {folder} could not be {verb}: {'; '.join(reasons)}")


# -- loading ---------------------------------------------------------------------------------------

@dataclass
class _Check:
    """One rank's verdict on loading its keys from a checkpoint, before anything is read."""

    unreadable: tuple | None = None  # octopipe.json or .metadata could not be read: the error's parts
    bad_files: dict[str, str] = field(default_factory=dict)  # file name -> what is wrong with it
    missing: list[str] = field(default_factory=list)  # keys needed that the checkpoint lacks
    mismatched: dict[str, tuple[str, str]] = field(default_factory=dict)  # key -> (saved, here)
    missing_optional: set[str] = field(default_factory=set)
    taken: set[str] = field(default_factory=set)  # with whole_prefixes: this rank's keys under them
    saved_whole: set[str] = field(default_factory=set)  # the checkpoint's keys under them (the first rank's look)


class _LoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, but objects are read back as plain data (no code runs)."""

    def __init__(self) -> None:
        # not flattened: one state key is one checkpoint key, whatever its value is (a dict too)
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def load_bytes(self, read_item, value) -> None:
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


def load(path: str | os.PathLike, state: dict[str, Any], *, group: Any,
         optional_prefixes: tuple[str, ...] = (), whole_prefixes: tuple[str, ...] = (),
         other_model_fix: str = _OTHER_MODEL_FIX) -> set[str]:
    """Fill ``state`` in place from the checkpoint at ``path``; collective.

    Tensors are copied into the caller's tensors (any device); objects are replaced in
    ``state``. Keys starting with one of ``optional_prefixes`` may be absent from the checkpoint
    (per-rank RNG states under another world) or differ in shape, dtype or kind: those are left
    as they are and returned. Under ``whole_prefixes`` the group's states together take every key
    of the checkpoint (a whole model: one the checkpoint holds more of is another model, say one
    whose head was not tied); ``other_model_fix`` is the fix a checkpoint of another model names.
    Any other problem raises :class:`InputError` on every rank before
    a single value is loaded: missing, truncated or damaged files, keys the checkpoint lacks or
    holds beyond the model, shapes, dtypes or kinds that differ."""
    folder = Path(path)
    try:
        verdict = _check(folder, state, optional_prefixes, whole_prefixes, first=_is_first(group))
    except Exception as exc:  # a filesystem's refusal: still gathered, or the other ranks would wait
        verdict = _Check(unreadable=(str(folder), None, f"cannot be checked: {type(exc).__name__}: {exc}", None))
    verdicts = _gather(verdict, group)
    error = _first_error(folder, verdicts, other_model_fix)
    if error is not None:
        raise error
    mine = verdicts[dist.get_rank(group) if _distributed() else 0]
    wanted = {key: value for key, value in state.items() if key not in mine.missing_optional}
    try:
        with _dcp_call():
            dcp.load(wanted, storage_reader=dcp.FileSystemReader(folder), planner=_LoadPlanner(), process_group=group)
    except CheckpointException as exc:  # files that changed since the check: a BaseException, so converted
        raise _failed(folder, "read", exc) from None
    for key, value in wanted.items():
        if not isinstance(value, torch.Tensor):
            state[key] = value
    return mine.missing_optional


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{list(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    return "an object"


def _describe_saved(entry: Any) -> str:
    if isinstance(entry, TensorStorageMetadata):
        return f"{list(entry.size)} {str(entry.properties.dtype).removeprefix('torch.')}"
    return "an object"


def _check(folder: Path, state: dict[str, Any], optional_prefixes: tuple[str, ...],
           whole_prefixes: tuple[str, ...] = (), *, first: bool = True) -> _Check:
    verdict = _Check()
    try:
        read_meta(folder)
    except InputError as exc:
        verdict.unreadable = _portable(exc)[1:]
        return verdict
    try:
        index: Metadata = dcp.FileSystemReader(folder).read_metadata()
    except Exception as exc:  # pickle, truncation, permissions: whatever it is, it is this file's
        verdict.unreadable = (str(folder / _DCP_INDEX), None, f"cannot be read: {type(exc).__name__}: {exc}",
                              "resume from another checkpoint")
        return verdict
    saved = index.state_dict_metadata
    if whole_prefixes:
        verdict.taken = {key for key in state if key.startswith(whole_prefixes)}
        if first:
            verdict.saved_whole = {key for key in saved if key.startswith(whole_prefixes)}
    for key, value in state.items():
        if key not in saved:
            if key.startswith(tuple(optional_prefixes)):
                verdict.missing_optional.add(key)
            else:
                verdict.missing.append(key)
            continue
        entry = saved[key]
        if isinstance(value, torch.Tensor):
            # DCP would convert a dtype silently and stop half-way at a shape: both are another model's
            same = (isinstance(entry, TensorStorageMetadata) and tuple(entry.size) == tuple(value.shape)
                    and entry.properties.dtype == value.dtype)
        else:
            same = isinstance(entry, BytesStorageMetadata)
        if same:
            continue
        if key.startswith(tuple(optional_prefixes)):
            # an optional value that cannot be restored (an RNG state of another device kind or
            # torch version) is as good as absent: left as it is, and reported
            verdict.missing_optional.add(key)
        else:
            verdict.mismatched[key] = (_describe_saved(entry), _describe(value))
    needed = set(state) - verdict.missing_optional - set(verdict.missing)
    verdict.bad_files = _check_files(folder, index, needed)
    return verdict


def _crc32(path: Path) -> str:
    """The CRC-32 of a file's bytes, as 8 hex digits (zlib's, read in chunks: several GB/s from
    the page cache, so the file's read is what it costs)."""
    value = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CRC_CHUNK):
            value = zlib.crc32(chunk, value)
    return f"{value:08x}"


_CRC_CHUNK = 1 << 24


def _recorded_crcs(folder: Path) -> dict[str, str]:
    """The CRC-32s octopipe.json records (none in checkpoints written before they were)."""
    try:
        crcs = json.loads((folder / META_FILE).read_text()).get("crc32")
    except (OSError, ValueError, AttributeError, RecursionError):  # (read_meta has refused such a record)
        return {}
    return crcs if isinstance(crcs, dict) else {}


def _check_files(folder: Path, index: Metadata, keys: set[str]) -> dict[str, str]:
    """What is wrong with the files that hold ``keys``: missing, shorter than the index says, or
    bytes whose CRC-32 is not the one the save recorded."""
    needs: dict[str, tuple[int, int, str]] = {}  # file -> (bytes needed, entries, first key)
    for where, info in (index.storage_data or {}).items():
        if where.fqn not in keys:
            continue
        name = info.relative_path
        end, count, first = needs.get(name, (0, 0, where.fqn))
        needs[name] = (max(end, info.offset + info.length), count + 1, min(first, where.fqn))
    bad = {}
    for name, (end, count, first) in sorted(needs.items()):
        path = folder / name
        if not path.is_file():
            bad[name] = f"is missing (it holds {count} entries, e.g. {first})"
        elif path.stat().st_size < end:
            bad[name] = f"is truncated: {path.stat().st_size} bytes, the index needs {end}"
    recorded = _recorded_crcs(folder)
    for name in sorted(set(needs) - set(bad)):
        found = _crc32(folder / name) if name in recorded else None
        if found is not None and found != recorded[name]:
            bad[name] = f"is damaged: its bytes' CRC-32 is {found}, the save recorded {recorded[name]}"
    return bad


def _first_error(folder: Path, verdicts: list[_Check], fix: str) -> InputError | None:
    """The one error every rank raises, built from all ranks' verdicts alike; ``fix`` for a
    checkpoint of another model."""
    where = str(folder)
    for verdict in verdicts:
        if verdict.unreadable:
            return InputError(*verdict.unreadable)
    bad_files: dict[str, str] = {}
    for verdict in verdicts:
        bad_files.update(verdict.bad_files)
    if bad_files:
        name = sorted(bad_files)[0]
        others = f" ({len(bad_files) - 1} more files too)" if len(bad_files) > 1 else ""
        return InputError(where, name, bad_files[name] + others, "copy the whole checkpoint folder, or resume from another")
    missing = sorted({key for verdict in verdicts for key in verdict.missing})
    if missing:
        examples = ", ".join(missing[1:4])
        problem = "is not in the checkpoint"
        if len(missing) > 1:
            problem += f", nor are {len(missing) - 1} more keys this model needs (e.g. {examples})"
        return InputError(where, missing[0], problem + ": it holds another model's state", fix)
    mismatched: dict[str, tuple[str, str]] = {}
    for verdict in verdicts:
        mismatched.update(verdict.mismatched)
    if mismatched:
        key = sorted(mismatched)[0]
        saved, here = mismatched[key]
        others = f" ({len(mismatched) - 1} more keys differ too)" if len(mismatched) > 1 else ""
        return InputError(where, key, f"is {saved} in the checkpoint but {here} in this model{others}", fix)
    untaken = sorted(set().union(*(v.saved_whole for v in verdicts)) - set().union(*(v.taken for v in verdicts)))
    if untaken:
        more = f", nor {len(untaken) - 1} more of its keys (e.g. {', '.join(untaken[1:4])})" if len(untaken) > 1 else ""
        return InputError(where, untaken[0], f"is in the checkpoint but no layer of this model takes it{more}: it holds "
                          "another model's state (another config: a tied or untied head, other parameters)", fix)
    return None


# -- resuming --------------------------------------------------------------------------------------

def check_one_root(root: str | os.PathLike, *, group: Any) -> None:
    """Check that every rank of ``group`` saves into one folder; collective. Each node names its
    own ``root`` (the paths may differ), but a rank whose ``root`` is another folder (a node's
    local disk) would write its share where the first rank never looks: every checkpoint would
    lack it, and only a resume would tell. So the group's first rank leaves a marker file in its
    ``root``, and every rank looks for it in its own, then writes and removes a file of its own
    there: a node that sees the folder through a read-only mount would otherwise fail at the
    first save, hours into training. Raises :class:`InputError` on every rank alike, naming the
    ranks that do not see the marker, else those that cannot write."""
    root = Path(root)
    marker: list[str] = []
    created: list[Path] = []  # the folders made for the marker, outermost first

    def leave_marker() -> None:
        name = f".octorun-marker-{secrets.token_hex(8)}"
        try:
            created.extend(make_folders(root))
            (root / name).write_text("every rank of the job looks for this file in its --save folder\n")
        except OSError as exc:  # (a full disk, a quota): nothing stays behind, the marker nor its folders
            with suppress(OSError):
                (root / name).unlink()
            remove_empty(created)
            raise _unwritable(root, exc) from None
        marker.append(name)

    _on_first(group, leave_marker)
    name = _gather(marker[0] if marker else None, group)[0]
    me = dist.get_rank() if _distributed() else 0
    seen = _sees(root / name)
    found = _gather((me, seen, str(root), _cannot_write(root) if seen else None), group)
    if marker:
        with suppress(OSError):  # a marker left behind is harmless: it is hidden and tiny
            (root / name).unlink()
        # a run stopped by bad input leaves no folder; the first save makes them again (a
        # folder another job has put something in since is not empty, so it stays)
        remove_empty(created)
    blind = [(rank, where) for rank, seen, where, _ in found if not seen]
    if blind:
        raise InputError(None, "--save", f"is another folder on {_listed(blind)} than on rank {found[0][0]} "
                         f"({found[0][2]}): their shares of every checkpoint would be missing from it",
                         "give every node the same folder: one node, or a file system all nodes share")
    refused = [(rank, f"{where}: {why}") for rank, _, where, why in found if why is not None]
    if refused:
        raise InputError(None, "--save", f"cannot be written on {_listed(refused)}",
                         "give every node write access to the folder: a read-write mount of the shared file system")
    # the first rank alone decides (a root that does not exist yet is taken at the first save)
    _on_first(group, lambda: hold_root(root) if root.is_dir() else None)


def _listed(ranks: list[tuple[int, str]]) -> str:
    """``rank 2 (/mnt/ckpt), rank 3 (...)``, the first four."""
    return ", ".join(f"rank {rank} ({what})" for rank, what in ranks[:4]) + (", ..." if len(ranks) > 4 else "")


def _cannot_write(root: Path) -> str | None:
    """Why this rank cannot create a file in ``root`` (None: it can). The probe file is removed."""
    probe = root / f".octorun-probe-{secrets.token_hex(8)}"
    try:
        probe.write_bytes(b"")
    except OSError as exc:
        return exc.strerror or str(exc)
    with suppress(OSError):
        probe.unlink()
    return None


def _sees(marker: Path, tries: int = 3) -> bool:
    """Whether this rank sees ``marker``. A network file system may answer from its cache that a
    folder it looked at before (prepare checks --save) is still missing: listing the folders
    again refreshes it, so a miss is retried for a few seconds. A folder this rank may not
    enter counts as not seen."""
    for attempt in range(tries):
        try:
            if marker.exists():
                return True
            for folder in (marker.parent.parent, marker.parent):
                with suppress(OSError):
                    os.listdir(folder)
        except OSError:
            return False
        if attempt + 1 < tries:
            time.sleep(1.0)
    return False


def saved_by(path: str | os.PathLike) -> str:
    """Which save wrote the checkpoint at ``path``: a digest of its ``octopipe.json``, which
    holds a random id per save, so copies of one checkpoint agree and two saves of one step
    (two runs, or a node's stale copy) do not."""
    return hashlib.sha256((Path(path) / META_FILE).read_bytes()).hexdigest()[:12]


def agree(step: int | None, *, group: Any, save: str | None = None, flag: str = "--resume") -> None:
    """Check that every rank of ``group`` resumes the same ``step`` (None: a fresh start) of the
    same ``save`` (:func:`saved_by`), or with ``flag="--init-from"`` takes its weights from the
    same one; collective. Raises :class:`InputError` naming the ranks and
    what each found, e.g. ``ranks 0,1 found step 20, rank 2 found step 10``."""
    me = dist.get_rank() if _distributed() else 0
    found = _gather((me, step, save), group)
    if len({(s, by) for _, s, by in found}) <= 1:
        return
    by_checkpoint: dict[tuple[int | None, str | None], list[int]] = {}
    for rank, s, by in sorted(found, key=lambda item: item[0]):
        by_checkpoint.setdefault((s, by), []).append(rank)
    steps = [s for s, _ in by_checkpoint]
    parts = []
    for (s, by), ranks in sorted(by_checkpoint.items(), key=lambda item: item[1][0]):
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {','.join(map(str, ranks))}"
        which = f" (save {by})" if steps.count(s) > 1 else ""  # one step, two saves: say which
        parts.append(f"{who} found {'no checkpoint' if s is None else f'step {s}'}{which}")
    raise InputError(None, flag, f"the ranks would {'resume' if flag == '--resume' else 'start'} from different "
                     f"checkpoints: {', '.join(parts)}",
                     f"give every node the same checkpoint folder (a shared filesystem), or {flag} one checkpoint folder")
