"""Tied parameters: groups of parameters in different layers that are one tensor (an embedding
and the LM head that reuses its matrix, as Llama 3.2 and Gemma tie them).

The model file declares them with ``tied_parameters(**config)``: a list of groups, each a list of
(layer index, parameter name as the layer's ``named_parameters()`` spells it). The first member
of a group (the lowest layer index) is its canonical one: its initial value is the group's, its
name keys the tensor in checkpoints, and the global gradient norm counts the tensor on its stage.

How a pipeline keeps them one tensor, as Megatron-LM's embedding group does:
- one rank holding several members: they become one ``Parameter`` there (one gradient, one
  optimizer state, stepped once);
- several ranks holding members: each keeps its own copy, starting from the canonical value;
  after every step's backward (and data-parallel all-reduce) the ranks holding a member, in each
  data-parallel replica, sum the copy's gradient; with the same start, the same gradient and the
  same optimizer, every copy takes the same values step after step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from octoplan.errors import InputError

__all__ = ["TiedGroup", "tied_groups", "tie_local", "parameter_key", "model_state"]

Member = tuple[int, str]


@dataclass(frozen=True)
class TiedGroup:
    members: tuple[Member, ...]  # sorted: the canonical member first

    @property
    def canonical(self) -> Member:
        return self.members[0]

    @property
    def layers(self) -> frozenset[int]:
        return frozenset(layer for layer, _ in self.members)


def parameter_key(layer: int, name: str) -> str:
    """A parameter's name in checkpoints: by global layer index, never by stage or rank."""
    return f"layers.{layer}.{name}"


def model_state(layers: dict[int, torch.nn.Module], tied_keys: dict[int, str]) -> dict[str, torch.Tensor]:
    """The parameters and buffers of ``layers`` (by global layer index) as a checkpoint keys them:
    ``model/`` and :func:`parameter_key`, a parameter a layer holds under two names by its first,
    a tied one by its canonical member's key (``tied_keys``: id(parameter) -> key, as
    :func:`tie_local` returns them). The tensors themselves, so that a load fills them."""
    keys = {id(p): parameter_key(index, name) for index in sorted(layers) for name, p in layers[index].named_parameters()}
    keys.update(tied_keys)
    state: dict[str, torch.Tensor] = {}
    for index in sorted(layers):
        for name, value in layers[index].state_dict(keep_vars=True).items():
            state[f"model/{keys.get(id(value), parameter_key(index, name))}"] = value.detach()
    return state


def tied_groups(model) -> tuple[TiedGroup, ...]:
    """The model file's groups, as ModelFile.tied_groups validated them (none when it declares none)."""
    return tuple(TiedGroup(tuple(sorted(members))) for members in model.tied_groups())


def _parameter(model_path: str, layer_module: torch.nn.Module, layer: int, name: str) -> torch.nn.Parameter:
    found = dict(layer_module.named_parameters(remove_duplicate=False)).get(name)
    if found is None:
        raise InputError(model_path, "tied_parameters", f"layer {layer} has no parameter {name!r}",
                         "name parameters as the layer's named_parameters() spells them")
    return found


def tie_local(model_path: str, layers: dict[int, torch.nn.Module], groups: Sequence[TiedGroup],
              build_layer: Callable[[int], torch.nn.Module]) -> dict[int, str]:
    """Make this rank's members of each group one Parameter holding the canonical value.

    ``layers`` maps the global layer index of every layer this rank holds to its module;
    ``build_layer`` builds a layer this rank does not hold (only to read a canonical value).
    Returns ``id(parameter) -> canonical member's key`` for every tied parameter held here.
    """
    keys: dict[int, str] = {}
    for group in groups:
        here = [(layer, name) for layer, name in group.members if layer in layers]
        if not here:
            continue
        canonical_layer, canonical_name = group.canonical
        if canonical_layer in layers:
            source = _parameter(model_path, layers[canonical_layer], canonical_layer, canonical_name)
        else:  # built only to read it; the global RNG stream stays as the rank's own layers left it
            # (build_layer's torch.manual_seed reseeds the GPU's generator too: fork that as well)
            cuda = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
            with torch.random.fork_rng(devices=cuda):
                source = _parameter(model_path, build_layer(canonical_layer), canonical_layer, canonical_name)
        shared = _parameter(model_path, layers[here[0][0]], *here[0])
        for layer, name in here:
            param = _parameter(model_path, layers[layer], layer, name)
            if param.shape != source.shape:
                raise InputError(model_path, "tied_parameters",
                                 f"layer {layer}'s {name} has shape {tuple(param.shape)} but layer {canonical_layer}'s "
                                 f"{canonical_name} has {tuple(source.shape)}", "tie parameters of one shape")
        with torch.no_grad():
            shared.copy_(source.detach().to(shared.device, shared.dtype))
        for layer, name in here[1:]:
            owner_path, _, attr = name.rpartition(".")
            owner = layers[layer].get_submodule(owner_path) if owner_path else layers[layer]
            setattr(owner, attr, shared)
        keys[id(shared)] = parameter_key(canonical_layer, canonical_name)
    return keys
