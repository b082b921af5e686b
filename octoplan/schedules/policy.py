"""A policy list scheduler: a valid, deadlock-free op order for *any* stage -> rank map.

The known schedules (gpipe, looped, zbv, dualpipev) are rules written for one placement. The
tuner moves stages between ranks freely, so it needs a generator that works for every map. This
one simulates the iteration event by event, with the same cost semantics as the simulator
(FORMATS.md section 7: ops last their stage's time, transfers between ranks cost latency + bytes /
bandwidth and leave one at a time per rank pair in production order), and whenever a rank is
free it runs the ready op its :class:`RankPolicy` prefers:

1. a deferred W, if more than ``w_cap`` are pending (bounds the memory W holds);
2. a backward (B, or I when ``split``), oldest microbatch first, later stage first on ties —
   backward first frees activation memory, as 1F1B does;
3. a forward, the later stage first when ``deep_first`` (drives microbatches to the end of the
   pipeline sooner) else the oldest microbatch; a forward of the rank's first stage admits a
   new microbatch to the rank and waits while ``inflight`` microbatches are admitted and not
   yet through that stage's backward, or — until the rank has run anything but its first
   stage's forwards — once it has run ``warmup`` of them (the warm-up depth: how far ahead the
   rank fills before it turns to its other stages, ZB-V's 2(pp-r)-1); and every forward waits
   while running it would leave the rank's activations, with what the older microbatches'
   forwards still to run on the rank will add, past its ``activation_budget_bytes`` (the
   budget keeps room for the messages the rank's transport holds beside them) — the oldest
   microbatch with ops left on the rank never waits for memory;
4. a deferred W, to fill a gap where nothing else is ready — with ``w_fits_gap``, only if no
   op whose input is already on its way would arrive before the W ends.

Why it cannot deadlock: each stage runs its F and its backward in microbatch order and a rank
admits microbatches in order, so the globally oldest unfinished microbatch is, on every rank,
the oldest with ops left (or not yet admitted, on a rank whose admitted ones are all done);
its forwards never wait for memory and its backwards never do, so its next op becomes ready
and nothing blocks it, and time advances.

Why memory is charged that way: a younger microbatch's forward may take memory only where every
older one can still run its remaining forwards beside it, so what the older ones will need is
never taken from them. An earlier rule reserved a microbatch's activations on all the rank's
stages as it was admitted; that refused admissions whose later stages' memory would be needed
only after older microbatches had freed theirs (a V rank's second stage), and so kept fewer
microbatches in flight than memory allowed (the tuner's plans on memory-bound workloads were
up to 2.5% slower for it).

The scheduler emits compute ops only; the simulator remains the judge of the order it emits.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import NamedTuple, Sequence

from octoplan.costs import StageCost, transfer_ms
from octoplan.ops import Kind, Op
from octoplan.plan import Cluster, Parallel

__all__ = ["RankPolicy", "default_policies", "policy_schedule"]

_INF = float("inf")


@dataclass(frozen=True)
class RankPolicy:
    """The knobs of one rank's list-scheduling policy."""

    inflight: int  # most microbatches admitted to the rank and not yet through its first stage's backward
    warmup: int = 1 << 30  # first-stage forwards before the rank first runs anything else
    split: bool = False  # backward as I then a deferred W, rather than one B
    w_cap: int = 0  # deferred Ws kept pending before one is forced (with split)
    deep_first: bool = True  # among ready forwards, the rank's later stage first
    w_fits_gap: bool = False  # a gap-filling W waits if a known arrival would come before it ends

    def acts_like(self, other: RankPolicy, *, stages: int | None = None, microbatches: int | None = None) -> bool:
        """Whether the two give the rank the same order: the same knobs but for those that
        cannot bind. Given the rank's number of ``stages`` and the ``microbatches`` (None:
        not known), that is also the in-flight limits and W caps that never stop an op."""
        return self.effect(stages=stages, microbatches=microbatches) == other.effect(stages=stages, microbatches=microbatches)

    def effect(self, *, stages: int | None = None, microbatches: int | None = None) -> tuple:
        """The knobs as :func:`policy_schedule` reads them, each moot value replaced by one that
        acts the same way:
        - an in-flight limit of at least ``microbatches``: no more can be admitted;
        - a warm-up depth of at least the in-flight limit: while a rank warms up it has run no
          backward, so the microbatches it admitted are its warm-up forwards, and such a depth
          never stops one that the in-flight limit lets through;
        - a W cap of at least the Ws the rank can hold back (microbatches x stages), and the W
          knobs of a rank that does not split its backward: they never force or hold a W;
        - the forward order of a rank with one stage: it has one forward to choose."""
        inflight = self.inflight if microbatches is None else min(self.inflight, microbatches)
        w_cap = self.w_cap
        if stages is not None and microbatches is not None:
            w_cap = min(w_cap, stages * microbatches)
        return (inflight, min(self.warmup, inflight), self.split, w_cap if self.split else 0,
                self.w_fits_gap and self.split, self.deep_first or stages == 1)

    def to_dict(self) -> dict:
        return {"inflight": self.inflight, "warmup": self.warmup, "split": self.split, "w_cap": self.w_cap,
                "deep_first": self.deep_first, "w_fits_gap": self.w_fits_gap}


