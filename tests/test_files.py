"""Profile and plan files: round trips, and one clear error naming file, field and fix for
every violation — through the library and through the command line (exit 2, one line)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from octoplan.baseline import make_baseline
from octoplan.errors import InputError
from octoplan.plan import load_plan, load_plan_profile, plan_to_dict, save_plan
from octoplan.profile import load_profile, profile_to_dict

from conftest import free_cluster, make_profile


def _octoplan(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "octoplan", *map(str, args)], capture_output=True, text=True, cwd=cwd)


@pytest.fixture
def baseline_files(tmp_path, profile_file):
    profile = make_profile([(1, 1, 1)] * 6, kinds=["embedding", "layer", "layer", "layer", "layer", "head"], out=1000, act=10)
    ppath = profile_file(profile)
    plan = make_baseline(profile, schedule="zb-h1", gpus=2, microbatches=4, cluster=free_cluster(2), profile_path=ppath)
    path = tmp_path / "plan.yaml"
    save_plan(plan, path)
    return ppath, path


def test_profile_round_trips(profile_file):
    profile = make_profile([(1.5, 0.25, 0.125), (2, 1, 1)], out=7, act=3, params=11)
    assert load_profile(profile_file(profile)) == profile
    assert profile_to_dict(profile)["format"] == "octoplan-profile/1"


def test_plan_round_trips(baseline_files):
    ppath, path = baseline_files
    plan = load_plan(path)
    assert plan_to_dict(plan) == yaml.safe_load(path.read_text())
    assert load_plan_profile(plan, path).num_layers == 6


PROFILE_BREAKS = [
    (lambda d: d.update(format="other/9"), "format", "expected 'octoplan-profile/1'"),
    (lambda d: d["layers"][1].update(forward_ms=-1.0), "layers[1].forward_ms", "must be >= 0"),
    (lambda d: d["layers"][0].pop("backward_weight_ms"), "layers[0].backward_weight_ms", "is missing"),
    (lambda d: d["layers"][0].update(param_bytes="lots"), "layers[0].param_bytes", "must be a whole number"),
    (lambda d: d["layers"][1].update(kind="embedding"), "layers[1].kind", "reserved for the first layer"),
    (lambda d: d.update(layers=[]), "layers", "is empty"),
    # finite but absurd: sums over ops would overflow to inf, CP-SAT's integer ticks past 64 bits
    (lambda d: d["layers"][1].update(forward_ms=1e308), "layers[1].forward_ms", "must be <= 8.64e+07"),
    (lambda d: d["layers"][0].update(backward_ms="fast"), "layers[0].backward_ms", "must be a number"),
    (lambda d: d["layers"][1].update(backward_ms=-0.5), "layers[1].backward_ms", "must be >= 0"),
    (lambda d: d["layers"][0].update(param_bytes=10**400), "layers[0].param_bytes", "got a 401-digit number"),
    # parts of another field that do not fit in it (the profiler measures them as subsets)
    (lambda d: d["layers"][1].update(w_saved_bytes=d["layers"][1]["activation_bytes"] + 1), "layers[1].w_saved_bytes",
     "more than activation_bytes"),
    (lambda d: d["layers"][1].update(w_saved_bytes=0, input_freed_bytes=d["layers"][1]["activation_bytes"] + 1),
     "layers[1].input_freed_bytes", "more than activation_bytes"),
    (lambda d: d["layers"][2].update(output_saved_bytes=4, output_w_bytes=8), "layers[2].output_w_bytes",
     "more than output_saved_bytes 4"),
    # an int of 400 digits has no float: math.isfinite() of it raised OverflowError (exit 1)
    (lambda d: d["layers"][0].update(flops=10**400), "layers[0].flops", "must be a finite number, got a 401-digit number"),
    # a misspelt field was dropped and its default used; other unknown fields are extensions SPEC allows
    (lambda d: d["layers"][1].update(backwrd_ms=0.5), "layers[1].backwrd_ms", "did you mean backward_ms?"),
    (lambda d: d["layers"][0].update(w_saved_byte=0), "layers[0].w_saved_byte", "did you mean w_saved_bytes?"),
    (lambda d: d.update({"microbatch-size": 8}), "microbatch-size", "did you mean microbatch_size?"),
]


@pytest.mark.parametrize("mutate,field,problem", PROFILE_BREAKS)
def test_bad_profiles_name_the_field(tmp_path, mutate, field, problem):
    data = profile_to_dict(make_profile([(1, 1, 1)] * 3))
    mutate(data)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(InputError) as info:
        load_profile(path)
    assert info.value.file == str(path) and info.value.field == field and problem in str(info.value)


PLAN_BREAKS = [
    (lambda d: d["stages"][1].update(layers=[2, 6]), "stages[1].layers", "overlaps the stage before"),
    (lambda d: d["stages"][1].update(layers=[4, 6]), "stages[1].layers", "leaves a gap"),
    (lambda d: d["stages"][0].update(rank=5), "stages[0].rank", "outside 0..1"),
    (lambda d: d["schedule"].update({0: d["schedule"][0].replace("0W0", "")}), "schedule.0", "0I0 without 0W0"),
    (lambda d: d["schedule"].update({0: d["schedule"][0] + " 1F0"}), "schedule.0", "stage 1 is on rank 1"),
    (lambda d: d["schedule"].update({0: d["schedule"][0].replace("0F1", "0Q1")}), "schedule.0", "unknown op '0Q1'"),
    (lambda d: d["schedule"].update({1: "1F0 " + d["schedule"][1]}), "schedule.1", "1F0 appears twice"),
    (lambda d: d["schedule"].update({0: d["schedule"][0].replace("0I0", "0X").replace("0W0", "0I0").replace("0X", "0W0")}),
     "schedule.0", "0W0 comes before 0I0"),
    (lambda d: d["schedule"].pop(1), "schedule.1", "is missing"),
    (lambda d: d["parallel"].update(pp=3), "cluster.gpus", "pp*dp"),
    (lambda d: d["stages"][0].update(layers=[-1, 3]), "stages[0].layers", "[-1, 3) does not start at layer 0"),
    (lambda d: d["stages"][0].update(layers=[3, 0]), "stages[0].layers", "[3, 0) is empty"),
    # a misspelt field would otherwise be dropped, its default used in silence
    (lambda d: d["cluster"].update(gpu_per_node=4), "cluster.gpu_per_node", "did you mean gpus_per_node?"),
    (lambda d: d["stages"][1].update(recompte=True), "stages[1].recompte", "did you mean recompute?"),
    (lambda d: d["parallel"].update(micro_batches=8), "parallel.micro_batches", "did you mean microbatches?"),
    (lambda d: d.update(profile_sha256="xyz"), "profile_sha256", "not a SHA-256 digest"),
    (lambda d: d["cluster"].update(latency_us=10**400), "cluster.latency_us", "must be <= 1e+09, got a 401-digit number"),
    # "²" passes str.isdigit() but not int(); "٢" passed both, as rank 2
    (lambda d: d["schedule"].update({"²": d["schedule"].pop(1)}), "schedule.²", "is not a pipeline rank"),
    (lambda d: d["schedule"].update({"٢": d["schedule"].pop(1)}), "schedule.٢", "is not a pipeline rank"),
    (lambda d: d["parallel"].update(microbatches=5000), "parallel.microbatches", "must be <= 4096, got 5000"),
    (lambda d: d.update(profile=""), "profile", "is empty"),
    (lambda d: d.update(profil=d.pop("profile")), "profil", "did you mean profile?"),
]


@pytest.mark.parametrize("mutate,field,problem", PLAN_BREAKS)
def test_bad_plans_name_the_field_and_exit_2_from_the_cli(baseline_files, mutate, field, problem):
    _, path = baseline_files
    data = yaml.safe_load(path.read_text())
    mutate(data)
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(InputError) as info:
        load_plan(path)
    assert info.value.field == field and problem in str(info.value)
    run = _octoplan("validate", path)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and field in lines[0] and "Traceback" not in run.stderr


def test_simulate_splits_each_ranks_idle_into_warm_up_between_and_drain(baseline_files):
    # ZB-H1 on 2 ranks, stages of 3 layers (F = I = W = 3 ms): rank 1 starts after 0F0 (3 ms of
    # warm-up) and never waits again; rank 0 waits from 6 to 9 for 1I0; both end together at 39
    _, path = baseline_files
    run = subprocess.run([sys.executable, "-m", "octoplan.cli", "simulate", str(path)], capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "200"})
    assert run.returncode == 0, run.stderr
    assert "idle: warm-up / between / drain" in run.stdout
    rows = {line.split()[1]: line for line in run.stdout.splitlines() if line.startswith("│ ") and "/" in line}
    assert "0.00 / 3.00 / 0.00" in rows["0"] and "3.00 / 0.00 / 0.00" in rows["1"], run.stdout


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_output_to_a_full_disk_is_one_line_naming_stdout(baseline_files):
    _, path = baseline_files
    with open("/dev/full", "w") as full:  # every write fails: no space left on the device
        run = subprocess.run([sys.executable, "-m", "octoplan.cli", "simulate", str(path)], stdout=full,
                             stderr=subprocess.PIPE, text=True)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "error: stdout: cannot be written: No space left on device (check where the output goes and its free space)"]


def test_a_plan_whose_profile_changed_is_refused(baseline_files):
    ppath, path = baseline_files
    ppath.write_text(ppath.read_text().replace("forward_ms: 1.0", "forward_ms: 2.0", 1))
    run = _octoplan("simulate", path)
    assert run.returncode == 2
    assert "profile_sha256" in run.stderr and "re-run octoplan tune or baseline" in run.stderr


def test_a_deadlocked_plan_is_reported_with_the_waits(baseline_files):
    _, path = baseline_files
    data = yaml.safe_load(path.read_text())
    ops = data["schedule"][1].split()
    ops.remove("1F0")
    ops.insert(ops.index("1I0") + 1, "1F0")  # rank 1's first backward now precedes its forward
    data["schedule"][1] = " ".join(ops)
    path.write_text(yaml.safe_dump(data))
    run = _octoplan("validate", path)
    assert run.returncode == 2
    assert "schedule: deadlock: rank 0 waits at 0I0 for 1I0 (rank 1); rank 1 waits at 1I0 for 1F0 (rank 1)" in run.stderr


def test_missing_and_malformed_files(tmp_path):
    run = _octoplan("simulate", tmp_path / "nope.yaml")
    assert run.returncode == 2 and "no such plan file" in run.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("format: [unclosed")
    run = _octoplan("validate", bad)
    assert run.returncode == 2 and "not valid YAML" in run.stderr and len(run.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args,field", [
    (["--microbatches", "0"], "--microbatches"),
    (["--pp", "3"], "--pp"),
    (["--schedule", "2f2b"], "--schedule"),
    (["--partition", "random"], "--partition"),
    (["--latency-us", "-1"], "--latency-us"),
    (["--microbatches", "100000"], "--microbatches"),  # would take minutes: refused, not run
    (["--chunks", "3"], "--chunks"),  # 1F1B holds one stage per rank: the flag would be ignored
    (["--pp", "0"], "--pp"),
    (["--memory-gb", "1e300"], "--memory-gb"),  # its byte count would overflow the simulator
    (["--intra-node-gbps", "1e-300"], "--intra-node-gbps"),  # a plan file would refuse it: so does the flag
    (["--schedule", "zbv", "--chunks", "3"], "--chunks"),
])
def test_bad_baseline_options_exit_2_naming_the_option(profile_file, tmp_path, args, field):
    profile = make_profile([(1, 1, 1)] * 8)
    base = {"--schedule": "1f1b"}
    options = dict(base, **dict(zip(args[::2], args[1::2])))
    flat = [item for pair in options.items() for item in pair]
    run = _octoplan("baseline", profile_file(profile), "--gpus", 4, *flat, "-o", tmp_path / "plan.yaml")
    assert run.returncode == 2, run.stderr
    assert run.stderr.count("\n") == 1 and field in run.stderr and "Traceback" not in run.stderr
    assert not (tmp_path / "plan.yaml").exists()


def test_spec_example_numbers_and_non_finite_values(tmp_path):
    # FORMATS.md section 2 writes flops: 1.2e9 — a float in YAML 1.2 though a string in YAML 1.1.
    text = """format: octoplan-profile/1
