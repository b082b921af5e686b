"""An octorun checkpoint as one safetensors file of the whole model (``octoplan export --format
safetensors``): the weights of a model file's model, for whatever serves, evaluates or converts
them outside OctoPipe.

A checkpoint is DCP, sharded by rank and keyed by global layer index, a tied parameter once under
its canonical member (octorun.checkpoint). This module builds every layer as octorun does, ties
them, loads the checkpoint into them with octorun's own checks (files intact, every key of the
model there, shapes and dtypes equal: a checkpoint of another model or config is refused before a
value is read), and writes each layer's ``state_dict`` under ``layers.{index}.``: the keys of

    whole = torch.nn.Module(); whole.layers = torch.nn.ModuleList(build_layer(i) for i in range(n))

so ``whole.load_state_dict(safetensors.torch.load_file(FILE))`` takes it strictly. A tied
parameter is written under every member's key (safetensors stores no shared tensors; the values
are equal), and persistent buffers are written as ``state_dict`` has them. The file is written
whole or not at all.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from octoplan.errors import InputError
from octoplan.outputs import check_writable, write_bytes
from octoplan.plan import Plan
from octorun import checkpoint
from octorun.checkpoint import CONFIG_KEYS_APART, config_differences
from octorun.tied import model_state, tie_local, tied_groups

__all__ = ["DTYPES", "ExportedFile", "check_same_config", "export_safetensors", "load_checkpoint_layers"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ExportedFile:
    file: Path
    checkpoint: Path
    step: int  # the checkpoint's next step (the steps it has trained)
    tensors: int
    bytes: int
    dtype: str


def check_same_config(meta: dict, config: dict, resolved: dict, path: Path) -> None:
    """Refuse a plan whose model config differs from the one the checkpoint was trained under,
    beyond ``seq`` and ``weights``, which the weights do not depend on: the export would describe
    the weights with values they were not trained with. The resolved configs are compared where
    the checkpoint records one (``layers=2`` and ``num_hidden_layers=2`` are one config), else
    the ``--config`` overrides as given."""
    saved_resolved = meta.get("resolved_config")
    if isinstance(saved_resolved, dict):
        differences = config_differences(saved_resolved, resolved)
        if differences:
            raise InputError(str(path), "resolved_config", f"the checkpoint's model was trained with {differences[0]}",
                             "export with a plan of the model config the checkpoint was trained with")
        return
    saved = meta.get("model_config")
    if not isinstance(saved, dict):
        return
    ours = {k: v for k, v in config.items() if k not in CONFIG_KEYS_APART}
    theirs = {k: v for k, v in saved.items() if k not in CONFIG_KEYS_APART}
    if ours != theirs:
        key = sorted(set(ours) ^ set(theirs) | {k for k in set(ours) & set(theirs) if ours[k] != theirs[k]})[0]
        raise InputError(str(path), "model_config", f"the checkpoint was trained with --config {key}="
                         f"{theirs.get(key, '(not given)')}, the plan has {ours.get(key, '(not given)')}",
                         "export with a plan of the model config the checkpoint was trained with")


def load_checkpoint_layers(model: Any, path: Path) -> dict[int, torch.nn.Module]:
    """Every layer of ``model`` (a ModelFile) built and tied as octorun builds them, holding the
    checkpoint at ``path``'s parameters and buffers."""
    layers = {index: model.build_layer(index) for index in range(model.num_layers())}
    tied = tie_local(model.path, layers, tied_groups(model), model.build_layer)
    checkpoint.load(path, model_state(layers, tied), group=None, whole_prefixes=("model/",),
                    other_model_fix="give a checkpoint that octorun wrote for this plan's model and --config")
    return layers


def export_safetensors(plan: Plan, plan_path: Path, checkpoint_spec: str, output: Path, *,
                       dtype: str | None = None) -> ExportedFile:
    """Write the checkpoint at ``checkpoint_spec`` (a checkpoint folder, or a folder of them: its
    newest) of ``plan``'s model file as one safetensors file at ``output``. ``dtype``: a key of
    :data:`DTYPES` for the floating-point tensors; None: float32, the dtype octorun trains its
    parameters in."""
    from octoplan.hf import is_hf_source
    from octoplan.modelfile import load_model_file
    from octorun.runtime import model_identity, model_path

    if dtype is not None and dtype not in DTYPES:
        raise InputError(None, "--dtype", f"is {dtype!r}", f"use one of {', '.join(DTYPES)}")
    if is_hf_source(plan.model.source or ""):
        raise InputError(str(plan_path), "model.source", f"is {plan.model.source!r}, a Hugging Face model",
                         "export it with --format hf, which writes a folder from_pretrained reads")
    try:
        from safetensors.torch import save as safetensors_bytes
    except ImportError:
        raise InputError(None, "--format", "safetensors needs the safetensors package",
                         "pip install -e '.[hf]' (or pip install safetensors)") from None
    model = load_model_file(model_path(plan, str(plan_path)), plan.model.config)
    path = checkpoint.resolve(checkpoint_spec, save_root=None, flag="--checkpoint")
    # what the export reads, which writing FILE must not destroy: the model file, and every file of
    # the checkpoint (a file written into its folder would also go when a later run prunes it)
    check_writable(output, "-o", inputs=(model.path,))
    if Path(os.path.abspath(output)).resolve().is_relative_to(path.resolve()):
        raise InputError(str(output), "-o", f"is inside the checkpoint {path}", "give a file outside it")
    meta = checkpoint.read_meta(path)
    checkpoint.check_compatible(meta, model_identity(model, model.num_layers()), path, weights_only=True,
                                flag="--checkpoint", ours="the plan's")
    check_same_config(meta, plan.model.config, model.resolved_config(), path)
    layers = load_checkpoint_layers(model, path)
    out_dtype = DTYPES[dtype or "float32"]
    tensors: dict[str, torch.Tensor] = {}
    stored: set[int] = set()
    for index, layer in sorted(layers.items()):
        for name, value in layer.state_dict().items():
            tensor = value.detach().to(out_dtype) if value.is_floating_point() else value.detach()
            storage = tensor.untyped_storage().data_ptr()
            # a tied parameter's members, a view of another tensor: a copy each, as safetensors keeps no shared storage
            tensors[f"layers.{index}.{name}"] = tensor.clone() if storage in stored else tensor.contiguous()
            stored.add(storage)
    data = safetensors_bytes(tensors, metadata={
        "format": "pt", "model": model.name, "checkpoint": str(path), "step": str(meta["step"]),
        "config": json.dumps(plan.model.config, sort_keys=True)})
    write_bytes(output, data, flag="-o")
    return ExportedFile(output, path, int(meta["step"]), len(tensors), len(data), str(out_dtype).removeprefix("torch."))
