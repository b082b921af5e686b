"""Per-block cost accounting: which matmuls, attention, scans, memory-bound ops, collectives and
saved tensors each kind of block has.

Byte counts are per token and bf16 (2 bytes) unless a comment says fp32; they are written for
the whole layer and :class:`~octoplan.arch.costmodel.LayerAccount` divides them by tp. The op
lists follow the public reference implementations (Hugging Face transformers, Megatron-LM,
mamba_ssm); docs/COST_MODEL.md tabulates them.
"""

from __future__ import annotations

from dataclasses import dataclass

from octoplan.arch.architectures import MLA, Arch, Attention, Block, Mamba1, Mamba2, Mlp, Moe, Projector
from octoplan.arch.costmodel import (
    BYTES,
    SELECTIVE_SCAN_FLOPS,
    CostModel,
    LayerAccount,
    LayerCost,
    attention_pairs,
    inter_node,
)
from octoplan.arch.gpus import GPUS_PER_NODE

__all__ = ["Shape", "embedding_cost", "block_cost", "head_cost", "output_bytes"]


@dataclass(frozen=True)
class Shape:
    """Token counts of one microbatch."""

    batch: int
    seq: int  # LLM sequence length (text + image tokens)
    vision_seqs: int = 0  # image tiles in the microbatch
    vision_seq: int = 0  # ViT positions per tile
    image_tokens: int = 0  # LLM tokens the images become, whole microbatch

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def text_tokens(self) -> int:
        return self.tokens - self.image_tokens

    @property
    def vision_tokens(self) -> int:
        return self.vision_seqs * self.vision_seq


def _norm_params(hidden: int, layer_norm: bool) -> int:
    return 2 * hidden if layer_norm else hidden


def _attention(acct: LayerAccount, a: Attention, hidden: int, *, seqs: int, seq: int) -> None:
    tokens = seqs * seq
    q, kv = a.heads * a.head_dim, a.kv_heads * a.head_dim
    norms = 2 if a.post_norm else 1
    acct.weights(norms * _norm_params(hidden, a.layer_norm) + (hidden if a.layer_scale else 0))
    if a.qk_norm:
        acct.weights(2 * a.head_dim)
    acct.linear(tokens, hidden, q + 2 * kv, split="col", bias=a.bias)
    acct.linear(tokens, q, hidden, split="row", bias=a.bias)
    pairs = seqs * attention_pairs(seq, causal=a.causal, window=a.window)
    acct.attention(
        flops=2.0 * pairs * (a.head_dim + a.head_dim) * a.heads / acct.tp,
        io_bytes=BYTES * tokens * (2 * q + 2 * kv) / acct.tp,
    )
    # elements read + written per token: each norm 2h, residual add 3h, rotary 2(q+kv), ...
    moved = norms * 2 * hidden + 3 * hidden
    moved += 2 * (q + kv) if a.rope else 0
    moved += 2 * (q + kv) if a.qk_norm else 0
    moved += 2 * hidden if a.layer_scale else 0
    acct.elementwise(BYTES * tokens * moved)
    # saved: norm input(s), qkv input, q/k/v, attention output (= o_proj input), fp32 logsumexp
    saved = BYTES * (norms * hidden + hidden + (q + 2 * kv) + q + (q + kv if a.qk_norm else 0)) + 4 * a.heads
    acct.save(saved * tokens)
    acct.w_reads(BYTES * tokens * norms * hidden)  # the norms' inputs, for their scales
    acct.tp_collective(BYTES * tokens * hidden)


