"""Copies between device and host memory for ``sh.offload``: one graph node each.

Design notes
------------
* Pack calls ``savedhooks::offload`` and unpack ``savedhooks::reload``. They are
  functional custom ops (no output aliases an input), so AOTAutograd can trace
  them inside the hooks under functionalization. Each stays one node in the
  compiled graphs, where the reorder pass places it like any pack or unpack.
* Alone, each op is a whole copy ordered on the current stream: correct in eager
  mode, under aot_eager and under inductor, with no pass at all. The source's
  memory is freed after the copy on that same stream, so the caching allocator
  orders its reuse after the copy. A D2H copy into pinned memory does not block
  the host.
* Overlap is added after tracing, by :mod:`savedhooks.compiler.overlap`. Each op is
  rewritten there into an asynchronous start and torch's ``ao::wait_tensor``
  (torch's transfer stream, and an event per copy): ``ao::reload`` for the
  copy back, and for the copy out ``savedhooks::offload_async``, which is
  torch's ``ao::offload`` (same stream, same event registry) except that it
  writes into a slab of the host pool instead of a new pinned buffer per copy.
  The hooks cannot call those ops directly: ``ao::wait_tensor`` returns an
  alias of its input, which functionalization refuses
  (``tests/codec/test_codec_models.py`` pins this).
* Layout: a dense tensor keeps its strides on both sides (transposed and
  channels-last tensors come back as they went); any other tensor moves
  contiguous.
* Host memory: a pinned copy (CUDA to CPU) is written into a slab of
  :func:`savedhooks.hostmem.pool.default_pool`, of exactly its bytes, which
  comes back to the pool when the copy's storage is freed (after a CUDA event
  recorded then), so later steps allocate no pinned memory; torch's own pinned
  allocator rounds every request up to a power of two and keeps the blocks.
  The asynchronous copies of compiled CUDA graphs write into the same pool
  (torch's ``ao::offload`` allocates a pinned buffer per copy unless its own
  pool is on, and that pool takes a buffer back only through ``keepalive``,
  which would free a saved tensor that a retained graph unpacks again). The
  slab waits on the copy's event and on one recorded when its storage is
  freed: a backward frees a saved host tensor after the wait of its copy back.
"""

from __future__ import annotations

import torch

from savedhooks._torch.offload import register_wait, transfer_stream
from savedhooks._torch.tensors import is_non_overlapping_and_dense_or_false, make_contiguous_strides_for
from savedhooks.hostmem.pool import default_pool

__all__ = ["torch_offload", "torch_offload_async", "torch_reload"]


def _empty_like_layout(x: torch.Tensor, device: torch.device, pin_memory: bool) -> torch.Tensor:
    """An uninitialized tensor shaped as ``x`` on ``device``: ``x``'s strides when dense, else contiguous.

    Pinned host memory comes from the pool of pinned slabs (see the module notes).
    """
    stride = x.stride() if is_non_overlapping_and_dense_or_false(x) else make_contiguous_strides_for(x.shape)
    if pin_memory:
        return default_pool().empty_strided(x.size(), stride, x.dtype)
    return torch.empty_strided(x.size(), stride, dtype=x.dtype, device=device)


def torch_offload(x: torch.Tensor, device: torch.device, pin_memory: bool) -> torch.Tensor:
    """Copy ``x`` to ``device`` (host memory, usually), on the current stream.

    Args:
        x: the tensor to move (any dtype).
        device: where the copy lives.
        pin_memory: allocate pinned host memory when copying from CUDA to the
            CPU, so that the copy does not block the host.

    Returns:
        The copy, with ``x``'s strides when ``x`` is dense.

    Raises:
        ValueError: ``x`` already lives on ``device``.
    """
    device = torch.device(device)
    if x.device == device:
        raise ValueError(f"savedhooks.offload: the tensor already lives on {device}")
    pin = pin_memory and device.type == "cpu" and x.device.type == "cuda"
    host = _empty_like_layout(x, device, pin).copy_(x, non_blocking=pin)
    if pin:
        _note_copy(host)
    return host


def torch_reload(host: torch.Tensor, device: torch.device, pinned: bool) -> torch.Tensor:
    """Copy an offloaded payload back to ``device``, on the current stream.

    Args:
        host: what :func:`torch_offload` returned.
        device: the device the saved tensor came from.
        pinned: whether ``torch_offload`` was asked for pinned memory (what
            the compiled graph knows; the copy itself asks ``host``).

    Returns:
        The copy on ``device``, with ``host``'s strides when dense.

    Raises:
        ValueError: ``host`` already lives on ``device``.
    """
    device = torch.device(device)
    if host.device == device:
        raise ValueError(f"savedhooks.reload: the tensor already lives on {device}")
    asynchronous = pinned and host.is_pinned()
    back = _empty_like_layout(host, device, False).copy_(host, non_blocking=asynchronous)
    if asynchronous:
        _note_copy(host)
    return back


