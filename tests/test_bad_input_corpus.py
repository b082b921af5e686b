"""A corpus of bad input, generated: every command refuses every case the same way.

Valid seed files (a measured profile and a plan the project's own commands made from it, and an
analytic profile) are mutated systematically with hypothesis: wrong types, out-of-range and huge
numbers, missing fields, duplicated or missing ops, cyclic orders, stages that overlap or leave
gaps, world sizes that disagree, truncated files, alias bombs; model files off the contract;
launch variables that disagree with the plan; checkpoints that lack a shard or hold another
model. Each case is built to be bad input by construction (never a mutation that may leave a
valid file), and the contract asserted for every one (docs/FORMATS.md section 5):

- exit status 2, and stderr exactly one line: ``error: FILE: FIELD: ...`` from octoplan,
  ``octorun: FILE: FIELD: ...`` from octorun, naming the file (and the field where there is one);
- no ``Traceback``, no log or warning line beside it;
- no output file created, and an existing one byte-identical (no temporary file left either);
- the command ends within :data:`CASE_TIMEOUT_S`.

The commands run in this process (``octoplan.cli.main`` and ``octorun.cli.main`` with their
argv), as a user's shell would run them but without a second's worth of imports per case; the
cases that need a real process (a checkpoint is only read once the process group exists) and a
few end-to-end checks run as subprocesses. In-process octorun stops where the launch would
begin (:class:`_ReachedLaunch`): a case that gets there was not refused.

``OCTOPIPE_CORPUS_EXAMPLES=N`` runs N cases per property instead of the few CI runs;
``benchmarks/bench_bad_input.py`` runs the corpus that way and counts the cases per command.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml
from octoplan.profile import DTYPE_BYTES
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parent.parent

# the few cases CI runs per property (repeatable: derandomized); a benchmark raises it
EXAMPLES = int(os.environ.get("OCTOPIPE_CORPUS_EXAMPLES", "0") or 0)
CASE_TIMEOUT_S = 60.0


def corpus_settings(default_examples: int):
    return settings(max_examples=EXAMPLES or default_examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


# --- the tally: cases tried and contract violations per command (read by the benchmark) ----

@dataclass
class Tally:
    tried: Counter = field(default_factory=Counter)
    violated: Counter = field(default_factory=Counter)
    examples: dict = field(default_factory=dict)  # command -> the first violation's text
    record_only: bool = False  # the benchmark counts violations instead of stopping at the first


TALLY = Tally()


def _judge(command: str, problems: list[str], case: str) -> None:
    TALLY.tried[command] += 1
    if not problems:
        return
    TALLY.violated[command] += 1
    text = f"{command} on {case}: " + "; ".join(problems)
    TALLY.examples.setdefault(command, text)
    if not TALLY.record_only:
        raise AssertionError(text)


# --- running the commands in this process ----------------------------------------------------

class _Hung(BaseException):
    """Raised by the alarm: a command ran past CASE_TIMEOUT_S (a BaseException, so that no
    ``except Exception`` of the command's own turns it into an exit status)."""


class _ReachedLaunch(BaseException):
    """In-process octorun got as far as forming its process group: nothing refused the input."""


@dataclass(frozen=True)
class Outcome:
    code: int | None  # None: it did not end (hung, or reached the launch)
    stdout: str
    stderr: str
    note: str = ""  # why code is None


@contextlib.contextmanager
def _alarm(seconds: float):
    def ring(signum, frame):
        raise _Hung()

    old = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@contextlib.contextmanager
def _environment(env: dict[str, str | None]):
    """os.environ with ``env`` applied (None: unset), restored afterwards: octorun sets the
    launch variables it defaults."""
    before = dict(os.environ)
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(before)


_LAUNCH_CLEAN = {name: None for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                         "MASTER_PORT", "GROUP_RANK", "TORCHELASTIC_RUN_ID")}


def _in_process(entry: Callable[[], Any], *, env: dict[str, str | None] | None = None, cwd: Path | None = None,
                timeout_s: float = CASE_TIMEOUT_S) -> Outcome:
    """Run a command's ``main`` here: its exit status, stdout and stderr as a shell would see
    them. Log records and Python warnings are printed to stderr by the real commands, so they
    count as stderr lines here too."""
    out, err = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(err)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    code, note = None, ""
    old_cwd = os.getcwd()
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_environment({**_LAUNCH_CLEAN, "COLUMNS": "120", **(env or {})}))
            stack.enter_context(contextlib.redirect_stdout(out))
            stack.enter_context(contextlib.redirect_stderr(err))
            caught = stack.enter_context(warnings.catch_warnings(record=True))
            warnings.simplefilter("default")
            if cwd is not None:
                os.chdir(cwd)
            try:
                with _alarm(timeout_s):
                    entry()
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                if not isinstance(exc.code, (int, type(None))):
                    err.write(f"{exc.code}\n")  # as the interpreter prints it
            except _Hung:
                note = f"did not end within {timeout_s:g} s"
            except _ReachedLaunch:
                note = "was not refused: it reached the launch of the process group"
            except KeyboardInterrupt:  # the person running the tests, not the command
                raise
            except BaseException as exc:  # noqa: BLE001 - what the interpreter would print as a traceback
                import traceback

                err.write("Traceback (most recent call last):\n" + "".join(traceback.format_exception(exc)))
                code = 1
            for warning in caught:
                err.write(warnings.formatwarning(warning.message, warning.category, warning.filename, warning.lineno))
    finally:
        os.chdir(old_cwd)
        root.removeHandler(handler)
    return Outcome(code, out.getvalue(), err.getvalue(), note)


def octoplan(*args: Any, cwd: Path | None = None) -> Outcome:
    from octoplan.cli import main

    def entry():
        saved = sys.argv
        sys.argv = ["octoplan", *map(str, args)]
        try:
            main()
        finally:
            sys.argv = saved

    return _in_process(entry, cwd=cwd)


def octorun(*args: Any, env: dict[str, str | None] | None = None) -> Outcome:
    """octorun in this process; it never forms a process group (:class:`_ReachedLaunch`)."""
    import octorun.runtime as runtime
    from octorun.cli import main

    def refuse_launch(*_args, **_kwargs):
        raise _ReachedLaunch()

    def entry():
        real = runtime._init_process_group, runtime._meeting_place
        # a process alone: no peers to tell of its bad input, none to form a group with
        runtime._init_process_group, runtime._meeting_place = refuse_launch, lambda *_args: None
        try:
            main([str(a) for a in args])
        finally:
            runtime._init_process_group, runtime._meeting_place = real

    return _in_process(entry, env=env)


def subprocess_run(module: str, *args: Any, env: dict[str, str] | None = None, cwd: Path | None = None,
                   timeout_s: float = CASE_TIMEOUT_S) -> Outcome:
    full_env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_CLEAN}
    full_env.update(OMP_NUM_THREADS="1", COLUMNS="120", PYTHONPATH=str(REPO), **(env or {}))
    try:
        done = subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True,
                              env=full_env, cwd=cwd, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        return Outcome(None, str(exc.stdout or ""), str(exc.stderr or ""), f"did not end within {timeout_s:g} s")
    return Outcome(done.returncode, done.stdout, done.stderr)


# --- the contract --------------------------------------------------------------------------------

@dataclass
class Outputs:
    """The output paths a case gives its command, and what each held before: a missing file
    must stay missing, an existing one must keep its bytes, and their folder gains nothing."""

    folder: Path
    paths: dict[str, Path] = field(default_factory=dict)
    before: dict[str, bytes | None] = field(default_factory=dict)
    listing: set[str] = field(default_factory=set)

    @classmethod
    def make(cls, names: dict[str, str], *, existing: bool) -> "Outputs":
        folder = Path(tempfile.mkdtemp(prefix="out-", dir=_workdir()))
        outputs = cls(folder)
        for flag, name in names.items():
            path = folder / name
            if existing and name.endswith("/"):  # a folder of earlier checkpoints
                (path / "step_00000001").mkdir(parents=True)
                (path / "step_00000001" / "octopipe.json").write_text("{}")
            elif existing:
                path.write_bytes(b"an earlier output \x00 kept byte for byte\n")
            outputs.paths[flag] = path
            outputs.before[flag] = None if not path.exists() else b"" if path.is_dir() else path.read_bytes()
        outputs.listing = _listing(folder)
        return outputs

    def problems(self, *, allowed: str | None = None) -> list[str]:
        """``allowed``: a glob of files a failed run may leave on purpose."""
        found = []
        for flag, path in self.paths.items():
            was = self.before[flag]
            if was is None and path.exists():
                found.append(f"{flag} {path.name} was created")
            elif was is not None and not path.is_dir() and (not path.is_file() or path.read_bytes() != was):
                found.append(f"{flag} {path.name} was changed")
        extra = {name for name in _listing(self.folder) - self.listing
                 if allowed is None or not Path(name).match(allowed)}
        if extra:
            found.append(f"left behind {sorted(extra)}")
        return found


