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
list), so the count moves with the runtime's own releases.

The transport's messages (:mod:`octorun.comm`) count in a second figure: a receive buffer from
the moment it is posted until the op that reads the message has run, a send's tensors until the
transport lets go of them. ``peak_with_messages`` is the most that tapes and messages held
together, each storage once: a received input that an F keeps on its tape, or a gradient whose
storage an I keeps for its W, is not counted twice. The planner's ``peak_memory_bytes`` less the
static bytes predicts it. An op's temporaries count in neither figure.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterable, Iterator

import torch

from octoplan.splitgrad import SavedTensors

__all__ = ["ActivationMeter", "Hold"]


class Hold:
    """While this object lives, its tensor's storage counts in its meter (as a message's, or
    as a tape's)."""

    __slots__ = ("meter", "key", "message")

    def __init__(self, meter: "ActivationMeter", tensor: torch.Tensor, message: bool = False):
        self.meter, self.message = meter, message
        self.key = meter._take(tensor, message)

    def __del__(self) -> None:
        if self.key is not None:
            self.meter._drop(self.key, self.message)


class ActivationMeter:
    """Bytes of activation storage held now, and the most held at once since :meth:`reset`;
    the same with the transport's messages (``*_with_messages``)."""

    def __init__(self, static: Iterable[torch.Tensor] = ()):
        """``static``: the rank's parameters and buffers, held whatever the schedule (never counted)."""
        self._excluded = {_key(p) for p in static}
        # storage -> [bytes, tape holders, message holders]
        self._held: dict[tuple[str, int], list[int]] = {}
        # the transport's receiver threads take and drop holds too; reentrant, because a
        # holder's __del__ may run inside the meter's own bookkeeping on this thread
        self._lock = threading.RLock()
        self.current = self.peak = 0
        self.current_with_messages = self.peak_with_messages = 0

    def reset(self) -> None:
        """Start new peaks from what is held now (between steps: no tapes; the receive buffers
        the transport has posted for the next step's first messages)."""
        with self._lock:
            self.peak = self.current
            self.peak_with_messages = self.current_with_messages

    def hold(self, tensors: Iterable[object]) -> list[Hold]:
        """Holders for the tensors among ``tensors``; keep the list as long as they are held."""
        return [Hold(self, t) for t in tensors if isinstance(t, torch.Tensor)]

    def hold_one(self, tensor: torch.Tensor) -> Hold:
        return Hold(self, tensor)

    def hold_message(self, tensor: torch.Tensor) -> Hold:
        """A holder for a tensor the transport keeps: a posted receive buffer, a send's payload."""
        return Hold(self, tensor, message=True)

    @contextmanager
    def saving(self) -> Iterator[None]:
        """Inside, every tensor autograd saves for a backward counts until autograd lets go of it
        (the stage executor records each layer's into a :class:`SavedTensors` of its own)."""
        with SavedTensors(self.hold_one).recording():
            yield

    def _take(self, tensor: torch.Tensor, message: bool) -> tuple[str, int] | None:
        key, nbytes = _key(tensor), tensor.untyped_storage().nbytes()
        if key in self._excluded or not nbytes:
            return None
        with self._lock:
            entry = self._held.setdefault(key, [nbytes, 0, 0])
            if not entry[1] and not entry[2]:
                self.current_with_messages += nbytes
                self.peak_with_messages = max(self.peak_with_messages, self.current_with_messages)
            if not message and not entry[1]:
                self.current += nbytes
                self.peak = max(self.peak, self.current)
            entry[2 if message else 1] += 1
        return key

    def _drop(self, key: tuple[str, int], message: bool) -> None:
        with self._lock:
            entry = self._held[key]
            entry[2 if message else 1] -= 1
            if not message and not entry[1]:
                self.current -= entry[0]
            if not entry[1] and not entry[2]:
                del self._held[key]
                self.current_with_messages -= entry[0]


def _key(tensor: torch.Tensor) -> tuple[str, int]:
    return str(tensor.device), tensor.untyped_storage().data_ptr()