def _mla(acct: LayerAccount, m: MLA, hidden: int, *, seqs: int, seq: int) -> None:
    tokens = seqs * seq
    d_qk = m.qk_nope_dim + m.qk_rope_dim
    acct.weights(hidden + m.q_lora_rank + m.kv_lora_rank)  # pre-norm, q_a and kv_a norms
    # The down-projections are small and replicated across tp (Megatron-LM's MLA).
    acct.linear(tokens, hidden, m.q_lora_rank, split=None)
    acct.linear(tokens, hidden, m.kv_lora_rank + m.qk_rope_dim, split=None, shared_input=True)
    acct.linear(tokens, m.q_lora_rank, m.heads * d_qk, split="col")
    acct.linear(tokens, m.kv_lora_rank, m.heads * (m.qk_nope_dim + m.v_dim), split="col")
    acct.linear(tokens, m.heads * m.v_dim, hidden, split="row")
    pairs = seqs * attention_pairs(seq, causal=True, window=None)
    acct.attention(
        flops=2.0 * pairs * (d_qk + m.v_dim) * m.heads / acct.tp,
        io_bytes=BYTES * tokens * m.heads * (2 * d_qk + 2 * m.v_dim) / acct.tp,
    )
    acct.elementwise(BYTES * tokens * (2 * hidden + 3 * hidden))  # pre-norm + residual
    acct.elementwise(BYTES * tokens * 2 * (m.q_lora_rank + m.kv_lora_rank), sharded=False)  # latent norms
    # rotary on q_rope / k_rope, and assembling q and k from their nope and rope parts
    acct.elementwise(BYTES * tokens * (2 * m.heads * m.qk_rope_dim + 4 * m.heads * d_qk))
    # saved: norm input, down-projection input, q/k/v, output, fp32 logsumexp; replicated latents
    acct.save(tokens * (BYTES * (hidden + hidden + m.heads * (2 * d_qk + m.v_dim) + m.heads * m.v_dim) + 4 * m.heads))
    acct.save(BYTES * tokens * (2 * m.q_lora_rank + 2 * m.kv_lora_rank + m.qk_rope_dim), sharded=False)
    acct.w_reads(BYTES * tokens * hidden)  # the pre-norm's input
    acct.w_reads(BYTES * tokens * (m.q_lora_rank + m.kv_lora_rank), sharded=False)  # the latent norms'
    acct.tp_collective(BYTES * tokens * hidden)


def _mamba2(acct: LayerAccount, mb: Mamba2, hidden: int, *, tokens: int) -> None:
    inner = mb.heads * mb.head_dim
    bc = 2 * mb.groups * mb.state
    conv_dim = inner + bc
    proj = 2 * inner + bc + mb.heads  # z, x, B, C, dt
    acct.weights(hidden)
    acct.weights(conv_dim * (mb.conv + 1) + 3 * mb.heads + inner, split=True)  # conv, dt_bias/A/D, gated norm
    acct.linear(tokens, hidden, proj, split="col")
    acct.linear(tokens, inner, hidden, split="row")
    # SSD (Mamba-2 paper, sec. 6): per token, the intra-chunk C B^T (per group, causal half),
    # its product with X (per head, causal half), chunk states B^T X and the state output C h.
    ssd_flops = tokens * (mb.groups * mb.chunk * mb.state + mb.heads * (mb.chunk * mb.head_dim + 4 * mb.state * mb.head_dim))
    # read x, B, C, dt; write y; fp32 chunk states written and read once per chunk
    ssd_bytes = tokens * (BYTES * (2 * inner + bc + mb.heads) + 2 * 4 * mb.heads * mb.head_dim * mb.state / mb.chunk)
    acct.scan(tensor_flops=ssd_flops / acct.tp, io_bytes=ssd_bytes / acct.tp)
    # pre-norm, residual, conv1d+SiLU, gated RMSNorm (reads y and z, writes)
    acct.elementwise(BYTES * tokens * (2 * hidden + 3 * hidden + 2 * conv_dim + 3 * inner))
    acct.save(BYTES * tokens * (hidden + hidden + proj + conv_dim + inner + inner))
    acct.w_reads(BYTES * tokens * (hidden + inner))  # the pre-norm's and the gated norm's inputs
    acct.tp_collective(BYTES * tokens * hidden)


