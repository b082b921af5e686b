"""The contract's documentation keeps up with the code: every command line option and every
key `octoplan simulate --json` prints is named either in SPEC.md (the shared contract) or in
docs/SPEC_ADDITIONS.md (what this project adds to it). An option added without a word in
either fails here."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import typer.main

from octoplan.cli import app
from octorun.cli import build_parser

from conftest import make_profile

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT.parent / "shared" / "SPEC.md"
ADDITIONS = ROOT / "docs" / "SPEC_ADDITIONS.md"

pytestmark = pytest.mark.skipif(not SPEC.exists(), reason="the shared SPEC.md is not beside this checkout")


def _documented() -> str:
    return SPEC.read_text() + ADDITIONS.read_text()


def _named(option: str, text: str) -> bool:
    """``--lr`` is named where it stands alone, not inside ``--lr-max``."""
    return re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text) is not None


def _octoplan_options() -> set[tuple[str, str]]:
    group = typer.main.get_command(app)
    out = {("octoplan", opt) for param in group.params for opt in param.opts if opt.startswith("-")}
    for name, command in group.commands.items():
        for param in command.params:
            if param.param_type_name == "option":
                out |= {(f"octoplan {name}", opt) for opt in param.opts if opt.startswith("--") and opt != "--help"}
    return out


def test_every_octoplan_option_is_documented():
    text = _documented()
    options = _octoplan_options()
    assert ("octoplan tune", "--time-limit") in options and ("octoplan baseline", "--chunks") in options
    missing = sorted(f"{command} {opt}" for command, opt in options if not _named(opt, text))
    assert not missing, f"options in neither SPEC.md nor docs/SPEC_ADDITIONS.md: {missing}"


def test_every_octorun_option_is_documented():
    text = _documented()
    options = {opt for action in build_parser()._actions for opt in action.option_strings if opt.startswith("--")}
    assert "--replay" in options
    missing = sorted(opt for opt in options - {"--help"} if not _named(opt, text))
    assert not missing, f"octorun options in neither SPEC.md nor docs/SPEC_ADDITIONS.md: {missing}"


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
    text = _documented()
    assert not sorted(k for k in keys if f"`{k}`" not in text)