def default_policies(rank_of_stage: Sequence[int], num_ranks: int, microbatches: int, *, split: bool = False,
                     depth: float = 1.0, warmup_gap: bool = True) -> tuple[RankPolicy, ...]:
    """1F1B-like knobs for any placement: a rank admits as many microbatches as there are
    ranks between its first stage and the pipeline's end (``depth`` scales that), so the
    pipeline fills; with ``split``, Ws wait while the rank would otherwise idle. With
    ``warmup_gap`` the warm-up stops when the first microbatch can be back on the rank;
    without, only the in-flight limit bounds it."""
    num_stages = len(rank_of_stage)
    first_stage = [num_stages] * num_ranks
    for s, r in enumerate(rank_of_stage):
        first_stage[r] = min(first_stage[r], s)
    second_stage = [num_stages] * num_ranks
    for s, r in enumerate(rank_of_stage):
        if s > first_stage[r] and second_stage[r] == num_stages:
            second_stage[r] = s
    out = []
    for r in range(num_ranks):
        # ranks the microbatch still visits after this rank's first stage, counted in stages
        # scaled to ranks: a loop of V chunks revisits every rank V times
        remaining = (num_stages - first_stage[r]) * num_ranks / max(num_stages, 1)
        inflight = max(1, min(microbatches, int(round(remaining * depth))))
        # warm-up: the stages a microbatch crosses before it is back on this rank — as the
        # forward of the rank's next stage (a V: 2(pp-r)-1, as ZB-V), or as the gradient, after
        # which the steady state runs one more forward first (1F1B: pp-r)
        if second_stage[r] < num_stages:
            gap = second_stage[r] - first_stage[r]
        else:
            gap = num_stages - first_stage[r]
        warmup = max(1, min(microbatches, gap)) if warmup_gap else microbatches
        # with split, Ws wait for gaps without a cap: the in-flight limit already bounds memory
        out.append(RankPolicy(inflight=inflight, warmup=warmup, split=split,
                              w_cap=microbatches * num_stages if split else 0))
    return tuple(out)


def policy_schedule(
    rank_of_stage: Sequence[int],
    costs: Sequence[StageCost],
    *,
    microbatches: int,
    policies: Sequence[RankPolicy],
    cluster: Cluster,
    parallel: Parallel,
    activation_budget_bytes: Sequence[float] | None = None,
) -> list[list[Op]]:
    """Per-rank op lists for stages placed by ``rank_of_stage`` (stage -> pipeline rank).

    ``activation_budget_bytes``: per rank, the memory left for activations after weights,
    gradients and optimizer state (None: no memory limit beyond the in-flight knobs).
    """
    num_ranks = len(policies)
    stages_of: list[list[int]] = [[] for _ in range(num_ranks)]
    for s, r in enumerate(rank_of_stage):
        stages_of[r].append(s)
    if any(not held for held in stages_of):
        raise ValueError("every rank must hold at least one stage")
    split = [policies[r].split for r in rank_of_stage]
    times = _op_times(rank_of_stage, costs, cluster, parallel)
    memory = _memory_rule(rank_of_stage, stages_of, costs, split, times, activation_budget_bytes)
    return _list_schedule(rank_of_stage, stages_of, split, policies, microbatches, times, memory)


class _OpTimes(NamedTuple):
    """Per stage: each op's time, and where its output goes and how long it travels."""

    f_ms: list[float]
    i_ms: list[float]
    w_ms: list[float]
    b_ms: list[float]
    fwd_to: list[int]  # the rank of the next stage (-1: none)
    bwd_to: list[int]  # the rank of the stage before (-1: none)
    fwd_wire: list[float]  # the forward output's wire time (0: same rank / none)
    bwd_wire: list[float]  # the backward gradient's