def _listing(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


_PREFIX = {"octoplan": "error: ", "octorun": "octorun: "}


def contract_problems(outcome: Outcome, *, tool: str, file: str | Path | tuple | None,
                      field_name: str | tuple[str, ...] | None = None,
                      outputs: Outputs | None = None) -> list[str]:
    """What ``outcome`` breaks of the bad-input contract; [] when it keeps all of it.
    ``file``: the file the line must name (None: any); ``field_name``: a field it must name."""
    found = []
    if outcome.code is None:
        found.append(outcome.note)
    elif outcome.code != 2:
        found.append(f"exit {outcome.code}")
    if "Traceback" in outcome.stderr:
        found.append("a traceback")
    lines = outcome.stderr.splitlines()
    if len(lines) != 1 or not outcome.stderr.endswith("\n"):
        found.append(f"{len(lines)} lines on stderr")
    line = lines[0] if lines else ""
    if not line.startswith(_PREFIX[tool]):
        found.append(f"the line does not start with {_PREFIX[tool]!r}")
    files = () if file is None else (file,) if isinstance(file, (str, Path)) else file
    if files and not any(str(name) in line for name in files):
        found.append(f"the line does not name {' or '.join(map(str, files))}")
    alternatives = (field_name,) if isinstance(field_name, str) else field_name
    if alternatives and not any(f"{name}" in line for name in alternatives):
        found.append(f"the line does not name the field {' or '.join(alternatives)}")
    if outputs is not None:
        found += outputs.problems()
    if found:
        found.append(f"stderr: {outcome.stderr[-600:]!r}")
    return found


# --- the seeds ---------------------------------------------------------------------------------

_WORK: Path | None = None


def _workdir() -> Path:
    global _WORK
    if _WORK is None:
        _WORK = Path(tempfile.mkdtemp(prefix="octopipe-corpus-"))
    return _WORK


TINY_CONFIG = {"vocab": 64, "hidden": 32, "layers": 4, "heads": 4, "seq": 8, "data_vocab": 32}


def _config_flags(config: dict[str, Any]) -> list[str]:
    return [part for key, value in config.items() for part in ("--config", f"{key}={value}")]


def _must(outcome: Outcome, what: str) -> None:
    assert outcome.code == 0, f"{what}: exit {outcome.code} {outcome.note}\n{outcome.stderr}"


@dataclass(frozen=True)
class Seeds:
    folder: Path
    profile: Path  # tiny_gpt measured here (6 layers)
    plan: Path  # ZB-H1 on 2 GPUs, 4 microbatches, of that profile
    analytic: Path  # an analytic profile (--arch)
    plan_data: dict
    profile_data: dict
    analytic_data: dict


_SEEDS: Seeds | None = None


def seeds() -> Seeds:
    """The valid files every mutation starts from, made once by the project's own commands."""
    global _SEEDS
    if _SEEDS is None:
        # a folder of its own each time: when making the seeds fails, the next case tries again
        # and shows the same failure, not a folder already there
        folder = Path(tempfile.mkdtemp(prefix="seeds-", dir=_workdir()))
        profile, plan, analytic = folder / "profile.yaml", folder / "plan.yaml", folder / "analytic.yaml"
        _must(octoplan("profile", REPO / "examples/models/tiny_gpt.py", *_config_flags(TINY_CONFIG), "--repeat", 1,
                       "--device", "cpu", "-o", profile, cwd=REPO), "profile")
        _must(octoplan("baseline", profile, "--gpus", 2, "--schedule", "zb-h1", "--microbatches", 4, "-o", plan,
                       cwd=REPO), "baseline")
        _must(octoplan("profile", "--arch", "llama3-8b", "--gpu", "h100", "-o", analytic), "analytic profile")
        load = lambda path: yaml.safe_load(path.read_text())
        _SEEDS = Seeds(folder, profile, plan, analytic, load(plan), load(profile), load(analytic))
    return _SEEDS


# --- writing a mutated document ----------------------------------------------------------------

@dataclass(frozen=True)
class Raw:
    """A value written into the YAML text as it is (what yaml.safe_dump cannot write: a number
    of 5000 digits, an alias), through a placeholder."""

    text: str


@dataclass(frozen=True)
class Case:
    """One bad file: its bytes, what was done to it, and the field its error must name (None:
    none in particular, e.g. a YAML syntax error names a line)."""

    kind: str
    text: bytes
    field: str | tuple[str, ...] | None  # several: the line names one of them
    describe: str


def _dump(data: dict, *, raws: dict[str, str] | None = None, prelude: str = "") -> bytes:
    text = yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=4096)
    for token, raw in (raws or {}).items():
        text = text.replace(f"'{token}'", raw).replace(token, raw)
    return (prelude + text).encode("utf-8")


def _field_name(path: tuple) -> str:
    """As error lines name a field: ``stages[1].layers`` (a list's item), ``schedule.0`` (a key)."""
    name = ""
    for before, part in zip((None, *path), path):
        name += f"[{part}]" if isinstance(part, int) and before != "schedule" else (f".{part}" if name else str(part))
    return name


def _set(data: Any, path: tuple, value: Any) -> None:
    for part in path[:-1]:
        data = data[part]
    data[path[-1]] = value


def _get(data: Any, path: tuple) -> Any:
    for part in path:
        data = data[part]
    return data


def _delete(data: Any, path: tuple) -> None:
    parent = _get(data, path[:-1])
    del parent[path[-1]]


def _with_value(seed: dict, path: tuple, value: Any) -> tuple[bytes, str]:
    data = copy.deepcopy(seed)
    raws = {}
    if isinstance(value, Raw):
        raws["RAWVALUE7f3a"] = value.text
        value = "RAWVALUE7f3a"
    _set(data, path, value)
    return _dump(data, raws=raws), f"{_field_name(path)} = {value if not raws else raws['RAWVALUE7f3a'][:60]!r}"


# --- values ----------------------------------------------------------------------------------------

_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=24)
_SMALL_INTS = st.integers(-10**6, 10**6)
def _huge(min_digits: int = 16) -> st.SearchStrategy:
    """Whole numbers of ``min_digits`` to 5000 digits (over 4300, more than Python reads),
    a third of them negative, written into the text as they are."""
    return st.integers(min_digits, 5000).map(lambda digits: Raw(("-" if digits % 3 == 0 else "") + "9" * digits))


_HUGE_INTS = _huge()
_NON_INTEGRAL = st.floats(allow_nan=True, allow_infinity=True).filter(lambda x: not float(x).is_integer())
_LISTS = st.lists(st.integers(-5, 5) | st.text("ab", max_size=3), max_size=4)
_DICTS = st.dictionaries(st.text("xyz", min_size=1, max_size=3), st.integers(-5, 5), max_size=3)
_BOOLS = st.booleans()
_FLOATS = st.floats(allow_nan=True, allow_infinity=True)


def _wrong_type(kind: str) -> st.SearchStrategy:
    """A value no field of ``kind`` accepts."""
    return {
        "int": _TEXT | _NON_INTEGRAL | _BOOLS | _LISTS | _DICTS,
        "num": _TEXT | _BOOLS | _LISTS | _DICTS,
        "str": _SMALL_INTS | _FLOATS | _BOOLS | _LISTS | _DICTS,
        "ops": _SMALL_INTS | _FLOATS | _BOOLS | _LISTS | _DICTS,
        "map": _TEXT | _SMALL_INTS | _FLOATS | _BOOLS | st.lists(st.integers(), min_size=0, max_size=3),
        "list": _TEXT.filter(bool) | _SMALL_INTS | _FLOATS | _BOOLS | _DICTS,
        "pair": _TEXT | _SMALL_INTS | _BOOLS | _DICTS
                | st.lists(st.integers(0, 9), max_size=5).filter(lambda v: len(v) != 2)
                | st.tuples(st.floats(0, 9), st.floats(0, 9)).map(list)
                | st.tuples(_BOOLS, st.integers(0, 9)).map(list)
                | st.tuples(st.text("0123", min_size=1, max_size=2), st.integers(0, 9)).map(list),
        "bool": _TEXT | _SMALL_INTS | _FLOATS | _LISTS | _DICTS,
    }[kind]


