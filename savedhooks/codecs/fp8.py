"""Scaled float8 packing of saved floating tensors: 1 byte per element plus scales.

The numerics live in ``savedhooks.kernels.fp8`` (the aten reference is the spec;
Triton kernels must match it bit for bit). This file is the codec around them:
configuration checks, layout, and what unpack needs to rebuild the tensor.

Rounding: to nearest even (default), or stochastic (``rounding="stochastic"``):
unbiased, each pack draws an int64 seed from torch's generator on the tensor's
device (``torch.randint``; reproducible under ``torch.manual_seed``, a graph op
under torch.compile) and the kernels derive each element's random bits from
(seed, index), so every backend writes the same bytes for the same seed.

Non-finite values: +-inf comes back exact; e4m3fn has no infinity, so its two NaN
codes carry +inf and -inf, and a NaN comes back as the infinity of its sign (e5m2
keeps NaN). Scales ignore non-finite values, so the finite values of the same
group keep full accuracy.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from savedhooks.codecs.backends import check_backend, inductor_traces, uses_fused, uses_triton
from savedhooks.codecs.base import Codec
from savedhooks.codecs.layout import Layout, blocks_view, from_rows, innermost_size, to_rows
from savedhooks.kernels import kernel_op
from savedhooks.kernels.fp8 import FP8_DTYPES, GRANULARITIES
from savedhooks.kernels.fp8_fused import fused_fp8_dequantize, fused_fp8_quantize

__all__ = ["ROUNDINGS", "Float8", "fp8"]

ROUNDINGS = ("nearest", "stochastic")


@dataclasses.dataclass(frozen=True)
class Float8(Codec):
    """Configuration of the float8 codec (see :func:`fp8`)."""

    dtype: torch.dtype = torch.float8_e4m3fn
    granularity: str = "block"
    block_size: int = 128
    pow2_scale: bool = False
    backend: str = "auto"
    rounding: str = "nearest"

    def __post_init__(self) -> None:
        if self.dtype not in FP8_DTYPES:
            raise ValueError(f"fp8: dtype must be one of {FP8_DTYPES}, got {self.dtype}")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"fp8: granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        if not isinstance(self.block_size, int) or isinstance(self.block_size, bool) or self.block_size < 1:
            raise ValueError(f"fp8: block_size must be a positive int, got {self.block_size!r}")
        if not isinstance(self.pow2_scale, bool):
            raise ValueError(f"fp8: pow2_scale must be a bool, got {self.pow2_scale!r}")
        check_backend("fp8", self.backend, fused=True)
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"fp8: rounding must be one of {ROUNDINGS}, got {self.rounding!r}")

    def accepts(self, x: torch.Tensor) -> bool:
        """Non-empty fp32 / bf16 / fp16 tensors whose innermost dim is longer than 1.

        Float8 and float64 are left alone. So are columns of scalars ((B, T, 1)
        normalization statistics, 0-d tensors): a scale per value would cost more
        than the value, and their precision matters most.
        """
        return x.dtype in (torch.float32, torch.bfloat16, torch.float16) and x.numel() > 0 and innermost_size(x) > 1

    def encode(self, x: torch.Tensor) -> tuple[Any, ...]:
        """Quantize ``x``: ``(q, scale, dtype, layout constants, fused)``.

        ``fused``: q holds the fp8 codes as uint8, made by the decomposed form (same
        bytes as the op's float8 q); a constant, so it is baked into the unpack graph.
        Stochastic rounding draws the seed here (:meth:`_seed`); the payload does not
        need it.
        """
        rows, layout = to_rows(x)
        fused = uses_fused(self.backend, x)
        quantize = fused_fp8_quantize if fused else kernel_op("fp8_quantize", uses_triton(self.backend, x))
        args = (self._groups_view(rows), self.dtype, self.granularity, self.block_size, self.pow2_scale)
        q, scale = quantize(*args) if self.rounding == "nearest" else quantize(*args, self._seed(x))
        return q, scale, x.dtype, layout.as_constants(), fused

    @staticmethod
    def _seed(x: torch.Tensor) -> torch.Tensor:
        """A 0-d int64 seed in ``[0, 2**32)`` from torch's generator on x's device.

        Uniform low 32 bits make every element's random bits exactly uniform (see
        ``savedhooks.kernels.fp8_stochastic``). ``torch.randint``, not Python's
        random: ``torch.manual_seed`` reproduces it, and under torch.compile it is a
        node of the traced forward graph (inductor generates its own draw).
        """
        return torch.randint(0, 1 << 32, (), dtype=torch.int64, device=x.device)

    def decode(self, payload: tuple[Any, ...]) -> torch.Tensor:
        """Dequantize to the saved tensor's dtype, shape and strides, in the form that made the payload."""
        q, scale, dtype, layout, fused = payload
        layout = Layout.from_constants(layout)
        if fused:  # for inductor, computed in the saved tensor's shape: see fused_fp8_dequantize
            shape = layout.shape if layout.shape and inductor_traces() else None
            rows = fused_fp8_dequantize(q, scale, self.dtype, dtype, self.block_size, shape)
        else:
            rows = kernel_op("fp8_dequantize", uses_triton(self.backend, q))(q, scale, dtype, self.block_size)
        return from_rows(rows, layout)

    def _groups_view(self, rows: torch.Tensor) -> torch.Tensor:
        """The 2-D view the kernel quantizes; same values, blocks laid out for fewer scales and chunking."""
        if self.granularity != "block":
            return rows
        # A narrow inner dim (C=3 channels_last) would pay a scale per few values: blocks run
        # across rows instead, when a row has fewer bytes than half a block has values (float32
        # rows under block_size / 8 values, 16-bit rows under block_size / 4: the 4-byte scale
        # would cost more than 1/16 of the row). Moderately short rows keep their own scale.
        if 2 * rows.shape[1] * rows.element_size() < self.block_size:
            rows = rows.reshape(1, -1)
        return blocks_view(rows, self.block_size, short_rows=False)


