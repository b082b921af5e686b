"""hf:FOLDER: Hugging Face transformers models as chains of their own modules (octoplan.hf).

Every family is a tiny config built here, saved with transformers' save_pretrained (so its
safetensors files are in the hub's format: MoE experts one matrix each, LLaVA's legacy keys),
and compared with the transformers model itself: its own loss (labels=...), its gradients, and
its own SGD step against octorun running a 1F1B pp-4 plan and a tuned plan.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from octoplan.cli import app
from octoplan.errors import InputError
from octoplan.modelfile import as_args, load_model_file
from octoplan.plan import load_plan

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from tests import runtime_helpers as h  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SEQ = 6
MBS = 2
LR = 0.5


def _text(model_type: str, **extra):
    base = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2)  # 4 decoder layers: a 1F1B pp-4 plan pins the embedding and head to the ends
    return transformers.AutoConfig.for_model(model_type, **{**base, **extra})


FAMILIES = {
    "llama": lambda: _text("llama"),
    "mistral": lambda: _text("mistral", sliding_window=4),
    "qwen2": lambda: _text("qwen2"),
    "qwen3": lambda: _text("qwen3", head_dim=8),
    # tied embeddings, sliding and full attention alternating, soft-capped logits
    "gemma2": lambda: _text("gemma2", head_dim=8, sliding_window=3),
    "mixtral": lambda: _text("mixtral", num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": lambda: _text("qwen3_moe", head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    # hybrid: gated DeltaNet (linear attention) and gated full attention, MoE
    "qwen3_next": lambda: _text("qwen3_next", num_hidden_layers=4, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=16, shared_expert_intermediate_size=16, linear_num_value_heads=4,
                                linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8),
    "llava": lambda: transformers.LlavaConfig(
        text_config=dict(model_type="llama", vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2),
        vision_config=dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=2, image_size=8, patch_size=4, projection_dim=16),
        image_token_id=95, image_seq_length=4),
}
# one per kind the issue names: dense, tied + local/global attention, MoE, hybrid, vision-language
RUN_FAMILIES = ("qwen3", "gemma2", "mixtral", "qwen3_next", "llava")


def _hf_class(config):
    return transformers.AutoModelForImageTextToText if config.model_type == "llava" else transformers.AutoModelForCausalLM


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> (folder with config.json and model.safetensors, the transformers model)."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for index, (name, make) in enumerate(FAMILIES.items()):
        torch.manual_seed(100 + index)
        config = make()
        model = _hf_class(config).from_config(config)
        model.save_pretrained(root / name)
        out[name] = (root / name, model)
    return out


def _hf_loss(model, inputs, targets) -> torch.Tensor:
    """transformers' own loss (labels=...) of a chain microbatch: the tokens with the last target
    appended, labels shifted by the model itself."""
    if isinstance(inputs, tuple):  # LLaVA: (pixels, ids); the image positions carry no loss
        pixels, ids = inputs
        tokens = torch.cat([ids, targets[:, -1:]], 1)
        labels = torch.cat([torch.full_like(targets[:, :1], -100), targets], 1)
        return model(input_ids=tokens, pixel_values=pixels, labels=labels).loss
    tokens = torch.cat([inputs, targets[:, -1:]], 1)
    return model(input_ids=tokens, labels=tokens).loss


def _chain(folder: Path, **config):
    model = load_model_file(f"hf:{folder}", {"seq": SEQ, **config})
    return model, [model.build_layer(i) for i in range(model.num_layers())]


def _forward(model, layers, inputs, targets) -> torch.Tensor:
    value = inputs
    for layer in layers:
        value = layer(*as_args(value))
    return model.loss(value, targets)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_chain_loss_and_gradients_equal_transformers(saved, family):
    folder, hf_model = saved[family]
    model, layers = _chain(folder)
    reference = copy.deepcopy(hf_model).train()
    inputs, targets = model.sample_batch(MBS, step=0, replica=0, mb=0)
    loss = _forward(model, layers, inputs, targets)
    expected = _hf_loss(reference, inputs, targets)
    assert abs(loss.item() - expected.item()) <= 1e-5
    loss.backward()
    expected.backward()
    grads = {name: p.grad for name, p in reference.named_parameters()}
    # a tied weight's gradient is the sum over its uses, in transformers as across octorun's ranks
    tied = reference.all_tied_weights_keys
    found: dict[str, torch.Tensor] = {}
    for layer in layers:
        for name, param in layer.named_parameters():
            key = tied.get(name, name)
            if param.grad is None:  # unused, as LLaVA's last vision layer (it reads the one before)
                assert grads[key] is None, name
                found[key] = None
                continue
            assert key not in found or key in tied.values(), name  # each parameter in one chain layer
            found[key] = found[key] + param.grad if key in found else param.grad
    assert set(found) == set(grads)
    for name, grad in found.items():
        if grad is None:
            continue
        assert torch.allclose(grad, grads[name], atol=1e-5, rtol=0), (name, (grad - grads[name]).abs().max())


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_a_router_loss_in_the_config_is_left_out_and_said(saved, family, tmp_path, capsys):
    """config.json with output_router_logits: true (as some hub MoE checkpoints ship) builds; the
    loss is the language-model loss (the routers' logits never reach the head), and rank 0
    says so on stderr."""
    import json
    import shutil

    folder, hf_model = saved[family]
    routed = tmp_path / "routed"
    shutil.copytree(folder, routed)
    config = json.loads((routed / "config.json").read_text())
    config["output_router_logits"] = True
    (routed / "config.json").write_text(json.dumps(config))
    model, layers = _chain(routed)
    inputs, targets = model.sample_batch(MBS, step=0, replica=0, mb=0)
    loss = _forward(model, layers, inputs, targets)
    reference = copy.deepcopy(hf_model).train()
    assert not reference.config.output_router_logits
    assert abs(loss.item() - _hf_loss(reference, inputs, targets).item()) <= 1e-5
    assert "output_router_logits is set to false" in capsys.readouterr().err


def test_chain_layers_names_and_kinds(saved, tmp_path):
    model, _ = _chain(saved["qwen3_next"][0], weights="none")
    names = [model.module.layer_name(i, **model.config) for i in range(model.num_layers())]
    kinds = [model.module.layer_kind(i, **model.config) for i in range(model.num_layers())]
    assert names == ["embed_tokens", "layers.0", "layers.1", "layers.2", "layers.3", "norm+lm_head"]
    assert kinds == ["embedding", "linear_attention", "linear_attention", "linear_attention", "full_attention", "head"]
    vlm, _ = _chain(saved["llava"][0], weights="none")
    assert [vlm.module.layer_kind(i, **vlm.config) for i in range(vlm.num_layers())] == [
        "vision", "projector", "embed", "decoder", "decoder", "decoder", "decoder", "head"]
    (pixels, ids), targets = vlm.sample_batch(3, step=0, replica=0, mb=0)
    assert pixels.shape == (3, 3, 8, 8) and ids.shape == (3, 4 + SEQ) and targets.shape == (3, 4 + SEQ)
    assert (ids[:, :4] == 95).all() and (ids[:, 4:] != 95).all() and (targets[:, :4] == -100).all()
    assert model.tokens_per_sample() == SEQ + 1
    # a token file's ids are held to config.json's vocab_size (the text model's, for a VLM)
    assert (model.vocab_size(), vlm.vocab_size()) == (96, 96)
    # a token file holds no images: a VLM refuses one as the file opens, before any rank starts
    from octorun.data import TokenData

    tokens = tmp_path / "t.bin"
    tokens.write_bytes(bytes(2 * 4 * (SEQ + 1)))
    with pytest.raises(InputError, match="holds no images"):
        TokenData.open(tokens, vlm, seed=0)
    assert _chain(saved["qwen3_next"][0], weights="none", vocab_size=120)[0].vocab_size() == 120


def test_seeded_init_is_per_layer_and_deterministic(saved):
    folder = saved["gemma2"][0]
    first, layers = _chain(folder, weights="none")
    _, again = _chain(folder, weights="none")
    for a, b in zip(layers, again):
        for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
            assert torch.equal(x, y), name
    seeded = load_model_file(f"hf:{folder}", {"seq": SEQ, "weights": "none"}, seed=1).build_layer(1)
    assert not torch.equal(seeded.state_dict()["model.layers.0.mlp.up_proj.weight"],
                           layers[1].state_dict()["model.layers.0.mlp.up_proj.weight"])
    # transformers' init: normal(0, initializer_range) for matrices, not the checkpoint's values
    up = layers[1].state_dict()["model.layers.0.mlp.up_proj.weight"]
    assert abs(up.std().item() - first_init_std(folder)) < 0.005
    assert all(layer.checkpoint_bytes_read == 0 for layer in layers)
    assert first.tied_groups() == [[(0, "model.embed_tokens.weight"), (5, "lm_head.weight")]]


def first_init_std(folder: Path) -> float:
    return json.loads((folder / "config.json").read_text())["initializer_range"]


def _checkpoint_bytes_by_layer(folder: Path, names: list[str]) -> dict[int, int]:
    """Hand-made from the safetensors header: the bytes of the checkpoint's tensors per chain layer."""
    header = safetensors_torch.load_file(folder / "model.safetensors")
    out = {i: 0 for i in range(len(names))}
    for key, tensor in header.items():
        size = tensor.numel() * tensor.element_size()
        if "embed_tokens" in key:
            out[0] += size
        elif key in ("model.norm.weight", "lm_head.weight"):
            out[len(names) - 1] += size
        else:
            out[names.index("layers." + key.split("layers.")[1].split(".")[0])] += size
    return out


def test_each_rank_reads_only_its_stages_tensors(saved, tmp_path):
    folder = saved["mixtral"][0]
    model = load_model_file(f"hf:{folder}", {"seq": SEQ})
    names = [model.module.layer_name(i, **model.config) for i in range(model.num_layers())]
    expected = _checkpoint_bytes_by_layer(folder, names)
    plan = h.baseline_plan("1f1b", f"hf:{folder}", dict(model.config), tmp_path, gpus=4, pp=4, microbatches=4)
    total = 0
    for stage in plan.stages:  # what each rank's octorun builds: its stages' layers, no others
        fresh = load_model_file(f"hf:{folder}", {"seq": SEQ})
        read = sum(fresh.build_layer(i).checkpoint_bytes_read for i in range(stage.start, stage.end))
        assert read == sum(expected[i] for i in range(stage.start, stage.end)) > 0
        total += read
    assert total == sum(expected.values()) == (folder / "model.safetensors").stat().st_size - _header_size(folder)


def test_a_trained_layer_leaves_the_checkpoint_as_it_was(saved):
    folder = saved["qwen3"][0]
    model = load_model_file(f"hf:{folder}", {"seq": SEQ})
    layer = model.build_layer(1)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    with torch.no_grad():
        for param in layer.parameters():
            param.add_(1.0)  # as an optimizer step does, in place
    again = model.build_layer(1).state_dict()
    assert all(torch.equal(again[k], before[k]) for k in before)


def test_a_bf16_checkpoint_trains_in_fp32_parameters(saved, tmp_path):
    _, hf_model = saved["qwen3"]
    copy.deepcopy(hf_model).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    layer = load_model_file(f"hf:{tmp_path / 'bf16'}", {"seq": SEQ}).build_layer(1)
    assert {p.dtype for p in layer.parameters()} == {torch.float32}  # octoplan's fp32 masters
    want = hf_model.state_dict()["model.layers.0.mlp.up_proj.weight"].to(torch.bfloat16).float()
    assert torch.equal(layer.state_dict()["model.layers.0.mlp.up_proj.weight"], want)


def _header_size(folder: Path) -> int:
    with open(folder / "model.safetensors", "rb") as file:
        return 8 + int.from_bytes(file.read(8), "little")


# ------------------------------------------------------------------------------------ bad input


def _cli(*args: str):
    return CliRunner().invoke(app, [*args])


def _one_line_exit_2(result, *words):
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    for word in words:
        assert word in lines[0], lines[0]


def test_bad_input_exits_2_in_one_line(saved, tmp_path):
    out = tmp_path / "p.yaml"
    _one_line_exit_2(_cli("profile", f"hf:{tmp_path / 'none'}", "-o", str(out)), "is not a folder")
    (tmp_path / "empty").mkdir()
    _one_line_exit_2(_cli("profile", f"hf:{tmp_path / 'empty'}", "-o", str(out)), "config.json", "not found")
    # configs transformers cannot read or build: an unknown model type, an unknown activation
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "no-such-model", "hidden_size": 8}))
    _one_line_exit_2(_cli("profile", f"hf:{unknown}", "-o", str(out)), "config.json", "cannot read it")
    folder = saved["qwen2"][0]
    _one_line_exit_2(_cli("profile", f"hf:{folder}", "--config", "hidden_act=no-such-act", "-o", str(out)),
                     "cannot build Qwen2ForCausalLM")
    _one_line_exit_2(_cli("profile", f"hf:{folder}", "--config", "no_such_field=1", "-o", str(out)),
                     "no_such_field", "not a field")
    # a float into an int field (transformers' strict configs raised their own traceback), and
    # counts below 1 (layers=-3 wrote a profile of no decoder layers)
    _one_line_exit_2(_cli("profile", f"hf:{folder}", "--config", "layers=2.5", "-o", str(out)),
                     "--config layers: is 2.5 but the config holds 4")
    _one_line_exit_2(_cli("profile", f"hf:{folder}", "--config", "layers=-3", "-o", str(out)),
                     "--config layers: is -3", "at least 1")
    _one_line_exit_2(_cli("profile", f"hf:{folder}", "--config", "vocab_size=0", "-o", str(out)),
                     "--config vocab_size: is 0")
    # the safetensors files hold hidden 32, the overridden config says 16
    _one_line_exit_2(_cli("profile", f"hf:{folder}", "--config", "hidden=16", "--config", "num_attention_heads=2",
                          "--config", "num_key_value_heads=1", "-o", str(out)),
                     "shape (96, 32)", "(96, 16)")
    # a family transformers declares no pipeline plan for (Jamba: Mamba and attention)
    jamba = tmp_path / "jamba"
    jamba.mkdir()
    transformers.JambaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2).save_pretrained(jamba)
    _one_line_exit_2(_cli("profile", f"hf:{jamba}", "-o", str(out)), "no pipeline plan", "'jamba'")
    # a family with a plan whose chain is not verified here
    phi = tmp_path / "phi3"
    phi.mkdir()
    transformers.Phi3Config(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2).save_pretrained(phi)
    _one_line_exit_2(_cli("profile", f"hf:{phi}", "-o", str(out)), "'phi3'", "not verified")
    # nor by naming another family: a Phi3 built as a Llama would load the same-named weights
    # into Llama's classes and lose what Phi3 does differently (a Granite its multipliers)
    _one_line_exit_2(_cli("profile", f"hf:{phi}", "--config", "model_type=llama", "-o", str(out)),
                     "--config model_type: names the model's family, which --config cannot change")
    _one_line_exit_2(_cli("profile", f"hf:{folder}", "--config", "architectures=LlamaForCausalLM", "-o", str(out)),
                     "--config architectures: names the model's family")
    # a LLaVA whose language model is of an unverified family: its decoder runs in pieces too
    llava = tmp_path / "llava-phi3"
    llava.mkdir()
    transformers.LlavaConfig(text_config=dict(model_type="phi3", vocab_size=64, hidden_size=16, num_hidden_layers=2,
                                              num_attention_heads=2),
                             vision_config=dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32,
                                                num_hidden_layers=1, num_attention_heads=2, image_size=8, patch_size=4),
                             image_token_id=63).save_pretrained(llava)
    _one_line_exit_2(_cli("profile", f"hf:{llava}", "-o", str(out)),
                     "the language model of this 'llava' is of model type 'phi3'", "not verified")
    _one_line_exit_2(_cli("profile", f"hf:{llava}", "--config", "text_config.model_type=llama", "-o", str(out)),
                     "--config text_config.model_type: names the model's family")
    # two names for one field, set apart (the sorted keys decided which won)
    _one_line_exit_2(_cli("profile", f"hf:{folder}", "--config", "layers=2", "--config", "num_hidden_layers=3",
                          "-o", str(out)),
                     "--config layers: is 2 and --config num_hidden_layers is 3", "give one of them")
    _one_line_exit_2(_cli("profile", f"hf:{saved['llava'][0]}", "--config", "layers=2", "--config",
                          "text_config.num_hidden_layers=3", "-o", str(out)),
                     "--config layers: is 2 and --config text_config.num_hidden_layers is 3")
    # an override transformers' forward cannot run: the line names the overrides, not "fix the forward"
    _one_line_exit_2(_cli("profile", f"hf:{folder}", "--config", "num_attention_heads=3", "--config", "weights=none",
                          "-o", str(out)),
                     "its forward raised", "the forward is transformers' own: check the --config overrides "
                                           "(num_attention_heads)")
    assert not out.exists()


