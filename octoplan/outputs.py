"""Output files: checked before the work that fills them, written whole or not at all.

A command that searches for a minute or measures a model must not find out at the end that its
``-o`` cannot be written, and a write that fails halfway (a full disk, a file-size limit) must
leave neither a truncated file nor an emptied old one behind: the text goes to a temporary
file beside the target, which then replaces the target in one rename.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Collection
from pathlib import Path

from octoplan.errors import InputError

__all__ = ["check_writable", "check_distinct", "write_text", "write_bytes", "StreamedOutput", "partial_path", "new_file_mode",
           "make_folders", "remove_empty"]


def _cannot(path: Path, flag: str | None, exc: OSError) -> InputError:
    what = f"{flag} cannot be written" if flag else "cannot write"
    return InputError(str(path), None, f"{what}: {exc.strerror or exc}", "give a writable file path")


def _target(path: str | Path) -> Path:
    """Where writing ``path`` lands: a symbolic link's target, not the link (which the rename
    of :func:`write_text` would otherwise replace by a file)."""
    target = Path(path)
    # realpath, not Path.resolve: a loop of links is no error here; it then fails to be written
    return Path(os.path.realpath(target)) if target.is_symlink() else target


def check_writable(path: str | Path, flag: str | None = None, *, inputs: tuple[str | Path | None, ...] = ()) -> None:
    """Fail now, not after the work, when ``path`` cannot be written. Creates nothing that
    stays: a throw-away file beside ``path`` where its folder exists (never ``path`` itself, so
    several processes may check one path at once), else a look at the nearest folder that
    does; the write makes the missing folders, so a command that fails leaves none behind.
    ``inputs``: files the command reads, which ``path`` must not overwrite."""
    if str(path).endswith(("/", os.sep)):  # Path() drops the slash, and would write a file there
        raise InputError(str(path), None, f"{flag or 'the output'} names a folder (it ends in /)", "give a file path")
    target = _target(path)
    for source in inputs:
        if source is None:
            continue
        if target.exists() and Path(source).exists() and target.samefile(source):
            raise InputError(str(path), None, f"{flag or '-o'} names the input file {source}, which writing would destroy",
                             "write to another file")
        if not Path(source).exists() and target.resolve() == Path(source).resolve():
            # an input the command reads where it exists (a token file's Megatron index): a
            # file written there would be read as one, by this run or the next
            raise InputError(str(path), None, f"{flag or '-o'} names {source}, where this command looks for an input",
                             "write to another file")
    if target.is_symlink():  # still a link after following links: a loop of them
        raise InputError(str(path), None, f"{flag or 'the output'} names a loop of symbolic links", "give a file path")
    if target.is_dir():
        raise InputError(str(path), None, f"{flag or 'the output'} names a folder", "give a file path")
    if target.exists() and not target.is_file():  # a device or FIFO would be replaced by a plain file
        raise InputError(str(path), None, f"{flag or 'the output'} names a device, FIFO or socket, not a file",
                         "give a file path")
    try:
        if target.parent.is_dir():
            handle, probe = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".check", dir=target.parent)
            os.close(handle)
            os.unlink(probe)
        else:
            _check_can_make(target.parent)
        if target.exists() and not os.access(target, os.W_OK):
            raise PermissionError(13, "Permission denied", str(target))
    except OSError as exc:
        raise _cannot(target, flag, exc) from None


def _check_can_make(folder: Path) -> None:
    """``folder`` is missing: its nearest existing ancestor must be a folder this process may
    create entries in."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise NotADirectoryError(20, "Not a directory", str(existing))
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(13, "Permission denied", str(existing))


def check_distinct(outputs: dict[str, str | Path | None], *, folders: Collection[str] = ()) -> None:
    """Two outputs of one command (``{flag: path}``) must not name one file: the second
    written would silently replace the first. ``folders``: the flags whose output is a folder
    (``--save``), so the line says "path" where one of them is involved."""
    seen: dict[Path, str] = {}
    for flag, path in outputs.items():
        if path is None:
            continue
        key = Path(os.path.realpath(path))  # a/../m and a link to a folder name one file too
        if key in seen:
            noun = "path" if flag in folders or seen[key] in folders else "file"
            raise InputError(str(path), None, f"{flag} names the {noun} {seen[key]} names too, so one output would be lost",
                             f"give each output its own {noun}")
        seen[key] = flag


