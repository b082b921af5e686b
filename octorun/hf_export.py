"""An octorun checkpoint of an ``hf:`` model written back as a transformers model folder.

Training an ``hf:FOLDER`` model with octorun leaves DCP checkpoints keyed by chain layer
(``model/layers.3.model.layers.2.mlp.down_proj.weight``: octorun.checkpoint). What serves,
evaluates or fine-tunes the result elsewhere reads a folder as ``from_pretrained`` does. This
module builds that folder from a plan of the model (which names the model folder and its
``--config``) and a checkpoint of any plan of it:

1. every chain layer is built as octorun builds it (no weights read from the model folder: the
   checkpoint holds them all), tied parameters made one, and the checkpoint loaded into them
   with octorun's own checks (files intact, every key of the model present, shapes and dtypes
   equal: a checkpoint of another model or config is refused before a value is read);
2. a chain layer's parameters are named as in the whole transformers model (octoplan.hf.layer),
   so they are assigned to the whole model under their own names, without a copy;
3. transformers' ``save_pretrained`` writes the weights: it undoes its own load-time conversions
   (a MoE's per-expert matrices stacked into one are written one per expert again), leaves out
   tied copies, shards large models and writes config.json with the config the plan trained
   (its ``--config`` overrides included);
4. the model folder's other files (tokenizer, processor, chat template) are copied beside them.

The folder is written under a temporary name and renamed when complete (an empty folder given
is filled, config.json last), so an interrupted export leaves no folder that ``from_pretrained``
would half read.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from octoplan.errors import InputError
from octoplan.outputs import make_folders, new_file_mode, remove_empty
from octoplan.hf import chain_for, is_hf_source, load_hf_model, resolve_hf_source
from octoplan.plan import Plan
from octorun import checkpoint
from octorun.runtime import model_identity
from octorun.weights_export import DTYPES, check_same_config, load_checkpoint_layers

__all__ = ["DTYPES", "ExportedWeights", "export_hf"]

# the model folder's files copied beside the weights: tokenizers, processors, chat templates and
# generation settings (an allow-list: what else a folder holds may be stale weights or state)
_COPIED = ("tokenizer*", "tekken.json", "vocab*", "merges.txt", "spiece.model", "sentencepiece*.model", "special_tokens_map.json",
           "added_tokens.json", "chat_template*", "*preprocessor_config.json", "processor_config.json",
           "generation_config.json")


@dataclass(frozen=True)
class ExportedWeights:
    folder: Path
    checkpoint: Path
    step: int  # the checkpoint's next step (the steps it has trained)
    tensors: int  # in the written safetensors files
    bytes: int
    dtype: str
    copied: tuple[str, ...]  # the model folder's other files, copied


def _output_folder(output: Path, *, model_folder: Path, checkpoint_path: Path | None = None) -> Path:
    """The folder ``-o output`` names, absolute (a link followed); refused where it is a file, a
    link to nothing, a folder that holds anything (its old weight files would be read beside the
    new ones), the model folder, inside a checkpoint, or under a file."""
    flag, given = "-o", str(output)
    if output.is_symlink() and not output.exists():
        raise InputError(given, flag, "is a symbolic link to nothing", "give a folder, or link to an existing one")
    target = output.resolve() if output.is_symlink() else Path(os.path.abspath(output))
    if target.exists() and not target.is_dir():
        raise InputError(given, flag, "is a file: --format hf writes a model folder", "give a new folder")
    if target.is_dir() and any(target.iterdir()):
        raise InputError(given, flag, "is a folder that is not empty: from_pretrained would read its old "
                         "files beside the new ones", "give a new or empty folder")
    above = next((parent for parent in target.parents if parent.exists()), None)
    if above is not None and not above.is_dir():
        raise InputError(given, flag, f"lies under {above}, which is a file", "give a folder path")
    if target.resolve() == model_folder.resolve():
        raise InputError(given, flag, "is the plan's model folder", "give a new folder")
    if checkpoint_path is not None and target.resolve().is_relative_to(checkpoint_path.resolve()):
        raise InputError(given, flag, "is inside the checkpoint", "give a folder outside it")
    return target


def export_hf(plan: Plan, plan_path: Path, checkpoint_spec: str, output: Path, *, dtype: str | None = None) -> ExportedWeights:
    """Write the checkpoint at ``checkpoint_spec`` (a checkpoint folder, or a folder of them: its
    newest) of ``plan``'s ``hf:`` model as a transformers model folder at ``output``.
    ``dtype``: a key of :data:`DTYPES`; None: the model folder's own (config.json's ``dtype``),
    else float32, the dtype octorun trains its parameters in."""
    source = plan.model.source
    if not is_hf_source(source):
        what = f"is {source!r}, not an hf:FOLDER model" if source else "is missing (an analytic plan has no model)"
        raise InputError(str(plan_path), "model.source", f"{what}: --format hf writes transformers weights",
                         "give a plan of an hf: model; --format safetensors writes a model file's checkpoint")
    found = resolve_hf_source(source, plan_path)
    if found is None:
        raise InputError(str(plan_path), "model.source", f"model folder {source!r} not found",
                         "run from the project folder or fix the path")
    if dtype is not None and dtype not in DTYPES:
        raise InputError(None, "--dtype", f"is {dtype!r}", f"use one of {', '.join(DTYPES)}")
    model_folder = Path(found.removeprefix("hf:"))
    path = checkpoint.resolve(checkpoint_spec, save_root=None, flag="--checkpoint")
    target = _output_folder(output, model_folder=model_folder, checkpoint_path=path)

    config = {**plan.model.config, "weights": "none"}  # every weight comes from the checkpoint
    model = load_hf_model(found, config)
    num_layers = model.num_layers()
    meta = checkpoint.read_meta(path)
    checkpoint.check_compatible(meta, model_identity(model, num_layers), path, weights_only=True, flag="--checkpoint",
                                ours="the plan's")
    check_same_config(meta, plan.model.config, model.resolved_config(), path)
    partial = target.with_name(f".{target.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:  # now, not after the work: a folder that cannot be written fails first
        made = make_folders(partial)  # removed again on failure
    except OSError as exc:
        raise InputError(str(output), "-o", f"cannot be written: {exc.strerror or exc}", "give a folder you can write") from None
    done = False
    try:
        layers = load_checkpoint_layers(model, path)
        chain = chain_for(found, model.config)
        whole = _whole_model(chain, layers)
        folder_config = _folder_config(model_folder)
        _restore_router_loss(whole, folder_config, plan.model.config)
        # the plan's --config dtype=... (or its older name torch_dtype) where given, as config.json
        # then says, else the folder's
        named = next((source.get(key) for source in (plan.model.config, folder_config) for key in ("dtype", "torch_dtype")
                      if source.get(key)), None)
        out_dtype = DTYPES[dtype] if dtype is not None else DTYPES.get(named, torch.float32)
        whole.to(out_dtype)
        whole.save_pretrained(partial, safe_serialization=True)
        copied = _copy_other_files(model_folder, partial)
        _readable_as_the_umask_says(partial)
        tensors, nbytes = _written(partial)
        if target.is_dir():  # empty (checked), and perhaps a shell's working folder: kept, filled
            # config.json last: from_pretrained refuses a folder without it, never half reads one
            for file in sorted(partial.iterdir(), key=lambda f: f.name == "config.json"):
                file.rename(target / file.name)
        else:
            partial.rename(target)
        done = True
    finally:
        shutil.rmtree(partial, ignore_errors=True)
        if not done:  # refused or failed: nothing of the export stays, the folders it made included
            remove_empty(made)
    return ExportedWeights(output, path, int(meta["step"]), tensors, nbytes, str(out_dtype).removeprefix("torch."), copied)


def _whole_model(chain, layers: dict[int, torch.nn.Module]) -> torch.nn.Module:
    """The whole transformers model holding the layers' own tensors (none copied)."""
    whole = copy.deepcopy(chain.meta)
    tied_targets = set(getattr(whole, "all_tied_weights_keys", {}))
    values = {name: tensor for layer in layers.values() for name, tensor in layer.state_dict().items()
              if name not in tied_targets}
    missing, unexpected = whole.load_state_dict(values, strict=False, assign=True)
    left = sorted(set(missing) - tied_targets)
    if left or unexpected:  # every parameter is in exactly one chain layer (octoplan.hf.chain checks)
        raise AssertionError(f"chain layers and the whole model disagree: missing {left[:3]}, unexpected {unexpected[:3]}")
    whole.tie_weights()
    # buffers outside the state dict (rotary frequencies, an embedding's scale) are still on the
    # meta device: each is taken from a layer's shell that holds its module (initialized there)
    shells = [layer._shell for layer in layers.values()]
    for name, buffer in list(whole.named_buffers()):
        if buffer.is_meta:
            owner, _, attr = name.rpartition(".")
            found = next((b for shell in shells if (b := _buffer(shell, name)) is not None), None)
            if found is None:
                raise AssertionError(f"no chain layer holds the buffer {name}")
            whole.get_submodule(owner)._buffers[attr] = found.clone()
    return whole


