"""``octoplan export --format torchtitan`` and ``tune --runs-on loop / v``: torchtitan's settings.

The settings file is compared line by line with a hand-written one; the module names are those
torchtitan's ``pipeline_module_split`` keeps per stage, and the placement is the one its
``_get_stage_indices`` computes for the schedule name written (loop, or V for ZB-V).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from dataclasses import replace

import pytest

from octoplan.baseline import make_baseline
from octoplan.errors import InputError
from octoplan.export import torch_csv_rows
from octoplan.export_torchtitan import export_torchtitan, module_fqns, torchtitan_export, torchtitan_placement
from octoplan.plan import Cluster, save_plan
from octoplan.profile import Layer, ModelRef, Profile, save_profile
from octoplan.tuner.search import TuneOptions, tune

KINDS = ["embedding"] + ["transformer"] * 6 + ["head"]


def _profile(kinds=KINDS, names=None, times=None) -> Profile:
    names = names or [f"l{i}" for i in range(len(kinds))]
    times = times or [(1.0 + (i % 3), 1.0, 1.0) for i in range(len(kinds))]
    layers = tuple(Layer(name, kind, f, i, w, 1000, 100, 10) for name, kind, (f, i, w) in zip(names, kinds, times))
    return Profile(model=ModelRef("m"), layers=layers, microbatch_size=3)


def _stage_indices(style: str, pp: int, num_stages: int, pp_rank: int) -> tuple[int, ...]:
    """torchtitan's rule (pipeline_module_split's _get_stage_indices), restated."""
    per_rank = num_stages // pp
    if style == "loop":
        return tuple(pp_rank + s * pp for s in range(per_rank))
    return list(zip(range(pp), range(num_stages - 1, pp - 1, -1)))[pp_rank]


def _with_bounds(plan, bounds):
    """``plan`` with its stages cut at ``bounds`` (the same ranks and ops)."""
    return replace(plan, stages=tuple(replace(s, start=a, end=b) for s, a, b in zip(plan.stages, bounds, bounds[1:])))


def test_loop_plan_settings_are_exact(tmp_path):
    plan = _with_bounds(make_baseline(_profile(), schedule="interleaved-1f1b", gpus=2, microbatches=4, chunks=2),
                        (0, 2, 4, 6, 8))
    export, csv_path = export_torchtitan(plan, _profile(), tmp_path / "tt.toml", file="p.yaml")
    assert csv_path == tmp_path / "tt.csv"
    assert (tmp_path / "tt.toml").read_text().splitlines() == [
        "# torchtitan settings for p.yaml (octoplan export --format torchtitan)",
        "# 4 stages in a loop on 2 pipeline ranks, 4 microbatches of 3",
        "[parallelism]",
        "pipeline_parallel_degree = 2",
        "# only decides where stages go (loop placement); the CSV sets the order",
        'pipeline_parallel_schedule = "Interleaved1F1B"',
        f"pipeline_parallel_schedule_csv = \"{tmp_path / 'tt.csv'}\"",
        "pipeline_parallel_microbatch_size = 3",
        "module_fqns_per_model_part = [",
        '    ["tok_embeddings", "layers.0"],',
        '    ["layers.1", "layers.2"],',
        '    ["layers.3", "layers.4"],',
        '    ["layers.5", "norm", "output"]',
        "]",
        "",
        "[training]",
        "# 4 microbatches = local_batch_size / pipeline_parallel_microbatch_size",
        "local_batch_size = 12",
        "",
        "[activation_checkpoint]",
        "# as the plan: torchtitan's presets recompute (selective or full) by default",
        'mode = "none"',
    ]
    settings = tomllib.loads((tmp_path / "tt.toml").read_text())
    parallelism = settings["parallelism"]
    assert settings["training"]["local_batch_size"] // parallelism["pipeline_parallel_microbatch_size"] == 4
    assert [row.split(",") for row in (tmp_path / "tt.csv").read_text().splitlines()] == torch_csv_rows(plan)
    for rank in range(2):  # torchtitan builds on each rank the stages the CSV gives it
        stages = {int(cell.split("F")[0]) for cell in (tmp_path / "tt.csv").read_text().splitlines()[rank].split(",")
                  if "F" in cell}
        assert stages == set(_stage_indices("loop", 2, 4, rank))


def test_any_file_name_stays_inside_its_string_or_comment(tmp_path):
    """A folder name with a line break, an emoji (beyond the BMP, which JSON escapes as
    surrogates that TOML refuses) and DEL: the TOML still parses to the CSV's own path, and the
    Megatron-LM file, sourced by bash, defines its array and runs nothing."""
    from octoplan.export_megatron import export_megatron

    folder = tmp_path / "a\necho RAN\n\U0001F600\x7f"
    folder.mkdir()
    plan = make_baseline(_profile(), schedule="interleaved-1f1b", gpus=2, microbatches=4, chunks=2)
    _, csv_path = export_torchtitan(plan, _profile(), folder / "tt.toml", file=str(folder / "p.yaml"))
    settings = tomllib.loads((folder / "tt.toml").read_text())
    assert settings["parallelism"]["pipeline_parallel_schedule_csv"] == str(csv_path)
    export = export_megatron(plan, _profile(), folder / "m.sh", file=str(folder / "p.yaml"))
    done = subprocess.run(["bash", "-c", 'source "$0" && printf "%s\\n" "${MEGATRON_PP_ARGS[@]}"', str(folder / "m.sh")],
                          capture_output=True, text=True)
    assert done.returncode == 0 and done.stderr == "" and done.stdout.splitlines() == list(export.arguments), done
    # a folder whose name is no UTF-8 (byte 0xff): the Megatron-LM file escapes it in its comment;
    # the TOML could not name its CSV, so nothing is written
    raw = tmp_path / os.fsdecode(b"raw\xffdir")
    raw.mkdir()
    export_megatron(plan, _profile(), raw / "m.sh", file=str(raw / "p.yaml"))
    assert "raw\\udcffdir" in (raw / "m.sh").read_text()
    with pytest.raises(InputError, match="-o: is not a UTF-8 path"):
        export_torchtitan(plan, _profile(), raw / "tt.toml")
    assert sorted(p.name for p in raw.iterdir()) == ["m.sh"]


def test_one_stage_per_rank_is_1f1b_and_v_plans_are_zbv():
    one = torchtitan_export(_with_bounds(make_baseline(_profile(), schedule="1f1b", gpus=4, microbatches=4),
                                         (0, 2, 4, 6, 8)), _profile())
    assert (one.placement, one.schedule_name) == ("loop", "1F1B")
    assert one.fqns == (("tok_embeddings", "layers.0"), ("layers.1", "layers.2"), ("layers.3", "layers.4"),
                        ("layers.5", "norm", "output"))
    plan = make_baseline(_profile(), schedule="zbv", gpus=2, microbatches=4)
    v = torchtitan_export(plan, _profile())
    assert (v.placement, v.schedule_name) == ("v", "ZBVZeroBubble")
    assert [s.rank for s in plan.stages] == [0, 1, 1, 0]
    for rank in range(2):
        assert {s for s, stage in enumerate(plan.stages) if stage.rank == rank} == set(_stage_indices("v", 2, 4, rank))
    assert v.fqns[3][-2:] == ("norm", "output") and v.fqns[0][0] == "tok_embeddings"
    assert list(map(list, v.rows)) == torch_csv_rows(plan)


def test_other_placements_are_refused_naming_the_one_needed(tmp_path):
    three = make_baseline(_profile(), schedule="1f1b", gpus=2, microbatches=2)
    moved = replace(three, stages=(replace(three.stages[0], rank=1), replace(three.stages[1], rank=0)))
    moved = moved.with_schedule([three.schedule[1], three.schedule[0]])
    assert torchtitan_placement(moved) is None
    with pytest.raises(InputError, match=r"rank s mod pp .* V of exactly two stages per rank") as info:
        export_torchtitan(moved, _profile(), tmp_path / "x.toml")
    assert "--runs-on loop" in info.value.fix
    assert not (tmp_path / "x.toml").exists() and not (tmp_path / "x.csv").exists()


def _swap_ranks(schedule, plan):
    """Each rank's ops for ``plan``'s placement: the ops of the stages it now holds, in the order
    they ran on their old rank (any valid order will do here)."""
    out = [[] for _ in range(plan.pp)]
    for ops in schedule:
        for op in ops:
            out[plan.stages[op.stage].rank].append(op)
    return out


def test_split_blocks_name_one_layer_and_refuse_a_cut_inside():
    kinds = ["embedding", "transformer.mixer", "transformer.ffn", "moe.mixer", "moe.ffn", "head"]
    names = ["embed", "layers.0.mixer", "layers.0.ffn", "layers.1.mixer", "layers.1.ffn", "head"]
    profile = _profile(kinds=kinds, names=names)
    plan = make_baseline(profile, schedule="1f1b", gpus=2, microbatches=2)
    whole = replace(plan, stages=(replace(plan.stages[0], end=3), replace(plan.stages[1], start=3)))
    assert module_fqns(whole, profile) == [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]
    assert module_fqns(whole, profile, style="profile") == [["embed", "layers.0.mixer", "layers.0.ffn"],
                                                            ["layers.1.mixer", "layers.1.ffn", "head"]]
    inside = replace(plan, stages=(replace(plan.stages[0], end=2), replace(plan.stages[1], start=2)))
    with pytest.raises(InputError, match="inside block layers.0"):
        module_fqns(inside, profile)
    with pytest.raises(InputError, match="--fqn-style"):
        module_fqns(whole, profile, style="hf")


def test_profile_names_of_an_hf_model_are_refused():
    """An hf: chain's layer names (norm+lm_head) are no module of the transformers model:
    torchtitan would drop them, and the head with them."""
    names = ["embed_tokens"] + [f"layers.{k}" for k in range(6)] + ["norm+lm_head"]
    profile = replace(_profile(names=names), model=ModelRef("qwen3", source="hf:/models/qwen3"))
    plan = make_baseline(profile, schedule="1f1b", gpus=2, microbatches=2)
    with pytest.raises(InputError, match="are the pipeline's pieces, not module names"):
        module_fqns(plan, profile, style="profile")
    assert module_fqns(plan, profile)[-1][-2:] == ["norm", "output"]  # the llama style is the user's to choose


def test_a_pp_1_plan_of_several_stages_is_refused_for_what_it_is():
    """torchtitan turns pipelining off at a degree of 1: a pp-1 plan of two stages (a loop by
    the letter, stage s on rank s mod 1) would run as one stage."""
    profile = _profile()
    plan = make_baseline(profile, schedule="interleaved-1f1b", gpus=1, microbatches=2, chunks=2)
    with pytest.raises(InputError) as caught:
        torchtitan_export(plan, profile, file="p.yaml")
    assert caught.value.problem == ("are 2 on one pipeline rank (pp 1): torchtitan builds no pipeline at pp 1, so it "
                                    "runs the model as one stage, not as the plan's")
    one = make_baseline(profile, schedule="1f1b", gpus=1, microbatches=2)
    assert torchtitan_export(one, profile).placement == "loop"


def test_profile_names_that_repeat_are_refused():
    """A model file without layer_name names each layer by its class: Block, Block, ... would
    give one module name to two stages, so torchtitan's split would differ from the plan."""
    profile = _profile(kinds=["embedding", "moe", "moe", "moe", "mtp", "head"],
                       names=["Embed", "Block", "Block", "Block", "Mtp", "Head"])
    plan = make_baseline(profile, schedule="1f1b", gpus=2, microbatches=2)
    with pytest.raises(InputError) as caught:
        module_fqns(plan, profile, style="profile", file="p.yaml")
    assert (caught.value.file, caught.value.field) == ("p.yaml", "--fqn-style profile")
    assert caught.value.problem == ("layers 1 and 2 are both named 'Block'; torchtitan would give one module to two "
                                    "stages")