def _outside(least: float, most: float, *, whole: bool) -> st.SearchStrategy:
    """A number below ``least`` or above ``most`` (or not finite, for a real-valued field)."""
    below = st.integers(max_value=int(least) - 1 if float(least).is_integer() else int(least)).filter(lambda v: v < least)
    above = st.integers(min_value=int(most) + 1)
    choices = below | above | _huge(len(str(int(most))) + 1)
    if not whole:
        choices = choices | st.floats(max_value=least, exclude_max=True) | st.floats(min_value=most, exclude_min=True) \
            | st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e308, -1e308])
    # -0.0 is no float below 0.0
    return choices.filter(lambda v: isinstance(v, Raw) or not least <= v <= most)


def _other_than(value: int) -> st.SearchStrategy:
    return (st.integers(-10**9, 10**9) | _HUGE_INTS).filter(lambda v: v != value)


# deep and wide YAML: a document of aliases that expands past any file, one that holds
# itself, and a value nested too deep to read
def _alias_bomb(width: int, depth: int) -> tuple[str, str]:
    lines = [f"bomb0: &bomb0 [{', '.join(['x'] * width)}]"]
    lines += [f"bomb{i}: &bomb{i} [{', '.join([f'*bomb{i - 1}'] * width)}]" for i in range(1, depth)]
    return "\n".join(lines) + "\n", f"*bomb{depth - 1}"


_ALIAS_BOMBS = st.tuples(st.integers(4, 12), st.integers(7, 12)).filter(lambda wd: wd[0] ** wd[1] > 2 * 10**6)


# --- what a file holds: each field's kind, whether it must be there, and values out of range ---

@dataclass(frozen=True)
class Slot:
    path: tuple
    kind: str  # int, num, str, ops, map, list, pair, bool
    required: bool = True
    bad: Callable[[Any], st.SearchStrategy] | None = None  # of the seed's value: values of the right kind, yet bad
    # what the error line names when the value is out of range, where another field's rule may
    # be the one it breaks (a pipeline degree that pp*dp = gpus refuses): any of these
    named: tuple[str, ...] = ()


_OPS_RE = re.compile(r"^\s*[0-9]+[FIWB][0-9]+\s*$")


def _not_ops_token() -> st.SearchStrategy:
    """A token (no whitespace) that is no op."""
    token = st.text(st.characters(blacklist_categories=("Cs", "Zs", "Zl", "Zp", "Cc")), min_size=1, max_size=8)
    return token.filter(lambda t: not any(c.isspace() for c in t) and not _OPS_RE.match(t))


def plan_slots(data: dict) -> list[Slot]:
    """Every field of the seed plan: what it is and which of its values are bad."""
    gpus, pp, dp, mbs = (data["cluster"]["gpus"], data["parallel"]["pp"], data["parallel"]["dp"],
                         data["parallel"]["microbatches"])
    slots = [
        Slot(("format",), "str", bad=lambda v: _TEXT.filter(lambda t: t != v)),
        Slot(("profile",), "str", required=False, bad=lambda v: _TEXT.filter(lambda t: t != v and "/" not in t)),
        Slot(("profile_sha256",), "str", required=False, bad=lambda v: _TEXT.filter(lambda t: t != v)
             | st.text("0123456789abcdef", min_size=64, max_size=64).filter(lambda t: t != v)),
        Slot(("model",), "map"),
        Slot(("model", "name"), "str", bad=lambda v: _TEXT.filter(lambda t: t != v)),
        Slot(("model", "source"), "str", bad=lambda v: _TEXT.filter(lambda t: t != v and "/" not in t)),
        Slot(("model", "config"), "map"),
        Slot(("cluster",), "map"),
        Slot(("cluster", "gpus"), "int", bad=_other_than),
        Slot(("cluster", "gpus_per_node"), "int", required=False, bad=lambda v: _outside(1, 2**20, whole=True)),
        Slot(("cluster", "memory_gb"), "num", required=False, bad=lambda v: _outside(0, 1e6, whole=False)),
        Slot(("cluster", "intra_node_gbps"), "num", required=False, bad=lambda v: _outside(1e-9, 1e15, whole=False)),
        Slot(("cluster", "inter_node_gbps"), "num", required=False, bad=lambda v: _outside(1e-9, 1e15, whole=False)),
        Slot(("cluster", "latency_us"), "num", required=False, bad=lambda v: _outside(0, 1e9, whole=False)),
        Slot(("parallel",), "map"),
        Slot(("parallel", "pp"), "int", bad=_other_than, named=("parallel.pp", "cluster.gpus")),
        Slot(("parallel", "dp"), "int", required=False, bad=_other_than, named=("parallel.dp", "cluster.gpus")),
        Slot(("parallel", "microbatches"), "int", bad=_other_than, named=("parallel.microbatches", "schedule")),
        Slot(("parallel", "rank_order"), "str", required=False,
             bad=lambda v: _TEXT.filter(lambda t: t not in ("pp-inner", "dp-inner"))),
        Slot(("stages",), "list"),
        Slot(("schedule",), "map"),
    ]
    for i, stage in enumerate(data["stages"]):
        slots += [
            Slot(("stages", i), "map"),
            Slot(("stages", i, "layers"), "pair", bad=lambda v: st.tuples(st.integers(-3, 9), st.integers(-3, 9))
                 .map(list).filter(lambda pair: pair != v), named=("stages",)),
            Slot(("stages", i, "rank"), "int", bad=_other_than, named=("stages", "schedule")),
            Slot(("stages", i, "recompute"), "bool", required=False),
        ]
    for rank in data["schedule"]:
        slots.append(Slot(("schedule", rank), "ops"))
    return slots


def profile_slots(data: dict) -> list[Slot]:
    """Every field of a seed profile (docs/FORMATS.md section 2), and which of its values are bad."""
    slots = [
        Slot(("format",), "str", bad=lambda v: _TEXT.filter(lambda t: t != v)),
        Slot(("model",), "map"),
        Slot(("model", "name"), "str"),
        Slot(("model", "config"), "map", required=False),
        Slot(("microbatch_size",), "int", required=False, bad=lambda v: _outside(1, 1 << 20, whole=True)),
        Slot(("dtype",), "str", required=False,
             bad=lambda v: _TEXT.filter(lambda t: t not in DTYPE_BYTES)),
        Slot(("precision",), "str", required=False, bad=lambda v: _TEXT.filter(lambda t: t not in ("fp32", "bf16"))),
        Slot(("layers",), "list", bad=lambda v: st.just([])),
    ]
    if "device" in data:
        slots += [Slot(("device",), "map", required=False),
                  Slot(("device", "memory_gb"), "num", required=False, bad=lambda v: _outside(0, 1e6, whole=False))]
    if "source" in data["model"]:
        slots.append(Slot(("model", "source"), "str", required=False))
    ms, byte_count = (lambda v: _outside(0, 86_400_000.0, whole=False)), (lambda v: _outside(0, 10**15, whole=True))
    last = len(data["layers"]) - 1
    for i, layer in enumerate(data["layers"]):
        slots += [
            Slot(("layers", i), "map"),
            Slot(("layers", i, "name"), "str"),
            Slot(("layers", i, "kind"), "str", required=False,
                 bad=lambda v, i=i: st.sampled_from([k for k, ok in (("embedding", i != 0), ("head", i != last)) if ok])),
            Slot(("layers", i, "forward_ms"), "num", bad=ms),
            Slot(("layers", i, "backward_input_ms"), "num", bad=ms),
            Slot(("layers", i, "backward_weight_ms"), "num", bad=ms),
            Slot(("layers", i, "param_bytes"), "int", bad=byte_count),
            Slot(("layers", i, "activation_bytes"), "int", bad=byte_count),
            Slot(("layers", i, "output_bytes"), "int", bad=byte_count),
        ]
        flops = lambda v: _outside(0, sys.float_info.max, whole=False)  # noqa: E731 - no maximum but a float's
        for name, kind, bad in (("flops", "num", flops), ("backward_ms", "num", ms), ("pending_w_bytes", "int", byte_count),
                                ("w_saved_bytes", "int", byte_count)):
            if name in layer:
                slots.append(Slot(("layers", i, name), kind, required=False, bad=bad))
    return slots


