"""Input files: read whole, and only when they are ordinary files of a sane size.

A plan, profile or trace is read into memory at once. ``/dev/zero``, a FIFO or a terminal
would never end (a command must never hang), and a stray multi-gigabyte file would take the
machine's memory before any parse error could name it; both are refused up front instead.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from octoplan.errors import InputError

__all__ = ["MAX_INPUT_BYTES", "ordinary_file_size", "check_input_file", "read_input_text", "read_input_bytes",
           "parse_json"]

# Far above any plan, profile or trace of a 1024-GPU job (a trace of 1024 ranks x 2048 ops is
# about 200 MB), far below what would exhaust the memory of the machines octoplan runs on.
MAX_INPUT_BYTES = 1 << 30


def ordinary_file_size(path: str | Path, *, field: str | int | None = None, fix: str) -> int:
    """The size in bytes of ``path`` once it is an ordinary file; :class:`InputError` (naming
    ``fix``) if it is missing, a folder or a device. Only a ``stat``, so it never blocks
    (opening a FIFO without a writer would)."""
    file = str(path)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise InputError(file, field, "no such file", fix) from None
    except OSError as exc:
        raise InputError(file, field, f"cannot be read: {exc.strerror or exc}", fix) from None
    if stat.S_ISDIR(info.st_mode):
        raise InputError(file, field, "is a folder", fix)
    if not stat.S_ISREG(info.st_mode):
        raise InputError(file, field, "is not an ordinary file (a device, FIFO or socket)", fix)
    return info.st_size


def check_input_file(path: str | Path, *, field: str | int | None = None, fix: str) -> None:
    """:class:`InputError` (naming ``fix``) unless ``path`` is an ordinary file of at most
    :data:`MAX_INPUT_BYTES`."""
    size = ordinary_file_size(path, field=field, fix=fix)
    if size > MAX_INPUT_BYTES:
        raise InputError(str(path), field, f"is {size / 2**30:.1f} GiB, more than the "
                         f"{MAX_INPUT_BYTES // 2**30} GiB an input file may have", fix)


def read_input_bytes(path: str | Path, *, field: str | int | None = None, fix: str) -> bytes:
    """The bytes of ``path``, once :func:`check_input_file` has passed it."""
    file = str(path)
    check_input_file(path, field=field, fix=fix)
    try:
        with open(path, "rb") as handle:  # in chunks: read(n) would reserve n bytes at once
            chunks, size = [], 0
            while chunk := handle.read(1 << 20):
                chunks.append(chunk)
                size += len(chunk)
                if size > MAX_INPUT_BYTES:  # a file that grows, or one whose size stat does not tell (/proc)
                    raise InputError(file, field, f"is more than the {MAX_INPUT_BYTES // 2**30} GiB an input file may have", fix)
            return b"".join(chunks)
    except FileNotFoundError:  # gone since the stat
        raise InputError(file, field, "no such file", fix) from None
    except OSError as exc:
        raise InputError(file, field, f"cannot be read: {exc.strerror or exc}", fix) from None


def read_input_text(path: str | Path, *, field: str | int | None = None, fix: str) -> str:
    """:func:`read_input_bytes` decoded as UTF-8."""
    try:
        return read_input_bytes(path, field=field, fix=fix).decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(str(path), field, "is not readable as UTF-8 text", fix) from None


def parse_json(text: str, *, file: str, field: str | int | None = None, fix: str) -> Any:
    """``text`` as JSON; :class:`InputError` naming ``file`` for text that is not JSON, that
    nests deeper than the parser recurses, or that holds an integer past Python's digit limit
    for converting one (4,300 digits), each of which would otherwise end in a traceback."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(file, field, f"is not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}", fix) from None
    except RecursionError:
        raise InputError(file, field, "is nested too deeply to be read", fix) from None
    except ValueError as exc:  # an integer literal of too many digits
        raise InputError(file, field, f"cannot be read: {exc}", fix) from None
