"""The one error type for bad input.

Every command turns an :class:`InputError` into exit status 2 and a single line on stderr
that names the file, the field and the fix (SPEC section 5). Library code raises it; only the
CLI prints it.
"""

from __future__ import annotations

__all__ = ["InputError"]


# A part of the line longer than this is cut in its middle: a bad value echoed back may be a
# whole file's worth (a 50 MB line of YAML), and the line must stay one that can be read. Far
# above what octoplan's own texts need (a deadlock's waits on 16 ranks: about 700 characters).
_PART_CHARS = 4000


def _clipped(part):
    if not isinstance(part, str) or len(part) <= _PART_CHARS:
        return part
    half = _PART_CHARS // 2
    return f"{part[:half]}...[{len(part) - 2 * half} characters]...{part[-half:]}"


class InputError(ValueError):
    """Bad input from a user: a file, a field in it, what is wrong and how to fix it."""

    def __init__(self, file: str | None, field: str | None, problem: str, fix: str | None = None):
        self.file = file
        self.field = field
        self.problem = problem
        self.fix = fix
        super().__init__(self.line())

    def line(self) -> str:
        file, field, problem, fix = (_clipped(part) for part in (self.file, self.field, self.problem, self.fix))
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
