"""The split backward: one layer's gradient to its inputs (I) now, to its weights (W) later,
together costing about one fused backward.

Why not two plain ``torch.autograd.grad`` calls: ``grad(out, params)`` after ``grad(out, input)``
walks the layer's graph again down to its first parameter, so inside a transformer block it
redoes almost all of the input-gradient work (measured: I + W about 1.5 times a fused
backward). :func:`backward_input` instead records, while it computes the input gradient, the
gradient arriving at each autograd node where a parameter branch leaves the input's path;
:func:`backward_weight` starts from those nodes and runs only the parameter branches.

What W needs is far less than what the forward saved: only the tensors the parameter branches
read (a matmul's input, a norm's input), not the input path's (attention probabilities, the
softmax a cross-entropy keeps, activation inputs). :class:`SavedTensors` puts each tensor autograd
saves during a layer's forward in a box; :func:`backward_input` notes which boxes the input path
alone read, and :meth:`SavedTensors.release` empties them once I is done, so from I to W a layer
holds only what W reads (a profile's ``w_saved_bytes``).

The profiler measures I and W with these functions and the runtime executes I and W ops with
them, so a profile describes the work octorun does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["PendingWeightGrads", "SavedTensors", "backward_input", "backward_weight", "root_edge"]


class _Box:
    """One tensor autograd saved, as the pack hook hands it back to autograd."""

    __slots__ = ("tensor", "version", "hold", "input_path_only")

    def __init__(self, tensor: torch.Tensor, hold: object):
        # Detached: a tensor autograd saves may be an output of the node that saves it, and
        # keeping it with its grad_fn would be a cycle through C++ that Python never frees.
        # The detached tensor shares the version counter, which unpack checks.
        self.tensor: torch.Tensor | None = tensor.detach()
        self.version = tensor._version
        self.hold = hold  # whatever counts the storage while the box holds it (a meter's Hold), or None
        self.input_path_only = False  # read by I outside every weight branch's boundary node


class SavedTensors:
    """The tensors autograd saves inside :meth:`recording`, in boxes that :meth:`release` can empty.

    ``hold(tensor)``, if given, is called for each saved tensor; what it returns lives as long as
    the box holds the tensor (the runtime's activation meter counts the storage that long).
    """

    def __init__(self, hold: Callable[[torch.Tensor], object] | None = None):
        self.boxes: list[_Box] = []
        self._hold = hold
        self._tracking = False  # inside a backward_input given these tensors
        self._in_boundary = 0  # boundary nodes running now (their reads W repeats)

    def recording(self):
        """Inside, every tensor autograd saves for a backward goes into a box of this object."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> _Box:
        box = _Box(tensor, None if self._hold is None else self._hold(tensor))
        self.boxes.append(box)
        return box

    def _unpack(self, box: _Box) -> torch.Tensor:
        # With hooks installed autograd no longer checks that a saved tensor was not changed in
        # place since; this does, in autograd's words, so such a layer fails as it would
        # without the hooks instead of computing wrong gradients.
        tensor = box.tensor
        if tensor is None:
            raise RuntimeError("a saved tensor released after the input gradient (I) was read again: "
                               "the weight gradient (W) runs a node that I alone was thought to need")
        if tensor._version != box.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: [{tensor.type()} {list(tensor.shape)}] is at version {tensor._version}; "
                f"expected version {box.version} instead")
        if self._tracking and not self._in_boundary:
            box.input_path_only = True
        return tensor

    def kept(self) -> list[torch.Tensor]:
        """The saved tensors :meth:`release` would keep: those W reads."""
        return [box.tensor for box in self.boxes if box.tensor is not None and not box.input_path_only]

    def release(self) -> None:
        """Empty the boxes only I read (call after :func:`backward_input`): W never reads them."""
        kept = []
        for box in self.boxes:
            if box.input_path_only:
                box.tensor = box.hold = None
            else:
                kept.append(box)
        self.boxes = kept


@dataclass
class _WeightGroup:
    """Parameters whose gradients flow in through the same set of source edges."""

    params: list[int]  # indices into the params given to backward_input
    roots: list[tuple[GradientEdge, torch.Tensor]] = field(default_factory=list)  # outputs off the input path
    nodes: list[Node] = field(default_factory=list)  # input-path nodes where parameter branches leave


