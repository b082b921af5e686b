"""Token files: a flat array of token ids, little-endian, no header.

This is the layout of nanoGPT's ``.bin`` files and of the ``.bin`` half of Megatron-LM's
indexed datasets, so files made by either train as they are. The file itself does not say its
element type; it comes from the user (``--data-dtype``), else from the Megatron ``.idx`` index
beside the file (whose header names it), else uint16 (nanoGPT's GPT-2 files).

This module knows the format and writes files in it (``octoplan tokenize``: byte-level, each
UTF-8 byte one token id 0..255); reading them for training is ``octorun.data``. It needs numpy,
not torch. Token files are routinely larger than the 1 GiB octoplan's other inputs may have,
so they are checked and read here in chunks, never whole.
"""

from __future__ import annotations

import codecs
import contextlib
import os
import struct
import tempfile
from pathlib import Path

import numpy as np

from octoplan.errors import InputError
from octoplan.inputs import ordinary_file_size
from octoplan.outputs import _cannot, _mode_for, _target, check_writable, make_folders, remove_empty

__all__ = [
    "DTYPES",
    "MEGATRON_INDEX_MAGIC",
    "check_token_file",
    "index_path",
    "megatron_index_dtype",
    "readable_dtype",
    "resolve_dtype",
    "tokenize_text",
]

# What --data-dtype accepts, as numpy dtypes of the file's bytes.
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}

# Megatron-LM's MMapIndexedDataset index header (megatron/core/datasets/indexed_dataset.py):
# these 9 bytes, a little-endian uint64 version (1), then one byte naming the .bin's dtype.
MEGATRON_INDEX_MAGIC = b"MMIDIDX\x00\x00"
_MEGATRON_VERSION = 1
# Megatron's DType codes. Its preprocessing writes uint16 for vocabularies under 65500 and
# int32 above; int32 ids are read as int32 (a negative one is then refused as out of range).
_MEGATRON_CODES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32", 8: "uint16"}
_READABLE = {**DTYPES, "int32": np.dtype("<i4")}

_FIX_TOKENIZE = "give a token file (octoplan tokenize TEXT -o FILE.bin makes one)"
_CHUNK_BYTES = 1 << 24


def check_token_file(path: str | Path, *, fix: str = _FIX_TOKENIZE) -> int:
    """The size in bytes of ``path`` once it is an ordinary file (no size limit: token files are
    memory-mapped, never read whole); :class:`InputError` if it is missing, a folder or a device."""
    return ordinary_file_size(path, fix=fix)


def index_path(path: str | Path) -> Path:
    """Where Megatron-LM keeps the index of the token file ``path``: ``PREFIX.idx`` beside
    ``PREFIX.bin``; ``path`` itself where it has no file name (``.``, ``/``), which is no token
    file and is refused as a folder."""
    path = Path(path)
    return path.with_suffix(".idx") if path.name else path


def megatron_index_dtype(idx: str | Path) -> str:
    """The dtype a Megatron ``.idx`` file's header names for its ``.bin``: ``uint16`` or ``int32``."""
    file = str(idx)
    check_token_file(idx, fix="remove it, or give --data-dtype")
    try:
        with open(idx, "rb") as handle:
            header = handle.read(len(MEGATRON_INDEX_MAGIC) + 9)
    except OSError as exc:
        raise InputError(file, None, f"cannot be read: {exc.strerror or exc}", "give --data-dtype") from None
    if len(header) < len(MEGATRON_INDEX_MAGIC) + 9 or not header.startswith(MEGATRON_INDEX_MAGIC):
        raise InputError(file, "header", "is not a Megatron-LM index (it does not start with MMIDIDX)",
                         "give --data-dtype, or move the file away from the token file")
    version, code = struct.unpack("<QB", header[len(MEGATRON_INDEX_MAGIC):])
    if version != _MEGATRON_VERSION:
        raise InputError(file, "version", f"is {version}, not Megatron-LM's {_MEGATRON_VERSION}", "give --data-dtype")
    name = _MEGATRON_CODES.get(code, f"unknown code {code}")
    if name not in _READABLE:
        raise InputError(file, "dtype", f"is {name}: token files are uint16, uint32 or Megatron's int32",
                         "write the dataset with integer token ids")
    return name


def resolve_dtype(path: str | Path, dtype: str | None) -> str:
    """The dtype to read ``path`` as: ``dtype`` when given, else the one its Megatron index
    names, else uint16. A given dtype whose width the index contradicts is refused: every id
    would be read wrong."""
    if dtype is not None and dtype not in DTYPES:
        raise InputError(None, "--data-dtype", f"is {dtype!r}", f"use one of {', '.join(DTYPES)}")
    idx = index_path(path)
    indexed = None
    if idx != Path(path) and idx.exists():
        try:
            indexed = megatron_index_dtype(idx)
        except InputError as exc:
            # with --data-dtype given, a file that is no Megatron index (or one of another
            # version) says nothing about the token file; a real index naming a dtype we cannot
            # read still does
            if dtype is None or exc.field == "dtype":
                raise
    if dtype is None:
        return indexed or "uint16"
    if indexed is not None and _READABLE[indexed].itemsize != DTYPES[dtype].itemsize:
        raise InputError(str(idx), "dtype", f"is {indexed}, but --data-dtype is {dtype}",
                         f"drop --data-dtype, or give --data-dtype {'uint16' if indexed == 'uint16' else 'uint32'}; "
                         f"if this index is another file's, remove it")
    return dtype


