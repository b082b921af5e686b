"""A small vision-language model: a ViT encoder, a projector and a causal text decoder.

Heterogeneity: the encoder runs on 16 image patches, the decoder on 16 image tokens plus the
text, and the head projects only the text positions onto the vocabulary.

Layers (FORMATS.md section 4, a chain; layer i consumes layer i-1's output):

    0                   PatchEmbedding  (image, ids) -> (patches, ids)
                        conv over image patches + learned positions; ids (int64) pass through
    1 .. V              VisionBlock     (patches, ids) -> (patches, ids), bidirectional attention
    V + 1               Projector       (patches, ids) -> hidden (mbs, P + text_len, hidden)
                        MLP from vision width to text width, embeds the text tokens, concatenates
                        [image tokens ; text tokens]
    V + 2 .. V + D + 1  TransformerBlock causal attention over image and text tokens
    V + D + 2           LMHead          logits of the text positions only (mbs, text_len, vocab)

with V = ``vision_layers``, D = ``decoder_layers``, P = (image_size / patch)^2 image tokens.
``loss_fn`` is the cross-entropy of the text logits against the caption.

Data: each sample is one of ``num_classes`` fixed image templates plus noise; its text is that
class's fixed caption, shifted right behind a BOS token (id 0). The first caption token can only
be predicted from the image, so learning needs the whole encoder-projector-decoder path.

Optional hooks (docs/FORMATS.md section 4; the profiler uses them to fill a profile's layer
``name`` and ``kind``): ``layer_kind(index, **config)`` returns "embedding" (first), "vision",
"projector", "decoder", "head" (last); ``layer_name(index, **config)`` returns "patch_embed",
"vision.<n>", "projector", "decoder.<n>", "head".

Transformer pieces come from the sibling ``tiny_gpt.py`` (same folder).
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from octoplan.errors import InputError

__all__ = [
    "NAME",
    "CONFIG",
    "VLMConfig",
    "num_layers",
    "build_layer",
    "sample_batch",
    "loss_fn",
    "layer_kind",
    "layer_name",
    "PatchEmbedding",
    "VisionBlock",
    "Projector",
]

NAME = "vlm"


import tiny_gpt as _gpt  # noqa: E402  (beside this file: a model file's folder is on the import path)

BOS = 0
_TEMPLATE_SEED = 1234  # fixed: the image classes and captions are part of the task, not the stream
_CAPTION_SEED = 4321


@dataclass(frozen=True)
class VLMConfig:
    image_size: int = 32
    channels: int = 3
    patch: int = 8
    vision_hidden: int = 96
    vision_layers: int = 2
    hidden: int = 128
    decoder_layers: int = 3
    heads: int = 4
    vocab: int = 4096
    text_len: int = 16
    num_classes: int = 8
    noise: float = 0.5  # std of the noise added to a class's image template

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch) ** 2


CONFIG = asdict(VLMConfig())


def _config(config: dict) -> VLMConfig:
    # Unknown keys raise TypeError, which load_model_file reports as a bad config key.
    cfg = VLMConfig(**config)
    if cfg.patch < 1 or cfg.image_size % cfg.patch:
        raise InputError(__file__, "config.patch", f"{cfg.patch} does not divide image_size={cfg.image_size}", "pick a divisor")
    _gpt.check_heads(hidden=cfg.vision_hidden, heads=cfg.heads)
    _gpt.check_heads(hidden=cfg.hidden, heads=cfg.heads)
    if cfg.vision_layers < 0 or cfg.decoder_layers < 0:
        raise InputError(__file__, "config.vision_layers", "layer counts must be >= 0", "raise them")
    if cfg.vocab < 2 or cfg.text_len < 1 or cfg.num_classes < 1:
        raise InputError(__file__, "config.vocab", "vocab must be >= 2, text_len and num_classes >= 1", "raise them")
    return cfg


class PatchEmbedding(nn.Module):
    """Non-overlapping patches through one strided conv, plus learned patch positions."""

    def __init__(self, channels: int, patch: int, num_patches: int, hidden: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, hidden, kernel_size=patch, stride=patch)
        self.positions = nn.Parameter(torch.randn(num_patches, hidden) * 0.02)

    def forward(self, image: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        patches = self.conv(image).flatten(2).transpose(1, 2)  # (mbs, patches, hidden)
        return patches + self.positions, ids


class VisionBlock(nn.Module):
    """A bidirectional transformer block over the patches; the text ids ride along untouched."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.block = _gpt.TransformerBlock(hidden, heads, causal=False)

    def forward(self, patches: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.block(patches), ids


class Projector(nn.Module):
    """Vision features to text width, text ids to embeddings, joined as [image ; text] tokens."""

    def __init__(self, vision_hidden: int, hidden: int, vocab: int, seq: int):
        super().__init__()
        self.ln = nn.LayerNorm(vision_hidden)
        self.up = nn.Linear(vision_hidden, hidden)
        self.down = nn.Linear(hidden, hidden)
        self.text = _gpt.TokenEmbedding(vocab, hidden, seq)  # positions cover image and text tokens

    def forward(self, patches: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        image = self.down(F.gelu(self.up(self.ln(patches))))
        tokens = torch.cat([image, self.text.tokens(ids)], dim=1)
        return tokens + self.text.positions.weight[: tokens.shape[1]]


def num_layers(**config) -> int:
    cfg = _config(config)
    return cfg.vision_layers + cfg.decoder_layers + 3


def layer_kind(index: int, **config) -> str:
    return _place(_config(config), index)[0]


def layer_name(index: int, **config) -> str:
    kind, n = _place(_config(config), index)
    return {"embedding": "patch_embed", "projector": "projector", "head": "head"}.get(kind, f"{kind}.{n}")


def _place(cfg: VLMConfig, index: int) -> tuple[str, int]:
    """(kind, index within its kind) of layer ``index``."""
    layout = (
        [("embedding", 0)]
        + [("vision", n) for n in range(cfg.vision_layers)]
        + [("projector", 0)]
        + [("decoder", n) for n in range(cfg.decoder_layers)]
        + [("head", 0)]
    )
    if not 0 <= index < len(layout):
        raise IndexError(f"layer {index} out of range 0..{len(layout) - 1}")
    return layout[index]


def build_layer(index: int, **config) -> nn.Module:
    cfg = _config(config)
    kind, _ = _place(cfg, index)
    if kind == "embedding":
        return PatchEmbedding(cfg.channels, cfg.patch, cfg.num_patches, cfg.vision_hidden)
    if kind == "vision":
        return VisionBlock(cfg.vision_hidden, cfg.heads)
    if kind == "projector":
        return Projector(cfg.vision_hidden, cfg.hidden, cfg.vocab, cfg.num_patches + cfg.text_len)
    if kind == "decoder":
        return _gpt.TransformerBlock(cfg.hidden, cfg.heads)
    return _gpt.LMHead(cfg.hidden, cfg.vocab, skip=cfg.num_patches)


@functools.lru_cache(maxsize=8)
def _task(cfg: VLMConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed image templates and captions of every class (same in every process)."""
    templates = torch.randn(
        cfg.num_classes, cfg.channels, cfg.image_size, cfg.image_size, generator=torch.Generator().manual_seed(_TEMPLATE_SEED)
    )
    captions = torch.randint(1, cfg.vocab, (cfg.num_classes, cfg.text_len), generator=torch.Generator().manual_seed(_CAPTION_SEED))
    return templates, captions


def sample_batch(
    microbatch_size: int, generator: torch.Generator, **config
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    cfg = _config(config)
    templates, captions = _task(cfg)
    classes = torch.randint(0, cfg.num_classes, (microbatch_size,), generator=generator)
    images = templates[classes] + cfg.noise * torch.randn(
        microbatch_size, cfg.channels, cfg.image_size, cfg.image_size, generator=generator
    )
    targets = captions[classes]
    ids = torch.cat([torch.full((microbatch_size, 1), BOS, dtype=torch.long), targets[:, :-1]], dim=1)
    return (images, ids), targets


def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return _gpt.token_cross_entropy(outputs, targets)
