"""Undo inductor's ``mm + add -> addmm`` fusion where it keeps a large operand alive.

Inductor's post-grad patterns rewrite ``add(mm(a, b), c)`` into ``addmm(c, a, b)``
at the place of the add. When ``c`` is made long after ``a`` and ``b``, the
matmul now waits for it, and so do its operands. The case that matters: a tied
weight (GPT-2's embedding and output head). Its two gradient contributions are
added at the end of the backward, so the head's weight-gradient matmul runs
last and the logits' gradient, ``(tokens, vocab)`` floats, stays alive through
the whole backward.

:func:`split_late_addmm` turns each such ``addmm`` back into the ``mm`` and ``add``
that autograd wrote (same operands, so the eager step's arithmetic), before the
reorder pass, which may then run the ``mm`` as soon as its operands exist.
:func:`join_adjacent` fuses again every pair that the reorder left side by
side, where splitting gained nothing.
"""

from __future__ import annotations

import torch
import torch.fx

__all__ = ["join_adjacent", "split_late_addmm"]

_aten = torch.ops.aten


def split_late_addmm(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """Split each ``addmm(c, a, b)`` whose ``c`` is made after ``a`` and ``b`` into ``add(c, mm(a, b))``.

    Only plain ``addmm`` (no ``alpha`` / ``beta``) whose value and three operands
    carry fake tensors is split; the new nodes get fake values in the same fake mode.

    Args:
        graph: a post-grad graph (nodes with ``meta["val"]``).

    Returns:
        The new ``mm`` nodes (each with one user, its ``add``).
    """
    position = {node: i for i, node in enumerate(graph.nodes)}
    made = []
    for node in list(graph.nodes):
        if node.target is not _aten.addmm.default or node.kwargs or len(node.args) != 3:
            continue
        bias, a, b = node.args
        operands = (bias, a, b)
        if not all(isinstance(x, torch.fx.Node) and isinstance(x.meta.get("val"), torch.Tensor) for x in operands):
            continue
        mode = getattr(node.meta.get("val"), "fake_mode", None)
        if mode is None or bias.op == "placeholder" or position[bias] < max(position[a], position[b]):
            continue
        with graph.inserting_before(node), mode:
            mm = graph.call_function(_aten.mm.default, (a, b))
            mm.meta["val"] = _aten.mm.default(a.meta["val"], b.meta["val"])
            add = graph.call_function(_aten.add.Tensor, (bias, mm))
            add.meta["val"] = _aten.add.Tensor(bias.meta["val"], mm.meta["val"])
        add.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        position[mm] = position[add] = position[node]  # a later addmm may take this add as its bias
        node.replace_all_uses_with(add)
        graph.erase_node(node)
        made.append(mm)
    return made


def join_adjacent(graph: torch.fx.Graph, mms: list[torch.fx.Node]) -> int:
    """Fuse back each ``mm`` of :func:`split_late_addmm` that still runs right before its ``add``.

    Args:
        graph: the graph :func:`split_late_addmm` split, after any reordering.
        mms: what it returned.

    Returns:
        How many pairs were fused again.
    """
    joined = 0
    for mm in mms:
        add = next(iter(mm.users)) if len(mm.users) == 1 else None
        if add is None or mm.next is not add:
            continue
        bias, _ = add.args
        a, b = mm.args
        with graph.inserting_before(add):
            addmm = graph.call_function(_aten.addmm.default, (bias, a, b))
        addmm.meta.update(add.meta)
        add.replace_all_uses_with(addmm)
        graph.erase_node(add)
        graph.erase_node(mm)
        joined += 1
    return joined