def test_no_output_overwrites_a_file_of_the_model_folder(saved, tmp_path):
    folder = tmp_path / "copy"
    folder.mkdir()
    for file in saved["qwen2"][0].iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    before = {file.name: file.read_bytes() for file in folder.iterdir()}
    assert {"config.json", "model.safetensors"} <= set(before)
    for name in ("config.json", "model.safetensors"):
        _one_line_exit_2(_cli("profile", f"hf:{folder}", "-o", str(folder / name)), "names the input file")
    profile = tmp_path / "p.yaml"
    assert _cli("profile", f"hf:{folder}", "--config", f"seq={SEQ}", "--repeat", "1", "--device", "cpu",
                "-o", str(profile)).exit_code == 0
    plan_path = tmp_path / "plan.yaml"
    assert _cli("baseline", str(profile), "--gpus", "1", "--schedule", "1f1b", "-o", str(plan_path)).exit_code == 0
    from octorun.runtime import RunConfig, prepare

    for flag in ("metrics_path", "trace_path"):
        with pytest.raises(InputError, match=f"names the input file {folder / 'model.safetensors'}"):
            prepare(RunConfig(plan_path=str(plan_path), **{flag: str(folder / "model.safetensors")}))
    assert {file.name: file.read_bytes() for file in folder.iterdir()} == before


