"""CP-SAT for partition and placement: where the stage boundaries fall and which rank holds
each stage, chosen together.

This is line balancing (OR-Tools' ``line_balancing_sat`` example) with a pipeline's twists:
- the layers are cut into ``num_stages`` contiguous stages; boundary ``b[j]`` is a variable
  over layer indices, and a stage's F, I, W, weight and activation sizes are differences of
  prefix sums read with element constraints, so the model stays small for any layer count;
- any stage -> rank map, 1..``max_per_rank`` stages per rank, never two neighbouring stages on
  one rank (they would be one stage);
- each rank's F + I + W load is balanced (the steady state of any schedule runs at the pace
  of the busiest rank), with the per-kind maxima as a tie-breaker (they set warm-up and
  cool-down), and every cut edge pays its forward + backward transfer, more when its two
  ranks sit on different nodes (``cluster.node_of`` of their global ranks);
- memory: each rank's static bytes (:func:`octoplan.memory.static_bytes`) plus each stage's
  activation bytes times an estimate of the microbatches in flight (1F1B's count for the
  stage's position) fit the GPU.

Times are integer ticks via :func:`octoplan.costs.to_ticks`; bytes are whole megabytes. The
greedy answer (balanced partition, loop placement) is the hint; status, objective, bound and
wall time are logged and returned.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from itertools import accumulate
from typing import Sequence

from ortools.sat.python import cp_model

from octoplan.costs import to_ticks, transfer_ms
from octoplan.memory import static_bytes
from octoplan.partition import balanced_partition
from octoplan.plan import Cluster
from octoplan.schedules import loop_placement
from octoplan.schedules.policy import default_policies
from octoplan.tuner.space import Candidate, Config, Evaluator, bounds_of

__all__ = ["PartitionProblem", "PartitionSolution", "solve_partition", "problem_for", "cpsat_seeds"]

log = logging.getLogger("octoplan.tuner.cpsat")

_MB = 1_000_000


@dataclass(frozen=True)
class PartitionProblem:
    """Integer data of one partition + placement problem (ticks and megabytes)."""

    forward: tuple[int, ...]  # per layer, ticks
    backward_input: tuple[int, ...]
    backward_weight: tuple[int, ...]
    num_ranks: int
    num_stages: int
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

    def stats(self) -> dict:
        return {"stages": len(self.ranks), "status": self.status, "objective": self.objective,
                "bound": self.bound, "wall_s": round(self.wall_s, 3), "max_load_ticks": self.max_load}


def inflight_estimate(stage: int, num_stages: int, num_ranks: int, microbatches: int) -> int:
    """Microbatches a stage holds at once under 1F1B-like warm-up: the ranks still ahead."""
    ahead = math.ceil((num_stages - stage) * num_ranks / num_stages)
    return max(1, min(microbatches, ahead))


def solve_partition(
    problem: PartitionProblem,
    *,
    hint: tuple[Sequence[int], Sequence[int]] | None = None,
    time_limit_s: float = 5.0,
    seed: int = 0,
) -> PartitionSolution | None:
    """The CP-SAT optimum (or best found in the time limit); None when infeasible."""
    L, S, P = problem.num_layers, problem.num_stages, problem.num_ranks
    if S > L or S < P or S > P * problem.max_per_rank or (P == 1 and S > 1):
        return None
    total = [f + i + w for f, i, w in zip(problem.forward, problem.backward_input, problem.backward_weight)]
    pre_t = [0, *accumulate(total)]
    pre_f = [0, *accumulate(problem.forward)]
    pre_i = [0, *accumulate(problem.backward_input)]
    pre_w = [0, *accumulate(problem.backward_weight)]
    horizon = pre_t[-1]
    model = cp_model.CpModel()

    # boundaries: b[0] = 0 < b[1] < ... < b[S] = L, so every stage is non-empty and contiguous
    b = [model.new_constant(0)] + [model.new_int_var(j, L - S + j, f"b{j}") for j in range(1, S)] + [model.new_constant(L)]
    for j in range(S):
        model.add(b[j + 1] >= b[j] + 1)

    def prefix_at(values: list[int], name: str) -> list:
        """values[b[j]] for every boundary, by element constraints."""
        out = []
        for j in range(S + 1):
            var = model.new_int_var(min(values), max(values), f"{name}{j}")
            model.add_element(b[j], values, var)
            out.append(var)
        return out

    at_t, at_f, at_i, at_w = prefix_at(pre_t, "pt"), prefix_at(pre_f, "pf"), prefix_at(pre_i, "pi"), prefix_at(pre_w, "pw")
    stage_t = [at_t[j + 1] - at_t[j] for j in range(S)]
    stage_kind = {"F": [at_f[j + 1] - at_f[j] for j in range(S)], "I": [at_i[j + 1] - at_i[j] for j in range(S)],
                  "W": [at_w[j + 1] - at_w[j] for j in range(S)]}

    # placement: every stage on one rank; every rank 1..max_per_rank stages; neighbours apart
    x = {(j, r): model.new_bool_var(f"x{j}_{r}") for j in range(S) for r in range(P)}
    for j in range(S):
        model.add_exactly_one(x[j, r] for r in range(P))
    for r in range(P):
        model.add(sum(x[j, r] for j in range(S)) >= 1)
        model.add(sum(x[j, r] for j in range(S)) <= problem.max_per_rank)
        if P > 1:
            for j in range(S - 1):
                model.add_bool_or([x[j, r].Not(), x[j + 1, r].Not()])
    # rank 0 holds stage 0: the first stage's rank is a free relabelling otherwise only when
    # all ranks are alike, so this is the one symmetry broken
    if not problem.rank_class or len(set(problem.rank_class)) == 1:
        model.add(x[0, 0] == 1)

    def rank_load(per_stage: list, name: str, upper: int) -> list:
        """Per rank, the sum of ``per_stage`` over its stages (lower bounds: the objective
        presses on the maximum)."""
        loads = []
        for r in range(P):
            parts = []
            for j in range(S):
                y = model.new_int_var(0, upper, f"{name}{j}_{r}")
                model.add(y >= per_stage[j] - upper * (1 - x[j, r]))
                parts.append(y)
            loads.append(sum(parts))
        return loads

    z = model.new_int_var(0, horizon, "max_load")
    for load in rank_load(stage_t, "y", horizon):
        model.add(z >= load)
    kind_max = []
    for kind, per_stage in stage_kind.items():
        upper = max(1, pre_f[-1] if kind == "F" else pre_i[-1] if kind == "I" else pre_w[-1])
        zk = model.new_int_var(0, upper, f"max_{kind}")
        for load in rank_load(per_stage, f"y{kind}", upper):
            model.add(zk >= load)
        kind_max.append(zk)

    # transfers: every edge is cut (neighbours are never on one rank); an edge between node
    # classes pays the inter-node time. A link carries one transfer per microbatch each way,
    # so it also bounds the pace (z >= one-way time).
    xfer_terms = []
    if problem.intra_ticks and S > 1:
        classes = sorted(set(problem.rank_class))
        big = max(problem.inter_ticks) + 1
        for j in range(1, S):
            intra = model.new_int_var(0, max(problem.intra_ticks), f"ci{j}")
            inter = model.new_int_var(0, max(problem.inter_ticks), f"ce{j}")
            model.add_element(b[j] - 1, list(problem.intra_ticks), intra)
            model.add_element(b[j] - 1, list(problem.inter_ticks), inter)
            xfer = model.new_int_var(0, big, f"xfer{j}")
            model.add(xfer >= intra)
            if len(classes) > 1:
                crossing = model.new_bool_var(f"cross{j}")
                for c in classes:
                    members = [r for r in range(P) if problem.rank_class[r] == c]
                    model.add(crossing >= sum(x[j - 1, r] for r in members) - sum(x[j, r] for r in members))
                model.add(xfer >= inter - big * (1 - crossing))
            model.add(z >= xfer)
            xfer_terms.append(xfer)

    # memory: static bytes + activations x in-flight estimate, per rank
    if problem.memory_mb is not None and problem.static_mb:
        pre_s = [0, *accumulate(problem.static_mb)]
        pre_a = [0, *accumulate(problem.activation_mb)]
        at_s, at_a = prefix_at(pre_s, "ps"), prefix_at(pre_a, "pa")
        mem_stage = []
        upper = pre_s[-1] + pre_a[-1] * problem.microbatches
        for j in range(S):
            inflight = inflight_estimate(j, S, P, problem.microbatches)
            mem_stage.append((at_s[j + 1] - at_s[j]) + inflight * (at_a[j + 1] - at_a[j]))
        for load in rank_load(mem_stage, "m", upper):
            model.add(load <= problem.memory_mb)

    model.minimize(problem.microbatches * z + 2 * sum(xfer_terms) + sum(kind_max))

    if hint is not None:
        hint_bounds, hint_ranks = hint
        for j in range(1, S):
            model.add_hint(b[j], hint_bounds[j])
        for j in range(S):
            for r in range(P):
                model.add_hint(x[j, r], 1 if hint_ranks[j] == r else 0)

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = 1  # one worker: deterministic for a seed (and the machine is shared)
    solver.parameters.random_seed = seed
    start = time.perf_counter()
    status = solver.solve(model)
    wall = time.perf_counter() - start
    name = solver.status_name(status)
    log.info("cp-sat %d layers -> %d stages on %d ranks: %s, objective %s, bound %s, %.2f s", L, S, P, name,
             solver.objective_value if status in (cp_model.OPTIMAL, cp_model.FEASIBLE) else None,
             solver.best_objective_bound, wall)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    bounds = tuple(int(solver.value(v)) for v in b)
    ranks = tuple(next(r for r in range(P) if solver.value(x[j, r])) for j in range(S))
    return PartitionSolution(bounds, ranks, name, float(solver.objective_value), float(solver.best_objective_bound),
                             wall, int(solver.value(z)))


def _rank_classes(cluster: Cluster, config: Config) -> tuple[int, ...]:
    """Ranks share a class when their global ranks share a node in every dp replica."""
    parallel = config.parallel()
    keys = [tuple(cluster.node_of(parallel.global_rank(r, d)) for d in range(config.dp)) for r in range(config.pp)]
    index: dict[tuple, int] = {}
    return tuple(index.setdefault(k, len(index)) for k in keys)


def problem_for(evaluator: Evaluator, config: Config, num_stages: int, *, max_per_rank: int = 3) -> PartitionProblem:
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
    dtype = profile.dtype_bytes
    return PartitionProblem(
        forward=tuple(to_ticks(l.forward_ms) for l in layers),
        backward_input=tuple(to_ticks(l.backward_input_ms) for l in layers),
        backward_weight=tuple(to_ticks(l.backward_weight_ms) for l in layers),
        num_ranks=config.pp,
        num_stages=num_stages,
        microbatches=config.microbatches,
        static_mb=tuple(math.ceil(static_bytes(l.param_bytes, dtype_bytes=dtype) / _MB) for l in layers),
        activation_mb=tuple(math.ceil(l.activation_bytes / _MB) for l in layers),
        memory_mb=int(cluster.memory_gb * 1e9 / _MB),
        rank_class=classes,
        intra_ticks=tuple(intra),
        inter_ticks=tuple(inter),
        max_per_rank=max_per_rank,
    )


def cpsat_seeds(evaluator: Evaluator, config: Config, *, chunks_max: int, time_limit_s: float,
                seed: int = 0) -> tuple[list[Candidate], list[dict]]:
    """Candidates from CP-SAT for 1..chunks_max stages per rank, with policy-scheduler knobs."""
    profile = evaluator.profile
    seeds, stats = [], []
    for per_rank in range(1, max(1, chunks_max) + 1):
        num_stages = per_rank * config.pp
        if num_stages > profile.num_layers or (config.pp == 1 and per_rank > 1):
            break
        problem = problem_for(evaluator, config, num_stages, max_per_rank=max(1, chunks_max))
        hint = (bounds_of(balanced_partition(profile, num_stages)), loop_placement(config.pp, num_stages))
        solution = solve_partition(problem, hint=hint, time_limit_s=time_limit_s, seed=seed)
        if solution is None:
            stats.append({"stages": num_stages, "status": "INFEASIBLE or no solution"})
            continue
        stats.append({"config": config.label(), **solution.stats()})
        for split, depth in ((True, 1.0), (True, 2.0), (False, 1.0)):
            policies = default_policies(solution.ranks, config.pp, config.microbatches, split=split, depth=depth)
            seeds.append(Candidate(config, solution.bounds, solution.ranks, policies, None,
                                   f"cp-sat x{per_rank}, split={split}, depth={depth:g}"))
    return seeds, stats
