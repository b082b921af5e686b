"""Analytic profiles (octoplan.arch): parameter counts against the published ones, closed-form
FLOPs, and the directions the cost model must get right (faster GPU, tp, sliding windows, the
vocabulary head, MoE vs dense, expert all-to-all)."""

from __future__ import annotations

import math

import pytest

from octoplan.arch import analytic_profile, list_architectures, list_gpus
from octoplan.arch.costmodel import attention_pairs
from octoplan.errors import InputError
from octoplan.profile import Profile, profile_from_dict, profile_to_dict

ARCHS = [name for name, _ in list_architectures()]
GPUS = [name for name, _ in list_gpus()]


def params(profile: Profile, *, tp: int = 1, kinds: set[str] | None = None) -> float:
    """The model's parameter count: what each GPU holds, plus the experts held by other ep ranks."""
    ep = profile.extra["cost_model"].get("expert_parallel", {})
    elsewhere = ep.get("expert_param_bytes_elsewhere_per_layer", {})
    return sum((layer.param_bytes + elsewhere.get(layer.kind, 0)) / 2 * tp
               for layer in profile.layers if kinds is None or layer.kind in kinds)


def test_catalogue_names_every_required_family():
    assert {"llama3-8b", "llama3-70b", "gemma2-27b", "gemma3-27b", "nemotron-h-8b", "deepseek-v3", "internvl2-8b", "jamba-v0.1"} <= set(ARCHS)
    assert GPUS == ["a100", "h100", "h200"]
    assert all(description for _, description in list_architectures() + list_gpus())


@pytest.mark.parametrize("arch", ARCHS)
def test_profile_shape_and_round_trip(arch):
    profile = analytic_profile(arch, "h100")
    assert profile.model.name == arch and profile.model.source is None
    assert profile.model.config["tp"] == 1 and profile.model.config["seq_len"] > 0
    assert profile.dtype == "bf16" and profile.microbatch_size == 1
    assert profile.device == {"name": "h100", "memory_gb": 80.0}
    kinds = [layer.kind for layer in profile.layers]
    assert kinds[0] == "embedding" and kinds[-1] == "head"
    assert "embedding" not in kinds[1:] and "head" not in kinds[:-1]
    assert 30 <= len(kinds) <= 130
    assert len({layer.name for layer in profile.layers}) == len(kinds)
    for layer in profile.layers[1:-1]:
        assert layer.forward_ms > 0 and layer.backward_input_ms > 0 and layer.backward_weight_ms > 0
        assert layer.param_bytes > 0 and layer.activation_bytes > 0 and layer.output_bytes > 0 and layer.flops > 0
    assert profile.layers[0].backward_input_ms == 0  # nothing before the embedding needs a gradient
    assert "cost_model" in profile.extra
    data = profile_to_dict(profile)
    again = profile_from_dict(data)
    assert profile_to_dict(again) == data
    assert [layer.kind for layer in again.layers] == kinds


def test_llama_parameter_counts_match_meta():
    assert params(analytic_profile("llama3-8b", "h100")) == pytest.approx(8.03e9, rel=0.02)
    assert params(analytic_profile("llama3-70b", "h100")) == pytest.approx(70.6e9, rel=0.02)
    # tp=2: weights split in two, only norm scales replicated
    assert params(analytic_profile("llama3-8b", "h100", tp=2), tp=2) == pytest.approx(8.03e9, rel=0.001)


def test_nemotron_h_parameter_count_is_exact():
    # 8,100,852,736 parameters in the published Nemotron-H-8B-Base-8K checkpoint
    assert params(analytic_profile("nemotron-h-8b", "h100")) == 8_100_852_736


def test_deepseek_v3_parameters_and_layout():
    profile = analytic_profile("deepseek-v3", "h100")
    kinds = [layer.kind for layer in profile.layers]
    assert kinds == ["embedding"] + ["transformer"] * 3 + ["moe"] * 58 + ["mtp", "head"]
    main = params(profile, kinds={"embedding", "transformer", "moe", "head"})
    assert main == pytest.approx(671e9, rel=0.01)
    assert params(profile) == pytest.approx(671e9, rel=0.03)  # plus the 11.6B MTP module
    dense, moe = profile.layers[1], profile.layers[4]
    elsewhere = profile.extra["cost_model"]["expert_parallel"]["expert_param_bytes_elsewhere_per_layer"]
    assert moe.param_bytes + elsewhere["moe"] > 15 * dense.param_bytes  # 257 experts vs one 18432-wide MLP
    assert moe.param_bytes < dense.param_bytes  # ...but one GPU holds 4 of the 256 routed experts
    assert moe.flops == pytest.approx(dense.flops, rel=0.05)  # ~ same active compute per token...
    breakdown = profile.extra["cost_model"]["layer_kinds"]
    assert "ep_comm" not in breakdown["transformer"]["breakdown_ms"]["F"]
    assert breakdown["moe"]["breakdown_ms"]["F"]["ep_comm"] > 0  # ...but the MoE pays the all-to-all
    assert moe.forward_ms > dense.forward_ms
    ep = profile.extra["cost_model"]["expert_parallel"]
    assert ep["ep"] == 64 and ep["param_bytes_per_gpu_with_ep"] == sum(layer.param_bytes for layer in profile.layers)
    assert ep["param_bytes_per_gpu_with_ep"] < params(profile) * 2 / 10
    assert profile.layers[-2].output_bytes == 2 * profile.layers[-3].output_bytes  # MTP forwards two streams


