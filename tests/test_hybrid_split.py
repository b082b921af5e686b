"""The hybrid example's finer layers (examples/models/hybrid.py: ``head_shards``, ``split_mamba``).

A split chain computes the unsplit model's function: with the unsplit model's weights copied in,
its loss and every parameter gradient match within 1e-6 (fp32, CPU). For the same seed it also
starts from the same weights. It profiles through ``octoplan profile --config`` and trains through
a 2-rank octorun pipeline whose stage boundaries fall inside a Mamba-style block and between head
shards, as a single process does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import runtime_helpers as h
from octoplan.cli import app
from octoplan.errors import InputError
from octoplan.modelfile import ModelFile, as_args, load_model_file
from octoplan.plan import save_plan
from octoplan.profile import load_profile
from octorun.runtime import RunConfig

HYBRID = h.EXAMPLES / "hybrid.py"
# Small sizes, an odd vocabulary (uneven slices for 2 and 3 shards), every block kind.
SMALL = {"vocab": 97, "hidden": 16, "seq": 8, "pattern": "mamemame", "heads": 2, "experts": 2, "top_k": 1,
         "expert_hidden": 16, "data_vocab": 32}
SPLITS = [{"head_shards": 2}, {"head_shards": 3}, {"split_mamba": True}, {"head_shards": 3, "split_mamba": True}]
MICROBATCH = 2

pytestmark = pytest.mark.usefixtures("one_thread")


def _load(config: dict, *, seed: int = 0) -> ModelFile:
    return load_model_file(HYBRID, {**SMALL, **config}, seed=seed)


def _layers(model: ModelFile) -> dict[str, torch.nn.Module]:
    """name -> layer, in chain order."""
    return {model.module.layer_name(i, **model.config): model.build_layer(i) for i in range(model.num_layers())}


def _unsplit_source(name: str) -> str:
    """The unsplit layer a split layer's tensors come from: mamba.K.conv -> mamba.K, head.k -> head."""
    if name.startswith("head."):
        return "head"
    return name.rsplit(".", 1)[0] if name.endswith((".conv", ".scan")) else name


def _unsplit_tensors(split: dict[str, torch.nn.Module]) -> dict[tuple[str, str], tuple[str, str, slice]]:
    """(split layer, tensor) -> (unsplit layer, tensor, rows): the state-dict mapping. A head shard
    holds the next ``out.weight.shape[0]`` vocabulary rows; every other tensor keeps its name."""
    mapping, next_row = {}, 0
    for name, layer in split.items():
        for key, tensor in layer.state_dict().items():
            rows = slice(None)
            if name.startswith("head.") and key == "out.weight":
                rows = slice(next_row, next_row + tensor.shape[0])
                next_row = rows.stop
            mapping[(name, key)] = (_unsplit_source(name), key, rows)
    return mapping


def _loss_and_grads(model: ModelFile, layers: dict[str, torch.nn.Module], batch: tuple) -> tuple[torch.Tensor, dict]:
    inputs, targets = batch
    value = inputs
    for layer in layers.values():
        value = layer(*as_args(value))
    loss = model.loss(value, targets)
    loss.backward()
    return loss.detach(), {(name, key): p.grad for name, layer in layers.items() for key, p in layer.named_parameters()}