model: {name: t}
layers:
  - {name: a, kind: embedding, forward_ms: 1e-3, backward_input_ms: 0.05, backward_weight_ms: 0.30,
     param_bytes: 6291456, activation_bytes: 1048576, output_bytes: 262144, flops: 1.2e9}
"""
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    layer = load_profile(path).layers[0]
    assert (layer.forward_ms, layer.flops) == (0.001, 1.2e9)
    path.write_text(text.replace("forward_ms: 1e-3", "forward_ms: .inf"))
    with pytest.raises(InputError, match="must be a finite number"):
        load_profile(path)


def test_usage_errors_are_one_line_exit_2(tmp_path):
    for args in (["simulate"], ["frobnicate"], ["validate", tmp_path]):
        run = _octoplan(*args)
        assert run.returncode == 2 and run.stderr.count("\n") == 1 and "Traceback" not in run.stderr, (args, run.stderr)


def test_an_unknown_dtype_is_refused_not_guessed(tmp_path):
    data = profile_to_dict(make_profile([(1, 1, 1)]))
    data["dtype"] = "int4"
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(InputError) as info:
        load_profile(path)
    assert info.value.field == "dtype" and "bf16" in info.value.fix


@pytest.mark.parametrize("args,field", [
    (["profile", "--arch", "llama3-8b", "--seq-len", "1000000000000"], "--seq-len"),
    (["profile", "--arch", "llama3-8b", "--microbatch-size", "100000000000000000"], "--microbatch-size"),
    (["profile", "--arch", "llama3-8b", "--config", "hidden=5"], "--config"),
    (["profile", "examples/models/tiny_gpt.py", "--arch", "llama3-8b"], "--arch"),
    (["profile", "examples/models/tiny_gpt.py", "--microbatch-size", "0"], "--microbatch-size"),
    # an option of the other kind of profile: it used to be ignored without a word
    (["profile", "examples/models/tiny_gpt.py", "--tp", "2"], "--tp"),
    (["profile", "examples/models/tiny_gpt.py", "--split-blocks"], "--split-blocks"),
    (["profile", "examples/models/tiny_gpt.py", "--gpu", "a100"], "--gpu"),
    (["profile", "--arch", "llama3-8b", "--repeat", "3"], "--repeat"),
    (["profile", "--arch", "llama3-8b", "--check-whole"], "--check-whole"),
    (["profile", "--arch", "llama3-8b", "--threads", "2"], "--threads"),
    (["profile", "examples/models/tiny_gpt.py", "--threads", "0"], "--threads"),
    # small layers at seq-len 1, but a microbatch size no reader of the profile accepts
    (["profile", "--arch", "gemma2-27b", "--seq-len", "1", "--microbatch-size", "2000000"], "--microbatch-size"),
    (["profile", "examples/models/tiny_gpt.py", "--microbatch-size", "2000000"], "--microbatch-size"),
])
def test_profile_options_that_conflict_or_overflow_exit_2(tmp_path, args, field):
    # each used to be ignored (exit 0, another profile written) or crash a later command
    root = Path(__file__).resolve().parents[1]
    run = _octoplan(*args, "-o", tmp_path / "x.yaml", cwd=root)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and field in run.stderr, run.stderr
    assert "Traceback" not in run.stderr and not (tmp_path / "x.yaml").exists()


def test_tune_refuses_more_microbatches_than_it_can_plan_in_time(tmp_path, profile_file):
    ppath = profile_file(make_profile([(1, 1, 1)] * 8))
    for args, field in ((["--microbatches", "5000"], "--microbatches: is 5000 (use 1 to 4096)"),
                        (["--global-batch", "100000"], "--global-batch: 100000 samples make")):
        run = _octoplan("tune", ppath, "--gpus", 2, *args, "--time-limit", 1, "-o", tmp_path / "t.yaml")
        assert run.returncode == 2 and field in run.stderr and run.stderr.count("\n") == 1, run.stderr
    assert not (tmp_path / "t.yaml").exists()


def test_show_refuses_widths_it_cannot_draw(baseline_files):
    _, path = baseline_files
    for width in (0, -5, 39, 100_000_000):
        run = _octoplan("show", path, "--width", width)
        assert run.returncode == 2 and "--width" in run.stderr and run.stderr.count("\n") == 1, run.stderr
    assert _octoplan("show", path, "--width", 40).returncode == 0


def test_a_plan_without_a_usable_profile_field_names_the_plan_and_the_field(baseline_files):
    _, path = baseline_files
    data = yaml.safe_load(path.read_text())
    data.pop("profile")
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    run = _octoplan("simulate", path)
    assert run.returncode == 2 and f"{path}: profile: is missing" in run.stderr, run.stderr
    # validate still checks what it can, and says what it could not
    run = _octoplan("validate", path)
    assert run.returncode == 0 and "not checked" in run.stdout
    data["profile"] = str(path.parent)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    for command in ("simulate", "validate"):
        run = _octoplan(command, path)
        assert run.returncode == 2 and f"{path}: profile: " in run.stderr and "is a folder" in run.stderr, run.stderr


def test_no_command_says_so(tmp_path):
    run = _octoplan()
    assert run.returncode == 2 and run.stderr == "error: no command given (see octoplan --help)\n"


def test_a_closed_stdout_still_ends_well_with_the_files_written(baseline_files, tmp_path):
    """``octoplan show PLAN --svg F | head -1``: rich exited 1 at the first print, silently,
    and the files were never written."""
    _, plan = baseline_files
    svg, trace = tmp_path / "t.svg", tmp_path / "t.json"
    read_end, write_end = os.pipe()
    os.close(read_end)  # a reader that is gone before the first line: every write fails
    try:
        run = subprocess.run([sys.executable, "-m", "octoplan.cli", "show", str(plan), "--svg", str(svg), "--trace",
                              str(trace)], stdout=write_end, stderr=subprocess.PIPE, text=True)
    finally:
        os.close(write_end)
    assert run.returncode == 0 and run.stderr == "", run.stderr
    assert svg.exists() and trace.exists()


def test_a_cluster_of_a_part_node_is_refused_by_the_planner_and_in_plan_files(baseline_files, tmp_path):
    """12 GPUs on nodes of 8: the plan was written, and its second node's launch refused."""
    path, plan = baseline_files
    for command in (["tune", path, "--gpus", 12, "--max-plans", 10], ["baseline", path, "--gpus", 12, "--schedule", "1f1b"]):
        run = _octoplan(*command, "--gpus-per-node", 8, "-o", tmp_path / "x.yaml")
        assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
        assert "--gpus: is 12, not a whole number of nodes of 8 GPUs (the last would hold 4;" in run.stderr
        assert not (tmp_path / "x.yaml").exists()
    assert _octoplan("baseline", path, "--gpus", 12, "--gpus-per-node", 4, "--schedule", "1f1b", "--pp", 2,
                     "-o", tmp_path / "x.yaml").returncode == 0  # three nodes of 4
    data = yaml.safe_load(plan.read_text())
    data["cluster"]["gpus_per_node"] = 3  # 2 GPUs: a part of one node is fine; 4 on nodes of 3 is not
    plan.write_text(yaml.safe_dump(data, sort_keys=False))
    assert _octoplan("validate", plan).returncode == 0
    data["cluster"].update(gpus=4)
    data["parallel"].update(dp=2)
    plan.write_text(yaml.safe_dump(data, sort_keys=False))
    run = _octoplan("validate", plan)
    assert run.returncode == 2 and f"{plan}: cluster.gpus: is 4, not a whole number of nodes of 3 GPUs" in run.stderr


