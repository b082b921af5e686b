"""Plans (FORMATS.md section 3): stages, their ranks, and every rank's op order.

``load_plan`` checks the structural rules (coverage, placement, every op exactly once, I before
W); whether the orders can run to the end is a property of the dependency graph and is checked
by :func:`octoplan.deps.check_runnable`. ``octorun`` reads plans through this module too, so it
must stay free of OR-Tools and of the simulator.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Sequence

from octoplan.errors import InputError, shown
from octoplan.ops import Kind, Op, format_ops, parse_op
from octoplan.profile import MAX_MICROBATCH_SIZE, MEMORY_GB_RANGE, ModelRef, Profile, load_profile
from octoplan.yamlio import Fields, file_sha256, read_yaml, write_yaml

__all__ = [
    "PLAN_FORMAT",
    "MAX_MICROBATCHES",
    "MAX_GPUS",
    "CLUSTER_RANGES",
    "Cluster",
    "Parallel",
    "Stage",
    "Plan",
    "load_plan",
    "save_plan",
    "plan_to_dict",
    "plan_from_dict",
    "check_structure",
    "resolve_profile_path",
    "resolve_written_path",
    "load_plan_profile",
]

PLAN_FORMAT = "octoplan-plan/1"
RANK_ORDERS = ("pp-inner", "dp-inner")
# The most microbatches per pipeline the planner accepts: far above what real jobs use (the
# bubble is gone long before), and a plan this size still simulates in seconds, where one of
# 10**5 microbatches would keep the tuner busy for minutes past its --time-limit.
MAX_MICROBATCHES = 4096
# The most GPUs: beyond any cluster built, and small enough that the work per GPU count (the
# tuner tries every pp dividing it) stays within a second.
MAX_GPUS = 1 << 20
# The range of each cluster figure, for plan files and the command line alike: wide enough
# for any machine, narrow enough that times and byte counts stay finite.
CLUSTER_RANGES = {
    "memory_gb": MEMORY_GB_RANGE,
    "intra_node_gbps": (1e-9, 1e15),  # 1e12 and more: transfers as good as free
    "inter_node_gbps": (1e-9, 1e15),
    "latency_us": (0.0, 1e9),  # up to 1000 s
    "op_overhead_us": (0.0, 1e9),
}


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int = 8
    memory_gb: float = 80.0
    intra_node_gbps: float = 450.0
    inter_node_gbps: float = 50.0
    latency_us: float = 10.0
    # Optional extension of FORMATS.md section 3: a fixed cost added to every op, for runtimes whose
    # per-op overhead is not negligible against the ops (CPU processes standing in for GPUs).
    op_overhead_us: float = 0.0

    @property
    def memory_bytes(self) -> int:
        """Each GPU's memory in bytes: memory_gb x 10^9, rounded (``int`` would truncate 4.1 GB
        to 4,099,999,999 bytes, and a plan needing exactly 4.1 GB would not fit)."""
        return round(self.memory_gb * 1e9)

    def node_of(self, global_rank: int) -> int:
        return global_rank // self.gpus_per_node

    def rank_orders_alike(self, gpus: int) -> bool:
        """Whether both rank orders (:attr:`Parallel.rank_order`) put the same ranks on shared
        nodes for a job of ``gpus``: all of them on one node, or every GPU a node of its own."""
        return gpus <= self.gpus_per_node or self.gpus_per_node == 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpus": self.gpus,
            "gpus_per_node": self.gpus_per_node,
            "memory_gb": self.memory_gb,
            "intra_node_gbps": self.intra_node_gbps,
            "inter_node_gbps": self.inter_node_gbps,
            "latency_us": self.latency_us,
            **({"op_overhead_us": self.op_overhead_us} if self.op_overhead_us else {}),
        }


@dataclass(frozen=True)
class Parallel:
    pp: int
    microbatches: int
    dp: int = 1
    rank_order: str = "pp-inner"

    def global_rank(self, pp_rank: int, dp_rank: int = 0) -> int:
        if self.rank_order == "pp-inner":
            return dp_rank * self.pp + pp_rank
        return pp_rank * self.dp + dp_rank

    def coordinates(self, global_rank: int) -> tuple[int, int]:
        """(pp_rank, dp_rank) of a global rank."""
        if self.rank_order == "pp-inner":
            return global_rank % self.pp, global_rank // self.pp
        return global_rank // self.dp, global_rank % self.dp

    def to_dict(self) -> dict[str, Any]:
        return {"pp": self.pp, "dp": self.dp, "microbatches": self.microbatches, "rank_order": self.rank_order}

    def runs_in_order(self, order: str, cluster: Cluster) -> bool:
        """Whether a framework that numbers ranks in ``order`` runs this parallelism on the nodes
        it was planned on: one pipeline or one stage (either order numbers ranks alike), the same
        order, or a cluster where the orders are alike."""
        return (self.dp == 1 or self.pp == 1 or self.rank_order == order
                or cluster.rank_orders_alike(self.pp * self.dp))


@dataclass(frozen=True)
class Stage:
    start: int  # first layer
    end: int  # one past the last layer
    rank: int  # pipeline rank holding the stage
    # Activation recomputation: F keeps only the stage's input, and the stage's first backward
    # op (I or B) runs the forward again before it (octoplan.costs.StageCost says what that costs).
    recompute: bool = False
    # With recompute, how many of the stage's first layers run again (None: all of them). The
    # rest keep their activations from F, as Megatron-LM's --recompute-method block does.
    recompute_layers: int | None = None

    def __post_init__(self) -> None:
        if self.recompute_layers is not None and self.recompute_layers < 1:
            raise ValueError(f"recompute_layers is {self.recompute_layers}: recompute at least 1 layer, or set None for all")

    @property
    def layers(self) -> range:
        return range(self.start, self.end)

    @property
    def recomputed_layers(self) -> int:
        """How many of the stage's layers its first backward op runs again (0: none)."""
        if not self.recompute:
            return 0
        count = self.end - self.start
        return count if self.recompute_layers is None else min(self.recompute_layers, count)


