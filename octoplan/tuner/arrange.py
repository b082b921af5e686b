"""Start-aware placement: which rank holds which stage, when ranks do not all start together.

Balancing each rank's load (what CP-SAT and the balanced partition do) treats every rank as
if it could work from the first to the last millisecond. In a pipeline it cannot: rank ``r``
waits for the first microbatch's forward through every stage before its first stage, and the
last microbatch's input gradient still has to travel back through those stages after the rank
is done. With B split into I and a deferred W, the rank's own Ws can fill the second wait,
but not the first. A rank's time is therefore about

    T_r = microbatches * load_r + sum over stages s before first(r) of (F_s + I_s)

and the iteration at least ``max_r T_r``. Two placements with the same loads can differ by
several microbatches' worth of time: the busiest rank should hold early stages, and ranks
that start late should carry less. :func:`start_aware` moves and swaps stages between ranks
(stage boundaries stay) to lower ``max_r T_r`` — a cheap proxy, priced in pure Python; the
simulator still judges every candidate it produces.

Deterministic: moves are scanned in a fixed order and the best strict improvement is taken.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["rank_times", "start_aware"]


def rank_times(ranks: Sequence[int], work: Sequence[float], lead: Sequence[float], *, num_ranks: int,
               microbatches: int) -> list[float]:
    """``T_r`` above for every rank: ``work[s]`` is stage s's F + I + W per microbatch and
    ``lead[s]`` its F + I (what a later rank waits for); ranks holding nothing get 0."""
    load = [0.0] * num_ranks
    first = [-1] * num_ranks
    for s, r in enumerate(ranks):
        load[r] += work[s]
        if first[r] < 0:
            first[r] = s
    prefix = [0.0]
    for value in lead:
        prefix.append(prefix[-1] + value)
    return [microbatches * load[r] + (prefix[first[r]] if first[r] >= 0 else 0.0) for r in range(num_ranks)]


def _key(times: Sequence[float]) -> tuple[float, float]:
    # the worst rank first, then the spread (so ties in the worst rank still make progress)
    return (max(times), sum(t * t for t in times))


def _valid(ranks: Sequence[int], s: int) -> bool:
    """Stage s is not on the same rank as a neighbour (two neighbouring stages on one rank
    would be one stage)."""
    r = ranks[s]
    return (s == 0 or ranks[s - 1] != r) and (s + 1 == len(ranks) or ranks[s + 1] != r)


def start_aware(ranks: Sequence[int], work: Sequence[float], lead: Sequence[float], *, num_ranks: int,
                microbatches: int, max_per_rank: int, max_rounds: int = 200) -> tuple[int, ...]:
    """A placement of the same stages with a lower ``max_r T_r`` (or ``ranks`` unchanged):
    best-improvement moves and swaps of a stage of the worst rank, every rank keeping at least
    one and at most ``max_per_rank`` stages."""
    current = list(ranks)
    num_stages = len(current)
    prefix = [0.0]
    for value in lead:
        prefix.append(prefix[-1] + value)
    held: list[list[int]] = [[] for _ in range(num_ranks)]
    for s, r in enumerate(current):
        held[r].append(s)

    def t_of(stages: list[int]) -> float:
        # stages in any order; a rank with none costs nothing
        if not stages:
            return 0.0
        return microbatches * sum(work[s] for s in stages) + prefix[min(stages)]

    times = [t_of(h) for h in held]
    best_key = _key(times)
    for _ in range(max_rounds):
        worst = max(range(num_ranks), key=lambda r: (times[r], -r))
        base_sq = best_key[1] - times[worst] ** 2
        found = None

        def consider(q: int, new_w: list[int], new_q: list[int], trial_at: tuple) -> None:
            nonlocal found
            tw, tq = t_of(new_w), t_of(new_q)
            others = max((times[r] for r in range(num_ranks) if r not in (worst, q)), default=0.0)
            key = (max(others, tw, tq), base_sq - times[q] ** 2 + tw * tw + tq * tq)
            if key < best_key and (found is None or key < found[0]):
                found = (key, trial_at)

        for a in list(held[worst]):
            for b in range(num_stages):
                q = current[b]
                if q == worst:
                    continue
                current[a], current[b] = q, worst
                if _valid(current, a) and _valid(current, b):
                    consider(q, [s for s in held[worst] if s != a] + [b], [s for s in held[q] if s != b] + [a],
                             ("swap", a, b, q))
                current[a], current[b] = worst, q
            if len(held[worst]) > 1:
                for q in range(num_ranks):
                    if q == worst or len(held[q]) >= max_per_rank:
                        continue
                    current[a] = q
                    if _valid(current, a):
                        consider(q, [s for s in held[worst] if s != a], held[q] + [a], ("move", a, -1, q))
                    current[a] = worst
        if found is None:
            break
        best_key, (how, a, b, q) = found
        current[a] = q
        held[worst].remove(a)
        held[q].append(a)
        if how == "swap":
            current[b] = worst
            held[q].remove(b)
            held[worst].append(b)
        times[worst], times[q] = t_of(held[worst]), t_of(held[q])
    return tuple(current)