def readable_dtype(name: str) -> np.dtype:
    """The numpy dtype of a name :func:`resolve_dtype` returns."""
    return _READABLE[name]


def tokenize_text(source: str | Path, output: str | Path, *, dtype: str = "uint16", holdout: float | None = None,
                  holdout_output: str | Path | None = None) -> int:
    """Write the UTF-8 text file ``source`` as a byte-level token file ``output`` (each byte a
    token id 0..255); returns the number of tokens in ``output``. Each output is written whole
    or not at all.

    With ``holdout`` (a fraction between 0 and 1), the text's last ``holdout`` of bytes go to
    ``holdout_output`` instead, a held-out file for ``octorun --eval-data``, as nanoGPT's data
    preparation splits its text: cut at the first character boundary from that point, so each
    file holds whole characters."""
    if dtype not in DTYPES:
        raise InputError(None, "--dtype", f"is {dtype!r}", f"use one of {', '.join(DTYPES)}")
    if (holdout is None) != (holdout_output is None):
        given, missing = ("--holdout", "--holdout-output FILE") if holdout_output is None else \
            ("--holdout-output", "--holdout FRACTION")
        raise InputError(None, given, f"needs {missing}", "give both, or neither")
    if holdout is not None and not 0 < holdout < 1:
        raise InputError(None, "--holdout", f"is {holdout}", "give the held-out fraction of the text, above 0 and below 1")
    size = check_token_file(source, fix="give a UTF-8 text file")
    if size == 0:
        raise InputError(str(source), None, "is empty: there is nothing to tokenize", "give a text file with some text")
    check_writable(output, "-o", inputs=(source,))
    targets = [(_target(output), "-o")]
    if holdout_output is not None:
        if os.path.abspath(holdout_output) == os.path.abspath(output):
            raise InputError(str(holdout_output), "--holdout-output", "is the -o file too", "give another file")
        check_writable(holdout_output, "--holdout-output", inputs=(source, output))
        targets.append((_target(holdout_output), "--holdout-output"))
    decoder = codecs.getincrementaldecoder("utf-8")()  # a binary file given by mistake is refused, not tokenized
    try:
        text = open(source, "rb")
    except OSError as exc:
        raise InputError(str(source), None, f"cannot be read: {exc.strerror or exc}", "give a readable text file") from None
    temporaries: list[str] = []
    made: list[Path] = []  # removed again when the text is refused or a write fails
    done, read, counts = False, 0, []
    try:
        cut = size if holdout is None else _character_boundary(text, size - int(size * holdout), size)
        if holdout is not None and cut in (0, size):
            part = "training" if cut == 0 else "held-out"
            raise InputError(str(source), None, f"is {size} bytes: a --holdout of {holdout} leaves the {part} part empty",
                             "give a longer text, or another --holdout")
        text.seek(0)
        for (target, flag), end in zip(targets, (cut, size)):
            try:
                made += make_folders(target.parent)
                handle, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
                temporaries.append(temporary)
                with os.fdopen(handle, "wb") as out:
                    while read < end and (chunk := text.read(min(_CHUNK_BYTES, end - read))):
                        try:
                            decoder.decode(chunk)
                        except UnicodeDecodeError as exc:
                            raise InputError(str(source), None, f"is not UTF-8 text (near byte {read + exc.start})",
                                             "give a UTF-8 text file") from None
                        out.write(np.frombuffer(chunk, dtype=np.uint8).astype(DTYPES[dtype]).tobytes())
                        read += len(chunk)
                os.chmod(temporary, _mode_for(target))
            except OSError as exc:
                raise _cannot(target, flag, exc) from None
            counts.append(end - (counts[0] if counts else 0))
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise InputError(str(source), None, "is not UTF-8 text (it ends inside a character)",
                             "give a UTF-8 text file") from None
        for (target, flag), temporary in zip(targets, temporaries):  # only once the whole text is known good
            try:
                os.replace(temporary, target)
            except OSError as exc:
                raise _cannot(target, flag, exc) from None
        temporaries, done = [], True
    finally:
        text.close()
        for temporary in temporaries:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
        if not done:
            remove_empty(made)
    return counts[0]


def _character_boundary(text, at: int, size: int) -> int:
    """The first offset from ``at`` of the open file ``text`` where a UTF-8 character starts
    (a byte that is no continuation byte 10xxxxxx), or ``size``."""
    text.seek(at)
    ahead = text.read(4)
    for offset, byte in enumerate(ahead):
        if byte & 0xC0 != 0x80:
            return at + offset
    return min(at + len(ahead), size)