def test_other_parameter_counts_match_their_cards():
    gemma2 = analytic_profile("gemma2-27b", "h100")
    tied = 256000 * 4608  # the head's copy of the tied embedding
    assert params(gemma2) - tied == pytest.approx(27.2e9, rel=0.01)
    gemma3 = analytic_profile("gemma3-27b", "h100")
    assert params(gemma3) - 262208 * 5376 == pytest.approx(27.0e9, rel=0.01)
    assert params(analytic_profile("jamba-v0.1", "h100")) == pytest.approx(52e9, rel=0.02)
    vlm = analytic_profile("internvl2-8b", "h100")
    assert params(vlm) == pytest.approx(8.1e9, rel=0.01)
    assert params(vlm, kinds={"vision"}) == pytest.approx(0.30e9, rel=0.02)  # InternViT-300M


def test_llama_layer_flops_are_closed_form():
    seq, mbs = 4096, 2
    profile = analytic_profile("llama3-8b", "h100", seq_len=seq, microbatch_size=mbs)
    h, q, kv, ffn = 4096, 32 * 128, 8 * 128, 14336
    matmul_params = h * (q + 2 * kv) + q * h + 3 * h * ffn
    tokens = seq * mbs
    attention = 4 * (seq * (seq + 1) // 2) * mbs * 128 * 32  # causal QK^T and PV, every pair once
    assert profile.layers[1].flops == 2 * matmul_params * tokens + attention
    assert profile.layers[1].param_bytes == 2 * (matmul_params + 2 * h)
    assert profile.layers[-1].flops == 2 * tokens * h * 128256
    # Korthikanti et al. 2022: 34 s*b*h bytes without the score matrix (flash attention)
    assert profile.layers[1].activation_bytes == 34 * tokens * h + 4 * 32 * tokens
    assert profile.layers[1].output_bytes == 2 * tokens * h
    # what a split backward's I keeps for W: every matmul's output gradient (bf16): q, k, v,
    # the attention's output projection, gate and up, down; the head's logits; the embedding
    # its output's (for the scatter-add)
    assert profile.layers[1].pending_w_bytes == 2 * tokens * ((q + 2 * kv) + h + 2 * ffn + h)
    assert profile.layers[-1].pending_w_bytes == 2 * tokens * 128256
    assert profile.layers[0].pending_w_bytes == 2 * tokens * h
    # what W reads of the activations, held from I to W: each matmul's input (norm outputs,
    # the attention's output, the SwiGLU's) and each norm's input; the head's final norm and
    # projection inputs, not its logits; the embedding's token ids
    assert profile.layers[1].w_saved_bytes == 2 * tokens * ((h + h) + q + (h + h) + ffn)
    assert profile.layers[-1].w_saved_bytes == 2 * tokens * (h + h)
    assert profile.layers[0].w_saved_bytes == 8 * tokens == profile.layers[0].activation_bytes


def test_attention_pairs():
    assert attention_pairs(4, causal=True, window=None) == 10
    assert attention_pairs(4, causal=False, window=None) == 16
    assert attention_pairs(6, causal=True, window=2) == 1 + 2 * 5
    assert attention_pairs(6, causal=True, window=8) == 21


def test_newer_gpu_is_faster_for_the_same_layer():
    a100, h100, h200 = (analytic_profile("llama3-70b", gpu).layers[5] for gpu in ("a100", "h100", "h200"))
    assert h100.forward_ms < a100.forward_ms / 2.5  # 3.2x the bf16 peak
    assert h200.forward_ms < h100.forward_ms  # same peak, more bandwidth for the memory-bound ops
    assert h100.param_bytes == a100.param_bytes and h100.flops == a100.flops


def test_tensor_parallel_halves_compute_and_adds_collectives():
    one = analytic_profile("llama3-70b", "h100", tp=1)
    two = analytic_profile("llama3-70b", "h100", tp=2)
    f1 = one.extra["cost_model"]["layer_kinds"]["transformer"]["breakdown_ms"]["F"]
    f2 = two.extra["cost_model"]["layer_kinds"]["transformer"]["breakdown_ms"]["F"]
    assert f2["matmul"] == pytest.approx(f1["matmul"] / 2, rel=0.03)
    assert f1["tp_comm"] == 0 and f2["tp_comm"] > 0
    layer1, layer2 = one.layers[5], two.layers[5]
    assert layer2.forward_ms > layer1.forward_ms / 2
    assert layer2.backward_weight_ms == pytest.approx(layer1.backward_weight_ms / 2, rel=0.03)
    assert layer2.flops == pytest.approx(layer1.flops / 2)
    assert layer2.activation_bytes == pytest.approx(layer1.activation_bytes / 2, rel=0.001)
    assert layer2.output_bytes == layer1.output_bytes // 2
    # 2 all-reduces of the s*b*h activation in F: ring over 2 GPUs sends it once each
    expected = 2 * (0.010 + 2 * 8192 * 8192 / (450e9 * 0.8) * 1e3)
    assert f2["tp_comm"] == pytest.approx(expected, rel=1e-6)


def test_sliding_window_layers_are_cheaper_at_long_context():
    profile = analytic_profile("gemma2-27b", "h100", seq_len=32768)
    local, global_ = profile.layers[1], profile.layers[2]
    assert (local.kind, global_.kind) == ("transformer-swa", "transformer")
    assert local.param_bytes == global_.param_bytes
    assert local.forward_ms < global_.forward_ms and local.backward_input_ms < global_.backward_input_ms
    assert local.backward_weight_ms == pytest.approx(global_.backward_weight_ms)
    saved_pairs = 32768 * 32769 // 2 - (4096 * 4097 // 2 + (32768 - 4096) * 4096)
    assert global_.flops - local.flops == 4 * saved_pairs * 128 * 32
    short = analytic_profile("gemma2-27b", "h100", seq_len=4096)  # window covers everything
    assert short.layers[1].flops == short.layers[2].flops


def test_big_vocabulary_head_costs_several_blocks():
    for arch, blocks in (("gemma2-27b", 1.8), ("gemma3-27b", 2.5)):
        profile = analytic_profile(arch, "h100")
        head = profile.layers[-1]
        block = max(profile.layers[1:-1], key=lambda layer: layer.total_ms)
        assert head.total_ms > blocks * block.total_ms
        assert head.activation_bytes > block.activation_bytes  # the logits are kept for the loss


def test_hybrid_layer_patterns():
    nemotron = [layer.kind for layer in analytic_profile("nemotron-h-8b", "h100").layers[1:-1]]
    assert (nemotron.count("mamba"), nemotron.count("mlp"), nemotron.count("attention")) == (24, 24, 4)
    jamba = analytic_profile("jamba-v0.1", "h100")
    kinds = [layer.kind for layer in jamba.layers[1:-1]]
    assert sum(kind.startswith("attention") for kind in kinds) == 4  # 1 attention : 7 Mamba
    assert sum(kind.endswith("-moe") for kind in kinds) == 16  # every other block
    assert kinds[4] == "attention-mlp" and kinds[1] == "mamba-moe"
    mlp, moe = jamba.layers[1], jamba.layers[2]  # layers.0 mamba-mlp, layers.1 mamba-moe
    elsewhere = jamba.extra["cost_model"]["expert_parallel"]["expert_param_bytes_elsewhere_per_layer"]
    # 16 experts over ep = 8: a GPU holds 2, the other 14 are elsewhere.
    assert elsewhere["mamba-moe"] == 14 * 3 * 4096 * 14336 * 2
    assert moe.param_bytes + elsewhere["mamba-moe"] - mlp.param_bytes == 15 * 3 * 4096 * 14336 * 2 + 16 * 4096 * 2


def test_vision_language_model_layout():
    profile = analytic_profile("internvl2-8b", "h100", seq_len=4096)
    kinds = [layer.kind for layer in profile.layers]
    assert kinds == ["embedding"] + ["vision"] * 24 + ["projector"] + ["transformer"] * 32 + ["head"]
    vit = profile.layers[1]
    # bidirectional attention over 4 tiles of 1025 positions: every pair counted
    attention = 4 * 1025 * 1025 * 4 * 64 * 16
    vit_matmuls = 2 * 4 * 1025 * (1024 * 3 * 1024 + 1024 * 1024 + 2 * 1024 * 4096)
    assert vit.flops == vit_matmuls + attention
    # a vision layer forwards the image activations and the text embeddings it carries along
    assert vit.output_bytes == 2 * (4 * 1025 * 1024 + (4096 - 1024) * 4096)
    assert profile.layers[25].output_bytes == 2 * 4096 * 4096


def test_microbatch_and_seq_len_scale_costs():
    one = analytic_profile("llama3-8b", "h100", seq_len=2048, microbatch_size=1).layers[3]
    four = analytic_profile("llama3-8b", "h100", seq_len=2048, microbatch_size=4).layers[3]
    assert four.flops == pytest.approx(4 * one.flops)
    assert four.activation_bytes == 4 * one.activation_bytes
    assert one.forward_ms < four.forward_ms < 4.2 * one.forward_ms
    assert four.param_bytes == one.param_bytes


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"arch": "gpt5"}, "--arch"),
        ({"gpu": "b300"}, "--gpu"),
        ({"seq_len": 0}, "--seq-len"),
        ({"seq_len": 1.5}, "--seq-len"),
        ({"microbatch_size": -1}, "--microbatch-size"),
        ({"tp": 3}, "--tp"),
        ({"tp": 16}, "--tp"),
        ({"tp": True}, "--tp"),
        ({"arch": "internvl2-8b", "seq_len": 512}, "--seq-len"),
    ],
)
def test_bad_input_raises_input_error(kwargs, field):
    args = {"arch": "llama3-8b", "gpu": "h100"} | kwargs
    arch, gpu = args.pop("arch"), args.pop("gpu")
    with pytest.raises(InputError) as info:
        analytic_profile(arch, gpu, **args)
    assert info.value.field == field and info.value.file is None and info.value.fix
    if field == "--arch":
        assert "llama3-8b" in info.value.fix and "deepseek-v3" in info.value.fix
    if field == "--gpu":
        assert "h100" in info.value.fix


