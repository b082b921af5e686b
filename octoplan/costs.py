"""How long things take: the one place that turns a profile and a cluster into op and
transfer durations (FORMATS.md section 7's cost semantics).

Stage costs are sums of layer costs, computed from prefix sums so that the tuner can price
any layer range in O(1). The integer scaling CP-SAT needs lives in :func:`to_ticks`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import accumulate
from typing import Sequence

from octoplan.ops import Kind
from octoplan.plan import Cluster, Parallel, Plan, Stage
from octoplan.profile import Profile

__all__ = [
    "LayerTable",
    "StageCost",
    "transfer_ms",
    "allreduce_ms",
    "tied_allreduce_ms",
    "link_gbps",
    "stage_costs",
    "op_ms",
    "lower_bound_ms",
    "to_ticks",
    "TICKS_PER_MS",
    "cheaper_backward",
]

TICKS_PER_MS = 1000  # CP-SAT works in integers: one tick is a microsecond


@dataclass(frozen=True)
class StageCost:
    """What one stage's ops cost: their times, and the bytes a microbatch holds.

    Memory (:mod:`octoplan.memory`): F keeps ``activation_bytes`` until the backward. A B frees
    them. An I frees all but ``w_held_bytes`` and adds ``pending_w_bytes``, both held until its
    W; walking the layers from the last, it frees each layer's share as it goes, so while it runs
    it holds at most ``i_peak_bytes`` more than at its start.

    With activation recomputation (``Stage.recompute``) the figures are the recomputed stage's:
    F keeps only the stage's input (``activation_bytes``, from the end of F to the end of the
    backward), and the first backward op, I or B, runs the forward again before its own work
    (``backward_input_ms`` and ``backward_ms`` include ``forward_ms``). The re-run forward
    rebuilds the rest of the activations (``recompute_bytes``), after which the op goes on as
    without recomputation: a B holds them only while it runs, an I as above (its
    ``i_peak_bytes`` counts from the rebuilt state). Where only the stage's first k layers
    recompute (``Stage.recompute_layers``), F also keeps the activations of the layers after
    them, and the backward runs again only those k layers' forward and rebuilds only their
    activations. Every user of these costs prices recomputation that way without knowing of it.
    """

    forward_ms: float
    backward_input_ms: float
    backward_weight_ms: float
    param_bytes: int
    activation_bytes: int
    output_bytes: int  # sent forward; the gradient sent back has the same size
    backward_ms: float | None = None  # the fused backward, where the profile measured it
    recompute_bytes: int = 0  # 0 without recomputation
    pending_w_bytes: int = 0  # what an I keeps for its W besides the activations (its layers')
    w_held_bytes: int = 0  # of the (rebuilt) activations, what an I keeps for its W
    i_peak_bytes: int = 0  # the most an I holds above its (rebuilt) start while it runs
    buffer_bytes: int = 0  # its layers' buffers: held, never trained

    @property
    def b_ms(self) -> float:
        """A B op's time: the measured fused backward, else I + W (docs/FORMATS.md section 2)."""
        if self.backward_ms is None:
            return self.backward_input_ms + self.backward_weight_ms
        return self.backward_ms

    @property
    def total_ms(self) -> float:
        return self.forward_ms + self.backward_input_ms + self.backward_weight_ms

    @property
    def i_delta_bytes(self) -> int:
        """What an I leaves held, less what it found: its W's share minus what F kept."""
        return self.w_held_bytes + self.pending_w_bytes - self.activation_bytes