@pytest.mark.parametrize("split", SPLITS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_split_chain_has_the_unsplit_loss_and_gradients(split: dict) -> None:
    torch.manual_seed(0)
    whole = _load({})
    whole_layers = _layers(whole)
    model = _load(split, seed=1)  # another seed: the copy below, not the init, makes the weights equal
    split_layers = _layers(model)
    mapping = _unsplit_tensors(split_layers)
    whole_state = {(name, key): t for name, layer in whole_layers.items() for key, t in layer.state_dict().items()}
    # every unsplit tensor lands somewhere, and the head's rows tile the vocabulary exactly
    assert {(src, key) for src, key, _ in mapping.values()} == set(whole_state)
    head_rows = sorted(rows.indices(SMALL["vocab"])[:2] for src, key, rows in mapping.values() if (src, key) == ("head", "out.weight"))
    assert head_rows[0][0] == 0 and head_rows[-1][1] == SMALL["vocab"]
    assert all(a[1] == b[0] for a, b in zip(head_rows, head_rows[1:]))
    for name, layer in split_layers.items():
        layer.load_state_dict({key: whole_state[mapping[(name, key)][:2]][mapping[(name, key)][2]]
                               for key in layer.state_dict()})

    batch = whole.sample_batch(MICROBATCH, step=0, replica=0, mb=0)  # the data depend on the seed too
    whole_loss, whole_grads = _loss_and_grads(whole, whole_layers, batch)
    split_loss, split_grads = _loss_and_grads(model, split_layers, batch)
    torch.testing.assert_close(split_loss, whole_loss, rtol=0, atol=1e-6)
    assert len(split_grads) >= len(whole_grads)
    for (name, key), grad in split_grads.items():
        src, _, rows = mapping[(name, key)]
        torch.testing.assert_close(grad, whole_grads[(src, key)][rows], rtol=0, atol=1e-6, msg=f"{name} {key}")


@pytest.mark.parametrize("seed", [0, 5])
def test_same_seed_same_initial_weights(seed: int) -> None:
    """Split layers draw as the unsplit model draws: splitting changes the chain, not the model."""
    whole = {(name, key): t for name, layer in _layers(_load({}, seed=seed)).items() for key, t in layer.state_dict().items()}
    split = _layers(_load({"head_shards": 3, "split_mamba": True}, seed=seed))
    for (name, key), (src, _, rows) in _unsplit_tensors(split).items():
        assert torch.equal(split[name].state_dict()[key], whole[(src, key)][rows]), f"{name} {key}"


def test_layer_counts_names_and_kinds() -> None:
    def chain(config: dict) -> list[tuple[str, str]]:
        model = load_model_file(HYBRID, config)
        module = model.module
        return [(module.layer_name(i, **model.config), module.layer_kind(i, **model.config)) for i in range(model.num_layers())]

    assert len(chain({})) == 10  # embedding, 8 blocks, head: today's model
    assert chain({})[-1] == ("head", "head")
    assert len(chain({"head_shards": 3})) == 12
    assert len(chain({"split_mamba": True})) == 14  # "mamemame" has four Mamba-style blocks
    both = chain({"head_shards": 2, "split_mamba": True})
    assert len(both) == 15
    assert both[1:3] == [("mamba.0.conv", "mamba"), ("mamba.0.scan", "mamba")]
    assert both[3] == ("attention.1", "attention")
    assert both[-2:] == [("head.0", "head-shard"), ("head.1", "head")]  # "head" is reserved for the last layer


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"head_shards": 0}, "config.head_shards"),
        ({"head_shards": SMALL["vocab"] + 1}, "config.head_shards"),
        ({"head_shards": "2"}, "config.head_shards"),
        ({"head_shards": 2.0}, "config.head_shards"),
        ({"head_shards": True}, "config.head_shards"),
        ({"split_mamba": "yes"}, "config.split_mamba"),
    ],
)
def test_bad_split_config_is_an_input_error(config: dict, field: str) -> None:
    model = _load(config)
    with pytest.raises(InputError) as excinfo:
        model.num_layers()
    assert excinfo.value.field == field