def test_llama_names_refuse_layers_a_llama_style_model_does_not_have():
    # DeepSeek-V3's MTP layer would have become layers.4, a module torchtitan's split silently skips
    profile = _profile(kinds=["embedding", "moe", "moe", "moe", "mtp", "head"],
                       names=["embed", "l0", "l1", "l2", "mtp.0", "head"])
    plan = make_baseline(profile, schedule="1f1b", gpus=2, microbatches=2)
    with pytest.raises(InputError) as caught:
        module_fqns(plan, profile, file="p.yaml")
    assert (caught.value.file, caught.value.field) == ("p.yaml", "--fqn-style llama")
    assert caught.value.problem.startswith("has no module for layer 4 (mtp.0, kind 'mtp')")
    assert module_fqns(plan, profile, style="profile") == [["embed", "l0", "l1"], ["l2", "mtp.0", "head"]]


def test_llama_names_give_the_first_and_last_stage_the_embedding_and_head_a_profile_lacks():
    """Four decoder layers and nothing else timed: torchtitan's split sets every module no stage
    names to None, so stage 0 would take token ids and the last stage give no logits."""
    profile = _profile(kinds=["transformer"] * 4)
    plan = make_baseline(profile, schedule="1f1b", gpus=2, microbatches=2)
    assert module_fqns(plan, profile) == [["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm",
                                                                                       "output"]]
    assert module_fqns(plan, profile, style="profile") == [["l0", "l1"], ["l2", "l3"]]  # the profile's own names


