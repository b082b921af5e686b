"""``hf:FOLDER``: a Hugging Face transformers model used where a model file is (docs/FORMATS.md
section 4), read from a folder holding its ``config.json`` and, optionally, its safetensors files.

:func:`load_hf_model` returns a :class:`octoplan.modelfile.ModelFile` whose module implements
the model-file contract for the model (:mod:`octoplan.hf.chain` builds the chain, and
:mod:`octoplan.hf.weights` reads each layer's weights), so that the profiler, the planner and
octorun use it unchanged. Its config (the profile's and plan's ``model.config``) holds:

- ``seq``: tokens per sample (default 32; for a VLM, the text tokens after the image's);
- ``weights``: ``auto`` (the folder's safetensors files, else a seeded init) or ``none``;
- ``layers`` and ``hidden``: the language model's ``num_hidden_layers`` and ``hidden_size``;
- any other field of config.json by its name (``a.b``: field ``b`` of sub-config ``a``), to
  profile a shrunken copy of a model.

transformers is optional (``pip install -e '.[hf]'``); it is imported only here.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from octoplan.errors import InputError

__all__ = ["PREFIX", "is_hf_source", "load_hf_model", "model_source_files", "resolve_hf_source", "chain_for"]

PREFIX = "hf:"


def is_hf_source(source: Any) -> bool:
    return isinstance(source, str) and source.startswith(PREFIX)


def resolve_hf_source(source: str, file: str | Path) -> str | None:
    """A plan's ``hf:FOLDER`` source with FOLDER found as other written paths are (as written,
    else relative to the plan's folder or the one above it); None if no such folder exists."""
    from octoplan.plan import resolve_written_path

    found = resolve_written_path(source[len(PREFIX):], file)
    return None if found is None or not found.is_dir() else PREFIX + str(found)


def model_source_files(source: str | Path) -> tuple[Path, ...]:
    """The files a model source is read from, which no output may overwrite: a model file, or
    every file of an ``hf:FOLDER`` (its config.json, safetensors and tokenizer files)."""
    if not is_hf_source(str(source)):
        return (Path(source),)
    try:
        return tuple(entry for entry in Path(str(source)[len(PREFIX):]).iterdir() if entry.is_file())
    except OSError:  # no such folder: the command says so when it reads the model
        return ()


def _folder(source: str) -> Path:
    text = source[len(PREFIX):]
    if not text:
        raise InputError(source, None, "names no folder", "write hf:FOLDER, a folder holding config.json")
    return Path(text)


@functools.lru_cache(maxsize=8)
def _chain(source: str, folder: str, frozen: tuple) -> Any:
    from octoplan.hf.chain import HFChain

    return HFChain(source, Path(folder), dict(frozen))


def chain_for(source: str, config: dict[str, Any]) -> Any:
    """The (per process, cached) :class:`~octoplan.hf.chain.HFChain` of ``source`` under ``config``."""
    frozen = tuple(sorted(config.items(), key=lambda item: item[0]))
    return _chain(source, str(_folder(source).resolve()), frozen)


@functools.lru_cache(maxsize=8)
def _checkpoint(source: str, folder: str) -> Any:
    from octoplan.hf.weights import Checkpoint

    return Checkpoint.of_folder(source, Path(folder))


def load_hf_model(source: str, config: dict[str, Any] | None = None, *, seed: int = 0):
    """``hf:FOLDER`` as a :class:`~octoplan.modelfile.ModelFile` (checked: transformers builds
    the model, its family has a chain). ``config`` overrides fields (module docstring)."""
    from octoplan.hf.chain import DEFAULT_SEQ
    from octoplan.modelfile import ModelFile

    merged = {"seq": DEFAULT_SEQ, **(config or {})}
    chain = chain_for(source, merged)  # every check happens here, once
    folder = str(_folder(source).resolve())
    if merged.get("weights", "auto") == "auto":
        checkpoint = _checkpoint(source, folder)  # which weight files it holds: a folder it cannot read is refused now
        if checkpoint is not None:
            _check_tied_as_stored(source, chain, checkpoint)
    return ModelFile(path=source, module=_contract(source, folder, chain), config=merged, seed=seed)


