"""Which FX nodes inductor computes inside their consumers instead of storing.

Inductor lowers a pointwise op to a lazy loop body and *inlines* it into the
kernels that read it, as long as those are pointwise ops or reductions; it
stores (realizes) the result only for consumers that need a buffer: matmuls,
convolutions, custom ops and other extern kernels, graph outputs. A liveness
model of an inductor graph that gives every pointwise node its own buffer
counts temporaries that never exist (a GELU backward is one kernel, not eight
buffers), and it then prefers orders that are not better for inductor.

This module marks the inlined nodes; :func:`savedhooks.memory.build_graph_memory`
with ``fused=True`` gives them no buffer and lets their consumers read what they
read. The rule is inductor's first-order one; it ignores the thresholds on
which inductor still realizes a heavily reused pointwise result
(``realize_reads_threshold``, ``realize_opcount_threshold``).
"""

from __future__ import annotations

import operator
from collections.abc import Collection

import torch
import torch.fx

from savedhooks.memory.sizes import storage_key

__all__ = ["inlined_nodes", "is_alias", "is_constant_fill", "is_view"]

_FUSING_TAGS = (torch.Tag.pointwise, torch.Tag.reduction)

# ops without a pointwise tag that inductor lowers to a pointwise loop body all the same (``tensor_constructor``,
# ``iota``): a constant fill such as the zeros of ``_safe_softmax``'s ``where`` is computed in its readers' kernels
_CONSTANT_FILLS = frozenset(
    op
    for op in (
        getattr(torch.ops.aten, "full", None),
        getattr(torch.ops.aten, "full_like", None),
        getattr(torch.ops.aten, "zeros", None),
        getattr(torch.ops.aten, "ones", None),
        getattr(torch.ops.aten, "zeros_like", None),
        getattr(torch.ops.aten, "ones_like", None),
        getattr(torch.ops.aten, "scalar_tensor", None),
        getattr(torch.ops.prims, "iota", None),
    )
    if op is not None
)


def _tags(node: torch.fx.Node) -> tuple[torch.Tag, ...]:
    return tuple(getattr(node.target, "tags", ())) if node.op == "call_function" else ()


def is_constant_fill(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a constant fill that inductor lowers to a pointwise loop body (``full``, ``zeros``, ``iota``, ...).

    Args:
        node: an FX node.

    Returns:
        True for ``full``, ``zeros``, ``ones`` (and their ``_like`` forms),
        ``scalar_tensor`` and ``iota``: they carry no ``pointwise`` tag, but
        inductor computes them inside the kernels that read them.
    """
    return node.op == "call_function" and getattr(node.target, "overloadpacket", None) in _CONSTANT_FILLS


def is_view(node: torch.fx.Node) -> bool:
    """Whether ``node``'s value aliases its first input (reshape, permute, detach, ...): it allocates nothing.

    Args:
        node: an FX node with ``meta["val"]`` (as its first input).

    Returns:
        True when both values are tensors on the same storage.
    """
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return False
    val, base = node.meta.get("val"), node.args[0].meta.get("val")
    if not isinstance(val, torch.Tensor) or not isinstance(base, torch.Tensor):
        return False
    mine = storage_key(val)
    return mine is not None and mine == storage_key(base)


def is_alias(node: torch.fx.Node) -> bool:
    """Whether ``node`` computes nothing: a view (:func:`is_view`), or one output of a multi-output op (``getitem``).

    Args:
        node: an FX node with ``meta["val"]``.

    Returns:
        True for a view or a ``getitem``.
    """
    return node.target is operator.getitem or is_view(node)


def _consumers(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes that read ``node``'s data, looking through views of it."""
    found, frontier = [], [node]
    while frontier:
        current = frontier.pop()
        for user in current.users:
            if is_view(user) and user.args[0] is current:
                frontier.append(user)
            else:
                found.append(user)
    return found


def inlined_nodes(graph: torch.fx.Graph, realized: Collection[str] = ()) -> set[torch.fx.Node]:
    """Pointwise nodes that inductor fuses into every consumer (no buffer of their own).

    Args:
        graph: an AOTAutograd forward or backward graph (nodes with ``meta["val"]``).
        realized: names of the nodes inductor stored, where a compile recorded
            them (:meth:`savedhooks.planner.recording.GraphRecorder.kernel_order`):
            they and their views are not inlined (inductor realizes a pointwise
            result that many kernels read). With that record, a constant fill
            (:func:`is_constant_fill`) it does not name is a candidate too;
            without it (a pass that runs before inductor lowers the graph) fills
            keep their buffer.

    Returns:
        The candidate nodes (the ``pointwise`` tag; see ``realized``) whose
        consumers, looking through views, are all pointwise ops or reductions
        (never an output, an extern kernel or a custom op), and the views of
        such nodes.
    """
    inlined: set[torch.fx.Node] = set()
    for node in reversed(graph.nodes):  # consumers first: a view of an inlined node is inlined too
        candidate = torch.Tag.pointwise in _tags(node) or (realized and is_constant_fill(node))
        if not candidate or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        if node.name in realized:
            continue
        consumers = _consumers(node)
        if consumers and all(any(t in _tags(c) for t in _FUSING_TAGS) for c in consumers):
            inlined.add(node)
    for node in graph.nodes:
        if is_view(node) and node.args[0] in inlined:
            inlined.add(node)
    return inlined