def test_show_checks_the_measured_trace_before_writing_anything(baseline_files, tmp_path):
    _, plan = baseline_files
    svg, trace, measured = tmp_path / "t.svg", tmp_path / "t.json", tmp_path / "empty.json"
    measured.write_text('{"traceEvents": []}')
    for given in (measured, tmp_path / "missing.json"):
        run = _octoplan("show", plan, "--svg", svg, "--trace", trace, "--measured", given)
        assert run.returncode == 2 and run.stderr.count("\n") == 1 and str(given) in run.stderr, run.stderr
        assert not svg.exists() and not trace.exists()


@pytest.mark.parametrize("options, said", [
    (["-o", "{a}", "-o", "{b}"], "-o/--output given twice ('{a}', then '{b}')"),
    (["-o{a}", "--output={b}"], "-o/--output given twice ('{a}', then '{b}')"),
    (["--gpus", "4", "-o", "{a}"], "--gpus given twice ('2', then '4')"),
    (["--schedule", "zb-h1", "--recompute", "--recompute", "-o", "{a}"], "--schedule given twice ('1f1b', then 'zb-h1')"),
])
def test_an_option_given_twice_with_two_values_is_refused(profile_file, tmp_path, options, said):
    """click keeps an option's last value without a word: -o a.yaml -o b.yaml wrote b.yaml only."""
    path = profile_file(make_profile([(1, 1, 1)] * 4))
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    run = _octoplan("baseline", path, "--gpus", 2, "--schedule", "1f1b", *(o.format(a=a, b=b) for o in options))
    assert run.returncode == 2, run.stderr
    assert run.stderr == f"error: {said.format(a=a, b=b)}: give it once (see octoplan --help)\n"
    assert not a.exists() and not b.exists()


def test_an_option_given_twice_with_one_value_is_taken(profile_file, tmp_path):
    path = profile_file(make_profile([(1, 1, 1)] * 4))
    out = tmp_path / "plan.yaml"
    run = _octoplan("baseline", path, "--gpus", 2, "--gpus=2", "--schedule", "1f1b", "-o", out, "--output", out,
                    "--memory-gb", "80", "--memory-gb", "80.0")  # one value, as the option reads it
    assert run.returncode == 0, run.stderr
    assert load_plan(out).cluster.gpus == 2 and load_plan(out).cluster.memory_gb == 80
    # help asked for is help, whatever else the line holds
    helped = _octoplan("baseline", path, "-o", "a.yaml", "-o", "b.yaml", "--help")
    assert helped.returncode == 0 and "Usage" in helped.stdout, helped.stderr


