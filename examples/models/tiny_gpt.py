"""A tiny GPT whose large-vocabulary embedding and head dominate a few cheap blocks.

The point of this example is heterogeneity: with the defaults (vocab 8192, hidden 128, 4 blocks,
sequence 32) the head's 128x8192 projection and its cross-entropy cost several transformer
blocks' worth, so a pipeline that splits layers evenly by count is unbalanced.

Layers (FORMATS.md section 4, a chain; layer i consumes layer i-1's output):

    0            TokenEmbedding     ids (mbs, seq) int64   -> hidden (mbs, seq, hidden)
    1 .. layers  TransformerBlock   pre-LayerNorm causal self-attention + MLP, residuals
    layers + 1   LMHead             LayerNorm + linear     -> logits (mbs, seq, vocab)

``loss_fn`` is the token-mean cross-entropy of the logits against the next tokens.

Data: each sequence counts from a random start with a random stride in 1..4, modulo
``data_vocab`` (token ids stay below it). The next token is a function of the last two, so the
model has real structure to learn (the stride must be read from the context by attention), and
a few optimizer steps already lower the loss.

Optional hooks (docs/FORMATS.md section 4; the profiler uses them to fill a profile's layer
``name`` and ``kind``): ``layer_kind(index, **config)`` returns "embedding" for the first layer,
"head" for the last and "transformer" for the blocks; ``layer_name(index, **config)`` returns
"embed", "block.<n>" and "head".

The building blocks here (:class:`SelfAttention`, :class:`MLP`, :class:`TransformerBlock`,
:class:`TokenEmbedding`, :class:`LMHead`, :func:`stride_sequences`, :func:`token_cross_entropy`)
are reused by the sibling examples ``vlm.py`` and ``hybrid.py``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from octoplan.errors import InputError

__all__ = [
    "NAME",
    "CONFIG",
    "GPTConfig",
    "num_layers",
    "build_layer",
    "sample_batch",
    "loss_fn",
    "layer_kind",
    "layer_name",
    "SelfAttention",
    "MLP",
    "TransformerBlock",
    "TokenEmbedding",
    "LMHead",
    "stride_sequences",
    "token_cross_entropy",
    "check_heads",
]

NAME = "tiny-gpt"


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 8192
    hidden: int = 128
    layers: int = 4  # transformer blocks between the embedding and the head
    heads: int = 4
    seq: int = 32
    mlp_ratio: int = 4
    data_vocab: int = 256  # sample_batch draws token ids below this


CONFIG = asdict(GPTConfig())


def check_heads(*, hidden: int, heads: int) -> None:
    """Attention splits ``hidden`` evenly over ``heads``; say so plainly when it cannot."""
    if heads < 1 or hidden % heads:
        raise InputError(__file__, "config.heads", f"{heads} does not divide hidden={hidden}", "pick heads dividing hidden")


def _config(config: dict) -> GPTConfig:
    # Unknown keys raise TypeError, which load_model_file reports as a bad config key.
    cfg = GPTConfig(**config)
    check_heads(hidden=cfg.hidden, heads=cfg.heads)
    if not 2 <= cfg.data_vocab <= cfg.vocab:
        raise InputError(__file__, "config.data_vocab", f"{cfg.data_vocab} is not in 2..vocab={cfg.vocab}", "lower data_vocab")
    if cfg.layers < 1 or cfg.seq < 1:
        raise InputError(__file__, "config.layers", "layers and seq must be positive", "raise them")
    return cfg


class SelfAttention(nn.Module):
    """Multi-head self-attention; ``causal`` masks future positions (decoders), else bidirectional."""

    def __init__(self, hidden: int, heads: int, *, causal: bool = True):
        super().__init__()
        self.heads = heads
        self.causal = causal
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, hidden // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, hidden))


class MLP(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.up = nn.Linear(hidden, inner)
        self.down = nn.Linear(inner, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class TransformerBlock(nn.Module):
    """Pre-LayerNorm block: x + attention(ln(x)), then + mlp(ln(.))."""

    def __init__(self, hidden: int, heads: int, *, mlp_ratio: int = 4, causal: bool = True):
        super().__init__()
        self.ln_attn = nn.LayerNorm(hidden)
        self.attn = SelfAttention(hidden, heads, causal=causal)
        self.ln_mlp = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden, mlp_ratio * hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class TokenEmbedding(nn.Module):
    """Token plus learned position embedding: int64 ids (mbs, seq) -> (mbs, seq, hidden)."""

    def __init__(self, vocab: int, hidden: int, seq: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab, hidden)
        self.positions = nn.Embedding(seq, hidden)
        # Unit-scale tokens (torch's default) keep the token identity dominant in the residual
        # stream at first, so MoE routers and attention see distinct tokens; positions are smaller.
        nn.init.normal_(self.positions.weight, std=0.1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions.weight[: ids.shape[1]]


class LMHead(nn.Module):
    """Final LayerNorm and vocabulary projection; drops the first ``skip`` positions (image tokens)."""

    def __init__(self, hidden: int, vocab: int, *, skip: int = 0):
        super().__init__()
        self.skip = skip
        self.ln = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x[:, self.skip :]))


def stride_sequences(
    microbatch_size: int, generator: torch.Generator, *, seq: int, data_vocab: int, max_stride: int = 4
) -> tuple[torch.Tensor, torch.Tensor]:
    """Counting sequences ``start + k * stride (mod data_vocab)``: inputs and next-token targets."""
    start = torch.randint(0, data_vocab, (microbatch_size, 1), generator=generator)
    stride = torch.randint(1, max_stride + 1, (microbatch_size, 1), generator=generator)
    tokens = (start + stride * torch.arange(seq + 1)) % data_vocab
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy averaged over every token of the microbatch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def num_layers(**config) -> int:
    return _config(config).layers + 2


def layer_kind(index: int, **config) -> str:
    last = num_layers(**config) - 1
    return "embedding" if index == 0 else "head" if index == last else "transformer"


def layer_name(index: int, **config) -> str:
    last = num_layers(**config) - 1
    return "embed" if index == 0 else "head" if index == last else f"block.{index - 1}"


def build_layer(index: int, **config) -> nn.Module:
    cfg = _config(config)
    if not 0 <= index < cfg.layers + 2:
        raise IndexError(f"layer {index} out of range 0..{cfg.layers + 1}")
    if index == 0:
        return TokenEmbedding(cfg.vocab, cfg.hidden, cfg.seq)
    if index == cfg.layers + 1:
        return LMHead(cfg.hidden, cfg.vocab)
    return TransformerBlock(cfg.hidden, cfg.heads, mlp_ratio=cfg.mlp_ratio)


def sample_batch(microbatch_size: int, generator: torch.Generator, **config) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = _config(config)
    return stride_sequences(microbatch_size, generator, seq=cfg.seq, data_vocab=cfg.data_vocab)


def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return token_cross_entropy(outputs, targets)
