"""The one error type for bad input.

Every command turns an :class:`InputError` into exit status 2 and a single line on stderr
that names the file, the field and the fix (SPEC section 5). Library code raises it; only the
CLI prints it.
"""

from __future__ import annotations

__all__ = ["InputError"]


class InputError(ValueError):
    """Bad input from a user: a file, a field in it, what is wrong and how to fix it."""

    def __init__(self, file: str | None, field: str | None, problem: str, fix: str | None = None):
        self.file = file
        self.field = field
        self.problem = problem
        self.fix = fix
        super().__init__(self.line())

    def line(self) -> str:
        where = ": ".join(part for part in (self.file, self.field) if part)
        text = f"{where}: {self.problem}" if where else self.problem
        if self.fix:
            text += f" ({self.fix})"
        return text

    def in_file(self, file: str) -> "InputError":
        """The same error, attributed to ``file`` when it had no file yet."""
        if self.file:
            return self
        return InputError(file, self.field, self.problem, self.fix)
