"""A hybrid language model mixing state-space, attention and mixture-of-experts blocks.

Heterogeneity: the three block kinds differ in cost, in parameters and in how their backward
splits between input and weight gradients (a MoE block holds four experts' weights but runs two
per token; the state-space block's scan is a chain of small kernels; attention is quadratic in the sequence).

Layers (FORMATS.md section 4, a chain; layer i consumes layer i-1's output):

    0          TokenEmbedding   ids (mbs, seq) int64 -> hidden (mbs, seq, hidden)
    1 .. n     one block per letter of ``pattern`` (default "mamemame"), each pre-LayerNorm with
               a residual, hidden -> hidden:
                 m  MambaStyleBlock  gated causal depthwise conv + selective (input-dependent
                                     decay) linear scan over time
                 a  AttentionBlock   causal multi-head self-attention
                 e  MoEBlock         ``experts`` MLP experts, top-``top_k`` routing; tokens are
                                     gathered to their experts and scattered back weighted by the
                                     router's probabilities, so the router trains
    n + 1      LMHead           LayerNorm + linear -> logits (mbs, seq, vocab)

``loss_fn`` is the token-mean cross-entropy against the next tokens; the data are tiny_gpt's
counting sequences (random start and stride, modulo ``data_vocab``).

Every expert takes part in every forward, even with no token routed to it (it then runs on an
empty batch), so ``torch.autograd.grad`` over a layer's parameters always finds all of them.

Optional hooks (docs/FORMATS.md section 4; the profiler uses them to fill a profile's layer
``name`` and ``kind``): ``layer_kind(index, **config)`` returns "embedding" (first), "mamba",
"attention", "moe", "head" (last); ``layer_name(index, **config)`` returns "embed",
"<kind>.<block index>", "head".

Shared pieces come from the sibling ``tiny_gpt.py`` (same folder).
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from octoplan.errors import InputError

__all__ = [
    "NAME",
    "CONFIG",
    "HybridConfig",
    "num_layers",
    "build_layer",
    "sample_batch",
    "loss_fn",
    "layer_kind",
    "layer_name",
    "MambaStyleBlock",
    "AttentionBlock",
    "MoEBlock",
]

NAME = "hybrid"


def _load_sibling(stem: str):
    """Import ``<stem>.py`` from this file's folder; model files are loaded by path, not as a package."""
    module_name = f"_octopipe_example_{stem}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, Path(__file__).with_name(f"{stem}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # dataclasses look their module up by name
        spec.loader.exec_module(module)
    return sys.modules[module_name]


_gpt = _load_sibling("tiny_gpt")

_BLOCK_KINDS = {"m": "mamba", "a": "attention", "e": "moe"}


@dataclass(frozen=True)
class HybridConfig:
    vocab: int = 4096
    hidden: int = 128
    seq: int = 32
    pattern: str = "mamemame"  # one letter per block: m mamba, a attention, e moe
    heads: int = 4
    state_expand: int = 2  # mamba inner width = state_expand * hidden
    conv_kernel: int = 4
    experts: int = 4
    top_k: int = 2
    expert_hidden: int = 256
    data_vocab: int = 256  # sample_batch draws token ids below this


CONFIG = asdict(HybridConfig())


def _config(config: dict) -> HybridConfig:
    # Unknown keys raise TypeError, which load_model_file reports as a bad config key.
    cfg = HybridConfig(**config)
    bad = sorted(set(cfg.pattern) - set(_BLOCK_KINDS))
    if not cfg.pattern or bad:
        raise InputError(__file__, "config.pattern", f"{cfg.pattern!r} is empty or has letters {bad}", "use only m, a, e")
    if "a" in cfg.pattern:
        _gpt.check_heads(hidden=cfg.hidden, heads=cfg.heads)
    if not 1 <= cfg.top_k <= cfg.experts:
        raise InputError(__file__, "config.top_k", f"{cfg.top_k} is not in 1..experts={cfg.experts}", "lower top_k")
    if not 2 <= cfg.data_vocab <= cfg.vocab:
        raise InputError(__file__, "config.data_vocab", f"{cfg.data_vocab} is not in 2..vocab={cfg.vocab}", "lower data_vocab")
    return cfg