def fp8(
    dtype: torch.dtype = torch.float8_e4m3fn,
    granularity: str = "block",
    block_size: int = 128,
    pow2_scale: bool = False,
    backend: str = "auto",
    rounding: str = "nearest",
):
    """Hooks that keep saved floating tensors in float8 with float32 scales.

    Args:
        dtype: ``torch.float8_e4m3fn`` (more precision, max 448) or
            ``torch.float8_e5m2`` (more range, max 57344).
        granularity: ``"tensor"`` (one scale), ``"row"`` (one per row of the
            innermost dim in memory) or ``"block"`` (1 x ``block_size`` tiles
            along it; rows of fewer bytes than ``block_size / 2`` (float32
            rows under ``block_size / 8`` values, bf16 / fp16 rows under
            ``block_size / 4``) are blocked as one flat row, and rows wider
            than a block but not a multiple of it run on across row ends when
            the tensor's size is a multiple of ``block_size``; otherwise a
            last block may be shorter).
        block_size: elements per block for ``"block"``.
        pow2_scale: round scales up to powers of two (re-quantizing an unpacked
            tensor then gives it back exactly).
        backend: ``"auto"`` (in graphs inductor compiles, the decomposed form that
            inductor fuses; elsewhere the Triton kernels on CUDA when triton imports,
            else the aten reference), ``"fused"`` (always the decomposed form),
            ``"triton"`` or ``"aten"`` (always that op); the bytes are identical.
        rounding: ``"nearest"`` (round to nearest even) or ``"stochastic"``: round
            up or down with probability proportional to the distance, so the
            dequantized value is unbiased (``E[x'] = x``); the price is a larger
            error (for values spread evenly within a spacing, twice the mean
            square of round to nearest's).
            Each pack draws a seed with ``torch.randint`` on the tensor's device,
            so it advances torch's generator (reproducible under
            ``torch.manual_seed``).

    Returns:
        The cached :class:`~savedhooks.HookPair` (equal arguments, same object).
        Integer, bool and float64 tensors are stored as they are, and so is a
        log-softmax saved outside compiled graphs (an eager loss's:
        :func:`savedhooks.codecs.placement.saved_for_an_eager_loss`).

    Raises:
        ValueError: an argument is out of range, ``rounding`` is not one of
            ``"nearest"`` / ``"stochastic"``, or ``backend="triton"`` without triton.
    """
    return Float8(dtype, granularity, block_size, pow2_scale, backend, rounding).hooks()
