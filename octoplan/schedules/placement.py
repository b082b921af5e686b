"""Stage -> rank maps of the known schedules."""

from __future__ import annotations

__all__ = ["loop_placement", "v_placement"]


def loop_placement(pp: int, num_stages: int) -> list[int]:
    """Stage s on rank s mod pp: one stage per rank, or Megatron's interleaved chunks."""
    return [s % pp for s in range(num_stages)]


def v_placement(pp: int, num_stages: int) -> list[int]:
    """Down the ranks and back up: rank r holds stages r and 2*pp-1-r (ZB-V, DualPipeV)."""
    if num_stages != 2 * pp:
        raise ValueError(f"a V placement needs 2*pp stages, got {num_stages} for pp={pp}")
    return [s if s < pp else 2 * pp - 1 - s for s in range(num_stages)]