class MambaStyleBlock(nn.Module):
    """x + out(scan(silu(conv(in_x))) * silu(in_z)): a gated, selective state-space mixer.

    The scan is h_t = a_t * h_{t-1} + (1 - a_t) * u_t per channel, with the decay a_t in (0, 1)
    computed from u_t (the "selective" part). It runs as a loop over time: at these sizes that
    is several times faster on a CPU than the parallel (seq x seq) form, and it makes the block
    what real SSM layers often are, bound by many small kernels rather than by FLOPs.
    """

    def __init__(self, hidden: int, *, expand: int, kernel: int):
        super().__init__()
        inner = expand * hidden
        self.ln = nn.LayerNorm(hidden)
        self.in_proj = nn.Linear(hidden, 2 * inner)
        self.conv = nn.Conv1d(inner, inner, kernel, groups=inner)  # holds the weights; see _causal_conv
        self.decay = nn.Linear(inner, inner)
        self.skip = nn.Parameter(torch.ones(inner))
        self.out_proj = nn.Linear(inner, hidden)
        # Start with slow decay (a ~ 0.9) so the state remembers across the sequence.
        nn.init.constant_(self.decay.bias, 2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u, z = self.in_proj(self.ln(x)).chunk(2, dim=-1)
        u = F.silu(self._causal_conv(u))  # (mbs, seq, inner)
        decay = torch.sigmoid(self.decay(u))
        drive = (1 - decay) * u
        h = torch.zeros_like(u[:, 0])
        states = []
        # unbind, not indexing per step: its backward is one stack, not seq full-size scatters.
        for a_t, b_t in zip(decay.unbind(1), drive.unbind(1)):
            h = a_t * h + b_t
            states.append(h)
        state = torch.stack(states, dim=1)
        return x + self.out_proj((state + self.skip * u) * F.silu(z))

    def _causal_conv(self, u: torch.Tensor) -> torch.Tensor:
        """The depthwise conv, output t seeing inputs t-kernel+1..t, as windows times weights.

        Same numbers as ``self.conv`` with left padding only; torch's CPU depthwise conv1d
        backward is several times slower than this at these sizes.
        """
        kernel = self.conv.kernel_size[0]
        windows = F.pad(u, (0, 0, kernel - 1, 0)).unfold(1, kernel, 1)  # (mbs, seq, inner, kernel)
        return (windows * self.conv.weight.squeeze(1)).sum(-1) + self.conv.bias


class AttentionBlock(nn.Module):
    """x + causal self-attention(ln(x)); the MLP lives in the MoE blocks."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.attn = _gpt.SelfAttention(hidden, heads, causal=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(self.ln(x))


class MoEBlock(nn.Module):
    """x + sum over the top-k experts of router_weight * expert(ln(x)), per token."""

    def __init__(self, hidden: int, *, experts: int, top_k: int, expert_hidden: int):
        super().__init__()
        self.top_k = top_k
        self.ln = nn.LayerNorm(hidden)
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(_gpt.MLP(hidden, expert_hidden) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.ln(x).reshape(-1, x.shape[-1])
        probs = F.softmax(self.router(tokens), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)  # (tokens, top_k)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        mixed = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            # No skip for an expert without tokens: its empty forward keeps its weights in the graph.
            token, slot = (chosen == e).nonzero(as_tuple=True)
            out = expert(tokens[token]) * weights[token, slot].unsqueeze(-1)
            mixed = mixed.index_add(0, token, out.to(mixed.dtype))  # under bf16 autocast the expert computes in bf16
        return x + mixed.view_as(x)


def num_layers(**config) -> int:
    return len(_config(config).pattern) + 2


def _kind(cfg: HybridConfig, index: int) -> str:
    last = len(cfg.pattern) + 1
    if not 0 <= index <= last:
        raise IndexError(f"layer {index} out of range 0..{last}")
    return "embedding" if index == 0 else "head" if index == last else _BLOCK_KINDS[cfg.pattern[index - 1]]


def layer_kind(index: int, **config) -> str:
    return _kind(_config(config), index)


def layer_name(index: int, **config) -> str:
    kind = _kind(_config(config), index)
    return {"embedding": "embed", "head": "head"}.get(kind, f"{kind}.{index - 1}")


def build_layer(index: int, **config) -> nn.Module:
    cfg = _config(config)
    kind = _kind(cfg, index)
    if kind == "embedding":
        return _gpt.TokenEmbedding(cfg.vocab, cfg.hidden, cfg.seq)
    if kind == "head":
        return _gpt.LMHead(cfg.hidden, cfg.vocab)
    if kind == "mamba":
        return MambaStyleBlock(cfg.hidden, expand=cfg.state_expand, kernel=cfg.conv_kernel)
    if kind == "attention":
        return AttentionBlock(cfg.hidden, cfg.heads)
    return MoEBlock(cfg.hidden, experts=cfg.experts, top_k=cfg.top_k, expert_hidden=cfg.expert_hidden)


def sample_batch(microbatch_size: int, generator: torch.Generator, **config) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = _config(config)
    return _gpt.stride_sequences(microbatch_size, generator, seq=cfg.seq, data_vocab=cfg.data_vocab)


def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return _gpt.token_cross_entropy(outputs, targets)