def test_tune_runs_on_loop_and_v():
    profile = _profile()
    for runs_on, placement in (("loop", "loop"), ("v", "v")):
        result = tune(profile, Cluster(gpus=2), TuneOptions(gpus=2, pp=2, microbatches=4, max_plans=300, runs_on=runs_on))
        assert torchtitan_placement(result.plan) == placement
        assert "torchtitan" in result.runs_on
        torchtitan_export(result.plan, profile)  # and it exports
    free = tune(profile, Cluster(gpus=2), TuneOptions(gpus=2, pp=2, microbatches=4, max_plans=300))
    loop = tune(profile, Cluster(gpus=2), TuneOptions(gpus=2, pp=2, microbatches=4, max_plans=300, runs_on="loop"))
    assert free.scored.iteration_ms <= loop.scored.iteration_ms + 1e-9 or "torchtitan" not in free.runs_on


def test_torchtitan_numbers_ranks_dp_inner_across_nodes():
    """torchtitan's device mesh is ["pp", "dp_replicate", ...]: pp outermost, so a stage's
    replicas take consecutive ranks (dp-inner). On 2 nodes of 2 GPUs a pp-inner plan keeps each
    pipeline on one node, where torchtitan would put each across both: refused, and not counted
    as torchtitan's; dp-inner, or all 4 GPUs on one node, it runs as planned. `--runs-on loop`
    searches dp-inner only there."""
    from octoplan.tuner.frameworks import Frameworks
    from octoplan.tuner.space import Candidate, Config

    profile, nodes = _profile(), Cluster(gpus=4, gpus_per_node=2)
    plan = make_baseline(profile, schedule="1f1b", gpus=4, pp=2, microbatches=4, cluster=nodes)
    with pytest.raises(InputError) as caught:
        torchtitan_export(plan, profile, file="p.yaml")
    assert (caught.value.file, caught.value.field) == ("p.yaml", "parallel.rank_order")
    assert caught.value.problem.startswith("is pp-inner with dp 2 on 4 GPUs of 2 a node")
    torchtitan_export(make_baseline(profile, schedule="1f1b", gpus=4, pp=2, microbatches=4, cluster=nodes,
                                    rank_order="dp-inner"), profile)
    torchtitan_export(make_baseline(profile, schedule="1f1b", gpus=4, pp=2, microbatches=4), profile)  # one node
    # pp 1: both orders number the replicas alike (rank = dp rank)
    torchtitan_export(make_baseline(profile, schedule="1f1b", gpus=4, pp=1, microbatches=4, cluster=nodes), profile)
    loop = lambda order: Candidate(Config(2, 2, 4, order), (0, 4, 8), (0, 1))
    assert "torchtitan" not in Frameworks(profile, cluster=nodes).runs_on(loop("pp-inner"))
    assert "torchtitan" in Frameworks(profile, cluster=nodes).runs_on(loop("dp-inner"))
    assert "torchtitan" in Frameworks(profile, cluster=Cluster(gpus=4)).runs_on(loop("pp-inner"))
    result = tune(profile, nodes, TuneOptions(gpus=4, pp=2, microbatches=4, max_plans=200, runs_on="loop"))
    assert result.plan.parallel.rank_order == "dp-inner" and "torchtitan" in result.runs_on
    torchtitan_export(result.plan, profile)


