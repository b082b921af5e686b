"""Point-to-point transport between pipeline ranks: one process group per directed channel.

Wire format. Shapes are not known in advance (a layer may return a tuple of tensors of any shape
and dtype, e.g. float features and int64 token ids), so a message starts with a fixed-size int64
header — the message's identity (kind, stage, mb), the tensor count, then dtype code, ndim and
dims of each tensor — followed by one transfer per tensor. The receiver checks the identity
against the message it expects next, so a protocol slip fails loudly instead of mixing data.

The header is sent with every message of step 0. After that, by default (``static`` shapes),
both sides reuse the layout step 0 had for the same message, so a message is one transfer per
tensor. On a CPU box a header is a second gloo send and a second receiver wake-up per message:
sending it only in step 0 halves a transfer's time and cuts octorun's gaps between ops by a
third to a half (docs/BENCHMARKS.md). The message order is fixed by the lowering pass, so
step 0's identity check covers the order of every step. The sender compares each later message
with its step-0 layout and, if it changed, fails loudly naming the message: a receive of the
wrong size never happens. ``dynamic`` shapes (``octorun --dynamic-shapes``) send the header
every step, for models whose shapes change between steps.

Channels. Each directed pair ``src -> dst`` of global ranks that exchanges messages gets its own
process group, used by exactly one thread on each side: the sender's compute thread issues
``isend`` and lets go of a send's tensors an op later, once it is surely delivered (see
``Transport.begin_op``); a receiver thread per incoming channel posts its receives for the
channel's messages in the order the sender sends them (the lowering pass fixes that order),
ahead of need, on a CUDA stream of its own, and drops the tensors in a mailbox the compute
thread takes from. Why a group per *direction*:
NCCL runs all send/recv between two ranks of one communicator on one ordered stream and ignores
tags, so a gradient travelling B -> A could queue behind an activation A -> B that waits for B;
V-shaped placements send activations both ways between the same pair, so even separate
"forward" and "backward" groups could block each other. With one group per direction every
stream carries a single FIFO whose sender and receiver post in the same order, so one direction
can never block the other, and receives never wait for compute. On NCCL, headers travel on a
parallel gloo group (host memory: the receiver reads the header without a device sync); on gloo
the same group carries both, with a per-channel tag sequence that both sides count identically.
"""

from __future__ import annotations

import datetime
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from octorun.activations import ActivationMeter
from octorun.lowering import ACT, GRAD, Message
from octorun.watchdog import gist

__all__ = ["Channel", "Mailbox", "Transport", "ShapeChanged", "SendFailed", "encode_header", "decode_header", "layout_of", "wait_work",
           "HEADER_SLOTS", "RECEIVE_LAST_RESORT"]

HEADER_SLOTS = 128

# A receiver thread's receive may wait for most of a step and beyond it, for the next step's
# first message, so no timeout derived from --timeout fits every legal plan. The compute
# thread's deadlines (each of its waits is bounded by --timeout) and a dead peer's closed
# connection are what end a stuck job; a receive's own timeout is only a last resort.
RECEIVE_LAST_RESORT = datetime.timedelta(days=7)
_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
)
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}


_KINDS = (ACT, GRAD)


Layout = tuple[tuple[torch.dtype, tuple[int, ...]], ...]


class SendFailed(ConnectionError):
    """A send the transport reported as failed (not merely late)."""

    def __init__(self, message: Message, problem: str):
        super().__init__(f"the send of the {message} failed: {problem}")
        self.message = message


class ShapeChanged(ValueError):
    """A message's tensors differ from the same message's in step 0, with static shapes."""


def layout_of(tensors: Sequence[torch.Tensor]) -> Layout:
    return tuple((tensor.dtype, tuple(tensor.shape)) for tensor in tensors)


