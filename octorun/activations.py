"""Counting the activation memory a rank's tapes hold (``octorun --activation-memory``).

The planner prices a plan's memory with the model of :mod:`octoplan.memory`: each stage holds
its ``activation_bytes`` per microbatch from the start of its F, a split backward's I frees
all but what its W reads, and the backward's end frees the rest. This meter measures what the
runtime really holds, so the two can be set side by side (``peak_activation_bytes`` in ``--metrics``): every storage that autograd saves for a
backward (through :class:`octoplan.splitgrad.SavedTensors`, until autograd lets go of it or an I
releases it), the tensors the stage's tapes keep (each layer's input, a recomputing stage's
stash) and the gradients an I op leaves for its W, each storage counted once while anything
holds it, parameters and buffers never.

The count is exact on any device, as it reads sizes rather than an allocator: a storage counts
from the moment the first holder takes it until the last one is dropped. CPython frees a holder
the moment its last reference goes (when autograd releases a saved tensor, when a tape clears a
list), so the count moves with the runtime's own releases. Received messages waiting for their
op, gradients waiting for theirs and the transport's buffers are not counted: the planner's model
leaves them out too.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator

import torch

from octoplan.splitgrad import SavedTensors

__all__ = ["ActivationMeter", "Hold"]


class Hold:
    """While this object lives, its tensor's storage counts in its meter."""

    __slots__ = ("meter", "key")

    def __init__(self, meter: "ActivationMeter", tensor: torch.Tensor):
        self.meter = meter
        self.key = meter._take(tensor)

    def __del__(self) -> None:
        if self.key is not None:
            self.meter._drop(self.key)


class ActivationMeter:
    """Bytes of activation storage held now, and the most held at once since :meth:`reset`."""

    def __init__(self, static: Iterable[torch.Tensor] = ()):
        """``static``: the rank's parameters and buffers, held whatever the schedule (never counted)."""
        self._excluded = {_key(p) for p in static}
        self._held: dict[tuple[str, int], list[int]] = {}  # storage -> [bytes, holders]
        self.current = 0
        self.peak = 0

    def reset(self) -> None:
        """Start a new peak from what is held now (between steps: nothing)."""
        self.peak = self.current

    def hold(self, tensors: Iterable[object]) -> list[Hold]:
        """Holders for the tensors among ``tensors``; keep the list as long as they are held."""
        return [Hold(self, t) for t in tensors if isinstance(t, torch.Tensor)]

    def hold_one(self, tensor: torch.Tensor) -> Hold:
        return Hold(self, tensor)

    @contextmanager
    def saving(self) -> Iterator[None]:
        """Inside, every tensor autograd saves for a backward counts until autograd lets go of it
        (the stage executor records each layer's into a :class:`SavedTensors` of its own)."""
        with SavedTensors(self.hold_one).recording():
            yield

    def _take(self, tensor: torch.Tensor) -> tuple[str, int] | None:
        key, nbytes = _key(tensor), tensor.untyped_storage().nbytes()
        if key in self._excluded or not nbytes:
            return None
        entry = self._held.get(key)
        if entry is None:
            self._held[key] = [nbytes, 1]
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        else:
            entry[1] += 1
        return key

    def _drop(self, key: tuple[str, int]) -> None:
        entry = self._held[key]
        entry[1] -= 1
        if not entry[1]:
            del self._held[key]
            self.current -= entry[0]


def _key(tensor: torch.Tensor) -> tuple[str, int]:
    return str(tensor.device), tensor.untyped_storage().data_ptr()