def torch_offload_async(x: torch.Tensor) -> torch.Tensor:
    """Start copying ``x`` into a pinned slab of the host pool on torch's transfer stream.

    torch's ``ao::offload`` with the pool's memory: the transfer stream waits for
    the current stream (which made ``x``), the copy's event is registered where
    ``ao::wait_tensor`` looks for it (by the host tensor's data pointer), and the
    slab waits on it too. The graph must call ``ao::wait_tensor(host, None, x)``
    before it frees ``x`` or reads the result.

    Args:
        x: a tensor on an accelerator, in any layout: inductor may hand over a
            padded or channels-last layout where the traced graph had a
            contiguous one (a node that a pass inserts gets no layout
            constraint), and the copy makes it contiguous.

    Returns:
        The host tensor, contiguous, its copy still running.

    Raises:
        ValueError: ``x`` is on the CPU.
    """
    if x.device.type == "cpu":
        raise ValueError("savedhooks.offload_async: needs a tensor on an accelerator, got one on the cpu")
    transfer = transfer_stream(x.device)
    current = torch.accelerator.current_stream(x.device)
    transfer.wait_stream(current)
    host = default_pool().empty_strided(x.size(), make_contiguous_strides_for(x.shape), x.dtype)
    event = register_wait(host, x.device)
    torch.accelerator.set_stream(transfer)
    try:
        host.copy_(x, non_blocking=True)
        transfer.record_event(event)
    finally:
        torch.accelerator.set_stream(current)
    default_pool().note_copy(host, event)
    return host


def _note_copy(host: torch.Tensor) -> None:
    """Tell the host pool that a copy on the current CUDA stream reads or writes ``host``'s slab."""
    event = torch.cuda.Event()
    event.record()
    default_pool().note_copy(host, event)


# --- ops: one graph node per copy, traceable inside hook graphs ---------------------------------


@torch.library.custom_op("savedhooks::offload", mutates_args=())
def offload(x: torch.Tensor, device: torch.device, pin_memory: bool) -> torch.Tensor:
    """``torch.ops.savedhooks.offload``: :func:`torch_offload` as one graph node.

    Args:
        x: the tensor to move.
        device: where the copy lives.
        pin_memory: pinned host memory for a CUDA-to-CPU copy.

    Returns:
        The copy (a new tensor: the op aliases nothing, so it traces under functionalization).

    Raises:
        ValueError: ``x`` already lives on ``device``.
    """
    return torch_offload(x, device, pin_memory)


@offload.register_fake
def _(x, device, pin_memory):
    if x.device == torch.device(device):
        raise ValueError(f"savedhooks.offload: the tensor already lives on {device}")
    return _empty_like_layout(x, device, False)


@torch.library.custom_op("savedhooks::offload_async", mutates_args=())
def offload_async(x: torch.Tensor) -> torch.Tensor:
    """``torch.ops.savedhooks.offload_async``: :func:`torch_offload_async` as one graph node.

    Only :mod:`savedhooks.compiler.overlap` puts it in graphs, followed by
    ``ao::wait_tensor(result, None, x)``.

    Args:
        x: a tensor on an accelerator (any layout).

    Returns:
        The host tensor (new, contiguous), its copy still running.

    Raises:
        ValueError: ``x`` is on the CPU.
    """
    return torch_offload_async(x)


@offload_async.register_fake
def _(x):
    if x.device.type == "cpu":
        raise ValueError("savedhooks.offload_async: needs a tensor on an accelerator, got cpu")
    return torch.empty(x.shape, dtype=x.dtype, device="cpu")


@torch.library.custom_op("savedhooks::reload", mutates_args=())
def reload(host: torch.Tensor, device: torch.device, pinned: bool) -> torch.Tensor:
    """``torch.ops.savedhooks.reload``: :func:`torch_reload` as one graph node.

    Args:
        host: what ``savedhooks::offload`` returned.
        device: the device the saved tensor came from.
        pinned: the ``pin_memory`` its offload was given: only a pinned
            payload's copy back is made asynchronous in compiled graphs.

    Returns:
        The copy on ``device``.

    Raises:
        ValueError: ``host`` already lives on ``device``.
    """
    return torch_reload(host, device, pinned)


@reload.register_fake
def _(host, device, pinned):
    if host.device == torch.device(device):
        raise ValueError(f"savedhooks.reload: the tensor already lives on {device}")
    return _empty_like_layout(host, device, False)