def test_missing_tensor_is_bad_input(saved, tmp_path):
    folder = saved["qwen3"][0]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((folder / "config.json").read_text())
    tensors = safetensors_torch.load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    safetensors_torch.save_file(tensors, broken / "model.safetensors")
    model = load_model_file(f"hf:{broken}", {"seq": SEQ})
    model.build_layer(1)  # layer 0 of the decoder is whole
    with pytest.raises(InputError, match=r"layer 2 \(layers.1\).*model.layers.1.mlp.down_proj.weight is not in"):
        model.build_layer(2)


def test_weights_in_a_format_octopipe_does_not_read_are_refused_not_dropped(saved, tmp_path):
    """A folder whose weights are only a PyTorch pickle (pytorch_model.bin, as older checkpoints
    ship them, and from_pretrained reads): profiling it trained from a seeded init without a
    word. Now one line names the file and the two ways on; --config weights=none takes the
    seeded init knowingly."""
    folder = saved["qwen3"][0]
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((folder / "config.json").read_text())
    torch.save(safetensors_torch.load_file(folder / "model.safetensors"), pickled / "pytorch_model.bin")
    out = tmp_path / "p.yaml"
    _one_line_exit_2(_cli("profile", f"hf:{pickled}", "--config", f"seq={SEQ}", "-o", str(out)),
                     f"{pickled / 'pytorch_model.bin'}", "does not read", "weights=none")
    assert not out.exists()
    assert load_model_file(f"hf:{pickled}", {"seq": SEQ, "weights": "none"}).num_layers() > 0