class LayerTable:
    """Prefix sums over a profile's layers: the cost of any layer range in O(1)."""

    def __init__(self, profile: Profile):
        layers = profile.layers
        self.num_layers = len(layers)
        self._f = [0.0, *accumulate(layer.forward_ms for layer in layers)]
        self._i = [0.0, *accumulate(layer.backward_input_ms for layer in layers)]
        self._w = [0.0, *accumulate(layer.backward_weight_ms for layer in layers)]
        # Layers without a measured fused backward count I + W in it.
        self._b = [0.0, *accumulate(layer.b_ms for layer in layers)] if profile.measures_fused_backward else None
        self._param = [0, *accumulate(layer.param_bytes for layer in layers)]
        self._buffers = [0, *accumulate(layer.buffer_bytes for layer in layers)]
        self._act = [0, *accumulate(layer.activation_bytes for layer in layers)]
        self._pending_w = [0, *accumulate(layer.pending_w_bytes for layer in layers)]
        self._layers = layers
        self.output_bytes = [layer.output_bytes for layer in layers]
        self.layer_total_ms = [layer.total_ms for layer in layers]

    def _split_backward(self, start: int, end: int, seam: int | None) -> tuple[int, int]:
        """(what an I of layers [start, end) leaves for its W besides the captured gradients,
        the most it holds above its start while it runs), as octorun's I does it: it takes the
        layers from the last, and at each first holds the gradients it captures, then lets go
        of all the layer's share W will not read.

        The tensor between two layers of the stage is one storage: the later layer's figures
        hold it as its input; where the earlier layer holds it too (its ``output_saved_bytes``)
        and the later one lets go of it at its I, it lives until the earlier layer's step, or
        its W. The stage's last layer's own outputs, and those of ``seam`` (the last layer a
        partial recomputation rebuilds, whose rebuilt output is a new tensor), no later layer
        holds."""
        layers = self._layers
        freed = {j: layers[j].activation_bytes - layers[j].held_for_w_bytes for j in range(start, end)}
        kept = sum(layers[j].held_for_w_bytes for j in range(start, end))
        for j in range(start, end):
            layer = layers[j]
            if j == end - 1 or j == seam:
                freed[j] += layer.output_saved_bytes - layer.output_w_bytes
                kept += layer.output_w_bytes
                continue
            overlap = min(layer.output_saved_bytes, layers[j + 1].input_freed_bytes)
            stays = min(layer.output_w_bytes, overlap)
            freed[j + 1] -= overlap
            freed[j] += overlap - stays
            kept += stays
        peak, change = 0, 0
        for j in range(end - 1, start - 1, -1):
            pending = layers[j].pending_w_bytes
            peak = max(peak, change + pending)
            change += pending - freed[j]
        return kept, peak

    def stage(self, start: int, end: int, *, recompute: bool = False, recompute_layers: int | None = None) -> StageCost:
        """Layers [start, end) as one stage; with ``recompute``, the first ``recompute_layers``
        of them (None: all) run their forward again in the first backward op."""
        forward_ms = self._f[end] - self._f[start]
        backward_ms = None if self._b is None else self._b[end] - self._b[start]
        # The layers' own figures hold their inputs, so the stage's input is in them; the
        # stage's output, once sent on, no tape holds (octorun keeps only its gradient edge)
        # unless its last layer holds it itself.
        tail = self._layers[end - 1].output_saved_bytes
        # the recomputed layers are [start, cut)
        cut = min(start + recompute_layers, end) if recompute and recompute_layers is not None else end
        w_held, i_peak = self._split_backward(start, end, seam=cut - 1 if cut < end else None)
        cost = StageCost(
            forward_ms=forward_ms,
            backward_input_ms=self._i[end] - self._i[start],
            backward_weight_ms=self._w[end] - self._w[start],
            param_bytes=self._param[end] - self._param[start],
            activation_bytes=self._act[end] - self._act[start] + tail,
            output_bytes=self.output_bytes[end - 1],
            backward_ms=backward_ms,
            pending_w_bytes=self._pending_w[end] - self._pending_w[start],
            w_held_bytes=w_held,
            i_peak_bytes=i_peak,
            buffer_bytes=self._buffers[end] - self._buffers[start],
        )
        if not recompute:
            return cost
        # The stage's input is the previous layer's output; the first stage's input, the
        # microbatch itself, is not in the profile and counts as nothing.
        stash = self.output_bytes[start - 1] if start > 0 else 0
        again_ms = self._f[cut] - self._f[start]  # the recomputed layers' forward
        # what they hold again, their input among it, and the last one's own outputs, new
        # tensors (F, without grad, kept none); the layers after them keep their tapes from F
        rebuilt = self._act[cut] - self._act[start] + self._layers[cut - 1].output_saved_bytes
        kept = self._act[end] - self._act[cut] + (tail if cut < end else 0)
        return replace(
            cost,
            backward_input_ms=cost.backward_input_ms + again_ms,
            backward_ms=None if backward_ms is None else backward_ms + again_ms,
            activation_bytes=stash + kept,
            recompute_bytes=max(rebuilt - stash, 0),
        )

    def total_ms(self, start: int = 0, end: int | None = None) -> float:
        end = self.num_layers if end is None else end
        return (self._f[end] - self._f[start]) + (self._i[end] - self._i[start]) + (self._w[end] - self._w[start])


def stage_costs(stages: Sequence[Stage], table: LayerTable) -> list[StageCost]:
    return [table.stage(stage.start, stage.end, recompute=stage.recompute, recompute_layers=stage.recompute_layers)
            for stage in stages]


def op_ms(cost: StageCost, kind: Kind) -> float:
    """The duration of one op of a stage: F, I, W, or B (I + W unless measured fused; FORMATS.md section 2)."""
    if kind is Kind.F:
        return cost.forward_ms
    if kind is Kind.I:
        return cost.backward_input_ms
    if kind is Kind.W:
        return cost.backward_weight_ms
    return cost.b_ms


def link_gbps(cluster: Cluster, global_a: int, global_b: int) -> float:
    same_node = cluster.node_of(global_a) == cluster.node_of(global_b)
    return cluster.intra_node_gbps if same_node else cluster.inter_node_gbps