def _op_times(rank_of_stage: Sequence[int], costs: Sequence[StageCost], cluster: Cluster, parallel: Parallel) -> _OpTimes:
    num_stages = len(rank_of_stage)
    overhead = cluster.op_overhead_us / 1000.0  # every op pays it, as in the simulator
    f_ms = [c.forward_ms + overhead for c in costs]
    i_ms = [c.backward_input_ms + overhead for c in costs]
    w_ms = [c.backward_weight_ms + overhead for c in costs]
    b_ms = [c.b_ms + overhead for c in costs]
    fwd_to = [rank_of_stage[s + 1] if s + 1 < num_stages else -1 for s in range(num_stages)]
    bwd_to = [rank_of_stage[s - 1] if s > 0 else -1 for s in range(num_stages)]
    fwd_wire = [0.0] * num_stages
    bwd_wire = [0.0] * num_stages
    for s in range(num_stages):
        r = rank_of_stage[s]
        if fwd_to[s] >= 0 and fwd_to[s] != r:
            fwd_wire[s] = transfer_ms(cluster, parallel, r, fwd_to[s], costs[s].output_bytes)
        if bwd_to[s] >= 0 and bwd_to[s] != r:
            bwd_wire[s] = transfer_ms(cluster, parallel, r, bwd_to[s], costs[s - 1].output_bytes)
    return _OpTimes(f_ms, i_ms, w_ms, b_ms, fwd_to, bwd_to, fwd_wire, bwd_wire)


class _MemoryRule(NamedTuple):
    """What the memory rule of the module's docstring reads, per stage and per rank."""

    act: list[int]  # per stage: what a microbatch holds from its F to its B or W
    after_i: list[int]  # what an I changes that by
    until_w: list[int]  # what W frees
    budget: list[float]  # per rank: the bytes its tapes may hold (inf: no limit)
    limited: list[bool]  # whether the rank's budget is finite
    i_grows: list[bool]  # whether an I of the rank can leave more held than its F did
    owed_per_admit: list[int]  # what one more admitted microbatch owes the rank's later stages
    later_here: list[list[int]]  # per stage: its rank's later stages


def _memory_rule(rank_of_stage: Sequence[int], stages_of: Sequence[Sequence[int]], costs: Sequence[StageCost],
                 split: Sequence[bool], times: _OpTimes, activation_budget_bytes: Sequence[float] | None) -> _MemoryRule:
    num_stages = len(rank_of_stage)
    fwd_to, bwd_to = times.fwd_to, times.bwd_to
    # what a microbatch holds on a stage from its F to its B or W (octoplan.costs.StageCost): an
    # I changes it by after_i (it frees all but what its W reads, and keeps the gradients W
    # starts from) and W frees the rest; the budget keeps room for the most an op holds above
    # that while it runs (an I's peak, a recomputing op's rebuilt activations)
    act = [c.activation_bytes for c in costs]
    after_i = [c.i_delta_bytes for c in costs]
    until_w = [c.w_held_bytes + c.pending_w_bytes for c in costs]
    transient = [c.recompute_bytes + (c.i_peak_bytes if split[s] else 0) for s, c in enumerate(costs)]
    budget = list(activation_budget_bytes) if activation_budget_bytes is not None else [_INF] * len(stages_of)
    budget = [b - max(transient[s] for s in held) for b, held in zip(budget, stages_of)]
    # and for the transport's messages beside the tapes (octoplan.simulator._message_peaks): per
    # incoming channel the receive posted ahead and one message waiting, per outgoing channel
    # a send not yet let go, each at the channel's largest message
    largest: dict[tuple[int, int], int] = {}
    for s in range(num_stages):
        r = rank_of_stage[s]
        for dst, size in ((fwd_to[s], costs[s].output_bytes), (bwd_to[s], costs[s - 1].output_bytes if s else 0)):
            if dst >= 0 and dst != r:
                largest[r, dst] = max(largest.get((r, dst), 0), size)
    for (src, dst), size in largest.items():
        budget[src] -= size
        budget[dst] -= 2 * size
    # ranks where an I can leave more held than F did: only their Ws bring them back under budget
    i_grows = [any(split[s] and after_i[s] > 0 for s in held) for held in stages_of]
    limited = [b < _INF for b in budget]
    # what the admitted microbatches' forwards still to run on a rank will add is kept as it
    # changes: sum over the rank's stages s of act[s] x (admitted - next_f[s]). A first-stage F
    # admits one more (every later stage owes its act again); any other F pays its own off.
    owed_per_admit = [sum(act[s] for s in held[1:]) for held in stages_of]
    # a rank's stages after s: a microbatch older than m can still owe a forward only there,
    # since next_f never grows along the pipeline (F(s, m) needs F(s - 1, m))
    later_here = [[s2 for s2 in stages_of[rank_of_stage[s]] if s2 > s] for s in range(num_stages)]
    return _MemoryRule(act, after_i, until_w, budget, limited, i_grows, owed_per_admit, later_here)


