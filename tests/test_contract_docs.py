"""The user documentation keeps up with the code: every command line option, every key
`octoplan simulate --json` prints and every "FORMATS.md section N" the code cites is in
docs/FORMATS.md, which ships with the repository. Where the shared contract SPEC.md sits beside
the checkout, FORMATS.md must also name every option and field it names; without it the same
tests run against FORMATS.md alone, so nothing here skips."""

from __future__ import annotations

import json
import re
from pathlib import Path

import typer.main

from octoplan.cli import app
from octorun.cli import build_parser

from conftest import make_profile

ROOT = Path(__file__).resolve().parent.parent
FORMATS = ROOT / "docs" / "FORMATS.md"
SPEC = ROOT.parent / "shared" / "SPEC.md"  # the shared contract, where it is beside the checkout

# The contract's section titles, which the code's and the --help texts' citations rely on.
SECTIONS = {1: "Ops", 2: "Profile file", 3: "Plan file", 4: "Model file", 5: "Commands", 6: "Baseline schedules",
            7: "What the numbers mean"}

# What the contract names, so FORMATS.md is checked against it in a clone without SPEC.md too.
CONTRACT_TERMS = {
    "format: octoplan-profile/1", "format: octoplan-plan/1", "forward_ms", "backward_input_ms", "backward_weight_ms",
    "param_bytes", "activation_bytes", "output_bytes", "flops", "microbatch_size", "dtype", "profile_sha256",
    "gpus_per_node", "memory_gb", "intra_node_gbps", "inter_node_gbps", "latency_us", "rank_order", "pp-inner",
    "dp-inner", "num_layers", "build_layer", "sample_batch", "loss_fn", "CONFIG", "torch.manual_seed(seed + i)",
    "((seed * 1_000_003 + t) * 1_009 + d) * 10_007 + j", "iteration_ms", "bubble_ratio", "lower_bound_ms",
    "efficiency", "peak_memory_bytes", "fits_memory", "gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv",
    "dualpipev", "uniform", "balanced", "--chunks", "--partition", "--steps", "--seed", "--optimizer", "--lr",
    "--metrics", "--trace", "--timeout", "--gpus-per-node", "--memory-gb", "--intra-node-gbps",
    "--inter-node-gbps", "--latency-us", "--microbatches", "--pp", "latency_us + bytes /",
}


def _formats() -> str:
    return FORMATS.read_text()


def _named(term: str, text: str) -> bool:
    """``--lr`` is named where it stands alone, not inside ``--lr-max``."""
    return re.search(rf"(?<![\w-]){re.escape(term)}(?![\w-])", text) is not None


def _octoplan_options() -> set[tuple[str, str]]:
    group = typer.main.get_command(app)
    out = {("octoplan", opt) for param in group.params for opt in param.opts if opt.startswith("-")}
    for name, command in group.commands.items():
        for param in command.params:
            if param.param_type_name == "option":
                out |= {(f"octoplan {name}", opt) for opt in param.opts if opt.startswith("--") and opt != "--help"}
    return out


def test_every_octoplan_command_and_option_is_documented():
    text = _formats()
    options = _octoplan_options()
    assert ("octoplan tune", "--time-limit") in options and ("octoplan baseline", "--chunks") in options
    missing = sorted(f"{command} {opt}" for command, opt in options if not _named(opt, text))
    assert not missing, f"options not in docs/FORMATS.md: {missing}"
    commands = typer.main.get_command(app).commands
    assert {"profile", "tune", "simulate", "export"} <= set(commands)
    assert not sorted(name for name in commands if f"`octoplan {name}" not in text)


def test_defaults_written_into_help_texts_are_shown():
    # rich reads "[default: 10]" in a help text as markup and drops it: each such text escapes
    # its bracket, and every one of them shows up in the rendered help
    from typer.testing import CliRunner

    written = []
    group = typer.main.get_command(app)
    for name, command in group.commands.items():
        for param in command.params:
            found = re.search(r"\[default: [^]]*\]", getattr(param, "help", None) or "")
            if found:
                written.append((name, found.group(0)))
    assert ("profile", "[default: 10]") in written and ("export", "[default: llama]") in written
    runner = CliRunner()
    for name, default in written:
        shown = " ".join(runner.invoke(app, [name, "--help"], env={"COLUMNS": "400"}).output.split())
        assert default.replace("\\", "") in shown.replace("│", " ").replace("  ", " "), (name, default)


def test_every_octorun_option_is_documented():
    text = _formats()
    options = {opt for action in build_parser()._actions for opt in action.option_strings if opt.startswith("--")}
    assert "--replay" in options
    missing = sorted(opt for opt in options - {"--help"} if not _named(opt, text))
    assert not missing, f"octorun options not in docs/FORMATS.md: {missing}"


def test_every_simulate_json_key_is_documented(profile_file, tmp_path):
    from typer.testing import CliRunner

    profile = profile_file(make_profile([(1, 1, 1)] * 4))
    plan = tmp_path / "plan.yaml"
    runner = CliRunner()
    made = runner.invoke(app, ["baseline", str(profile), "--gpus", "2", "--schedule", "1f1b", "-o", str(plan)])
    assert made.exit_code == 0, made.output
    printed = runner.invoke(app, ["simulate", str(plan), "--json"])
    assert printed.exit_code == 0, printed.output
    keys = set(json.loads(printed.stdout))
    assert {"iteration_ms", "idle_ms"} <= keys
    text = _formats()
    assert not sorted(k for k in keys if f"`{k}`" not in text)


def test_the_contract_sections_keep_their_numbers():
    headings = dict(re.findall(r"^## (\d+)\. (.+)$", _formats(), flags=re.MULTILINE))
    for number, title in SECTIONS.items():
        assert headings.get(str(number), "").startswith(title), (number, title, headings)


def test_every_cited_section_exists():
    """A "FORMATS.md section N" in code, tests or docs points at a section that is there."""
    numbers = {int(n) for n in re.findall(r"^## (\d+)\.", _formats(), flags=re.MULTILINE)}
    cited = {}
    for path in [*ROOT.glob("octo*/**/*.py"), *ROOT.glob("tests/*.py"), *ROOT.glob("benchmarks/*"),
                 *ROOT.glob("examples/**/*.py"), *ROOT.glob("docs/*.md"), ROOT / "README.md"]:
        if path.is_file():
            for number in re.findall(r"FORMATS\.md,? sections? (\d+)", path.read_text(errors="replace")):
                cited.setdefault(int(number), path.relative_to(ROOT))
    assert cited, "no citation found: the pattern no longer matches how the code cites the sections"
    assert not {n: str(p) for n, p in cited.items() if n not in numbers}


def test_formats_names_everything_the_contract_names():
    """The contract's options, fields and formulas, listed here and read from SPEC.md where it is
    beside the checkout, are all in FORMATS.md."""
    terms = set(CONTRACT_TERMS)
    if SPEC.exists():
        spec = SPEC.read_text()
        terms |= set(re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", spec))
        terms |= {key for key in re.findall(r"`([a-z_]+_(?:ms|bytes|ratio|gbps|us|gb))`", spec)}
    text = _formats()
    assert not sorted(t for t in terms if t not in text)


def test_user_documents_point_nowhere_outside_the_repository():
    for path in [ROOT / "README.md", *ROOT.glob("docs/*.md")]:
        text = path.read_text()
        assert "../shared" not in text and "SPEC_ADDITIONS" not in text, path