# --- mutations of a whole document -----------------------------------------------------------------

_NOT_A_MAPPING = ["", "# only a comment\n", "- a\n- b\n", "42\n", "just text\n", "null\n", "[]\n", "---\n...\n"]
_BAD_BYTES = [b"\xff", b"\xfe\xff", b"\xc3", b"\x00", b"\x07", b"\x1b[2J", b"\xed\xa0\x80"]


@st.composite
def document_cases(draw, seed: dict, slots: list[Slot], *, spelt: list[tuple[tuple, tuple | None]],
                   more: dict[str, Callable] | None = None) -> Case:
    """A bad version of ``seed``. ``spelt``: the mappings whose keys must be spelt right
    (a near miss of a key is refused there), each as (its path, the keys the format reads there,
    or None: all of them) where the others are extensions another tool may write; ``more``: further kinds of damage, each a
    function of ``draw`` that returns a Case."""
    kinds = ["wrong type", "out of range", "missing", "truncated", "alias bomb", "self alias", "deep nesting",
             "not a mapping", "bad bytes", "duplicate key", "misspelt key", "huge number", *(more or {})]
    kind = draw(st.sampled_from(kinds))
    if kind == "wrong type":
        slot = draw(st.sampled_from(slots))
        value = draw(_wrong_type(slot.kind))
        text, what = _with_value(seed, slot.path, value)
        return Case(kind, text, _field_name(slot.path), what)
    if kind in ("out of range", "huge number"):
        ranged = [s for s in slots if s.bad is not None and (kind == "out of range" or s.kind in ("int", "num"))]
        slot = draw(st.sampled_from(ranged))
        try:
            now = _get(seed, slot.path)
        except KeyError:  # an optional field the seed leaves out
            now = None
        bad = slot.bad(now)
        value = draw(bad if kind == "out of range" else bad.filter(lambda v: isinstance(v, Raw)))
        text, what = _with_value(seed, slot.path, value)
        named = slot.named or (_field_name(slot.path),)
        if isinstance(value, Raw) and len(value.text.lstrip("-")) > sys.get_int_max_str_digits():
            named = ("line ",)  # no Python int holds it: the reader names its line
        return Case(kind, text, named, what)
    if kind == "missing":
        slot = draw(st.sampled_from([s for s in slots if s.required]))
        data = copy.deepcopy(seed)
        if draw(st.booleans()) and not isinstance(slot.path[-1], int):
            _delete(data, slot.path)
            what = f"{_field_name(slot.path)} deleted"
        else:
            _set(data, slot.path, None)
            what = f"{_field_name(slot.path)} = null"
        # a missing mapping or list may be named by the field inside it that is then missing
        return Case(kind, _dump(data), None if slot.kind in ("map", "list") else _field_name(slot.path), what)
    if kind == "truncated":
        # format last: whatever the cut leaves, it has lost or broken the format line
        data = {k: v for k, v in seed.items() if k != "format"}
        data["format"] = seed["format"]
        full = _dump(data)
        cut = draw(st.integers(0, len(full.rstrip()) - 1))
        return Case(kind, full[:cut], None, f"cut at byte {cut} of {len(full)}")
    if kind == "alias bomb":
        width, depth = draw(_ALIAS_BOMBS)
        prelude, alias = _alias_bomb(width, depth)
        slot = draw(st.sampled_from(slots))
        data = copy.deepcopy(seed)
        _set(data, slot.path, "RAWVALUE7f3a")
        return Case(kind, _dump(data, raws={"RAWVALUE7f3a": alias}, prelude=prelude), None,
                    f"{width}**{depth} values at {_field_name(slot.path)}")
    if kind == "self alias":
        slot = draw(st.sampled_from(slots))
        text, what = _with_value(seed, slot.path, Raw(draw(st.sampled_from(["&selfref [*selfref]", "&selfref {a: *selfref}",
                                                                           "&selfref [1, [2, *selfref]]"]))))
        return Case(kind, text, None, what)
    if kind == "deep nesting":
        slot = draw(st.sampled_from(slots))
        depth = draw(st.integers(300, 60_000))
        opener = draw(st.sampled_from(["[", "{a: "]))
        closer = "]" if opener == "[" else "}"
        text, _ = _with_value(seed, slot.path, Raw(opener * depth + closer * depth))
        return Case(kind, text, None, f"{depth} levels at {_field_name(slot.path)}")
    if kind == "not a mapping":
        text = draw(st.sampled_from(_NOT_A_MAPPING))
        return Case(kind, text.encode(), None, repr(text))
    if kind == "bad bytes":
        full = _dump(seed)
        at = draw(st.integers(0, len(full)))
        bad = draw(st.sampled_from(_BAD_BYTES))
        return Case(kind, full[:at] + bad + full[at:], None, f"{bad!r} at byte {at}")
    if kind == "duplicate key":
        full = _dump(seed).decode()
        lines = full.splitlines(keepends=True)
        keyed = [i for i, line in enumerate(lines) if re.match(r"^\s*[A-Za-z_0-9]+:", line)]
        i = draw(st.sampled_from(keyed))
        # the key again beside itself; a key whose value is the block below it gets an empty one
        again = lines[i].rstrip() + " {}\n" if lines[i].rstrip().endswith(":") else lines[i]
        lines.insert(i + 1, again)
        return Case(kind, "".join(lines).encode(), None, f"line {i + 1} written twice: {lines[i].strip()!r}")
    if kind == "misspelt key":
        parent, read = draw(st.sampled_from(spelt))
        mapping = _get(seed, parent)
        key = draw(st.sampled_from([k for k in mapping
                                    if isinstance(k, str) and len(k) >= 4 and (read is None or k in read)]))
        drop = draw(st.integers(0, len(key) - 1))
        wrong = key[:drop] + key[drop + 1:]
        assume(wrong not in mapping)
        data = copy.deepcopy(seed)
        target = _get(data, parent)
        target_items = list(target.items())
        target.clear()
        target.update((wrong if k == key else k, v) for k, v in target_items)
        return Case(kind, _dump(data), None, f"{_field_name(parent + (key,))} spelt {wrong!r}")
    return more[kind](draw)


# --- damage only a plan can take: its op orders and its stages ---------------------------------------

def _op(token: str) -> tuple[int, str, int]:
    match = re.fullmatch(r"([0-9]+)([FIWB])([0-9]+)", token)
    return int(match.group(1)), match.group(2), int(match.group(3))


def _ancestors(op: tuple[int, str, int], num_stages: int, present: set) -> set:
    """Every op ``op`` waits for, directly or not (docs/FORMATS.md section 3's dependencies),
    written out here rather than taken from the code under test."""
    found, todo = set(), [op]
    while todo:
        stage, kind, mb = todo.pop()
        direct = []
        if kind == "F" and stage > 0:
            direct.append((stage - 1, "F", mb))
        if kind in ("I", "B"):
            direct.append((stage, "F", mb))
            if stage + 1 < num_stages:
                direct += [(stage + 1, "I", mb), (stage + 1, "B", mb)]
        if kind == "W":
            direct.append((stage, "I", mb))
        for dep in direct:
            if dep in present and dep not in found:
                found.add(dep)
                todo.append(dep)
    return found


def _schedule_of(data: dict) -> dict[int, list[str]]:
    return {rank: text.split() for rank, text in data["schedule"].items()}


def _with_schedule(seed: dict, schedule: dict[int, list[str]]) -> bytes:
    data = copy.deepcopy(seed)
    data["schedule"] = {rank: " ".join(ops) for rank, ops in schedule.items()}
    return _dump(data)