def transfer_ms(cluster: Cluster, parallel: Parallel, src_rank: int, dst_rank: int, num_bytes: float) -> float:
    """Point-to-point time between two pipeline ranks: latency + bytes / bandwidth.

    With dp > 1 every replica sends the same tensor over its own link; the slowest replica's
    link decides, so the time is the maximum over replicas (equal when replicas are alike).
    """
    if src_rank == dst_rank:
        return 0.0
    # Whether replica d's two ranks share a node depends only on d mod gpus_per_node (in both
    # rank orders a replica's global ranks shift by d x a constant), so one node's worth of
    # replicas covers every case: linear in the node size, not in dp.
    slowest = min(
        link_gbps(cluster, parallel.global_rank(src_rank, d), parallel.global_rank(dst_rank, d))
        for d in range(min(parallel.dp, cluster.gpus_per_node))
    )
    return cluster.latency_us / 1000.0 + num_bytes / (slowest * 1e9) * 1000.0


def allreduce_ms(cluster: Cluster, parallel: Parallel, pp_rank: int, num_bytes: float) -> float:
    """Ring all-reduce of ``num_bytes`` over the dp group of one pipeline rank.

    A ring moves 2(dp-1)/dp of the buffer over each link in 2(dp-1) latency-bound steps; its
    speed is that of the slowest link the ring crosses (inter-node if the group spans nodes).
    """
    dp = parallel.dp
    if dp <= 1 or num_bytes <= 0:
        return 0.0
    # global ranks grow with the replica index in both rank orders: the first and the last
    # replica tell whether the group spans nodes
    first, last = parallel.global_rank(pp_rank, 0), parallel.global_rank(pp_rank, dp - 1)
    gbps = cluster.intra_node_gbps if cluster.node_of(first) == cluster.node_of(last) else cluster.inter_node_gbps
    return 2 * (dp - 1) * cluster.latency_us / 1000.0 + 2 * (dp - 1) / dp * num_bytes / (gbps * 1e9) * 1000.0


def tied_allreduce_ms(cluster: Cluster, parallel: Parallel, pp_ranks: Sequence[int], num_bytes: float) -> float:
    """Ring all-reduce of a tied tensor's gradient (``num_bytes``) among the pipeline ranks
    ``pp_ranks`` that hold a copy, within each data-parallel replica: :func:`allreduce_ms`'s
    link model over k ranks instead of dp. Every replica reduces its own copies at once; the
    slowest replica's ring decides (inter-node if its ranks span nodes)."""
    k = len(set(pp_ranks))
    if k <= 1 or num_bytes <= 0:
        return 0.0
    # as in transfer_ms: a replica's global ranks shift by d x a constant, so one node's worth
    # of replicas shows every way the ring can fall on nodes
    spans_nodes = any(
        len({cluster.node_of(parallel.global_rank(r, d)) for r in pp_ranks}) > 1
        for d in range(min(parallel.dp, cluster.gpus_per_node))
    )
    gbps = cluster.inter_node_gbps if spans_nodes else cluster.intra_node_gbps
    return 2 * (k - 1) * cluster.latency_us / 1000.0 + 2 * (k - 1) / k * num_bytes / (gbps * 1e9) * 1000.0


def lower_bound_ms(profile: Profile, *, pp: int, microbatches: int, op_overhead_ms: float = 0.0) -> float:
    """FORMATS.md section 7: no plan with this pp and microbatch count can be faster. A layer's least
    time takes the cheaper of its split backward (I + W) and its fused one (B). With a per-op
    runtime cost, every rank runs at least two ops (F and B) per microbatch and pays it twice.
    Tied tensors' all-reduces (``Profile.tied``) only add time after the ops, so they are left
    out: the bound still holds, and the simulator prices them."""
    totals = [layer.forward_ms + min(layer.backward_input_ms + layer.backward_weight_ms, layer.b_ms)
              for layer in profile.layers]
    return microbatches * (max(sum(totals) / pp, max(totals)) + 2 * op_overhead_ms)


def cheaper_backward(layer) -> tuple[float, float]:
    """A layer's I and W as the model weighs them: scaled to add up to the cheaper of I + W and
    the fused B, as the simulator prices a rank that runs whichever its order holds and the
    lower bound counts (docs/FORMATS.md section 7). Where the profile measured a B cheaper than
    I + W, a partition balanced on I + W would overload the ranks that run B."""
    split = layer.backward_input_ms + layer.backward_weight_ms
    if split <= 0 or layer.b_ms >= split:
        return layer.backward_input_ms, layer.backward_weight_ms
    scale = layer.b_ms / split
    return layer.backward_input_ms * scale, layer.backward_weight_ms * scale


def to_ticks(ms: float) -> int:
    """Milliseconds as CP-SAT integer ticks (microseconds), rounded."""
    return int(round(ms * TICKS_PER_MS))


def plan_stage_costs(plan: Plan, table: LayerTable) -> list[StageCost]:
    return stage_costs(plan.stages, table)
