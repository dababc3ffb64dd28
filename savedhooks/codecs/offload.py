"""Move saved tensors to another device (host memory) in pack and back in unpack.

With an inner codec the payload is packed first and then moved: fp8 then offload
moves 4x fewer bytes than fp32 offload. Each move is one ``savedhooks::offload``
or ``savedhooks::reload`` node (:mod:`savedhooks.kernels.offload`): a copy on the
current stream, correct wherever it runs. In CUDA graphs that the reorder pass
sees, :mod:`savedhooks.hostmem.overlap` turns them into asynchronous copies on a
transfer stream, the pack's wait sunk and the reload started early.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.utils._pytree as pytree

import savedhooks.kernels.offload  # noqa: F401  (registers savedhooks::offload and savedhooks::reload)
from savedhooks.codecs.base import Codec, as_codec, is_broadcast, narrow_broadcast

__all__ = ["Offload", "offload"]


@dataclasses.dataclass(frozen=True)
class Offload(Codec):
    """Configuration of the offload codec (see :func:`offload`)."""

    inner: Codec | None = None
    device: torch.device = torch.device("cpu")
    pin_memory: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "inner", as_codec(self.inner, "offload(inner=...)"))
        try:
            object.__setattr__(self, "device", torch.device(self.device))
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"offload: device must name a torch device, got {self.device!r}") from e
        if not isinstance(self.pin_memory, bool):
            raise ValueError(f"offload: pin_memory must be a bool, got {self.pin_memory!r}")

    def accepts(self, x: torch.Tensor) -> bool:
        """Non-empty tensors of any dtype that live on another device type."""
        return x.numel() > 0 and x.device.type != self.device.type

    def encode(self, x: torch.Tensor) -> tuple[Any, ...]:
        """``(inner payload moved to device, inner index, source device)``."""
        use_inner = self.inner is not None and self.inner.accepts(x)
        expand: tuple[Any, ...] = ()
        if use_inner:
            payload = self.inner.encode(x)
        else:
            payload, expand = _unbroadcast(x)
        # Pinned host memory makes the device-to-host copy asynchronous.
        moved = pytree.tree_map_only(
            torch.Tensor, lambda t: torch.ops.savedhooks.offload(t, self.device, self.pin_memory), payload
        )
        return moved, use_inner, x.device, expand

    def decode(self, payload: tuple[Any, ...]) -> torch.Tensor:
        """Copy back to the saved tensor's device, then unpack the inner codec."""
        moved, use_inner, device, expand = payload
        back = pytree.tree_map_only(torch.Tensor, lambda t: torch.ops.savedhooks.reload(t, device), moved)
        if use_inner:
            return self.inner.decode(back)
        return back.expand(expand) if expand else back


def _unbroadcast(x: torch.Tensor) -> tuple[torch.Tensor, tuple[Any, ...]]:
    """Drop broadcast (stride-0) dims so their data moves once; return the shape to expand back to."""
    if not is_broadcast(x):
        return x, ()
    return narrow_broadcast(x), tuple(x.shape)


def offload(inner: Any = None, device: str | torch.device = "cpu", pin_memory: bool = True):
    """Hooks that keep saved tensors in another device's memory (host memory by default).

    Args:
        inner: optional codec applied before the move, e.g. ``savedhooks.fp8()``
            (a HookPair from a savedhooks codec, or a Codec object).
        device: where the payload is kept.
        pin_memory: pin host buffers so that device-to-host copies are asynchronous.

    Returns:
        The cached :class:`~savedhooks.HookPair`. Tensors already on ``device`` (or
        empty) are stored as they are.

    Raises:
        TypeError: ``inner`` is not a savedhooks codec.
        ValueError: ``device`` is not a device name or ``pin_memory`` not a bool.
    """
    return Offload(as_codec(inner, "offload(inner=...)"), device, pin_memory).hooks()
