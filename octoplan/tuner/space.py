"""The tuner's search space: one candidate plan as plain data, and how it is priced.

A :class:`Candidate` fixes the three things the tuner co-optimizes:
- *partition*: stage boundaries over the layers (``bounds``, ``S + 1`` cut points);
- *placement*: which pipeline rank holds each stage (``ranks``, any map, several per rank);
- *schedule*: either per-rank knobs of the policy list scheduler (``policies``) or a fixed
  op order taken from a baseline (``fixed``), which stays valid while the stage count and
  placement do not change, so a baseline's partition can be tuned under its own schedule.

The :class:`Evaluator` turns a candidate into a plan and prices it with the simulator (the
one judge of every candidate); it caches by candidate so a move that returns to a known point
costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from octoplan.costs import LayerTable, StageCost, lower_bound_ms
from octoplan.memory import static_bytes
from octoplan.ops import Op
from octoplan.plan import Cluster, Parallel, Plan, Stage
from octoplan.profile import Profile
from octoplan.schedules.bottleneck import bottleneck_order
from octoplan.schedules.justify import justify
from octoplan.schedules.list_order import longest_tail_order
from octoplan.schedules.policy import RankPolicy, policy_schedule
from octoplan.simulator import SimResult, simulate_costs

__all__ = ["Config", "Candidate", "Scored", "Evaluator", "bounds_of", "OrderRule", "BOTTLENECK", "LONGEST_TAIL",
           "ORDER_RULES", "JUSTIFY_S_PER_UNIT", "justification_size"]


@dataclass(frozen=True)
class OrderRule:
    """A rule that builds a layout's whole op order anew (:meth:`Evaluator.reordered`)."""

    name: str  # appended to a rebuilt candidate's origin
    build: Callable  # (schedule, rank_of_stage, costs, *, cluster, parallel, keep_memory) -> (order, makespan)
    tag: str  # what its orders carry in a candidate's ``fixed_id``
    # what a rebuild's cost (both variants and their justifications) grows with, and the seconds
    # per unit of it before one is measured, on this project's 2-core machine
    size: Callable[[Candidate], float]
    s_per_unit: float


# the shifting-bottleneck procedure's cost grows with the ops times the square of the ranks
# (2-3.3e-6 s: 5 s for gemma3-27b's 6,144 ops on 16 ranks, 27 s for deepseek-v3's 12,288 on 32)
BOTTLENECK = OrderRule("shifting-bottleneck order", bottleneck_order, "bottleneck",
                       lambda cand: cand.num_ops * cand.config.pp ** 2, 2.5e-6)


def justification_size(cand: Candidate) -> float:
    """What a justification's cost grows with: the ops to the power 1.5. Its seconds per op are
    not constant: llama3-70b-a100's plans of 6,912, 24,576 and 36,864 ops took 0.2, 1.4 and
    2.6 s, 3.5-3.7e-7 s per unit of this size, where a pace per op taken from the smaller
    one would have seen the largest end 2.5 times later than estimated."""
    return float(cand.num_ops) ** 1.5


# seconds per unit of justification_size before one is measured: cautious, as both
# justifications of llama3-70b-a100's 18,432 ops took 1.8 s
JUSTIFY_S_PER_UNIT = 7.2e-7

# the list scheduler's as its justifications, which dominate
LONGEST_TAIL = OrderRule("longest-tail-first order", longest_tail_order, "longest-tail",
                         justification_size, JUSTIFY_S_PER_UNIT)
ORDER_RULES = (BOTTLENECK, LONGEST_TAIL)


@dataclass(frozen=True, order=True)
class Config:
    """The outer choice: pipeline and data-parallel degrees, microbatches, global rank order."""

    pp: int
    dp: int
    microbatches: int
    rank_order: str = "pp-inner"

    def parallel(self) -> Parallel:
        return Parallel(pp=self.pp, dp=self.dp, microbatches=self.microbatches, rank_order=self.rank_order)

    def label(self) -> str:
        order = "" if self.dp == 1 else f" {self.rank_order}"
        return f"pp={self.pp} dp={self.dp} mb={self.microbatches}{order}"


