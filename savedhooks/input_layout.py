"""Saved inputs leave inductor's forward as themselves, not as channels_last copies.

Inductor's layout optimization (on CPU for any graph with a convolution when
mkldnn is there; on CUDA by a FLOPs heuristic) gives every 4-D tensor that a
convolution reads a channels_last layout, graph inputs included. A forward graph
returns the inputs the backward needs (the image a first convolution read, its
weight); under the optimization inductor returns a channels_last *copy* in their
place. AOTAutograd hands only intermediates to saved-tensor hooks, so no codec
reaches the copy, and it lives from the forward to the backward next to the input
it copies: 3.05 MiB of the ViT's 29.3 MiB of saved bytes at the benchmark's
size 1, the image being 2.30 of them (README, "Under inductor").

* :func:`keep_input_layout` (forward graphs) marks the forward outputs that are
  graph inputs as user-visible in inductor's own output metadata
  (``user_visible_output_idxs``, which inductor sets before its post-grad passes
  and reads after them): inductor then returns them in their original strides,
  which is the input itself. The forward's convolution still reads a
  channels_last copy, freed after it.
* :func:`restore_input_layout` (backward graphs): a parameter's layout decides
  the backward's. The backward graph has no ``aten.convolution``, so inductor
  does not optimize its layout; it follows its inputs' strides, and a
  channels_last weight makes ``convolution_backward`` return channels_last
  gradients. With contiguous weights the benchmark's CNN ran its whole backward
  contiguous: a lower step peak, a slower step on CPU (README). So each weight
  that the forward returned contiguous where inductor would have copied it
  gets a channels_last copy right before its ``convolution_backward``, and the
  backward runs in the layout it had. The forward records those weights' names
  on the compile's ``TracingContext`` (AOTAutograd compiles both graphs under
  it, the backward's inputs named as the forward's outputs).

Which inputs are parameters or buffers is AOTAutograd's ``static_input_indices``,
matched to the placeholders by position; when the counts differ (effect tokens,
RNG state), nothing is marked.
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch.fx

__all__ = ["keep_input_layout", "restore_input_layout"]

_VISIBLE, _STRIDES = "user_visible_output_idxs", "original_output_strides"
_RESTORE = "savedhooks_channels_last_inputs"  # on the compile's TracingContext: weights to copy back in the backward
_CONVOLUTION, _CONVOLUTION_BACKWARD = torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default


def keep_input_layout(graph: torch.fx.Graph) -> list[str]:
    """Have inductor return a forward graph's saved inputs in their own strides.

    Data inputs are always marked. A parameter or buffer is marked when it is
    4-D, a convolution reads it and inductor optimizes the graph's layout; its
    name is then recorded for :func:`restore_input_layout`. Call it from a
    post-grad pass on an AOTAutograd forward graph, inside inductor's compile
    (it reads the compile's ``TracingContext``).

    Args:
        graph: a forward graph (changed in place: its output node's metadata).

    Returns:
        The names of the placeholders newly marked user-visible (empty when the
        graph returns no such input, or the metadata or the tracing context is
        missing).

    Raises:
        Nothing.
    """
    output = graph.output_node()
    if _VISIBLE not in output.meta or _STRIDES not in output.meta:
        return []
    context = torch._guards.TracingContext.try_get()
    fw_metadata = getattr(context, "fw_metadata", None)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if fw_metadata is None or len(placeholders) != len(fw_metadata.input_info):
        return []
    static = set(fw_metadata.static_input_indices)
    weights = {n for i, n in enumerate(placeholders) if i in static and _convolution_weight(n)}
    if weights and not _layout_optimized(graph):
        weights = set()
    kept = weights | {n for i, n in enumerate(placeholders) if i not in static}
    values = output.args[0] if isinstance(output.args[0], (tuple, list)) else output.args
    visible, strides = set(output.meta[_VISIBLE]), output.meta[_STRIDES]
    marked = [i for i, value in enumerate(values)
              if value in kept and i not in visible and i < len(strides) and strides[i] is not None]
    if marked:
        output.meta[_VISIBLE] = sorted(visible | set(marked))
        restore = getattr(context, _RESTORE, set())
        setattr(context, _RESTORE, restore | {values[i].name for i in marked if values[i] in weights})
    return [values[i].name for i in marked]


def restore_input_layout(graph: torch.fx.Graph) -> list[str]:
    """Give each weight that :func:`keep_input_layout` kept a channels_last copy before its ``convolution_backward``.

    Call it from a post-grad pass on the backward graph compiled under the same
    ``TracingContext`` as its forward.

    Args:
        graph: a backward graph (changed in place: ``aten.clone`` nodes added,
            convolution backwards reading them).

    Returns:
        The names of the placeholders given a copy (empty outside a compile, or
        when the forward kept none).

    Raises:
        Nothing.
    """
    names = getattr(torch._guards.TracingContext.try_get(), _RESTORE, set())
    restored = []
    for node in [n for n in graph.nodes if n.op == "placeholder" and n.name in names]:
        readers = [u for u in node.users if u.target is _CONVOLUTION_BACKWARD]
        value = node.meta.get("val")
        if not readers or not isinstance(value, torch.Tensor) or value.dim() != 4:
            continue
        with graph.inserting_before(min(readers, key=_position(graph))):
            copy = graph.call_function(torch.ops.aten.clone.default, (node,), {"memory_format": torch.channels_last})
        with value.fake_mode if hasattr(value, "fake_mode") else contextlib.nullcontext():
            copy.meta["val"] = value.clone(memory_format=torch.channels_last)
        for reader in readers:
            reader.replace_input_with(node, copy)
        restored.append(node.name)
    return restored


def _convolution_weight(node: torch.fx.Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.dim() == 4 and any(u.target is _CONVOLUTION for u in node.users)


def _layout_optimized(graph: torch.fx.Graph) -> bool:
    """Inductor's own decision for this graph (training: ``is_inference=False``)."""
    from torch._inductor.graph import GraphLowering

    return bool(GraphLowering.decide_layout_opt(types.SimpleNamespace(graph=graph), is_inference=False))


def _position(graph: torch.fx.Graph):
    order = {node: i for i, node in enumerate(graph.nodes)}
    return order.__getitem__
