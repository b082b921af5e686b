"""DualPipeV (DeepSeek-V3 report, 2024; the "cut-in-half" DualPipe): V placement, two chunks
per rank, and in the steady phase the forward of one chunk paired with the full backward of
the other, which DeepSeek overlaps to hide expert-parallel communication. Here a pair is
written as its two ops in order (forward first), which is how it runs on one compute stream.

Rule for rank r (chunk 0 = stage r, chunk 1 = stage 2pp-1-r), microbatches M >= 2pp:
1. 2(pp-r-1) forwards of chunk 0;
2. r+1 pairs: forward chunk 0, forward chunk 1;
3. pp-r-1 rounds: I of chunk 1, a pending W if any, forward chunk 1;
4. M-2pp+r+1 rounds: (F0, B1) then (F1, B0) — the last rank starts with F0 then B1;
5. pp-r-1 rounds: B1, then (F1, B0);
6. r+1 rounds of backward chunk 1 then chunk 0, switching from B to I (deferring W) half way;
7. pp-r-1 rounds: a pending W, then the chunk-0 backward;
8. the remaining pending Ws.
"""

from __future__ import annotations

from octoplan.ops import Kind, Op

__all__ = ["generate"]


def generate(pp: int, microbatches: int) -> list[list[Op]]:
    if microbatches < 2 * pp:
        raise ValueError(f"DualPipeV needs at least 2*pp = {2 * pp} microbatches, got {microbatches}")
    return [_rank_ops(pp, microbatches, r) for r in range(pp)]


def _rank_ops(pp: int, microbatches: int, r: int) -> list[Op]:
    c0, c1 = r, 2 * pp - 1 - r
    ops: list[Op] = []
    next_f = {c0: 0, c1: 0}
    next_bwd = {c0: 0, c1: 0}
    pending_w: list[tuple[int, int]] = []

    def forward(stage: int) -> None:
        ops.append(Op(stage, Kind.F, next_f[stage]))
        next_f[stage] += 1

    def backward(stage: int, *, split: bool) -> None:
        mb = next_bwd[stage]
        next_bwd[stage] += 1
        if split:
            ops.append(Op(stage, Kind.I, mb))
            pending_w.append((stage, mb))
        else:
            ops.append(Op(stage, Kind.B, mb))

    def weight() -> None:
        if pending_w:
            stage, mb = pending_w.pop(0)
            ops.append(Op(stage, Kind.W, mb))

    for _ in range(2 * (pp - r - 1)):
        forward(c0)
    for _ in range(r + 1):
        forward(c0)
        forward(c1)
    for _ in range(pp - r - 1):
        backward(c1, split=True)
        weight()
        forward(c1)
    for _ in range(microbatches - 2 * pp + r + 1):
        forward(c0)
        backward(c1, split=False)
        forward(c1)
        backward(c0, split=False)
    for _ in range(pp - r - 1):
        backward(c1, split=False)
        forward(c1)
        backward(c0, split=False)
    split = False
    steps = r + 1
    for i in range(steps):
        if i == steps // 2 and r % 2 == 1:
            split = True
        backward(c1, split=split)
        if i == steps // 2 and r % 2 == 0:
            split = True
        backward(c0, split=split)
    for _ in range(pp - r - 1):
        weight()
        backward(c0, split=split)
    while pending_w:
        weight()
    return ops
