"""The one op representation: ``<stage><TYPE><mb>`` (FORMATS.md section 1).

An op is plain data — stage, kind, microbatch — with a string form that round-trips. Every
part of OctoPipe (generators, validator, simulator, tuner, exporter, runtime) reads the same
per-rank lists of :class:`Op`.
"""

from __future__ import annotations

import re
from enum import Enum
from typing import Iterable, NamedTuple

__all__ = ["Kind", "Op", "parse_op", "parse_ops", "format_ops", "splits_backward", "F", "I", "W", "B"]


class Kind(str, Enum):
    F = "F"  # forward (the last stage's forward includes the loss)
    I = "I"  # backward to the stage input (activation gradient)
    W = "W"  # backward to the stage weights
    B = "B"  # full backward: I and W fused

    # Enum's own __hash__ is Python code; ops are hashed in the simulator's and tuner's hot
    # loops, so hash as the plain one-letter string (consistent with str equality).
    __hash__ = str.__hash__


F, I, W, B = Kind.F, Kind.I, Kind.W, Kind.B

# ASCII digits without leading zeros: one spelling per op, so plans compare and diff as text
_NUMBER = "(0|[1-9][0-9]*)"
_OP_RE = re.compile(rf"^{_NUMBER}([FIWB]){_NUMBER}$")


class Op(NamedTuple):
    """One compute op. A NamedTuple: hashable, cheap, and ordered by (stage, kind, mb)."""

    stage: int
    kind: Kind
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.mb}"

    @property
    def is_backward(self) -> bool:
        return self.kind is not Kind.F


def parse_op(text: str) -> Op:
    """Parse ``"3I12"`` into ``Op(3, Kind.I, 12)``; ``ValueError`` names the bad string."""
    match = _OP_RE.match(text.strip())
    if not match:
        raise ValueError(
            f"unknown op {text!r}; an op is <stage><F|I|W|B><microbatch>, e.g. 0F0, 3I12"
        )
    return Op(int(match.group(1)), Kind(match.group(2)), int(match.group(3)))


def parse_ops(text: str) -> list[Op]:
    """Parse a space-separated op list, as a plan's schedule holds it."""
    return [parse_op(token) for token in text.split()]


def format_ops(ops: Iterable[Op]) -> str:
    return " ".join(str(op) for op in ops)


def splits_backward(schedule: Iterable[Iterable[Op]]) -> bool:
    """Whether an order runs any backward as separate I and W ops (else every backward is a B)."""
    return any(op.kind in (Kind.I, Kind.W) for ops in schedule for op in ops)
