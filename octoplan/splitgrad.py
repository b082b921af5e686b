"""The split backward: one layer's gradient to its inputs (I) now, to its weights (W) later,
together costing about one fused backward.

Why not two plain ``torch.autograd.grad`` calls: ``grad(out, params)`` after ``grad(out, input)``
walks the layer's graph again down to its first parameter, so inside a transformer block it
redoes almost all of the input-gradient work (measured: I + W about 1.5 times a fused
backward). :func:`backward_input` instead records, while it computes the input gradient, the
gradient arriving at each autograd node where a parameter branch leaves the input's path;
:func:`backward_weight` starts from those nodes and runs only the parameter branches.

The profiler measures I and W with these functions and the runtime executes I and W ops with
them, so a profile describes the work octorun does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["PendingWeightGrads", "backward_input", "backward_weight"]


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


def backward_input(
    outputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> tuple[tuple[torch.Tensor | None, ...], PendingWeightGrads]:
    """The I op of one layer: gradients of ``outputs`` (weighted by ``grad_outputs``) w.r.t.
    ``inputs`` (floating tensors that require grad; may be empty), plus what
    :func:`backward_weight` needs to finish the parameters without repeating this work.

    ``outputs`` are the tensors that carry gradient (for the last layer: the loss, with a grad of
    ones). The graph is retained; it is freed when the outputs and the pending state are dropped.
    """
    params = [p for p in params if p.requires_grad]
    roots = [(get_gradient_edge(out), grad) for out, grad in zip(outputs, grad_outputs) if out.requires_grad]
    groups = _plan_weight_groups(roots, inputs, params)
    captured: dict[Node, tuple[torch.Tensor | None, ...]] = {}

    def capture(node: Node) -> Callable:
        def hook(grads: tuple[torch.Tensor | None, ...]) -> None:
            captured[node] = tuple(grads)

        return hook

    handles = [node.register_prehook(capture(node)) for group in groups for node in group.nodes]
    try:
        if inputs and roots:
            grads = _grad([edge for edge, _ in roots], list(inputs), [g for _, g in roots])
        else:
            grads = tuple(None for _ in inputs)
    finally:
        for handle in handles:
            handle.remove()
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
