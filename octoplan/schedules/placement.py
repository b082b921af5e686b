"""Stage -> rank maps of the known schedules."""

from __future__ import annotations

__all__ = ["loop_placement", "v_placement", "framework_placement"]


def loop_placement(pp: int, num_stages: int) -> list[int]:
    """Stage s on rank s mod pp: one stage per rank, or Megatron's interleaved chunks."""
    return [s % pp for s in range(num_stages)]


def v_placement(pp: int, num_stages: int) -> list[int]:
    """Down the ranks and back up: rank r holds stages r and 2*pp-1-r (ZB-V, DualPipeV)."""
    if num_stages != 2 * pp:
        raise ValueError(f"a V placement needs 2*pp stages, got {num_stages} for pp={pp}")
    return [s if s < pp else 2 * pp - 1 - s for s in range(num_stages)]


def framework_placement(pp: int, ranks: list[int] | tuple[int, ...]) -> str | None:
    """``"loop"`` or ``"v"``: the placement of stages on ranks ``ranks`` (stage s on ranks[s]) that
    Megatron-LM and torchtitan build, or None. With pp 1 they build no pipeline at all, so only a
    single stage is theirs: a rank of several stages (virtual stages) needs pp 2 or more
    (Megatron-LM: "pipeline-model-parallel size should be greater than 1 with interleaved
    schedule"; torchtitan: a degree of 1 turns pipelining off)."""
    count = len(ranks)
    if pp == 1:
        return "loop" if count == 1 else None
    if count % pp == 0 and list(ranks) == loop_placement(pp, count):
        return "loop"
    if count == 2 * pp and list(ranks) == v_placement(pp, count):
        return "v"
    return None
