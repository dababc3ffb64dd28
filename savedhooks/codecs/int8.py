"""int8 codes with float32 scales: per row (fused attention's value) and per block (what products read).

Design notes
------------
* A row is the innermost dim in memory (:func:`savedhooks.codecs.layout.to_rows`):
  for attention's query, key, value and output, one head's vector of one token.
  Its scale is its largest finite magnitude over 127, and each value is rounded
  to the nearest of 255 evenly spaced levels. fp8's e4m3 keeps 3 mantissa bits
  at any magnitude (a relative error of up to 2**-4 on every value); a
  row's int8 levels hold the large values of the row to 2**-8 of the row's
  largest and the small ones to the same absolute step. On values of one
  scale, such as a head's vector, that is closer than fp8 at the same byte
  per value (``python -m benchmarks.codec_sqnr``; the tests hold it 8 dB
  above e4m3 blocks on Gaussian rows).
* Non-finite values take the code -128 and come back as NaN (an infinity's
  sign is lost); the scale ignores them, so the row's finite values keep their
  accuracy. A row of zeros has scale 0 and comes back as zeros.
* :class:`Int8Blocks` scales each run of ``block_size`` values in memory
  order instead of each row: a block's step is its own largest over 127, so
  one large value (an outlier channel) coarsens its block only. Its energy
  error has a bound that no data breaks: each value is within half a step,
  at most ``amax / 254``, and the block holds at least ``amax**2``, so the
  block's SQNR is at least ``20 log10(254) - 10 log10(block_size)`` dB (30.0
  dB for 64 values; on Gaussian blocks about 45 dB). e4m3's relative error of
  up to 2**-4 gives about 29 dB on any data. What the int8 levels lose is
  the small values' relative precision: a value under half a step becomes 0,
  so the policy uses blocks only for readers whose backward is linear in the
  value (a product's factor, a smooth derivative), never for one that
  compares it with 0 (ReLU's mask) or reads its logarithmic range (exp's
  output): :mod:`savedhooks.codecs.tolerance`.
* The numerics are ``savedhooks.kernels.int8``: plain aten ops while a graph
  is traced (inductor fuses them into the producer's and the reader's
  kernels); in eager mode opaque ops that run them a chunk of rows at a time.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from savedhooks.codecs.base import Codec
from savedhooks.codecs.layout import Layout, blocks_view, from_rows, innermost_size, to_rows
from savedhooks.kernels.int8 import int8_dequantize, int8_quantize, torch_int8_row_dequantize, torch_int8_row_quantize

__all__ = ["Int8Blocks", "Int8Rows", "torch_int8_row_dequantize", "torch_int8_row_quantize"]



def _quantize(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 codes and scales of ``rows``: aten ops while a graph is traced, else the chunked op."""
    return torch_int8_row_quantize(rows) if torch.compiler.is_compiling() else int8_quantize(rows)


def _dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Invert :func:`_quantize` (either form reads either's payload: the same codes and scales)."""
    compiling = torch.compiler.is_compiling()
    return torch_int8_row_dequantize(codes, scale, dtype) if compiling else int8_dequantize(codes, scale, dtype)


@dataclasses.dataclass(frozen=True)
class Int8Rows(Codec):
    """int8 codes and one float32 scale per row of the saved tensor (the policy's codec for attention's operands).

    Attributes:
        min_row: the shortest row packed (default 8): a scale costs 4 bytes a
            row, so an 8-value row takes 1.5 bytes a value (bf16: 2).

    Error: the step is the row's largest finite magnitude over 127, and each
    value is within half a step; on rows of Gaussian values the codec tests
    hold the SQNR above 40 dB.
    """

    min_row: int = 8

    def __post_init__(self) -> None:
        if not isinstance(self.min_row, int) or isinstance(self.min_row, bool) or self.min_row < 1:
            raise ValueError(f"Int8Rows: min_row must be a positive int, got {self.min_row!r}")

    def accepts(self, x: torch.Tensor) -> bool:
        """Non-empty float32 / bf16 / fp16 tensors whose rows (innermost dim in memory) hold ``min_row`` values or more."""
        return (
            x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and x.numel() > 0
            and innermost_size(x) >= self.min_row
        )

    def encode(self, x: torch.Tensor) -> tuple[Any, ...]:
        """``(codes, scales, dtype, layout constants)``."""
        rows, layout = to_rows(x.detach())  # eager autograd records nothing: its ops would save tensors
        codes, scale = _quantize(rows)
        return codes, scale, x.dtype, layout.as_constants()

    def decode(self, payload: tuple[Any, ...]) -> torch.Tensor:
        """The values in the saved tensor's dtype, shape and strides."""
        codes, scale, dtype, layout = payload
        return from_rows(_dequantize(codes, scale, dtype), Layout.from_constants(layout))


@dataclasses.dataclass(frozen=True)
class Int8Blocks(Codec):
    """int8 codes and one float32 scale per ``block_size`` values in memory order (the policy's codec for factors).

    Attributes:
        block_size: values per scale (default 64: 1.0625 bytes a value). A
            tensor whose size is not a multiple of it gets a scale per row
            (its innermost dim in memory) instead.

    Error: each value is within half a step of its block's largest finite
    magnitude over 127; a block's SQNR is at least ``20 log10(254) - 10
    log10(block_size)`` dB whatever its values (30.0 dB at 64), about 45 dB
    on Gaussian blocks (the codec tests hold both). Values under half a step
    become 0, so a reader that compares values with 0 must not get them
    (the policy's tolerance rules). Non-finite values come back as NaN.
    """

    block_size: int = 64

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or isinstance(self.block_size, bool) or self.block_size < 2:
            raise ValueError(f"Int8Blocks: block_size must be an int of at least 2, got {self.block_size!r}")

    def accepts(self, x: torch.Tensor) -> bool:
        """Float32 / bf16 / fp16 tensors of at least ``block_size`` values, of concrete sizes.

        A symbolic size (dynamic shapes) is refused: which blocks a tensor
        splits into depends on its size, and a guard on it would recompile
        (the policy uses ``floating`` there).
        """
        if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return False
        return all(isinstance(s, int) for s in x.shape) and x.numel() >= self.block_size

    def encode(self, x: torch.Tensor) -> tuple[Any, ...]:
        """``(codes, scales, dtype, layout constants)``; codes and scales in the blocks' shape."""
        rows, layout = to_rows(x.detach())
        codes, scale = _quantize(blocks_view(rows, self.block_size))
        return codes, scale, x.dtype, layout.as_constants()

    decode = Int8Rows.decode  # the same payload: codes and scales of any 2-D view of the memory-order data
