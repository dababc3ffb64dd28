"""One bit per element: the bit packing that the bitmask codec and the sign-only form share.

:func:`pack_bits` / :func:`unpack_bits` hold a bool tensor at 8 elements per
byte in memory order (:mod:`savedhooks.codecs.layout`). :class:`SignBits` keeps
only ``x > 0`` of a floating tensor: exact for a saved value whose backward uses
only compare it with 0, as ``threshold_backward(grad, relu_out, 0)`` does. Under
torch.compile a ReLU output is saved twice, as itself and as a ``detach`` alias
that only feeds ``threshold_backward``; packing the alias this way removes the
second copy (:func:`savedhooks.codecs.base.sign_only_in_backward`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from savedhooks.codecs.backends import check_backend, uses_triton
from savedhooks.codecs.layout import Layout, from_rows, to_rows
from savedhooks.kernels import kernel_op

__all__ = ["SignBits", "pack_bits", "unpack_bits"]


def pack_bits(x: torch.Tensor, backend: str) -> tuple[Any, ...]:
    """Pack a bool tensor at 1 bit per element.

    Args:
        x: a bool tensor of any shape and strides.
        backend: one of :data:`savedhooks.codecs.backends.BACKENDS`.

    Returns:
        ``(bits, layout constants)``: 8 bools per byte, in memory order.
    """
    rows, layout = to_rows(x)
    return kernel_op("bitmask_pack", uses_triton(backend, x))(_dense(x, rows, layout)), layout.as_constants()


def _dense(x: torch.Tensor, rows: torch.Tensor, layout: Layout) -> torch.Tensor:
    """What the pack op reads: ``x`` itself where it is contiguous, else its rows, flat (the same bits).

    Under inductor, the op reading a view of a value that other kernels also
    read has inductor write the view out as a buffer of its own, and the value's
    producer (a dropout mask drawn from random floats) is then kept alive for
    both: the saved tensor itself is stored once, and read by every user.
    """
    if x.dim() > 0 and not layout.expand and x.is_contiguous():
        return x
    return rows.view(-1)


def unpack_bits(payload: tuple[Any, ...], backend: str) -> torch.Tensor:
    """Invert :func:`pack_bits`.

    Args:
        payload: what :func:`pack_bits` returned.
        backend: one of :data:`savedhooks.codecs.backends.BACKENDS`.

    Returns:
        The bool tensor, bit for bit, with the packed tensor's shape and strides.
    """
    bits, constants = payload
    layout = Layout.from_constants(constants)
    numel = 1
    for size in layout.shape:
        numel *= size
    flat = kernel_op("bitmask_unpack", uses_triton(backend, bits))(bits, numel)
    return from_rows(flat.view(1, -1), layout)


@dataclasses.dataclass(frozen=True)
class SignBits:
    """Only the sign of a floating tensor (``x > 0``), 1 bit per element; decodes to 0.0 / 1.0 (see the module notes).

    Attributes:
        backend: where the bit kernels come from (:data:`savedhooks.codecs.backends.BACKENDS`).
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
        return unpack_bits((bits, constants), self.backend).to(dtype)