@dataclass
class PendingWeightGrads:
    """What :func:`backward_input` leaves for :func:`backward_weight`: the parameter groups and
    the gradients captured at their boundary nodes. Holds the layer's graph until dropped."""

    params: list[torch.Tensor]
    groups: list[_WeightGroup]
    captured: dict[Node, tuple[torch.Tensor | None, ...]]

    @property
    def keeps_inputs(self) -> bool:
        """Whether the graph W needs reaches the layer's inputs: a boundary node lies on the
        input path, and the inputs' gradient accumulators hold the input tensors, so until W
        the inputs stay whatever else lets go of them."""
        return any(group.nodes for group in self.groups)

    def gradients(self) -> list[torch.Tensor]:
        """The gradients W starts from, captured ones and those of outputs off the input path:
        memory held from I to W besides the graph's saved tensors (a layer's ``pending_w_bytes``)."""
        rooted = [g for group in self.groups for _, g in group.roots]
        return rooted + [g for grads in self.captured.values() for g in grads if g is not None]


def _collect(roots: list[Node]) -> dict[Node, list[Node]]:
    """Every node reachable from ``roots`` with its children (``next_functions`` read once)."""
    children: dict[Node, list[Node]] = {}
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in children:
            continue
        kids = [child for child, _ in node.next_functions if child is not None]
        children[node] = kids
        stack.extend(kids)
    return children


def _post_order(children: dict[Node, list[Node]]) -> list[Node]:
    """The nodes, children before parents, by depth-first search (iterative: graphs can be
    deeper than Python's recursion limit)."""
    order: list[Node] = []
    done: set[Node] = set()
    for root in children:
        stack = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                order.append(node)
            elif node not in done:
                done.add(node)
                stack.append((node, True))
                stack.extend((kid, False) for kid in children[node] if kid not in done)
    return order


def _creation_order(children: dict[Node, list[Node]]) -> list[Node]:
    """The nodes sorted by creation: autograd numbers each node as the forward creates it,
    after the nodes of its inputs, so this puts children first (leaves have no number that
    fits, and no children: they go first). Much cheaper than a search; the caller checks it."""
    return sorted(children, key=lambda node: node._sequence_nr() if children[node] else -1)


def _plan_weight_groups(
    roots: list[tuple[GradientEdge, torch.Tensor]], inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]
) -> list[_WeightGroup]:
    """Split the graph below ``roots`` into the input path (nodes from which an input is
    reachable) and parameter branches, and group the branch sources by shared parameters.

    Runs on every I op, so it is written for speed: parameter sets are int bitmasks, and the
    graph is ordered by creation unless that order turns out not to put children first.
    """
    children = _collect([edge.node for edge, _ in roots])
    try:
        return _plan_in_order(_creation_order(children), children, roots, inputs, params)
    except KeyError:  # a child after its parent (e.g. a node made by another thread)
        return _plan_in_order(_post_order(children), children, roots, inputs, params)


