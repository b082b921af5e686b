"""Analytic profiles of real architectures on real GPUs (``octoplan profile --arch NAME --gpu NAME``).

A profile built here is what ``octoplan profile MODEL.py`` would measure, but computed from
public model configs and GPU datasheets with the cost model of :mod:`octoplan.arch.costmodel`
(docs/COST_MODEL.md), so that plans for models far larger than this machine can be tuned and
simulated. Times are per microbatch on one GPU of a tensor-parallel group of ``tp`` GPUs.

Assumptions worth knowing before trusting a number: bf16, flash attention, no activation
recomputation, no overlap of communication with compute, balanced MoE routing, and
``param_bytes`` being what one GPU holds: a MoE layer's experts are sharded over the
expert-parallel group, so it holds experts/ep of them (the bytes held elsewhere, per layer
kind, are in ``profile.extra["cost_model"]["expert_parallel"]``).
"""

from __future__ import annotations

import logging
from typing import Any

from octoplan.arch.architectures import ARCHITECTURES, Arch, Moe
from octoplan.arch.costmodel import ASSUMPTIONS, CostModel, LayerCost
from octoplan.arch.gpus import GPUS, GpuSpec
from octoplan.arch.layers import Shape, block_cost, embedding_cost, head_cost, output_bytes
from octoplan.errors import InputError
from octoplan.profile import MAX_MICROBATCH_SIZE, Layer, ModelRef, Profile, check_layer_limits

__all__ = ["list_architectures", "list_gpus", "analytic_profile", "MAX_TP"]

log = logging.getLogger(__name__)

MAX_TP = 8  # tensor parallelism stays inside one 8-GPU NVLink node


def list_architectures() -> list[tuple[str, str]]:
    """(name, one-line description) of every known architecture."""
    return [(arch.name, arch.description) for arch in ARCHITECTURES.values()]


def list_gpus() -> list[tuple[str, str]]:
    """(name, one-line description) of every known GPU."""
    return [(gpu.name, gpu.description) for gpu in GPUS.values()]