@dataclass(frozen=True)
class Plan:
    model: ModelRef
    cluster: Cluster
    parallel: Parallel
    stages: tuple[Stage, ...]
    schedule: tuple[tuple[Op, ...], ...]  # indexed by pipeline rank
    profile: str | None = None
    profile_sha256: str | None = None
    predicted: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def pp(self) -> int:
        return self.parallel.pp

    @property
    def microbatches(self) -> int:
        return self.parallel.microbatches

    def stages_of(self, rank: int) -> list[int]:
        return [s for s, stage in enumerate(self.stages) if stage.rank == rank]

    @property
    def num_recomputing(self) -> int:
        """How many stages recompute their activations."""
        return sum(stage.recompute for stage in self.stages)

    @property
    def num_recomputing_part(self) -> int:
        """How many of those recompute only their first layers (``recompute_layers``)."""
        return sum(0 < stage.recomputed_layers < stage.end - stage.start for stage in self.stages)

    def with_schedule(self, schedule: Sequence[Sequence[Op]]) -> "Plan":
        return replace(self, schedule=tuple(tuple(ops) for ops in schedule))


# A plan's top-level fields (docs/FORMATS.md section 3): any other is kept as an extension,
# unless it is a near miss of one of these (a misspelt profile would leave the plan without one)
# (the fields Plan reads; the last three, and any other, stay in Plan.extra as they are)
_READ_FIELDS = ("format", "profile", "profile_sha256", "model", "cluster", "parallel", "stages", "schedule", "predicted")
_TOP_FIELDS = (*_READ_FIELDS, "microbatch_size", "generator", "tuner")


