"""The model-file contract of FORMATS.md section 4: loading a ``model.py``, seeding its layers and
drawing its microbatches exactly as every process must, so that the profiler, the runtime and
single-process references all rebuild the same model and data.

Needs torch; the planner imports this module only to profile.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch

from octoplan.errors import MODEL_CODE_FAILURES, InputError, shown, where_raised
from octoplan.inputs import check_input_file

__all__ = [
    "ModelFile",
    "load_model_file",
    "microbatch_seed",
    "forward_seed",
    "as_args",
    "REQUIRED_FUNCTIONS",
]

REQUIRED_FUNCTIONS = ("num_layers", "build_layer", "sample_batch", "loss_fn")
# Far more layers than any model has (a layer per block's mixer and MLP of a 1000-block model
# is 2000); a count beyond it is a mistake that would otherwise profile forever.
MAX_LAYERS = 100_000


def microbatch_seed(*, seed: int, step: int, replica: int, mb: int) -> int:
    """FORMATS.md section 4: the generator seed of microbatch ``mb`` of ``step`` on replica ``replica``."""
    return ((seed * 1_000_003 + step) * 1_009 + replica) * 10_007 + mb


def forward_seed(*, seed: int, step: int, position: int, layer: int) -> int:
    """FORMATS.md section 4: the seed of torch's generators as layer ``layer`` runs its training
    forward on the microbatch at ``position`` of ``step``'s global batch (replica * microbatches
    + mb); an evaluation after step S passes step -(S + 1). A hash rather than a product, so that
    nearby keys (layer 3 of one microbatch, layer 4 of the one before) give unrelated streams;
    63 bits, a seed every generator takes."""
    digest = hashlib.blake2b(f"{seed} {step} {position} {layer}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def as_args(value: Any) -> tuple:
    """A layer's input as positional arguments: a tuple is spread, a tensor is one argument."""
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


