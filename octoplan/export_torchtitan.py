"""Export a plan as torchtitan settings: its ``[parallelism]`` pipeline config and the schedule CSV.

torchtitan (``torchtitan/distributed/pipeline_parallel.py``) builds a pipeline from
``ParallelismConfig``: ``pipeline_parallel_degree`` ranks, the stages' modules
``module_fqns_per_model_part`` (one list of module names per stage, in stage order), and with
``pipeline_parallel_schedule_csv`` it runs torch's ``_PipelineScheduleRuntime`` on that CSV
(octoplan's ``torch-csv`` export, :mod:`octoplan.export`). The microbatch count is
``training.local_batch_size / pipeline_parallel_microbatch_size``.

torchtitan places stages itself, from the schedule's name in ``pipeline_parallel_schedule``:
in a loop (rank ``r`` holds stages ``r + s x pp``) for every schedule but ZB-V and DualPipeV,
which take a V of exactly two stages per rank (rank ``r`` holds ``r`` and ``2pp-1-r``). The
CSV decides the order only. So a plan exports when its placement is one of those two (the
schedule's name is then set to one that yields it); any other placement would put stages on
other ranks than the CSV names, and is refused. ``octoplan tune --runs-on loop`` (or ``v``)
finds the best plan of that placement.

Module names (``fqn_style``): ``llama`` names the modules as torchtitan's Llama-style models
do — the embedding layer ``tok_embeddings``, the head ``norm`` and ``output``, every other layer
``layers.N`` with N counting those layers from 0 (a split block's mixer and MLP are one
``layers.N``; a stage boundary between them is refused). A profile without an embedding or a
head layer still gets ``tok_embeddings`` in the first stage and ``norm`` and ``output`` in the
last: torchtitan drops the modules no stage names. That is an assumption about the
model's module tree that holds for torchtitan's Llama, Llama-4-style and DeepSeek-V3
models' decoder layers; ``profile`` takes each layer's name from the profile instead, for a
model whose profile names its modules.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from octoplan.errors import InputError, one_line
from octoplan.export import torch_csv_rows
from octoplan.hf import is_hf_source
from octoplan.outputs import check_distinct, write_text
from octoplan.plan import Plan, check_structure
from octoplan.profile import Profile
from octoplan.schedules import framework_placement

__all__ = ["FQN_STYLES", "TORCHTITAN_RANK_ORDER", "TorchtitanExport", "torchtitan_placement", "module_fqns", "torchtitan_export",
           "export_torchtitan", "csv_path_for", "torchtitan_cuts", "non_llama_kind", "checkpoint_mode"]

FQN_STYLES = ("llama", "profile")
# torchtitan's device mesh is ["pp", "dp_replicate", "dp_shard", "cp", "tp"], pp outermost: a
# stage's data-parallel replicas take consecutive ranks
TORCHTITAN_RANK_ORDER = "dp-inner"
# layer kinds that are no decoder layer of torchtitan's Llama-style models (layers.N): an MTP
# module, a vision tower and its projector, a Mamba mixer
_NOT_LLAMA_LAYERS = frozenset({"mtp", "vision", "projector", "mamba"})
_SPLIT_PARTS = ("mixer", "ffn")


def torchtitan_placement(plan: Plan) -> str | None:
    """``"loop"`` or ``"v"``: the torchtitan stage placement that is ``plan``'s (None: neither)."""
    return framework_placement(plan.pp, [s.rank for s in plan.stages])


def _split_block_owners(profile: Profile) -> list[str | None]:
    """Per layer, the split block it is part of (a split-blocks profile's NAME.mixer and
    NAME.ffn), else None: torchtitan cannot start a stage between a block's parts."""
    owners = []
    for layer in profile.layers:
        base, _, part = layer.name.rpartition(".")
        owners.append(base if part in _SPLIT_PARTS and layer.kind.rpartition(".")[2] == part else None)
    return owners