@dataclass(frozen=True)
class Candidate:
    config: Config
    bounds: tuple[int, ...]
    ranks: tuple[int, ...]
    policies: tuple[RankPolicy, ...] | None = None
    fixed: tuple[tuple[Op, ...], ...] | None = field(default=None, compare=False, hash=False)
    origin: str = field(default="", compare=False, hash=False)
    # names the fixed order (a baseline's label, plus a digest once reordered): the order itself
    # is left out of equality and hashing, which would cost a pass over every op per lookup
    fixed_id: str = ""
    # the stages that recompute their activations (octoplan.costs.StageCost), by index: a rank
    # may recompute some of its stages and keep the others' activations (selective
    # recomputation); moves that renumber stages carry the flags with them (moves._renumbered)
    recompute: frozenset[int] = frozenset()
    # (stage, k) for the recomputing stages that recompute only their first k layers, sorted;
    # the others recompute all of theirs (a k as large as the stage is all of them)
    recompute_layers: tuple[tuple[int, int], ...] = ()

    @property
    def num_stages(self) -> int:
        return len(self.ranks)

    def stages(self) -> tuple[Stage, ...]:
        # a count that a boundary shift has made as large as its stage is the whole stage
        return tuple(Stage(self.bounds[i], self.bounds[i + 1], r, i in self.recompute,
                           k if 0 < (k := self.recomputed_layers(i)) < self.bounds[i + 1] - self.bounds[i] else None)
                     for i, r in enumerate(self.ranks))

    def recomputed_layers(self, stage: int) -> int:
        """How many of ``stage``'s layers recompute (0: none)."""
        if stage not in self.recompute:
            return 0
        count = self.bounds[stage + 1] - self.bounds[stage]
        # a short scan: only the stages that recompute part of their layers are listed
        return min(next((k for s, k in self.recompute_layers if s == stage), count), count)

    def stages_of(self, rank: int) -> list[int]:
        return [s for s, r in enumerate(self.ranks) if r == rank]

    @property
    def every_stage(self) -> frozenset[int]:
        """Every stage's index: ``recompute`` for full recomputation."""
        return frozenset(range(self.num_stages))

    @property
    def num_ops(self) -> int:
        """How many ops its order has, without scheduling it: a policy rank that splits its
        backwards runs F, I and W per stage and microbatch, any other F and B."""
        if self.fixed is not None:
            return sum(len(ops) for ops in self.fixed)
        assert self.policies is not None
        return self.config.microbatches * sum(3 if self.policies[r].split else 2 for r in self.ranks)


@dataclass(frozen=True)
class Scored:
    """A candidate's figures. ``score`` orders candidates: fitting ones by iteration time per
    ``samples`` (1 where every configuration trains one batch), then the rest by how much memory
    their fullest GPU needs."""

    iteration_ms: float
    bubble_ratio: float
    efficiency: float
    peak_memory_bytes: int
    fits: bool
    # the microbatches an iteration trains (dp x microbatches per pipeline), where configurations
    # of one search train different batches (tune --microbatches without --pp); else 1
    samples: int = 1

    @property
    def judged_ms(self) -> float:
        """The time the search compares: the iteration's, per microbatch where batches differ."""
        return self.iteration_ms / self.samples

    @property
    def score(self) -> tuple[int, float]:
        return (0, self.judged_ms) if self.fits else (1, float(self.peak_memory_bytes))