@dataclass
class ModelFile:
    path: str
    module: ModuleType
    config: dict[str, Any] = field(default_factory=dict)
    seed: int = 0

    def resolved_config(self) -> dict[str, Any]:
        """The model's whole configuration, as JSON values: a model file's CONFIG with the plan's
        overrides, or a Hugging Face model's transformers config. Checkpoints record it; a resume
        and an export compare it (octorun.checkpoint.config_differences)."""
        import json

        # (a Hugging Face model's own function; a model file's functions are section 4's)
        whole = self.module.resolved_config(**self.config) if self.path.startswith("hf:") else dict(self.config)
        return json.loads(json.dumps(whole, default=str))

    @property
    def name(self) -> str:
        name = getattr(self.module, "NAME", Path(self.path).stem)
        if not isinstance(name, str) or not name.strip():
            raise InputError(self.path, "NAME", f"is {name!r}", "make NAME a non-empty string, or leave it out (the file name is used)")
        if name in (".", "..") or any(c in "/\\" or ord(c) < 32 or ord(c) == 127 for c in name):
            # it names the default profile file, profiles/NAME.yaml: it must stay one file name there
            raise InputError(self.path, "NAME", f"is {name!r}", "make NAME a plain name, without / or \\ or control "
                             "characters (it names the default profile file)")
        return name

    @property
    def profile_clock(self) -> str:
        """``PROFILE_CLOCK``: the clock ``octoplan profile --clock auto`` times this model with;
        ``wall`` for a model whose layers wait (sleep, I/O), which a CPU-time clock does not count."""
        clock = getattr(self.module, "PROFILE_CLOCK", "auto")
        if clock not in ("auto", "wall"):
            raise InputError(self.path, "PROFILE_CLOCK", f"is {shown(clock)}",
                             "make it 'wall' for a model whose layers wait, or leave it out")
        return clock

    def num_layers(self) -> int:
        try:
            count = self._call("num_layers", **self.config)
        except InputError:
            raise
        except MODEL_CODE_FAILURES as exc:  # the first call into a model file: what it raises is the file's fault
            text = " ".join(str(exc).split())[:300]
            raise InputError(self.path, "num_layers", f"raised {type(exc).__name__}{': ' + text if text else ''}",
                             "fix num_layers in the model file") from None
        if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_LAYERS:
            raise InputError(self.path, "num_layers", f"returned {shown(count)}", f"return an int from 1 to {MAX_LAYERS}")
        return count

    def build_layer(self, index: int) -> torch.nn.Module:
        """Layer ``index``, built after ``torch.manual_seed(seed + index)`` (docs/FORMATS.md section 4)."""
        torch.manual_seed(self.seed + index)
        layer = self._call("build_layer", index, **self.config)
        if not isinstance(layer, torch.nn.Module):
            raise InputError(self.path, f"build_layer({index})", f"returned {type(layer).__name__}", "return a torch.nn.Module")
        return layer

    def sample_batch(self, microbatch_size: int, *, step: int, replica: int, mb: int) -> tuple[Any, Any]:
        generator = torch.Generator().manual_seed(microbatch_seed(seed=self.seed, step=step, replica=replica, mb=mb))
        batch = self._call("sample_batch", microbatch_size, generator, **self.config)
        if not (isinstance(batch, tuple) and len(batch) == 2):
            raise InputError(self.path, "sample_batch", "must return (inputs, targets)", "return a 2-tuple")
        return batch

    def loss(self, outputs: Any, targets: Any) -> torch.Tensor:
        value = self.module.loss_fn(outputs, targets)
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise InputError(self.path, "loss_fn", f"returned {shape}, not a scalar tensor", "reduce the loss with .mean()")
        return value

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        fn: Callable = getattr(self.module, name)
        try:
            return fn(*args, **kwargs)
        except InputError as exc:  # the model file's own words: about the file the user gave, if about none
            raise exc.in_file(self.path) from None
        except TypeError as exc:
            # most often a config key the model does not take, or a value of the wrong type
            given = ", ".join(f"{key}={shown(value)}" for key, value in self.config.items()) or "no config"
            if len(given) > 120:
                given = given[:117] + "..."
            raise InputError(self.path, name, f"call failed with {given}: {exc}",
                             "check the config's keys and value types (--config, or the plan's model.config)") from None

    # -- token data (octorun --data): optional hooks, with next-token prediction as the default --
    def tokens_per_sample(self) -> int:
        """How many consecutive tokens of a token file one sample reads: the model file's
        ``tokens_per_sample(**config)``, else ``config["seq"] + 1`` (inputs and next-token targets
        of ``seq`` positions each)."""
        if callable(getattr(self.module, "tokens_per_sample", None)):
            count = self._call("tokens_per_sample", **self.config)
            if not isinstance(count, int) or isinstance(count, bool) or count < 2:
                raise InputError(self.path, "tokens_per_sample", f"returned {shown(count)}",
                                 "return an int of at least 2 (consecutive windows share one token)")
            return count
        seq = self.config.get("seq")
        if isinstance(seq, int) and not isinstance(seq, bool) and seq >= 1:
            return seq + 1
        raise InputError(self.path, "tokens_per_sample", f"is not defined, and the config has no positive int seq "
                         f"(seq is {shown(seq)})", "define tokens_per_sample(**config) -> int in the model file: the "
                         "tokens one sample reads from a token file")

    def vocab_size(self) -> int | None:
        """The token ids a token file may hold are below this: the model file's
        ``vocab_size(**config)``, else the config's int ``vocab``; None where neither says (the
        ids are then checked only by the model's own embedding, as it runs)."""
        if callable(getattr(self.module, "vocab_size", None)):
            size = self._call("vocab_size", **self.config)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise InputError(self.path, "vocab_size", f"returned {shown(size)}", "return a positive int")
            return size
        vocab = self.config.get("vocab")
        return vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None

    def batch_from_tokens(self, tokens: torch.Tensor) -> tuple[Any, Any]:
        """A microbatch's ``(inputs, targets)`` from its windows of token ids (int64, one row
        per sample): the model file's ``batch_from_tokens(tokens, **config)``, else next-token
        prediction, ``(tokens[:, :-1], tokens[:, 1:])``."""
        if not callable(getattr(self.module, "batch_from_tokens", None)):
            # contiguous: a tensor that is sent or saved must not drag its whole window along
            return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        batch = self._call("batch_from_tokens", tokens, **self.config)
        if not (isinstance(batch, tuple) and len(batch) == 2):
            raise InputError(self.path, "batch_from_tokens", f"returned {type(batch).__name__}, not (inputs, targets)",
                             "return a 2-tuple")
        return batch

    # -- tied parameters: an optional hook --
    def tied_groups(self) -> list[list[tuple[int, str]]]:
        """The model file's ``tied_parameters(**config)``, validated: groups of parameters that
        are one tensor, each member (layer index, parameter name as that layer's
        ``named_parameters()`` spells it), sorted so that the canonical member (the lowest
        layer) comes first; each group has two or more distinct members in range. None declared:
        an empty list. That each member exists and the shapes agree needs the layers built
        (the profiler and octorun.tied check it)."""
        if not callable(getattr(self.module, "tied_parameters", None)):
            return []
        declared = self._call("tied_parameters", **self.config)
        example = "e.g. [[(0, 'embed.weight'), (5, 'proj.weight')]]"
        if not isinstance(declared, (list, tuple)):
            raise InputError(self.path, "tied_parameters", f"returned {type(declared).__name__}, not a list of groups",
                             f"return a list of groups of (layer index, parameter name), {example}")
        total = self.num_layers()
        groups = []
        for g, group in enumerate(declared):
            where = f"tied_parameters group {g}"
            if not isinstance(group, (list, tuple)) or not all(
                    isinstance(m, (list, tuple)) and len(m) == 2 and isinstance(m[0], int) and not isinstance(m[0], bool)
                    and isinstance(m[1], str) and m[1] for m in group):
                raise InputError(self.path, where, f"is {shown(group)}, not a list of (layer index, parameter name)",
                                 f"write each group as a list of (int, str) pairs, {example}")
            members = [(int(layer), str(name)) for layer, name in group]
            for layer, name in members:
                if not 0 <= layer < total:
                    raise InputError(self.path, where, f"names layer {layer} ({name}) of a {total}-layer model",
                                     f"give layer indices from 0 to {total - 1}")
            if len(members) < 2 or len(set(members)) != len(members):
                raise InputError(self.path, where, f"{shown(group)} has {len(set(members))} distinct member(s)",
                                 "tie two or more distinct parameters in a group, each listed once")
            for other, earlier in enumerate(groups):
                both = sorted(set(members) & set(earlier))
                if both:
                    raise InputError(self.path, where, f"repeats {both[0]} of group {other}",
                                     "put all the parameters tied to one tensor in one group")
            groups.append(sorted(members))
        return groups