def non_llama_kind(profile: Profile) -> str | None:
    """The kind of the profile's first layer with no module in a Llama-style model (an MTP,
    vision or Mamba layer), None where every layer has one."""
    return next((layer.kind for layer in profile.layers if layer.kind.partition(".")[0] in _NOT_LLAMA_LAYERS), None)


def _analytic(profile: Profile) -> bool:
    """An ``octoplan profile --arch`` profile: its layer names are its own, no module names."""
    return "cost_model" in profile.extra


def torchtitan_cuts(profile: Profile, style: str = "llama") -> frozenset[int] | None:
    """The layer indices a stage may start at in the export of ``style``: all but those inside a
    split block; None where that style refuses every plan of the profile: ``llama`` for a layer
    with no Llama-style module (:func:`non_llama_kind`), ``profile`` for an analytic or an hf:
    profile, whose layer names are no module names."""
    if style == "llama" and non_llama_kind(profile) is not None:
        return None
    if style == "profile" and (_analytic(profile) or is_hf_source(profile.model.source)):
        return None
    owners = _split_block_owners(profile)
    return frozenset(i for i in range(profile.num_layers)
                     if i == 0 or owners[i] is None or owners[i] != owners[i - 1])


def module_fqns(plan: Plan, profile: Profile, *, style: str = "llama", file: str = "<plan>") -> list[list[str]]:
    """Each stage's module names in ``style`` (see the module docstring)."""
    if style not in FQN_STYLES:
        raise InputError(None, "--fqn-style", f"is {style!r}", f"use one of {', '.join(FQN_STYLES)}")
    if style == "profile" and _analytic(profile):
        raise InputError(file, "--fqn-style profile", f"the layer names of the analytic profile of {profile.model.name} "
                         "are its own, not module names of a model: torchtitan would drop "
                         "the embedding, norm and output no stage names",
                         "give --fqn-style llama for a model torchtitan builds with Llama-style names")
    if style == "profile" and is_hf_source(profile.model.source):
        # torchtitan drops a name no module has: the head would leave the last stage in silence
        raise InputError(file, "--fqn-style profile", f"the layer names of {profile.model.source} (embed_tokens, "
                         "layers.N, norm+lm_head) are the pipeline's pieces, not module names of a transformers model",
                         "give --fqn-style llama for a model torchtitan builds with Llama-style names, or set "
                         "module_fqns_per_model_part by hand from the stages")
    if style == "profile":
        seen: dict[str, int] = {}
        for index, layer in enumerate(profile.layers):
            if layer.name in seen:
                # two model parts would claim one module name (a model file without layer_name
                # names each layer by its class)
                raise InputError(file, "--fqn-style profile", f"layers {seen[layer.name]} and {index} are both named "
                                 f"{layer.name!r}; torchtitan would give one module to two stages",
                                 "give the model file a layer_name hook that returns each layer's module name, and "
                                 "profile again")
            seen[layer.name] = index
    names: list[list[str]] = []  # per layer
    owner = _split_block_owners(profile)  # per layer, the split block it is part of
    block_index = -1
    previous = None
    for layer, block in zip(profile.layers, owner):
        if style == "profile":
            names.append([layer.name])
        elif layer.kind == "embedding":
            names.append(["tok_embeddings"])
        elif layer.kind == "head":
            names.append(["norm", "output"])
        elif layer.kind.partition(".")[0] in _NOT_LLAMA_LAYERS:
            # torchtitan drops the module names no model part has: the stages would be split
            # otherwise than planned without a word
            raise InputError(file, f"--fqn-style {style}", f"has no module for layer {len(names)} ({layer.name}, kind "
                             f"{layer.kind!r}): a Llama-style model holds tok_embeddings, layers.N, norm and output only",
                             "give --fqn-style profile with a profile whose layer names are the model's module names")
        else:
            if block is None or block != previous:
                block_index += 1
            names.append([f"layers.{block_index}"])
        previous = block
    out = []
    for s, stage in enumerate(plan.stages):
        if stage.start > 0 and owner[stage.start] is not None and owner[stage.start] == owner[stage.start - 1]:
            raise InputError(file, f"stages.{s}", f"starts at layer {stage.start}, inside block {owner[stage.start]} "
                             "(its mixer and MLP are separate layers of a split-blocks profile)",
                             "torchtitan splits a model at module boundaries: tune from a profile without "
                             "--split-blocks, or move the boundary to the block's end")
        fqns: list[str] = []
        for layer in stage.layers:
            fqns.extend(name for name in names[layer] if name not in fqns)
        out.append(fqns)
    if style == "llama":
        # the model has them whether or not the profile timed them: a module no stage names is
        # dropped, and the first stage would take token ids, the last give no logits
        kinds = {layer.kind for layer in profile.layers}
        if "embedding" not in kinds:
            out[0].insert(0, "tok_embeddings")
        if "head" not in kinds:
            out[-1].extend(["norm", "output"])
    return out