def _mamba1(acct: LayerAccount, mb: Mamba1, hidden: int, *, tokens: int) -> None:
    d, n, r = mb.inner, mb.state, mb.dt_rank
    acct.weights(hidden + ((r + 2 * n) if mb.inner_norms else 0))
    acct.weights(d * (mb.conv + 1) + d + d * n + d, split=True)  # conv, dt bias, A_log, D
    acct.linear(tokens, hidden, 2 * d, split="col")
    acct.linear(tokens, d, r + 2 * n, split="row")
    acct.linear(tokens, r, d, split="col")
    acct.linear(tokens, d, hidden, split="row")
    # Selective scan (Gu & Dao 2023): runs on CUDA cores in fp32; reads u, delta, z, B, C, writes y.
    acct.scan(
        fp32_flops=tokens * _selective_scan_flops(mb) / acct.tp,
        io_bytes=BYTES * tokens * (4 * d + 2 * n) / acct.tp,
    )
    per_token = 2 * hidden + 3 * hidden + 2 * d + 2 * d  # norm, residual, conv+SiLU, softplus(dt)
    acct.elementwise(BYTES * tokens * per_token)
    if mb.inner_norms:
        acct.elementwise(BYTES * tokens * 2 * (r + 2 * n), sharded=False)
    acct.save(BYTES * tokens * (hidden + hidden + 2 * d + d + (r + 2 * n) + d + d))
    acct.w_reads(BYTES * tokens * hidden)  # the pre-norm's input
    if mb.inner_norms:
        acct.w_reads(BYTES * tokens * (r + 2 * n), sharded=False)
    acct.tp_collective(BYTES * tokens * (r + 2 * n))  # x_proj is row-parallel
    acct.tp_collective(BYTES * tokens * hidden)


def _selective_scan_flops(mb: Mamba1) -> float:
    """fp32 operations of the selective scan per token."""
    return SELECTIVE_SCAN_FLOPS * mb.inner * mb.state


def _mlp(acct: LayerAccount, f: Mlp, hidden: int, *, tokens: int) -> None:
    norms = 2 if f.post_norm else 1
    acct.weights(norms * _norm_params(hidden, f.layer_norm) + (hidden if f.layer_scale else 0))
    up = 2 * f.ffn if f.gated else f.ffn
    acct.linear(tokens, hidden, up, split="col", bias=f.bias)
    acct.linear(tokens, f.ffn, hidden, split="row", bias=f.bias)
    act = 3 * f.ffn if f.gated else 2 * f.ffn  # SwiGLU reads 2 writes 1; GELU/relu^2 reads 1 writes 1
    per_token = norms * 2 * hidden + 3 * hidden + act + (2 * hidden if f.layer_scale else 0)
    acct.elementwise(BYTES * tokens * per_token)
    # saved: norm input(s), up input, gate/up outputs (or fc1 output), down input
    acct.save(BYTES * tokens * (norms * hidden + hidden + up + f.ffn))
    acct.w_reads(BYTES * tokens * norms * hidden)  # the norms' inputs
    acct.tp_collective(BYTES * tokens * hidden)