def _parse_schedule(raw: Any, *, file: str, pp: int) -> tuple[tuple[Op, ...], ...]:
    if not isinstance(raw, dict):
        raise InputError(file, "schedule", "must map each pipeline rank to its ops", "see docs/FORMATS.md section 3")
    keyed: dict[int, Any] = {}
    for key, value in raw.items():
        # ASCII digits only: str.isdigit() also passes "²" (which int() refuses) and "٢" (read as 2)
        if isinstance(key, bool) or not (isinstance(key, int) or (isinstance(key, str) and re.fullmatch(r"[0-9]+", key))):
            raise InputError(file, f"schedule.{key}", "is not a pipeline rank", f"use ranks 0..{pp - 1}")
        rank = int(key)
        if rank in keyed:
            raise InputError(file, f"schedule.{key}", f"rank {rank} is listed twice", "keep one op list per rank")
        if not 0 <= rank < pp:
            raise InputError(file, f"schedule.{key}", f"rank {rank} is outside 0..{pp - 1}", "remove it or raise parallel.pp")
        keyed[rank] = value
    schedule = []
    for rank in range(pp):
        if rank not in keyed:
            raise InputError(file, f"schedule.{rank}", "is missing", "every pipeline rank needs an op list")
        text = keyed[rank]
        if text is None:
            text = ""
        if not isinstance(text, str):
            raise InputError(file, f"schedule.{rank}", "must be one space-separated string of ops", 'e.g. "0F0 0F1 0B0 0B1"')
        ops = []
        for token in text.split():
            try:
                ops.append(parse_op(token))
            except ValueError as exc:
                raise InputError(file, f"schedule.{rank}", str(exc), None) from None
        schedule.append(tuple(ops))
    return tuple(schedule)


def _sha256_field(top: Fields) -> str | None:
    digest = top.str("profile_sha256", None)
    if digest is not None and not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise InputError(top.file, "profile_sha256", f"is {digest[:80]!r}, not a SHA-256 digest (64 hex digits)",
                         "re-plan, or drop the field")
    return digest


def uneven_nodes(gpus: int, gpus_per_node: int) -> str:
    """Why ``gpus`` on nodes of ``gpus_per_node`` is no cluster octorun launches: it runs the
    plan's gpus_per_node processes on every node (LOCAL_WORLD_SIZE is checked)."""
    return (f"is {gpus}, not a whole number of nodes of {gpus_per_node} GPUs (the last would hold "
            f"{gpus % gpus_per_node}; octorun runs {gpus_per_node} processes on every node)")