def _mode_for(target: Path) -> int:
    """The old file's permissions, or those a plain ``open`` would give a new one."""
    if target.exists():
        return target.stat().st_mode & 0o7777
    return new_file_mode()


def new_file_mode() -> int:
    """The permissions a plain ``open`` gives a new file: 0666 less the umask."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_text(path: str | Path, text: str, *, flag: str | None = None, newline: str | None = None) -> None:
    """Write ``text`` to ``path`` atomically: on any failure the old file (if any) is untouched
    and no partial file remains. ``newline`` as for :func:`open` (``""``: write line endings
    as they are, which the csv module needs)."""
    _write_atomically(path, lambda handle: os.fdopen(handle, "w", encoding="utf-8", newline=newline), text, flag)


def write_bytes(path: str | Path, data: bytes, *, flag: str | None = None) -> None:
    """:func:`write_text` for bytes (a safetensors file)."""
    _write_atomically(path, lambda handle: os.fdopen(handle, "wb"), data, flag)


def _write_atomically(path: str | Path, opened, payload: str | bytes, flag: str | None) -> None:
    target = _target(path)
    probe = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, probe = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        with opened(handle) as out:
            out.write(payload)
        os.chmod(probe, _mode_for(target))  # mkstemp's 0600 would hide the file from others
        os.replace(probe, target)
        probe = None
    except OSError as exc:
        raise _cannot(target, flag, exc) from None
    finally:
        if probe is not None:
            # the write already failed and says why; a temporary file that will not go is no news
            with contextlib.suppress(OSError):
                os.unlink(probe)


def partial_path(path: str | Path) -> Path:
    """Where :class:`StreamedOutput` writes ``path``'s lines until the run ends well."""
    target = _target(path)
    return target.with_name(target.name + ".partial")


def make_folders(path: Path) -> list[Path]:
    """Make the folder ``path`` and those above it that do not exist; the ones this call made,
    outermost first, which a write that fails removes again (:func:`remove_empty`). Only those:
    in ``typo/../runs/ck`` the folder ``typo/../runs`` is ``runs``, which may be the user's own
    (a check of each path before the making would take it for a new one). On an error the
    folders made so far are removed before it is raised."""
    made: list[Path] = []
    try:
        for folder in [*reversed(path.parents), path]:
            try:
                os.mkdir(folder)
            except FileExistsError:
                continue
            made.append(folder)
    except OSError:
        remove_empty(made)
        raise
    if not path.is_dir():  # the name of a file, or of a link to one
        remove_empty(made)
        raise FileExistsError(errno.EEXIST, "is a file, not a folder", str(path))
    return made


def remove_empty(folders: list[Path]) -> None:
    """``folders`` (outermost first), each removed where it is empty, innermost first."""
    for folder in reversed(folders):
        try:
            folder.rmdir()
        except FileNotFoundError:  # removed already, with what it held
            continue
        except OSError:  # not empty: neither is any folder above it
            return


class StreamedOutput:
    """A file written line by line over a long run (octorun's metrics), yet whole or not at
    all: the lines go to ``PATH.partial`` as they come (flushed, so a watcher sees them), which
    replaces ``PATH`` when the run ends well. A run that fails, is interrupted or is killed
    leaves any old ``PATH`` as it was and its own lines in ``PATH.partial``."""

    def __init__(self, path: str | Path, *, flag: str | None = None):
        self.target = _target(path)
        self.partial = partial_path(path)
        self.flag = flag
        try:
            self.partial.parent.mkdir(parents=True, exist_ok=True)
            self._out = open(self.partial, "w", encoding="utf-8")
        except OSError as exc:
            raise _cannot(self.partial, flag, exc) from None

    def write_line(self, line: str) -> None:
        try:
            self._out.write(line + "\n")
            self._out.flush()
        except OSError as exc:  # a disk that fills up, a file size limit: the run's fault is the output's
            raise _cannot(self.partial, self.flag, exc) from None

    def commit(self) -> None:
        """The run ended well: the lines become ``PATH``."""
        try:
            self._out.close()
            os.chmod(self.partial, _mode_for(self.target))  # the old file's permissions, as write_text keeps them
            os.replace(self.partial, self.target)
        except OSError as exc:
            raise _cannot(self.target, self.flag, exc) from None

    def close(self) -> None:
        """Without :meth:`commit`: keep ``PATH.partial`` as it is."""
        # after a failure, the one the run reports: the flush of what is still buffered may fail
        # as the write did (a full disk), and must not take that report's place
        with contextlib.suppress(OSError):
            self._out.close()
