"""GPipe: every forward, then every backward (Huang et al., 2019)."""

from __future__ import annotations

from octoplan.ops import Kind, Op

__all__ = ["generate"]


def generate(pp: int, microbatches: int) -> list[list[Op]]:
    return [
        [Op(r, Kind.F, m) for m in range(microbatches)] + [Op(r, Kind.B, m) for m in range(microbatches)]
        for r in range(pp)
    ]
