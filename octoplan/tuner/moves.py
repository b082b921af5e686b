"""Bubble-aware moves: the neighbours of a candidate, most promising first.

Every move changes one of the three dimensions the tuner co-optimizes:
- ``partition``: shift a stage boundary by one layer; split a stage in two; merge two stages;
- ``placement``: move or swap stages between ranks; swap two ranks' whole contents (which
  changes which node each part of the model sits on); re-place the stages so the busiest
  ranks start early (:func:`octoplan.tuner.arrange.start_aware`, given per-stage times);
- ``schedule``: a rank's warm-up depth (in-flight limit), B split into I + W, how long Ws
  may wait, which chunk goes first, whether its stages recompute their activations (a rank's
  stages, one stage, or a stage's first layers: selective recomputation); a
  baseline's fixed order turned into the policy scheduler; and direct reorders of an explicit op order at its bubbles: a deferred W moved into the gap
  where its rank idles, or the op a rank waits for moved ahead of the op before it (an
  order with a cycle is rejected by the simulator's DeadlockError).

The order comes from the simulated timeline: a rank's *heat* is its busy time plus the idle
time it causes on others (``SimResult.bubbles``: who waits on whose op). Layers move from hot
ranks to cold ones; ranks that idle get deeper warm-ups and I/W splits; a plan that does not
fit memory first tries the moves that shrink its fullest GPU. Ties keep a fixed order, broken
only by the seeded ``random.Random`` passed in, so a run is deterministic for a seed.

The climbs read these moves as one neighbourhood (:class:`octoplan.tuner.neighbourhoods.BasicMoves`),
ranked together; a move that costs more than a simulation (an order rebuilt, a compound move)
is a neighbourhood of its own in :mod:`octoplan.tuner.neighbourhoods`.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import replace
from typing import Iterator

from octoplan.ops import Kind, Op
from octoplan.schedules.policy import RankPolicy, default_policies
from octoplan.simulator import SimResult
from octoplan.tuner.arrange import start_aware
from octoplan.tuner.space import Candidate

__all__ = ["DIMENSIONS", "neighbours", "shifts_off_hot_ranks", "with_layout", "with_recomputation", "Heat", "heat_of"]

DIMENSIONS = ("partition", "placement", "schedule")


class Heat:
    """Per-rank signals read off one simulated timeline."""

    def __init__(self, busy: list[float], blame: list[float], idle: list[float], transfer_pairs: list[tuple[int, int]],
                 peak: list[int], limit: int):
        self.busy = busy
        self.blame = blame  # idle time other ranks spent waiting on this rank's ops
        self.idle = idle  # this rank's own idle time between its first and last op
        self.transfer_pairs = transfer_pairs  # (waiting rank, sending rank) of transfer-bound bubbles, worst first
        self.peak = peak
        self.limit = limit

    def heat(self, rank: int) -> float:
        return self.busy[rank] + 0.5 * self.blame[rank]


def heat_of(result: SimResult) -> Heat:
    num_ranks = result.num_ranks
    blame = [0.0] * num_ranks
    idle = [0.0] * num_ranks
    transfer: dict[tuple[int, int], float] = defaultdict(float)
    for bubble in result.bubbles:
        if bubble.reason == "drain":
            continue
        idle[bubble.rank] += bubble.duration_ms
        if bubble.from_rank is not None and bubble.from_rank != bubble.rank:
            blame[bubble.from_rank] += bubble.duration_ms
            if bubble.reason == "transfer":
                transfer[(bubble.rank, bubble.from_rank)] += bubble.duration_ms
    pairs = [pair for pair, _ in sorted(transfer.items(), key=lambda item: (-item[1], item[0]))]
    return Heat(list(result.busy_ms), blame, idle, pairs, list(result.peak_memory_bytes), result.memory_limit_bytes)


def with_layout(cand: Candidate, bounds: tuple[int, ...], ranks: tuple[int, ...], origin: str,
                 recompute: tuple[frozenset[int], tuple[tuple[int, int], ...]] | None = None) -> Candidate:
    """A new partition/placement. A fixed order survives only a pure boundary shift; otherwise
    the policy scheduler takes over with the candidate's knobs (or 1F1B-like defaults).
    ``recompute``: the recomputing stages and their layer counts, when the move renumbers them
    (default: unchanged; a stage moved to another rank keeps its recomputation)."""
    if recompute is not None:
        cand = replace(cand, recompute=recompute[0], recompute_layers=recompute[1])
    if cand.recompute_layers:  # a count the new boundaries make as large as its stage is the whole stage
        cand = replace(cand, recompute_layers=tuple((s, k) for s, k in cand.recompute_layers if k < bounds[s + 1] - bounds[s]))
    if cand.fixed is not None and ranks == cand.ranks:
        return replace(cand, bounds=bounds, origin=origin)
    pp, num_mb = cand.config.pp, cand.config.microbatches
    policies = cand.policies
    if policies is None or len(ranks) != len(cand.ranks) or ranks != cand.ranks:
        split = bool(policies) and any(p.split for p in policies)
        fresh = default_policies(ranks, pp, num_mb, split=split)
        if policies is not None:
            # keep the tuned knobs, re-deriving only the warm-up depth the new placement needs
            fresh = tuple(replace(old, inflight=new.inflight, warmup=new.warmup if old.warmup < num_mb else old.warmup)
                          for old, new in zip(policies, fresh))
        policies = fresh
    return replace(cand, bounds=bounds, ranks=ranks, policies=policies, fixed=None, origin=origin, fixed_id="")


def _boundary_moves(cand: Candidate, heat: Heat, memory_first: bool) -> list[tuple[float, Candidate]]:
    out = []
    b = cand.bounds
    for j in range(1, cand.num_stages):
        left, right = j - 1, j
        rl, rr = cand.ranks[left], cand.ranks[right]
        for delta in (-1, 1):
            cut = b[j] + delta
            if not b[j - 1] < cut < b[j + 1]:
                continue
            # delta -1 moves a layer from the left stage to the right one
            giver, taker = (rl, rr) if delta < 0 else (rr, rl)
            if giver == taker:
                gain = 0.0
            elif memory_first:
                gain = float(heat.peak[giver] - heat.peak[taker])
            else:
                gain = heat.heat(giver) - heat.heat(taker)
            bounds = b[:j] + (cut,) + b[j + 1:]
            out.append((gain, with_layout(cand, bounds, cand.ranks, f"shift boundary {j} by {delta:+d}")))
    return out


def _renumbered(cand: Candidate, *, split: int | None = None, at: int | None = None,
                merged: int | None = None) -> tuple[frozenset[int], tuple[tuple[int, int], ...]]:
    """The recomputing stages and their layer counts (stage -> how many of its first layers)
    after stage ``split`` is cut in two at layer ``at``, or stages ``merged`` and ``merged + 1``
    become one. A split recomputes the same layers as before. A merge recomputes a prefix:
    the first stage's recomputed layers, or, where the second stage recomputes, all of the
    first and the second's; that is a superset of the layers its parts recomputed (more
    recomputation never needs more memory). Other stages keep theirs, renumbered."""
    counts = {s: cand.recomputed_layers(s) for s in cand.recompute}
    lengths = [b - a for a, b in zip(cand.bounds, cand.bounds[1:])]
    if split is not None:
        assert at is not None
        first = at - cand.bounds[split]
        k = counts.pop(split, 0)
        counts = {(s if s < split else s + 1): n for s, n in counts.items()}
        lengths = lengths[:split] + [first, lengths[split] - first] + lengths[split + 1:]
        counts.update({split: min(k, first), split + 1: max(k - first, 0)})
    else:
        assert merged is not None
        k1, k2 = counts.pop(merged, 0), counts.pop(merged + 1, 0)
        counts = {(s if s < merged else s - 1): n for s, n in counts.items()}
        counts[merged] = lengths[merged] + k2 if k2 else k1
        lengths = lengths[:merged] + [lengths[merged] + lengths[merged + 1]] + lengths[merged + 2:]
    recompute = frozenset(s for s, n in counts.items() if n > 0)
    some = tuple(sorted((s, n) for s, n in counts.items() if 0 < n < lengths[s]))
    return recompute, some


def _stage_count_moves(cand: Candidate, heat: Heat, max_per_rank: int) -> list[tuple[float, Candidate]]:
    out = []
    pp = cand.config.pp
    counts = [0] * pp
    for r in cand.ranks:
        counts[r] += 1
    order = sorted(range(pp), key=lambda r: heat.heat(r))
    coldest = order[0]
    hottest = order[-1]
    b = cand.bounds
    # split the hottest rank's longest stage; the second half goes to the coldest rank
    for s in cand.stages_of(hottest):
        length = b[s + 1] - b[s]
        if length < 2 or counts[coldest] >= max_per_rank:
            continue
        cut = b[s] + length // 2
        bounds = b[:s + 1] + (cut,) + b[s + 1:]
        for target in (coldest, hottest):
            if target == hottest and counts[hottest] >= max_per_rank:
                continue
            ranks = cand.ranks[:s + 1] + (target,) + cand.ranks[s + 1:]
            out.append((heat.heat(hottest) - heat.heat(target),
                        with_layout(cand, bounds, ranks, f"split stage {s}", _renumbered(cand, split=s, at=cut))))
    # merge a stage into a neighbour: fewer stages, fewer transfers
    for s in range(cand.num_stages - 1):
        r0, r1 = cand.ranks[s], cand.ranks[s + 1]
        bounds = b[:s + 1] + b[s + 2:]
        for keep, drop in ((r0, r1), (r1, r0)):
            if keep != drop and counts[drop] < 2:
                continue
            ranks = cand.ranks[:s] + (keep,) + cand.ranks[s + 2:]
            gain = 1e9 if keep == drop else heat.heat(drop) - heat.heat(keep)
            out.append((gain, with_layout(cand, bounds, ranks, f"merge stages {s} and {s + 1}",
                                           _renumbered(cand, merged=s))))
            if keep == drop:
                break
    return out


def _placement_moves(cand: Candidate, heat: Heat, rng: random.Random, breadth: int,
                     max_per_rank: int) -> list[tuple[float, Candidate]]:
    out = []
    pp = cand.config.pp
    counts = [0] * pp
    for r in cand.ranks:
        counts[r] += 1
    order = sorted(range(pp), key=lambda r: (heat.heat(r), r))
    hot = order[::-1][:breadth]
    cold = order[:breadth]
    ranks = cand.ranks
    for h in hot:
        for c in cold:
            if h == c:
                continue
            gap = heat.heat(h) - heat.heat(c)
            for a in cand.stages_of(h):
                # move a stage off a rank that holds several, onto one with room for it
                if counts[h] > 1 and counts[c] < max_per_rank:
                    moved = ranks[:a] + (c,) + ranks[a + 1:]
                    out.append((gap, with_layout(cand, cand.bounds, moved, f"move stage {a} to rank {c}")))
                for s in cand.stages_of(c):
                    swapped = list(ranks)
                    swapped[a], swapped[s] = c, h
                    out.append((gap * 0.5, with_layout(cand, cand.bounds, tuple(swapped), f"swap stages {a} and {s}")))
    # ranks whose transfers stall others: trade a rank's whole contents with one next to its
    # partner, to pull the pair onto one node (or onto the fast side of a node boundary)
    for waiting, sending in heat.transfer_pairs[:breadth]:
        for partner in (waiting - 1, waiting + 1, sending - 1, sending + 1):
            for moving in (sending, waiting):
                if 0 <= partner < pp and partner not in (waiting, sending):
                    perm = list(range(pp))
                    perm[moving], perm[partner] = partner, moving
                    swapped = tuple(perm[r] for r in ranks)
                    # a rank's contents move whole; its stages keep their recomputation
                    out.append((heat.idle[waiting], with_layout(cand, cand.bounds, swapped, f"swap ranks {moving} and {partner}")))
    rng.shuffle(out)  # ties break by seed, then the stable sort below keeps that order
    return out


def _start_aware_moves(cand: Candidate, work: tuple, max_per_rank: int) -> list[tuple[float, Candidate]]:
    """The same stages re-placed so the busiest ranks start early (:mod:`octoplan.tuner.arrange`)."""
    stage_work, stage_lead = work
    per_rank = max(max_per_rank, max(cand.ranks.count(r) for r in set(cand.ranks)))
    ranks = start_aware(cand.ranks, stage_work, stage_lead, num_ranks=cand.config.pp,
                        microbatches=cand.config.microbatches, max_per_rank=per_rank)
    if ranks == cand.ranks:
        return []
    # tried right after the turn to the policy scheduler: one move that may fix many bubbles
    return [(1e8, with_layout(cand, cand.bounds, ranks, "start-aware placement"))]


def _schedule_moves(cand: Candidate, heat: Heat, memory_first: bool) -> list[tuple[float, Candidate]]:
    out = []
    pp, num_mb = cand.config.pp, cand.config.microbatches
    if cand.policies is None:
        for split in (True, False):
            policies = default_policies(cand.ranks, pp, num_mb, split=split)
            out.append((1e9, replace(cand, policies=policies, fixed=None, origin=f"policy scheduler (split={split})",
                                     fixed_id="")))
        return out
    policies = cand.policies

    # a move that leaves every rank's policy acting as before would only cost a simulation:
    # gemma3-27b's 64-deep warm-ups under in-flight limits of 6-34, W caps far above the Ws a
    # rank can hold back (a CP-SAT seed's 148 schedule moves are 83 without them)
    held = [len(cand.stages_of(r)) for r in range(pp)]

    def moot(old: RankPolicy, new: RankPolicy, rank: int) -> bool:
        return new.acts_like(old, stages=held[rank], microbatches=num_mb)

    def knob(rank: int, gain: float, why: str, **changes) -> None:
        new = list(policies)
        new[rank] = replace(new[rank], **changes)
        if not moot(policies[rank], new[rank], rank):
            out.append((gain, replace(cand, policies=tuple(new), origin=f"rank {rank}: {why}")))

    def every(gain: float, why: str, fn) -> None:
        new = tuple(fn(p) for p in policies)
        if not all(moot(p, q, r) for r, (p, q) in enumerate(zip(policies, new))):
            out.append((gain, replace(cand, policies=new, origin=why)))

    if memory_first:
        fullest = sorted(range(pp), key=lambda r: (-heat.peak[r], r))
        for r in fullest[:3]:
            p = policies[r]
            if p.inflight > 1:
                knob(r, float(heat.peak[r]), f"in-flight {p.inflight - 1}", inflight=p.inflight - 1)
            if p.split and p.w_cap > 0:
                knob(r, float(heat.peak[r]) * 0.9, f"w_cap {p.w_cap // 2}", w_cap=p.w_cap // 2)
        every(1.0, "every rank in-flight -1", lambda p: replace(p, inflight=max(1, p.inflight - 1)))
    every(2.0 * max(heat.idle), "every rank splits B", lambda p: replace(p, split=True, w_cap=max(p.w_cap, pp)))
    every(1.5 * max(heat.idle), "every rank in-flight +1", lambda p: replace(p, inflight=min(num_mb, p.inflight + 1)))
    every(1.45 * max(heat.idle), "every rank toggles w_fits_gap", lambda p: replace(p, w_fits_gap=not p.w_fits_gap))
    every(1.4 * max(heat.idle), "every rank warm-up +1", lambda p: replace(p, warmup=min(num_mb, p.warmup + 1)))
    every(1.3 * max(heat.idle), "every rank warm-up -1", lambda p: replace(p, warmup=max(1, p.warmup - 1)))
    for r in sorted(range(pp), key=lambda r: (-heat.idle[r], r)):
        p = policies[r]
        gain = heat.idle[r]
        if not p.split:
            knob(r, gain, "split B into I+W", split=True, w_cap=max(p.w_cap, pp))
        if p.inflight < num_mb:
            knob(r, gain * 0.9, f"in-flight {p.inflight + 1}", inflight=p.inflight + 1)
        if p.warmup < num_mb:
            knob(r, gain * 0.85, f"warm-up {p.warmup + 1}", warmup=p.warmup + 1)
        if p.warmup > 1:
            knob(r, gain * 0.8, f"warm-up {p.warmup - 1}", warmup=p.warmup - 1)
        if p.split:
            for cap in (0, max(1, p.w_cap // 2), p.w_cap * 2 if p.w_cap else pp, num_mb * 3):
                if cap != p.w_cap:
                    knob(r, gain * 0.5, f"w_cap {cap}", w_cap=cap)
        if p.split:
            knob(r, gain * 0.45, f"w_fits_gap {not p.w_fits_gap}", w_fits_gap=not p.w_fits_gap)
        if len(cand.stages_of(r)) > 1:
            knob(r, gain * 0.4, "deep_first" if not p.deep_first else "oldest first", deep_first=not p.deep_first)
        if p.inflight > 1:
            knob(r, gain * 0.3, f"in-flight {p.inflight - 1}", inflight=p.inflight - 1)
        if p.split:
            knob(r, gain * 0.2, "fuse I+W into B", split=False, w_cap=0)
    every(0.1, "every rank in-flight -1", lambda p: replace(p, inflight=max(1, p.inflight - 1)))
    return out


def with_recomputation(cand: Candidate, counts: dict[int, int], origin: str) -> Candidate:
    """``cand`` with each stage of ``counts`` recomputing that many of its first layers (0:
    none; as many as it has, or more: all)."""
    recompute, some = set(cand.recompute), dict(cand.recompute_layers)
    for stage, k in counts.items():
        length = cand.bounds[stage + 1] - cand.bounds[stage]
        some.pop(stage, None)
        if k <= 0:
            recompute.discard(stage)
            continue
        recompute.add(stage)
        if k < length:
            some[stage] = k
    return replace(cand, recompute=frozenset(recompute), recompute_layers=tuple(sorted(some.items())), origin=origin)


def _recompute_moves(cand: Candidate, heat: Heat, memory_first: bool) -> list[tuple[float, Candidate]]:
    """Activation recomputation, per rank, per stage and per layer. Where memory is short, on
    the fullest ranks first (after the in-flight cuts, which cost no compute): more layers of
    a stage that recomputes some, then the rank's earliest stage that keeps its activations
    (the one with the most microbatches in flight, so the most memory per millisecond of
    recomputed forward), then all its stages. Where a full rank idles (its admissions may be
    throttled by memory), the same. Where memory allows, off, since it costs every backward a
    forward: all of a rank's stages, then one stage at a time, the latest first (the fewest in
    flight, so the least memory back), then half or all but one of a stage's recomputed
    layers, the latest stage first; on the least full recomputing ranks and on the busiest
    ones (whose recomputed forwards the iteration waits for)."""
    out = []
    pp = cand.config.pp
    fullest = sorted(range(pp), key=lambda r: (-heat.peak[r], r))
    recomputing = [r for r in range(pp) if any(s in cand.recompute for s in cand.stages_of(r))]

    def emit(gain: float, counts: dict[int, int], origin: str) -> None:
        moved = with_recomputation(cand, counts, origin)
        if (moved.recompute, moved.recompute_layers) != (cand.recompute, cand.recompute_layers):
            out.append((gain, moved))

    def length(stage: int) -> int:
        return cand.bounds[stage + 1] - cand.bounds[stage]

    def turn_on(rank: int, gain: float) -> None:
        mine = cand.stages_of(rank)
        for s in mine:  # a partly recomputing stage: twice its layers, or one more
            k = cand.recomputed_layers(s)
            if 0 < k < length(s):
                for more in dict.fromkeys((min(2 * k, length(s)), k + 1)):
                    emit(gain, {s: more}, f"stage {s} (rank {rank}): recompute {more} of {length(s)} layers")
        kept = [s for s in mine if s not in cand.recompute]
        partly = any(0 < cand.recomputed_layers(s) < length(s) for s in mine)
        if kept and (len(kept) > 1 or partly):  # else the stage's move is the rank's
            emit(0.995 * gain, {kept[0]: length(kept[0])}, f"stage {kept[0]} (rank {rank}): recompute")
        emit(0.99 * gain, {s: length(s) for s in mine}, f"rank {rank}: recompute")

    if memory_first:
        for r in fullest[:3]:
            if any(cand.recomputed_layers(s) < length(s) for s in cand.stages_of(r)):
                turn_on(r, 0.95 * heat.peak[r])
        emit(0.9 * max(heat.peak), {s: length(s) for s in range(cand.num_stages)}, "every rank recomputes")
        return out
    busiest = sorted(recomputing, key=lambda r: (-heat.busy[r], r))[:2]
    least_full = [r for r in reversed(fullest) if r in recomputing][:2]
    for r in dict.fromkeys(least_full + busiest):
        mine = [s for s in cand.stages_of(r) if s in cand.recompute]
        emit(heat.busy[r], {s: 0 for s in mine}, f"rank {r}: no recompute")
        if len(mine) > 1:
            for k, s in enumerate(reversed(mine)):
                emit(heat.busy[r] * (0.9 - 0.01 * k), {s: 0}, f"stage {s} (rank {r}): no recompute")
        for j, s in enumerate(reversed(mine)):
            k = cand.recomputed_layers(s)
            for fewer in dict.fromkeys((k // 2, k - 1)):
                if 0 < fewer < k:
                    emit(heat.busy[r] * (0.8 - 0.01 * j), {s: fewer}, f"stage {s} (rank {r}): recompute {fewer} of {length(s)} layers")
    for r in fullest[:2]:
        if heat.idle[r] > 0 and any(cand.recomputed_layers(s) < length(s) for s in cand.stages_of(r)):
            turn_on(r, 0.6 * heat.idle[r])
    return out


def _reorder_moves(cand: Candidate, result: SimResult, breadth: int) -> list[tuple[float, Candidate]]:
    """Op-order edits at the longest bubbles of ``result`` (whose schedule is ``cand``'s)."""
    schedule = [[span.op for span in result.spans(r)] for r in range(result.num_ranks)]
    index = [{op: i for i, op in enumerate(ops)} for ops in schedule]
    # the warm-up wait before a rank's first op cannot be reordered away: skip it
    bubbles = sorted((b for b in result.bubbles if b.reason != "drain" and b.waits_for is not None and b.start_ms > 0),
                     key=lambda b: (-b.duration_ms, b.rank, b.start_ms))
    out = []
    tag = cand.fixed_id.split("#")[0] if cand.fixed_id else "policy"

    def emit(gain: float, new_schedule: list[list[Op]], why: str) -> None:
        frozen = tuple(tuple(ops) for ops in new_schedule)
        # the digest only names the order inside this run (cache identity); no decision
        # depends on its value, so per-process hash seeds do not break determinism
        key = f"{tag}#{hash(frozen) & 0xFFFFFFFFFFFF:x}"
        out.append((gain, replace(cand, policies=None, fixed=frozen, origin=why, fixed_id=key)))

    for bubble in bubbles[: 4 * breadth]:
        need = bubble.waits_for
        r = bubble.rank
        # the op on rank r that waited: the consumer of ``need``
        if need.kind is Kind.F:
            waiting = [Op(need.stage + 1, Kind.F, need.mb)]
        else:
            waiting = [Op(need.stage - 1, Kind.I, need.mb), Op(need.stage - 1, Kind.B, need.mb)]
        at = next((index[r][op] for op in waiting if op in index[r]), None)
        if at is None:
            continue
        # a W of this rank whose I already ran: move it into the gap
        for k in range(at + 1, len(schedule[r])):
            op = schedule[r][k]
            if op.kind is Kind.W and index[r].get(Op(op.stage, Kind.I, op.mb), len(schedule[r])) < at:
                new = [list(ops) for ops in schedule]
                new[r].insert(at, new[r].pop(k))
                emit(bubble.duration_ms, new, f"rank {r}: {op} into the gap before {schedule[r][at]}")
                break
        # the producer of ``need`` one step earlier, and ahead of the Ws right before it
        q = bubble.from_rank
        j = index[q].get(need) if q is not None else None
        if j is None or j == 0:
            continue
        new = [list(ops) for ops in schedule]
        new[q][j - 1], new[q][j] = new[q][j], new[q][j - 1]
        emit(bubble.duration_ms * 0.8, new, f"rank {q}: {need} one op earlier")
        first_w = j
        while first_w > 0 and schedule[q][first_w - 1].kind is Kind.W:
            first_w -= 1
        if first_w < j - 1:
            new = [list(ops) for ops in schedule]
            new[q].insert(first_w, new[q].pop(j))
            emit(bubble.duration_ms * 0.9, new, f"rank {q}: {need} ahead of {j - first_w} Ws")
    return out


def shifts_off_hot_ranks(cand: Candidate, result: SimResult, *, limit: int) -> list[Candidate]:
    """The ``limit`` boundary shifts that move a layer from a hotter rank to a cooler one, the
    largest difference in heat first: the moves worth following with a justification, which
    costs a pass over every op (a shift alone often lands in an order that no longer fits it)."""
    heat = heat_of(result)
    moves = [(gain, moved) for gain, moved in _boundary_moves(cand, heat, memory_first=not result.fits_memory) if gain > 0]
    moves.sort(key=lambda item: -item[0])  # stable: ties keep the boundaries' order
    return [moved for _, moved in moves[:limit]]


def neighbours(
    cand: Candidate,
    result: SimResult,
    *,
    dimensions: tuple[str, ...] = DIMENSIONS,
    rng: random.Random,
    max_stages_per_rank: int = 3,
    breadth: int = 3,
    work: tuple | None = None,
    allow_recompute: bool = True,
) -> Iterator[Candidate]:
    """The candidates one move away, the most promising first; each is yielded once.
    ``work``: per stage, (F + I + W, F + I) ms of one microbatch, for the start-aware move."""
    heat = heat_of(result)
    memory_first = not result.fits_memory
    scored: list[tuple[float, int, Candidate]] = []
    groups: list[list[tuple[float, Candidate]]] = []
    # Moves that change the stage count or placement leave a baseline's fixed order behind and
    # hand the candidate to the policy scheduler with default knobs; tuning those knobs is
    # the schedule dimension's job.
    if "partition" in dimensions:
        groups.append(_boundary_moves(cand, heat, memory_first))
        groups.append(_stage_count_moves(cand, heat, max_stages_per_rank))
    if "placement" in dimensions:
        groups.append(_placement_moves(cand, heat, rng, breadth, max_stages_per_rank))
        if work is not None and cand.num_stages > cand.config.pp:
            groups.append(_start_aware_moves(cand, work, max_stages_per_rank))
    if "schedule" in dimensions:
        groups.append(_schedule_moves(cand, heat, memory_first))
        if allow_recompute:
            groups.append(_recompute_moves(cand, heat, memory_first))
        groups.append(_reorder_moves(cand, result, breadth))
    seq = 0
    for group in groups:
        for gain, moved in group:
            scored.append((-gain, seq, moved))
            seq += 1
    scored.sort(key=lambda item: (item[0], item[1]))
    seen = {cand}
    for _, _, moved in scored:
        if moved in seen:
            continue
        seen.add(moved)
        yield moved