def plan_from_dict(data: dict[str, Any], *, file: str = "<plan>") -> Plan:
    top = Fields.document(data, file=file, format=PLAN_FORMAT, fields=_TOP_FIELDS, fix="regenerate it with octoplan tune")
    model = ModelRef.read(top)
    c = top.mapping("cluster")
    c.only(("gpus", "gpus_per_node", *CLUSTER_RANGES))
    defaults = Cluster(gpus=1)
    cluster = Cluster(
        gpus=c.int("gpus", minimum=1, maximum=MAX_GPUS),
        gpus_per_node=c.int("gpus_per_node", defaults.gpus_per_node, minimum=1, maximum=MAX_GPUS),
        **{name: c.number(name, getattr(defaults, name), minimum=least, maximum=most)
           for name, (least, most) in CLUSTER_RANGES.items()},
    )
    if cluster.gpus > cluster.gpus_per_node and cluster.gpus % cluster.gpus_per_node:
        raise InputError(file, "cluster.gpus", uneven_nodes(cluster.gpus, cluster.gpus_per_node),
                         "give a whole number of nodes, or the gpus_per_node the nodes have")
    p = top.mapping("parallel")
    p.only(("pp", "dp", "microbatches", "rank_order"))
    parallel = Parallel(
        pp=p.int("pp", minimum=1),
        dp=p.int("dp", 1, minimum=1),
        microbatches=p.int("microbatches", minimum=1, maximum=MAX_MICROBATCHES),
        rank_order=p.str("rank_order", "pp-inner"),
    )
    if parallel.rank_order not in RANK_ORDERS:
        raise InputError(file, "parallel.rank_order", f"is {parallel.rank_order!r}", "use pp-inner or dp-inner")
    if parallel.pp * parallel.dp != cluster.gpus:
        raise InputError(
            file, "cluster.gpus", f"is {cluster.gpus} but pp*dp = {parallel.pp}*{parallel.dp}",
            "make cluster.gpus equal parallel.pp * parallel.dp",
        )
    stages = []
    for i, entry in enumerate(top.list("stages")):
        s = Fields(entry, file=file, prefix=f"stages[{i}]")
        s.only(("layers", "rank", "recompute", "recompute_layers"))
        layers = s.raw("layers")
        if not (isinstance(layers, list) and len(layers) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in layers)):
            raise InputError(file, f"stages[{i}].layers", f"is {shown(layers)}", "write [start, end) as two integers")
        recompute = s.bool("recompute", False)
        some = s.int("recompute_layers", None, minimum=1, maximum=max(1, layers[1] - layers[0]))
        if some is not None and not recompute:
            raise InputError(file, f"stages[{i}].recompute_layers", f"is {some} but the stage does not recompute",
                             "add recompute: true, or drop recompute_layers")
        stages.append(Stage(start=layers[0], end=layers[1], rank=s.int("rank"), recompute=recompute, recompute_layers=some))
    schedule = _parse_schedule(top.raw("schedule"), file=file, pp=parallel.pp)
    predicted = data.get("predicted")
    profile = top.str("profile", None)
    if profile is not None and not profile.strip():  # neither absent nor a path: say so, not "missing" or "not found"
        raise InputError(file, "profile", "is empty", "write the path of the profile the plan was made from, or drop the field")
    plan = Plan(
        model=model,
        cluster=cluster,
        parallel=parallel,
        stages=tuple(stages),
        schedule=schedule,
        profile=profile,
        profile_sha256=_sha256_field(top),
        predicted=predicted if isinstance(predicted, dict) else None,
        extra={k: v for k, v in data.items() if k not in _READ_FIELDS},
    )
    check_structure(plan, file=file)
    return plan