def test_a_config_is_compared_as_transformers_resolves_it(saved, tmp_path):
    """A checkpoint records the model's resolved config: ``layers=2`` and ``num_hidden_layers=2``
    are one model (export refused the pair, comparing the words), and a value equal to
    config.json's is no override; ``hidden_act=relu`` is another model (a resume accepted it
    without a word). seq and weights are the run's, not the model's."""
    from octorun.checkpoint import check_compatible, config_differences
    from octorun.weights_export import check_same_config as _check_same_config

    folder = saved["qwen3"][0]

    def resolved(**config):
        return load_model_file(f"hf:{folder}", {"seq": SEQ, **config}).resolved_config()

    depth = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    assert resolved(layers=2) == resolved(num_hidden_layers=2)
    assert resolved(layers=depth) == resolved()
    assert config_differences(resolved(), resolved(seq=SEQ + 8, weights="none")) == []
    assert config_differences(resolved(), resolved(hidden_act="relu")) == ["hidden_act=silu (now relu)"]
    meta = {"model": "Qwen3ForCausalLM", "resolved_config": resolved(layers=2), "model_config": {"layers": 2}}
    _check_same_config(meta, {"num_hidden_layers": 2}, resolved(num_hidden_layers=2), tmp_path)
    with pytest.raises(InputError, match=r"resolved_config: the checkpoint's model was trained with hidden_act=silu \(now relu\)"):
        _check_same_config(meta, {"layers": 2, "hidden_act": "relu"}, resolved(layers=2, hidden_act="relu"), tmp_path)
    with pytest.raises(InputError, match="hidden_act=silu"):
        check_compatible(meta, {"model": "Qwen3ForCausalLM", "resolved_config": resolved(layers=2, hidden_act="relu")},
                         tmp_path)
    check_compatible(meta, {"model": "Qwen3ForCausalLM", "resolved_config": resolved(layers=2, hidden_act="relu")},
                     tmp_path, weights_only=True)  # --init-from takes the weights into another config


