"""Zero-bubble V (Qi et al., 2024): two chunks per rank in a V (rank r holds stages r and
2pp-1-r), backward split into I and W.

Rule for rank r (chunk 0 = stage r, going down; chunk 1 = stage 2pp-1-r, coming back up):
1. 2(pp-r)-1 forwards of chunk 0;
2. r pairs: forward chunk 1, forward chunk 0;
3. pp-r rounds of: forward chunk 1, then I and W of chunk 1 — the V's turn on the last rank
   makes its gradient available at once;
4. steady: F0 I0 W0 F1 I1 W1 until every forward is issued;
5. drain: r pairs of I0 I1, then pp-r pairs of I0 W0, then every pending W.
The rule is written for at least 2pp-1 microbatches; with fewer, the ops of the missing
microbatches are simply left out, which keeps the order valid.
"""

from __future__ import annotations

from octoplan.ops import Kind, Op

__all__ = ["generate"]


def generate(pp: int, microbatches: int) -> list[list[Op]]:
    padded = max(2 * pp - 1, microbatches)
    return [
        [op for op in _rank_ops(pp, padded, r) if op.mb < microbatches]
        for r in range(pp)
    ]


def _rank_ops(pp: int, microbatches: int, r: int) -> list[Op]:
    down, up = r, 2 * pp - 1 - r
    ops: list[Op] = []
    counts = {(s, k): 0 for s in (down, up) for k in (Kind.F, Kind.I, Kind.W)}

    def emit(stage: int, kind: Kind) -> None:
        ops.append(Op(stage, kind, counts[stage, kind]))
        counts[stage, kind] += 1

    for _ in range(2 * (pp - r) - 1):
        emit(down, Kind.F)
    for _ in range(r):
        emit(up, Kind.F)
        emit(down, Kind.F)
    for _ in range(pp - r):
        emit(up, Kind.F)
        emit(up, Kind.I)
        emit(up, Kind.W)
    while counts[down, Kind.F] < microbatches or counts[up, Kind.F] < counts[down, Kind.F]:
        if counts[down, Kind.F] < microbatches:
            emit(down, Kind.F)
        emit(down, Kind.I)
        emit(down, Kind.W)
        emit(up, Kind.F)
        emit(up, Kind.I)
        emit(up, Kind.W)
    for _ in range(r):
        emit(down, Kind.I)
        emit(up, Kind.I)
    for _ in range(pp - r):
        emit(down, Kind.I)
        emit(down, Kind.W)
    for stage in (up, down):
        while counts[stage, Kind.W] < counts[stage, Kind.I]:
            emit(stage, Kind.W)
    return ops