def encode_header(message: Message, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[kind, stage, mb, count, (dtype, ndim, *dims) per tensor, 0...]`` as a host int64 tensor."""
    words = [_KINDS.index(message.kind), message.stage, message.mb, len(tensors)]
    for tensor in tensors:
        if tensor.dtype not in _DTYPE_CODE:
            raise TypeError(f"cannot send a tensor of dtype {tensor.dtype} between stages")
        words += [_DTYPE_CODE[tensor.dtype], tensor.dim(), *tensor.shape]
    if len(words) > HEADER_SLOTS:
        raise ValueError(f"a stage boundary passes {len(tensors)} tensors whose shapes need {len(words)} header words; the limit is {HEADER_SLOTS}")
    header = torch.zeros(HEADER_SLOTS, dtype=torch.int64)
    header[: len(words)] = torch.tensor(words, dtype=torch.int64)
    return header


def decode_header(header: torch.Tensor) -> tuple[tuple[str, int, int], Layout]:
    """(message key, ((dtype, shape) per tensor)) of a header."""
    words = header.tolist()
    key = (_KINDS[words[0]], words[1], words[2])
    out, at = [], 4
    for _ in range(words[3]):
        dtype, ndim = _DTYPES[words[at]], words[at + 1]
        out.append((dtype, tuple(words[at + 2: at + 2 + ndim])))
        at += 2 + ndim
    return key, tuple(out)


@dataclass
class Channel:
    """One directed pair of global ranks, with its groups and its tag sequence."""

    src: int  # global ranks
    dst: int
    data_group: Any
    meta_group: Any  # the same group on gloo
    messages: tuple[Message, ...] = ()  # per step, in send order
    tag: int = 0
    # message key -> its step-0 layout, on both sides: static shapes send no header after step 0
    layouts: dict[tuple[str, int, int], Layout] = field(default_factory=dict)

    def next_tag(self) -> int:
        self.tag += 1
        return self.tag


class Mailbox:
    """Received messages keyed by (step, message key); compute threads wait here with a deadline."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        # (step, message key) -> (its tensors, their holds in the meter, which the taker keeps
        # until its op has run)
        self._items: dict[tuple[int, tuple[str, int, int]], tuple[tuple[torch.Tensor, ...], list]] = {}
        self._errors: dict[int, str] = {}  # source global rank -> what went wrong

    def put(self, step: int, message: Message, value: tuple[torch.Tensor, ...], holds: Sequence[object] = ()) -> None:
        with self._cond:
            self._items[(step, message.key)] = (value, list(holds))
            self._cond.notify_all()

    def fail(self, src: int, problem: str) -> None:
        with self._cond:
            self._errors[src] = problem
            self._cond.notify_all()

    def take(self, step: int, message: Message, *, src: int, deadline: float) -> tuple[tuple[torch.Tensor, ...], list]:
        """The message's tensors and their holds in the meter (empty without one: the taker drops
        them when the op that reads the message ends); raises ``TimeoutError`` past ``deadline``
        or ``ConnectionError`` when the receiver thread of that channel failed."""
        key = (step, message.key)
        with self._cond:
            while key not in self._items:
                if src in self._errors:
                    raise ConnectionError(self._errors[src])
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError()
                self._cond.wait(min(left, 1.0))
            return self._items.pop(key)


class Transport:
    """Sends and receives the messages of one rank's program over per-channel groups."""

    def __init__(
        self,
        *,
        outgoing: dict[int, Channel],
        incoming: dict[int, Channel],
        device: torch.device,
        rounds: Callable[[], Iterable[bool]],
        timeout_s: float,
        static_shapes: bool = True,
        meter: ActivationMeter | None = None,
    ):
        self.outgoing = outgoing  # dst global rank -> channel
        self.incoming = incoming  # src global rank -> channel
        self.device = device
        # a fresh iterator, for each receiver thread, of one entry per round of messages this run
        # exchanges, in order: False for a training step (every message of the program), True
        # for an evaluation's forward-only pass (its activations only, octorun.lowering.
        # forward_only); both sides number rounds alike. Made as it goes: a run of millions of
        # steps holds no list of them
        self.rounds = rounds
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.static_shapes = static_shapes
        self.mailbox = Mailbox()
        self.meter = meter  # counts receive buffers and send payloads as messages (octorun.activations)
        # (work, message, tensors kept alive (and their holds in the meter), completion polled
        # rather than waited: NCCL payloads, the op count when it started), oldest first
        self._pending: list[tuple[Any, Message, tuple[object, ...], bool, int]] = []
        self._ops = 0  # ops begun so far (see begin_op)
        self._threads = [
            threading.Thread(target=self._receive_loop, args=(channel,), name=f"octorun-recv-{src}", daemon=True)
            for src, channel in incoming.items()
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    # -- sending (compute thread) -------------------------------------------------------------
    def send(self, message: Message, tensors: Sequence[torch.Tensor], *, dst: int, step: int, what: str = "") -> None:
        """Start sending in round ``step``; the tensors stay referenced until the send is known
        to be done (see :meth:`begin_op`). Raises :class:`ShapeChanged` (before sending
        anything, naming the round as ``what`` does, "step 3") when static shapes do not hold."""
        channel = self.outgoing[dst]
        payload = tuple(t.detach().contiguous() for t in tensors)
        if self._header_in(step):
            header = encode_header(message, payload)
            channel.layouts[message.key] = layout_of(payload)
            work = dist.isend(header, dst, group=channel.meta_group, tag=channel.next_tag())
            self._pending.append((work, message, (header,), False, self._ops))
        elif (layout := layout_of(payload)) != channel.layouts[message.key]:
            raise ShapeChanged(f"the {message} of {what or f'round {step}'} has tensors {_describe(layout)}, in step 0 "
                               f"{_describe(channel.layouts[message.key])}; run octorun with --dynamic-shapes "
                               f"for a model whose shapes change between steps")
        polled = self.device.type == "cuda"
        for tensor in payload:
            work = dist.isend(tensor, dst, group=channel.data_group, tag=channel.next_tag())
            kept = (tensor,) if self.meter is None else (tensor, self.meter.hold_message(tensor))
            self._pending.append((work, message, kept, polled, self._ops))

    def begin_op(self, *, deadline: float) -> Message | None:
        """Called before each op: lets go of the sends started before the previous op, so a
        rank holds the tensors of about one op's sends, not of a whole step's (a sent
        activation would otherwise outlive its backward by the rest of the step).

        Waiting for them costs nothing in practice: every channel's receiver thread posts its
        receives in send order, ahead of need, so a send from two ops ago has been taken or is
        being transferred. NCCL sends are only polled (their wait orders streams). Returns the
        message that missed the deadline, if any."""
        self._ops += 1
        done = 0
        for work, message, _, polled, started in self._pending:
            if polled:
                if not work.is_completed():
                    break
            elif started >= self._ops - 1:
                break
            elif (late := self._wait(work, message, polled=False, deadline=deadline)) is not None:
                return late
            done += 1
        del self._pending[:done]
        return None

    def wait_sends(self, *, deadline: float) -> Message | None:
        """Wait for every started send; returns the message that missed the deadline, if any."""
        pending, self._pending = self._pending, []
        for work, message, _, polled, _ in pending:
            if (late := self._wait(work, message, polled=polled, deadline=deadline)) is not None:
                return late
        return None

    @staticmethod
    def _wait(work: Any, message: Message, *, polled: bool, deadline: float) -> Message | None:
        """None once the send is done; raises :class:`SendFailed` when the transport reports
        a failure (a peer that died closes the connection), returns ``message`` past the
        deadline."""
        left = deadline - time.monotonic()
        try:
            if left <= 0 or not wait_work(work, left, polled=polled):
                return message
        except RuntimeError as exc:
            raise SendFailed(message, gist(exc)) from None
        return None

    @property
    def sends_in_flight(self) -> int:
        """How many tensors this rank still holds for sends (a test's view of the release)."""
        return len(self._pending)

    def _header_in(self, round_: int) -> bool:
        """Whether the messages of round ``round_`` carry a header (the same answer on both
        sides). Round 0 is a training step, so it sends every message an evaluation sends too."""
        return round_ == 0 or not self.static_shapes

    # -- receiving (one thread per incoming channel) ------------------------------------------
    def _receive_loop(self, channel: Channel) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            # Receives run on a stream of their own. On the compute thread's stream a receive
            # posted ahead of need would queue that thread's later kernels (and so the sends
            # the receive waits for) behind itself: a deadlock from the first early receive on.
            with torch.cuda.stream(torch.cuda.Stream(self.device)):
                self._receive_all(channel)
        else:
            self._receive_all(channel)

    def _receive_all(self, channel: Channel) -> None:
        try:
            for step, forward_only in enumerate(self.rounds()):
                for message in channel.messages:
                    if forward_only and message.kind != ACT:
                        continue
                    if self._header_in(step):
                        header = torch.empty(HEADER_SLOTS, dtype=torch.int64)
                        _receive(header, channel.src, group=channel.meta_group, tag=channel.next_tag())
                        key, layout = decode_header(header)
                        if key != message.key:
                            raise RuntimeError(f"protocol error: expected the {message}, received {key[0]} {key[1]}.{key[2]} instead")
                        channel.layouts[message.key] = layout
                    else:
                        layout = channel.layouts[message.key]
                    tensors, holds = [], []
                    for dtype, shape in layout:
                        tensor = self._empty(shape, dtype)
                        if self.meter is not None:  # a posted buffer is memory from now on
                            holds.append(self.meter.hold_message(tensor))
                        _receive(tensor, channel.src, group=channel.data_group, tag=channel.next_tag())
                        tensors.append(tensor)
                    if self.device.type == "cuda":
                        # the compute thread uses the tensors on its own stream: make them land first
                        torch.cuda.current_stream(self.device).synchronize()
                    self.mailbox.put(step, message, tuple(tensors), holds)
                    del tensors, holds  # the mailbox holds them now, until the op takes them
        except Exception as exc:  # a dead peer closes the connection: tell whoever waits on it
            self.mailbox.fail(channel.src, gist(exc))

    def _empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A receive buffer. On CUDA it is allocated on the compute thread's (default) stream,
        which uses and frees it, so the caching allocator never hands the block to another
        stream while that stream's kernels still read it."""
        if self.device.type != "cuda":
            return torch.empty(shape, dtype=dtype)
        with torch.cuda.stream(torch.cuda.default_stream(self.device)):
            tensor = torch.empty(shape, dtype=dtype, device=self.device)
        # The block may have been freed by the compute thread a moment ago, with kernels that
        # use its old tensor still queued on the default stream; NCCL's receive orders itself
        # after this thread's stream only, so that stream waits for them first. (The default
        # stream never waits on a receive: no deadlock.)
        torch.cuda.current_stream(self.device).wait_stream(torch.cuda.default_stream(self.device))
        return tensor


def _receive(tensor: torch.Tensor, src: int, *, group: Any, tag: int) -> None:
    """``dist.recv`` with :data:`RECEIVE_LAST_RESORT` as its timeout: a blocking ``recv``
    would use the group's, which gloo fixes when the group is created."""
    dist.irecv(tensor, src, group=group, tag=tag).wait(timeout=RECEIVE_LAST_RESORT)


def _describe(layout: Layout) -> str:
    return ", ".join(f"{str(dtype).removeprefix('torch.')}{list(shape)}" for dtype, shape in layout) or "none"


def wait_work(work: Any, seconds: float, *, polled: bool) -> bool:
    """Wait for a torch.distributed Work at most ``seconds``; False when it did not finish.

    gloo's works only report completion from ``wait``, which takes a timeout; an NCCL work's
    ``wait`` returns at once (it only orders streams), so its completion is ``polled`` instead.
    """
    if polled:
        deadline = time.monotonic() + seconds
        while not work.is_completed():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.0005)
        return True
    return bool(work.wait(timeout=datetime.timedelta(seconds=seconds)))