@dataclass(frozen=True)
class TorchtitanExport:
    placement: str  # "loop" or "v"
    schedule_name: str  # pipeline_parallel_schedule: a name that yields that placement
    fqns: tuple[tuple[str, ...], ...]
    rows: tuple[tuple[str, ...], ...]  # the CSV's rows

    def toml(self, *, plan: Plan, microbatch_size: int, csv_path: str, title: str) -> str:
        """The settings as a torchtitan TOML fragment."""
        fqns = ",\n".join(f"    [{', '.join(_toml_string(name) for name in stage)}]" for stage in self.fqns)
        local_batch = microbatch_size * plan.microbatches
        lines = [
            f"# {_toml_comment(title)}",
            f"# {plan.num_stages} stages in a {'V' if self.placement == 'v' else 'loop'} on {plan.pp} pipeline ranks, "
            f"{plan.microbatches} microbatches of {microbatch_size}",
            "[parallelism]",
            f"pipeline_parallel_degree = {plan.pp}",
            f"# only decides where stages go ({self.placement} placement); the CSV sets the order",
            f"pipeline_parallel_schedule = {_toml_string(self.schedule_name)}",
            f"pipeline_parallel_schedule_csv = {_toml_string(csv_path)}",
            f"pipeline_parallel_microbatch_size = {microbatch_size}",
            "module_fqns_per_model_part = [",
            fqns,
            "]",
            "",
            "[training]",
            f"# {plan.microbatches} microbatches = local_batch_size / pipeline_parallel_microbatch_size",
            f"local_batch_size = {local_batch}",
        ]
        if plan.parallel.dp > 1:
            lines[4:4] = [f"# dp {plan.parallel.dp}: torchtitan shards it with FSDP by default (data_parallel_shard_degree "
                          "= -1, reduce-scatters and all-gathers); the plan priced one gradient all-reduce per stage"]
        mode = checkpoint_mode(plan)
        if mode is not None:  # else the stages recompute unlike each other: the export's note says so
            lines += ["", "[activation_checkpoint]",
                      "# as the plan: torchtitan's presets recompute (selective or full) by default",
                      f"mode = {_toml_string(mode)}"]
        return "\n".join(lines) + "\n"


def checkpoint_mode(plan: Plan) -> str | None:
    """torchtitan's one ``activation_checkpoint.mode`` for every model part: ``none`` where no
    stage recomputes, ``full`` where every stage recomputes all its layers, None otherwise (it
    has no setting per stage)."""
    whole = [stage.recompute and (stage.recompute_layers is None or stage.recompute_layers >= stage.end - stage.start)
             for stage in plan.stages]
    if not any(stage.recompute for stage in plan.stages):
        return "none"
    return "full" if all(whole) else None