def test_profiles_through_the_command_line(tmp_path: Path) -> None:
    """``--config`` values are YAML scalars: ``split_mamba=true`` is a bool."""
    overrides = [f"--config={key}={value}" for key, value in {**SMALL, "head_shards": 2, "split_mamba": "true"}.items()]
    out = tmp_path / "split.yaml"
    result = CliRunner().invoke(app, ["profile", str(HYBRID), *overrides, "--microbatch-size", str(MICROBATCH),
                                      "--repeat", "1", "--device", "cpu", "-o", str(out)])
    assert result.exit_code == 0, result.output
    profile = load_profile(out)
    assert profile.model.config["split_mamba"] is True and profile.model.config["head_shards"] == 2
    assert [layer.name for layer in profile.layers][:3] == ["embed", "mamba.0.conv", "mamba.0.scan"]
    assert [layer.kind for layer in profile.layers][-2:] == ["head-shard", "head"]
    # what crosses a cut: (x, u, z) inside a block, (normed, logits_0) between head shards (fp32)
    tokens, inner = MICROBATCH * SMALL["seq"], 2 * SMALL["hidden"]
    by_name = {layer.name: layer for layer in profile.layers}
    assert by_name["mamba.0.conv"].output_bytes == 4 * tokens * (SMALL["hidden"] + 2 * inner)
    assert by_name["head.0"].output_bytes == 4 * tokens * (SMALL["hidden"] + 49)  # 97 rows: 49 + 48
    assert all(layer.forward_ms > 0 for layer in profile.layers)


def test_two_rank_pipeline_cut_inside_a_block_and_between_head_shards(tmp_path: Path) -> None:
    """Four stages on two ranks, alternating; stage boundaries after mamba.0.conv and head.0.
    fp32: losses equal the unsplit model's single-process run (same seed, same weights), final
    weights the split model's single-process run. bf16 (the tuple (x, u, z) then mixes fp32 and
    bf16): losses within 1e-3 of the single-process bf16 run, as tests/test_training.py allows."""
    config = {**SMALL, "pattern": "mame", "head_shards": 2, "split_mamba": True}
    # 0 embed, 1 mamba.0.conv | 2 mamba.0.scan, 3 attention.1, 4 mamba.2.conv, 5 mamba.2.scan, 6 moe.3,
    # 7 head.0 | 8 head.1 ... (the third stage holds nothing but head.0)
    assert load_model_file(HYBRID, config).num_layers() == 9
    stages = [(0, 2, 0), (2, 7, 1), (7, 8, 0), (8, 9, 1)]
    ranks, microbatches = [r for _, _, r in stages], 4
    schedule = h.list_schedule(ranks, microbatches, split=lambda s, m: (s + m) % 2 == 0,
                               priority=lambda op: (op.mb, op.kind.value != "F"))
    plan = h.make_plan(HYBRID, config, stages=stages, schedule=schedule, microbatches=microbatches,
                       microbatch_size=MICROBATCH)
    save_plan(plan, tmp_path / "plan.yaml")
    steps, lr = 2, 0.1
    jobs = [h.Job(precision, RunConfig(plan_path=str(tmp_path / "plan.yaml"), steps=steps, optimizer="sgd", lr=lr,
                                       timeout_s=30, precision=precision)) for precision in ("fp32", "bf16")]
    launched = h.launch(2, jobs, tmp_path / "out", timeout_s=90)
    assert launched.exitcodes == [0, 0], "\n".join(launched.logs)

    unsplit = {key: value for key, value in config.items() if key not in ("head_shards", "split_mamba")}
    run = dict(steps=steps, microbatches=microbatches, dp=1, microbatch_size=MICROBATCH, optimizer="sgd", lr=lr)
    whole_reference = h.reference(HYBRID, unsplit, **run)
    split_reference = h.reference(HYBRID, config, **run)
    losses = [m.loss for m in launched.result("fp32", 0)["metrics"]]
    assert losses == pytest.approx(whole_reference.losses, abs=1e-5)
    assert losses == pytest.approx(split_reference.losses, abs=1e-5)
    state = {**launched.result("fp32", 0)["state"], **launched.result("fp32", 1)["state"]}
    assert h.max_abs_diff(state, split_reference.state) <= 1e-5

    bf16_reference = h.reference(HYBRID, config, **run, precision="bf16")
    assert [m.loss for m in launched.result("bf16", 0)["metrics"]] == pytest.approx(bf16_reference.losses, rel=1e-3)