def test_cli_writes_both_files_or_refuses_with_exit_2(tmp_path):
    save_profile(_profile(), tmp_path / "p.yaml")
    plan = make_baseline(_profile(), schedule="zbv", gpus=2, microbatches=4, profile_path=tmp_path / "p.yaml")
    save_plan(plan, tmp_path / "v.yaml")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = lambda *args: subprocess.run([sys.executable, "-m", "octoplan.cli", "export", *args], capture_output=True,
                                       text=True, cwd=tmp_path, env=env)
    done = run("v.yaml", "--format", "torchtitan", "-o", "v.toml")
    assert done.returncode == 0, done.stderr
    settings = tomllib.loads((tmp_path / "v.toml").read_text())["parallelism"]
    assert settings["pipeline_parallel_schedule"] == "ZBVZeroBubble"
    assert settings["pipeline_parallel_schedule_csv"] == "v.csv" and (tmp_path / "v.csv").exists()
    moved = replace(plan, stages=tuple(replace(s, rank=r) for s, r in zip(plan.stages, (0, 0, 1, 1))))
    moved = moved.with_schedule(_swap_ranks(plan.schedule, moved))
    save_plan(moved, tmp_path / "m.yaml")
    done = run("m.yaml", "--format", "torchtitan", "-o", "m.toml")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "torchtitan places stage s on rank s mod pp" in done.stderr
    assert not (tmp_path / "m.toml").exists() and not (tmp_path / "m.csv").exists()
    done = run("v.yaml", "--format", "torchtitan", "-o", "v.csv")  # the CSV would overwrite the settings
    assert done.returncode == 2 and "names the file" in done.stderr