def _plan_in_order(
    order: list[Node],
    children: dict[Node, list[Node]],
    roots: list[tuple[GradientEdge, torch.Tensor]],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> list[_WeightGroup]:
    input_ids = {id(t) for t in inputs}
    param_bit = {id(p): 1 << i for i, p in enumerate(params)}
    on_path: dict[Node, bool] = {}
    reach: dict[Node, int] = {}  # off-path nodes: parameters reachable from them
    # Sources: input-path nodes with an off-path child reaching parameters, and outputs that are
    # off the path altogether (all of a first layer's outputs when its inputs are token ids).
    sources: list[tuple[Any, int]] = []
    for node in order:  # children first; a child not seen yet raises KeyError
        kids = children[node]
        if not kids:  # a leaf; gradient accumulators expose their tensor as ``variable``
            leaf_id = id(getattr(node, "variable", None))
            on_path[node] = leaf_id in input_ids
            reach[node] = 0 if on_path[node] else param_bit.get(leaf_id, 0)
            continue
        path, off = False, 0
        for kid in kids:
            if on_path[kid]:
                path = True
            else:
                off |= reach[kid]
        on_path[node] = path
        if not path:
            reach[node] = off
        elif off:
            sources.append((node, off))
    for edge, grad in roots:
        if not on_path[edge.node] and reach[edge.node]:
            sources.append(((edge, grad), reach[edge.node]))

    # A parameter used at two sources ties them into one autograd call: merge overlapping masks.
    merged: list[tuple[int, list[Any]]] = []
    for source, mask in sources:
        members = [source]
        rest = []
        for other_mask, other_members in merged:
            if other_mask & mask:
                mask |= other_mask
                members += other_members
            else:
                rest.append((other_mask, other_members))
        merged = rest + [(mask, members)]
    groups = []
    for mask, members in merged:
        group = _WeightGroup(params=[i for i in range(len(params)) if mask >> i & 1])
        for source in members:
            if isinstance(source, tuple):
                group.roots.append(source)
            else:
                group.nodes.append(source)
        groups.append(group)
    return groups


def _grad(outputs: list, inputs: list, grads: list) -> tuple[torch.Tensor | None, ...]:
    """``torch.autograd.grad(outputs, inputs, grads, retain_graph=True, allow_unused=True)``.

    Calls the autograd engine directly, as that function does after its argument checks: the
    checks cost ~35 us of Python per call, and W makes one call per parameter group, so on small
    layers they would be a visible share of the time the profile reports. Our arguments are
    built here and need no checking.
    """
    if _ENGINE is None:
        return torch.autograd.grad(outputs, inputs, grads, retain_graph=True, allow_unused=True)
    return _ENGINE.run_backward(tuple(outputs), tuple(grads), True, False, tuple(inputs), True, False)


_ENGINE = getattr(getattr(torch.autograd, "Variable", None), "_execution_engine", None)


def root_edge(output: torch.Tensor) -> GradientEdge | None:
    """Where a backward from ``output`` starts, or None if it carries no gradient. A tape keeps
    this rather than the tensor: the edge holds the graph, not the output's storage."""
    return get_gradient_edge(output) if output.requires_grad else None


def backward_input(
    outputs: Sequence[torch.Tensor | GradientEdge],
    grad_outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    *,
    saved: SavedTensors | None = None,
) -> tuple[tuple[torch.Tensor | None, ...], PendingWeightGrads]:
    """The I op of one layer: gradients of ``outputs`` (weighted by ``grad_outputs``) w.r.t.
    ``inputs`` (floating tensors that require grad; may be empty), plus what
    :func:`backward_weight` needs to finish the parameters without repeating this work.

    ``outputs`` are the tensors that carry gradient (for the last layer: the loss, with a grad of
    ones), or their :func:`root_edge`. The graph is retained; it is freed when the outputs and the
    pending state are dropped. With ``saved`` (the layer's forward recorded into it) the call
    also marks the saved tensors only the input path read, for :meth:`SavedTensors.release`.
    """
    params = [p for p in params if p.requires_grad]
    edges = [out if isinstance(out, GradientEdge) else root_edge(out) for out in outputs]
    roots = [(edge, grad) for edge, grad in zip(edges, grad_outputs) if edge is not None]
    groups = _plan_weight_groups(roots, inputs, params)
    captured: dict[Node, tuple[torch.Tensor | None, ...]] = {}
    # W reruns each boundary node (the tensors it reads stay) and the weight branches below it,
    # which I never runs; so what I reads outside boundary nodes, W does not read again. A
    # group of several boundary nodes is the exception: W runs the input path between them.
    track = saved is not None and all(len(group.nodes) <= 1 for group in groups)

    def capture(node: Node) -> Callable:
        def hook(grads: tuple[torch.Tensor | None, ...]) -> None:
            captured[node] = tuple(grads)
            if track:
                saved._in_boundary += 1

        return hook

    def leave(_grad_inputs, _grad_outputs) -> None:
        saved._in_boundary -= 1

    boundary = [node for group in groups for node in group.nodes]
    handles = [node.register_prehook(capture(node)) for node in boundary]
    if track:
        handles += [node.register_hook(leave) for node in boundary]
        for box in saved.boxes:
            box.input_path_only = False
        saved._tracking, saved._in_boundary = True, 0
    try:
        if inputs and roots:
            grads = _grad([edge for edge, _ in roots], list(inputs), [g for _, g in roots])
        else:
            grads = tuple(None for _ in inputs)
    finally:
        for handle in handles:
            handle.remove()
        if saved is not None:
            saved._tracking = False
    return tuple(grads), PendingWeightGrads(params=params, groups=groups, captured=captured)


def backward_weight(pending: PendingWeightGrads) -> tuple[torch.Tensor | None, ...]:
    """The W op of one layer: the gradients of the parameters given to :func:`backward_input`
    (those that require grad, in order; None for an unused one). Runs only parameter branches.

    The graph is retained so that the call can be repeated (the profiler does); drop the
    outputs and ``pending`` to free it.
    """
    result: list[torch.Tensor | None] = [None] * len(pending.params)
    for group in pending.groups:
        edges: list[GradientEdge] = []
        grads: list[torch.Tensor] = []
        for edge, grad in group.roots:
            edges.append(edge)
            grads.append(grad)
        for node in group.nodes:
            for nr, grad in enumerate(pending.captured.get(node, ())):
                if grad is not None:
                    edges.append(GradientEdge(node, nr))
                    grads.append(grad)
        if not edges:
            continue
        # With several boundary nodes in one call, gradient flowing from one to the next along
        # the input path would be added to what was captured there (which already holds it):
        # pin each boundary node's incoming gradient to the captured value.
        handles = []
        if len(group.nodes) > 1:
            for node in group.nodes:
                if node in pending.captured:
                    handles.append(node.register_prehook(lambda _grads, saved=pending.captured[node]: saved))
        try:
            found = _grad(edges, [pending.params[i] for i in group.params], grads)
        finally:
            for handle in handles:
                handle.remove()
        for i, grad in zip(group.params, found):
            result[i] = grad
    return tuple(result)
