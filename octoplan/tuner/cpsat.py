"""CP-SAT for partition and placement: where the stage boundaries fall and which rank holds
each stage, chosen together.

This is line balancing (OR-Tools' ``line_balancing_sat`` example) with a pipeline's twists:
- every layer goes to one rank; a stage is a maximal run of consecutive layers on one rank,
  so stages are contiguous by construction and any stage -> rank map is possible, with
  1..``max_per_rank`` stages per rank (neighbouring stages are never on one rank: they would
  be one stage). Rank loads are plain sums of layer costs, which keeps the relaxation tight;
- each rank's F + I + W load is balanced (the steady state of any schedule runs at the pace
  of the busiest rank), with the per-kind maxima as a tie-breaker (they set warm-up and
  cool-down), and every cut edge pays its forward + backward transfer, more when its two
  ranks sit on different nodes (``cluster.node_of`` of their global ranks);
- memory: each rank's static bytes (:func:`octoplan.memory.static_bytes`, and its layers'
  ``buffer_bytes``) plus each layer's
  activation bytes times an estimate of the microbatches in flight (1F1B's count for the
  layer's position in the model) fit the GPU.

Times are integer ticks via :func:`octoplan.costs.to_ticks`; bytes are whole megabytes. Ranks
of one node class are ordered by the first layer they hold (symmetry breaking). The greedy
answer (balanced partition, one stage per rank in order) is the hint, priced on its own first
and kept when the search does not beat it in time. The limit is CP-SAT's deterministic time
with one worker, so the answer does not depend on the machine's load. Status, objective,
bound and wall time are logged and returned.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Sequence

from ortools.sat.python import cp_model

from octoplan.costs import cheaper_backward, to_ticks, transfer_ms
from octoplan.memory import static_bytes
from octoplan.partition import balanced_partition
from octoplan.plan import Cluster
from octoplan.schedules import loop_placement
from octoplan.schedules.policy import default_policies
from octoplan.tuner.space import Candidate, Config, Evaluator, bounds_of

__all__ = ["PartitionProblem", "PartitionSolution", "solve_partition", "problem_for", "cpsat_seeds"]

log = logging.getLogger("octoplan.tuner.cpsat")

_MB = 1_000_000
SINGLE_STAGE_SHARE = 3  # the one-stage-per-rank solve's limit: the several-stage solve's over this


@dataclass(frozen=True)
class PartitionProblem:
    """Integer data of one partition + placement problem (ticks and megabytes)."""

    forward: tuple[int, ...]  # per layer, ticks
    backward_input: tuple[int, ...]
    backward_weight: tuple[int, ...]
    num_ranks: int
    num_stages: int  # the most stages (or exactly this many, with solve_partition(exact_stages=True))
    microbatches: int = 1
    static_mb: tuple[int, ...] = ()  # per layer; empty: no memory constraint
    activation_mb: tuple[int, ...] = ()
    memory_mb: int | None = None
    rank_class: tuple[int, ...] = ()  # per rank: ranks of one class share a node in every replica
    intra_ticks: tuple[int, ...] = ()  # per boundary position 1..L-1 (index b-1): one-way transfer
    inter_ticks: tuple[int, ...] = ()
    max_per_rank: int = 3

    @property
    def num_layers(self) -> int:
        return len(self.forward)


@dataclass(frozen=True)
class PartitionSolution:
    bounds: tuple[int, ...]
    ranks: tuple[int, ...]
    status: str
    objective: float
    bound: float
    wall_s: float
    max_load: int  # ticks: the busiest rank's F + I + W
    limit_s: float = 0.0  # the deterministic-time limit it was solved under

    def stats(self) -> dict:
        return {"stages": len(self.ranks), "status": self.status, "objective": self.objective,
                "bound": self.bound, "limit_s": round(self.limit_s, 3), "wall_s": round(self.wall_s, 3),
                "max_load_ticks": self.max_load}


# The wall-clock safety net of a solve, in multiples of its deterministic limit. A tune that
# asks for the same plan at any load (--max-plans) gets the wider one: a loaded machine takes
# several wall seconds per deterministic second, and a net that cut a solve short would change
# its seeds.
WALL_FACTOR = 4.0
DETERMINISTIC_WALL_FACTOR = 40.0

def inflight_estimate(position: float, num_ranks: int, microbatches: int) -> int:
    """Microbatches a layer holds at once under 1F1B-like warm-up: the ranks still ahead of
    it, for a layer ``position`` (0..1) of the way through the model."""
    ahead = math.ceil((1.0 - position) * num_ranks)
    return max(1, min(microbatches, ahead))


def solve_partition(
    problem: PartitionProblem,
    *,
    hint: tuple[Sequence[int], Sequence[int]] | None = None,
    time_limit_s: float = 5.0,
    seed: int = 0,
    exact_stages: bool = False,
    wall_factor: float = WALL_FACTOR,
) -> PartitionSolution | None:
    """The CP-SAT optimum (or best found in the time limit); None when infeasible.

    The model assigns every *layer* to a rank (``a[l, r]``); a stage is a maximal run of
    layers on one rank, so contiguity is free and neighbouring stages are on different ranks
    by construction. Rank loads are then plain sums of layer costs, which keeps the LP
    relaxation tight. ``problem.num_stages`` caps the stage count (fixes it with
    ``exact_stages``); ``max_per_rank`` caps each rank's runs.
    """
    L, P = problem.num_layers, problem.num_ranks
    max_stages = min(problem.num_stages, L, P * problem.max_per_rank)
    if max_stages < P or (exact_stages and problem.num_stages > max_stages):
        return None
    total = [f + i + w for f, i, w in zip(problem.forward, problem.backward_input, problem.backward_weight)]
    model = cp_model.CpModel()
    a = {(l, r): model.new_bool_var(f"a{l}_{r}") for l in range(L) for r in range(P)}
    for l in range(L):
        model.add_exactly_one(a[l, r] for r in range(P))
    # start[l, r]: a stage of rank r begins at layer l (a run of the rank's layers starts)
    start = {}
    for r in range(P):
        start[0, r] = a[0, r]
        for l in range(1, L):
            st = model.new_bool_var(f"s{l}_{r}")
            model.add_implication(st, a[l, r])
            model.add_implication(st, a[l - 1, r].Not())
            model.add_bool_or([a[l, r].Not(), a[l - 1, r], st])  # a[l] and not a[l-1] -> start
            start[l, r] = st
        runs = sum(start[l, r] for l in range(L))
        model.add(runs >= 1)  # every rank holds a stage
        model.add(runs <= problem.max_per_rank)
    num_stages = sum(start[l, r] for l in range(L) for r in range(P))
    if exact_stages:
        model.add(num_stages == problem.num_stages)
    else:
        model.add(num_stages <= max_stages)
    # Ranks of one node class are interchangeable; break that symmetry by ordering them by
    # the first layer they hold (seen[l, r]: rank r holds one of layers 0..l).
    rank_class = problem.rank_class or (0,) * P
    seen = {}
    for r in range(P):
        for l in range(L):
            v = model.new_bool_var(f"seen{l}_{r}")
            model.add_implication(a[l, r], v)
            if l == 0:
                model.add(v <= a[l, r])
            else:
                model.add_implication(seen[l - 1, r], v)
                model.add(v <= seen[l - 1, r] + a[l, r])
            seen[l, r] = v
    for r in range(P):
        later = next((q for q in range(r + 1, P) if rank_class[q] == rank_class[r]), None)
        if later is not None:
            for l in range(L):
                model.add_implication(seen[l, later], seen[l, r])

    # balance: the busiest rank's F + I + W sets the pace of any schedule's steady state; the
    # per-kind maxima break ties (they shape warm-up and cool-down)
    z = model.new_int_var(0, sum(total), "max_load")
    kinds = (problem.forward, problem.backward_input, problem.backward_weight)
    kind_max = [model.new_int_var(0, max(1, sum(k)), f"max_kind{i}") for i, k in enumerate(kinds)]
    for r in range(P):
        model.add(z >= sum(total[l] * a[l, r] for l in range(L)))
        for zk, costs in zip(kind_max, kinds):
            model.add(zk >= sum(costs[l] * a[l, r] for l in range(L)))

    # transfers: a stage boundary at layer l sends layer l-1's output forward and its gradient
    # back; it is inter-node when the two ranks' node classes differ. A link carries one
    # transfer per microbatch each way, so one transfer also bounds the pace (z >= it).
    xfer_terms = []
    crossings = {}
    if problem.intra_ticks:
        classes = sorted(set(problem.rank_class))
        for l in range(1, L):
            cut = sum(start[l, r] for r in range(P))  # 0 or 1: a stage starts here
            intra, inter = problem.intra_ticks[l - 1], problem.inter_ticks[l - 1]
            term = intra * cut
            model.add(z >= intra * cut)
            if len(classes) > 1 and inter > intra:
                crossing = model.new_bool_var(f"cross{l}")
                crossings[l] = crossing
                for c in classes:
                    members = [r for r in range(P) if problem.rank_class[r] == c]
                    model.add(crossing >= sum(a[l - 1, r] for r in members) - sum(a[l, r] for r in members))
                term = term + (inter - intra) * crossing
                model.add(z >= term)
            xfer_terms.append(term)

    # memory: static bytes + activations x in-flight estimate for the layer's position
    if problem.memory_mb is not None and problem.static_mb:
        for r in range(P):
            model.add(sum((problem.static_mb[l] + inflight_estimate(l / L, P, problem.microbatches)
                           * problem.activation_mb[l]) * a[l, r] for l in range(L)) <= problem.memory_mb)

    model.minimize(problem.microbatches * z + 2 * sum(xfer_terms) + sum(kind_max))

    if hint is not None:
        # a complete hint (every auxiliary variable too) so CP-SAT starts from a full solution
        hint_bounds, hint_ranks = hint
        owner = [0] * L
        for j, r_hint in enumerate(hint_ranks):
            for l in range(hint_bounds[j], hint_bounds[j + 1]):
                owner[l] = r_hint
        for r in range(P):
            held = False
            for l in range(L):
                model.add_hint(a[l, r], owner[l] == r)
                if l > 0:  # start[0, r] is a[0, r] itself
                    model.add_hint(start[l, r], owner[l] == r and owner[l - 1] != r)
                held = held or owner[l] == r
                model.add_hint(seen[l, r], held)
        for l, crossing in crossings.items():
            model.add_hint(crossing, rank_class[owner[l - 1]] != rank_class[owner[l]])
        # the objective's own variables as well: without them the hint is incomplete, and
        # CP-SAT may spend its whole limit trying to complete it
        load = [sum(total[l] for l in range(L) if owner[l] == r) for r in range(P)]
        worst = max(load)
        if problem.intra_ticks:  # z also covers each cut's transfer, as the model states it
            for l in range(1, L):
                if owner[l] != owner[l - 1]:
                    xfer = problem.intra_ticks[l - 1]
                    if l in crossings and rank_class[owner[l - 1]] != rank_class[owner[l]]:
                        xfer = problem.inter_ticks[l - 1]
                    worst = max(worst, xfer)
        model.add_hint(z, worst)
        for zk, costs in zip(kind_max, kinds):
            model.add_hint(zk, max(sum(costs[l] for l in range(L) if owner[l] == r) for r in range(P)))

    def solve(fix_hint: bool) -> tuple[cp_model.CpSolver, int, float]:
        solver = cp_model.CpSolver()
        # one worker and a limit in deterministic time (work, not seconds): the same answer on
        # a busy machine as on an idle one; the wall-clock limit is only a safety net
        solver.parameters.num_workers = 1
        solver.parameters.max_deterministic_time = time_limit_s
        solver.parameters.max_time_in_seconds = wall_factor * time_limit_s
        solver.parameters.random_seed = seed
        solver.parameters.fix_variables_to_their_hinted_value = fix_hint
        solver.parameters.catch_sigint_signal = False  # Ctrl-C ends the command, not just this solve
        began = time.perf_counter()
        status = solver.solve(model)
        return solver, status, time.perf_counter() - began

    def read(solver: cp_model.CpSolver) -> tuple[tuple[int, ...], tuple[int, ...]]:
        owner = [next(r for r in range(P) if solver.value(a[l, r])) for l in range(L)]
        bounds, ranks = [0], [owner[0]]
        for l in range(1, L):
            if owner[l] != owner[l - 1]:
                bounds.append(l)
                ranks.append(owner[l])
        bounds.append(L)
        return tuple(bounds), tuple(ranks)

    ok = (cp_model.OPTIMAL, cp_model.FEASIBLE)
    greedy = None
    if hint is not None:
        # the hint alone, priced by the model: CP-SAT with one worker does not always find its
        # way back to a hint within a short limit, and the greedy answer is a floor
        solver, status, _ = solve(fix_hint=True)
        if status in ok:
            greedy = (solver.objective_value, read(solver), int(solver.value(z)))
    solver, status, wall = solve(fix_hint=False)
    name = solver.status_name(status)
    found = status in ok
    log.info("cp-sat %d layers on %d ranks (<= %d stages): %s, objective %s, bound %s, %.2f s (hint objective %s)",
             L, P, max_stages, name, solver.objective_value if found else None, solver.best_objective_bound, wall,
             greedy[0] if greedy else None)
    if found and (greedy is None or solver.objective_value <= greedy[0]):
        bounds, ranks = read(solver)
        return PartitionSolution(bounds, ranks, name, float(solver.objective_value),
                                 float(solver.best_objective_bound), wall, int(solver.value(z)), time_limit_s)
    if greedy is not None:
        objective, (bounds, ranks), max_load = greedy
        return PartitionSolution(bounds, ranks, f"{name} (hint kept)", float(objective),
                                 float(solver.best_objective_bound), wall, max_load, time_limit_s)
    return None


def _rank_classes(cluster: Cluster, config: Config) -> tuple[int, ...]:
    """Ranks share a class when their global ranks share a node in every dp replica."""
    parallel = config.parallel()
    keys = [tuple(cluster.node_of(parallel.global_rank(r, d)) for d in range(config.dp)) for r in range(config.pp)]
    index: dict[tuple, int] = {}
    return tuple(index.setdefault(k, len(index)) for k in keys)


def problem_for(evaluator: Evaluator, config: Config, num_stages: int, *, max_per_rank: int = 3,
                recompute: bool = False) -> PartitionProblem:
    """The partition and placement problem of ``config``. With ``recompute``, every stage
    recomputes: each backward does its layer's forward again, and a layer's in-flight memory
    is its input, not its activations (every layer's input, where only a stage's first is
    kept: an overestimate), plus its activations once over ``max_per_rank`` for the rebuild
    (counted with the static bytes: a rank rebuilds one stage at a time, estimated as an even
    share of the rank's layers)."""
    profile, cluster = evaluator.profile, evaluator.cluster
    layers = profile.layers
    classes = _rank_classes(cluster, config)
    parallel = config.parallel()
    intra, inter = [], []
    # a representative pair of ranks per kind of link: same class, different class
    same = next(((a, b) for a in range(config.pp) for b in range(config.pp) if a != b and classes[a] == classes[b]), None)
    diff = next(((a, b) for a in range(config.pp) for b in range(config.pp) if classes[a] != classes[b]), None)
    for layer in layers[:-1]:
        intra.append(to_ticks(transfer_ms(cluster, parallel, *same, layer.output_bytes)) if same else 0)
        inter.append(to_ticks(transfer_ms(cluster, parallel, *diff, layer.output_bytes)) if diff else intra[-1])
    dtype = profile.param_dtype_bytes  # a tied tensor counts once per member here: a bound on the safe side
    backwards = [cheaper_backward(layer) for layer in layers]
    return PartitionProblem(
        forward=tuple(to_ticks(l.forward_ms) for l in layers),
        backward_input=tuple(to_ticks(i + (l.forward_ms if recompute else 0.0)) for l, (i, _) in zip(layers, backwards)),
        backward_weight=tuple(to_ticks(w) for _, w in backwards),
        num_ranks=config.pp,
        num_stages=num_stages,
        microbatches=config.microbatches,
        static_mb=tuple(math.ceil((static_bytes(l.param_bytes, dtype_bytes=dtype) + l.buffer_bytes
                                   + (l.activation_bytes / max_per_rank if recompute else 0))
                                  / _MB) for l in layers),
        activation_mb=tuple(math.ceil((kept if recompute else l.activation_bytes) / _MB)
                            for l, kept in zip(layers, [0] + [l.output_bytes for l in layers[:-1]])),
        memory_mb=int(cluster.memory_bytes / _MB),
        rank_class=classes,
        intra_ticks=tuple(intra),
        inter_ticks=tuple(inter),
        max_per_rank=max_per_rank,
    )


def cpsat_seeds(evaluator: Evaluator, config: Config, *, chunks_max: int, time_limit_s: float,
                seed: int = 0, recompute: bool = False, wall_factor: float = WALL_FACTOR
                ) -> tuple[list[Candidate], list[dict]]:
    """Candidates from CP-SAT with at most 1 and at most ``chunks_max`` stages per rank, each
    with policy-scheduler knobs (I/W split at two warm-up depths, and plain B). With
    ``recompute``, a stage count whose problem has no solution within memory is solved again
    with every stage recomputing, and its seeds recompute. ``time_limit_s`` is CP-SAT's
    deterministic limit for the several-stage problem; the one-stage problem gets
    1/:data:`SINGLE_STAGE_SHARE` of it."""
    profile = evaluator.profile
    seeds, stats, solutions = [], [], []
    caps = sorted({1, max(1, chunks_max)}) if config.pp > 1 else [1]
    for cap in caps:
        num_stages = min(cap * config.pp, profile.num_layers)
        # one stage per rank is the smaller problem, and its hint (the balanced partition) is
        # at or near its optimum: on the suite's 9 workloads 5 s improved on the hint by 0.03%
        # at most, where the several-stage problem still improved from 3 s to 5 s (gemma3-27b:
        # 2723943 -> 2718287 ticks, and its tuned plan 1.9% faster; docs/BENCHMARKS.md)
        limit = time_limit_s / SINGLE_STAGE_SHARE if cap == 1 and len(caps) > 1 else time_limit_s
        hint_stages = config.pp
        hint = (bounds_of(balanced_partition(profile, hint_stages)), loop_placement(config.pp, hint_stages))
        for recomputing in (False, True) if recompute else (False,):
            problem = problem_for(evaluator, config, num_stages, max_per_rank=cap, recompute=recomputing)
            solution = solve_partition(problem, hint=hint, time_limit_s=limit, seed=seed, wall_factor=wall_factor)
            if solution is not None:
                break
        if solution is None:
            stats.append({"config": config.label(), "max_per_rank": cap, "status": "no solution"})
            continue
        stats.append({"config": config.label(), "max_per_rank": cap, "recompute": recomputing, **solution.stats()})
        if any(solution.ranks == s.ranks and solution.bounds == s.bounds for s in solutions):
            continue
        solutions.append(solution)
        for split, depth, gap in ((True, 1.0, False), (True, 2.0, False), (True, 2.0, True), (False, 1.0, False)):
            policies = default_policies(solution.ranks, config.pp, config.microbatches, split=split, depth=depth,
                                        warmup_gap=gap)
            seeds.append(Candidate(config, solution.bounds, solution.ranks, policies, None,
                                   f"cp-sat <= {cap}/rank, split={split}, depth={depth:g}, warm-up gap={gap}"
                                   + (", every rank recomputes" if recomputing else ""),
                                   recompute=frozenset(range(len(solution.ranks))) if recomputing else frozenset()))
    return seeds, stats