def check_structure(plan: Plan, *, file: str = "<plan>", num_layers: int | None = None) -> None:
    """FORMATS.md section 3's rules on stages and ops (not the run-to-end rule)."""
    pp, num_mb = plan.pp, plan.microbatches
    if not plan.stages:
        raise InputError(file, "stages", "is empty", "list at least one stage")
    expected_start = 0
    for i, stage in enumerate(plan.stages):
        field_name = f"stages[{i}].layers"
        if stage.end <= stage.start:  # first: a reversed range neither overlaps nor leaves a gap
            raise InputError(file, field_name, f"[{stage.start}, {stage.end}) is empty", "every stage needs at least one layer")
        if stage.start != expected_start:
            problem = ("does not start at layer 0" if i == 0 else
                       "overlaps the stage before" if stage.start < expected_start else "leaves a gap after the stage before")
            raise InputError(file, field_name, f"[{stage.start}, {stage.end}) {problem}", f"start it at layer {expected_start}")
        if not 0 <= stage.rank < pp:
            raise InputError(file, f"stages[{i}].rank", f"is {stage.rank}, outside 0..{pp - 1}", "use a pipeline rank")
        expected_start = stage.end
    if num_layers is not None and expected_start != num_layers:
        raise InputError(
            file, "stages", f"cover layers [0, {expected_start}) but the profile has {num_layers}",
            f"end the last stage at layer {num_layers}",
        )
    empty = sorted(set(range(pp)) - {stage.rank for stage in plan.stages})
    if empty:
        raise InputError(file, "stages", f"no stage on pipeline rank {empty[0]}", "every rank must hold at least one stage")
    seen: Counter[Op] = Counter()
    position: dict[Op, int] = {}
    for rank, ops in enumerate(plan.schedule):
        for index, op in enumerate(ops):
            where = f"schedule.{rank}"
            if op.stage >= plan.num_stages:
                raise InputError(file, where, f"op {op} names stage {op.stage}; the plan has {plan.num_stages} stages", "fix the op")
            if op.mb >= num_mb:
                raise InputError(file, where, f"op {op} names microbatch {op.mb}; the plan has {num_mb}", "fix the op or parallel.microbatches")
            holder = plan.stages[op.stage].rank
            if holder != rank:
                raise InputError(file, where, f"op {op} is on rank {rank} but stage {op.stage} is on rank {holder}", f"move it to schedule.{holder}")
            seen[op] += 1
            if seen[op] > 1:
                raise InputError(file, where, f"op {op} appears twice", "keep one")
            position[op] = index
    for stage_index, stage in enumerate(plan.stages):
        where = f"schedule.{stage.rank}"
        for mb in range(num_mb):
            f_op = Op(stage_index, Kind.F, mb)
            b_op, i_op, w_op = Op(stage_index, Kind.B, mb), Op(stage_index, Kind.I, mb), Op(stage_index, Kind.W, mb)
            if f_op not in seen:
                raise InputError(file, where, f"missing {f_op}", "add the forward of every microbatch")
            if b_op in seen:
                if i_op in seen or w_op in seen:
                    raise InputError(file, where, f"{b_op} and {i_op if i_op in seen else w_op} both present", "use B or I+W, not both")
                continue
            if i_op not in seen and w_op not in seen:
                raise InputError(file, where, f"missing the backward of stage {stage_index} microbatch {mb}", f"add {b_op} or {i_op} and {w_op}")
            if i_op not in seen:
                raise InputError(file, where, f"{w_op} without {i_op}", f"add {i_op} before {w_op}")
            if w_op not in seen:
                raise InputError(file, where, f"{i_op} without {w_op}", f"add {w_op} after {i_op}")
            if position[w_op] < position[i_op]:
                raise InputError(file, where, f"{w_op} comes before {i_op}", f"move {w_op} after {i_op}")


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    out: dict[str, Any] = {"format": PLAN_FORMAT}
    if plan.profile is not None:
        out["profile"] = plan.profile
    if plan.profile_sha256 is not None:
        out["profile_sha256"] = plan.profile_sha256
    out["model"] = plan.model.to_dict()
    out["cluster"] = plan.cluster.to_dict()
    out["parallel"] = plan.parallel.to_dict()
    out["stages"] = [{"layers": [s.start, s.end], "rank": s.rank, **({"recompute": True} if s.recompute else {}),
                      **({"recompute_layers": s.recompute_layers} if s.recompute and s.recompute_layers is not None else {})}
                     for s in plan.stages]
    out["schedule"] = {rank: format_ops(ops) for rank, ops in enumerate(plan.schedule)}
    if plan.predicted is not None:
        out["predicted"] = plan.predicted
    out.update(plan.extra)
    return out


def save_plan(plan: Plan, path: str | Path) -> None:
    write_yaml(path, plan_to_dict(plan))


def load_plan(path: str | Path) -> Plan:
    """Read a plan and check its structure; the profile is not read (see load_plan_profile)."""
    return plan_from_dict(read_yaml(path, what="plan"), file=str(path))


def resolve_written_path(written: str | None, file: str | Path) -> Path | None:
    """A path a file holds (a plan's profile, a model's source) as written, else relative to
    that file's folder or the folder above it (plans/ and profiles/ beside the model files);
    None if none exists."""
    if not written:
        return None
    for candidate in (Path(written), Path(file).parent / written, Path(file).parent.parent / written):
        if candidate.exists():
            return candidate
    return None


def resolve_profile_path(plan: Plan, plan_path: str | Path) -> Path | None:
    """The plan's profile as written, else relative to the plan file or its parent folder."""
    return resolve_written_path(plan.profile, plan_path)


