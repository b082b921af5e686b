"""The looped one-forward-one-backward family: 1F1B, interleaved 1F1B and zero-bubble H1/H2.

All share one rule, parametrized:
- each rank holds ``chunks`` stages placed in a loop (stage ``c*pp + r`` on rank ``r``);
- microbatches are taken in *rounds* of about ``pp``; within a round every chunk runs the
  round's microbatches forward in chunk order, and backward in reverse chunk order
  (Megatron-LM's interleaving; with one chunk this is plain microbatch order);
- a rank first runs ``warmup(r)`` forwards, then alternates one forward with one backward,
  then drains the remaining backwards;
- with ``split``, the backward is I only and the W of a microbatch is issued ``w_lag(r)``
  backwards later, so deferred Ws fill the gaps where a rank would wait for a gradient;
  the Ws still pending at the end run last.
"""

from __future__ import annotations

from typing import Callable

from octoplan.ops import Kind, Op

__all__ = ["looped_schedule", "one_f_one_b", "interleaved_1f1b", "zb_h1", "zb_h2", "rounds"]


def rounds(microbatches: int, pp: int) -> list[list[int]]:
    """Consecutive groups of microbatches, each at least ``pp`` long where possible, sizes
    differing by at most one (larger first)."""
    count = max(1, microbatches // pp)
    base, extra = divmod(microbatches, count)
    out, first = [], 0
    for i in range(count):
        size = base + (1 if i < extra else 0)
        out.append(list(range(first, first + size)))
        first += size
    return out


def looped_schedule(
    pp: int,
    microbatches: int,
    *,
    chunks: int,
    warmup: Callable[[int], int],
    split: bool = False,
    w_lag: Callable[[int], int] = lambda r: 0,
) -> list[list[Op]]:
    groups = rounds(microbatches, pp)
    total = microbatches * chunks
    schedule = []
    for r in range(pp):
        forward = [(c * pp + r, mb) for group in groups for c in range(chunks) for mb in group]
        backward = [(c * pp + r, mb) for group in groups for c in reversed(range(chunks)) for mb in group]
        num_warmup = min(warmup(r), total)
        lag = w_lag(r)
        ops: list[Op] = []
        pending_w: list[tuple[int, int]] = []
        num_backward = 0

        def backward_op(index: int) -> None:
            nonlocal num_backward
            stage, mb = backward[index]
            if not split:
                ops.append(Op(stage, Kind.B, mb))
                return
            ops.append(Op(stage, Kind.I, mb))
            pending_w.append((stage, mb))
            num_backward += 1
            if num_backward > lag:
                w_stage, w_mb = pending_w.pop(0)
                ops.append(Op(w_stage, Kind.W, w_mb))

        for stage, mb in forward[:num_warmup]:
            ops.append(Op(stage, Kind.F, mb))
        for i, (stage, mb) in enumerate(forward[num_warmup:]):
            ops.append(Op(stage, Kind.F, mb))
            backward_op(i)
        for i in range(total - num_warmup, total):
            backward_op(i)
        ops.extend(Op(stage, Kind.W, mb) for stage, mb in pending_w)
        schedule.append(ops)
    return schedule


def one_f_one_b(pp: int, microbatches: int) -> list[list[Op]]:
    """PipeDream-flush / Megatron-LM 1F1B: rank r warms up with pp-1-r forwards."""
    return looped_schedule(pp, microbatches, chunks=1, warmup=lambda r: pp - 1 - r)


def interleaved_1f1b(pp: int, microbatches: int, chunks: int) -> list[list[Op]]:
    """Megatron-LM's interleaved 1F1B: a warm-up of (V-1) rounds plus 2(pp-1-r) forwards.

    With one chunk it is plain 1F1B, as in Megatron-LM. Where pp does not divide the
    microbatches (which Megatron-LM refused until recently), the rounds are those of
    ``rounds`` and the warm-up counts the first round's length: the rule of PyTorch's
    ``ScheduleInterleaved1F1B``, extended to counts its rounds do not divide."""
    if chunks == 1:
        return one_f_one_b(pp, microbatches)
    first_round = len(rounds(microbatches, pp)[0])
    return looped_schedule(
        pp, microbatches, chunks=chunks, warmup=lambda r: (chunks - 1) * first_round + 2 * (pp - 1 - r)
    )


def zb_h1(pp: int, microbatches: int) -> list[list[Op]]:
    """Zero-bubble H1 (Qi et al., 2024): 1F1B's warm-up and memory, W lagging r backwards
    on rank r so that the Ws fill the drain where upstream ranks wait for gradients."""
    return looped_schedule(pp, microbatches, chunks=1, warmup=lambda r: pp - 1 - r, split=True, w_lag=lambda r: r)


def zb_h2(pp: int, microbatches: int) -> list[list[Op]]:
    """Zero-bubble H2: rank r runs 2(pp-r)-1 forwards before its first backward (a warm-up
    of 2(pp-1-r), then the steady phase's forward), as many as fit before the first input
    gradient can come back to it; Ws lag 2r backwards to fill the drain. No bubble between a
    rank's first and last op, at (2pp-1) microbatches' activations on rank 0 (the paper's
    peak), against 1F1B's pp."""
    return looped_schedule(
        pp, microbatches, chunks=1, warmup=lambda r: 2 * (pp - 1 - r), split=True, w_lag=lambda r: 2 * r
    )