def _buffer(shell: torch.nn.Module, name: str) -> torch.Tensor | None:
    """``shell``'s buffer ``name`` where the shell holds its module (not an absent stand-in)."""
    try:
        buffer = shell.get_buffer(name)
    except AttributeError:
        return None
    return None if buffer.is_meta else buffer


def _folder_config(model_folder: Path) -> dict:
    """The model folder's config.json as written (no --config overrides)."""
    try:
        saved = json.loads((model_folder / "config.json").read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    return saved if isinstance(saved, dict) else {}


def _restore_router_loss(whole: torch.nn.Module, folder_config: dict, overrides: dict) -> None:
    """``output_router_logits`` as the folder (or the plan's --config) gives it: the chain turns it
    off for the pipeline's loss (octoplan.hf.chain), which is octorun's business, not the model's."""
    text = folder_config.get("text_config") if isinstance(folder_config.get("text_config"), dict) else folder_config
    for config, given in ((whole.config, folder_config), (whole.config.get_text_config(), text)):
        wanted = overrides.get("output_router_logits", given.get("output_router_logits"))
        if wanted is not None and hasattr(config, "output_router_logits"):
            config.output_router_logits = wanted


def _copy_other_files(model_folder: Path, target: Path) -> tuple[str, ...]:
    """The model folder's tokenizer, processor, chat-template and generation files, copied into
    ``target`` (its generation_config.json over the one save_pretrained derives from config.json:
    sampling settings, extra end-of-sequence ids); their names. Nothing else: other files may be
    the untrained weights in another format, a trainer's state or an adapter's config."""
    copied = []
    for entry in sorted(model_folder.iterdir()):
        if entry.is_file() and any(fnmatch.fnmatchcase(entry.name, pattern) for pattern in _COPIED):
            shutil.copy2(entry, target / entry.name)
            copied.append(entry.name)
    return tuple(copied)


def _readable_as_the_umask_says(folder: Path) -> None:
    """Every file in ``folder`` with the permissions a new file gets (safetensors writes its own
    files readable by their owner alone)."""
    for file in folder.iterdir():
        if file.is_file():
            file.chmod(new_file_mode())


def _written(folder: Path) -> tuple[int, int]:
    """Tensors and bytes of the safetensors files in ``folder``."""
    from safetensors import safe_open

    tensors = nbytes = 0
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            tensors += len(list(handle.keys()))
        nbytes += file.stat().st_size
    return tensors, nbytes