def _list_schedule(rank_of_stage: Sequence[int], stages_of: Sequence[Sequence[int]], split: Sequence[bool],
                   policies: Sequence[RankPolicy], num_mb: int, times: _OpTimes, memory: _MemoryRule) -> list[list[Op]]:
    """The event loop: whenever a rank is free, it runs the ready op its policy prefers (the
    module's docstring), until every op has run. One function, so that the hot loop reads its
    state as local variables."""
    num_stages = len(rank_of_stage)
    num_ranks = len(policies)
    f_ms, i_ms, w_ms, b_ms, fwd_to, bwd_to, fwd_wire, bwd_wire = times
    act, after_i, until_w, budget, limited, i_grows, owed_per_admit, later_here = memory
    first = [held[0] for held in stages_of]
    # backward candidates are scanned later stage first (the order ties break in)
    desc = [sorted(held, reverse=True) for held in stages_of]
    fwd_order = [desc[r] if policies[r].deep_first else stages_of[r] for r in range(num_ranks)]

    fwd_arrive = [[-1.0] * num_mb for _ in range(num_stages)]  # F(s,m)'s output at stage s+1's rank
    bwd_arrive = [[-1.0] * num_mb for _ in range(num_stages)]  # I/B(s,m)'s gradient at stage s-1's rank
    next_f = [0] * num_stages
    next_b = [0] * num_stages
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(num_ranks)]
    admitted = [0] * num_ranks
    warming = [True] * num_ranks  # the rank has run only first-stage forwards so far
    warm_count = [0] * num_ranks
    # what the rank's tapes hold now; a forward may take memory only where every older
    # microbatch's forwards still to run on the rank fit beside it, so the oldest can always
    # finish (see the module's docstring)
    tape = [0.0] * num_ranks
    owed = [0] * num_ranks  # what the admitted microbatches' forwards still to run will add (_memory_rule)
    ops_per_mb = [sum(3 if split[s] else 2 for s in stages) for stages in stages_of]
    ops_left = [[ops_per_mb[r]] * num_mb for r in range(num_ranks)]
    oldest = [0] * num_ranks  # the oldest microbatch with ops left on the rank
    free = [0.0] * num_ranks
    link_free: dict[tuple[int, int], float] = {}
    out: list[list[Op]] = [[] for _ in range(num_ranks)]
    remaining = sum(num_mb * (3 if split[s] else 2) for s in range(num_stages))
    version = [0] * num_ranks
    cached: list[list] = [[] for _ in range(num_ranks)]  # the candidates found at the rank's last push
    heap: list[tuple[float, int, int]] = []

    # the knobs per rank, read in the hot loop
    inflight = [p.inflight for p in policies]
    warmup = [p.warmup for p in policies]
    w_cap = [p.w_cap for p in policies]
    deep_first = [p.deep_first for p in policies]
    w_fits_gap = [p.w_fits_gap for p in policies]
    last_stage = num_stages - 1
    heappush, heappop = heapq.heappush, heapq.heappop
    F, B, I, W = Kind.F, Kind.B, Kind.I, Kind.W

    def push(r: int) -> None:
        """Find rank r's candidates (ready_time, kind, stage, mb) anew, and queue the rank at the
        earliest time it can start one of them (none: not queued, until a message comes)."""
        version[r] += 1
        t = free[r]
        if pending_w[r]:
            found = [(t, 2, -1, -1)]
            when = t
        else:
            found = []
            when = _INF
        for s in desc[r]:
            m = next_b[s]
            if m < next_f[s]:
                a = t if s == last_stage else bwd_arrive[s + 1][m]  # -1: not sent yet
                if a >= 0.0:
                    if a < t:
                        a = t
                    found.append((a, 1, s, m))
                    if a < when:
                        when = a
        first_r = first[r]
        for s in fwd_order[r]:
            m = next_f[s]
            if m >= num_mb:
                continue
            if s == first_r and (admitted[r] >= inflight[r] or (warming[r] and warm_count[r] >= warmup[r])):
                continue
            a = t if s == 0 else fwd_arrive[s - 1][m]
            if a < 0.0:
                continue
            if limited[r]:
                # an older microbatch m' still has F(s', m') to run here for m' in
                # [next_f[s'], m): what those will add must stay free. A first-stage F's m is
                # the newest admitted, so every admitted microbatch is older: all that is owed.
                room = budget[r] - tape[r] - act[s]
                if s == first_r:
                    room -= owed[r]
                else:
                    for s2 in later_here[s]:
                        if next_f[s2] < m:
                            room -= act[s2] * (m - next_f[s2])
                if room < 0.0 and m != oldest_with_ops(r):
                    continue
            if a < t:
                a = t
            found.append((a, 0, s, m))
            if a < when:
                when = a
        cached[r] = found
        if when < _INF:
            heappush(heap, (when, r, version[r]))

    def oldest_with_ops(r: int) -> int:
        m = oldest[r]
        left = ops_left[r]
        while m < num_mb and left[m] == 0:
            m += 1
        oldest[r] = m
        return m

    def send(r: int, dst: int, end: float, wire: float) -> float:
        key = (r, dst)
        ts = link_free.get(key, 0.0)
        if end > ts:
            ts = end
        te = ts + wire
        link_free[key] = te
        return te

    for r in range(num_ranks):
        push(r)
    while remaining:
        if not heap:
            raise RuntimeError("policy scheduler stalled; this is a bug (every order it builds should run)")
        when, r, ver = heappop(heap)
        if ver != version[r]:
            continue
        # a deferred W first when too many wait, or when Is that leave more than they found have
        # pushed the rank past its budget (I is never held back for memory)
        if pending_w[r] and (len(pending_w[r]) > w_cap[r] or (i_grows[r] and tape[r] > budget[r])):
            choice = (2, -1, -1)
        else:
            # one pass over the ready candidates: the backward of the oldest microbatch (later
            # stage on ties), else the forward the policy prefers, else a deferred W
            back = fwd = None
            by_age = not deep_first[r]
            for c in cached[r]:
                if c[0] > when:
                    continue
                kind = c[1]
                if kind == 1:
                    if back is None or c[3] < back[3] or (c[3] == back[3] and c[2] > back[2]):
                        back = c
                elif kind == 0:
                    if fwd is None or (by_age and (c[3], c[2]) < (fwd[3], fwd[2])):
                        fwd = c
            if back is not None:
                choice = (1, back[2], back[3])
            elif fwd is not None:
                choice = (0, fwd[2], fwd[3])
            else:
                # only a deferred W is ready: fill the gap with it, unless an op whose input is
                # already on its way would arrive before the W ends (the W would delay it)
                if w_fits_gap[r]:
                    arriving = min((c[0] for c in cached[r] if c[1] != 2 and c[0] > when), default=_INF)
                    if arriving < when + w_ms[pending_w[r][0][0]]:
                        version[r] += 1
                        heappush(heap, (arriving, r, version[r]))
                        continue
                choice = (2, -1, -1)
        kind, s, m = choice
        if kind == 0 and s == first[r]:
            warm_count[r] += 1
        else:
            warming[r] = False
        start = when
        touched = -1
        if kind == 2:
            s, m = pending_w[r].pop(0)
            out[r].append(Op(s, W, m))
            end = start + w_ms[s]
            tape[r] -= until_w[s]
        elif kind == 0:
            out[r].append(Op(s, F, m))
            end = start + f_ms[s]
            next_f[s] += 1
            if s == first[r]:
                admitted[r] += 1
                owed[r] += owed_per_admit[r]
            else:
                owed[r] -= act[s]
            tape[r] += act[s]
            dst = fwd_to[s]  # -1: the output goes nowhere (last forward, first backward)
            if dst == r:
                fwd_arrive[s][m] = end
            elif dst >= 0:
                fwd_arrive[s][m] = send(r, dst, end, fwd_wire[s])
                touched = dst
        else:
            if split[s]:
                out[r].append(Op(s, I, m))
                end = start + i_ms[s]
                pending_w[r].append((s, m))
                tape[r] += after_i[s]
            else:
                out[r].append(Op(s, B, m))
                end = start + b_ms[s]
                tape[r] -= act[s]
            next_b[s] += 1
            if s == first[r]:
                admitted[r] -= 1
            dst = bwd_to[s]  # -1: the output goes nowhere (last forward, first backward)
            if dst == r:
                bwd_arrive[s][m] = end
            elif dst >= 0:
                bwd_arrive[s][m] = send(r, dst, end, bwd_wire[s])
                touched = dst
        free[r] = end
        remaining -= 1
        ops_left[r][m] -= 1
        push(r)
        if touched >= 0:
            push(touched)
    return out
