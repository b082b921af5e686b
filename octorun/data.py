"""Real training data: samples read from a token file (``octoplan.tokenfile``), window by window.

A sample is a window of L = ``model.tokens_per_sample()`` consecutive tokens; window k starts at
token k * (L - 1), so consecutive windows share one boundary token (the last target of one is
the first input of the next) and a file of N tokens holds (N - 1) // (L - 1) windows.

Which window a sample reads is a pure function of (seed, stream index n). The stream index
counts samples over the whole training: n = consumed + g, where ``consumed`` is how many samples
the steps before this one read (the runtime keeps it in its checkpoints) and g is the sample's
place in the step's GLOBAL batch, (replica * microbatches + mb) * microbatch_size + row. So a
step reads the same samples whatever the pipeline and data-parallel degrees (dp=1 with 8
microbatches and dp=2 with 4 read one global batch), replicas read disjoint windows, and a run
resumed from a checkpoint, under any plan, reads on where the first run stopped.

Epoch e covers the stream indices [e * W, (e + 1) * W) of W windows and visits every window once,
in the order of a permutation seeded by (seed, e): no window repeats before all were read.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from octoplan.errors import InputError
from octoplan.tokenfile import DTYPES, check_token_file, index_path, readable_dtype, resolve_dtype

if TYPE_CHECKING:
    from octoplan.modelfile import ModelFile

__all__ = ["TokenData", "VOCAB_CHECK_TOKENS", "epoch_seed"]

# The ids checked against the model's vocabulary when the file is opened: a bounded prefix, so
# opening a file of billions of tokens stays instant (4M uint16 ids: 8 MB, milliseconds). Every
# window is checked again as it is read, so an id beyond the prefix is caught too.
VOCAB_CHECK_TOKENS = 1 << 22
# Permutations kept: a step's samples span at most two epochs unless an epoch is shorter than
# a global batch, and each permutation holds 8 bytes per window.
_CACHED_EPOCHS = 2
_FIX_DATA = "give a token file (octoplan tokenize TEXT -o FILE.bin makes one)"


def epoch_seed(seed: int, epoch: int) -> int:
    """The generator seed of the window order of ``epoch`` (kept within torch's seed range)."""
    return (seed * 1_000_003 + epoch) % (1 << 63)


def _looks_like_uint32(ids: np.ndarray, *, loose: bool) -> bool:
    """Whether uint16 ``ids`` are the halves of little-endian uint32 ids: every high half 0 and
    not every low half (no real uint16 text does that over 16 pairs); or, with ``loose``, every
    high half under 256 (a vocabulary under 16.7M) and at least a quarter of them 0 (the ids
    under 65,536, most of any text's tokens even in a 256k vocabulary), which a file of a few
    symbols with many zeros might also show. The vocab check would not catch the misreading:
    every half is a valid id of a vocabulary above 65,535."""
    pairs = ids[: len(ids) // 2 * 2].reshape(-1, 2)
    if len(pairs) < 16 or not pairs[:, 0].any():
        return False
    high = pairs[:, 1]
    if not high.any():
        return True
    return loose and int(high.max()) < 256 and 4 * int(np.count_nonzero(high == 0)) >= len(high)


class TokenData:
    """A token file read in windows; build it with :meth:`open`, which checks the file."""

    def __init__(self, *, path: str, tokens: np.ndarray, dtype: str, tokens_per_sample: int, seed: int,
                 model: "ModelFile", vocab: int | None):
        self.path = path
        self.dtype = dtype
        self.tokens_per_sample = tokens_per_sample
        self.num_tokens = len(tokens)
        self.num_windows = (self.num_tokens - 1) // (tokens_per_sample - 1)
        self.seed = seed
        self.model = model
        self._tokens = tokens
        self._vocab = vocab
        self._orders: dict[int, torch.Tensor] = {}
        self._fingerprint: str | None = None
        self._sampled: str | None = None
        # Training reads windows with pread, not through the memory map: a file cut short while
        # the run reads it (prepared again in place, nanoGPT-style) then gives a short read that
        # names the file, where a mapped page past the new end killed the process (SIGBUS).
        self._fd = os.open(path, os.O_RDONLY)
        self.stale_index_fix = ""  # where a Megatron index chose the dtype: what to do if it is another file's

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)  # (absent where __init__ failed before it)
        if fd is not None:
            os.close(fd)

    # tokens read from each end of the file for its fingerprint: a stale or cut copy on one
    # node differs there, and reading the whole file would cost a pass over terabytes
    FINGERPRINT_TOKENS = 1 << 16

    def fingerprint(self) -> str:
        """The file as the nodes of one job compare it (octorun.agreement) and checkpoints record
        it: its length, token type and a digest of its first and last tokens, as it was opened."""
        if self._fingerprint is None:
            ends = self._tokens[:self.FINGERPRINT_TOKENS].tobytes() + self._tokens[-self.FINGERPRINT_TOKENS:].tobytes()
            self._fingerprint = (f"a file of {self.num_tokens} {self.dtype} tokens "
                                 f"(digest {hashlib.sha256(ends).hexdigest()[:12]})")
        return self._fingerprint

    # blocks read evenly through the whole file for its sampled digest: a file edited in place
    # between a save and its resume (a shard re-tokenized) differs there, at the cost of a few
    # hundred kilobytes read, not the whole file
    SAMPLED_BLOCKS, SAMPLED_BLOCK_TOKENS = 64, 1 << 10

    def sampled_digest(self) -> str:
        """A digest of :attr:`SAMPLED_BLOCKS` blocks spread evenly over the file, as it was opened
        (checkpoints record it beside :meth:`fingerprint`, which reads only the ends)."""
        if self._sampled is None:
            block = min(self.SAMPLED_BLOCK_TOKENS, self.num_tokens)
            last = self.num_tokens - block
            starts = sorted({last * i // (self.SAMPLED_BLOCKS - 1) for i in range(self.SAMPLED_BLOCKS)})
            digest = hashlib.sha256()
            for start in starts:
                digest.update(self._tokens[start:start + block].tobytes())
            self._sampled = digest.hexdigest()[:12]
        return self._sampled

    @classmethod
    def open(cls, path: str, model: "ModelFile", *, seed: int, dtype: str | None = None) -> "TokenData":
        """Memory-map ``path`` for ``model``'s samples; :class:`InputError` on a file that is not
        a token file of at least one window whose ids fit the model's ``vocab``."""
        file = str(path)
        size = check_token_file(path, fix=_FIX_DATA)
        name = resolve_dtype(path, dtype)
        itemsize = readable_dtype(name).itemsize
        if size == 0:
            raise InputError(file, "size", "is empty", _FIX_DATA)
        if size % itemsize:
            other = [other for other, np_dtype in DTYPES.items() if size % np_dtype.itemsize == 0]
            fix = (f"if it holds {other[0]} ids, give --data-dtype {other[0]}" if other
                   else "the file is cut short, or not a token file")
            raise InputError(file, "size", f"is {size} bytes, not a whole number of {name} ids ({itemsize} bytes each)", fix)
        length = model.tokens_per_sample()
        num_tokens = size // itemsize
        if num_tokens < length:
            raise InputError(file, "size", f"holds {num_tokens} tokens, fewer than one sample's {length} "
                             f"(tokens_per_sample of {model.path})",
                             "give a longer token file, or a model whose samples are shorter (a smaller seq)")
        try:
            tokens = np.memmap(path, dtype=readable_dtype(name), mode="r", shape=(num_tokens,))
        except OSError as exc:
            raise InputError(file, None, f"cannot be read: {exc.strerror or exc}", _FIX_DATA) from None
        data = cls(path=file, tokens=tokens, dtype=name, tokens_per_sample=length, seed=seed, model=model,
                   vocab=model.vocab_size())
        prefix = np.asarray(tokens[:VOCAB_CHECK_TOKENS])
        index = index_path(path)
        data.stale_index_fix = f"; if {index} is another file's index, remove it" if dtype is None and index.exists() else ""
        # Not where the user named the dtype: --data-dtype uint16 is the way past this guess. The
        # loose pattern only where no index named it either and the vocabulary may hold ids above 65,535.
        loose = not index.exists() and (data._vocab is None or data._vocab > 1 << 16)
        if name == "uint16" and dtype is None and _looks_like_uint32(prefix, loose=loose):
            said = f" (as {index} says)" if index.exists() else ""
            raise InputError(file, "dtype", f"read as uint16{said}, every second id is 0 or small: it looks like a file of "
                             "uint32 ids", f"give --data-dtype uint32, or --data-dtype uint16 if it is one{data.stale_index_fix}")
        data._check_ids(0, prefix)
        # both now, as opened: a save late in the run reads no mapped page
        data.fingerprint()
        data.sampled_digest()
        # the model's batch_from_tokens on one window, before any rank starts: one that refuses
        # token files (a vision-language model's) or fails on them says so before the launch
        model.batch_from_tokens(data.windows(0, 1))
        return data

    def windows(self, first: int, count: int) -> torch.Tensor:
        """The windows of stream indices ``first`` .. ``first + count - 1``: int64 ``[count, L]``."""
        if first < 0 or count < 0:
            raise ValueError(f"stream indices must be >= 0, got first={first}, count={count}")
        stream = torch.arange(first, first + count, dtype=torch.int64)
        epochs, positions = stream // self.num_windows, stream % self.num_windows
        chosen = torch.empty(count, dtype=torch.int64)
        for epoch in torch.unique(epochs).tolist():
            inside = epochs == epoch
            chosen[inside] = self._order(epoch)[positions[inside]]
        starts = chosen.numpy() * (self.tokens_per_sample - 1)
        rows = np.empty((count, self.tokens_per_sample), dtype=np.int64)
        itemsize = self._tokens.dtype.itemsize
        length = self.tokens_per_sample * itemsize
        for row, start in enumerate(starts.tolist()):
            raw = os.pread(self._fd, length, start * itemsize)
            if len(raw) != length:
                raise InputError(self.path, "size", f"is {os.fstat(self._fd).st_size} bytes, cut short since the "
                                 f"run opened it with {self.num_tokens} tokens", "keep a token file as it is while a run reads it")
            rows[row] = np.frombuffer(raw, dtype=self._tokens.dtype)
        if rows.size and (rows.min() < 0 or (self._vocab is not None and rows.max() >= self._vocab)):
            for start, row in zip(starts.tolist(), rows):
                self._check_ids(start, row)
        return torch.from_numpy(rows)

    def microbatch(self, *, consumed: int, replica: int, mb: int, microbatches: int,
                   microbatch_size: int) -> tuple[Any, Any]:
        """Microbatch ``mb`` of data-parallel replica ``replica`` in the step that follows
        ``consumed`` samples: its ``(inputs, targets)`` through the model's batch_from_tokens."""
        first = consumed + (replica * microbatches + mb) * microbatch_size
        return self.model.batch_from_tokens(self.windows(first, microbatch_size))

    def _order(self, epoch: int) -> torch.Tensor:
        """The windows in the order epoch ``epoch`` visits them."""
        order = self._orders.get(epoch)
        if order is None:
            generator = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
            order = torch.randperm(self.num_windows, generator=generator)
            if len(self._orders) >= _CACHED_EPOCHS:
                del self._orders[min(self._orders)]
            self._orders[epoch] = order
        return order

    def _check_ids(self, offset: int, ids: np.ndarray) -> None:
        """:class:`InputError` when an id of ``ids`` (the file's tokens from ``offset`` on) is no
        token of the model: beyond its vocab, or negative (a Megatron int32 file)."""
        if len(ids) == 0:
            return
        largest, smallest = int(ids.max()), int(ids.min())
        if smallest < 0:
            at = offset + int(np.argmin(ids))
            raise InputError(self.path, f"token {at}", f"is {smallest}, a negative id",
                             f"the file is not a token file of this dtype{self.stale_index_fix}")
        if self._vocab is None or largest < self._vocab:
            return
        at = offset + int(np.argmax(ids))
        other = {"uint16": "uint32", "uint32": "uint16"}.get(self.dtype)
        fix = f"train a model with a vocab above {largest}"
        if other is not None:
            fix = f"if the file holds {other} ids, give --data-dtype {other}; else {fix}"
        fix += self.stale_index_fix
        raise InputError(self.path, f"token {at}", f"is {largest}, beyond the model's vocab {self._vocab} "
                         f"({self.model.path}) when the file is read as {self.dtype}", fix)

    def __repr__(self) -> str:
        return (f"TokenData({Path(self.path).name!r}, {self.num_tokens} {self.dtype} tokens, "
                f"{self.num_windows} windows of {self.tokens_per_sample})")