def test_tp_divisibility_lists_valid_degrees():
    with pytest.raises(InputError) as info:
        analytic_profile("llama3-8b", "h100", tp=16)
    assert "[1, 2, 4, 8]" in info.value.fix
    profile = analytic_profile("deepseek-v3", "a100", tp=8)
    assert profile.model.config["tp"] == 8 and all(math.isfinite(layer.forward_ms) for layer in profile.layers)


def test_yaml_file_round_trip(tmp_path):
    from octoplan.profile import load_profile, save_profile

    for arch in ("jamba-v0.1", "deepseek-v3"):
        profile = analytic_profile(arch, "a100", seq_len=2048, microbatch_size=2, tp=2)
        path = tmp_path / f"{arch}.yaml"
        save_profile(profile, path)
        loaded = load_profile(path)
        assert profile_to_dict(loaded) == profile_to_dict(profile)
        assert loaded.extra["cost_model"]["gpu"]["name"] == "a100"


@pytest.mark.parametrize("arch", ARCHS)
def test_split_blocks_halves_add_up_to_the_block(arch):
    whole = analytic_profile(arch, "h100")
    split = analytic_profile(arch, "h100", split_blocks=True)
    assert split.model.config["split_blocks"] is True
    halves = {layer.name: layer for layer in split.layers}
    paired = 0
    for layer in whole.layers:
        if layer.name in halves:  # embedding, head, projector: nothing to split
            assert halves[layer.name] == layer
            continue
        mixer, ffn = halves[f"{layer.name}.mixer"], halves[f"{layer.name}.ffn"]
        assert (mixer.kind, ffn.kind) == (f"{layer.kind}.mixer", f"{layer.kind}.ffn")
        for name in ("forward_ms", "backward_input_ms", "backward_weight_ms", "flops"):
            assert getattr(mixer, name) + getattr(ffn, name) == pytest.approx(getattr(layer, name), rel=1e-12), name
        for name in ("param_bytes", "activation_bytes"):
            assert abs(getattr(mixer, name) + getattr(ffn, name) - getattr(layer, name)) <= 1, name
        assert mixer.output_bytes == ffn.output_bytes == layer.output_bytes  # the residual stream
        assert mixer.forward_ms > 0 and ffn.forward_ms > 0
        paired += 1
    assert len(split.layers) == len(whole.layers) + paired
    # Nemotron-H's layers are already one mixer or one MLP each; every other family has blocks with both
    assert paired >= len(whole.layers) // 3 if arch != "nemotron-h-8b" else paired == 0
    # the split profile's order: each block's mixer right before its feed-forward part
    names = [layer.name for layer in split.layers]
    assert all(names[names.index(f"{n[:-4]}.mixer") + 1] == n for n in names if n.endswith(".ffn"))


def test_profile_command_writes_a_split_block_profile(tmp_path):
    import subprocess
    import sys

    from octoplan.profile import load_profile

    out = tmp_path / "llama-split.yaml"
    done = subprocess.run([sys.executable, "-m", "octoplan.cli", "profile", "--arch", "llama3-8b", "--gpu", "h100",
                           "--split-blocks", "-o", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    profile = load_profile(out)
    # embedding + 32 blocks x (mixer, ffn) + head
    assert profile.num_layers == 66 and profile.layers[1].name.endswith(".mixer") and profile.layers[2].name.endswith(".ffn")
    assert profile.model.config["split_blocks"] is True