def plan_damage(seed: dict) -> dict[str, Callable]:
    num_stages = len(seed["stages"])
    ranks = sorted(seed["schedule"])

    def duplicated_op(draw) -> Case:
        schedule = _schedule_of(seed)
        source = draw(st.sampled_from(ranks))
        token = draw(st.sampled_from(schedule[source]))
        into = draw(st.sampled_from(ranks))
        schedule[into].insert(draw(st.integers(0, len(schedule[into]))), token)
        return Case("duplicated op", _with_schedule(seed, schedule), "schedule",
                    f"{token} of rank {source} again on rank {into}")

    def missing_op(draw) -> Case:
        schedule = _schedule_of(seed)
        rank = draw(st.sampled_from(ranks))
        token = schedule[rank].pop(draw(st.integers(0, len(schedule[rank]) - 1)))
        return Case("missing op", _with_schedule(seed, schedule), f"schedule.{rank}", f"{token} dropped")

    def not_an_op(draw) -> Case:
        schedule = _schedule_of(seed)
        rank = draw(st.sampled_from(ranks))
        at = draw(st.integers(0, len(schedule[rank]) - 1))
        token = draw(_not_ops_token() | st.builds(lambda s, k, m: f"{s}{k}{m}", st.integers(num_stages, 10**30),
                                                  st.sampled_from("FIWB"), st.integers(0, 3))
                     | st.builds(lambda k, m: f"0{k}{m}", st.sampled_from("FIWB"), st.integers(4, 10**30)))
        was, schedule[rank][at] = schedule[rank][at], token
        return Case("not an op", _with_schedule(seed, schedule), f"schedule.{rank}", f"{was} -> {token!r}")

    def cyclic_order(draw) -> Case:
        # move an op before one it waits for on its own rank: the orders and the dependencies
        # then form a cycle (or, for a W moved before its I, break the I-before-W rule)
        schedule = _schedule_of(seed)
        present = {_op(t) for ops in schedule.values() for t in ops}
        choices = []
        for rank, ops in schedule.items():
            parsed = [_op(t) for t in ops]
            for at, op in enumerate(parsed):
                waits = _ancestors(op, num_stages, present)
                choices += [(rank, at, before) for before, other in enumerate(parsed[:at]) if other in waits]
        rank, at, before = draw(st.sampled_from(choices))
        ops = schedule[rank]
        token = ops.pop(at)
        ops.insert(before, token)
        return Case("cyclic order", _with_schedule(seed, schedule), "schedule",
                    f"rank {rank}: {token} moved before {ops[before + 1]}")

    def fused_and_split(draw) -> Case:
        schedule = _schedule_of(seed)
        stage = draw(st.integers(0, num_stages - 1))
        rank = seed["stages"][stage]["rank"]
        mb = draw(st.integers(0, seed["parallel"]["microbatches"] - 1))
        schedule[rank].append(f"{stage}B{mb}")
        return Case("B beside I and W", _with_schedule(seed, schedule), f"schedule.{rank}", f"{stage}B{mb} added")

    def stages_changed(draw) -> Case:
        data = copy.deepcopy(seed)
        how = draw(st.sampled_from(["drop", "repeat", "append", "swap ranks"]))
        i = draw(st.integers(0, num_stages - 1))
        if how == "drop":
            del data["stages"][i]
        elif how == "repeat":
            data["stages"].insert(i, copy.deepcopy(data["stages"][i]))
        elif how == "append":
            end = data["stages"][-1]["layers"][1]
            data["stages"].append({"layers": [end, end + draw(st.integers(1, 4))], "rank": draw(st.sampled_from(ranks))})
        else:
            ranks_now = [s["rank"] for s in data["stages"]]
            assume(len(set(ranks_now)) > 1)
            for stage, rank in zip(data["stages"], reversed(ranks_now)):
                stage["rank"] = rank
        return Case("stages overlap, gap or move", _dump(data), None, f"{how} stage {i}")

    def recompute_layers_alone(draw) -> Case:
        data = copy.deepcopy(seed)
        i = draw(st.integers(0, num_stages - 1))
        data["stages"][i]["recompute_layers"] = draw(st.integers(1, 3))
        return Case("recompute_layers without recompute", _dump(data), f"stages[{i}].recompute_layers", "")

    def world_size(draw) -> Case:
        data = copy.deepcopy(seed)
        pp, dp = draw(st.integers(1, 8)), draw(st.integers(1, 8))
        gpus = draw(st.integers(1, 64).filter(lambda g: g != pp * dp))
        data["parallel"].update(pp=pp, dp=dp)
        data["cluster"]["gpus"] = gpus
        return Case("world size", _dump(data), "cluster.gpus", f"gpus {gpus}, pp {pp} x dp {dp}")

    return {"duplicated op": duplicated_op, "missing op": missing_op, "not an op": not_an_op, "cyclic order": cyclic_order,
            "B beside I and W": fused_and_split, "stages overlap, gap or move": stages_changed,
            "recompute_layers without recompute": recompute_layers_alone, "world size": world_size}


def plan_cases(command: str) -> st.SearchStrategy:
    seed = seeds().plan_data
    slots = plan_slots(seed)
    if command in ("simulate", "show"):  # without a profile field, validate checks the rest, export
        # writes the op order and octorun trains microbatches of microbatch_size (or 1)
        slots = [Slot(s.path, s.kind, True, s.bad) if s.path == ("profile",) else s for s in slots]
    spelt = [(path, None) for path in ((), ("model",), ("model", "config"), ("cluster",), ("parallel",),
                                       *(("stages", i) for i in range(len(seed["stages"]))))]
    return document_cases(seed, slots, spelt=spelt, more=plan_damage(seed))


# --- the properties ------------------------------------------------------------------------------------

def _case_folder() -> Path:
    return Path(tempfile.mkdtemp(prefix="case-", dir=_workdir()))


def _write_case(case: Case, name: str) -> Path:
    path = _case_folder() / name
    path.write_bytes(case.text)
    return path


# the outputs each command is given: none may appear, an existing one must keep its bytes
PLAN_COMMANDS = {
    "simulate": ((), {}),
    "validate": ((), {}),
    "show": (("--svg", "{--svg}", "--trace", "{--trace}"), {"--svg": "timeline.svg", "--trace": "trace.json"}),
    "export": (("-o", "{-o}"), {"-o": "schedule.csv"}),
}


def _argv(template: tuple, outputs: Outputs) -> list[str]:
    return [str(outputs.paths[part[1:-1]]) if part.startswith("{") else part for part in template]


def check_plan_case(command: str, case: Case, existing: bool) -> None:
    plan = _write_case(case, "plan.yaml")
    template, names = PLAN_COMMANDS[command]
    outputs = Outputs.make(names, existing=existing)
    outcome = octoplan(command, plan, *_argv(template, outputs))
    problems = contract_problems(outcome, tool="octoplan", file=plan, field_name=case.field, outputs=outputs)
    _judge(command, problems, f"{case.kind}: {case.describe}")
    shutil.rmtree(plan.parent, ignore_errors=True)
    shutil.rmtree(outputs.folder, ignore_errors=True)


@pytest.mark.parametrize("command", list(PLAN_COMMANDS))
def test_bad_plans_are_refused_by_every_command(command):
    @corpus_settings(40)
    @given(case=plan_cases(command), existing=st.booleans())
    def run(case, existing):
        check_plan_case(command, case, existing)

    run()


# a launch of the seed plan that octorun accepts: only the plan's damage may stop it
_GOOD_LAUNCH = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29511"}
_OCTORUN_OUTPUTS = {"--metrics": "metrics.jsonl", "--trace": "trace.json", "--save": "checkpoints/"}


def check_octorun_plan_case(case: Case, existing: bool) -> None:
    plan = _write_case(case, "plan.yaml")
    outputs = Outputs.make(_OCTORUN_OUTPUTS, existing=existing)
    args = [arg for flag, path in outputs.paths.items() for arg in (flag, path)]
    outcome = octorun(plan, "--steps", 2, *args, env=_GOOD_LAUNCH)
    problems = contract_problems(outcome, tool="octorun", file=plan, field_name=case.field, outputs=outputs)
    _judge("octorun", problems, f"{case.kind}: {case.describe}")
    shutil.rmtree(plan.parent, ignore_errors=True)
    shutil.rmtree(outputs.folder, ignore_errors=True)


