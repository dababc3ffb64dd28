"""Lossy dtype cast of saved floating tensors (e.g. fp32 -> bf16 and back)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from savedhooks.codecs.base import Codec

__all__ = ["Downcast", "downcast"]


@dataclasses.dataclass(frozen=True)
class Downcast(Codec):
    """Configuration of the downcast codec (see :func:`downcast`)."""

    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"downcast: dtype must be a floating torch.dtype, got {self.dtype!r}")
        if self.dtype.itemsize == 1:  # a plain cast to float8 saturates +-inf to finite values
            raise ValueError(f"downcast: {self.dtype} needs scales; use savedhooks.fp8(dtype={self.dtype})")

    def encode(self, x: torch.Tensor) -> tuple[Any, ...]:
        """``(x.to(dtype), original dtype)``; a no-op (no copy) when the dtype already matches."""
        return x.to(self.dtype), x.dtype

    def decode(self, payload: tuple[Any, ...]) -> torch.Tensor:
        """Cast back to the saved tensor's dtype."""
        y, dtype = payload
        return y.to(dtype)


def downcast(dtype: torch.dtype = torch.bfloat16):
    """Hooks that keep saved floating tensors in a smaller floating dtype.

    Args:
        dtype: the storage dtype, e.g. ``torch.bfloat16`` (range of fp32, 8-bit
            mantissa) or ``torch.float16`` (10-bit mantissa, max 65504). Values
            beyond the dtype's range become +-inf, as torch's cast makes them
            (visible in the gradients, never silent).

    Returns:
        The cached :class:`~savedhooks.HookPair`. Non-floating tensors are stored
        as they are, and so is a log-softmax saved outside compiled graphs (an
        eager loss's: :func:`savedhooks.codecs.placement.saved_for_an_eager_loss`);
        a tensor already of ``dtype`` round-trips bit-exactly.

    Raises:
        ValueError: ``dtype`` is not a floating dtype.
    """
    return Downcast(dtype).hooks()