def _whole(value: Any, field: str, *, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InputError(None, field, f"must be a whole number >= {minimum}, got {value!r}", f"pass {field} {minimum} or more")
    if maximum is not None and value > maximum:
        raise InputError(None, field, f"is {value}, more than {maximum}", f"pass {field} {minimum} to {maximum}")
    return value


def _check_tp(arch: Arch, tp: int) -> None:
    tp = _whole(tp, "--tp", minimum=1)
    dims = arch.tp_divisors()
    valid = [t for t in range(1, MAX_TP + 1) if all(d % t == 0 for d in dims.values())]
    if tp > MAX_TP:
        raise InputError(None, "--tp", f"is {tp}, more than the {MAX_TP} GPUs of one NVLink node", f"use one of {valid}")
    bad = [name for name, d in dims.items() if d % tp]
    if bad:
        raise InputError(None, "--tp", f"{tp} does not divide {arch.name}'s {bad[0]} ({dims[bad[0]]})", f"use one of {valid}")


def _shape(arch: Arch, seq_len: int, microbatch_size: int) -> Shape:
    if arch.vision is None:
        return Shape(batch=microbatch_size, seq=seq_len)
    v = arch.vision
    image = v.tiles * v.tokens_per_tile
    if seq_len <= image:
        raise InputError(
            None,
            "--seq-len",
            f"{seq_len} leaves no text after {arch.name}'s {image} image tokens ({v.tiles} tiles x {v.tokens_per_tile})",
            f"use --seq-len > {image}",
        )
    return Shape(
        batch=microbatch_size,
        seq=seq_len,
        vision_seqs=microbatch_size * v.tiles,
        vision_seq=v.positions_per_tile,
        image_tokens=microbatch_size * image,
    )


def _layer(name: str, kind: str, cost: LayerCost, out_bytes: int) -> Layer:
    return Layer(
        name=name,
        kind=kind,
        forward_ms=cost.forward_ms,
        backward_input_ms=cost.backward_input_ms,
        backward_weight_ms=cost.backward_weight_ms,
        param_bytes=2 * (cost.params - cost.remote_expert_params),
        activation_bytes=cost.activation_bytes,
        output_bytes=out_bytes,
        flops=cost.flops,
        pending_w_bytes=cost.pending_w_bytes,
        w_saved_bytes=cost.w_saved_bytes,
    )


def _round(value: float) -> float:
    return float(f"{value:.6g}")


def analytic_profile(
    arch: str,
    gpu: str,
    *,
    seq_len: int | None = None,
    microbatch_size: int | None = None,
    tp: int = 1,
    split_blocks: bool = False,
) -> Profile:
    """The profile of ``arch`` on one ``gpu`` of a ``tp``-way tensor-parallel group.

    seq_len defaults to the architecture's pre-training length, microbatch_size to 1. Unknown
    names or bad values raise :class:`InputError` naming the option and the valid choices.

    ``split_blocks``: every block that has both a mixer (attention, MLA, Mamba) and a
    feed-forward part (MLP, MoE) becomes two layers, ``NAME.mixer`` and ``NAME.ffn`` (kinds
    ``KIND.mixer`` / ``KIND.ffn``), each passing the residual stream on. Their costs add up to the
    block's exactly. A stage boundary may then fall inside a block: at high pp, whole blocks
    cannot balance (llama3-70b on 16 stages: 5 of 80 blocks plus the head on the busiest stage),
    half blocks can, if the model file builds its layers at that granularity too.
    """
    if arch not in ARCHITECTURES:
        raise InputError(None, "--arch", f"unknown architecture {arch!r}", f"use one of: {', '.join(ARCHITECTURES)}")
    if gpu not in GPUS:
        raise InputError(None, "--gpu", f"unknown GPU {gpu!r}", f"use one of: {', '.join(GPUS)}")
    spec: Arch = ARCHITECTURES[arch]
    device: GpuSpec = GPUS[gpu]
    seq = _whole(spec.default_seq_len if seq_len is None else seq_len, "--seq-len", minimum=1)
    # what every reader of the profile allows: a larger one would be written, then refused
    mbs = _whole(1 if microbatch_size is None else microbatch_size, "--microbatch-size", minimum=1, maximum=MAX_MICROBATCH_SIZE)
    _check_tp(spec, tp)
    shape = _shape(spec, seq, mbs)
    model = CostModel(gpu=device, tp=tp)

    costs: list[tuple[str, str, LayerCost, int]] = [
        ("embed", "embedding", embedding_cost(spec, model, shape=shape), output_bytes(spec, None, shape=shape, tp=tp, first=True))
    ]
    for block in spec.blocks:
        out = output_bytes(spec, block, shape=shape, tp=tp)
        if split_blocks and block.mixer is not None and block.ffn is not None:
            for part in ("mixer", "ffn"):
                costs.append((f"{block.name}.{part}", f"{block.kind}.{part}", block_cost(spec, block, model, shape=shape, part=part), out))
        else:
            costs.append((block.name, block.kind, block_cost(spec, block, model, shape=shape), out))
    costs.append(("head", "head", head_cost(spec, model, shape=shape), 4))  # the fp32 loss
    layers = tuple(_layer(name, kind, cost, out) for name, kind, cost, out in costs)
    check_layer_limits(layers, file=None, cause="--seq-len / --microbatch-size",
                       fix=f"use a smaller --seq-len (default {spec.default_seq_len}) or --microbatch-size")
    log.info("analytic profile of %s on %s (tp=%d): %d layers", arch, gpu, tp, len(layers))

    config: dict[str, Any] = {"seq_len": seq, "tp": tp, "hidden_size": spec.hidden, "vocab_size": spec.vocab}
    if split_blocks:
        config["split_blocks"] = True
    moe = next((b.ffn for b in spec.blocks if isinstance(b.ffn, Moe)), None)
    if moe is not None:
        config["ep"] = moe.ep
    if spec.vision is not None:
        config["image_tiles"] = spec.vision.tiles
    return Profile(
        model=ModelRef(name=arch, source=None, config=config),
        layers=layers,
        device={"name": gpu, "memory_gb": device.memory_gb},
        microbatch_size=mbs,
        dtype="bf16",
        extra={"cost_model": _summary(spec, device, costs, tp=tp, moe=moe)},
    )


def _summary(spec: Arch, device: GpuSpec, costs: list[tuple[str, str, LayerCost, int]], *, tp: int, moe: Moe | None) -> dict[str, Any]:
    """What the profile assumed and where its time goes, kept in the profile for readers."""
    kinds: dict[str, dict[str, Any]] = {}
    for name, kind, cost, _ in costs:
        if kind not in kinds:
            kinds[kind] = {"count": 0, "example": name, "breakdown_ms": cost.breakdown}
        kinds[kind]["count"] += 1
    params = sum(cost.params for *_, cost, _ in costs)
    summary: dict[str, Any] = {
        "gpu": device.to_dict(),
        "assumptions": dict(ASSUMPTIONS),
        "sources": list(spec.sources),
        "tied_embeddings": spec.tied_embeddings,
        "totals": {
            "params_per_gpu": params,
            "forward_flops_per_gpu": _round(sum(cost.flops for *_, cost, _ in costs)),
            "forward_ms": _round(sum(cost.forward_ms for *_, cost, _ in costs)),
            "backward_input_ms": _round(sum(cost.backward_input_ms for *_, cost, _ in costs)),
            "backward_weight_ms": _round(sum(cost.backward_weight_ms for *_, cost, _ in costs)),
        },
        "layer_kinds": kinds,
    }
    if spec.vision is not None:
        summary["image_tiles_per_sample"] = spec.vision.tiles
    if moe is not None:
        remote = sum(cost.remote_expert_params for *_, cost, _ in costs)
        elsewhere: dict[str, int] = {}
        for _, kind, cost, _ in costs:
            if cost.remote_expert_params:
                elsewhere[kind] = 2 * cost.remote_expert_params
        summary["expert_parallel"] = {
            "ep": moe.ep,
            "node_limit": moe.node_limit,
            "param_bytes_per_gpu_with_ep": 2 * (params - remote),
            "expert_param_bytes_elsewhere_per_layer": elsewhere,
            "note": "layer param_bytes are what one GPU holds: experts/ep of a MoE layer's experts; "
                    "expert_param_bytes_elsewhere_per_layer (by layer kind) are held by the other ep ranks",
        }
    return summary
