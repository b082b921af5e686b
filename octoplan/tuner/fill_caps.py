"""How fast any layout of one placement can run at best, counting the pipeline's fill: a cap on
the iteration time of every layout whose stages sit on the ranks as given (a loop, a V or
any other), whatever its cut points, the order of its ranks and its op order.

The balance cap (:mod:`octoplan.tuner.caps`) leaves out that a rank cannot work before work
reaches it. Here each rank is held to four facts, each true of every order:

- it cannot start its first stage before the first microbatch's forward has passed every
  layer before that stage (with the smallest transfer between ranks on every hop), and from
  then on it still has all its work to run, M microbatches of F plus the cheaper backward;
- before the first microbatch reaches one of its later stages, it can run only the forwards of
  its earlier stages: the rest of its work comes after that arrival;
- microbatches reach each of its stages no faster than the slowest forward before that
  stage passes them on: microbatch J arrives J such forwards after the first at the earliest,
  so a rank behind a thick stage idles while it waits for its next stage;
- before the first backward reaches its last stage, it can run only forwards.

And every stage runs its M forwards one after another, as the last microbatch's whole forward
and backward must still follow its forward there; its M backwards on the way down likewise.
CP-SAT picks the cut points that minimise the largest of these times. A V pays for its first
rank: that rank holds the first and the last stage, and between the first forward and the first
microbatch's return it can run only the forwards of its first stage; a loop's ranks wait half a
pipeline for their second stage instead. ``benchmarks/bench_tuner.py caps --fill`` gives the
suite's caps (docs/BENCHMARKS.md, "The fill caps each placement").

Only which stages share a rank matters, not which pp rank holds them, and every hop between
ranks is priced as the smallest transfer the cluster has: the cap holds for every order of the
ranks. Layer times are floored to integer ticks (:func:`octoplan.costs.to_ticks`'s
microseconds), so the cap stays a bound.
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple, Sequence

from octoplan.costs import TICKS_PER_MS
from octoplan.plan import Cluster
from octoplan.profile import Profile

__all__ = ["FillCap", "SHAPES", "fill_cap", "shape_label", "shape_of", "shape_ranks"]

SHAPES = ("loop", "zigzag")


class FillCap(NamedTuple):
    found_ms: float  # the cap of the best cut points found
    proven_ms: float  # no layout of the placement runs faster (found_ms where CP-SAT proved it optimal)
    bounds: tuple[int, ...]  # the best cut points found: stage s holds layers bounds[s] .. bounds[s + 1] - 1

    @property
    def is_proven(self) -> bool:
        return round(self.found_ms * TICKS_PER_MS) <= round(self.proven_ms * TICKS_PER_MS)


def shape_ranks(shape: str, pp: int, stages_per_rank: int) -> tuple[int, ...]:
    """The rank of every stage of ``shape`` (one of :data:`SHAPES`): a loop gives rank r stages
    r, pp + r, 2 pp + r, ...; a zigzag runs down the ranks and back up (stages r and
    2 pp - 1 - r: a V)."""
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {SHAPES}, not {shape!r}")
    ranks = []
    for stage in range(stages_per_rank * pp):
        chunk, i = divmod(stage, pp)
        ranks.append(i if shape == "loop" or chunk % 2 == 0 else pp - 1 - i)
    return tuple(ranks)


def shape_of(ranks: Sequence[int], pp: int) -> tuple[str, int] | None:
    """The shape of a layout whose stage s is on rank ``ranks[s]``, up to the order of the ranks:
    (shape, stages per rank), or None where it is neither a loop nor a zigzag. One stage per
    rank is a loop of 1."""
    if pp < 1 or not ranks or len(ranks) % pp or len(set(ranks[:pp])) != pp:
        return None
    position = {rank: i for i, rank in enumerate(ranks[:pp])}  # the rank's place in the shape
    for shape in SHAPES:
        if [position.get(rank) for rank in ranks] == list(shape_ranks(shape, pp, len(ranks) // pp)):
            return shape, len(ranks) // pp
    return None


def shape_label(shape: str, stages_per_rank: int) -> str:
    if stages_per_rank == 1:
        return "one stage per rank"
    if (shape, stages_per_rank) == ("zigzag", 2):
        return "a V of 2 stages per rank"
    return f"a {shape} of {stages_per_rank} stages per rank"


def _ticks_down(ms: float) -> int:
    return max(0, math.floor(ms * TICKS_PER_MS + 1e-6))


class _Tables(NamedTuple):
    """A profile's prefix sums in floored ticks: the forwards, the cheaper backwards (I + W or
    B: what a rank must run besides the forward) and the least backward on the way down (I,
    or B where cheaper); the per-op overhead and the smallest hop between ranks."""

    fwd: list[int]
    back: list[int]
    down: list[int]
    overhead: int
    hop: int


def _tables(profile: Profile, cluster: Cluster) -> _Tables:
    def prefix(values) -> list[int]:
        out = [0]
        for v in values:
            out.append(out[-1] + v)
        return out

    layers = profile.layers
    # the smallest transfer between two ranks: the fastest link and the smallest output any
    # stage but the last can hand on
    fastest = max(cluster.intra_node_gbps, cluster.inter_node_gbps) if cluster.gpus_per_node > 1 else cluster.inter_node_gbps
    smallest = min(l.output_bytes for l in layers[:-1]) if len(layers) > 1 else 0
    return _Tables(
        fwd=prefix(_ticks_down(l.forward_ms) for l in layers),
        back=prefix(_ticks_down(min(l.backward_input_ms + l.backward_weight_ms, l.b_ms)) for l in layers),
        down=prefix(_ticks_down(min(l.backward_input_ms, l.b_ms)) for l in layers),
        overhead=_ticks_down(cluster.op_overhead_us / 1000.0),
        hop=_ticks_down(cluster.latency_us / 1000.0 + smallest / (fastest * 1e9) * 1000.0),
    )


def _stage_forwards(f_at: Sequence, t: _Tables) -> list:
    """Each stage's forward op, its overhead included, from the forwards' table at the cut points."""
    return [f_at[s + 1] - f_at[s] + t.overhead for s in range(len(f_at) - 1)]


def _arrival_steps(m: int) -> range:
    """The microbatches J whose arrival the rate facts price: every one for up to 31
    microbatches, about 16 spread evenly beyond (each J gives a valid fact; more would tighten
    the cap a little, at CP-SAT's time)."""
    return range(1, m, max(1, m // 16))


def _fill_terms(f_at: Sequence, b_at: Sequence, d_at: Sequence, ranks: Sequence[int], m: int, t: _Tables,
                rate: Sequence | None = None) -> list[tuple]:
    """The times no order of the layout can end before, one per fact of the module's docstring,
    from the tables' values at each cut point (``f_at[s]``: the forwards of the layers before
    stage s): integers price one layout; :func:`fill_cap` passes CP-SAT's variables, and its
    model minimises the largest. Each term is a tuple of alternatives, and the layout cannot end
    before the least of them. ``rate[s]``: the slowest forward op of stages 0..s (computed here
    for integers; CP-SAT's model passes its own variables)."""
    num_stages = len(ranks)
    hops_before = [0]  # hops on the way to stage s
    for s in range(num_stages - 1):
        hops_before.append(hops_before[-1] + int(ranks[s] != ranks[s + 1]))
    stage_f = _stage_forwards(f_at, t)
    if rate is None:
        rate = list(itertools.accumulate(stage_f, max))
    stage_b = [b_at[s + 1] - b_at[s] + t.overhead for s in range(num_stages)]
    stage_d = [d_at[s + 1] - d_at[s] + t.overhead for s in range(num_stages)]
    # the first microbatch's forward reaches stage s
    reach = [f_at[s] + s * t.overhead + hops_before[s] * t.hop for s in range(num_stages)]
    forward_done = reach[-1] + stage_f[-1]
    total_hops = hops_before[-1]
    whole_backward = sum(stage_d, 0) + total_hops * t.hop
    terms: list[tuple] = []
    for r in sorted(set(ranks)):
        mine = [s for s in range(num_stages) if ranks[s] == r]
        for k, s in enumerate(mine):
            # before the first microbatch reaches s, only the earlier stages' forwards can run
            rest = m * (sum(stage_b[j] for j in mine[:k]) + sum(stage_f[j] + stage_b[j] for j in mine[k:]))
            terms.append((reach[s] + rest,))
            if k == 0:
                continue
            # and microbatches reach the stage before it no faster than the slowest forward
            # ahead of it passes them on: microbatch J and every later one not before
            # J x that forward after the first. So the rank's forwards of microbatches J and
            # later there, and everything counted above, wait for the earlier of that time and
            # the first microbatch's arrival at s
            before = mine[k - 1]
            for j in _arrival_steps(m):
                after = (m - j) * stage_f[before] + rest
                terms.append((reach[before] + j * rate[before] + after, reach[s] + after))
        # before the first backward reaches the rank, only forwards can run
        last = mine[-1]
        back_reaches = forward_done + sum(stage_d[last + 1:], 0) + (total_hops - hops_before[last]) * t.hop
        terms.append((back_reaches + m * sum(stage_b[j] for j in mine),))
    for s in range(num_stages):
        # stage s runs its M forwards one after another, so the last of them ends M - 1 forwards
        # later than the first could; that microbatch's forward through the later stages and its
        # whole backward still follow. Its M backwards on the way down likewise
        terms.append((forward_done + (m - 1) * stage_f[s] + whole_backward,))
        terms.append((forward_done + (m - 1) * stage_d[s] + whole_backward,))
    return terms


def _figure(terms: list[tuple]) -> list:
    """Each term's value for one layout (integers): the least of its alternatives."""
    return [min(alternatives) for alternatives in terms]


def fill_cap(profile: Profile, cluster: Cluster, *, microbatches: int, ranks: Sequence[int],
             time_limit_s: float = 10.0, hint: Sequence[int] | None = None,
             wall_limit_s: float | None = None) -> FillCap | None:
    """The least iteration time of any layout whose stage s is on rank ``ranks[s]`` (any cut
    points; the cap holds for every order of the ranks too), within ``time_limit_s`` of
    CP-SAT's deterministic time on one worker (the same answer on any machine); None where the
    profile has fewer layers than stages. :func:`shape_ranks` gives a loop's or a zigzag's.
    CP-SAT starts from the cut points ``hint`` (a plan's own; by default layers spread evenly
    over the stages); None also where its time ends before its first answer (its presolve alone
    takes about a deterministic second on a pipeline of 32 stages). ``wall_limit_s``: a
    wall-clock cap as well, for callers on the clock (the answer then depends on the machine)."""
    from ortools.sat.python import cp_model

    num_layers, num_stages, m = profile.num_layers, len(ranks), microbatches
    if not 0 < num_stages <= num_layers:
        return None
    start = list(hint) if hint is not None else _even_cuts(num_layers, num_stages)
    if len(start) != num_stages + 1 or start[0] != 0 or start[-1] != num_layers or any(
            a >= b for a, b in zip(start, start[1:])):
        raise ValueError(f"hint must be {num_stages + 1} rising cut points from 0 to {num_layers}, not {start}")
    t = _tables(profile, cluster)
    model = cp_model.CpModel()
    cut = [model.new_int_var(0, num_layers, f"cut{s}") for s in range(num_stages + 1)]
    model.add(cut[0] == 0)
    model.add(cut[-1] == num_layers)
    for s in range(num_stages):
        model.add(cut[s + 1] >= cut[s] + 1)

    def at(table: list[int], name: str) -> list:
        out = [model.new_int_var(0, table[-1], f"{name}{s}") for s in range(num_stages + 1)]
        for var, c in zip(out, cut):
            model.add_element(c, table, var)
        return out

    f_at, b_at, d_at = at(t.fwd, "f"), at(t.back, "b"), at(t.down, "d")
    stage_f = _stage_forwards(f_at, t)
    rate = [model.new_int_var(0, t.fwd[-1] + t.overhead, f"rate{s}") for s in range(num_stages)]
    for s in range(num_stages):
        model.add_max_equality(rate[s], [stage_f[s]] if s == 0 else [rate[s - 1], stage_f[s]])
    top_max = (m * (t.fwd[-1] + t.back[-1] + 3 * t.overhead * num_stages) + t.fwd[-1] + t.down[-1]
               + 2 * num_stages * (t.overhead + t.hop))
    top = model.new_int_var(0, top_max, "top")
    # the hinted layout's tables at its cut points, and its own terms, to hint which
    # alternative of each bounds it
    hinted_at = [[table[c] for c in start] for table in (t.fwd, t.back, t.down)]
    hinted_terms = _fill_terms(*hinted_at, ranks, m, t)
    earlier = []
    for alternatives, hinted in zip(_fill_terms(f_at, b_at, d_at, ranks, m, t, rate), hinted_terms):
        if len(alternatives) == 1:
            model.add(top >= alternatives[0])
            continue
        first = model.new_bool_var(f"earlier{len(earlier)}")  # the first alternative bounds it
        model.add(top >= alternatives[0]).only_enforce_if(first)
        model.add(top >= alternatives[1]).only_enforce_if(~first)
        earlier.append((first, hinted[0] <= hinted[1]))
    model.minimize(top)
    # a complete hint (every variable, the objective's too): once presolved, CP-SAT starts from
    # an answer, where an incomplete hint can cost it its whole time limit to complete
    for s, c in enumerate(start):
        model.add_hint(cut[s], c)
        for var, values in zip((f_at[s], b_at[s], d_at[s]), hinted_at):
            model.add_hint(var, values[s])
    for var, value in zip(rate, itertools.accumulate(_stage_forwards(hinted_at[0], t), max)):
        model.add_hint(var, value)
    for var, value in earlier:
        model.add_hint(var, value)
    # the objective at the hinted layout's own figure: hinted at its upper bound instead, the
    # hint is an answer CP-SAT must first improve on by itself, and in a few seconds it often
    # does not (llama3-8b's V at 2 s ended at that bound, 4.2 times the hinted layout's figure)
    model.add_hint(top, max(_figure(hinted_terms)))

    solver = cp_model.CpSolver()
    solver.parameters.max_deterministic_time = max(0.01, time_limit_s)
    solver.parameters.num_workers = 1
    if wall_limit_s is not None:
        solver.parameters.max_time_in_seconds = max(0.01, wall_limit_s)
    solver.parameters.catch_sigint_signal = False  # Ctrl-C ends the command, not just this solve
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    found = solver.objective_value / TICKS_PER_MS
    # the objective is in whole ticks, so a fractional bound rounds up
    proven = found if status == cp_model.OPTIMAL else math.ceil(solver.best_objective_bound - 1e-6) / TICKS_PER_MS
    return FillCap(found, proven, tuple(solver.value(c) for c in cut))


def _even_cuts(num_layers: int, num_stages: int) -> list[int]:
    return [s * num_layers // num_stages for s in range(num_stages + 1)]
