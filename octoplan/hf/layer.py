"""One chain layer of a transformers model: its shell, run through transformers' own forward.

The layer's parameters are named as in the full transformers model (``model.layers.3.mlp.
down_proj.weight``): the layer module holds the shell's children as its own, and the shell
itself, which runs them, outside its module tree.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["ChainLayer"]


class ChainLayer(nn.Module):
    """A chain layer: ``role`` says which part of the model's forward it runs (chain.Piece)."""

    def __init__(self, shell: nn.Module, role: str, text_base: str):
        super().__init__()
        for name, child in shell.named_children():
            self.add_module(name, child)
        # outside the module tree: its children are this module's, its own forward runs them
        object.__setattr__(self, "_shell", shell)
        self.role = role
        self.text_base = text_base

    def train(self, mode: bool = True) -> "ChainLayer":
        super().train(mode)
        self._shell.training = mode  # the children are shared; the shell's own flag follows
        return self

    def extra_repr(self) -> str:
        return f"role={self.role}"

    def forward(self, *args: torch.Tensor) -> Any:
        shell, role = self._shell, self.role
        if role == "embed":  # the plan's embed_tokens: input_ids -> inputs_embeds
            (ids,) = args
            return shell.get_submodule(self.text_base).embed_tokens(ids)
        if role == "decoder":  # the base model's forward, every other layer an identity
            (hidden,) = args
            return shell.get_submodule(self.text_base)(inputs_embeds=hidden, use_cache=False).last_hidden_state
        if role == "head":  # the causal-LM forward: norm, lm_head, and whatever it does to the logits
            (hidden,) = args
            return shell(inputs_embeds=hidden, use_cache=False).logits
        if role == "vision":  # LLaVA's get_image_features, its projector an identity
            pixel_values, ids = args
            features = shell.model.get_image_features(pixel_values=pixel_values, return_dict=True).pooler_output
            return torch.stack(list(features)), ids
        if role == "projector":
            features, ids = args
            return shell.model.multi_modal_projector(features), ids
        if role == "merge":  # LLaVA's forward up to the language model: embed, scatter the image features
            from transformers.modeling_outputs import BaseModelOutputWithPooling

            features, ids = args
            image = BaseModelOutputWithPooling(pooler_output=list(features))
            return shell.model(input_ids=ids, mm_encoder_outputs={"image": image}, use_cache=False).last_hidden_state
        raise AssertionError(role)