def test_what_tune_says_torchtitan_runs_its_export_takes():
    """A split-blocks analytic profile tuned --runs-on loop: the search may cut a block between
    its mixer and MLP, which torchtitan's modules cannot; the plan it calls torchtitan's
    exports. A Mamba hybrid's layers have no Llama-style module: its plans are torchtitan's
    through the profile's own names (--fqn-style profile), and an analytic hybrid's, whose names
    are no module names, are not."""
    from octoplan.arch import analytic_profile

    split = analytic_profile("llama3-8b", "h100", split_blocks=True)
    result = tune(split, Cluster(gpus=4), TuneOptions(gpus=4, pp=4, microbatches=8, max_plans=300, runs_on="loop"))
    assert "torchtitan" in result.runs_on
    torchtitan_export(result.plan, split)
    hybrid = _profile(kinds=["embedding", "mamba", "transformer", "mamba", "transformer", "head"])
    looped = tune(hybrid, Cluster(gpus=2), TuneOptions(gpus=2, pp=2, microbatches=4, max_plans=100, runs_on="loop"))
    assert torchtitan_placement(looped.plan) == "loop" and "torchtitan" in looped.runs_on
    module_fqns(looped.plan, hybrid, style="profile")  # the export that claim rests on
    with pytest.raises(InputError, match="has no module for layer 1"):
        module_fqns(looped.plan, hybrid)
    # an analytic hybrid: neither its kinds (llama) nor its names (profile) export, so a search
    # confined to torchtitan's placement has nothing to find, and says why before it starts
    analytic = analytic_profile("nemotron-h-8b", "h100")
    free = tune(analytic, Cluster(gpus=4), TuneOptions(gpus=4, pp=4, microbatches=8, max_plans=50))
    assert all("torchtitan" not in row.runs_on for row in free.baselines if row.config.pp > 1)
    with pytest.raises(InputError, match=r"--runs-on loop: torchtitan's export has no module name for the profile's "
                                         r"'mamba' layers"):
        tune(analytic, Cluster(gpus=4), TuneOptions(gpus=4, max_plans=50, runs_on="loop"))


def test_analytic_profile_names_are_no_module_names():
    """--arch profiles name their layers embed, layers.N, head: torchtitan would drop the
    embedding, norm and output modules no stage names."""
    from octoplan.arch import analytic_profile

    profile = analytic_profile("llama3-8b", "h100")
    plan = make_baseline(profile, schedule="1f1b", gpus=4, microbatches=4)
    with pytest.raises(InputError, match="the layer names of the analytic profile of llama3-8b are its own"):
        module_fqns(plan, profile, style="profile")
    assert module_fqns(plan, profile)[0][0] == "tok_embeddings"


def test_the_settings_say_what_the_plan_recomputes_and_how_dp_runs(tmp_path):
    """torchtitan's presets recompute by default, and it has one mode for every model part:
    none where no stage recomputes, full where every stage recomputes all its layers, no
    setting (and the export's note) where stages differ. dp > 1 says that torchtitan shards it."""
    from octoplan.export_torchtitan import checkpoint_mode

    plan = make_baseline(_profile(), schedule="1f1b", gpus=4, microbatches=4, pp=2)
    assert plan.parallel.dp == 2 and checkpoint_mode(plan) == "none"
    text = torchtitan_export(plan, _profile()).toml(plan=plan, microbatch_size=3, csv_path="x.csv", title="t")
    assert "# dp 2: torchtitan shards it with FSDP by default" in text
    assert tomllib.loads(text)["activation_checkpoint"] == {"mode": "none"}
    every = replace(plan, stages=tuple(replace(s, recompute=True) for s in plan.stages))
    assert checkpoint_mode(every) == "full"
    assert tomllib.loads(torchtitan_export(every, _profile()).toml(plan=every, microbatch_size=3, csv_path="x.csv",
                                                                   title="t"))["activation_checkpoint"]["mode"] == "full"
    some = replace(plan, stages=(replace(plan.stages[0], recompute=True), plan.stages[1]))
    assert checkpoint_mode(some) is None
    assert "activation_checkpoint" not in torchtitan_export(some, _profile()).toml(plan=some, microbatch_size=3,
                                                                                   csv_path="x.csv", title="t")