class Evaluator:
    """Builds and simulates candidates of one profile on one cluster, with a cache."""

    def __init__(self, profile: Profile, cluster: Cluster, *, optimizer: str = "adam-mixed"):
        self.profile = profile
        self.cluster = cluster
        self.optimizer = optimizer
        self.table = LayerTable(profile)
        self.num_layers = profile.num_layers
        self._stage_cache: dict[tuple[int, int, int], StageCost] = {}  # (start, end, recomputed layers)
        self._cache: dict[Candidate, Scored] = {}
        # whether the configurations priced train different batches, so that candidates are
        # judged by time per microbatch (see judge_per_sample)
        self.per_sample = False
        self.evaluations = 0  # simulations actually run (cache misses)
        self._last: tuple[Candidate, SimResult] | None = None  # the latest timeline, for the climb

    def stage_cost(self, start: int, end: int, recompute_layers: int = 0) -> StageCost:
        """Layers [start, end) as a stage whose first ``recompute_layers`` recompute (0: none)."""
        key = (start, end, min(recompute_layers, end - start))
        cost = self._stage_cache.get(key)
        if cost is None:
            cost = self._stage_cache[key] = self.table.stage(start, end, recompute=key[2] > 0, recompute_layers=key[2] or None)
        return cost

    def recomputed_forward_ms(self, cand: Candidate, stage: int) -> float:
        """The forward time ``stage``'s first backward op runs again: its recomputed layers' (0
        where the stage does not recompute)."""
        start = cand.bounds[stage]
        return self.table.stage(start, start + cand.recomputed_layers(stage)).forward_ms

    def costs(self, cand: Candidate) -> list[StageCost]:
        return [self.stage_cost(cand.bounds[i], cand.bounds[i + 1], cand.recomputed_layers(i)) for i in range(cand.num_stages)]

    def schedule(self, cand: Candidate) -> tuple[tuple[Op, ...], ...]:
        if cand.fixed is not None:
            return cand.fixed
        assert cand.policies is not None
        costs = self.costs(cand)
        ops = policy_schedule(
            cand.ranks, costs, microbatches=cand.config.microbatches, policies=cand.policies,
            cluster=self.cluster, parallel=cand.config.parallel(),
            activation_budget_bytes=self.activation_budget(cand, costs),
        )
        return tuple(tuple(rank_ops) for rank_ops in ops)

    def activation_budget(self, cand: Candidate, costs: Sequence[StageCost]) -> list[float]:
        """Per rank, the GPU memory left for activations once the static bytes are placed."""
        limit = self.cluster.memory_bytes
        budget = [limit] * cand.config.pp
        for cost, rank in zip(costs, cand.ranks):
            budget[rank] -= static_bytes(cost.param_bytes, dtype_bytes=self.profile.param_dtype_bytes,
                                         optimizer=self.optimizer) + cost.buffer_bytes
        return budget

    def justified(self, cand: Candidate) -> list[Candidate]:
        """``cand`` with its op order justified (:func:`octoplan.schedules.justify.justify`) as
        fixed orders: keeping each stage's microbatches in flight, and free of that limit
        (which can defer more Ws, for plans with memory to spare); the orders that differ
        from ``cand``'s."""
        schedule = tuple(tuple(ops) for ops in self.schedule(cand))
        costs = self.costs(cand)
        out: list[Candidate] = []
        for keep in (True, False):
            new, _ = justify(schedule, cand.ranks, costs, cluster=self.cluster, parallel=cand.config.parallel(),
                             keep_memory=keep)
            base = cand.origin.split(", justified")[0]
            _add_fixed(out, cand, schedule, new, "justified", f"{base}, justified" + ("" if keep else " (in flight unbounded)"))
        return out

    def reordered(self, cand: Candidate, rule: OrderRule = BOTTLENECK) -> list[Candidate]:
        """``cand``'s ops ordered anew by ``rule``, one of :data:`ORDER_RULES` (the
        shifting-bottleneck procedure, :func:`octoplan.schedules.bottleneck.bottleneck_order`,
        or the longest-tail-first list scheduler,
        :func:`octoplan.schedules.list_order.longest_tail_order`), keeping each stage's
        microbatches in flight and free of that limit, each order followed by its justified
        ones: the orders that differ from ``cand``'s."""
        schedule = tuple(tuple(ops) for ops in self.schedule(cand))
        costs = self.costs(cand)
        out: list[Candidate] = []
        base = cand.origin.split(", justified")[0]
        for known in ORDER_RULES:
            base = base.split(f", {known.name}")[0]
        for keep in (True, False):
            new, _ = rule.build(schedule, cand.ranks, costs, cluster=self.cluster,
                                parallel=cand.config.parallel(), keep_memory=keep)
            fresh = _add_fixed(out, cand, schedule, new, rule.tag,
                               f"{base}, {rule.name}" + ("" if keep else " (in flight unbounded)"))
            if fresh is not None:
                out.extend(c for c in self.justified(fresh) if all(c.fixed != o.fixed for o in out))
        return out

    def plan(self, cand: Candidate) -> Plan:
        return Plan(
            model=self.profile.model,
            cluster=self.cluster,
            parallel=cand.config.parallel(),
            stages=cand.stages(),
            schedule=self.schedule(cand),
        )

    def simulate(self, cand: Candidate) -> SimResult:
        plan = self.plan(cand)
        result = simulate_costs(
            plan, self.costs(cand),
            lower_bound=lower_bound_ms(self.profile, pp=cand.config.pp, microbatches=cand.config.microbatches,
                                       op_overhead_ms=self.cluster.op_overhead_us / 1000.0),
            dtype_bytes=self.profile.param_dtype_bytes, optimizer=self.optimizer, tied=self.profile.tied,
        )
        self.evaluations += 1
        self._cache[cand] = _scored(result, cand.config.dp * cand.config.microbatches if self.per_sample else 1)
        self._last = (cand, result)
        return result

    def timeline(self, cand: Candidate) -> SimResult:
        """``cand``'s simulated timeline: the latest one when it is ``cand``'s (a climb asks for
        the move it just accepted), else simulated again (only scores are cached)."""
        if self._last is not None and self._last[0] == cand and self._last[0].fixed_id == cand.fixed_id:
            return self._last[1]
        return self.simulate(cand)

    def score(self, cand: Candidate) -> Scored:
        hit = self._cache.get(cand)
        if hit is None:
            self.simulate(cand)
            hit = self._cache[cand]
        return hit

    def judge_per_sample(self, configs: Sequence[Config]) -> None:
        """Judge candidates by time per microbatch where ``configs`` train different batches (a
        fixed count of microbatches per pipeline over several dp): a longer iteration of more
        samples may train faster. Scores priced under the other rule are dropped."""
        per_sample = len({config.dp * config.microbatches for config in configs}) > 1
        if per_sample != self.per_sample:
            self._cache.clear()
            self.per_sample = per_sample

    def priced(self, cand: Candidate) -> bool:
        """Whether ``cand``'s score is known: asking for it again costs no plan."""
        return cand in self._cache

    def priced_plans(self) -> list[tuple[Candidate, Scored]]:
        """Every candidate priced so far, with its score."""
        return list(self._cache.items())

    def least_memory(self) -> int | None:
        return min((s.peak_memory_bytes for s in self._cache.values()), default=None)