def test_a_tied_head_stored_with_other_values_is_refused(saved, tmp_path):
    """config.json ties the head to the embedding, but the folder stores lm_head.weight of its
    own (an untied model whose config was edited): transformers keeps them apart, OctoPipe tied
    them and trained another model. Refused in one line; a stored copy equal to the embedding
    is the tied model, taken."""
    folder = saved["gemma2"][0]
    assert json.loads((folder / "config.json").read_text()).get("tie_word_embeddings", True)
    tensors = safetensors_torch.load_file(folder / "model.safetensors")
    embedding = tensors["model.embed_tokens.weight"]
    for name, head in (("other", embedding + 1.0), ("same", embedding.clone())):
        copy = tmp_path / name
        copy.mkdir()
        (copy / "config.json").write_text((folder / "config.json").read_text())
        safetensors_torch.save_file({**tensors, "lm_head.weight": head}, copy / "model.safetensors")
        result = _cli("profile", f"hf:{copy}", "--config", f"seq={SEQ}", "--repeat", "1", "--device", "cpu",
                      "-o", str(tmp_path / f"{name}.yaml"))
        if name == "other":
            _one_line_exit_2(result, f"{copy / 'config.json'}: tie_word_embeddings", "lm_head.weight of other values")
        else:
            assert result.exit_code == 0, result.output


def test_the_files_read_are_those_transformers_reads(saved, tmp_path):
    """A sharded checkpoint's index names its files: a stray copy beside them (an older export)
    is not read, as transformers' from_pretrained does not read it; without an index, a tensor
    in two files is bad input rather than whichever file sorts last."""
    import json
    import shutil

    folder, hf_model = saved["qwen3"]
    sharded = tmp_path / "sharded"
    hf_model.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) > 1
    stray = {"model.norm.weight": torch.full_like(hf_model.model.norm.weight, 7.0)}
    safetensors_torch.save_file(stray, sharded / "old-model.safetensors")
    model = load_model_file(f"hf:{sharded}", {"seq": SEQ})
    head = model.build_layer(model.num_layers() - 1)
    assert torch.equal(head.state_dict()["model.norm.weight"], hf_model.model.norm.weight)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(sharded)  # transformers itself agrees
    assert torch.equal(reloaded.model.norm.weight, hf_model.model.norm.weight)
    # the same stray file beside model.safetensors alone: still not read; and model.safetensors
    # beside an index (and its shards) wins, as in transformers
    single = tmp_path / "single"
    hf_model.save_pretrained(single)
    safetensors_torch.save_file(stray, single / "old-model.safetensors")
    for name in ("model.safetensors.index.json", *json.loads((sharded / "model.safetensors.index.json").read_text())
                 ["weight_map"].values()):
        if not (single / name).exists():
            shutil.copy(sharded / name, single / name)
    shards = {"model.norm.weight": stray["model.norm.weight"]}  # the index's copy of the norm differs
    index = json.loads((single / "model.safetensors.index.json").read_text())
    safetensors_torch.save_file({**safetensors_torch.load_file(single / index["weight_map"]["model.norm.weight"]),
                                 **shards}, single / index["weight_map"]["model.norm.weight"])
    head = load_model_file(f"hf:{single}", {"seq": SEQ}).build_layer(model.num_layers() - 1)
    assert torch.equal(head.state_dict()["model.norm.weight"], hf_model.model.norm.weight)
    assert torch.equal(transformers.AutoModelForCausalLM.from_pretrained(single).model.norm.weight,
                       hf_model.model.norm.weight)
    # no standard name, two copies: refused
    loose = tmp_path / "loose"
    loose.mkdir()
    (loose / "config.json").write_text((folder / "config.json").read_text())
    (single / "model.safetensors").rename(loose / "a.safetensors")
    safetensors_torch.save_file(stray, loose / "b.safetensors")
    with pytest.raises(InputError, match=r"b.safetensors: model.norm.weight: is also in a.safetensors"):
        load_model_file(f"hf:{loose}", {"seq": SEQ}).build_layer(model.num_layers() - 1)
    # an index that names a file the folder lacks (another folder: a folder's files are read once per process)
    partial = tmp_path / "partial"
    shutil.copytree(sharded, partial)
    index = json.loads((partial / "model.safetensors.index.json").read_text())
    missing = sorted(set(index["weight_map"].values()))[0]
    (partial / missing).unlink()
    with pytest.raises(InputError, match=f"weight_map: names {missing}, which is not in the folder"):
        load_model_file(f"hf:{partial}", {"seq": SEQ}).build_layer(1)