def _contract(source: str, folder: str, chain: Any) -> SimpleNamespace:
    """The model-file functions of ``chain``. They take the config as model files do, and look
    the chain up by it, so a ModelFile whose config changes rebuilds it."""
    import torch
    import torch.nn.functional as F

    def resolved(config: dict[str, Any]) -> Any:
        return chain_for(source, config)

    def num_layers(**config: Any) -> int:
        return len(resolved(config).pieces)

    def layer_kind(index: int, **config: Any) -> str:
        return resolved(config).pieces[index].kind

    def layer_name(index: int, **config: Any) -> str:
        return resolved(config).pieces[index].name

    def build_layer(index: int, **config: Any) -> torch.nn.Module:
        from octoplan.hf.layer import ChainLayer

        model = resolved(config)
        if not 0 <= index < len(model.pieces):
            raise IndexError(f"layer {index} out of range 0..{len(model.pieces) - 1}")
        shell = model.shell(index)
        checkpoint = _checkpoint(source, folder) if config.get("weights", "auto") == "auto" else None
        read = 0
        if checkpoint is not None:
            before = checkpoint.bytes_read
            piece = model.pieces[index]
            tied = {target: src for target, src in getattr(model.meta, "all_tied_weights_keys", {}).items()}
            keys = {src: _checkpoint_key(model, checkpoint, src) for src in tied.values()}
            checkpoint.load(shell, label=f"layer {index} ({piece.name})", tied=tied,
                            full_names={name: key for name, key in keys.items() if key is not None})
            read = checkpoint.bytes_read - before
        model.check_initialized(shell, index)
        layer = ChainLayer(shell, model.pieces[index].role, model.text_base)
        layer.checkpoint_bytes_read = read  # what building this layer read from the safetensors files
        return layer

    def tied_parameters(**config: Any) -> list[list[tuple[int, str]]]:
        return resolved(config).tied

    def sample_batch(microbatch_size: int, generator: torch.Generator, **config: Any) -> tuple[Any, Any]:
        model = resolved(config)
        tokens = _text_tokens(model, microbatch_size, model.seq + 1, generator)
        return _batch(model, tokens, generator)

    def tokens_per_sample(**config: Any) -> int:
        return resolved(config).seq + 1

    def resolved_config(**config: Any) -> dict[str, Any]:
        # transformers' whole config as the --config overrides leave it (``layers=2`` and
        # ``num_hidden_layers=2`` alike), without the fields of its bookkeeping
        whole = resolved(config).config.to_dict()
        return {key: value for key, value in whole.items() if not key.startswith("_") and key != "transformers_version"}

    def vocab_size(**config: Any) -> int:
        return resolved(config).vocab_size

    def batch_from_tokens(tokens: torch.Tensor, **config: Any) -> tuple[Any, Any]:
        model = resolved(config)
        if model.is_vlm:
            raise InputError(source, "batch_from_tokens", "a token file holds no images for this vision-language model",
                             "train it on sample_batch's synthetic images (drop --data)")
        return _batch(model, tokens.long(), None)

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # transformers' causal-LM loss: float logits, the mean over every token not ignored (-100)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)

    return SimpleNamespace(
        NAME=f"hf-{Path(folder).name}", num_layers=num_layers, build_layer=build_layer, sample_batch=sample_batch,
        loss_fn=loss_fn, layer_kind=layer_kind, layer_name=layer_name, tied_parameters=tied_parameters,
        tokens_per_sample=tokens_per_sample, vocab_size=vocab_size, batch_from_tokens=batch_from_tokens,
        resolved_config=resolved_config, __name__=f"hf:{folder}",
    )


def _text_tokens(model: Any, count: int, length: int, generator: Any) -> Any:
    """Token ids below the vocabulary, never the image placeholder of a VLM."""
    import torch

    image = getattr(model.config, "image_token_id", None) if model.is_vlm else None
    high = model.vocab_size - (1 if image is not None and 0 <= image < model.vocab_size else 0)
    tokens = torch.randint(0, high, (count, length), generator=generator)
    if image is not None and 0 <= image < model.vocab_size:
        tokens += (tokens >= image).long()  # skip the placeholder id
    return tokens


def _batch(model: Any, tokens: Any, generator: Any) -> tuple[Any, Any]:
    """Inputs and next-token targets of token windows; a VLM's inputs start with an image."""
    import torch

    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    if not model.is_vlm:
        return inputs, targets
    vision = model.config.vision_config
    patches = (vision.image_size // vision.patch_size) ** 2
    if getattr(model.config, "vision_feature_select_strategy", "default") == "full":
        patches += 1  # the CLS token is kept
    count = inputs.shape[0]
    pixels = torch.randn(count, vision.num_channels, vision.image_size, vision.image_size, generator=generator)
    placeholders = torch.full((count, patches), model.config.image_token_id, dtype=torch.long)
    ignored = torch.full((count, patches), -100, dtype=torch.long)  # no loss on image positions
    return (pixels, torch.cat([placeholders, inputs], 1)), torch.cat([ignored, targets], 1)


def _check_tied_as_stored(source: str, model: Any, checkpoint: Any) -> None:
    """config.json ties the head to the embedding (``tie_word_embeddings``), yet the folder
    stores a head of other values: transformers then keeps the two apart (with a warning), and
    OctoPipe, which ties by the config, would train another model than ``from_pretrained`` loads
    and export without the stored head. Refused; a stored copy of equal values is taken."""
    import torch

    for target, tied_to in sorted(getattr(model.meta, "all_tied_weights_keys", {}).items()):
        stored, kept = _checkpoint_key(model, checkpoint, target), _checkpoint_key(model, checkpoint, tied_to)
        if stored is None or kept is None:
            continue
        if not torch.equal(checkpoint.slices[stored][...], checkpoint.slices[kept][...]):
            raise InputError(f"{_folder(source) / 'config.json'}", "tie_word_embeddings",
                             f"ties {target} to {tied_to}, but the folder's safetensors hold a {stored} of other values "
                             "(transformers keeps the two apart)",
                             f"set tie_word_embeddings to false to train them apart, or remove {stored} from the folder")


def _checkpoint_key(model: Any, checkpoint: Any, name: str) -> str | None:
    """The checkpoint key a parameter of the full model is stored under (a plain rename only)."""
    if name in checkpoint.slices:
        return name
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    mapping = get_model_conversion_mapping(model.meta)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    state = model.meta.state_dict()
    for key in checkpoint.slices:
        renamed, pattern = rename_source_key(key, renamings, converters, model.meta.base_model_prefix, state)
        if renamed == name and pattern is None:
            return key
    return None