def test_bad_plans_are_refused_by_octorun():
    @corpus_settings(40)
    @given(case=plan_cases("octorun"), existing=st.booleans())
    def run(case, existing):
        check_octorun_plan_case(case, existing)

    run()


# --- profiles --------------------------------------------------------------------------------------------

def profile_damage(seed: dict) -> dict[str, Callable]:
    def part_over_whole(draw) -> Case:
        data = copy.deepcopy(seed)
        i = draw(st.integers(0, len(data["layers"]) - 1))
        layer = data["layers"][i]
        layer["w_saved_bytes"] = layer["activation_bytes"] + draw(st.integers(1, 10**6))
        layer.pop("input_freed_bytes", None)
        return Case("a part over its whole", _dump(data), f"layers[{i}].w_saved_bytes", "w_saved_bytes > activation_bytes")

    def bad_tied(draw) -> Case:
        # tied parameters (docs/FORMATS.md section 2): groups of two or more distinct members
        # [layer index, parameter name] whose bytes fit in every member layer
        data = copy.deepcopy(seed)
        num_layers = len(data["layers"])
        good = [[0, "embed.weight"], [num_layers - 1, "proj.weight"]]
        size = min(data["layers"][0]["param_bytes"], data["layers"][-1]["param_bytes"])
        how = draw(st.sampled_from(["not a list", "a member that is no pair", "a layer out of range", "one member",
                                    "a member twice", "bytes over param_bytes", "an unknown key", "no members"]))
        group: Any = {"members": good, "bytes": size}
        if how == "not a list":
            tied = draw(_wrong_type("list"))
        else:
            if how == "a member that is no pair":
                group["members"] = [good[0], draw(_wrong_type("pair") | st.tuples(st.integers(0, 2), _wrong_type("str"))
                                                  .map(list) | st.just([1, ""]))]
            elif how == "a layer out of range":
                group["members"] = [good[0], [draw(st.integers(max_value=-1) | st.integers(min_value=num_layers)), "w"]]
            elif how == "one member":
                group["members"] = good[:1]
            elif how == "a member twice":
                group["members"] = [good[0], good[0]]
            elif how == "bytes over param_bytes":
                group["bytes"] = size + draw(st.integers(1, 10**12))
            elif how == "an unknown key":
                group["membres"] = group.pop("members")
            else:
                del group["members"]
            tied = [group]
        data["tied"] = tied
        return Case("bad tied parameters", _dump(data), "tied", how)

    return {"a part over its whole": part_over_whole, "bad tied parameters": bad_tied}


def profile_cases(which: str) -> st.SearchStrategy:
    seed = seeds().profile_data if which == "measured" else seeds().analytic_data
    # the top-level fields a profile reads (octoplan.profile): "profiler" and the like are extensions
    read = ("format", "model", "device", "microbatch_size", "dtype", "precision", "tied", "layers")
    spelt = [((), read), (("model",), None), *((("layers", i), None) for i in range(len(seed["layers"])))]
    return document_cases(seed, profile_slots(seed), spelt=spelt, more=profile_damage(seed))


PROFILE_COMMANDS = {
    "baseline": ("--gpus", "2", "--schedule", "1f1b", "-o", "{-o}"),
    "tune": ("--gpus", "2", "--max-plans", "10", "--time-limit", "5", "-o", "{-o}"),
}


def check_profile_case(command: str, case: Case, existing: bool) -> None:
    profile = _write_case(case, "profile.yaml")
    if command == "simulate":  # a plan whose profile is bad: its hash matches, its content does not pass
        data = copy.deepcopy(seeds().plan_data)
        data.update(profile=str(profile), profile_sha256=hashlib.sha256(case.text).hexdigest())
        plan = profile.parent / "plan.yaml"
        plan.write_bytes(_dump(data))
        outcome, outputs, files = octoplan("simulate", plan), None, (profile, plan)
    else:
        outputs = Outputs.make({"-o": "plan.yaml"}, existing=existing)
        outcome, files = octoplan(command, profile, *_argv(PROFILE_COMMANDS[command], outputs)), profile
    # through a plan, the line may name the plan's field that the bad profile breaks instead
    problems = contract_problems(outcome, tool="octoplan", file=files,
                                 field_name=case.field if command != "simulate" else None, outputs=outputs)
    _judge(command if command != "simulate" else "simulate (bad profile)", problems, f"{case.kind}: {case.describe}")
    shutil.rmtree(profile.parent, ignore_errors=True)
    if outputs is not None:
        shutil.rmtree(outputs.folder, ignore_errors=True)


@pytest.mark.parametrize("command", [*PROFILE_COMMANDS, "simulate"])
def test_bad_profiles_are_refused_by_every_command(command):
    @corpus_settings(30 if command != "simulate" else 20)
    @given(case=profile_cases("measured") | profile_cases("analytic"), existing=st.booleans())
    def run(case, existing):
        check_profile_case(command, case, existing)

    run()


# --- model files off the contract (octoplan profile) ---------------------------------------------------

_MODEL_TEMPLATE = '''\
import torch
from torch import nn

NAME = {name}


class Plain(nn.Module):
    def __init__(self, index):
        super().__init__()
        self.index = index
        self.linear = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        {forward}
        return self.linear(x){reshape}


def num_layers(**config):
    {num_layers}
    return 3


def build_layer(index, **config):
    {build_layer}
    return Plain(index)


def sample_batch(microbatch_size, generator, **config):
    {sample_batch}
    return torch.randn(microbatch_size, 4, generator=generator), torch.randn(microbatch_size, 4, generator=generator)


def loss_fn(outputs, targets):
    {loss_fn}
    return ((outputs - targets) ** 2).mean()
{tail}'''

# what a layer raises: the exception types model code meets, with messages that may span lines
_RAISED = st.sampled_from(["ValueError", "RuntimeError", "ZeroDivisionError", "KeyError", "AssertionError", "TypeError",
                           "IndexError", "NotImplementedError", "OSError", "FloatingPointError", "SystemExit"])
_MESSAGES = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40) | st.sampled_from(
    ["line one\nline two", "tab\there", "\r\n", "x" * 5000, "carriage\rreturn", "form\x0cfeed", "sep\u2028line"])


