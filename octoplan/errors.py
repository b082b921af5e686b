"""The one error type for bad input.

Every command turns an :class:`InputError` into exit status 2 and a single line on stderr
that names the file, the field and the fix (FORMATS.md section 5). Library code raises it; only the
CLI prints it.
"""

from __future__ import annotations

import os
import reprlib
import sysconfig
from pathlib import Path
from typing import Any

__all__ = ["MODEL_CODE_FAILURES", "InputError", "shown", "where_raised"]

# What a model file's code may raise that is its own failure, to be reported as one: any
# Exception, and an exit (sys.exit, exit(), argparse's error, GeneratorExit), which would
# otherwise end the command silently with the model's own status. Ctrl-C is not among them.
MODEL_CODE_FAILURES = (Exception, SystemExit, GeneratorExit)


# Code that is not the user's: where an exception passed through only these, no line of the
# user's is named: octoplan and octorun, the stdlib, and torch and the other installed packages
# (in a site-packages or dist-packages folder, wherever the venv, the system or the user's site
# keeps one)
_NOT_USERS = tuple(str(Path(p).resolve()) + os.sep for p in {
    str(Path(__file__).resolve().parents[1] / "octoplan"), str(Path(__file__).resolve().parents[1] / "octorun"),
    *(sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib")),
})
_PACKAGE_FOLDERS = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")
_WHERE_CHARS = 300  # a path longer than this is cut in its middle: the line stays readable


def where_raised(exc: BaseException) -> str:
    """`` (at FILE:LINE in FUNCTION)``: the last line of the user's code (a model file, or a
    module of theirs it imports) that an exception passed through, so a one-line error still
    says where a model's bug is; empty where none of its frames is the user's. One line, always
    (a path's line breaks escaped), and never an error of its own."""
    try:
        found = None
        tb = exc.__traceback__
        while tb is not None:
            code = tb.tb_frame.f_code
            path = str(Path(code.co_filename).resolve()) if not code.co_filename.startswith("<") else None
            if path is not None and not path.startswith(_NOT_USERS) and not any(p in path for p in _PACKAGE_FOLDERS):
                found = (path, tb.tb_lineno, code.co_name)
            tb = tb.tb_next
        if found is None:
            return ""
        path, line, function = found
        shown_path = os.path.relpath(path)  # getcwd(): fails where the working folder is gone
        if shown_path.startswith(".."):
            shown_path = path
    except (OSError, ValueError, RuntimeError):
        return ""
    return f" (at {_clipped(shown_path, _WHERE_CHARS)}:{line} in {function})".translate(_LINE_BREAKS)


# A part of the line longer than this is cut in its middle: a bad value echoed back may be a
# whole file's worth (a 50 MB line of YAML), and the line must stay one that can be read. Far
# above what octoplan's own texts need (a deadlock's waits on 16 ranks: about 700 characters).
_PART_CHARS = 4000


def _clipped(part, chars: int = _PART_CHARS):
    if not isinstance(part, str) or len(part) <= chars:
        return part
    half = chars // 2
    return f"{part[:half]}...[{len(part) - 2 * half} characters]...{part[-half:]}"


# Every character that ends a line for str.splitlines() (and for a terminal or a log reader),
# written as its escape instead: a message a model file raised, or a file name, may hold one,
# and the error must stay one line. With them, the other control characters (a NUL, an escape
# sequence that would drive the terminal) and the bidirectional overrides that show text in
# another order than it has: the line must read as what it says. Tabs stay.
_LINE_BREAKS = {ord(c): c.encode("unicode_escape").decode("ascii")
                for c in ("\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
                          + "".join(map(chr, [*range(0x00, 0x09), *range(0x0e, 0x1c), 0x1f, *range(0x7f, 0xa0)]))
                          + "\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")}


def one_line(text: str) -> str:
    """``text`` with every line break written as its escape: for a line that must stay one, such
    as a comment in a generated file that quotes a file name. A byte of a file name that is not
    UTF-8 (Python's lone surrogate for it) is written as its escape too: a file cannot hold it."""
    return text.translate(_LINE_BREAKS).encode("utf-8", "backslashreplace").decode("utf-8")


# What a bad value echoed back may show of a structure: reprlib's cuts, so that the text is
# bounded before it is built. repr() of a list a few YAML aliases expand to 10**9 items would
# run for minutes (and take the memory) before _clipped could trim it.
class _Bounded(reprlib.Repr):
    def repr_int(self, x: int, level: int) -> str:
        # reprlib cuts repr(x), which raises beyond 4300 digits
        return f"<a {_digits(x)}-digit number>" if abs(x) >= 10**60 else super().repr_int(x, level)


_SHOWN = _Bounded()
_SHOWN.maxlevel = 2
_SHOWN.maxlist = _SHOWN.maxtuple = _SHOWN.maxset = _SHOWN.maxfrozenset = _SHOWN.maxdict = 6
_SHOWN.maxstring = 200  # inside a structure; a string alone is cut by _clipped, which counts what it drops
_SHOWN.maxlong = 60
_SHOWN.maxother = 200


def shown(value: Any) -> str:
    """``repr(value)`` for an error line, bounded whatever the value's size: a long string is
    cut in its middle, saying how much was left out, a structure after its first items."""
    if isinstance(value, str):
        if len(value) <= _PART_CHARS:
            return repr(value)
        half = _PART_CHARS // 2
        return f"{value[:half]!r}...[{len(value) - 2 * half} characters]...{value[-half:]!r}"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**60:
        return f"a {_digits(value)}-digit number"
    return _SHOWN.repr(value)


def _digits(value: int) -> int:
    """How many decimal digits ``value`` has, counted without str(), which raises beyond 4300
    digits (sys.get_int_max_str_digits)."""
    value = abs(value)
    count = max(1, int(value.bit_length() * 0.30102999566398))  # log10(2): at most one short
    while 10**count <= value:
        count += 1
    return count


class InputError(ValueError):
    """Bad input from a user: a file, a field in it, what is wrong and how to fix it."""

    def __init__(self, file: str | None, field: str | None, problem: str, fix: str | None = None):
        self.file = file
        self.field = field
        self.problem = problem
        self.fix = fix
        super().__init__(self.line())

    def line(self) -> str:
        file, field, problem, fix = (_clipped(part).translate(_LINE_BREAKS) if isinstance(part, str) else part
                                     for part in (self.file, self.field, self.problem, self.fix))
        where = ": ".join(part for part in (file, field) if part)
        text = f"{where}: {problem}" if where else problem
        if fix:
            text += f" ({fix})"
        return text

    def in_file(self, file: str) -> "InputError":
        """The same error, attributed to ``file`` when it had no file yet."""
        if self.file:
            return self
        return InputError(file, self.field, self.problem, self.fix)
