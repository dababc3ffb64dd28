"""Lossless 1-bit packing of saved bool tensors (ReLU, dropout and threshold masks)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from savedhooks.codecs.backends import check_backend
from savedhooks.codecs.base import Codec
from savedhooks.codecs.bits import pack_bits, unpack_bits

__all__ = ["Bitmask", "bitmask"]


@dataclasses.dataclass(frozen=True)
class Bitmask(Codec):
    """Configuration of the bitmask codec (see :func:`bitmask`): only where its kernels come from."""

    @property
    def lossy(self) -> bool:
        """False: decoding returns the packed values bit for bit."""
        return False

    backend: str = "auto"

    def __post_init__(self) -> None:
        check_backend("bitmask", self.backend)

    def accepts(self, x: torch.Tensor) -> bool:
        """Non-empty bool tensors."""
        return x.dtype == torch.bool and x.numel() > 0

    def encode(self, x: torch.Tensor) -> tuple[Any, ...]:
        """``(bits, layout)``: 8 bools per byte, in memory order."""
        return pack_bits(x, self.backend)

    def decode(self, payload: tuple[Any, ...]) -> torch.Tensor:
        """The bool tensor, bit for bit, with the saved tensor's shape and strides."""
        return unpack_bits(payload, self.backend)


def bitmask(backend: str = "auto"):
    """Hooks that keep saved bool tensors at 1 bit per element (lossless).

    Args:
        backend: ``"auto"`` (Triton kernels on CUDA when triton imports, else the
            aten reference), ``"triton"`` or ``"aten"``; the bytes are identical.

    Returns:
        The cached :class:`~savedhooks.HookPair`. Non-bool tensors are stored as
        they are.

    Raises:
        ValueError: ``backend`` is invalid, or ``"triton"`` without triton.
    """
    return Bitmask(backend).hooks()
