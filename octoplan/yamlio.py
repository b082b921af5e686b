"""Reading and writing the YAML files of FORMATS.md sections 2 and 3, with input errors that name
the file and the field instead of a traceback."""

from __future__ import annotations

import difflib
import hashlib
import math
import re
import sys
from pathlib import Path
from typing import Any, Iterable

import yaml

from octoplan.errors import InputError, shown
from octoplan.inputs import read_input_bytes, read_input_text
from octoplan.outputs import write_text

__all__ = ["read_yaml", "read_yaml_value", "write_yaml", "file_sha256", "Fields", "MAX_ALIASED_NODES"]


class _Loader(yaml.SafeLoader):
    """YAML 1.2's floats: PyYAML follows YAML 1.1, where ``1.2e9`` and ``1e-3`` (no dot, or no
    sign in the exponent) are strings — but FORMATS.md's own example writes ``flops: 1.2e9``."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                    |[-+]?\.(?:inf|Inf|INF)
                    |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."),
)


class _Refused(yaml.constructor.ConstructorError):
    """Valid YAML that no octoplan file may hold; :func:`read_yaml` names its line and ``fix``."""

    def __init__(self, problem: str, fix: str, mark: Any):
        super().__init__(None, None, problem, mark)
        self.fix = fix


def _construct_mapping(loader: _Loader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # "<<: *base": its keys may be overridden here
            continue
        key = loader.construct_object(key_node, deep=True)
        if isinstance(key, (str, int, float, bool)) or key is None:
            if key in seen:  # YAML forbids it, PyYAML keeps the last silently
                raise _Refused(f"key {shown(key)} appears twice", "keep one of them", key_node.start_mark)
            seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_Loader.construct_mapping = _construct_mapping  # type: ignore[method-assign]


def _construct_int(loader: _Loader, node: yaml.ScalarNode) -> int:
    try:
        return yaml.SafeLoader.construct_yaml_int(loader, node)
    except ValueError:  # Python reads no decimal of more digits (int_max_str_digits)
        raise _Refused(f"a number of {len(node.value)} characters is more than Python reads "
                       f"({sys.get_int_max_str_digits()} digits)", "write a smaller number", node.start_mark) from None


_Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)

# The values aliases may add to a document beyond those written out: far above any use of
# anchors in a plan or profile (one shared layer entry repeated over 10,000 layers adds
# 200,000), low enough that walking the result (a check, an error's text) takes well under a
# second. Without it ten lines of nested aliases read as 10**9 values, and anything that walks
# them runs for minutes.
MAX_ALIASED_NODES = 1_000_000


def _check_expansion(root: yaml.Node) -> None:
    """Refuse a document whose aliases expand it by more than :data:`MAX_ALIASED_NODES` values,
    or that holds itself; counted on the node graph, shared nodes once, so never walked whole."""
    size: dict[int, int] = {}  # id(node) -> values in it, aliases expanded
    open_nodes: set[int] = set()  # the nodes being counted: the path from the root
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:  # depth first, without recursion: a deep document is PyYAML's to refuse
        node, done = stack.pop()
        children = [] if isinstance(node, yaml.ScalarNode) else (
            [part for pair in node.value for part in pair] if isinstance(node, yaml.MappingNode) else node.value)
        key = id(node)
        if done:
            open_nodes.discard(key)
            size[key] = 1 + sum(size[id(child)] for child in children)
            if size[key] > len(size) + MAX_ALIASED_NODES:
                raise _Refused(f"its aliases expand to more than {MAX_ALIASED_NODES} values", "write the values out",
                               node.start_mark)
            continue
        if key in size:
            continue
        if key in open_nodes:
            raise _Refused("an alias refers to a value that holds it", "write the value out", node.start_mark)
        open_nodes.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in children)


def _compose_document(loader: _Loader) -> yaml.Node:
    node = yaml.SafeLoader.compose_document(loader)
    _check_expansion(node)
    return node


_Loader.compose_document = _compose_document  # type: ignore[method-assign]


# The deepest nesting of flow collections ([...] and {...}) a file may have. PyYAML's scanner
# reads a flow collection to its end before the parser sees it, keeping one pending key per
# open level and checking all of them at every token: time quadratic in the depth (3000
# levels: 10 s; the 64k of a 130 kB file: hours), long before its parser would give up on the
# recursion (about 500 levels). No octoplan file nests more than a few.
MAX_FLOW_DEPTH = 200
_FLOW_CHARS = re.compile(r"""[\[\]{}'"#\n\\]""")


def _too_deep(text: str) -> int | None:
    """The line where ``text``'s flow collections first nest deeper than
    :data:`MAX_FLOW_DEPTH`, else None. One pass over the characters that matter, passing over
    quoted text and comments as YAML does (a quote opens only where a scalar may start, so the
    apostrophe of a plain ``it's`` is none); a text with fewer brackets than the limit is not
    scanned at all."""
    if text.count("[") + text.count("{") <= MAX_FLOW_DEPTH:
        return None
    depth, line, quote, comment, escaped = 0, 1, "", False, -1
    for match in _FLOW_CHARS.finditer(text):
        char, at = match.group(), match.start()
        if char == "\n":
            line, comment = line + 1, False
            continue
        if comment:
            continue
        if quote:
            if char == "\\" and quote == '"' and at != escaped:
                escaped = at + 1  # the next character is escaped, a quote or a backslash alike
            elif char == quote and at != escaped:
                quote = ""
            continue
        before = text[at - 1] if at else "\n"
        if char in "'\"":
            if before in " \t\n[{,":
                quote = char
        elif char == "#":
            comment = before in " \t\n"
        elif char in "[{":
            depth += 1
            if depth > MAX_FLOW_DEPTH:
                return line
        elif char in "]}":
            depth = max(0, depth - 1)
    return None


def read_yaml(path: str | Path, *, what: str) -> dict[str, Any]:
    path = Path(path)
    if not path.exists():
        raise InputError(str(path), None, f"no such {what} file", "check the path")
    text = read_input_text(path, fix=f"give a {what} YAML file")
    line = _too_deep(text)
    if line is not None:
        raise InputError(str(path), f"line {line}", f"nested too deeply to be a {what} file (more than "
                         f"{MAX_FLOW_DEPTH} levels of [ ] or {{ }})", f"give a {what} YAML file")
    try:
        data = yaml.load(text, Loader=_Loader)
    except RecursionError:
        raise InputError(str(path), None, f"nested too deeply to be a {what} file", f"give a {what} YAML file") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else None
        if isinstance(exc, _Refused):
            raise InputError(str(path), where, exc.problem, exc.fix) from None
        raise InputError(str(path), where, "not valid YAML", "fix the YAML syntax") from None
    if not isinstance(data, dict):
        raise InputError(str(path), None, f"a {what} file must be a YAML mapping", "see docs/FORMATS.md")
    return data


def read_yaml_value(text: str) -> Any:
    """One YAML value (a command-line ``key=value``'s), read as the files are: YAML 1.2's
    floats (``5e-1`` is a number), no key twice, aliases bounded, nesting bounded. Raises
    ``yaml.YAMLError``."""
    if _too_deep(text) is not None:
        raise yaml.YAMLError(f"nested more than {MAX_FLOW_DEPTH} levels deep")
    try:
        return yaml.load(text, Loader=_Loader)
    except RecursionError:
        raise yaml.YAMLError("nested too deeply") from None


class _Dumper(yaml.SafeDumper):
    """Block style for mappings, but short lists of scalars stay on one line."""


def _represent_list(dumper: yaml.SafeDumper, data: list) -> Any:
    flow = len(data) <= 8 and all(isinstance(x, (int, float, str)) for x in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_Dumper.add_representer(list, _represent_list)


def write_yaml(path: str | Path, data: dict[str, Any]) -> None:
    write_text(path, yaml.dump(data, Dumper=_Dumper, sort_keys=False, width=120))


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(read_input_bytes(path, fix="give the profile file")).hexdigest()


class Fields:
    """Typed access to one mapping of a file, raising :class:`InputError` with the field path."""

    def __init__(self, data: Any, *, file: str, prefix: str):
        if not isinstance(data, dict):
            raise InputError(file, prefix or None, "must be a mapping", "see docs/FORMATS.md")
        self.data = data
        self.file = file
        self.prefix = prefix

    @classmethod
    def document(cls, data: Any, *, file: str, format: str, fields: Iterable[str], fix: str) -> "Fields":
        """A whole file of one of FORMATS.md's formats: its ``format`` must be ``format`` (else the
        error says ``fix``), and no top-level key may be a near miss of one of ``fields``."""
        top = cls(data, file=file, prefix="")
        found = top.str("format")
        if found != format:
            raise InputError(file, "format", f"is {found!r}, expected {format!r}", fix)
        top.no_misspelling(fields)
        return top

    def _name(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def _error(self, key: str, problem: str, fix: str) -> InputError:
        return InputError(self.file, self._name(key), problem, fix)

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def only(self, known: Iterable[str]) -> None:
        """Refuse a key outside ``known``: a misspelt field would otherwise be dropped and its
        default used, changing what the file says without a word."""
        known = list(known)
        for key in self.data:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                fix = f"did you mean {close[0]}?" if close else f"use only {', '.join(known)}"
                raise self._error(str(key), "is not a field here", fix)

    def no_misspelling(self, known: Iterable[str]) -> None:
        """Refuse a key that is not in ``known`` but nearly is (``backwrd_ms``, ``w_saved_byte``,
        ``microbatch-size``), where other keys are extensions FORMATS.md lets a file carry: only a
        near miss is surely a misspelt field, which would be dropped for its default."""
        known = list(known)
        for key in self.data:
            if key in known:
                continue
            spelt = str(key).lower().replace("-", "_").replace(" ", "_")
            # 0.85: one or two letters off a name; an extension like cost_model (0.67 to model) passes
            close = difflib.get_close_matches(spelt, known, n=1, cutoff=0.85)
            if close:
                raise self._error(str(key), "is not a field here", f"did you mean {close[0]}?")

    def raw(self, key: str, default: Any = ..., ) -> Any:
        if key not in self.data or self.data[key] is None:
            if default is ...:
                raise self._error(key, "is missing", "add it (see docs/FORMATS.md)")
            return default
        return self.data[key]

    def str(self, key: str, default: Any = ...) -> str:
        value = self.raw(key, default)
        if value is not None and not isinstance(value, str):
            raise self._error(key, f"must be text, got {shown(value)}", "quote it")
        return value

    def number(self, key: str, default: Any = ..., *, minimum: float = 0.0, maximum: float = math.inf) -> float:
        value = self.raw(key, default)
        if value is None:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self._error(key, f"must be a number, got {shown(value)}", "write a number")
        if isinstance(value, float) and not math.isfinite(value):
            raise self._error(key, f"must be a finite number, got {shown(value)}", "write a number")
        # compared as written: an int of 400 digits has no float, and math.isfinite() of it
        # raises OverflowError
        if value < minimum:
            raise self._error(key, f"must be >= {minimum:g}, got {shown(value)}", f"use a value >= {minimum:g}")
        if value > maximum:
            raise self._error(key, f"must be <= {maximum:g}, got {shown(value)}", f"use a value <= {maximum:g}")
        if abs(value) > sys.float_info.max:  # only where no maximum holds it
            raise self._error(key, f"must be a finite number, got {shown(value)}", f"use a value <= {sys.float_info.max:.3g}")
        return float(value)

    def int(self, key: str, default: Any = ..., *, minimum: int = 0, maximum: int | None = None) -> int:
        value = self.raw(key, default)
        if value is None:
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                raise self._error(key, f"must be a whole number, got {shown(value)}", "write an integer")
        if value < minimum:
            raise self._error(key, f"must be >= {minimum}, got {value}", f"use a value >= {minimum}")
        if maximum is not None and value > maximum:
            # whole numbers as they are, where they are short enough to read
            got = str(value) if value < 10**15 else f"{value:.3g}" if value < 10**300 else shown(value)
            limit = str(maximum) if maximum < 10**15 else f"{maximum:.3g}"
            raise self._error(key, f"must be <= {limit}, got {got}", f"use a value <= {limit}")
        return value

    def bool(self, key: str, default: Any = ...) -> bool:
        value = self.raw(key, default)
        if not isinstance(value, bool):
            raise self._error(key, f"must be true or false, got {shown(value)}", "write true or false")
        return value

    def mapping(self, key: str, default: Any = ...) -> "Fields":
        value = self.raw(key, default)
        return Fields(value if value is not None else {}, file=self.file, prefix=self._name(key))

    def list(self, key: str) -> list:
        value = self.raw(key)
        if not isinstance(value, list):
            raise self._error(key, "must be a list", "write a YAML list")
        return value
