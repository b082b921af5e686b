"""Cut points for two stages per rank in a loop or a V: where the stage boundaries fall so that
the busiest rank carries the least F + I + W, exactly.

Balancing the stages (:func:`octoplan.partition.balanced_partition`) does not balance the
ranks once each rank holds two of them. On gemma3-27b's split blocks at pp 16, 32 balanced
stages in a loop balance the ranks to 0.863 (the ideal over the busiest rank's work), the best
loop cut to 0.964 (``benchmarks/bench_tuner.py caps --two-per-rank``).

Both shapes are solved by bisection on the busiest rank's load ``T``, each ``T`` checked by a
dynamic programme over the ranks whose state is the pair of layers reached by the rank's two
stages. Rank r's two stages cost ``P[x'] - P[x] + P[y'] - P[y]`` (``P`` the layers' prefix
sums), so "some reachable state can reach (x', y')" is a two-dimensional running maximum of
``P[x] +- P[y]`` over the reachable states (numpy), compared with ``P[x'] +- P[y'] - T``:
O(pp x L^2) per check (per split point, for the loop).
- V (rank r holds stages r and 2 pp - 1 - r): the state is (i, j), the front reached up to
  layer i from the start and the back down to layer j from the end; it starts at (0, L) and
  must meet (i = j) after pp ranks.
- loop (rank r holds stages r and pp + r): the state is (a, b), the first half's stages up to
  a and the second half's up to b, for each split point c of the halves (the c whose halves
  could each fit pp ranks at ``T``); it starts at (0, c) and must end at (c, L).

Times are integer ticks (:func:`octoplan.costs.to_ticks`), so the answer is exact and
deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

__all__ = ["PlacedCuts", "v_cuts", "loop_cuts"]

_NONE = np.iinfo(np.int64).min // 4  # "no reachable state": below every prefix-sum difference


@dataclass(frozen=True)
class PlacedCuts:
    bounds: tuple[int, ...]  # the 2 pp stages' cut points, 0 first and the layer count last
    busiest: int  # the busiest rank's ticks; no cut of this shape gives it less


def _shift_max(values: np.ndarray, axis: int, ascending: bool) -> np.ndarray:
    """out[k] = max(values[:k]) (ascending) or max(values[k + 1:]) along ``axis``: the best of
    the states strictly before (or after) k, as a stage cannot be empty."""
    values = values if ascending else np.flip(values, axis)
    running = np.maximum.accumulate(values, axis=axis)
    out = np.full_like(values, _NONE)
    if axis == 0:
        out[1:] = running[:-1]
    else:
        out[:, 1:] = running[:, :-1]
    return out if ascending else np.flip(out, axis)


def _bisect(lowest: int, highest: int, feasible: Callable[[int], list | None]) -> tuple[int, list]:
    """The least T in [lowest, highest] that ``feasible`` accepts, with its answer (it accepts
    ``highest``)."""
    answer = feasible(highest)
    while lowest < highest:
        middle = (lowest + highest) // 2
        found = feasible(middle)
        if found is None:
            lowest = middle + 1
        else:
            highest, answer = middle, found
    return highest, answer


def _limits(work: Sequence[int], num_ranks: int, second: Callable[[int], int]) -> tuple[np.ndarray, int, int] | None:
    """The layers' prefix sums and the range the bisection searches: from the ideal (no rank
    below the mean, none below the largest layer) up to the busiest rank of the cut into 2 pp
    stages of equal work, with rank r holding stages r and ``second(r)``."""
    if num_ranks < 1 or len(work) < 2 * num_ranks:
        return None
    prefix = np.concatenate(([0], np.cumsum(np.asarray(work, dtype=np.int64))))
    total, stages, L = int(prefix[-1]), 2 * num_ranks, len(work)
    even = [0]
    for k in range(1, stages):
        even.append(min(max(even[-1] + 1, int(np.searchsorted(prefix, k * total / stages))), L - stages + k))
    even.append(L)
    stage = np.diff(prefix[even])
    highest = max(int(stage[r] + stage[second(r)]) for r in range(num_ranks))
    return prefix, max(-(-total // num_ranks), max(work)), highest


def v_cuts(work: Sequence[int], num_ranks: int) -> PlacedCuts | None:
    """The best cut of ``work`` (ticks per layer) into 2 x ``num_ranks`` stages, rank r holding
    stages r and 2 num_ranks - 1 - r; None with fewer layers than stages."""
    limits = _limits(work, num_ranks, lambda r: 2 * num_ranks - 1 - r)
    if limits is None:
        return None
    prefix, lowest, highest = limits
    L = len(work)
    front, back = prefix[:, None], prefix[None, :]  # P[i] down the rows, P[j] along the columns
    below_back = np.arange(L + 1)[:, None] <= np.arange(L + 1)[None, :]  # i <= j: the legs do not cross

    def feasible(T: int) -> list | None:
        reach = np.zeros((L + 1, L + 1), dtype=bool)
        reach[0, L] = True
        levels = [reach]
        for _ in range(num_ranks):
            # state (i, j) -> (i', j') costs P[i'] - P[i] + P[j] - P[j'] <= T
            value = np.where(reach, front - back, _NONE)
            best = _shift_max(_shift_max(value, 0, ascending=True), 1, ascending=False)
            reach = (best >= front - back - T) & below_back
            levels.append(reach)
        meet = np.flatnonzero(np.diagonal(reach))
        if meet.size == 0:
            return None
        i = j = int(meet[0])
        path = [(i, j)]
        for earlier in reversed(levels[:-1]):  # back from the meeting point, any predecessor
            candidates = np.argwhere(earlier[:i, j + 1:])
            cost = prefix[i] - prefix[candidates[:, 0]] + prefix[candidates[:, 1] + j + 1] - prefix[j]
            k = int(np.flatnonzero(cost <= T)[0])
            i, j = int(candidates[k, 0]), int(candidates[k, 1]) + j + 1
            path.append((i, j))
        path.reverse()  # (0, L), then rank 0's ends, ..., the meeting point
        return [i for i, _ in path] + [j for _, j in reversed(path[:-1])]

    busiest, bounds = _bisect(lowest, highest, feasible)
    return PlacedCuts(tuple(bounds), busiest)


def loop_cuts(work: Sequence[int], num_ranks: int) -> PlacedCuts | None:
    """The best cut of ``work`` (ticks per layer) into 2 x ``num_ranks`` stages, rank r holding
    stages r and num_ranks + r; None with fewer layers than stages."""
    limits = _limits(work, num_ranks, lambda r: num_ranks + r)
    if limits is None:
        return None
    prefix, lowest, highest = limits
    L, p, total = len(work), num_ranks, int(prefix[-1])

    def halves(T: int, c: int) -> list | None:
        a_sums, b_sums = prefix[:c + 1, None], prefix[None, c:]  # rows a in [0, c], columns b in [c, L]
        reach = np.zeros((c + 1, L - c + 1), dtype=bool)
        reach[0, 0] = True
        levels = [reach]
        for _ in range(p):
            # state (a, b) -> (a', b') costs P[a'] - P[a] + P[b'] - P[b] <= T
            value = np.where(reach, a_sums + b_sums, _NONE)
            best = _shift_max(_shift_max(value, 0, ascending=True), 1, ascending=True)
            reach = best >= a_sums + b_sums - T
            levels.append(reach)
        if not reach[c, L - c]:
            return None
        a, b = c, L - c
        path = [(a, b)]
        for earlier in reversed(levels[:-1]):
            candidates = np.argwhere(earlier[:a, :b])
            cost = prefix[a] - prefix[candidates[:, 0]] + prefix[b + c] - prefix[candidates[:, 1] + c]
            k = int(np.flatnonzero(cost <= T)[0])
            a, b = int(candidates[k, 0]), int(candidates[k, 1])
            path.append((a, b))
        path.reverse()
        return [a for a, _ in path] + [b + c for _, b in path[1:]]

    def feasible(T: int) -> list | None:
        # each half holds p stages of at least one layer and at most p x T of work; the split
        # nearest an even one first, where an answer usually lies
        splits = [c for c in range(p, L - p + 1) if prefix[c] <= p * T and total - prefix[c] <= p * T]
        for c in sorted(splits, key=lambda c: (abs(2 * int(prefix[c]) - total), c)):
            found = halves(T, c)
            if found is not None:
                return found
        return None

    busiest, bounds = _bisect(lowest, highest, feasible)
    return PlacedCuts(tuple(bounds), busiest)
