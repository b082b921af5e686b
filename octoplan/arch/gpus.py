"""Datasheet numbers of the GPUs the analytic profiler knows, plus the efficiency factors the
cost model applies to them.

Assumptions: dense (not 2:4-sparse) bf16 tensor-core peaks, SXM parts, 8 GPUs per node joined
by NVLink, one InfiniBand NIC per GPU. Bandwidths are GB/s = 1e9 bytes/s; NVLink figures are
per direction (half the datasheet's bidirectional total). The efficiency factors are not
datasheet values: they are this project's calibration, justified in docs/COST_MODEL.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["GpuSpec", "GPUS", "GPUS_PER_NODE"]

GPUS_PER_NODE = 8  # DGX/HGX A100, H100 and H200 nodes all hold 8 GPUs


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model: peaks from its datasheet and the fractions of them we expect to reach."""

    name: str
    description: str
    bf16_tflops: float  # dense tensor-core bf16 peak
    fp32_tflops: float  # non-tensor-core fp32 peak (the Mamba-1 selective scan runs here)
    hbm_gbps: float
    memory_gb: float
    nvlink_gbps: float  # per direction, per GPU
    network_gbps: float  # inter-node, per GPU (one NIC per GPU)
    matmul_efficiency: float  # fraction of bf16 peak a large GEMM reaches
    attention_fwd_efficiency: float  # fraction of bf16 peak of the flash-attention forward
    attention_bwd_efficiency: float  # ... and of its backward
    hbm_efficiency: float  # fraction of HBM bandwidth a streaming kernel reaches
    comm_efficiency: float  # fraction of link bandwidth NCCL collectives reach (bus bandwidth)
    source: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


GPUS: dict[str, GpuSpec] = {
    spec.name: spec
    for spec in (
        GpuSpec(
            name="a100",
            description="NVIDIA A100 SXM4 80GB (312 TFLOPs bf16, 2.0 TB/s HBM2e, NVLink3)",
            bf16_tflops=312.0,
            fp32_tflops=19.5,
            hbm_gbps=2039.0,
            memory_gb=80.0,
            nvlink_gbps=300.0,
            network_gbps=25.0,  # DGX A100: 8x 200 Gb/s HDR InfiniBand
            matmul_efficiency=0.80,
            attention_fwd_efficiency=0.60,
            attention_bwd_efficiency=0.50,
            hbm_efficiency=0.85,
            comm_efficiency=0.80,
            source="NVIDIA A100 Tensor Core GPU datasheet; NVIDIA DGX A100 datasheet",
        ),
        GpuSpec(
            name="h100",
            description="NVIDIA H100 SXM5 80GB (989 TFLOPs bf16, 3.35 TB/s HBM3, NVLink4)",
            bf16_tflops=989.0,
            fp32_tflops=67.0,
            hbm_gbps=3350.0,
            memory_gb=80.0,
            nvlink_gbps=450.0,
            network_gbps=50.0,  # DGX H100: 8x 400 Gb/s ConnectX-7
            matmul_efficiency=0.72,
            attention_fwd_efficiency=0.65,
            attention_bwd_efficiency=0.50,
            hbm_efficiency=0.85,
            comm_efficiency=0.80,
            source="NVIDIA H100 Tensor Core GPU datasheet; NVIDIA DGX H100 datasheet",
        ),
        GpuSpec(
            name="h200",
            description="NVIDIA H200 SXM 141GB (989 TFLOPs bf16, 4.8 TB/s HBM3e, NVLink4)",
            bf16_tflops=989.0,
            fp32_tflops=67.0,
            hbm_gbps=4800.0,
            memory_gb=141.0,
            nvlink_gbps=450.0,
            network_gbps=50.0,  # HGX H200 reference nodes: 8x 400 Gb/s
            matmul_efficiency=0.72,
            attention_fwd_efficiency=0.65,
            attention_bwd_efficiency=0.50,
            hbm_efficiency=0.85,
            comm_efficiency=0.80,
            source="NVIDIA H200 Tensor Core GPU datasheet",
        ),
    )
}