def _moe(acct: LayerAccount, m: Moe, hidden: int, *, tokens: int) -> None:
    e, k, f = m.experts, m.top_k, m.expert_ffn
    acct.weights(hidden + (e if m.router_bias else 0))
    acct.linear(tokens, hidden, e, split="seq")  # router
    if m.shared_experts:
        acct.linear(tokens, hidden, 2 * m.shared_experts * f, split="col", shared_input=True)  # the router's input
        acct.linear(tokens, m.shared_experts * f, hidden, split="row")
    # Expert parallelism: each GPU of the ep group holds experts/ep experts and, with balanced
    # routing, each expert sees tokens * top_k * ep / experts tokens of this microbatch's size.
    local = e // m.ep
    per_expert = tokens * k * m.ep / e
    before = acct.params
    acct.linear(per_expert, hidden, 2 * f, split="col", count=local)
    acct.linear(per_expert, f, hidden, split="row", count=local)
    local_params = acct.params - before
    # param_bytes holds every expert (the layer's full weights); the ep-sharded share is reported apart.
    remote = (e - local) * (local_params // local)
    acct.params += remote
    acct.remote_expert_params += remote
    per_token = 2 * hidden + 3 * hidden  # pre-norm, residual
    per_token += 3 * e  # router logits (bf16) -> probabilities (fp32)
    per_token += hidden + k * hidden  # permute: read token, write k copies
    per_token += k * hidden + hidden  # unpermute and weighted sum
    per_token += 3 * f * (k + m.shared_experts)  # SwiGLU of every expert a token visits
    acct.elementwise(BYTES * tokens * per_token)
    saved = hidden + hidden + 2 * e + k * hidden + 3 * k * f + k * hidden + 3 * m.shared_experts * f
    acct.save(BYTES * tokens * saved)
    acct.w_reads(BYTES * tokens * hidden)  # the pre-norm's input
    acct.tp_collective(BYTES * tokens * hidden)
    if m.ep > 1:
        local_tokens = tokens / acct.tp
        if inter_node(m.ep):
            nodes = m.ep // GPUS_PER_NODE
            destinations = min(k, m.node_limit or k, nodes)
            leaving = BYTES * local_tokens * destinations * hidden * (nodes - 1) / nodes
        else:
            leaving = BYTES * local_tokens * k * hidden * (m.ep - 1) / m.ep
        acct.expert_all_to_all(leaving, inter_node=inter_node(m.ep))


def _projector(acct: LayerAccount, p: Projector, hidden: int, *, shape: Shape) -> None:
    images = shape.image_tokens
    acct.weights(2 * p.in_dim)
    acct.linear(images, p.in_dim, p.hidden, split="col", bias=True)
    acct.linear(images, p.hidden, hidden, split="row", bias=True)
    # pixel shuffle (copy), LayerNorm, GELU; then scatter into the token sequence
    acct.elementwise(BYTES * images * (2 * p.in_dim + 2 * p.in_dim + 2 * p.hidden))
    acct.elementwise(BYTES * shape.tokens * 2 * hidden)
    acct.save(BYTES * images * (p.in_dim + p.in_dim + p.hidden + p.hidden))
    acct.w_reads(BYTES * images * p.in_dim)  # the LayerNorm's input
    acct.tp_collective(BYTES * images * hidden)


def _mtp_extra(acct: LayerAccount, hidden: int, *, tokens: int) -> None:
    """DeepSeek-V3 MTP module, before its block: embed token t+1, norm both inputs, eh_proj."""
    acct.weights(2 * hidden)
    acct.linear(tokens, 2 * hidden, hidden, split="col")
    acct.elementwise(BYTES * tokens * (2 * hidden + 2 * 2 * hidden))  # embedding gather, two norms
    acct.save(BYTES * tokens * (2 * hidden + 2 * hidden))
    acct.w_reads(BYTES * tokens * 2 * hidden)  # the two norms' inputs
    acct.tp_collective(BYTES * tokens * hidden)


def embedding_cost(arch: Arch, model: CostModel, *, shape: Shape) -> LayerCost:
    """Token embedding (vocab-parallel under tp), plus the ViT patch embedding for a VLM."""
    acct = LayerAccount(model)
    h = arch.hidden
    text = shape.text_tokens
    acct.weights(arch.vocab * h, split=True)
    # gather rows (read + write h per token), Gemma's sqrt(h) scaling another pass; no input grad
    passes = 2 if arch.embed_scale else 1
    acct.elementwise(BYTES * text * 2 * h * passes, sharded=False, backward=False)
    acct.weight_grad_memory(BYTES * text * 3 * h)  # scatter-add: read grad, read+write rows
    acct.keep_for_w(BYTES * text * h)  # which needs the output's gradient: no I, so it waits for W
    acct.save(8 * text, sharded=False)  # int64 token ids
    acct.w_reads(8 * text, sharded=False)  # which the scatter-add reads
    acct.tp_collective(BYTES * text * h, backward=False)
    if arch.vision is not None:
        v = arch.vision
        patch_in = 3 * v.patch * v.patch
        patches = shape.vision_seqs * v.patches_per_tile
        acct.linear(patches, patch_in, v.hidden, split="col", bias=True, input_grad=False)
        acct.weights(v.positions_per_tile * v.hidden + (v.hidden if v.cls_token else 0))
        # add position embedding, prepend CLS; backward is the patch weight gradient's input only
        acct.elementwise(BYTES * shape.vision_tokens * 3 * v.hidden, backward=False)
        acct.save(BYTES * patches * patch_in)
    return acct.result()


def block_cost(arch: Arch, block: Block, model: CostModel, *, shape: Shape, part: str = "all") -> LayerCost:
    """One block: its optional MTP input stage, its mixer, its feed-forward part. ``part``:
    ``all``, or ``mixer`` (MTP input stage + mixer) or ``ffn`` alone; every cost is a sum over
    ops, so the two parts add up to the whole block exactly."""
    if part not in ("all", "mixer", "ffn"):
        raise ValueError(f"unknown block part {part!r}")
    acct = LayerAccount(model)
    if block.stream == "vision":
        assert arch.vision is not None
        hidden, seqs, seq = arch.vision.hidden, shape.vision_seqs, shape.vision_seq
    else:
        hidden, seqs, seq = arch.hidden, shape.batch, shape.seq
    tokens = seqs * seq
    mixer = block.mixer if part in ("all", "mixer") else None
    ffn = block.ffn if part in ("all", "ffn") else None
    if block.mtp and part != "ffn":
        _mtp_extra(acct, hidden, tokens=tokens)
    if isinstance(mixer, Attention):
        _attention(acct, mixer, hidden, seqs=seqs, seq=seq)
    elif isinstance(mixer, MLA):
        _mla(acct, mixer, hidden, seqs=seqs, seq=seq)
    elif isinstance(mixer, Mamba2):
        _mamba2(acct, mixer, hidden, tokens=tokens)
    elif isinstance(mixer, Mamba1):
        _mamba1(acct, mixer, hidden, tokens=tokens)
    if isinstance(ffn, Mlp):
        _mlp(acct, ffn, hidden, tokens=tokens)
    elif isinstance(ffn, Moe):
        _moe(acct, ffn, hidden, tokens=tokens)
    elif isinstance(ffn, Projector):
        _projector(acct, ffn, arch.hidden, shape=shape)
    return acct.result()


def head_cost(arch: Arch, model: CostModel, *, shape: Shape) -> LayerCost:
    """Final norm, output projection and cross-entropy; once more per MTP module (shared head)."""
    acct = LayerAccount(model)
    h, v = arch.hidden, arch.vocab
    streams = 1 + arch.num_mtp
    tokens = shape.tokens * streams
    acct.weights(h * streams)  # the main final norm and each MTP module's own
    acct.linear(tokens, h, v, split="col")  # a tied head still holds its own copy on the last stage
    # final norm (read + write h); cross-entropy forward reads the logits once (fused
    # log-sum-exp); Gemma 2's tanh soft-capping reads and writes them once more
    acct.elementwise(BYTES * tokens * 2 * h)
    acct.elementwise(BYTES * tokens * (v + (2 * v if arch.logit_softcap else 0)))
    # saved: norm input, projection input, logits (softmax kept for the CE backward), softcap input
    acct.save(BYTES * tokens * (h + h + v + (v if arch.logit_softcap else 0)))
    acct.w_reads(BYTES * tokens * h)  # the final norm's input; the logits only I reads
    acct.tp_collective(BYTES * tokens * h)
    acct.tp_collective(3 * 4 * tokens, backward=False)  # vocab-parallel CE: max, sum, target logit
    return acct.result()


def output_bytes(arch: Arch, block: Block | None, *, shape: Shape, tp: int, first: bool = False) -> int:
    """Bytes a layer sends to the next stage: its output activation, split over the tp ranks."""
    h = arch.hidden
    if (first and arch.vision is not None) or (block is not None and block.stream == "vision"):
        assert arch.vision is not None
        size = shape.vision_tokens * arch.vision.hidden + shape.text_tokens * h
    elif block is not None and block.mtp:
        size = 2 * shape.tokens * h  # the main stream's hidden state and the MTP module's
    else:
        size = shape.tokens * h
    return BYTES * size // tp
