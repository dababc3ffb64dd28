"""The compile integration: where inductor and AOTAutograd place the inlined hooks.

* :mod:`savedhooks.compiler.api`: :class:`saved_tensors_hooks` (torch's hooks
  block plus this placement), :func:`backend`, :func:`reorder_pass` and the
  context that plain ``torch.compile`` reads;
* :mod:`savedhooks.compiler.passes`: the reorder pass on a post-grad FX graph
  (unpacks placed before their first use, packs after their last);
* :mod:`savedhooks.compiler.overlap`: host-offload copies moved to overlap
  compute;
* :mod:`savedhooks.compiler.input_layout`: saved graph inputs kept in their
  own layout;
* :mod:`savedhooks.compiler.unfuse`: inductor's late ``addmm`` fusions split
  back where they keep a large operand alive.
"""

from savedhooks.compiler.api import (
    ReorderPass,
    backend,
    inductor_placement,
    placed_aot_eager,
    placed_compile,
    placing_requested,
    post_grad_passes,
    reorder_pass,
    saved_tensors_hooks,
)

__all__ = [
    "ReorderPass",
    "backend",
    "inductor_placement",
    "placed_aot_eager",
    "placed_compile",
    "placing_requested",
    "post_grad_passes",
    "reorder_pass",
    "saved_tensors_hooks",
]
