"""A Hugging Face transformers model as a chain of layers, built from transformers' own modules.

The chain follows the pipeline plan transformers declares for the model (its config's
``base_model_pp_plan``: ``embed_tokens`` -> each of ``layers`` -> ``norm``, then the causal-LM
class's ``lm_head``), and, for a LLaVA-style vision-language model, puts the vision tower and the
projector in front of it:

    [vision_tower, multi_modal_projector,]  embed_tokens,  layers.0 .. layers.N-1,  norm + lm_head

Each chain layer is a *shell*: a copy of the whole transformers model in which every module the
layer does not hold is an identity, so that running it is running transformers' own forward.
That forward computes what the decoder layers need beside the hidden states exactly as the
model always does: position ids, the rotary (cos, sin), one attention mask per layer type
(sliding and full attention, or none for linear-attention layers), Gemma's logit soft-capping in
the head, LLaVA's scatter of image features into the text embeddings. Only the hidden states
(and, before the embedding of a VLM, the token ids) cross from one layer to the next; the rest is
recomputed in each layer from them, as the model's forward computes it once: a few element-wise
ops per layer, and nothing that needs a gradient or a message between stages.

The models are built on the meta device (no memory) once per process; a layer's shell is copied
from it, given real storage, initialized by the model's own ``_init_weights`` under the seed
the caller set, and filled from the checkpoint where one is given (:mod:`octoplan.hf.weights`).
"""

from __future__ import annotations

import copy
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from octoplan.errors import InputError, shown

__all__ = ["Piece", "HFChain", "VERIFIED_MODEL_TYPES", "DEFAULT_SEQ"]

# Model types whose chain has been checked against transformers' own forward, loss and gradients
# (tests/test_hf.py). Others with a pipeline plan are refused rather than guessed: a base model
# whose forward does more than embed -> layers -> norm (per-layer embeddings, deep-stacked vision
# features) would run here without error and compute something else.
VERIFIED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "mixtral", "qwen3_moe", "qwen3_next", "llava")
# the language models a VLM (llava) may hold: the families verified on their own
VERIFIED_TEXT_TYPES = tuple(t for t in VERIFIED_MODEL_TYPES if t != "llava")
# --config fields that name the family (transformers' classes for the weights), not a size
IDENTITY_FIELDS = frozenset({"model_type", "architectures"})
# --config's short names for the language model's fields
SHORT_FIELDS = {"layers": "num_hidden_layers", "hidden": "hidden_size"}
DEFAULT_SEQ = 32

# --config keys of our own (the rest name fields of config.json)
OWN_KEYS = ("seq", "weights", "layers", "hidden")


@dataclass(frozen=True)
class Piece:
    """One chain layer: the modules of the full model it holds, and how it runs."""

    name: str  # the profile's layer name
    kind: str  # the profile's layer kind
    owned: tuple[str, ...]  # module paths in the full transformers model
    role: str  # vision | projector | merge | embed | decoder | head


