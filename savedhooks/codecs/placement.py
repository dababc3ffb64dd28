"""Where a codec's packs and unpacks run, and when packing pays: under AOTAutograd, and for an eager loss.

Design notes
------------
* torch puts every inlined unpack at the start of the backward graph. A compiled
  backward runs in that order unless something moves them: inductor (the reorder
  pass that entering the hooks installs, and its scheduler, which fuses decodes
  into their readers) or a savedhooks backend
  (:func:`savedhooks.hooks.contract.placed_compile`). Neither has run when the hooks
  are traced, so the codecs ask :func:`unpacks_placed`.
* Without placement, overlapping views of one storage cost memory: AOTAutograd
  packs each saved value on its own and each is decoded into a buffer of its
  own, all at the start of the backward. The vit's attention output (saved by
  SDPA) and its reshape (saved by the output projection) are such a pair:
  decoded twice, they would put its plain aot_eager step above the step without
  hooks. The driver stores such values as they are (:func:`decodes_twice`).
* In eager mode nothing is placed, and a pack frees nothing while the forward
  still holds the tensor. A loss computed eagerly on a compiled model's output
  (``cross_entropy(compiled(x), y)``) saves its log-softmax, still held until
  the product with the targets, and its backward reads it right after: the
  payload is only added at the loss's peak, where the step peaks with an eager
  loss. The codecs store it as it is (:func:`saved_for_an_eager_loss`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from savedhooks._torch import inductor
from savedhooks.hooks.contract import HookContext, placing_requested
from savedhooks.memory.sizes import storage_key

__all__ = ["decodes_twice", "inductor_compiling", "saved_for_an_eager_loss", "unpacks_placed"]


def inductor_compiling() -> bool:
    """Whether the caller runs inside inductor's ``compile_fx`` (AOTAutograd called by inductor).

    Returns:
        True when inductor's ``_compile_fx_main`` is on the call stack.
    """
    return inductor.compiling()


def unpacks_placed() -> bool:
    """Whether the graphs being traced will have their unpacks moved to their uses.

    Returns:
        True under inductor (the reorder pass that entering the hooks installs,
        and its scheduler, which fuses decodes into their readers) and inside
        :func:`savedhooks.hooks.contract.placed_compile` (``sh.backend("aot_eager")``);
        False elsewhere, for example under plain ``torch.compile(backend="aot_eager")``.
    """
    return placing_requested() or inductor_compiling()


def _tensor(node: Any) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def decodes_twice(ctx: HookContext) -> bool:
    """Whether the forward outputs on the saved value's storage hold more bytes than that storage.

    AOTAutograd packs each saved value on its own, and each is decoded into a
    buffer of its own. Where several outputs (saved for backward or returned)
    view one storage and overlap (an attention output and the reshape of it
    that the output projection saves), their decoded buffers hold some bytes
    twice, where the step without hooks held the storage once. Views that
    split a storage (the q, k and v of one projection) decode into no more
    bytes than it has.

    Args:
        ctx: the context of the value being packed (:func:`savedhooks.hook_context`);
            AOTAutograd changes the forward graph's outputs only after every
            saved value is packed, so they are the original ones here.

    Returns:
        True when the outputs sharing the storage are known to hold more
        elements' bytes than the storage (False when the sizes are symbolic
        and not known to).
    """
    val = _tensor(ctx.node)
    mine = None if val is None else storage_key(val)
    if mine is None:
        return False
    views = [t for t in map(_tensor, ctx.fw_graph.output_node().args[0]) if t is not None and storage_key(t) == mine]
    if len(views) < 2:
        return False
    held = sum(t.numel() * t.element_size() for t in views)
    return statically_known_true(held > val.untyped_storage().nbytes())


def saved_for_an_eager_loss(x: torch.Tensor, ctx: HookContext | None) -> bool:
    """Whether a tensor saved outside compiled graphs is the output of a log-softmax (as an eager cross-entropy saves).

    Eagerly, the tensor autograd saves is the one the forward goes on using: a
    cross-entropy's log-softmax stays alive until its product with the targets
    (or the NLL gather) has run, and the loss's backward, which starts right
    after, reads it again. A packed copy is added at that moment and nothing is
    freed for longer than the loss's last few ops (an offloaded copy is a round
    trip to the host that frees nothing). A model compiled with a log-softmax
    at its end returns a graph output, which this does not match (its autograd
    node is the compiled function's). An eager loss is where a compiled
    model's step with its loss outside peaks (gpt2 under inductor with
    ``sh.fp8()``, for one: packing the log-softmax there raises the peak).

    Args:
        x: the saved tensor.
        ctx: :func:`savedhooks.hook_context` (None in eager mode).

    Returns:
        True in eager mode for the output of a log-softmax (autograd node
        ``LogSoftmaxBackward0``); False under compile, where the loss's
        tensors are graph values that placement and fusion handle.
    """
    return ctx is None and type(x.grad_fn).__name__ == "LogSoftmaxBackward0"
