"""A chain layer's weights from the safetensors files of a checkpoint folder, and only its own.

``safe_open`` maps a file and reads a tensor's bytes only when the tensor is sliced, so every
checkpoint key is offered to transformers' loader as a lazy slice, and the loader slices only
the keys that its conversion rules (renamed keys, per-expert matrices stacked into one) map to
the shell's parameters: a pipeline rank reads its stages' tensors and no others. Each slice
counts the bytes it returns (:attr:`Checkpoint.bytes_read`).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch
from torch import nn

from octoplan.errors import InputError

__all__ = ["Checkpoint"]

INDEX_FILE = "model.safetensors.index.json"  # a sharded checkpoint's map of tensor -> file
SINGLE_FILE = "model.safetensors"
# the other formats transformers' from_pretrained reads, which OctoPipe does not: a folder of only
# these would otherwise train from a seeded init without a word (the weights silently dropped)
UNREAD_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "tf_model.h5", "flax_model.msgpack",
                  "model.ckpt.index")


def _indexed_files(index: Path) -> list[Path]:
    """The files an index's ``weight_map`` names, each once, in order; each must exist."""
    import json

    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
        if not all(isinstance(name, str) and name for name in names):
            raise TypeError("its values must be file names")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise InputError(str(index), "weight_map", f"cannot be read: {type(exc).__name__}: {exc}",
                         "give the index transformers wrote with the safetensors files, or remove it") from None
    files = [index.parent / name for name in names]
    for file in files:
        if not file.is_file():
            raise InputError(str(index), "weight_map", f"names {file.name}, which is not in the folder",
                             "copy the whole checkpoint folder")
    return files


class _CountedSlice:
    """A safetensors slice that adds the bytes of every read to its checkpoint's count."""

    def __init__(self, inner: Any, checkpoint: "Checkpoint"):
        self._inner = inner
        self._checkpoint = checkpoint

    def __getitem__(self, item: Any) -> torch.Tensor:
        # a copy: the slice may be a view of the file's mapping, which an in-place optimizer step
        # would then change for every later read in this process (and its forked children)
        tensor = self._inner[item].clone()
        self._checkpoint._count(tensor.numel() * tensor.element_size())
        return tensor

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class Checkpoint:
    """The safetensors files of one folder, opened lazily."""

    def __init__(self, source: str, files: list[Path]):
        from safetensors import safe_open

        self.source = source
        self.bytes_read = 0
        self._lock = threading.Lock()  # the loader reads from a thread pool
        self._handles = []
        self.slices: dict[str, _CountedSlice] = {}
        self._file_of: dict[str, Path] = {}
        for file in files:
            try:
                handle = safe_open(str(file), framework="pt", device="cpu")
            except Exception as exc:
                raise InputError(str(file), None, f"is not a readable safetensors file: {exc}", "replace the file") from None
            self._handles.append(handle)
            for key in handle.keys():
                if key in self.slices:  # two copies: which one the model got would hang on the file names
                    raise InputError(str(file), key, f"is also in {self._file_of[key].name}",
                                     "keep one copy of each tensor, or list the files to read in "
                                     f"{INDEX_FILE} as transformers writes it")
                self.slices[key] = _CountedSlice(handle.get_slice(key), self)
                self._file_of[key] = file

    @classmethod
    def of_folder(cls, source: str, folder: Path) -> "Checkpoint | None":
        """The files transformers' ``from_pretrained`` reads: ``model.safetensors``, else those
        ``model.safetensors.index.json`` names; a folder with neither, every ``*.safetensors``
        in it (None where there is none). :class:`InputError` for a folder whose weights are in
        another format only (``pytorch_model.bin``): reading none of them is not an answer."""
        if (folder / SINGLE_FILE).is_file():
            return cls(source, [folder / SINGLE_FILE])
        index = folder / INDEX_FILE
        if index.is_file():
            return cls(source, _indexed_files(index))
        files = sorted(folder.glob("*.safetensors"))
        if files:
            return cls(source, files)
        unread = [name for name in UNREAD_WEIGHTS if (folder / name).exists()]
        if unread:
            raise InputError(str(folder / unread[0]), None, "holds the model's weights in a format OctoPipe does not "
                             "read (it reads safetensors files), so training would start from a seeded init",
                             "convert them: AutoModelForCausalLM.from_pretrained(FOLDER).save_pretrained(FOLDER) writes "
                             "model.safetensors; or give --config weights=none for the seeded init")
        return None

    def _count(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_read += nbytes

    def load(self, shell: nn.Module, *, label: str, tied: dict[str, str], full_names: dict[str, str]) -> None:
        """Fill ``shell``'s parameters (and persistent buffers) from the checkpoint.

        ``tied`` maps a tied parameter transformers does not save (``lm_head.weight``) to the one
        it is (``model.embed_tokens.weight``); ``full_names`` maps a parameter name of the full
        model to the checkpoint key it is stored under, for those.
        """
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig

        load_config = LoadStateDictConfig(weight_mapping=get_model_conversion_mapping(shell))
        try:
            info, _ = convert_and_load_state_dict_in_model(shell, dict(self.slices), load_config)
        except Exception as exc:
            raise InputError(self.source, label, f"loading its weights failed: {_one_line(exc)}",
                             "check the safetensors files against config.json") from None
        if info.mismatched_keys:
            name, found, expected = sorted(info.mismatched_keys, key=str)[0]
            raise InputError(self.source, label, f"the safetensors files hold {name} of shape {tuple(found)}, "
                             f"but config.json makes it {tuple(expected)}",
                             "give the config.json of these weights (or --config weights=none for a seeded init)")
        if info.conversion_errors:
            name, text = sorted(info.conversion_errors.items())[0]
            raise InputError(self.source, label, f"converting {name} failed: {' '.join(str(text).split())[:300]}",
                             "check the safetensors files against config.json")
        params = dict(shell.named_parameters())
        for name in sorted(info.missing_keys):
            if name in tied and tied[name] in full_names:
                self._load_tied(shell, params[name], name, full_names[tied[name]], label)
            elif name in params:
                raise InputError(self.source, label, f"{name} is not in the safetensors files",
                                 "give the whole checkpoint (or --config weights=none for a seeded init)")

    def _load_tied(self, shell: nn.Module, param: torch.Tensor, name: str, key: str, label: str) -> None:
        value = self.slices[key][...]
        if tuple(value.shape) != tuple(param.shape):
            raise InputError(self.source, label, f"the safetensors files hold {key} (tied to {name}) of shape "
                             f"{tuple(value.shape)}, but config.json makes it {tuple(param.shape)}",
                             "give the config.json of these weights")
        with torch.no_grad():
            param.copy_(value.to(param.dtype))


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if len(text) > 300:
        text = text[:297] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