def load_model_file(path: str | Path, config: dict[str, Any] | None = None, *, seed: int = 0,
                    config_given: bool = False, folder_importable: bool = True) -> ModelFile:
    """Import a model file and check it has the FORMATS.md section 4 functions.

    ``config`` overrides the file's ``CONFIG`` defaults. ``config_given``: the user typed it
    (``--config``), so each key must be one of CONFIG's; a plan's config, merged from CONFIG
    when the profile was made, is the file's own business (its functions say what they take).
    ``hf:FOLDER`` is a Hugging Face transformers model instead (octoplan.hf).
    ``folder_importable``: put the file's folder on the import path (:func:`_put_on_import_path`);
    False for a model file of OctoPipe's own packages (the replay model), whose folder's modules
    must stay ``octorun.*`` and not shadow other packages' names.
    """
    if str(path).startswith("hf:"):
        from octoplan.hf import load_hf_model

        return load_hf_model(str(path), config, seed=seed)
    path = Path(path)
    if not path.exists():
        raise InputError(str(path), None, "no such model file", "check the path")
    check_input_file(path, fix="give a model file (.py)")  # importing /dev/zero would never end
    module_name = f"_octopipe_model_{abs(hash(str(path.resolve())))}"
    if folder_importable:
        _put_on_import_path(path.resolve().parent)
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise InputError(str(path), None, "cannot be imported as Python", "give a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look modules up by name
    try:
        spec.loader.exec_module(module)
    except InputError as exc:  # the file's own words, or a model file it loads that is bad (named by its error)
        raise exc.in_file(str(path)) from None
    except Exception as exc:  # a broken model file is the user's input, not our failure
        raise InputError(str(path), None, f"import failed: {type(exc).__name__}: {exc}{where_raised(exc)}",
                         "fix the model file") from None
    except SystemExit as exc:  # exit() at import would end the command silently, with its status
        raise InputError(str(path), None, f"exits when imported (status {exc.code!r})",
                         "guard the script part with if __name__ == '__main__'") from None
    missing = [name for name in REQUIRED_FUNCTIONS if not callable(getattr(module, name, None))]
    if missing:
        raise InputError(str(path), missing[0], "is not defined", f"define {', '.join(missing)} (docs/FORMATS.md section 4)")
    defaults = getattr(module, "CONFIG", None) or {}
    if not isinstance(defaults, dict):
        raise InputError(str(path), "CONFIG", f"is a {type(defaults).__name__}, not a mapping",
                         "write CONFIG = {'name': value, ...}")
    _check_config(str(path), defaults, config or {}, keys=config_given)
    model = ModelFile(path=str(path), module=module, config={**defaults, **(config or {})}, seed=seed)
    model.name  # checked now, not after a whole profile is measured
    return model


def _put_on_import_path(folder: Path) -> None:
    """The model file's folder goes first on the import path, as ``python model.py`` puts a
    script's, and stays there: a model file imports the modules beside it by name
    (``import my_layers``), at its top or inside its functions as they run. As for a script, a
    module beside it shadows an installed one of the same name, and one name is one module per
    process (the first model file's ``my_layers`` serves the next that imports that name)."""
    entry = str(folder)
    if entry not in sys.path:
        sys.path.insert(0, entry)


def _check_config(path: str, defaults: dict[str, Any], overrides: dict[str, Any], *, keys: bool) -> None:
    """CONFIG's keys are names and its values what a profile file can hold (they are written into
    it); where the file gives CONFIG, the overrides name its keys (a misspelt one would be passed
    on unused, and recorded as if it had been)."""
    for key, value in defaults.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise InputError(path, "CONFIG", f"has the key {key!r}", "name CONFIG's keys as Python keyword arguments")
        if not _plain(value):
            raise InputError(path, f"CONFIG.{key}", f"is a {type(value).__name__}, which a profile file cannot hold",
                             "use a str, int, float, bool, None, or a list or dict of them")
    unknown = sorted(key for key in overrides if key not in defaults)
    if keys and defaults and unknown:
        import difflib

        near = difflib.get_close_matches(unknown[0], list(defaults), n=1)
        raise InputError(path, f"--config {unknown[0]}", "is not a key of the model file's CONFIG",
                         (f"did you mean {near[0]}? " if near else "") + f"its keys: {', '.join(defaults)}")


def _plain(value: Any) -> bool:
    if value is None or type(value) in (str, int, float, bool):
        return True
    if type(value) in (list, tuple):
        return all(_plain(v) for v in value)
    if type(value) is dict:
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False
