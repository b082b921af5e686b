"""The analytic cost model: time, FLOPs and memory of one layer's F, I and W on one GPU.

Every formula here is written out, with its source, in docs/COST_MODEL.md. In short:

* a matmul of m x k by k x n costs 2mnk FLOPs and lasts
  ``max(flops / (peak * eff(m, n, k)), bytes / hbm)`` with ``eff = matmul_efficiency *
  d / (d + 64)``, d the smallest of m, n, k (small matmuls fill the GPU badly);
  its dX (I) and dW (W) matmuls cost the same again, each;
* flash attention costs ``2 * pairs * (d_qk + d_v)`` FLOPs per head forward and 2.5 times
  that backward (all in I), at the GPU's attention efficiency;
* norms, activations, residual adds, rotary, the conv and the scans' state traffic are
  memory-bound: bytes read + written at ``hbm_gbps * hbm_efficiency``; their backward moves
  twice the bytes and is counted in I;
* tensor parallelism with sequence parallelism (Megatron-LM): column- or row-split weights,
  one all-reduce-sized collective per mixer and per feed-forward in F and again in I;
* expert parallelism: a dispatch and a combine all-to-all in F and again in I.

Assumptions: bf16 weights and activations, no activation recomputation, no overlap of
communication with compute, perfectly balanced expert routing.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from octoplan.arch.gpus import GPUS_PER_NODE, GpuSpec

__all__ = ["ASSUMPTIONS", "CostModel", "LayerCost", "LayerAccount", "attention_pairs", "inter_node"]

BYTES = 2  # bf16
SMALL_DIM_HALF = 64  # a matmul whose smallest dimension is 64 runs at half the large-GEMM efficiency
FA_BACKWARD_FLOPS = 2.5  # flash-attention backward: 5 matmuls against the forward's 2
ELEMENTWISE_BACKWARD_BYTES = 2.0  # backward of a memory-bound op reads grad + saved input, writes grad
SSD_EFFICIENCY = 0.30  # Mamba-2 chunked scan (Triton kernels) as a fraction of bf16 peak
SELECTIVE_SCAN_EFFICIENCY = 0.50  # Mamba-1 scan as a fraction of fp32 CUDA-core peak
SELECTIVE_SCAN_FLOPS = 9  # per (channel, state) element and token: exp, 4 mul, 2 fma (own count)
COLLECTIVE_LATENCY_US = 10.0  # fixed cost of one NCCL collective

ASSUMPTIONS: dict[str, Any] = {
    "dtype_bytes": BYTES,
    "small_matmul_half_dim": SMALL_DIM_HALF,
    "flash_attention_backward_flop_factor": FA_BACKWARD_FLOPS,
    "elementwise_backward_byte_factor": ELEMENTWISE_BACKWARD_BYTES,
    "mamba2_scan_efficiency": SSD_EFFICIENCY,
    "mamba1_scan_fp32_efficiency": SELECTIVE_SCAN_EFFICIENCY,
    "mamba1_scan_flops_per_element": SELECTIVE_SCAN_FLOPS,
    "collective_latency_us": COLLECTIVE_LATENCY_US,
    "tensor_parallel": "Megatron-LM with sequence parallelism; one all-reduce-sized collective per mixer and per feed-forward, in F and in I",
    "activation_recomputation": "none; flash attention keeps no score matrix",
    "expert_routing": "perfectly balanced",
    "comm_compute_overlap": "none",
    "doc": "docs/COST_MODEL.md",
}


def attention_pairs(seq: int, *, causal: bool, window: int | None) -> int:
    """(query, key) pairs one sequence's attention computes.

    Causal: query i sees keys max(0, i - window + 1)..i; bidirectional: every key (a window
    then limits both sides, which no model here uses).
    """
    if not causal:
        return seq * seq
    if window is None or window >= seq:
        return seq * (seq + 1) // 2
    return window * (window + 1) // 2 + (seq - window) * window


@dataclass(frozen=True)
class CostModel:
    """One GPU and one tensor-parallel degree: turns FLOPs and bytes into milliseconds."""

    gpu: GpuSpec
    tp: int = 1

    def matmul_ms(self, m: float, n: float, k: float, *, count: int = 1) -> float:
        if m <= 0 or n <= 0 or k <= 0:
            return 0.0
        smallest = min(m, n, k)
        eff = self.gpu.matmul_efficiency * smallest / (smallest + SMALL_DIM_HALF)
        compute_s = 2.0 * m * n * k / (self.gpu.bf16_tflops * 1e12 * eff)
        memory_s = BYTES * (m * k + k * n + m * n) / (self.gpu.hbm_gbps * 1e9 * self.gpu.hbm_efficiency)
        return count * max(compute_s, memory_s) * 1e3

    def memory_ms(self, num_bytes: float) -> float:
        return num_bytes / (self.gpu.hbm_gbps * 1e9 * self.gpu.hbm_efficiency) * 1e3

    def tensor_ms(self, flops: float, efficiency: float) -> float:
        return flops / (self.gpu.bf16_tflops * 1e12 * efficiency) * 1e3

    def fp32_ms(self, flops: float, efficiency: float) -> float:
        return flops / (self.gpu.fp32_tflops * 1e12 * efficiency) * 1e3

    def tp_collective_ms(self, num_bytes: float) -> float:
        """A ring all-reduce (or all-gather + reduce-scatter) of ``num_bytes`` over the tp group."""
        if self.tp == 1:
            return 0.0
        wire = 2.0 * (self.tp - 1) / self.tp * num_bytes
        return COLLECTIVE_LATENCY_US / 1e3 + wire / (self.gpu.nvlink_gbps * 1e9 * self.gpu.comm_efficiency) * 1e3

    def all_to_all_ms(self, num_bytes: float, *, inter_node: bool) -> float:
        """``num_bytes`` leaving each GPU in one all-to-all, over NVLink or the per-GPU NIC."""
        gbps = self.gpu.network_gbps if inter_node else self.gpu.nvlink_gbps
        return COLLECTIVE_LATENCY_US / 1e3 + num_bytes / (gbps * 1e9 * self.gpu.comm_efficiency) * 1e3


@dataclass(frozen=True)
class LayerCost:
    forward_ms: float
    backward_input_ms: float
    backward_weight_ms: float
    params: int  # held by one GPU (all experts: expert parallelism not applied, see remote_expert_params)
    remote_expert_params: int
    activation_bytes: int
    pending_w_bytes: int  # what a split backward's I keeps for its W (the matmuls' output gradients)
    w_saved_bytes: int  # of activation_bytes, what W reads (the matmuls' and norms' inputs), held from I to W
    flops: float  # forward, one GPU
    breakdown: dict[str, dict[str, float]] = field(default_factory=dict)  # F/I/W -> category -> ms


class LayerAccount:
    """Accumulates the costs of one layer, op by op, under one :class:`CostModel`.

    Per-token byte counts passed in are for the whole (unsplit) layer; under tensor parallelism
    with sequence parallelism each GPU holds 1/tp of every activation, so they are divided here.
    """

    def __init__(self, model: CostModel):
        self.model = model
        self.tp = model.tp
        self._ms: dict[str, dict[str, float]] = {"F": defaultdict(float), "I": defaultdict(float), "W": defaultdict(float)}
        self.params = 0
        self.remote_expert_params = 0  # experts counted in params that expert parallelism puts elsewhere
        self.flops = 0.0
        self.saved = 0.0
        self.pending_w = 0.0  # output gradients of the matmuls, kept from I for W
        self.w_saved = 0.0  # saved inputs of the matmuls and norms, which W reads

    def linear(
        self,
        tokens: float,
        n_in: int,
        n_out: int,
        *,
        split: str | None,
        bias: bool = False,
        count: int = 1,
        input_grad: bool = True,
        shared_input: bool = False,
    ) -> None:
        """``count`` matmuls (tokens x n_in) @ (n_in x n_out): F, dX in I, dW in W.

        input_grad=False skips dX, for a first layer whose input (pixels) needs no gradient.
        shared_input=True: the input is an earlier call's, saved once (two projections of one
        normalized input).

        split: "col" divides n_out by tp, "row" divides n_in, "seq" divides the tokens (weights
        replicated, input sequence-sharded), None runs replicated on every GPU.
        """
        m, k, n = tokens, n_in, n_out
        if split == "col":
            n = n_out // self.tp
        elif split == "row":
            k = n_in // self.tp
        elif split == "seq":
            m = tokens / self.tp
        elif split is not None:
            raise ValueError(f"unknown split {split!r}")
        weights = count * (k * n if split in ("col", "row") else n_in * n_out)
        biases = count * (n if split == "col" else n_out) if bias else 0
        self.params += weights + biases
        ms = self.model.matmul_ms(m, n, k, count=count)
        self._ms["F"]["matmul"] += ms
        if input_grad:
            self._ms["I"]["matmul"] += ms
        self._ms["W"]["matmul"] += ms
        self.flops += 2.0 * m * n * k * count
        # W computes dW = X^T dY from this output gradient, which a split backward keeps from
        # I to W; a row-parallel matmul's is the whole output's (gathered in the backward)
        self.pending_w += BYTES * m * (n if split == "col" else n_out) * count
        # ... and the input X, saved by F (sequence-sharded under tp for col/row splits: what
        # Megatron-LM saves, gathering it again for W)
        if not shared_input:
            self.w_saved += BYTES * count * (m * n_in / self.tp if split in ("col", "row") else m * n_in)

    def weights(self, count: int, *, split: bool = False) -> None:
        """Parameters outside matmuls (norm scales, conv filters, biases): no time of their own."""
        self.params += count // self.tp if split else count

    def attention(self, *, flops: float, io_bytes: float) -> None:
        """Flash attention core: ``flops`` forward, 2.5x backward (in I); q/k/v/o traffic as a floor."""
        gpu = self.model.gpu
        f_ms = max(self.model.tensor_ms(flops, gpu.attention_fwd_efficiency), self.model.memory_ms(io_bytes))
        i_ms = max(
            self.model.tensor_ms(FA_BACKWARD_FLOPS * flops, gpu.attention_bwd_efficiency),
            self.model.memory_ms(2.0 * io_bytes),
        )
        self._ms["F"]["attention"] += f_ms
        self._ms["I"]["attention"] += i_ms
        self.flops += flops

    def scan(self, *, tensor_flops: float = 0.0, fp32_flops: float = 0.0, io_bytes: float) -> None:
        """A state-space scan: roofline of its tensor-core or CUDA-core FLOPs and its HBM traffic."""
        compute = self.model.tensor_ms(tensor_flops, SSD_EFFICIENCY) + self.model.fp32_ms(fp32_flops, SELECTIVE_SCAN_EFFICIENCY)
        memory = self.model.memory_ms(io_bytes)
        self._ms["F"]["scan"] += max(compute, memory)
        self._ms["I"]["scan"] += 2.0 * max(compute, memory)
        self.flops += tensor_flops + fp32_flops

    def elementwise(self, num_bytes: float, *, sharded: bool = True, backward: bool = True) -> None:
        """Memory-bound ops moving ``num_bytes`` (whole layer) forward; backward moves twice as much."""
        share = num_bytes / self.tp if sharded else num_bytes
        ms = self.model.memory_ms(share)
        self._ms["F"]["memory"] += ms
        if backward:
            self._ms["I"]["memory"] += ELEMENTWISE_BACKWARD_BYTES * ms

    def weight_grad_memory(self, num_bytes: float) -> None:
        """Memory-bound weight-gradient work (the embedding's scatter-add) in W."""
        self._ms["W"]["memory"] += self.model.memory_ms(num_bytes)

    def tp_collective(self, num_bytes: float, *, forward: bool = True, backward: bool = True) -> None:
        """One tensor-parallel collective of the full activation ``num_bytes`` in F and/or I."""
        ms = self.model.tp_collective_ms(num_bytes)
        if forward:
            self._ms["F"]["tp_comm"] += ms
        if backward:
            self._ms["I"]["tp_comm"] += ms

    def expert_all_to_all(self, num_bytes: float, *, inter_node: bool) -> None:
        """Dispatch + combine of ``num_bytes`` leaving this GPU each, in F and again in I."""
        ms = 2.0 * self.model.all_to_all_ms(num_bytes, inter_node=inter_node)
        self._ms["F"]["ep_comm"] += ms
        self._ms["I"]["ep_comm"] += ms

    def save(self, num_bytes: float, *, sharded: bool = True) -> None:
        """Bytes F keeps for the backward (whole layer)."""
        self.saved += num_bytes / self.tp if sharded else num_bytes

    def w_reads(self, num_bytes: float, *, sharded: bool = True) -> None:
        """Saved bytes (whole layer) W reads besides the matmul inputs: a norm's input for its
        scale's gradient, the token ids for the embedding's."""
        self.w_saved += num_bytes / self.tp if sharded else num_bytes

    def keep_for_w(self, num_bytes: float) -> None:
        """Gradient bytes (whole layer) a split backward's I keeps for W outside a matmul."""
        self.pending_w += num_bytes / self.tp

    def result(self) -> LayerCost:
        total = {phase: float(sum(parts.values())) for phase, parts in self._ms.items()}
        breakdown = {phase: {k: round(v, 6) for k, v in sorted(parts.items())} for phase, parts in self._ms.items()}
        return LayerCost(
            forward_ms=total["F"],
            backward_input_ms=total["I"],
            backward_weight_ms=total["W"],
            params=int(self.params),
            remote_expert_params=int(self.remote_expert_params),
            activation_bytes=int(round(self.saved)),
            pending_w_bytes=int(round(self.pending_w)),
            # at most what F saved: where a call's accounting lumps tensors W reads with others
            w_saved_bytes=int(round(min(self.w_saved, self.saved))),
            flops=self.flops,
            breakdown=breakdown,
        )


def inter_node(ep: int) -> bool:
    """An expert-parallel group larger than one node crosses the network."""
    return ep > GPUS_PER_NODE