def test_octorun_refuses_an_option_given_twice_with_two_values(capsys):
    from octorun.cli import build_parser

    parser = build_parser()
    for argv, said in ((["p.yaml", "--lr", "0.1", "--lr=0.01"], "--lr given twice (0.1, then 0.01)"),
                       (["p.yaml", "--betas", "0.9", "0.95", "--betas", "0.9", "0.99"],
                        "--betas given twice ([0.9, 0.95], then [0.9, 0.99])"),
                       (["p.yaml", "--st", "2", "--steps", "3"], "--steps given twice (2, then 3)")):  # argparse's abbreviation too
        with pytest.raises(SystemExit) as stopped:
            parser.parse_args(argv)
        assert stopped.value.code == 2
        assert capsys.readouterr().err == f"octorun: {said}: give it once (see octorun --help)\n"
    # the same value twice is no conflict, and each parse starts afresh
    assert parser.parse_args(["p.yaml", "--lr", "0.1", "--lr", "0.10"]).lr == 0.1
    assert parser.parse_args(["p.yaml", "--lr", "0.5"]).lr == 0.5
    # nan is not equal to itself, yet one value given once (its own check names it, later)
    assert parser.parse_args(["p.yaml", "--replay=nan"]).replay != parser.parse_args(["p.yaml"]).replay
    assert capsys.readouterr().err == ""


def test_a_model_call_that_fails_names_the_config_it_was_given(tmp_path):
    root = Path(__file__).resolve().parents[1]
    run = _octoplan("profile", "examples/models/tiny_gpt.py", "--config", "hidden=abc", "--repeat", 1,
                    "-o", tmp_path / "x.yaml", cwd=root)
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert "num_layers: call failed with" in run.stderr and "hidden='abc'" in run.stderr


def test_a_model_file_imports_the_modules_beside_it_by_name(tmp_path, monkeypatch):
    """As ``python model.py`` would: a module beside the model file is imported by name at its
    top and inside a function it runs later, and through the command line too (profiled there
    with 2 threads, which the profile records)."""
    from octoplan.modelfile import load_model_file

    monkeypatch.setattr(sys, "path", list(sys.path))  # the folder this test puts on it goes again
    folder = tmp_path / "my model"
    folder.mkdir()
    (folder / "octo_test_widths.py").write_text("WIDTH = 3\n")
    (folder / "octo_test_blocks.py").write_text("import torch\n\ndef block(width):\n    return torch.nn.Linear(width, width)\n")
    (folder / "model.py").write_text(
        "import torch\n"
        "import octo_test_widths\n\n"
        "def num_layers():\n    return 2\n\n"
        "def build_layer(index):\n    import octo_test_blocks  # a lazy import, as the run builds its stages\n"
        "    return octo_test_blocks.block(octo_test_widths.WIDTH)\n\n"
        "def sample_batch(microbatch_size, generator):\n"
        "    x = torch.randn(microbatch_size, octo_test_widths.WIDTH, generator=generator)\n    return x, x\n\n"
        "def loss_fn(outputs, targets):\n    return (outputs - targets).pow(2).mean()\n")
    model = load_model_file(folder / "model.py")
    assert model.build_layer(1).in_features == 3
    run = _octoplan("profile", folder / "model.py", "--repeat", 1, "--device", "cpu", "--threads", 2,
                    "-o", tmp_path / "p.yaml")
    assert run.returncode == 0, run.stderr
    profile = load_profile(tmp_path / "p.yaml")
    assert profile.num_layers == 2 and profile.extra["profiler"]["threads"] == 2  # --threads, which octorun follows


def test_a_model_bug_is_named_by_the_line_of_the_users_code_it_raised_in(tmp_path, monkeypatch):
    """One line, still: the error names the deepest line of the user's own code the exception
    passed through (here a helper module beside the model file), not torch's or octoplan's, in
    octoplan's messages and in octorun's (watchdog.gist); an exception raised in torch alone
    names none."""
    import torch

    from octorun.watchdog import gist

    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "octo_test_gather.py").write_text("def gather(x):\n    return x[:, 999]\n")
    (tmp_path / "model.py").write_text(
        "import torch\nimport octo_test_gather\n\n"
        "def num_layers():\n    return 1\n\n"
        "class Layer(torch.nn.Module):\n"
        "    def forward(self, x):\n        return octo_test_gather.gather(x)\n\n"
        "def build_layer(index):\n    return Layer()\n\n"
        "def sample_batch(microbatch_size, generator):\n"
        "    x = torch.randn(microbatch_size, 8, generator=generator)\n    return x, x\n\n"
        "def loss_fn(outputs, targets):\n    return (outputs - targets).pow(2).mean()\n")
    run = _octoplan("profile", "model.py", "--repeat", 1, "-o", "p.yaml", cwd=tmp_path)
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert "IndexError: index 999 is out of bounds for dimension 1 with size 8 (at octo_test_gather.py:2 in gather)" \
        in run.stderr
    sys.path.insert(0, str(tmp_path))
    import octo_test_gather

    with pytest.raises(IndexError) as caught:
        octo_test_gather.gather(torch.zeros(1, 8))
    # outside the working folder: the whole path
    assert gist(caught.value).endswith(f"(at {(tmp_path / 'octo_test_gather.py').resolve()}:2 in gather)")
    # a model file that loads another, broken, one: that file's error, named once
    (tmp_path / "outer.py").write_text("from octoplan.modelfile import load_model_file\n"
                                       "inner = load_model_file(__file__.replace('outer', 'inner'))\n")
    (tmp_path / "inner.py").write_text("raise ValueError('broken')\n")
    run = _octoplan("profile", "outer.py", "--repeat", 1, "-o", "q.yaml", cwd=tmp_path)
    assert run.returncode == 2 and run.stderr.count("(at ") == 1, run.stderr
    assert f"{tmp_path / 'inner.py'}: import failed: ValueError: broken (at inner.py:1 in <module>)" in run.stderr
    # a folder whose name breaks lines keeps the line one line; a working folder that is gone
    # costs the location, not the error
    odd = tmp_path / "a\nb"
    odd.mkdir()
    (odd / "octo_test_odd.py").write_text("def fail():\n    raise ValueError('x')\n")
    sys.path.insert(0, str(odd))
    import octo_test_odd

    with pytest.raises(ValueError) as odd_one:
        octo_test_odd.fail()
    assert "\n" not in gist(odd_one.value) and gist(odd_one.value).endswith("octo_test_odd.py:2 in fail)")
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    assert gist(odd_one.value) == "ValueError: x"
    with pytest.raises(Exception) as inside_torch:
        torch.nn.functional.pad(torch.zeros(2), (1,), mode="no such mode")
    raised = inside_torch.value.with_traceback(inside_torch.tb.tb_next)  # torch's own frames only
    assert raised.__traceback__ is not None and "(at " not in gist(raised)


def test_an_output_over_the_input_profile_is_refused(profile_file, tmp_path):
    path = profile_file(make_profile([(1, 1, 1)] * 4))
    before = path.read_bytes()
    for command in (["baseline", path, "--gpus", 2, "--schedule", "1f1b"], ["tune", path, "--gpus", 2, "--time-limit", 1]):
        run = _octoplan(*command, "-o", path)
        assert run.returncode == 2 and "names the input file" in run.stderr and run.stderr.count("\n") == 1, run.stderr
        assert path.read_bytes() == before


