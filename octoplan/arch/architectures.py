"""The architectures the analytic profiler knows, as plain data taken from their public configs.

Each architecture is a chain of blocks: one profile layer per block, plus the embedding before
and the head after. A block is a *mixer* (attention, MLA, Mamba-2, Mamba-1 or none) followed by
an optional *feed-forward* part (dense MLP, MoE, or the vision-language projector), each with
its pre-norm and residual. Numbers are copied from the model cards, config.json files and
papers named in each entry's ``sources``; docs/COST_MODEL.md lists them again with the
parameter counts they reproduce.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

__all__ = [
    "Attention",
    "MLA",
    "Mamba2",
    "Mamba1",
    "Mlp",
    "Moe",
    "Projector",
    "Block",
    "Vision",
    "Arch",
    "ARCHITECTURES",
]


@dataclass(frozen=True)
class Attention:
    """Grouped-query (or multi-head) softmax attention with flash-attention kernels."""

    heads: int
    kv_heads: int
    head_dim: int
    window: int | None = None  # sliding window (keys per query); None = full context
    causal: bool = True  # False: bidirectional (vision encoders)
    rope: bool = True
    qk_norm: bool = False  # per-head RMSNorm of q and k (Gemma 3)
    bias: bool = False  # biases on qkv and output projections (ViTs)
    post_norm: bool = False  # extra norm after the mixer (Gemma 2/3 "sandwich" norms)
    layer_norm: bool = False  # LayerNorm (weight + bias) instead of RMSNorm
    layer_scale: bool = False  # per-channel residual scale (InternViT)


@dataclass(frozen=True)
class MLA:
    """DeepSeek multi-head latent attention: low-rank q and joint low-rank k/v."""

    heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_dim: int


@dataclass(frozen=True)
class Mamba2:
    """Mamba-2 (SSD) mixer: in_proj -> depthwise conv -> chunked state-space scan -> gated norm -> out_proj."""

    heads: int
    head_dim: int
    state: int
    groups: int
    conv: int
    chunk: int


@dataclass(frozen=True)
class Mamba1:
    """Mamba-1 mixer (selective scan on CUDA cores), as in Jamba."""

    inner: int
    state: int
    conv: int
    dt_rank: int
    inner_norms: bool = False  # Jamba's RMSNorms on dt, B and C


@dataclass(frozen=True)
class Mlp:
    """Dense feed-forward: gated (SwiGLU/GeGLU, 3 matrices) or plain (GELU/squared-ReLU, 2)."""

    ffn: int
    gated: bool = True
    bias: bool = False
    post_norm: bool = False
    layer_norm: bool = False
    layer_scale: bool = False


@dataclass(frozen=True)
class Moe:
    """Mixture of experts: gated experts of width ``expert_ffn``, top-k routing, optional shared experts.

    ``ep`` is the expert-parallel degree assumed for the all-to-all and the tokens each expert
    sees; ``node_limit`` caps the nodes one token is sent to (DeepSeek-V3's node-limited routing).
    """

    experts: int
    top_k: int
    expert_ffn: int
    shared_experts: int = 0
    ep: int = 1
    node_limit: int | None = None
    router_bias: bool = False


@dataclass(frozen=True)
class Projector:
    """Vision-language projector (InternVL's mlp1): pixel shuffle, LayerNorm, Linear, GELU, Linear."""

    in_dim: int
    hidden: int


Mixer = Union[Attention, MLA, Mamba2, Mamba1, None]
FeedForward = Union[Mlp, Moe, Projector, None]


@dataclass(frozen=True)
class Block:
    """One profile layer between the embedding and the head."""

    name: str
    kind: str
    mixer: Mixer
    ffn: FeedForward
    stream: str = "text"  # "vision": runs on image patches, carries the text embeddings along
    mtp: bool = False  # DeepSeek-V3 multi-token-prediction module (adds eh_proj and norms)


@dataclass(frozen=True)
class Vision:
    """Image side of a vision-language model: tiles of ``image_size`` pixels cut into patches."""

    hidden: int
    patch: int
    image_size: int
    tiles: int  # image tiles per sample (assumption, see COST_MODEL.md)
    tokens_per_tile: int  # LLM tokens per tile after the projector's pixel shuffle
    cls_token: bool = True

    @property
    def patches_per_tile(self) -> int:
        return (self.image_size // self.patch) ** 2

    @property
    def positions_per_tile(self) -> int:
        return self.patches_per_tile + (1 if self.cls_token else 0)


@dataclass(frozen=True)
class Arch:
    name: str
    description: str
    hidden: int
    vocab: int
    blocks: tuple[Block, ...]
    default_seq_len: int
    tied_embeddings: bool = False
    embed_scale: bool = False  # Gemma multiplies embeddings by sqrt(hidden)
    logit_softcap: bool = False  # Gemma 2 tanh soft-capping of the final logits
    vision: Vision | None = None
    sources: tuple[str, ...] = ()

    @property
    def num_mtp(self) -> int:
        return sum(1 for block in self.blocks if block.mtp)

    def tp_divisors(self) -> dict[str, int]:
        """Every dimension a tensor-parallel degree must divide, by name."""
        dims: dict[str, int] = {"vocab_size": self.vocab}
        for block in self.blocks:
            mixer, ffn = block.mixer, block.ffn
            if isinstance(mixer, Attention):
                dims[f"{block.kind}.attention_heads"] = mixer.heads
                dims[f"{block.kind}.kv_heads"] = mixer.kv_heads
            elif isinstance(mixer, MLA):
                dims[f"{block.kind}.attention_heads"] = mixer.heads
            elif isinstance(mixer, Mamba2):
                dims[f"{block.kind}.mamba_heads"] = mixer.heads
                dims[f"{block.kind}.mamba_groups"] = mixer.groups
            elif isinstance(mixer, Mamba1):
                dims[f"{block.kind}.mamba_inner"] = mixer.inner
            if isinstance(ffn, Mlp):
                dims[f"{block.kind}.ffn"] = ffn.ffn
            elif isinstance(ffn, Moe):
                dims[f"{block.kind}.expert_ffn"] = ffn.expert_ffn
            elif isinstance(ffn, Projector):
                dims["projector.hidden"] = ffn.hidden
        return dims


# --- builders: one function per family, parameters instead of copies --------------------------


def _dense_llm(
    *,
    prefix: str = "layers",
    num_layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    ffn: int,
    windows: tuple[int | None, ...] = (None,),
    sandwich: bool = False,
    qk_norm: bool = False,
) -> tuple[Block, ...]:
    """Pre-norm GQA + gated-MLP blocks; ``windows`` repeats over the layers (None = global)."""
    blocks = []
    for i in range(num_layers):
        window = windows[i % len(windows)]
        attn = Attention(heads, kv_heads, head_dim, window=window, qk_norm=qk_norm, post_norm=sandwich)
        kind = "transformer" if window is None else "transformer-swa"
        blocks.append(Block(f"{prefix}.{i}", kind, attn, Mlp(ffn, post_norm=sandwich)))
    return tuple(blocks)


def _llama3(name: str, description: str, *, num_layers: int, hidden: int, heads: int, ffn: int, card: str) -> Arch:
    return Arch(
        name=name,
        description=description,
        hidden=hidden,
        vocab=128256,
        blocks=_dense_llm(num_layers=num_layers, heads=heads, kv_heads=8, head_dim=128, ffn=ffn),
        default_seq_len=8192,
        sources=(card, "Grattafiori et al. 2024, The Llama 3 Herd of Models"),
    )


def _nemotron_h_8b() -> Arch:
    # Megatron-style hybrid_override_pattern: M = Mamba-2, - = MLP, * = attention.
    pattern = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
    mamba = Mamba2(heads=128, head_dim=64, state=128, groups=8, conv=4, chunk=128)
    attn = Attention(heads=32, kv_heads=8, head_dim=128, rope=False)
    mlp = Mlp(21504, gated=False)  # squared ReLU
    parts = {"M": ("mamba", mamba, None), "-": ("mlp", None, mlp), "*": ("attention", attn, None)}
    blocks = []
    for i, char in enumerate(pattern):
        kind, mixer, ffn = parts[char]
        blocks.append(Block(f"layers.{i}", kind, mixer, ffn))
    return Arch(
        name="nemotron-h-8b",
        description="Nemotron-H 8B: 52 blocks, Mamba-2 / MLP / attention pattern (24 M, 24 MLP, 4 attn)",
        hidden=4096,
        vocab=131072,
        blocks=tuple(blocks),
        default_seq_len=8192,
        sources=(
            "NVIDIA 2025, Nemotron-H: A Family of Accurate and Efficient Hybrid Mamba-Transformer Models",
            "nvidia/Nemotron-H-8B-Base-8K config.json (hybrid_override_pattern)",
            "Dao & Gu 2024, Transformers are SSMs (Mamba-2)",
        ),
    )


def _deepseek_v3() -> Arch:
    mla = MLA(heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64, v_dim=128)
    # 64-way EP over 8 nodes with each token sent to at most 4 nodes (DeepSeek-V3 report, 3.2).
    moe = Moe(experts=256, top_k=8, expert_ffn=2048, shared_experts=1, ep=64, node_limit=4, router_bias=True)
    blocks = [Block(f"layers.{i}", "transformer", mla, Mlp(18432)) for i in range(3)]
    blocks += [Block(f"layers.{i}", "moe", mla, moe) for i in range(3, 61)]
    blocks.append(Block("mtp.0", "mtp", mla, moe, mtp=True))
    return Arch(
        name="deepseek-v3",
        description="DeepSeek-V3 671B: MLA, 3 dense + 58 MoE blocks (256 routed + 1 shared, top-8), 1 MTP",
        hidden=7168,
        vocab=129280,
        blocks=tuple(blocks),
        default_seq_len=4096,
        sources=("DeepSeek-AI 2024, DeepSeek-V3 Technical Report", "deepseek-ai/DeepSeek-V3 config.json"),
    )


def _internvl2_8b() -> Arch:
    vision = Vision(hidden=1024, patch=14, image_size=448, tiles=4, tokens_per_tile=256)
    vit_attn = Attention(16, 16, 64, causal=False, rope=False, bias=True, layer_norm=True, layer_scale=True)
    vit_mlp = Mlp(4096, gated=False, bias=True, layer_norm=True, layer_scale=True)
    blocks = [Block(f"vision.{i}", "vision", vit_attn, vit_mlp, stream="vision") for i in range(24)]
    blocks.append(Block("projector", "projector", None, Projector(in_dim=4 * 1024, hidden=4096)))
    blocks += _dense_llm(num_layers=32, heads=32, kv_heads=8, head_dim=128, ffn=14336)
    return Arch(
        name="internvl2-8b",
        description="InternVL2-8B: InternViT-300M (24 blocks) + MLP projector + InternLM2.5-7B (32 blocks)",
        hidden=4096,
        vocab=92544,
        blocks=tuple(blocks),
        default_seq_len=4096,
        vision=vision,
        sources=(
            "Chen et al. 2024, How Far Are We to GPT-4V? (InternVL 1.5/2)",
            "OpenGVLab/InternViT-300M-448px and OpenGVLab/InternVL2-8B config.json",
            "internlm/internlm2_5-7b config.json",
        ),
    )


def _jamba() -> Arch:
    mamba = Mamba1(inner=8192, state=16, conv=4, dt_rank=256, inner_norms=True)
    attn = Attention(heads=32, kv_heads=8, head_dim=128, rope=False)
    moe = Moe(experts=16, top_k=2, expert_ffn=14336, ep=8)  # EP inside one NVLink node (assumption)
    blocks = []
    for i in range(32):
        # attn_layer_period 8, offset 4; expert_layer_period 2, offset 1 (Jamba config.json)
        is_attn = i % 8 == 4
        is_moe = i % 2 == 1
        mixer = attn if is_attn else mamba
        ffn = moe if is_moe else Mlp(14336)
        kind = ("attention" if is_attn else "mamba") + ("-moe" if is_moe else "-mlp")
        blocks.append(Block(f"layers.{i}", kind, mixer, ffn))
    return Arch(
        name="jamba-v0.1",
        description="Jamba v0.1 52B: 32 blocks, Mamba:attention 7:1, MoE (16 experts, top-2) every other block",
        hidden=4096,
        vocab=65536,
        blocks=tuple(blocks),
        default_seq_len=8192,
        sources=("Lieber et al. 2024, Jamba: A Hybrid Transformer-Mamba Language Model", "ai21labs/Jamba-v0.1 config.json"),
    )


ARCHITECTURES: dict[str, Arch] = {
    arch.name: arch
    for arch in (
        _llama3(
            "llama3-8b",
            "Llama 3 8B: 32 blocks, GQA 32/8 heads, SwiGLU 14336, vocab 128256",
            num_layers=32,
            hidden=4096,
            heads=32,
            ffn=14336,
            card="meta-llama/Meta-Llama-3-8B config.json",
        ),
        _llama3(
            "llama3-70b",
            "Llama 3 70B: 80 blocks, GQA 64/8 heads, SwiGLU 28672, vocab 128256",
            num_layers=80,
            hidden=8192,
            heads=64,
            ffn=28672,
            card="meta-llama/Meta-Llama-3-70B config.json",
        ),
        Arch(
            name="gemma2-27b",
            description="Gemma 2 27B: 46 blocks alternating sliding-window (4096) / global attention, vocab 256000",
            hidden=4608,
            vocab=256000,
            blocks=_dense_llm(num_layers=46, heads=32, kv_heads=16, head_dim=128, ffn=36864, windows=(4096, None), sandwich=True),
            default_seq_len=8192,
            tied_embeddings=True,
            embed_scale=True,
            logit_softcap=True,
            sources=("Gemma Team 2024, Gemma 2: Improving Open Language Models at a Practical Size", "google/gemma-2-27b config.json"),
        ),
        Arch(
            name="gemma3-27b",
            description="Gemma 3 27B (text): 62 blocks, 5 sliding-window (1024) : 1 global, vocab 262208",
            hidden=5376,
            vocab=262208,
            blocks=_dense_llm(
                num_layers=62,
                heads=32,
                kv_heads=16,
                head_dim=128,
                ffn=21504,
                windows=(1024, 1024, 1024, 1024, 1024, None),
                sandwich=True,
                qk_norm=True,
            ),
            default_seq_len=8192,
            tied_embeddings=True,
            embed_scale=True,
            sources=("Gemma Team 2025, Gemma 3 Technical Report", "google/gemma-3-27b-pt config.json (text_config)"),
        ),
        _nemotron_h_8b(),
        _deepseek_v3(),
        _internvl2_8b(),
        _jamba(),
    )
}