@st.composite
def model_cases(draw) -> Case:
    """A model file that breaks docs/FORMATS.md section 4, and the field its error must name."""
    parts = dict(name='"corpus-model"', forward="", reshape="", num_layers="", build_layer="", sample_batch="",
                 loss_fn="", tail="")
    kind = draw(st.sampled_from(["missing function", "a layer raises", "shapes disagree", "not a module",
                                 "bad layer count", "a hook raises", "bad batch", "bad loss", "broken file"]))
    layer = draw(st.integers(0, 2))
    field_name: tuple[str, ...] | None = None
    if kind == "missing function":
        name = draw(st.sampled_from(["num_layers", "build_layer", "sample_batch", "loss_fn"]))
        parts["tail"] = f"\ndel {name}\n"
        field_name = (name,)
    elif kind == "a layer raises":
        error, message = draw(_RAISED), draw(_MESSAGES)
        when = draw(st.sampled_from(["always", "on a later call", "in backward"]))
        raising = f"raise {error}({message!r})"
        if when == "always":
            parts["forward"] = f"if self.index == {layer}: {raising}"
        elif when == "on a later call":
            parts["forward"] = f"if self.index == {layer} and self.calls > 1: {raising}"
        else:  # on the gradient of the layer's output (its input has none in layer 0)
            parts["forward"] = (f"if self.index == {layer}:\n            out = self.linear(x)\n"
                                f"            out.register_hook(lambda g: (_ for _ in ()).throw({error}({message!r})))\n"
                                f"            return out")
    elif kind == "shapes disagree":
        # layer k's output does not fit what layer k+1 (or the loss) takes
        parts["reshape"] = f"[..., :3] if self.index == {layer} else self.linear(x)"
    elif kind == "not a module":
        value = draw(st.sampled_from(["None", "5", "'layer'", "lambda x: x", "torch.zeros(2)", "[nn.Linear(4, 4)]",
                                      "Plain", "nn.Linear"]))
        parts["build_layer"] = f"if index == {layer}: return {value}"
        field_name = (f"build_layer({layer})",)
    elif kind == "bad layer count":
        value = draw(st.sampled_from(["0", "-1", "'3'", "3.0", "None", "10**9", "10**5000", "True", "[1, 2, 3]",
                                      "[[1] * 1000] * 1000"]))
        parts["num_layers"] = f"return {value}"
        field_name = ("num_layers",)
    elif kind == "a hook raises":
        name = draw(st.sampled_from(["num_layers", "build_layer", "sample_batch", "loss_fn"]))
        parts[name] = f"raise {draw(_RAISED)}({draw(_MESSAGES)!r})"
        field_name = (name,) if name != "build_layer" else ("build_layer",)
    elif kind == "bad batch":
        value = draw(st.sampled_from(["None", "torch.zeros(4, 4)", "(torch.zeros(4, 4),)", "(1, 2, 3)",
                                      "('a', 'b')", "[torch.zeros(4, 4), torch.zeros(4, 4)]"]))
        parts["sample_batch"] = f"return {value}"
        field_name = ("sample_batch",)
    elif kind == "bad loss":
        value = draw(st.sampled_from(["None", "1.0", "outputs", "(outputs - targets)", "torch.tensor(1.0)"]))
        parts["loss_fn"] = f"return {value}"
        field_name = ("loss_fn",)
    else:
        how = draw(st.sampled_from(["syntax", "import", "raise", "exit", "name"]))
        parts["tail"] = {"syntax": "\ndef broken(:\n", "import": "\nimport a_module_that_is_not_there\n",
                         "raise": f"\nraise {draw(_RAISED)}({draw(_MESSAGES)!r})\n", "exit": "\nraise SystemExit(0)\n",
                         "name": ""}[how]
        if how == "name":
            parts["name"] = draw(st.sampled_from(["5", "''", "None", "['x']"]))
            field_name = ("NAME",)
    source = _MODEL_TEMPLATE.format(**parts)
    changed = "; ".join(f"{key}: {value.strip()}" for key, value in parts.items()
                        if value and not (key == "name" and value == '"corpus-model"'))
    return Case(kind, source.encode(), field_name, changed)


def check_model_case(case: Case, existing: bool) -> None:
    model = _write_case(case, "model.py")
    outputs = Outputs.make({"-o": "profile.yaml"}, existing=existing)
    outcome = octoplan("profile", model, "--repeat", 1, "--device", "cpu", "-o", outputs.paths["-o"])
    problems = contract_problems(outcome, tool="octoplan", file=model, field_name=case.field, outputs=outputs)
    _judge("profile", problems, f"{case.kind}: {case.describe}")
    shutil.rmtree(model.parent, ignore_errors=True)
    shutil.rmtree(outputs.folder, ignore_errors=True)


def test_model_files_off_the_contract_are_refused_by_profile(one_thread):
    @corpus_settings(30)
    @given(case=model_cases(), existing=st.booleans())
    def run(case, existing):
        check_model_case(case, existing)

    run()


# --- what the corpus found, each fixed and pinned by a plain test ----------------------------------------

def test_deep_flow_nesting_inside_a_mapping_is_refused_before_it_is_parsed(tmp_path):
    # PyYAML's scanner is quadratic in flow depth: 30000 levels under a key took minutes
    seed = seeds().plan_data
    text, _ = _with_value(seed, ("cluster", "latency_us"), Raw("[" * 30_000 + "]" * 30_000))
    plan = tmp_path / "plan.yaml"
    plan.write_bytes(text)
    line = next(n for n, text_line in enumerate(text.decode().splitlines(), 1) if "latency_us" in text_line)
    outcome = octoplan("validate", plan)
    assert outcome.code == 2 and outcome.stderr == (
        f"error: {plan}: line {line}: nested too deeply to be a plan file (more than 200 levels of [ ] or {{ }}) "
        "(give a plan YAML file)\n"), outcome
    # 200 levels are read (and refused for what they are: not a number), quoted brackets are text
    text, _ = _with_value(seed, ("cluster", "latency_us"), Raw("[" * 200 + "]" * 200))
    plan.write_bytes(text)
    outcome = octoplan("validate", plan)
    assert outcome.code == 2 and "cluster.latency_us: must be a number" in outcome.stderr, outcome
    data = copy.deepcopy(seed)
    data["model"]["name"] = "[" * 5000
    plan.write_bytes(_dump(data))
    outcome = octoplan("validate", plan)
    assert outcome.code == 2 and "model.name: is '[[[" in outcome.stderr, outcome


def test_an_error_line_stays_one_line_whatever_its_parts_hold():
    from octoplan.errors import InputError

    error = InputError("a\nb.py", "f\u2028", "x\ry\x0cz\x85", "fix\n")
    assert error.line() == "a\\nb.py: f\\u2028: x\\ry\\x0cz\\x85 (fix\\n)"
    # nor a NUL, a terminal's escape sequence or a bidirectional override (a layer name a model
    # file returned, echoed by export): the line reads as what it holds; a tab and é stay
    error = InputError("m.yaml", "layers.1.name", "is 'é\u202e\x00z\tq\x1b[31m'", "rename it")
    assert error.line() == "m.yaml: layers.1.name: is 'é\\u202e\\x00z\tq\\x1b[31m' (rename it)"


def test_a_model_file_that_raises_a_line_break_at_import_gets_one_line(tmp_path):
    model = tmp_path / "model.py"
    model.write_text("raise ValueError('carriage\\rreturn\\nand a new line')\n")
    outcome = octoplan("profile", model, "--repeat", 1, "-o", tmp_path / "p.yaml")
    assert outcome.code == 2 and outcome.stderr == (
        f"error: {model}: import failed: ValueError: carriage\\rreturn\\nand a new line (at {model.resolve()}:1 in "
        "<module>) (fix the model file)\n"), outcome


@pytest.mark.parametrize("body,problem", [
    ("raise KeyError('depth')", "num_layers: raised KeyError: 'depth' (fix num_layers in the model file)"),
    ("raise RuntimeError('')", "num_layers: raised RuntimeError (fix num_layers in the model file)"),
    ("return 10**5000", "num_layers: returned a 5001-digit number (return an int from 1 to 100000)"),
    ("return [10**5000]", "num_layers: returned [<a 5001-digit number>] (return an int from 1 to 100000)"),
])
def test_a_num_layers_that_raises_or_returns_a_huge_number_is_bad_input(tmp_path, body, problem):
    # each was exit 1 with the exception's text alone: octoplan profile's and octorun's first call into the file
    model = tmp_path / "model.py"
    model.write_text(_MODEL_TEMPLATE.format(name='"m"', forward="", reshape="", num_layers=body, build_layer="",
                                            sample_batch="", loss_fn="", tail=""))
    outcome = octoplan("profile", model, "--repeat", 1, "-o", tmp_path / "p.yaml")
    assert outcome.code == 2 and outcome.stderr == f"error: {model}: {problem}\n", outcome
    assert not (tmp_path / "p.yaml").exists()


def test_a_bad_value_of_more_digits_than_python_prints_is_shown_by_its_length():
    from octoplan.errors import shown

    assert shown(10**5000) == "a 5001-digit number" and shown(-(10**4999)) == "a 5000-digit number"
    assert shown(10**59) == str(10**59) and shown(10**60) == "a 61-digit number"
    assert shown({"a": [10**5000, 3]}) == "{'a': [<a 5001-digit number>, 3]}"


# --- launch variables that disagree with the plan (octorun) -------------------------------------------------