def load_plan_profile(plan: Plan, plan_path: str | Path) -> Profile:
    """The profile a plan was made from, checked against the plan's hash and layer count."""
    if plan.profile is None:
        raise InputError(str(plan_path), "profile", "is missing", "add the path of the profile the plan was made from")
    path = resolve_profile_path(plan, plan_path)
    if path is None:
        raise InputError(str(plan_path), "profile", f"profile {shown(plan.profile)} not found", "restore it or re-plan")
    if path.is_dir():
        raise InputError(str(plan_path), "profile", f"{shown(plan.profile)} is a folder", "give the profile file's path")
    if plan.profile_sha256 and file_sha256(path) != plan.profile_sha256:
        raise InputError(
            str(plan_path), "profile_sha256", f"does not match {path} (the profile changed since planning)",
            "re-run octoplan tune or baseline on the new profile",
        )
    profile = load_profile(path)
    check_structure(plan, file=str(plan_path), num_layers=profile.num_layers)
    _check_same_model(plan, str(plan_path), profile, path)
    return profile


def _check_same_model(plan: Plan, plan_path: str, profile: Profile, profile_path: Path) -> None:
    """The plan's model is its profile's: a plan edited to another config would pass every
    check, and octorun would train a model the plan's costs say nothing about."""
    fix = "re-plan from the profile with octoplan tune or baseline, or profile the model you mean"
    mine, theirs = plan.model, profile.model
    if mine.name != theirs.name:
        raise InputError(plan_path, "model.name", f"is {shown(mine.name)} but the profile {profile_path} has "
                         f"{shown(theirs.name)}", fix)
    # the same file, however each spells its path (as written, or from its own folder)
    if mine.source != theirs.source and not _same_file(resolve_written_path(mine.source, plan_path),
                                                       resolve_written_path(theirs.source, profile_path)):
        ours = "missing" if mine.source is None else shown(mine.source)
        has = "has none" if theirs.source is None else f"has {shown(theirs.source)}"
        raise InputError(plan_path, "model.source", f"is {ours} but the profile {profile_path} {has}", fix)
    for key in [*mine.config, *(k for k in theirs.config if k not in mine.config)]:
        if key not in theirs.config or key not in mine.config or not _same_value(mine.config[key], theirs.config[key]):
            ours = shown(mine.config[key]) if key in mine.config else "missing"
            has = f"has {shown(theirs.config[key])}" if key in theirs.config else "does not set it"
            raise InputError(plan_path, f"model.config.{key}", f"is {ours} but the profile {profile_path} {has}", fix)


def _same_file(a: Path | None, b: Path | None) -> bool:
    try:
        return a is not None and b is not None and a.samefile(b)
    except OSError:
        return False


def _same_value(a: Any, b: Any) -> bool:
    """Equal and of one type (128 is not 128.0 nor True to a model file), NaN equal to NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(_same_value, a, b))
    return a == b or (a != a and b != b)


def plan_microbatch_size(plan: Plan, plan_path: str | Path) -> int:
    """Samples per microbatch: the plan's profile's, or (a plan with no ``profile`` field) its
    top-level ``microbatch_size`` (1 when absent). A profile named but unreadable is bad input,
    never a fall back to 1: octorun would train other microbatches than the plan's."""
    size = plan.extra.get("microbatch_size", 1)
    if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= MAX_MICROBATCH_SIZE:
        raise InputError(str(plan_path), "microbatch_size", f"is {shown(size)}", f"write a whole number from 1 to {MAX_MICROBATCH_SIZE}")
    if plan.profile is None:
        return size
    measured = load_plan_profile(plan, plan_path).microbatch_size
    if "microbatch_size" in plan.extra and size != measured:  # a hand edit the run would silently not follow
        raise InputError(str(plan_path), "microbatch_size", f"is {size}, but the plan's profile was measured at {measured}, "
                         "the size its times are for and octorun trains at",
                         "remove the field, or profile the model at --microbatch-size "
                         f"{size} and plan again")
    return measured


def stage_ranks(stages: Iterable[Stage]) -> list[int]:
    return [s.rank for s in stages]