class _Absent(nn.Module):
    """Stands in for a module another chain layer holds: passes its first input on unused."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if args else next(iter(kwargs.values()))


def _transformers(source: str):
    # a local folder only, never the network: set before huggingface_hub reads it at import
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers
    except ImportError:
        raise InputError(source, None, "hf: models need transformers, which is not installed",
                         "pip install -e '.[hf]'") from None
    # the loader's progress bars and fallback notices would interleave with the CLI's own lines
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def _is_count(field: str) -> bool:
    """A field that counts or sizes something (num_hidden_layers, hidden_size, head_dim): 0 or
    less builds no model, or one with no layers."""
    return field.startswith("num_") or field.endswith("_size") or field == "head_dim"


_ROUTER_LOSS_SAID: set[str] = set()  # the sources _without_router_loss spoke of in this process


def _without_router_loss(source: str, *configs: Any) -> None:
    """Turn off ``output_router_logits`` (a MoE router's load-balancing loss, added to the loss by
    transformers' causal-LM forward): the chain's head sees hidden states only, never the
    routers' logits, so its loss is the language-model loss alone. Said once per process, by
    the launch's rank 0 (or a process outside a launch)."""
    turned_off = False
    for config in configs:
        if getattr(config, "output_router_logits", False):
            config.output_router_logits = False
            turned_off = True
    if turned_off and os.environ.get("RANK", "0") == "0" and source not in _ROUTER_LOSS_SAID:
        _ROUTER_LOSS_SAID.add(source)
        sys.stderr.write(f"octoplan: {source}: output_router_logits is set to false: the routers' load-balancing "
                         "loss is not part of the pipeline's loss (the language-model loss alone)\n")


def _set_field(config: Any, key: str, value: Any, source: str, given_as: str | None = None) -> None:
    """``key`` (``a.b`` reaches into a sub-config) of a transformers config set to ``value``;
    errors name ``--config given_as`` (the key the user gave: ``layers`` for num_hidden_layers)."""
    flag = f"--config {given_as or key}"
    obj = config
    parts = key.split(".")
    for part in parts[:-1]:
        obj = getattr(obj, part, None)
        if obj is None or not hasattr(obj, "to_dict"):
            raise InputError(source, flag, f"{part!r} is not a sub-config of this model",
                             "name a field of config.json (a.b for a field of its sub-config a)")
    field = parts[-1]
    if not hasattr(obj, field):
        raise InputError(source, flag, f"is not a field of this model's config ({type(obj).__name__})",
                         f"name a field of config.json, or one of {', '.join(OWN_KEYS)}")
    old = getattr(obj, field)
    is_int = isinstance(old, int) and not isinstance(old, bool)
    if isinstance(old, bool) != isinstance(value, bool) or (
            isinstance(old, (int, float)) and not isinstance(value, (int, float))) or (is_int and isinstance(value, float)):
        raise InputError(source, flag, f"is {shown(value)} but the config holds {shown(old)}",
                         "give a value of the field's type")
    if is_int and _is_count(field) and value < 1:
        raise InputError(source, flag, f"is {shown(value)}", "give a count or size of at least 1")
    try:
        setattr(obj, field, value)
    except Exception as exc:  # transformers' own check of the field
        raise InputError(source, flag, f"is refused by transformers: {_one_line(exc)}",
                         "give a value the model's config takes") from None
    if field == "num_hidden_layers" and isinstance(getattr(obj, "layer_types", None), list):
        # a shrunken copy keeps the first layers' pattern of sliding, full and linear attention
        types = obj.layer_types
        obj.layer_types = [types[i % len(types)] for i in range(value)] if types else types


class HFChain:
    """The chain of one transformers model directory under one octoplan config."""

    def __init__(self, source: str, directory: Path, config: dict[str, Any]):
        self.source = source
        self.directory = directory
        tf = _transformers(source)
        if not directory.is_dir():
            raise InputError(source, None, f"{directory} is not a folder", "give hf:FOLDER, a folder holding config.json")
        if not (directory / "config.json").is_file():
            raise InputError(source, "config.json", f"not found in {directory}",
                             "give a checkpoint folder, or one holding just the model's config.json")
        self.seq = config.get("seq", DEFAULT_SEQ)
        if not isinstance(self.seq, int) or isinstance(self.seq, bool) or not 1 <= self.seq <= 1_000_000:
            raise InputError(source, "config.seq", f"is {shown(self.seq)}", "give the sequence length as an int from 1")
        weights = config.get("weights", "auto")
        if weights not in ("auto", "none"):
            raise InputError(source, "config.weights", f"is {shown(weights)}",
                             "use auto (the folder's safetensors files if any) or none (a seeded init)")
        try:
            hf_config = tf.AutoConfig.from_pretrained(str(directory), local_files_only=True)
        except Exception as exc:  # transformers' own words on what it cannot read
            raise InputError(source, "config.json", f"transformers {tf.__version__} cannot read it: {_one_line(exc)}",
                             "give a config.json of a model type this transformers knows") from None
        text_config = hf_config.get_text_config()
        for key in config:
            if key.rpartition(".")[2] in IDENTITY_FIELDS:  # at any depth: text_config.model_type too
                # another model type picks other transformers classes for these weights: a Granite
                # as a Llama loses its multipliers, and the export's config.json says granite again
                raise InputError(source, f"--config {key}", "names the model's family, which --config cannot change",
                                 "give a folder whose config.json is of the family you want, or leave it out")
        for short, field in SHORT_FIELDS.items():
            # the language model's field under its own name: top-level, or in a VLM's text_config
            for key in (field, f"text_config.{field}"):
                if short in config and key in config and config[short] != config[key]:
                    raise InputError(source, f"--config {short}", f"is {shown(config[short])} and --config {key} is "
                                     f"{shown(config[key])}: both set the language model's {field}", "give one of them")
        for key, value in config.items():
            if key in ("seq", "weights"):
                continue
            field = SHORT_FIELDS.get(key)
            if field is not None:  # of the language model (get_text_config is the sub-config itself)
                _set_field(text_config, field, value, source, given_as=key)
            else:
                _set_field(hf_config, key, value, source)
        _without_router_loss(source, hf_config, text_config)
        self.model_type = hf_config.model_type
        self.model_class = self._model_class(tf, hf_config)
        plan = getattr(text_config, "base_model_pp_plan", None)
        if not plan:
            raise InputError(source, "config.json", f"transformers {tf.__version__} declares no pipeline plan "
                             f"(base_model_pp_plan) for model type {self.model_type!r} ({self.model_class.__name__}): "
                             "no chain decomposition to follow", "profile it with --arch, or write a model file (docs/FORMATS.md section 4)")
        if self.model_type not in VERIFIED_MODEL_TYPES:
            raise InputError(source, "config.json", f"model type {self.model_type!r} has a pipeline plan, but its chain is "
                             f"not verified against transformers' forward (verified: {', '.join(VERIFIED_MODEL_TYPES)})",
                             "profile it with --arch, or write a model file (docs/FORMATS.md section 4)")
        # a VLM's language model runs in pieces too: its family must be one verified alone
        if text_config is not hf_config and text_config.model_type not in VERIFIED_TEXT_TYPES:
            raise InputError(source, "config.json", f"the language model of this {self.model_type!r} is of model type "
                             f"{text_config.model_type!r}, whose chain is not verified against transformers' forward "
                             f"(verified: {', '.join(VERIFIED_TEXT_TYPES)})",
                             "profile it with --arch, or write a model file (docs/FORMATS.md section 4)")
        if list(plan) != ["embed_tokens", "layers", "norm"]:
            raise InputError(source, "config.json", f"the pipeline plan of {self.model_type!r} is {list(plan)}, not "
                             "embed_tokens, layers, norm", "profile it with --arch, or write a model file")
        try:
            with torch.device("meta"):
                # fp32 parameters whatever config.json's dtype (a checkpoint's bf16 is cast on load):
                # octoplan's precision is fp32 masters, with bf16 only as autocast (octoplan.precision)
                self.meta = self.model_class._from_config(hf_config, dtype=torch.float32)
        except Exception as exc:
            raise InputError(source, "config.json", f"transformers cannot build {self.model_class.__name__} from it: "
                             f"{_one_line(exc)}", "fix the config (or the --config overrides)") from None
        self.config = self.meta.config
        self.text_config = self.config.get_text_config()
        self.vocab_size = self.text_config.vocab_size
        self.pieces = self._pieces()
        self.piece_paths = {path for piece in self.pieces for path in piece.owned}
        held = [name for name, param in self.meta.named_parameters(remove_duplicate=False)
                if not any(name.startswith(path + ".") for path in self.piece_paths)]
        if held:
            raise InputError(source, "config.json", f"{self.model_class.__name__} holds parameters outside its pipeline "
                             f"plan ({held[0]}, ...): no chain decomposition", "profile it with --arch, or write a model file")
        self.tied = self._tied()

    # -- what the chain is --
    def _model_class(self, tf: Any, hf_config: Any) -> type:
        from transformers.models.auto import modeling_auto

        for mapping in (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES):
            name = mapping.get(hf_config.model_type)
            if name and hasattr(tf, name):
                return getattr(tf, name)
        raise InputError(self.source, "config.json", f"model type {hf_config.model_type!r} has no causal-LM or "
                         "image-text-to-text class in transformers", "give a decoder language model or a LLaVA-style VLM")

    @property
    def is_vlm(self) -> bool:
        return self.model_type == "llava"

    def _pieces(self) -> list[Piece]:
        base = "model.language_model" if self.is_vlm else self.meta.base_model_prefix
        self.text_base = base
        pieces = []
        if self.is_vlm:
            pieces.append(Piece("vision_tower", "vision", ("model.vision_tower",), "vision"))
            pieces.append(Piece("multi_modal_projector", "projector", ("model.multi_modal_projector",), "projector"))
            pieces.append(Piece("embed_tokens", "embed", (f"{base}.embed_tokens",), "merge"))
        else:
            pieces.append(Piece("embed_tokens", "embedding", (f"{base}.embed_tokens",), "embed"))
        types = getattr(self.text_config, "layer_types", None)
        for k in range(self.text_config.num_hidden_layers):
            kind = types[k] if isinstance(types, list) and k < len(types) else "decoder"
            pieces.append(Piece(f"layers.{k}", kind, (f"{base}.layers.{k}",), "decoder"))
        pieces.append(Piece("norm+lm_head", "head", (f"{base}.norm", "lm_head"), "head"))
        return pieces

    def _tied(self) -> list[list[tuple[int, str]]]:
        """transformers' tied weights (lm_head.weight is embed_tokens.weight) as chain members."""
        groups = []
        for target, source in sorted(getattr(self.meta, "all_tied_weights_keys", {}).items()):
            groups.append(sorted((self.piece_of(name), name) for name in (source, target)))
        return groups

    def piece_of(self, param_name: str) -> int:
        for index, piece in enumerate(self.pieces):
            if any(param_name.startswith(path + ".") for path in piece.owned):
                return index
        raise InputError(self.source, "config.json", f"tied weight {param_name} is outside the chain",
                         "profile it with --arch, or write a model file")

    # -- building a layer --
    def shell(self, index: int) -> nn.Module:
        """Chain layer ``index``'s shell on the CPU, initialized (not yet loaded)."""
        owned = set(self.pieces[index].owned)
        swapped = []
        for path in sorted(self.piece_paths - owned):
            parent_path, _, name = path.rpartition(".")
            parent = self.meta.get_submodule(parent_path)
            swapped.append((parent, name, parent._modules[name]))
            parent._modules[name] = _Absent()
        try:
            shell = copy.deepcopy(self.meta)
        finally:
            for parent, name, module in swapped:
                parent._modules[name] = module
        shell.to_empty(device="cpu")
        for tensor in [*shell.parameters(), *shell.buffers()]:
            if hasattr(tensor, "_is_hf_initialized"):
                del tensor._is_hf_initialized
            if tensor.is_floating_point():
                tensor.data.fill_(float("nan"))  # whatever init leaves untouched shows itself
        for module in shell.modules():
            if hasattr(module, "_is_hf_initialized"):
                del module._is_hf_initialized
        _initialize(shell, shell)
        return shell

    def check_initialized(self, shell: nn.Module, index: int) -> None:
        for name, tensor in [*shell.named_parameters(), *shell.named_buffers()]:
            if tensor.is_floating_point() and torch.isnan(tensor).any():
                raise InputError(self.source, f"layer {index} ({self.pieces[index].name})", f"{name} is left "
                                 "uninitialized by transformers' _init_weights and not in the checkpoint",
                                 "give a checkpoint holding it")


def _initialize(module: nn.Module, owner: Any) -> None:
    """transformers' own initialization, in its order: children first, each module by the
    ``_init_weights`` of the innermost pretrained model holding it (as ``initialize_weights``)."""
    from transformers import PreTrainedModel

    for child in module.children():
        _initialize(child, child if isinstance(child, PreTrainedModel) else owner)
    owner._init_weights(module)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if len(text) > 300:
        text = text[:297] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