@pytest.mark.parametrize("command", [
    ["show", "{plan}", "--trace", "{out}"], ["show", "{plan}", "--svg", "{out}"], ["justify", "{plan}", "-o", "{out}"],
    ["bound", "{plan}", "--time-limit", "1", "-o", "{out}"], ["export", "{plan}", "-o", "{out}"],
])
@pytest.mark.parametrize("victim", ["plan", "profile"])
def test_no_output_overwrites_the_plan_or_the_profile_it_names(baseline_files, command, victim):
    ppath, plan = baseline_files
    target = plan if victim == "plan" else ppath
    before = target.read_bytes()
    run = _octoplan(*[part.format(plan=plan, out=target) for part in command])
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert f"names the input file {target}" in run.stderr
    assert target.read_bytes() == before


def test_two_outputs_on_one_file_are_refused(baseline_files, tmp_path):
    _, plan = baseline_files
    run = _octoplan("show", plan, "--svg", tmp_path / "both", "--trace", tmp_path / "both")
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert "--trace names the file --svg names too" in run.stderr
    assert not (tmp_path / "both").exists()


def test_an_output_through_a_link_writes_its_target_and_a_fifo_is_refused(profile_file, tmp_path):
    path = profile_file(make_profile([(1, 1, 1)] * 4))
    (tmp_path / "real.yaml").write_text("old")
    (tmp_path / "link.yaml").symlink_to(tmp_path / "real.yaml")
    run = _octoplan("baseline", path, "--gpus", 2, "--schedule", "1f1b", "-o", tmp_path / "link.yaml")
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "link.yaml").is_symlink()  # the link stays a link; its target holds the plan
    assert load_plan(tmp_path / "real.yaml").pp == 2
    os.mkfifo(tmp_path / "fifo")
    run = _octoplan("baseline", path, "--gpus", 2, "--schedule", "1f1b", "-o", tmp_path / "fifo")
    assert run.returncode == 2 and "names a device, FIFO or socket" in run.stderr, run.stderr
    assert not (tmp_path / "fifo").is_file()


def test_outputs_named_by_a_loop_of_links_or_by_two_spellings_are_bad_input(baseline_files, tmp_path):
    _, plan = baseline_files
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    run = _octoplan("show", plan, "--svg", tmp_path / "loop")
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "Traceback" not in run.stderr, run.stderr
    (tmp_path / "a").mkdir()
    (tmp_path / "alink").symlink_to(tmp_path / "a")
    for other in (tmp_path / "a" / ".." / "both", tmp_path / "alink" / "both"):
        run = _octoplan("show", plan, "--svg", tmp_path / ("a" if "alink" in str(other) else "") / "both", "--trace", other)
        assert run.returncode == 2 and "names the file --svg names too" in run.stderr, (other, run.stderr)


def test_a_microbatch_size_no_batch_could_have_is_bad_input(tmp_path, profile_file):
    path = profile_file(make_profile([(1, 1, 1)] * 4))
    data = yaml.safe_load(path.read_text())
    data["microbatch_size"] = 10**12
    path.write_text(yaml.safe_dump(data))
    run = _octoplan("baseline", path, "--gpus", 2, "--schedule", "1f1b", "-o", tmp_path / "b.yaml")
    assert run.returncode == 2 and "microbatch_size" in run.stderr and "1048576" in run.stderr, run.stderr


def test_an_input_is_read_without_reserving_the_largest_size_allowed(tmp_path):
    import resource

    from octoplan.inputs import read_input_text

    (tmp_path / "small.yaml").write_text("format: x\n")
    script = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (900 << 20, 900 << 20)); "
              "from octoplan.inputs import read_input_text; print(read_input_text(sys.argv[1], fix='-'), end='')")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "small.yaml")], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == "format: x\n", done.stderr  # read(1 GiB) failed under 900 MB
    assert "VmRSS" in read_input_text("/proc/self/status", fix="-")  # st_size 0, yet read whole


def test_inputs_that_never_end_are_refused_not_read(tmp_path):
    os.mkfifo(tmp_path / "fifo")  # opening it would block until a writer came
    for source in ("/dev/zero", tmp_path / "fifo"):
        run = subprocess.run([sys.executable, "-m", "octoplan.cli", "simulate", str(source)], capture_output=True,
                             text=True, timeout=60)
        assert run.returncode == 2, run.stderr
        assert run.stderr == f"error: {source}: is not an ordinary file (a device, FIFO or socket) (give a plan YAML file)\n"


def test_a_huge_bad_value_is_echoed_cut_short(tmp_path):
    (tmp_path / "long.yaml").write_text("format: " + "x" * 1_000_000 + "\n")
    run = _octoplan("validate", tmp_path / "long.yaml")
    assert run.returncode == 2 and run.stderr.count("\n") == 1
    assert len(run.stderr) < 9000 and "characters]..." in run.stderr


def test_a_device_memory_out_of_range_names_the_profile_not_a_flag(tmp_path, profile_file):
    path = profile_file(make_profile([(1, 1, 1)] * 4))
    data = yaml.safe_load(path.read_text())
    data["device"] = {"name": "x", "memory_gb": 1e300}
    path.write_text(yaml.safe_dump(data))
    run = _octoplan("baseline", path, "--gpus", 2, "--schedule", "1f1b", "-o", tmp_path / "b.yaml")
    assert run.returncode == 2
    assert run.stderr == f"error: {path}: device.memory_gb: must be <= 1e+06, got 1e+300 (use a value <= 1e+06)\n"


def test_chunks_is_refused_for_every_schedule_that_fixes_its_own(profile_file, tmp_path):
    path = profile_file(make_profile([(1, 1, 1)] * 8))
    for schedule, chunks in (("1f1b", 1), ("gpipe", 1), ("zbv", 2), ("dualpipev", 2)):
        run = _octoplan("baseline", path, "--gpus", 2, "--schedule", schedule, "--chunks", chunks, "-o", tmp_path / "c.yaml")
        assert run.returncode == 2 and "drop --chunks" in run.stderr, (schedule, run.stderr)