def _not_whole(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return True
    return False


_NOT_WHOLE = _TEXT.filter(lambda t: "\x00" not in t and _not_whole(t))


@st.composite
def launch_cases(draw) -> tuple[dict[str, str | None], tuple[str, ...], str]:
    """The seed plan's good launch with one variable made bad: (environment, the fields the
    line may name, what was done)."""
    env = dict(_GOOD_LAUNCH)
    name = draw(st.sampled_from(["WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR"]))
    named: tuple[str, ...] = (name,)
    if name == "WORLD_SIZE":
        value = draw(st.integers(-10, 10**30).filter(lambda v: v != 2).map(str) | _NOT_WHOLE)
        named = (name, "cluster.gpus")
    elif name in ("RANK", "LOCAL_RANK"):
        value = draw((st.integers(max_value=-1) | st.integers(min_value=2)).map(str) | _NOT_WHOLE)
    elif name == "LOCAL_WORLD_SIZE":  # the plan's nodes hold 8 GPUs: its 2 ranks are one launcher's
        value = draw(st.integers(-10, 10**30).filter(lambda v: v != 2).map(str) | _NOT_WHOLE)
        named = (name, "cluster.gpus_per_node")
    elif name == "MASTER_PORT":
        value = draw((st.integers(max_value=0) | st.integers(min_value=65536)).map(str) | _NOT_WHOLE)
    else:
        value = ""
    env[name] = value
    return env, named, f"{name}={value!r}"


def check_launch_case(env: dict, named: tuple[str, ...], describe: str) -> None:
    outputs = Outputs.make(_OCTORUN_OUTPUTS, existing=False)
    args = [arg for flag, path in outputs.paths.items() for arg in (flag, path)]
    outcome = octorun(seeds().plan, *args, env=env)
    file = seeds().plan if any(name.startswith("cluster.") for name in named) and "cluster." in outcome.stderr else None
    problems = contract_problems(outcome, tool="octorun", file=file, field_name=named, outputs=outputs)
    _judge("octorun (launch)", problems, describe)
    shutil.rmtree(outputs.folder, ignore_errors=True)


def test_launch_variables_that_disagree_with_the_plan_are_refused():
    @corpus_settings(30)
    @given(case=launch_cases())
    def run(case):
        check_launch_case(*case)

    run()


def test_a_launch_that_sets_world_size_but_not_rank_is_refused():
    env = dict(_GOOD_LAUNCH, RANK=None)
    outcome = octorun(seeds().plan, env=env)
    problems = contract_problems(outcome, tool="octorun", file=None, field_name="RANK")
    assert not problems, problems


# --- checkpoints that cannot be resumed (octorun, as a process: a checkpoint is read once the group exists) -----

@dataclass(frozen=True)
class CheckpointSeeds:
    plan: Path  # 1 GPU, of the seed profile
    checkpoint: Path  # one step of it, saved
    other_plans: dict  # another model of the same name: {"layers": plan, "hidden": plan}


_CHECKPOINTS: CheckpointSeeds | None = None


def checkpoint_seeds() -> CheckpointSeeds:
    global _CHECKPOINTS
    if _CHECKPOINTS is None:
        # a folder of its own each time: when making the seeds fails, the next case tries again
        # and shows the same failure, not a folder already there
        folder = Path(tempfile.mkdtemp(prefix="checkpoint-seeds-", dir=_workdir()))
        plan = folder / "plan.yaml"
        _must(octoplan("baseline", seeds().profile, "--gpus", 1, "--schedule", "1f1b", "--microbatches", 2, "-o", plan),
              "baseline")
        saved = subprocess_run("octorun", plan, "--steps", 1, "--save", folder / "saved", timeout_s=300)
        _must(saved, "octorun --save")
        (checkpoint,) = [p for p in (folder / "saved").iterdir() if p.name.startswith("step_")]
        others = {}
        for what, change in (("layers", {"layers": 3}), ("hidden", {"hidden": 16})):
            profile, other = folder / f"profile-{what}.yaml", folder / f"plan-{what}.yaml"
            _must(octoplan("profile", REPO / "examples/models/tiny_gpt.py", *_config_flags({**TINY_CONFIG, **change}),
                           "--repeat", 1, "--device", "cpu", "-o", profile), f"profile {what}")
            _must(octoplan("baseline", profile, "--gpus", 1, "--schedule", "1f1b", "--microbatches", 2, "-o", other),
                  f"baseline {what}")
            others[what] = other
        _CHECKPOINTS = CheckpointSeeds(plan, checkpoint, others)
    return _CHECKPOINTS


def _damaged_checkpoint(how: str) -> tuple[Path, Path]:
    """(the plan to run, what --resume names) once the seed checkpoint suffered ``how``."""
    seeds_ = checkpoint_seeds()
    folder = _case_folder() / seeds_.checkpoint.name
    shutil.copytree(seeds_.checkpoint, folder)
    plan = seeds_.plan
    shards = sorted(folder.glob("*.distcp"))
    if how == "missing shard":
        shards[0].unlink()
    elif how == "truncated shard":
        shards[0].write_bytes(shards[0].read_bytes()[: shards[0].stat().st_size // 2])
    elif how == "missing index":
        (folder / ".metadata").unlink()
    elif how == "missing record":
        (folder / "octopipe.json").unlink()
    elif how == "record not JSON":
        (folder / "octopipe.json").write_text("{not json")
    elif how == "record of another format":
        record = json.loads((folder / "octopipe.json").read_text())
        record["format"] = "another/1"
        (folder / "octopipe.json").write_text(json.dumps(record))
    elif how in ("another layer count", "another hidden size"):
        plan = seeds_.other_plans["layers" if "layer" in how else "hidden"]
    elif how == "a file":
        folder = shards[0]
    elif how == "an empty folder":
        shutil.rmtree(folder)
        folder.mkdir()
    return plan, folder


_CHECKPOINT_DAMAGE = ["missing shard", "truncated shard", "missing index", "missing record", "record not JSON",
                      "record of another format", "another layer count", "another hidden size", "a file", "an empty folder"]


@pytest.mark.slow
@pytest.mark.parametrize("how", _CHECKPOINT_DAMAGE)
def test_checkpoints_that_cannot_be_resumed_are_refused(how):
    check_checkpoint_case(how, existing=_CHECKPOINT_DAMAGE.index(how) % 2 == 1)


def check_checkpoint_case(how: str, existing: bool) -> None:
    plan, folder = _damaged_checkpoint(how)
    outputs = Outputs.make({"--metrics": "metrics.jsonl", "--save": "more/"}, existing=existing)
    outcome = subprocess_run("octorun", plan, "--steps", 2, "--resume", folder, "--metrics", outputs.paths["--metrics"],
                             "--save", outputs.paths["--save"], "--init-timeout", 60, timeout_s=120)
    # a run that failed once its ranks started keeps each rank's last activities beside
    # --metrics (octorun.watchdog), for the post-mortem: on purpose, not a half-written output
    problems = contract_problems(outcome, tool="octorun", file=folder) + outputs.problems(allowed="*.ops.txt")
    _judge("octorun (checkpoint)", problems, how)
    shutil.rmtree(folder.parent if folder.is_dir() else folder.parent.parent, ignore_errors=True)
    shutil.rmtree(outputs.folder, ignore_errors=True)


# --- the same in a real process: what this module runs in-process is what a shell sees ---------------------

@pytest.mark.slow
@pytest.mark.parametrize("tool", ["octoplan", "octorun"])
def test_a_sample_of_the_corpus_ends_alike_in_a_real_process(tool):
    @corpus_settings(3)
    @given(case=plan_cases("validate" if tool == "octoplan" else "octorun"))
    def run(case):
        plan = _write_case(case, "plan.yaml")
        if tool == "octoplan":
            here, there = octoplan("validate", plan), subprocess_run("octoplan.cli", "validate", plan)
        else:
            # the real process tells its peers of its bad input first; none come, and it waits
            # for them only up to --init-timeout
            args = (plan, "--init-timeout", 2)
            here, there = octorun(*args, env=_GOOD_LAUNCH), subprocess_run("octorun", *args, env=_GOOD_LAUNCH)
        _judge(f"{tool} (a real process)", contract_problems(there, tool=tool, file=plan, field_name=case.field),
               f"{case.kind}: {case.describe}")
        assert (here.code, here.stderr) == (there.code, there.stderr)
        shutil.rmtree(plan.parent, ignore_errors=True)

    run()


def test_a_config_value_nested_too_deeply_is_bad_input():
    # read as YAML too: a RecursionError (exit 1), and quadratic below that
    outcome = octoplan("profile", REPO / "examples/models/tiny_gpt.py", "--config", "hidden=" + "[" * 5000 + "]" * 5000,
                       "-o", _case_folder() / "p.yaml")
    assert outcome.code == 2, outcome
    assert outcome.stderr.startswith("error: --config: value of 'hidden' is not valid YAML: '[[["), outcome
    assert outcome.stderr.count("\n") == 1 and "Traceback" not in outcome.stderr
