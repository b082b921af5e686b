"""A hybrid language model mixing state-space, attention and mixture-of-experts blocks.

Heterogeneity: the three block kinds differ in cost, in parameters and in how their backward
splits between input and weight gradients (a MoE block holds four experts' weights but runs two
per token; the state-space block's scan is a chain of small kernels; attention is quadratic in the sequence).

Layers (FORMATS.md section 4, a chain; layer i consumes layer i-1's output), with the default
config:

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

Finer layers. A pipeline stage holds whole layers, so one layer costlier than a rank's fair share
of the work caps how evenly the model can be cut. Two config keys cut the costliest layers into
more chain layers, computing exactly the same function (the defaults keep the layers above):

- ``split_mamba: true``: each Mamba-style block becomes two layers, cut near the middle of its
  cost (profiled on a CPU in bf16: the conv half about 40% of the block's F + I + W, the scan half
  60%; a cut after the gated product would leave the output projection alone, about 10%):
    ``mamba.K.conv``  LayerNorm, input projection, causal conv:  x -> (x, u, z)
    ``mamba.K.scan``  decay, selective scan, gate, output projection, residual:  (x, u, z) -> hidden
  ``x`` is the block's input (the residual), ``u`` the conv's activated output, ``z`` the gate's
  pre-activation (both (mbs, seq, state_expand * hidden)).
- ``head_shards: N`` (1 to ``vocab``): the LM head becomes N layers ``head.0`` .. ``head.N-1``,
  shard k computing the logits of the k-th contiguous slice of the vocabulary (slices as even as
  possible, the first ones one row longer). The LayerNorm lives in the first shard, which passes
  the normalized hidden state on, so no shard recomputes it and its weights are not duplicated:
    ``head.0``        hidden -> (normed, logits_0)
    ``head.k``        (normed, logits_0, .., logits_k-1) -> (normed, logits_0, .., logits_k)
    ``head.N-1``      (normed, logits_0, .., logits_N-2) -> logits (mbs, seq, vocab)
  The slices travel as separate tensors and are concatenated once, in the last shard, whose
  output is the unsplit head's, so ``loss_fn`` is unchanged. A profile times ``loss_fn`` with the
  last layer, and the cross-entropy over the whole vocabulary costs about as much as the
  projection, so the last shard is the costliest (2 shards, CPU, bf16: about 30% and 70%).

Same model, same initial weights: for the same seed, every parameter of a split model equals
the unsplit model's (a half block or shard holds the whole layer's tensors, or their rows, under
the same names: ``ln.weight``, ``out.weight``, ...). The determinism rule (FORMATS.md section 4)
seeds torch with ``seed + index`` before ``build_layer(index)``; a layer whose index differs from
its unsplit index reseeds with ``seed + unsplit index``, builds the whole unsplit layer and keeps
its part. Layers are keyed by index in checkpoints, so a checkpoint of one granularity does not
resume under the other; a run started from the seed does not depend on the granularity.

``loss_fn`` is the token-mean cross-entropy against the next tokens; the data are tiny_gpt's
counting sequences (random start and stride, modulo ``data_vocab``).

Every expert takes part in every forward, even with no token routed to it (it then runs on an
empty batch), so ``torch.autograd.grad`` over a layer's parameters always finds all of them.

Optional hooks (docs/FORMATS.md section 4; the profiler uses them to fill a profile's layer
``name`` and ``kind``): ``layer_kind(index, **config)`` returns "embedding" (first), "mamba" (a
block or either half of a split one), "attention", "moe", "head-shard" (a head shard but the last;
"head" is reserved for the last layer), "head" (last); ``layer_name(index, **config)`` returns
"embed", "<kind>.<block index>", "mamba.<block index>.conv" / ".scan", "head" or "head.<shard>".

Shared pieces come from ``tiny_gpt.py`` beside it, imported by name: a model file's folder is on
the import path.
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
    "HeadShard",
]

NAME = "hybrid"


import tiny_gpt as _gpt  # noqa: E402  (beside this file: a model file's folder is on the import path)

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
    head_shards: int = 1  # the LM head as this many layers, one vocabulary slice each
    split_mamba: bool = False  # each Mamba-style block as two layers (conv, scan)


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
    # bool is an int subclass: head_shards=true would silently mean one shard
    if not isinstance(cfg.head_shards, int) or isinstance(cfg.head_shards, bool) or not 1 <= cfg.head_shards <= cfg.vocab:
        raise InputError(__file__, "config.head_shards", f"{cfg.head_shards!r} is not an int in 1..vocab={cfg.vocab}",
                         "use e.g. head_shards=2 (1 keeps the head one layer)")
    if not isinstance(cfg.split_mamba, bool):
        raise InputError(__file__, "config.split_mamba", f"{cfg.split_mamba!r} is not true or false",
                         "use split_mamba=true or split_mamba=false")
    return cfg


class MambaStyleBlock(nn.Module):
    """x + out(scan(silu(conv(in_x))) * silu(in_z)): a gated, selective state-space mixer.

    The scan is h_t = a_t * h_{t-1} + (1 - a_t) * u_t per channel, with the decay a_t in (0, 1)
    computed from u_t (the "selective" part). It runs as a loop over time: at these sizes that
    is several times faster on a CPU than the parallel (seq x seq) form, and it makes the block
    what real SSM layers often are, bound by many small kernels rather than by FLOPs.

    ``part``: "whole" (x -> hidden), or one half of a split block (module docstring): "conv"
    (x -> (x, u, z)) or "scan" ((x, u, z) -> hidden). A half draws the whole block's weights, then
    drops the other half's, so it holds the tensors a whole block built from the same RNG state
    holds, under the same names.
    """

    PARTS = ("whole", "conv", "scan")

    def __init__(self, hidden: int, *, expand: int, kernel: int, part: str = "whole"):
        super().__init__()
        if part not in self.PARTS:
            raise ValueError(f"part {part!r} is not one of {self.PARTS}")
        self.part = part
        inner = expand * hidden
        self.ln = nn.LayerNorm(hidden)
        self.in_proj = nn.Linear(hidden, 2 * inner)
        self.conv = nn.Conv1d(inner, inner, kernel, groups=inner)  # holds the weights; see _causal_conv
        self.decay = nn.Linear(inner, inner)
        self.skip = nn.Parameter(torch.ones(inner))
        self.out_proj = nn.Linear(inner, hidden)
        # Start with slow decay (a ~ 0.9) so the state remembers across the sequence.
        nn.init.constant_(self.decay.bias, 2.0)
        if part == "conv":
            del self.decay, self.skip, self.out_proj
        elif part == "scan":
            del self.ln, self.in_proj, self.conv

    def forward(self, x: torch.Tensor, u: torch.Tensor | None = None, z: torch.Tensor | None = None):
        if self.part != "scan":
            u, z = self._convolve(x)
        if self.part == "conv":
            return x, u, z
        return self._scan(x, u, z)

    def _convolve(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The conv half: the scan's input ``u`` after the causal conv, and the gate's ``z``."""
        u, z = self.in_proj(self.ln(x)).chunk(2, dim=-1)
        return F.silu(self._causal_conv(u)), z  # (mbs, seq, inner) each

    def _scan(self, x: torch.Tensor, u: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The scan half: selective scan over time, gate, output projection, residual."""
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


class HeadShard(nn.Module):
    """One of ``head_shards`` layers of the LM head: the logits of vocabulary rows ``rows``.

    Built from a whole ``LMHead`` (the sibling tiny_gpt's): keeps its rows of the projection, and,
    in the first shard, its LayerNorm. The tuples between shards are described in the module
    docstring: the first shard normalizes and starts the tuple, each later one appends its slice,
    the last concatenates the slices into the full logits.
    """

    def __init__(self, head: nn.Module, rows: slice, *, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.ln = head.ln
        weight = head.out.weight[rows]
        self.out = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        self.out.weight = nn.Parameter(weight.detach().clone())

    def forward(self, *args: torch.Tensor):
        if self.first:
            normed, slices = self.ln(args[0]), ()
        else:
            normed, *slices = args
        logits = self.out(normed)
        if self.last:
            return torch.cat((*slices, logits), dim=-1)
        return (normed, *slices, logits)


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


@dataclass(frozen=True)
class _Piece:
    """One chain layer: a whole layer of the unsplit model, or a part of one."""

    name: str
    kind: str
    unsplit: int  # the layer's index in the unsplit model (the default config)
    half: str = "whole"  # a Mamba-style block's part (MambaStyleBlock.PARTS)
    shard: int | None = None  # the head shard's index; None for the whole head


def _pieces(cfg: HybridConfig) -> list[_Piece]:
    """The chain's layers under ``cfg``: the module docstring's list, in order."""
    pieces = [_Piece("embed", "embedding", 0)]
    for block, letter in enumerate(cfg.pattern):
        kind, unsplit = _BLOCK_KINDS[letter], block + 1
        if kind == "mamba" and cfg.split_mamba:
            pieces += [_Piece(f"mamba.{block}.{half}", kind, unsplit, half=half) for half in ("conv", "scan")]
        else:
            pieces.append(_Piece(f"{kind}.{block}", kind, unsplit))
    head = len(cfg.pattern) + 1
    if cfg.head_shards == 1:
        pieces.append(_Piece("head", "head", head))
    else:
        last = cfg.head_shards - 1
        pieces += [_Piece(f"head.{k}", "head" if k == last else "head-shard", head, shard=k) for k in range(cfg.head_shards)]
    return pieces


def _piece(cfg: HybridConfig, index: int) -> _Piece:
    pieces = _pieces(cfg)
    if not 0 <= index < len(pieces):
        raise IndexError(f"layer {index} out of range 0..{len(pieces) - 1}")
    return pieces[index]


def _vocab_rows(vocab: int, shards: int, shard: int) -> slice:
    """Shard ``shard``'s contiguous vocabulary slice; the first ``vocab % shards`` are one row longer."""
    size, longer = divmod(vocab, shards)
    start = shard * size + min(shard, longer)
    return slice(start, start + size + (shard < longer))


def num_layers(**config) -> int:
    return len(_pieces(_config(config)))


def layer_kind(index: int, **config) -> str:
    return _piece(_config(config), index).kind


def layer_name(index: int, **config) -> str:
    return _piece(_config(config), index).name


def build_layer(index: int, **config) -> nn.Module:
    cfg = _config(config)
    piece = _piece(cfg, index)
    if piece.unsplit != index:
        # The caller seeded torch with seed + index (FORMATS.md section 4). Draw as the unsplit
        # model draws this layer, seeded with seed + its unsplit index, so that splitting changes
        # the chain but not the model's initial weights.
        torch.manual_seed(torch.initial_seed() - index + piece.unsplit)
    if piece.kind == "embedding":
        return _gpt.TokenEmbedding(cfg.vocab, cfg.hidden, cfg.seq)
    if piece.kind in ("head", "head-shard"):
        head = _gpt.LMHead(cfg.hidden, cfg.vocab)
        if piece.shard is None:
            return head
        rows = _vocab_rows(cfg.vocab, cfg.head_shards, piece.shard)
        return HeadShard(head, rows, first=piece.shard == 0, last=piece.shard == cfg.head_shards - 1)
    if piece.kind == "mamba":
        return MambaStyleBlock(cfg.hidden, expand=cfg.state_expand, kernel=cfg.conv_kernel, part=piece.half)
    if piece.kind == "attention":
        return AttentionBlock(cfg.hidden, cfg.heads)
    return MoEBlock(cfg.hidden, experts=cfg.experts, top_k=cfg.top_k, expert_hidden=cfg.expert_hidden)


def sample_batch(microbatch_size: int, generator: torch.Generator, **config) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = _config(config)
    return _gpt.stride_sequences(microbatch_size, generator, seq=cfg.seq, data_vocab=cfg.data_vocab)


def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return _gpt.token_cross_entropy(outputs, targets)
