"""int8 codes with a float32 scale per row: the aten reference and its opaque ``torch.library`` ops.

Design notes
------------
* A row's scale is its largest finite magnitude over 127; each value is
  rounded (half to even) to the nearest multiple, a code in [-127, 127]; a
  non-finite value takes the code -128 and comes back as NaN. A row of zeros
  has scale 0 and comes back as zeros.
* :func:`torch_int8_row_quantize` and :func:`torch_int8_row_dequantize` are
  plain aten ops: inductor fuses them into the producer's and the reader's
  kernels (the codecs call them while a graph is traced). In eager mode the
  ops ``savedhooks::int8_quantize`` and ``savedhooks::int8_dequantize`` run
  them a chunk of rows at a time, so
  that their float32 temporaries stay small next to the tensor: on CPU chunks
  of 2**14 values (as the fp8 reference), elsewhere 2**22 (a chunk is a few
  kernel launches).
"""

from __future__ import annotations

import torch

__all__ = ["int8_dequantize", "int8_quantize", "torch_int8_row_dequantize", "torch_int8_row_quantize"]

LEVELS = 127
NON_FINITE = -128
_CHUNK_ELEMS = {"cpu": 1 << 14}
_DEVICE_CHUNK_ELEMS = 1 << 22


def torch_int8_row_quantize(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a ``(rows, cols)`` floating tensor to int8 codes with one float32 scale per row.

    Args:
        rows: a 2-D float32, bf16 or fp16 tensor.

    Returns:
        ``(codes, scales)``: int8 codes of ``rows``' shape, ``round(x / scale)``
        in [-127, 127] and -128 for a non-finite value; float32 scales of shape
        ``(rows, 1)``, each row's largest finite magnitude over 127.
    """
    x = rows.float()
    infinite = ~torch.isfinite(x)
    # in place where the result is a temporary: one float32 buffer the size of ``rows`` at a time
    scale = x.abs().masked_fill_(infinite, 0.0).amax(dim=-1, keepdim=True) / LEVELS
    inverse = torch.where(scale > 0, 1.0 / scale, 0.0)
    codes = (x * inverse).round_().clamp_(-LEVELS, LEVELS).masked_fill_(infinite, NON_FINITE)
    return codes.to(torch.int8), scale


def torch_int8_row_dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Invert :func:`torch_int8_row_quantize`.

    Args:
        codes: the int8 codes, ``(rows, cols)``.
        scale: the float32 scales, ``(rows, 1)``.
        dtype: the dtype to return.

    Returns:
        ``codes * scale`` in ``dtype``, NaN where the code is -128.
    """
    values = codes.float().mul_(scale).masked_fill_(codes == NON_FINITE, float("nan"))
    return values.to(dtype)


def _chunk_rows(x: torch.Tensor) -> int:
    """Rows of ``x`` (2-D) per chunk."""
    return max(1, _CHUNK_ELEMS.get(x.device.type, _DEVICE_CHUNK_ELEMS) // max(x.shape[1], 1))


@torch.library.custom_op("savedhooks::int8_quantize", mutates_args=())
def int8_quantize(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.savedhooks.int8_quantize``: :func:`torch_int8_row_quantize`, a chunk of rows at a time."""
    step = _chunk_rows(rows)
    if rows.shape[0] <= step:
        return torch_int8_row_quantize(rows)
    codes = torch.empty(rows.shape, dtype=torch.int8, device=rows.device)
    scale = torch.empty(rows.shape[0], 1, dtype=torch.float32, device=rows.device)
    for start in range(0, rows.shape[0], step):
        chunk = slice(start, start + step)
        codes[chunk], scale[chunk] = torch_int8_row_quantize(rows[chunk])
    return codes, scale


@int8_quantize.register_fake
def _(rows):
    return rows.new_empty(rows.shape, dtype=torch.int8), rows.new_empty((rows.shape[0], 1), dtype=torch.float32)


@torch.library.custom_op("savedhooks::int8_dequantize", mutates_args=())
def int8_dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``torch.ops.savedhooks.int8_dequantize``: :func:`torch_int8_row_dequantize`, a chunk of rows at a time."""
    step = _chunk_rows(codes)
    if codes.shape[0] <= step:
        return torch_int8_row_dequantize(codes, scale, dtype)
    out = torch.empty(codes.shape, dtype=dtype, device=codes.device)
    for start in range(0, codes.shape[0], step):
        chunk = slice(start, start + step)
        out[chunk] = torch_int8_row_dequantize(codes[chunk], scale[chunk], dtype)
    return out


@int8_dequantize.register_fake
def _(codes, scale, dtype):
    return codes.new_empty(codes.shape, dtype=dtype)
