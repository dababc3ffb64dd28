"""Move saved tensors to another device (host memory) in pack and back in unpack.

With an inner codec the payload is packed first and then moved: fp8 then offload
moves 4x fewer bytes than fp32 offload. Each move is one ``savedhooks::offload``
or ``savedhooks::reload`` node (:mod:`savedhooks.kernels.offload`): a copy on the
current stream, correct wherever it runs. In CUDA graphs that the reorder pass
sees, :mod:`savedhooks.compiler.overlap` turns them into asynchronous copies on a
transfer stream, the pack's wait sunk and the reload started early.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

import savedhooks.kernels.offload  # noqa: F401  (registers savedhooks::offload and savedhooks::reload)
from savedhooks._torch import pytree
from savedhooks.codecs.base import Codec, as_codec
from savedhooks.codecs.layout import is_broadcast, narrow_broadcast
from savedhooks.hooks.contract import hook_context
from savedhooks.memory.sizes import tensor_nbytes
from savedhooks.memory.timing import TransferModel, backward_seconds_before_use

__all__ = ["Offload", "offload"]


@dataclasses.dataclass(frozen=True)
class Offload(Codec):
    """Configuration of the offload codec (see :func:`offload`)."""

    @property
    def lossy(self) -> bool:
        """Whether the inner codec is lossy (a move alone is exact)."""
        return self.inner is not None and self.inner.lossy

    inner: Codec | None = None
    device: torch.device = torch.device("cpu")
    pin_memory: bool = True
    min_bytes: int = 1024
    keep_needed_soon: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "inner", as_codec(self.inner, "offload(inner=...)"))
        try:
            object.__setattr__(self, "device", torch.device(self.device))
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"offload: device must name a torch device, got {self.device!r}") from e
        if not isinstance(self.pin_memory, bool):
            raise ValueError(f"offload: pin_memory must be a bool, got {self.pin_memory!r}")
        if not isinstance(self.min_bytes, int) or isinstance(self.min_bytes, bool) or self.min_bytes < 0:
            raise ValueError(f"offload: min_bytes must be a non-negative int, got {self.min_bytes!r}")
        if not isinstance(self.keep_needed_soon, bool):
            raise ValueError(f"offload: keep_needed_soon must be a bool, got {self.keep_needed_soon!r}")

    def accepts(self, x: torch.Tensor) -> bool:
        """Non-empty tensors of at least ``min_bytes``, of any dtype, that live on another device type."""
        return x.numel() > 0 and x.device.type != self.device.type and x.numel() * x.element_size() >= self.min_bytes

    def encode(self, x: torch.Tensor) -> tuple[Any, ...]:
        """``(payload, inner used, source device, shape to expand back to, moved)``.

        The payload is the inner codec's (or ``x`` without broadcast dims), on
        ``device`` when it moved; it stays on the source device when the backward
        needs it before a copy back could end (``keep_needed_soon``).
        """
        use_inner = self.inner is not None and self.inner.accepts(x)
        expand: tuple[Any, ...] = ()
        if use_inner:
            payload = self.inner.encode(x)
        else:
            payload, expand = _unbroadcast(x)
        if self.keep_needed_soon and _needed_soon(payload):
            return payload, use_inner, x.device, expand, False
        # Pinned host memory makes the device-to-host copy asynchronous.
        moved = pytree.tree_map_only(
            torch.Tensor, lambda t: torch.ops.savedhooks.offload(t, self.device, self.pin_memory), payload
        )
        return moved, use_inner, x.device, expand, True

    def decode(self, payload: tuple[Any, ...]) -> torch.Tensor:
        """Copy back to the saved tensor's device (if it moved), then unpack the inner codec."""
        back, use_inner, device, expand, moved = payload
        if moved:
            back = pytree.tree_map_only(
                torch.Tensor, lambda t: torch.ops.savedhooks.reload(t, device, self.pin_memory), back
            )
        if use_inner:
            return self.inner.decode(back)
        return back.expand(expand) if expand else back


def _needed_soon(payload: Any) -> bool:
    """Under compile: whether the backward reads the saved value before its copy back could end.

    The copy back can overlap at most the backward compute that runs before the
    value's first use (:func:`savedhooks.memory.timing.backward_seconds_before_use`);
    a value needed sooner (the last layers' activations) would be reloaded at
    once and its copy stall the backward, for no memory saved at the step's peak.
    In eager mode there is no backward graph to look at: False.
    """
    ctx = hook_context()
    if ctx is None:
        return False
    model = TransferModel()
    nbytes = sum(tensor_nbytes(t) for t in pytree.tree_leaves(payload) if isinstance(t, torch.Tensor))
    return backward_seconds_before_use(ctx.node.name, ctx.bw_graph, model) < nbytes / model.bandwidth()


def _unbroadcast(x: torch.Tensor) -> tuple[torch.Tensor, tuple[Any, ...]]:
    """Drop broadcast (stride-0) dims so their data moves once; return the shape to expand back to."""
    if not is_broadcast(x):
        return x, ()
    return narrow_broadcast(x), tuple(x.shape)


def offload(
    inner: Any = None,
    device: str | torch.device = "cpu",
    pin_memory: bool = True,
    min_bytes: int = 1024,
    keep_needed_soon: bool = True,
):
    """Hooks that keep saved tensors in another device's memory (host memory by default).

    Args:
        inner: optional codec applied before the move, e.g. ``savedhooks.fp8()``
            (a HookPair from a savedhooks codec, or a Codec object).
        device: where the payload is kept.
        pin_memory: pin host buffers so that device-to-host copies are asynchronous.
        min_bytes: smaller saved tensors are stored as they are (a copy's fixed
            cost outweighs what it frees; torchtune's threshold is 1024 bytes).
        keep_needed_soon: under compile, keep on the device (packed by ``inner``)
            what the backward reads before its copy back could end: the modelled
            backward compute before the value's first use is shorter than the
            copy (the last layers' activations).

    Returns:
        The cached :class:`~savedhooks.HookPair`. Tensors already on ``device`` (or
        empty) are stored as they are, and so is a log-softmax saved outside
        compiled graphs (an eager loss's, read back right after it is saved: a
        round trip that frees nothing;
        :func:`savedhooks.codecs.placement.saved_for_an_eager_loss`).

    Raises:
        TypeError: ``inner`` is not a savedhooks codec.
        ValueError: ``device`` is not a device name, ``pin_memory`` or
            ``keep_needed_soon`` not a bool, or ``min_bytes`` negative.
    """
    codec = Offload(as_codec(inner, "offload(inner=...)"), device, pin_memory, min_bytes, keep_needed_soon)
    return codec.hooks()
