"""Saved inputs leave inductor's forward as themselves, not as channels_last copies.

Inductor's layout optimization (on CPU for any graph with a convolution when
mkldnn is there; on CUDA by heuristics on the convolutions' shapes) gives every
4-D tensor that a convolution reads a channels_last layout, graph inputs
included. A forward graph returns the inputs the backward needs (the image a
first convolution read, its weight); under the optimization inductor returns a
channels_last *copy* in their place. Inductor makes the copy after AOTAutograd
has inlined the saved-tensor hooks, so no codec reaches it, and it lives from
the forward to the backward next to the input it copies (on the benchmark's ViT, more bytes
than the image itself).

* :func:`keep_input_layout` (forward graphs) marks the forward outputs that are
  graph inputs as user-visible in inductor's own output metadata
  (``user_visible_output_idxs``, which inductor sets before its post-grad passes
  and reads after them): inductor then returns them in their original strides,
  which is the input itself. The forward's convolution still reads a
  channels_last copy, freed after it.
* :func:`restore_input_layout` (backward graphs): a convolution weight's layout
  decides the backward's. A backward graph that recomputes no convolution has
  no ``aten.convolution``, so inductor does not optimize its layout; it follows
  its inputs' strides, and a channels_last weight makes ``convolution_backward``
  return channels_last gradients. With contiguous weights the benchmark's CNN
  runs its whole backward contiguous: a lower step peak, a slower step on CPU.
  So a weight (the second argument of a convolution) is returned as
  itself only when inductor optimizes the forward's layout, and the backward
  gets a channels_last copy of it right before its ``convolution_backward``: the
  backward runs in the layout it had. The forward records those weights' names
  on the compile's ``TracingContext``, per forward (AOTAutograd compiles both
  graphs under it and sets its ``fw_metadata`` to the forward's, also for a
  lazily compiled backward; its backward inputs are named as the forward's
  outputs). :func:`recorded_weights` gives the record to the pass's cache key.
"""

from __future__ import annotations

import torch
import torch.fx

from savedhooks._torch import inductor
from savedhooks._torch.dynamo import tracing_context

__all__ = ["keep_input_layout", "recorded_weights", "restore_input_layout"]

_VISIBLE, _STRIDES = "user_visible_output_idxs", "original_output_strides"
_RECORD = "savedhooks_channels_last_weights"  # on the TracingContext: id(fw_metadata) -> (fw_metadata, names)
_CONVOLUTION, _CONVOLUTION_BACKWARD = torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default


def keep_input_layout(graph: torch.fx.Graph) -> list[str]:
    """Have inductor return a forward graph's saved inputs in their own strides.

    Every returned graph input is marked, except a convolution weight when
    inductor will not optimize the graph's layout (it is returned as itself
    then anyway); the weights marked are recorded for
    :func:`restore_input_layout`. Call it from a post-grad pass on an
    AOTAutograd forward graph, as the pass's last change to the graph (the
    layout decision reads the final graph), inside inductor's compile.

    Args:
        graph: a forward graph (changed in place: its output node's metadata).

    Returns:
        The names of the placeholders newly marked user-visible (empty when the
        graph returns no input, or inductor's output metadata is missing).
    """
    output = graph.output_node()
    if _VISIBLE not in output.meta or _STRIDES not in output.meta:
        return []
    placeholders = {n for n in graph.nodes if n.op == "placeholder"}
    convolved = {n for n in placeholders if _convolution_weight(n)}
    weights = convolved if convolved and _layout_optimized(graph) else set()
    kept = (placeholders - convolved) | weights
    values = output.args[0] if isinstance(output.args[0], (tuple, list)) else output.args
    visible, strides = set(output.meta[_VISIBLE]), output.meta[_STRIDES]
    marked = [
        i for i, value in enumerate(values)
        if value in kept and i not in visible and i < len(strides) and strides[i] is not None
    ]  # fmt: skip
    if not marked:
        return []
    output.meta[_VISIBLE] = sorted(visible | set(marked))
    _record({values[i].name for i in marked if values[i] in weights})
    return [values[i].name for i in marked]


def restore_input_layout(graph: torch.fx.Graph) -> list[str]:
    """Give each weight that :func:`keep_input_layout` kept a channels_last copy before its ``convolution_backward``.

    Call it from a post-grad pass on the backward graph compiled under the same
    ``TracingContext`` as its forward. A backward that recomputes a convolution
    is left alone: inductor optimizes its layout itself.

    Args:
        graph: a backward graph (changed in place: ``aten.clone`` nodes added,
            convolution backwards reading them).

    Returns:
        The names of the placeholders given a copy (empty outside a compile, or
        when the forward kept none).
    """
    names = recorded_weights()
    if not names or any(n.target is _CONVOLUTION for n in graph.nodes):
        return []
    restored = []
    order = {n: i for i, n in enumerate(graph.nodes)}  # the readers' order; the copies added read nothing else
    for node in [n for n in graph.nodes if n.op == "placeholder" and n.name in names]:
        readers = [u for u in node.users if u.target is _CONVOLUTION_BACKWARD and u.args[2] is node]
        value = node.meta.get("val")
        mode = getattr(value, "fake_mode", None)
        if not readers or mode is None or value.dim() != 4:
            continue
        with graph.inserting_before(min(readers, key=order.__getitem__)), mode:
            copy = graph.call_function(torch.ops.aten.clone.default, (node,), {"memory_format": torch.channels_last})
            copy.meta["val"] = value.clone(memory_format=torch.channels_last)
        for reader in readers:
            reader.replace_input_with(node, copy)
        restored.append(node.name)
    return restored


def recorded_weights() -> frozenset[str]:
    """The weights :func:`keep_input_layout` recorded for the forward of the compile in progress.

    Returns:
        Their names; empty outside a compile or when none was recorded.
    """
    context = tracing_context()
    fw_metadata = getattr(context, "fw_metadata", None)
    entry = getattr(context, _RECORD, {}).get(id(fw_metadata))
    return entry[1] if entry is not None and entry[0] is fw_metadata else frozenset()


def _record(names: set[str]) -> None:
    context = tracing_context()
    fw_metadata = getattr(context, "fw_metadata", None)
    if fw_metadata is None:
        return
    records = getattr(context, _RECORD, {})
    records[id(fw_metadata)] = (fw_metadata, frozenset(names))
    setattr(context, _RECORD, records)


def _convolution_weight(node: torch.fx.Node) -> bool:
    value = node.meta.get("val")
    return (isinstance(value, torch.Tensor) and value.dim() == 4
            and any(u.target is _CONVOLUTION and u.args[1] is node for u in node.users))


def _layout_optimized(graph: torch.fx.Graph) -> bool:
    """Inductor's own decision for this graph (a training graph: ``is_inference=False``)."""
    from types import SimpleNamespace

    return bool(inductor.GraphLowering.decide_layout_opt(SimpleNamespace(graph=graph), is_inference=False))
