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

:func:`keep_input_layout` marks the forward outputs that are *data* inputs as
user-visible in inductor's own output metadata (``user_visible_output_idxs``,
which inductor sets before its post-grad passes and reads after them): inductor
then returns them in their original strides, which is the input itself. The
forward's convolution still reads a channels_last copy, freed after it; the
backward reorders what it reads.

Parameters and buffers (AOTAutograd's ``static_input_indices``) keep their copies:
they are small (convolution weights), and their layout decides the backward's.
The backward graph has no ``aten.convolution``, so inductor does not optimize
its layout; it follows its inputs' strides, and a channels_last weight makes
``convolution_backward`` return channels_last gradients. With contiguous weights
too, the benchmark's CNN ran its whole backward contiguous: a lower step peak,
a slower step on CPU (README). Graph inputs are matched to
``static_input_indices`` by position; when the counts differ (effect tokens,
RNG state) nothing is marked.
"""

from __future__ import annotations

import torch
import torch.fx

__all__ = ["keep_input_layout"]

_VISIBLE, _STRIDES = "user_visible_output_idxs", "original_output_strides"


def keep_input_layout(graph: torch.fx.Graph) -> list[str]:
    """Have inductor return a forward graph's saved data inputs in their own strides.

    Call it from a post-grad pass on an AOTAutograd forward graph, inside
    inductor's compile (it reads the compile's ``TracingContext``).

    Args:
        graph: a forward graph (changed in place: its output node's metadata).

    Returns:
        The names of the placeholders newly marked user-visible (empty when the
        graph returns no data input, or the metadata or the tracing context is
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
    data = {node for i, node in enumerate(placeholders) if i not in static}
    values = output.args[0] if isinstance(output.args[0], (tuple, list)) else output.args
    visible, strides = set(output.meta[_VISIBLE]), output.meta[_STRIDES]
    marked = [i for i, value in enumerate(values)
              if value in data and i not in visible and i < len(strides) and strides[i] is not None]
    if marked:
        output.meta[_VISIBLE] = sorted(visible | set(marked))
    return [values[i].name for i in marked]