def _toml_string(text: str) -> str:
    """``text`` as a TOML basic string. JSON's escapes are TOML's but for characters beyond the
    Basic Multilingual Plane, which JSON writes as two surrogate escapes and TOML refuses: those
    are written as themselves, and DEL (which TOML wants escaped, JSON does not) as its escape."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def _toml_comment(text: str) -> str:
    """``text`` fit for a TOML comment: one line, and the control characters TOML refuses there
    (all but tab) written as their escapes."""
    return "".join(c.encode("unicode_escape").decode("ascii") if (ord(c) < 0x20 and c != "\t") or c == "\x7f" else c
                   for c in one_line(text))


def torchtitan_export(plan: Plan, profile: Profile, *, style: str = "llama", file: str = "<plan>") -> TorchtitanExport:
    """``plan`` as torchtitan settings; :class:`InputError` (naming the placement torchtitan
    needs) for a plan it would place otherwise."""
    check_structure(plan, file=file, num_layers=profile.num_layers)
    placement = torchtitan_placement(plan)
    if placement is None and plan.pp == 1:
        raise InputError(file, "stages", f"are {plan.num_stages} on one pipeline rank (pp 1): torchtitan builds no "
                         "pipeline at pp 1, so it runs the model as one stage, not as the plan's",
                         "octoplan tune --runs-on loop finds the best plan torchtitan runs (at pp 1: one stage)")
    if placement is None:
        ranks = ", ".join(str(s.rank) for s in plan.stages)
        raise InputError(file, "stages", f"are placed on ranks [{ranks}]; torchtitan places stage s on rank s mod pp "
                         f"(a loop, the same stage count on every rank) or, for ZB-V and DualPipeV, in a V "
                         f"of exactly two stages per rank (rank r holds r and {2 * plan.pp - 1}-r), and would run "
                         "these stages on other ranks than the plan's",
                         "octoplan tune --runs-on loop (or --runs-on v) finds the best plan of that placement")
    if not plan.parallel.runs_in_order(TORCHTITAN_RANK_ORDER, plan.cluster):
        cluster = plan.cluster
        raise InputError(file, "parallel.rank_order", f"is {plan.parallel.rank_order} with dp {plan.parallel.dp} on "
                         f"{plan.pp * plan.parallel.dp} GPUs of {cluster.gpus_per_node} a node: torchtitan's device "
                         "mesh puts pp outermost, so a stage's replicas take consecutive ranks (dp-inner) and its "
                         "pipelines would share nodes otherwise than the plan's",
                         "octoplan tune --runs-on loop (or --runs-on v) plans in torchtitan's rank order")
    fqns = module_fqns(plan, profile, style=style, file=file)
    rows = torch_csv_rows(plan, file=file)
    # the name's only effect is the placement: ZB-V's V, or a loop of one or several stages per rank
    name = "ZBVZeroBubble" if placement == "v" else ("Interleaved1F1B" if plan.num_stages > plan.pp else "1F1B")
    return TorchtitanExport(placement, name, tuple(map(tuple, fqns)), tuple(map(tuple, rows)))


def csv_path_for(path: str | Path) -> Path:
    """Where the schedule CSV goes beside the settings file ``path``: the same name, ``.csv``."""
    return Path(path).with_suffix(".csv")


def export_torchtitan(plan: Plan, profile: Profile, path: str | Path, *, style: str = "llama",
                      file: str = "<plan>") -> tuple[TorchtitanExport, Path]:
    """Write the torchtitan settings to ``path`` (TOML) and the schedule CSV beside it
    (:func:`csv_path_for`); nothing is written when it raises. Returns the export and the
    CSV's path."""
    csv_path = csv_path_for(path)
    check_distinct({"-o": path, "the schedule CSV": csv_path})
    try:  # the settings name the CSV by its path, and a TOML file is UTF-8
        str(csv_path).encode("utf-8")
    except UnicodeEncodeError:
        raise InputError(one_line(str(path)), "-o", "is not a UTF-8 path, which the settings could not name the CSV by",
                         "give -o a path of UTF-8 characters") from None
    export = torchtitan_export(plan, profile, style=style, file=file)
    from octoplan.export import export_torch_csv

    text = export.toml(plan=plan, microbatch_size=profile.microbatch_size, csv_path=str(csv_path),
                       title=f"torchtitan settings for {file} (octoplan export --format torchtitan)")
    export_torch_csv(plan, csv_path, file=file)
    try:
        write_text(path, text, flag="-o")
    except InputError:
        csv_path.unlink(missing_ok=True)  # the settings name the CSV: one without the other is half an export
        raise
    return export, csv_path