def test_profile_says_the_sequence_length_it_took(saved, tmp_path):
    """hf:'s default seq (32) sets the plan's times and octorun's token windows: the profile
    command says it took it, and says nothing where --config seq was given."""
    folder = saved["llama"][0]
    args = ("--microbatch-size", "1", "--repeat", "1", "--device", "cpu")
    said = _cli("profile", f"hf:{folder}", *args, "-o", str(tmp_path / "a.yaml"))
    assert said.exit_code == 0, said.output
    assert "profiled at seq 32 tokens per sample, hf:'s default; give --config seq=N" in " ".join(said.output.split())
    given = _cli("profile", f"hf:{folder}", "--config", "seq=8", *args, "-o", str(tmp_path / "b.yaml"))
    assert given.exit_code == 0 and "hf:'s default" not in given.output


def test_without_transformers_says_what_to_install(saved, tmp_path):
    script = ("import sys; sys.modules['transformers'] = None\n"
              "from octoplan.cli import main; sys.argv = ['octoplan'] + sys.argv[1:]; main()")
    run = subprocess.run([sys.executable, "-c", script, "profile", f"hf:{saved['qwen3'][0]}", "-o", str(tmp_path / "p.yaml")],
                         capture_output=True, text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 2
    assert run.stderr.strip().count("\n") == 0 and "pip install -e '.[hf]'" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr


# ---------------------------------------------------------------------- octorun against transformers


def _hf_sgd_step(hf_model, model, plan) -> tuple[float, dict[str, torch.Tensor]]:
    """transformers' own loss over the step's microbatches of every replica, and its weights
    after one SGD step."""
    reference = copy.deepcopy(hf_model).train()
    losses = [_hf_loss(reference, *model.sample_batch(MBS, step=0, replica=d, mb=mb))
              for d in range(plan.parallel.dp) for mb in range(plan.microbatches)]
    loss = torch.stack(losses).mean()
    loss.backward()
    with torch.no_grad():
        for param in reference.parameters():
            if param.grad is not None:
                param -= LR * param.grad
    state = dict(reference.named_parameters())
    for target, source in reference.all_tied_weights_keys.items():
        state[target] = state[source]
    return loss.item(), {name: p.detach() for name, p in state.items()}


@pytest.fixture(scope="module")
def octorun_runs(saved, tmp_path_factory):
    """Every RUN_FAMILIES model profiled, planned (1F1B pp 4 and tuned for 4 GPUs) and trained one
    SGD step by octorun on 4 processes, each 1F1B run saving a checkpoint: (the launch, job
    name -> (family, plan, plan path))."""
    from octorun.runtime import RunConfig

    tmp_path = tmp_path_factory.mktemp("octorun_hf")
    jobs, cases = [], {}
    for family in RUN_FAMILIES:
        folder, hf_model = saved[family]
        source = f"hf:{folder}"
        profile = tmp_path / f"{family}.yaml"
        result = _cli("profile", source, "--config", f"seq={SEQ}", "--microbatch-size", str(MBS), "--repeat", "1",
                      "--device", "cpu", "-o", str(profile))
        assert result.exit_code == 0, result.output
        for kind, args in (("1f1b", ["baseline", str(profile), "--gpus", "4", "--schedule", "1f1b"]),
                           ("tuned", ["tune", str(profile), "--gpus", "4", "--max-plans", "200"])):
            plan_path = tmp_path / f"{family}-{kind}.yaml"
            result = _cli(*args, "--microbatches", "4", "-o", str(plan_path))
            assert result.exit_code == 0, result.output
            name = f"{family}-{kind}"
            save = str(tmp_path / f"{name}-checkpoints") if kind == "1f1b" else None
            jobs.append(h.Job(name, RunConfig(plan_path=str(plan_path), steps=1, optimizer="sgd", lr=LR, timeout_s=60,
                                              save_dir=save)))
            cases[name] = (family, load_plan(plan_path), plan_path)
    launched = h.launch(4, jobs, tmp_path / "out", timeout_s=240)
    assert launched.exitcodes == [0] * 4, "\n".join(launched.logs)
    return launched, cases


@pytest.mark.slow
def test_octorun_1f1b_and_tuned_plans_equal_transformers(saved, octorun_runs):
    launched, cases = octorun_runs
    plan = next(iter(cases.values()))[1]
    assert plan.parallel.pp == 4 and plan.model.source.startswith("hf:")
    for name, (family, plan, _) in cases.items():
        folder, hf_model = saved[family]
        model = load_model_file(f"hf:{folder}", {"seq": SEQ})
        want_loss, want_state = _hf_sgd_step(hf_model, model, plan)
        metrics = launched.result(name, 0)["metrics"]
        assert abs(metrics[0].loss - want_loss) <= 1e-5, (name, metrics[0].loss, want_loss)
        compared, moved = 0, 0.0
        for rank in range(4):
            for layer, state in launched.result(name, rank)["state"].items():
                for key, value in state.items():
                    if key not in want_state:
                        continue  # buffers
                    assert torch.allclose(value, want_state[key], atol=1e-5, rtol=0), (name, layer, key)
                    moved = max(moved, (want_state[key] - hf_model.state_dict()[key]).abs().max().item()
                                if key in hf_model.state_dict() else 0.0)
                    compared += 1
        assert compared >= len(dict(hf_model.named_parameters())), name
        assert moved > 1e-3, name  # the step changed the weights: the comparison can fail


@pytest.mark.slow
def test_export_hf_writes_the_trained_weights_as_transformers_reads_them(saved, octorun_runs, tmp_path, monkeypatch):
    """octoplan export --format hf of each 1F1B run's checkpoint: transformers' from_pretrained
    loads the folder into the weights of transformers' own SGD step, stored under the keys and
    shapes of the model folder the run started from (a MoE's experts one matrix each again,
    a tied head left out), with the folder's other files beside them."""
    from safetensors import safe_open

    launched, cases = octorun_runs
    for name, (family, plan, plan_path) in cases.items():
        if not name.endswith("-1f1b"):
            continue
        folder, hf_model = saved[family]
        out = tmp_path / family
        dtype = "bfloat16" if family == "gemma2" else None  # else the model folder's (float32)
        extra = {"tokenizer_config.json": '{"model_max_length": 7}', "generation_config.json": '{"eos_token_id": [2, 7]}',
                 "tekken.json": '{"config": "Mistral\'s tokenizer"}', "model.gguf": "stale weights in another format"}
        given_config = (folder / "config.json").read_text()
        if family == "mixtral":  # training turns the routers' loss off; the exported config keeps it on
            (folder / "config.json").write_text(json.dumps({**json.loads(given_config), "output_router_logits": True}))
        kept = {name: (folder / name).read_bytes() for name in extra if (folder / name).exists()}
        for file, text in extra.items():
            (folder / file).write_text(text)
        where = f"{out}/"
        if family == "qwen3":  # written into the working folder, empty: kept and filled
            out.mkdir()
            monkeypatch.chdir(out)
            where = "."
        try:
            result = _cli("export", str(plan_path), "--format", "hf", "--checkpoint",
                          str(plan_path.parent / f"{name}-checkpoints"), "-o", where, *(["--dtype", dtype] if dtype else []))
        finally:
            for file in extra:
                (folder / file).unlink()
            for file, data in kept.items():
                (folder / file).write_bytes(data)
            (folder / "config.json").write_text(given_config)
        assert result.exit_code == 0, result.output
        monkeypatch.chdir(tmp_path)
        assert json.loads((out / "generation_config.json").read_text()) == {"eos_token_id": [2, 7]}
        assert not (out / "model.gguf").exists()
        assert json.loads((out / "config.json").read_text()).get("output_router_logits", False) == (family == "mixtral")
        assert {oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {oct(0o666 & ~_umask())}
        assert f"of {plan_path.parent / f'{name}-checkpoints' / 'step_00000001'} (after 1 steps)" in " ".join(result.output.split())
        with safe_open(str(folder / "model.safetensors"), "pt") as given, safe_open(str(out / "model.safetensors"), "pt") as written:
            assert {k: given.get_slice(k).get_shape() for k in given.keys()} == \
                   {k: written.get_slice(k).get_shape() for k in written.keys()}, family
        assert json.loads((out / "tokenizer_config.json").read_text()) == {"model_max_length": 7}
        assert (out / "tekken.json").read_text() == extra["tekken.json"]
        exported = _hf_class(hf_model.config).from_pretrained(out)
        assert exported.dtype == (torch.bfloat16 if dtype else torch.float32)
        _, want_state = _hf_sgd_step(hf_model, load_model_file(f"hf:{folder}", {"seq": SEQ}), plan)
        state = exported.state_dict()
        for key, want in want_state.items():
            want = want.to(exported.dtype)  # bfloat16: one rounding of the same values
            assert torch.allclose(state[key], want, atol=1e-5 if not dtype else 0, rtol=0 if not dtype else 1e-2), (family, key)
        assert set(want_state) <= set(state) and len(want_state) >= len(dict(hf_model.named_parameters()))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.slow
def test_export_hf_bad_input_exits_2_in_one_line_and_writes_nothing(saved, octorun_runs, tmp_path):
    _, cases = octorun_runs
    _, _, qwen3 = cases["qwen3-1f1b"]
    checkpoints = {family: plan_path.parent / f"{name}-checkpoints" for name, (family, _, plan_path) in cases.items()
                   if name.endswith("-1f1b")}
    analytic = tmp_path / "analytic.yaml"
    assert _cli("baseline", str(ROOT / "profiles" / "gemma2-27b-h100.yaml"), "--gpus", "4", "--schedule", "1f1b", "--microbatches", "4",
                "-o", str(analytic)).exit_code == 0
    full = tmp_path / "full"
    (full / "old").mkdir(parents=True)
    out = tmp_path / "out"
    # the same model at another config that changes no shape: config.json would say what the
    # weights were not trained with
    eps = tmp_path / "eps.yaml"
    assert _cli("profile", f"hf:{saved['qwen3'][0]}", "--config", f"seq={SEQ}", "--config", "rms_norm_eps=0.1",
                "--microbatch-size", str(MBS), "--repeat", "1", "--device", "cpu", "-o", str(eps)).exit_code == 0
    assert _cli("baseline", str(eps), "--gpus", "4", "--schedule", "1f1b", "--microbatches", "4",
                "-o", str(tmp_path / "eps-plan.yaml")).exit_code == 0
    _one_line_exit_2(_cli("export", str(tmp_path / "eps-plan.yaml"), "--format", "hf", "--checkpoint",
                          str(checkpoints["qwen3"]), "-o", str(out)), "resolved_config", "rms_norm_eps=1e-06 (now 0.1)")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    _one_line_exit_2(_cli(*("export", str(qwen3), "--format", "hf", "-o"), str(tmp_path / "dangling"), "--checkpoint",
                          str(checkpoints["qwen3"])), "-o", "link to nothing")
    _one_line_exit_2(_cli(*("export", str(qwen3), "--format", "hf", "-o"), str(analytic / "out"), "--checkpoint",
                          str(checkpoints["qwen3"])), "-o", "which is a file")
    export = ("export", str(qwen3), "--format", "hf", "-o")
    _one_line_exit_2(_cli(*export, str(out)), "--checkpoint", "is missing")
    _one_line_exit_2(_cli(*export, str(out), "--checkpoint", str(checkpoints["qwen3"]), "--dtype", "int8"), "--dtype", "bfloat16")
    _one_line_exit_2(_cli(*export, str(out), "--checkpoint", str(checkpoints["gemma2"])),
                     "model", "hf-gemma2", "give --checkpoint a checkpoint of this model")
    _one_line_exit_2(_cli(*export, str(out), "--checkpoint", str(tmp_path / "none")), "--checkpoint", "does not exist")
    _one_line_exit_2(_cli(*export, str(full), "--checkpoint", str(checkpoints["qwen3"])), "-o", "not empty")
    _one_line_exit_2(_cli(*export, str(checkpoints["qwen3"] / "step_00000001" / "hf"), "--checkpoint", str(checkpoints["qwen3"])),
                     "-o", "inside the checkpoint")
    _one_line_exit_2(_cli("export", str(qwen3), "--format", "megatron", "--checkpoint", str(checkpoints["qwen3"]),
                          "-o", str(out)), "--checkpoint", "applies to --format hf")
    _one_line_exit_2(_cli("export", str(analytic), "--format", "hf", "--checkpoint", str(checkpoints["qwen3"]), "-o", str(out)),
                     "model.source", "an analytic plan")
    # refused once the work has begun (a damaged shard shows as the checkpoint loads): the folders
    # made for -o go again
    damaged = tmp_path / "damaged"
    shutil.copytree(checkpoints["qwen3"], damaged)
    shard = next((damaged / "step_00000001").glob("*.distcp"))
    shard.write_bytes(bytes(b ^ 0xFF for b in shard.read_bytes()))
    _one_line_exit_2(_cli(*export, str(tmp_path / "new" / "deeper" / "out"), "--checkpoint", str(damaged)), "distcp")
    shutil.rmtree(damaged)
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == [
        "analytic.yaml", "dangling", "eps-plan.yaml", "eps.yaml", "full"]
    assert h.saved_entries(checkpoints["qwen3"]) == ["step_00000001"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dtype", "torch_dtype"])
def test_export_hf_writes_the_dtype_the_plans_config_gives(saved, tmp_path, name):
    """A model profiled with --config dtype=bfloat16 (or its older name, torch_dtype; its
    config.json says bfloat16, the folder's float32): the export without --dtype writes bfloat16
    tensors, as its config.json says; it wrote float32, the folder's."""
    from octorun.runtime import RunConfig

    folder, _ = saved["qwen3"]
    profile, plan_path, checkpoints = tmp_path / "p.yaml", tmp_path / "plan.yaml", tmp_path / "ck"
    assert _cli("profile", f"hf:{folder}", "--config", f"seq={SEQ}", "--config", f"{name}=bfloat16", "--microbatch-size",
                str(MBS), "--repeat", "1", "--device", "cpu", "-o", str(profile)).exit_code == 0
    assert _cli("baseline", str(profile), "--gpus", "1", "--schedule", "1f1b", "--microbatches", "2",
                "-o", str(plan_path)).exit_code == 0
    launched = h.launch(1, [h.Job("bf16-config", RunConfig(plan_path=str(plan_path), steps=1, optimizer="sgd", lr=LR,
                                                              timeout_s=60, save_dir=str(checkpoints)))],
                        tmp_path / "out", timeout_s=120)
    assert launched.exitcodes == [0], "\n".join(launched.logs)
    out = tmp_path / "exported"
    result = _cli("export", str(plan_path), "--format", "hf", "--checkpoint", str(checkpoints), "-o", str(out))
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert transformers.AutoModelForCausalLM.from_pretrained(out).dtype == torch.bfloat16
