"""Lossless 1-bit packing of saved bool tensors (ReLU, dropout and threshold masks)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from savedhooks.codecs.base import Codec, Layout, check_backend, from_rows, to_rows, uses_triton
from savedhooks.kernels import kernel_op

__all__ = ["Bitmask", "bitmask"]


@dataclasses.dataclass(frozen=True)
class Bitmask(Codec):
    """Configuration of the bitmask codec (see :func:`bitmask`): only where its kernels come from."""

    backend: str = "auto"

    def __post_init__(self) -> None:
        check_backend("bitmask", self.backend)

    def accepts(self, x: torch.Tensor) -> bool:
        """Non-empty bool tensors."""
        return x.dtype == torch.bool and x.numel() > 0

    def encode(self, x: torch.Tensor) -> tuple[Any, ...]:
        """``(bits, layout)``: 8 bools per byte, in memory order."""
        rows, layout = to_rows(x)
        return kernel_op("bitmask_pack", uses_triton(self.backend, x))(rows.view(-1)), layout.as_constants()

    def decode(self, payload: tuple[Any, ...]) -> torch.Tensor:
        """The bool tensor, bit for bit, with the saved tensor's shape and strides."""
        bits, constants = payload
        layout = Layout.from_constants(constants)
        numel = 1
        for size in layout.shape:
            numel *= size
        flat = kernel_op("bitmask_unpack", uses_triton(self.backend, bits))(bits, numel)
        return from_rows(flat.view(1, -1), layout)


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


@dataclasses.dataclass(frozen=True)
class SignBits(Codec):
    """Only the sign of a floating tensor (``x > 0``), 1 bit per element; decodes to 0.0 / 1.0.

    Exact for a saved value whose backward uses only compare it with 0, as
    ``threshold_backward(grad, relu_out, 0)`` does. Under torch.compile a ReLU
    output is saved twice, as itself and as a ``detach`` alias that only feeds
    ``threshold_backward``; packing the alias this way removes the second copy.
    """

    backend: str = "auto"

    def __post_init__(self) -> None:
        check_backend("sign bits", self.backend)

    def encode(self, x: torch.Tensor) -> tuple[Any, ...]:
        """``(bits of x > 0, dtype, layout)``."""
        rows, layout = to_rows(x)
        pack = kernel_op("bitmask_pack", uses_triton(self.backend, x))
        return pack((rows > 0).view(-1)), x.dtype, layout.as_constants()

    def decode(self, payload: tuple[Any, ...]) -> torch.Tensor:
        """1.0 where the value was positive, else 0.0, in the saved dtype, shape and strides."""
        bits, dtype, constants = payload
        return Bitmask(self.backend).decode((bits, constants)).to(dtype)