def _add_fixed(out: list[Candidate], cand: Candidate, schedule: tuple[tuple[Op, ...], ...],
               order: Sequence[Sequence[Op]], step: str, origin: str) -> Candidate | None:
    """Appends to ``out`` (and returns) ``cand``'s layout with ``order`` fixed, unless that
    order is ``schedule`` or one already in ``out``."""
    frozen = tuple(tuple(ops) for ops in order)
    if frozen == schedule or any(frozen == c.fixed for c in out):
        return None
    # the digest only names the order inside this run (the cache's identity for it)
    tag = cand.fixed_id.split("#")[0] if cand.fixed_id else "policy"
    key = f"{tag}+{step}#{hash(frozen) & 0xFFFFFFFFFFFF:x}"
    made = replace(cand, policies=None, fixed=frozen, origin=origin, fixed_id=key)
    out.append(made)
    return made


def _scored(result: SimResult, samples: int) -> Scored:
    return Scored(
        iteration_ms=result.iteration_ms,
        bubble_ratio=result.bubble_ratio,
        efficiency=result.efficiency,
        peak_memory_bytes=max(result.peak_memory_bytes),
        fits=result.fits_memory,
        samples=samples,
    )


def bounds_of(pairs: Sequence[tuple[int, int]]) -> tuple[int, ...]:
    """Stage boundaries (S + 1 cut points) of a list of [start, end) layer ranges."""
    return tuple([pairs[0][0]] + [end for _, end in pairs])