def test_tune_with_a_huge_chunks_max_and_layers_of_no_time_still_ends(profile_file, tmp_path):
    # --chunks-max 1000 used to build interleaved orders of up to 1000 chunks (minutes), and a
    # profile of 0 ms layers divided by zero in the summary
    path = profile_file(make_profile([(0, 0, 0)] * 8))
    run = subprocess.run([sys.executable, "-m", "octoplan.cli", "tune", str(path), "--gpus", "2", "--pp", "2", "--chunks-max", "1000",
                          "--max-plans", "30", "-o", str(tmp_path / "t.yaml")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert load_plan(tmp_path / "t.yaml").pp == 2


def test_an_output_that_cannot_be_written_is_refused_before_the_search(profile_file, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    run = _octoplan("tune", profile_file(make_profile([(1, 1, 1)] * 4)), "--gpus", 2, "--time-limit", 600,
                    "-o", blocker / "plan.yaml")
    # refused at once, not after the 600 s search
    assert run.returncode == 2 and "-o cannot be written" in run.stderr and run.stderr.count("\n") == 1, run.stderr


def test_a_failed_write_keeps_the_old_file_and_leaves_nothing_behind(tmp_path, monkeypatch):
    from octoplan import outputs

    target = tmp_path / "plan.yaml"
    target.write_text("old\n")
    target.chmod(0o640)
    outputs.write_text(target, "new\n")
    assert target.read_text() == "new\n" and target.stat().st_mode & 0o777 == 0o640  # permissions kept

    real_fdopen = os.fdopen

    def full_disk(fd, *args, **kwargs):
        handle = real_fdopen(fd, *args, **kwargs)

        def write(_text):
            raise OSError(28, "No space left on device")

        handle.write = write
        return handle

    monkeypatch.setattr(outputs.os, "fdopen", full_disk)
    with pytest.raises(InputError, match="No space left on device"):
        outputs.write_text(target, "newer\n")
    assert target.read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.yaml"]


@pytest.mark.slow
def test_ctrl_c_exits_130_saying_so(profile_file, tmp_path):
    import signal
    import time

    out = tmp_path / "plan.yaml"
    # uneven layers and many GPUs: a search that is still running when the signal comes
    layers = [(1 + i % 5, 1 + i % 3, 1 + i % 7) for i in range(64)]
    # As from a terminal: a shell without job control starts background commands with Ctrl-C
    # ignored, and a child inherits that (Python then leaves SIGINT ignored, rightly), so a
    # test suite run in the background would see no interrupt at all
    proc = subprocess.Popen([sys.executable, "-m", "octoplan.cli", "tune", str(profile_file(make_profile(layers))),
                             "--gpus", "16", "--pp", "16", "--microbatches", "32", "--time-limit", "60", "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(4)  # imports done, searching (CP-SAT seeding: OR-Tools must not swallow the signal)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted" in err and not out.exists(), (proc.returncode, err)


def test_input_nested_too_deeply_is_bad_input(tmp_path, baseline_files):
    _, plan = baseline_files
    deep = tmp_path / "deep.yaml"
    deep.write_text("[" * 20000 + "]" * 20000)
    trace = tmp_path / "deep.json"
    trace.write_text("[" * 20000 + "]" * 20000)
    for args in (("validate", deep), ("simulate", deep), ("calibrate", plan, trace)):
        run = _octoplan(*args)
        assert run.returncode == 2 and "nested too deeply" in run.stderr and run.stderr.count("\n") == 1, run.stderr


def test_a_key_written_twice_is_bad_input_naming_its_line(tmp_path):
    # PyYAML would keep the second value without a word; YAML itself forbids the repeat
    path = tmp_path / "plan.yaml"
    path.write_text("format: octoplan-plan/1\nmodel: {name: a, name: b}\n")
    run = _octoplan("validate", path)
    assert run.returncode == 2 and run.stderr.strip() == f"error: {path}: line 2: key 'name' appears twice (keep one of them)"


def test_plans_take_the_profiles_gpu_memory_and_say_when_they_do_not_fit(profile_file, tmp_path):
    from dataclasses import replace as copy

    # 4 fp32 layers of 20 GB of parameters: 80 GB of weights, gradients and Adam moments each,
    # 160 GB on each of the 2 ranks
    heavy = make_profile([(1, 1, 1)] * 4)
    heavy = heavy.with_layers([copy(layer, param_bytes=20 * 10**9) for layer in heavy.layers])
    for device, limit in (({"name": "h200", "memory_gb": 141.0}, 141.0), ({"name": "cpu", "memory_gb": 24.0}, 80.0)):
        path = profile_file(copy(heavy, device=device), f"{device['name']}.yaml")
        out = tmp_path / f"{device['name']}-plan.yaml"
        run = _octoplan("baseline", path, "--gpus", 2, "--schedule", "1f1b", "-o", out)
        # a CPU's RAM says nothing about the GPUs planned for: the 80 GB default then
        assert run.returncode == 0 and load_plan(out).cluster.memory_gb == limit, run.stderr
        assert run.stderr == (f"warning: this plan does not fit: rank 0 peaks at 160 GB, over the {limit:g} GB per GPU "
                              "(--memory-gb); octoplan tune finds plans that fit\n")
    run = _octoplan("baseline", path, "--gpus", 2, "--schedule", "1f1b", "--memory-gb", 400, "-o", out)
    assert run.returncode == 0 and run.stderr == "" and load_plan(out).cluster.memory_gb == 400
    # small figures keep their digits (a 0.4 GB limit printed as "0" beside "fits memory yes"): 2
    # layers of 3 MB on a rank, their weights, gradients and two Adam moments, 0.024 GB
    light = profile_file(make_profile([(1, 1, 1)] * 4, params=3 * 10**6), "light.yaml")
    run = _octoplan("baseline", light, "--gpus", 2, "--schedule", "1f1b", "--memory-gb", 0.4, "-o", out)
    assert run.returncode == 0 and run.stderr == "", run.stderr
    shown = _octoplan("simulate", out)
    assert shown.returncode == 0 and re.search(r"peak memory\s*│\s*0\.024 GB \(limit 0\.4\)", shown.stdout), shown.stdout
    run = _octoplan("baseline", light, "--gpus", 2, "--schedule", "1f1b", "--memory-gb", 0.02, "-o", out)
    assert "rank 0 peaks at 0.024 GB, over the 0.02 GB per GPU" in run.stderr, run.stderr
    from octoplan.cli import _gb

    # three digits, and no exponent however large (a 70B model on one GPU: 1858 GB, not 1.86e+03)
    assert [_gb(x) for x in (24e6, 58.63e9, 999.4e9, 999.6e9, 1858.42e9)] == ["0.024", "58.6", "999", "1000", "1858"]


def test_the_implicit_profile_is_named_once(tmp_path):
    folder = tmp_path / "profiles"
    folder.mkdir()
    from octoplan.profile import save_profile

    save_profile(make_profile([(1, 1, 1)] * 4), folder / "only.yaml")
    for command in (["baseline", "--schedule", "1f1b"], ["tune", "--time-limit", 1]):
        run = _octoplan(*command, "--gpus", 2, "-o", "plan.yaml", cwd=tmp_path)
        assert run.returncode == 0, run.stderr
        assert run.stderr.count("using the newest profile, profiles/only.yaml") == 1, run.stderr


def test_an_output_named_as_a_folder_is_refused_and_a_failure_leaves_no_folder(profile_file, tmp_path):
    ppath = profile_file(make_profile([(1, 1, 1)] * 4))
    existing = tmp_path / "existing"
    existing.write_text("data")
    for output in (tmp_path / "outdir", existing):
        for spelling in (["-o", f"{output}/"], [f"--output={output}/"], [f"-o{output}/"]):
            run = _octoplan("baseline", ppath, "--gpus", 2, "--schedule", "1f1b", *spelling)
            assert run.returncode == 2 and "names a folder (it ends in /)" in run.stderr, run.stderr
    assert not (tmp_path / "outdir").exists() and existing.read_text() == "data"
    run = _octoplan("baseline", ppath, "--gpus", 2, "--schedule", "zzz", "-o", tmp_path / "new" / "deeper" / "x.yaml")
    assert run.returncode == 2 and not (tmp_path / "new").exists()
    # a good run makes the folders it needs
    run = _octoplan("baseline", ppath, "--gpus", 2, "--schedule", "1f1b", "-o", tmp_path / "new" / "deeper" / "x.yaml")
    assert run.returncode == 0 and (tmp_path / "new" / "deeper" / "x.yaml").is_file(), run.stderr


def test_only_export_format_hf_takes_a_folder_ending_in_a_slash(capsys):
    from octoplan.cli import _refuse_folder_outputs

    for argv in (["export", "p.yaml", "--format", "hf", "-o", "out/"], ["-v", "export", "p.yaml", "--format=hf", "--output=out/"],
                 ["export", "p.yaml", "-oout/", "--format", "hf"]):
        _refuse_folder_outputs(argv)  # returns: export writes the folder
    for argv in (["export", "p.yaml", "-o", "out/"], ["export", "p.yaml", "--format", "hf", "--format", "megatron", "-o", "o/"],
                 ["baseline", "p.yaml", "--format", "hf", "-o", "out/"], ["export", "p.yaml", "-o", "o/", "--", "--format", "hf"]):
        with pytest.raises(SystemExit) as exited:
            _refuse_folder_outputs(argv)
        assert exited.value.code == 2 and "names a folder (it ends in /)" in capsys.readouterr().err


def test_export_refuses_a_plan_whose_profile_changed(baseline_files, tmp_path):
    ppath, path = baseline_files
    assert _octoplan("export", path, "-o", tmp_path / "ok.csv").returncode == 0
    data = yaml.safe_load(Path(ppath).read_text())
    data["layers"][1]["forward_ms"] = 5.0
    Path(ppath).write_text(yaml.safe_dump(data))
    run = _octoplan("export", path, "-o", tmp_path / "x.csv")
    assert run.returncode == 2 and "profile_sha256: does not match" in run.stderr and not (tmp_path / "x.csv").exists()


@pytest.mark.parametrize("args,needle", [
    (["--seed", 2**31], "--seed: is 2147483648"),
    (["--seed", -1], "--seed: is -1"),
    (["--workers", 2**31], "--workers: is 2147483648"),
])
def test_tune_refuses_a_seed_or_workers_out_of_range(profile_file, tmp_path, args, needle):
    ppath = profile_file(make_profile([(1, 1, 1)] * 4))
    run = _octoplan("tune", ppath, "--gpus", 2, "--time-limit", 1, *args, "-o", tmp_path / "x.yaml")
    assert run.returncode == 2 and needle in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr


def test_validate_refuses_the_microbatch_size_octorun_would(baseline_files):
    _, path = baseline_files
    data = yaml.safe_load(path.read_text())
    data.pop("profile"), data.pop("profile_sha256")
    data["microbatch_size"] = 0
    path.write_text(yaml.safe_dump(data))
    run = _octoplan("validate", path)
    assert run.returncode == 2 and "microbatch_size: is 0" in run.stderr, run.stderr


def test_a_microbatch_size_beside_a_profile_must_be_the_profiles(baseline_files):
    """octorun trains at the profile's size, which the plan's times are for: a field saying
    another was taken without a word."""
    from octoplan.plan import plan_microbatch_size

    ppath, path = baseline_files
    measured = load_profile(ppath).microbatch_size
    data = yaml.safe_load(path.read_text())
    for size, said in ((measured + 12, f"is {measured + 12}, but the plan's profile was measured at {measured}"),
                       ("abc", "is 'abc'"), (measured, None)):
        data["microbatch_size"] = size
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        run = _octoplan("validate", path)
        if said is not None:
            assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
            assert f"{path}: microbatch_size: {said}" in run.stderr, run.stderr
        else:
            assert run.returncode == 0, run.stderr
            assert plan_microbatch_size(load_plan(path), path) == measured


def test_profiles_equally_new_are_not_chosen_by_chance(tmp_path):
    """A fresh clone's bundled profiles share one time: none of them is "the newest"."""
    folder = tmp_path / "profiles"
    folder.mkdir()
    from octoplan.profile import save_profile

    for name in ("a.yaml", "b.yaml"):
        save_profile(make_profile([(1, 1, 1)] * 4), folder / name)
        os.utime(folder / name, (5, 5))
    run = _octoplan("baseline", "--gpus", 2, "--schedule", "1f1b", "-o", "plan.yaml", cwd=tmp_path)
    assert run.returncode == 2 and run.stderr.strip().splitlines() == [
        "error: profiles/: no profile given, and 2 are the newest alike (a.yaml, b.yaml) (name a PROFILE)"]
    os.utime(folder / "b.yaml", (6, 6))
    run = _octoplan("baseline", "--gpus", 2, "--schedule", "1f1b", "-o", "plan.yaml", cwd=tmp_path)
    assert run.returncode == 0 and "using the newest profile, profiles/b.yaml" in run.stderr


def test_a_newest_profile_that_is_no_profile_gets_one_line(tmp_path):
    folder = tmp_path / "profiles"
    folder.mkdir()
    from octoplan.profile import save_profile

    save_profile(make_profile([(1, 1, 1)] * 4), folder / "good.yaml")
    (folder / "zz.yaml").mkdir()  # a folder is never the newest profile
    (folder / "bad.yaml").write_text("format: other/1\n")
    os.utime(folder / "good.yaml", (1, 1))
    run = _octoplan("baseline", "--gpus", 2, "--schedule", "1f1b", "-o", "plan.yaml", cwd=tmp_path)
    assert run.returncode == 2 and run.stderr.strip().splitlines() == [
        "error: profiles/bad.yaml: format: is 'other/1', expected 'octoplan-profile/1' (regenerate it with octoplan profile)"]


@pytest.mark.parametrize("command", ["tune", "baseline"])
def test_the_newest_profile_is_read_once(tmp_path, monkeypatch, command):
    # read to check it before "using the newest profile" is said, and planned from that same
    # reading: a large profile is not parsed twice
    from typer.testing import CliRunner

    import octoplan.profile
    from octoplan.cli import app
    from octoplan.profile import save_profile

    (tmp_path / "profiles").mkdir()
    save_profile(make_profile([(1, 1, 1)] * 4), tmp_path / "profiles" / "only.yaml")
    monkeypatch.chdir(tmp_path)
    reads = []
    real = octoplan.profile.profile_from_dict  # what every load_profile, however imported, calls
    monkeypatch.setattr(octoplan.profile, "profile_from_dict", lambda data, *, file: reads.append(file) or real(data, file=file))
    extra = ["--max-plans", "20"] if command == "tune" else ["--schedule", "1f1b"]
    done = CliRunner().invoke(app, [command, "--gpus", "2", "-o", "plan.yaml", *extra])
    assert done.exit_code == 0, done.output
    assert reads == ["profiles/only.yaml"]
    assert load_plan(tmp_path / "plan.yaml").cluster.gpus == 2


def test_octorun_says_in_one_line_what_the_file_system_refuses(tmp_path):
    octorun = lambda *args: subprocess.run([sys.executable, "-m", "octorun", *map(str, args)], capture_output=True,
                                           text=True, cwd=tmp_path)
    run = octorun("a" * 300 + ".yaml")  # longer than a file name may be
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "File name too long" in run.stderr, run.stderr
    run = octorun("plan.yaml", "--steps", "9" * 5000)  # argparse echoes the value: cut short
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and len(run.stderr) < 4200, run.stderr[:300]


def test_arguments_that_would_be_ignored_or_overridden_are_refused(tmp_path):
    from octoplan.modelfile import load_model_file
    from octoplan.profiler import parse_config_overrides

    run = _octoplan("profile", "--list", "--arch", "llama3-8b", "-o", tmp_path / "x.yaml")
    assert run.returncode == 2 and "--list: given with --arch, -o" in run.stderr and not (tmp_path / "x.yaml").exists()
    run = _octoplan("profile", "--list", "--gpu", "h100", "--tp", "2", "--microbatch-size", "4")
    assert run.returncode == 2 and "--list: given with --gpu, --tp, --microbatch-size" in run.stderr, run.stderr
    with pytest.raises(InputError, match="'hidden' is given twice \\(4 and 16\\)"):
        parse_config_overrides(["hidden=4", "hidden=16"])
    source = (Path(__file__).parent.parent / "examples" / "models" / "tiny_gpt.py").read_text()
    model = tmp_path / "named.py"
    model.write_text(source.replace('NAME = "tiny-gpt"', "NAME = 5") if 'NAME = "tiny-gpt"' in source else source + "\nNAME = 5\n")
    with pytest.raises(InputError, match="NAME: is 5"):
        load_model_file(str(model)).name


def _laughs(value_at: str) -> str:
    """Ten lines of YAML whose nested aliases read as 10**9 values (a "billion laughs")."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    return "\n".join(lines) + f"\n{value_at}: *a8\n"


def test_aliases_that_expand_beyond_any_file_are_refused_at_once(tmp_path, baseline_files):
    # every command that read one hung: an error's text took repr() of all 10**9 values
    _, plan = baseline_files
    laughs = tmp_path / "laughs.yaml"
    laughs.write_text(_laughs("format"))
    loop = tmp_path / "loop.yaml"
    loop.write_text("format: &f [*f]\n")
    for args in (("validate", laughs), ("simulate", laughs), ("baseline", laughs, "--gpus", 2, "--schedule", "1f1b",
                                                              "-o", tmp_path / "b.yaml"), ("validate", loop)):
        run = subprocess.run([sys.executable, "-m", "octoplan.cli", *map(str, args)], capture_output=True, text=True,
                             timeout=60)
        assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
        assert ("line 6: its aliases expand to more than 1000000 values" in run.stderr if args[1] == laughs else
                "an alias refers to a value that holds it" in run.stderr), run.stderr
    # anchors as people write them still read: a merge key, overridden, and a shared value
    data = yaml.safe_load(plan.read_text())
    text = plan.read_text().replace("model:", "defaults: &d {latency_us: 5.0, memory_gb: 40.0}\nmodel:", 1)
    text = text.replace("cluster:\n", "cluster:\n  <<: *d\n", 1).replace("  latency_us: 0.0\n", "")
    plan.write_text(text)
    cluster = load_plan(plan).cluster
    assert (cluster.latency_us, cluster.memory_gb) == (5.0, data["cluster"]["memory_gb"])


def test_a_bad_value_is_shown_without_walking_all_of_it():
    from octoplan.errors import shown

    huge = ["x"] * 10
    for _ in range(8):
        huge = [huge] * 10  # 10**9 values, built in no time: each level shares the one below
    assert len(shown(huge)) < 400 and shown(10**400) == "a 401-digit number"
    assert "[10000 characters]" in shown("y" * 14000)


def test_a_number_python_cannot_read_names_its_line(baseline_files):
    _, plan = baseline_files
    plan.write_text(plan.read_text().replace("latency_us: 0.0", "latency_us: 1" + "0" * 5000))
    run = _octoplan("validate", plan)  # int() refuses over 4300 digits: it was a ValueError, exit 1
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert "line 13: a number of 5001 characters is more than Python reads" in run.stderr


def test_a_plan_whose_named_profile_is_gone_is_refused_by_octorun_too(baseline_files):
    from octoplan.plan import plan_microbatch_size

    ppath, path = baseline_files
    ppath.unlink()
    # octorun read the plan's profile only where the path resolved, else trained microbatches of 1
    with pytest.raises(InputError) as info:
        plan_microbatch_size(load_plan(path), path)
    assert info.value.field == "profile" and "not found" in info.value.problem
    run = subprocess.run([sys.executable, "-m", "octorun", str(path)], capture_output=True, text=True)
    assert run.returncode == 2 and f"{path}: profile: profile '{ppath}' not found" in run.stderr, run.stderr


def test_a_plan_whose_model_is_not_its_profiles_is_refused(tmp_path, profile_file):
    from dataclasses import replace as copy

    from octoplan.profile import ModelRef

    model = tmp_path / "models" / "m.py"
    model.parent.mkdir()
    model.write_text("")
    (tmp_path / "other.py").write_text("")
    config = {"hidden": 128, "act": "gelu", "sizes": [1, 2], "rate": float("nan")}
    profile = copy(make_profile([(1, 1, 1)] * 4), model=ModelRef("m", source=str(model), config=config))
    ppath = profile_file(profile)
    path = tmp_path / "plan.yaml"
    save_plan(make_baseline(profile, schedule="1f1b", gpus=2, microbatches=2, profile_path=ppath), path)
    fresh = yaml.safe_load(path.read_text())
    # as written by baseline it agrees, and so it does with the config's keys in another order
    # and the model file's path spelt from the plan's folder
    fresh["model"]["config"] = dict(reversed(list(fresh["model"]["config"].items())))
    fresh["model"]["source"] = "models/m.py"
    path.write_text(yaml.safe_dump(fresh, sort_keys=False))
    assert _octoplan("validate", path).returncode == 0
    for field, value, problem in (
            ("hidden", 512, "model.config.hidden: is 512 but the profile"),
            ("hidden", 128.0, "model.config.hidden: is 128.0 but the profile"),  # a float to the model file
            ("depth", 3, "model.config.depth: is 3 but the profile"),
            ("source", str(tmp_path / "other.py"), "model.source: is"),
            ("name", "n", "model.name: is 'n' but the profile")):
        data = yaml.safe_load(path.read_text())
        (data["model"] if field in ("source", "name") else data["model"]["config"])[field] = value
        bad = tmp_path / "bad.yaml"
        bad.write_text(yaml.safe_dump(data, sort_keys=False))
        for command in ("validate", "simulate"):
            run = _octoplan(command, bad)
            assert run.returncode == 2 and run.stderr.count("\n") == 1 and problem in run.stderr, run.stderr
            assert "re-plan from the profile" in run.stderr


def test_an_empty_profile_field_is_empty_to_every_command(baseline_files, tmp_path):
    _, path = baseline_files
    path.write_text(path.read_text().replace(f"profile: {yaml.safe_load(path.read_text())['profile']}", "profile: ''"))
    for args in (["validate"], ["simulate"], ["export", "-o", tmp_path / "x.csv"]):
        run = _octoplan(args[0], path, *args[1:])
        assert run.returncode == 2 and f"{path}: profile: is empty" in run.stderr, (args, run.stderr)


def test_profile_extension_fields_are_kept_or_passed_over(tmp_path):
    data = profile_to_dict(make_profile([(1, 1, 1)] * 2))
    data["layers"][0]["comment"] = "a field of another tool"
    data["cost_model"] = {"gpu": "h100"}  # as --arch writes: close to "model" but not a misspelling of it
    path = tmp_path / "ext.yaml"
    path.write_text(yaml.safe_dump(data))
    assert load_profile(path).extra == {"cost_model": {"gpu": "h100"}}


@pytest.mark.parametrize("spelled, read", [("4", 4), ("4.0", 4), ("4e0", 4), ("4.5", None), ("true", None), ('"4"', None)])
def test_a_count_is_any_spelling_of_a_whole_number_and_nothing_else(baseline_files, spelled, read):
    """docs/FORMATS.md section 2: numeric tools write counts as floats; a fraction, a boolean or a
    string is not a count."""
    _, path = baseline_files
    text = path.read_text()
    assert "\n  microbatches: 4\n" in text
    path.write_text(text.replace("\n  microbatches: 4\n", f"\n  microbatches: {spelled}\n"))
    if read is not None:
        assert load_plan(path).microbatches == read
    else:
        with pytest.raises(InputError, match="parallel.microbatches: must be a whole number"):
            load_plan(path)
