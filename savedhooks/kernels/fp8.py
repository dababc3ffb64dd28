"""Scaled float8 quantize / dequantize of a 2-D tensor: the aten reference (the spec of the fp8 ops).

Layout: the codec hands over a contiguous 2-D view ``(rows, cols)`` whose last
dim is the tensor's innermost dim in memory. Scales are float32:

* ``"tensor"``: shape ``(1, 1)``, one amax over everything (two passes);
* ``"row"``: shape ``(rows, 1)``;
* ``"block"``: shape ``(rows, ceil(cols / block_size))``; the last block of a row
  may be shorter (no padding copy).

Numerics (the spec the Triton kernels must match bit for bit):

* ``scale = amax / fmax`` over the *finite* values of a group, 1 for an all-zero
  (or all-non-finite) group so zeros come back exact, at least the smallest
  normal float32 so that tiny groups never divide by zero; with ``pow2_scale``
  rounded up to a power of two (exact: a mantissa carry on the bits).
* ``q = fp8(clamp(x / scale, -fmax, fmax))`` with round-to-nearest-even, or, given
  a ``seed``, stochastic rounding with the random bits of (seed, flat index)
  (``savedhooks.kernels.fp8_stochastic``: unbiased, same scales). Non-finite
  values are never made finite. e5m2 keeps NaN and +-inf as they are. e4m3fn has
  no infinity (torch's own cast would saturate it to +-448): its two NaN codes,
  0x7F and 0xFF, carry +inf and -inf, so an additive attention mask's -inf comes
  back exact, and a NaN comes back as the infinity of its sign bit (still not
  finite). Finite neighbours keep full accuracy: amax skips non-finite values.
* ``x' = q * scale`` in float32 (e4m3fn codes 0x7F / 0xFF: +-inf), clamped to the output dtype's finite range for
  finite codes (a power-of-two scale can round fp16's 65504 up to 65536), then
  cast to the output dtype.
"""

from __future__ import annotations

import torch

from savedhooks.kernels.fp8_stochastic import random_bits, stochastic_round

__all__ = ["FP8_DTYPES", "GRANULARITIES", "torch_fp8_dequantize", "torch_fp8_quantize"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
GRANULARITIES = ("tensor", "row", "block")
# Smallest normal float32: a scale below it would make x / scale lose bits or overflow.
_MIN_SCALE = torch.finfo(torch.float32).tiny


def _pow2_ceil(v: torch.Tensor) -> torch.Tensor:
    # Positive normal float32: adding 2**23 - 1 carries into the exponent unless the
    # mantissa is already zero; masking the mantissa then leaves the next power of two.
    bits = v.view(torch.int32)
    return ((bits + 0x7FFFFF) & 0x7F800000).view(torch.float32)


# Elements per step of the reference: its float32 temporaries stay under 256 KiB
# per call (about 145 KiB quantizing, 210 KiB dequantizing), whatever the tensor
# size (groups never span rows, so chunking changes no bits). Chunks of 1 << 18 elements
# would hold a few MiB.
_CHUNK_ELEMS = 1 << 14
# Stochastic rounding adds int64 temporaries (the random bits): a quarter of the elements per step.
_STOCHASTIC_CHUNK_SHIFT = 2


def _row_chunks(rows: int, cols: int, stochastic: bool = False) -> range:
    elems = _CHUNK_ELEMS >> (_STOCHASTIC_CHUNK_SHIFT if stochastic else 0)
    return range(0, rows, max(1, elems // max(cols, 1)))


def _segments(cols: int, granularity: str, block_size: int) -> list[tuple[int, int, int]]:
    """Column ranges ``(start, end, group size)`` that view as ``(rows, groups, group size)``."""
    if granularity != "block" or block_size >= cols:
        return [(0, cols, cols)] if cols else []
    full = cols // block_size * block_size
    return [(0, full, block_size)] + ([(full, cols, cols - full)] if full < cols else [])


def _finite_amax(x3: torch.Tensor) -> torch.Tensor:
    """Per-group amax of a (rows, groups, size) float32 view, ignoring NaN and +-inf."""
    return x3.abs().nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0).amax(dim=2)


def _scale_from_amax(amax: torch.Tensor, fmax: float, pow2_scale: bool, divide=torch.div) -> torch.Tensor:
    # A tensor divisor, not a Python scalar: CUDA divides by a CPU scalar as a multiply by
    # its reciprocal (not correctly rounded); the Triton kernels divide exactly everywhere.
    # ``divide``: a correctly rounded float32 division (the decomposed form passes its own).
    scale = torch.where(amax > 0, divide(amax, torch.full_like(amax, fmax)), 1.0).clamp_min(_MIN_SCALE)
    return _pow2_ceil(scale) if pow2_scale else scale


def _chunk_index(r: int, r_end: int, c0: int, c1: int, cols: int, device: torch.device) -> torch.Tensor:
    """int64 flat indices ``row * cols + col`` of rows ``r:r_end``, columns ``c0:c1``."""
    rows = torch.arange(r, r_end, dtype=torch.int64, device=device).unsqueeze(1) * cols
    return rows + torch.arange(c0, c1, dtype=torch.int64, device=device)


def _cast(y: torch.Tensor, dtype: torch.dtype, fmax: float) -> torch.Tensor:
    # |y| <= fmax up to rounding, as the scale comes from the group's amax.
    if dtype == torch.float8_e4m3fn:
        # No inf in e4m3fn: +-inf takes the NaN code of its sign (torch's cast would saturate
        # it to +-448, and keeps a NaN's sign), which decoding turns back into +-inf.
        y = torch.where(torch.isinf(y), torch.full_like(y, float("nan")).copysign(y), y).clamp_(-fmax, fmax)
    return y.to(dtype)  # e5m2 keeps +-inf and NaN as they are


def _code_value(q: torch.Tensor) -> torch.Tensor:
    """float32 value of fp8 ``q``; e4m3fn's NaN codes are +-inf (see the numerics above)."""
    qf = q.float()
    if q.dtype == torch.float8_e4m3fn:
        qf = torch.where(torch.isnan(qf), torch.full_like(qf, float("inf")).copysign(qf), qf)
    return qf


def torch_fp8_quantize(
    x: torch.Tensor,
    dtype: torch.dtype,
    granularity: str,
    block_size: int,
    pow2_scale: bool,
    seed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D floating tensor to float8 with per-group float32 scales (aten reference).

    Args:
        x: ``(rows, cols)`` float32, bfloat16 or float16 tensor, any device.
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        granularity: ``"tensor"``, ``"row"`` or ``"block"`` (1 x block_size along dim 1).
        block_size: elements per block; ignored unless granularity is ``"block"``.
        pow2_scale: round scales up to powers of two.
        seed: None (round to nearest even), or a 0-d int64 tensor on x's device:
            stochastic rounding with the random bits of (seed, flat index), see
            ``savedhooks.kernels.fp8_stochastic``. Scales are the same either way.

    Returns:
        ``(q, scale)``: q has x's shape and ``dtype``; scale is float32 of shape
        ``(1, 1)``, ``(rows, 1)`` or ``(rows, ceil(cols / block_size))``.

    Raises:
        ValueError: x is not 2-D floating point, dtype / granularity / block_size is
            invalid, or seed is not a 0-d int64 tensor.
    """
    _check_quantize_args(x, dtype, granularity, block_size, seed)
    rows, cols = x.shape
    fmax = torch.finfo(dtype).max
    q = torch.empty((rows, cols), dtype=dtype, device=x.device)
    scale = torch.ones(_scale_shape(rows, cols, granularity, block_size), dtype=torch.float32, device=x.device)
    chunks, segments = _row_chunks(rows, cols, seed is not None), _segments(cols, granularity, block_size)
    if granularity == "tensor" and x.numel():
        amax = max(_finite_amax(x[r : r + chunks.step].float().view(1, -1, cols)).amax() for r in chunks)
        scale.copy_(_scale_from_amax(amax.reshape(1, 1), fmax, pow2_scale))
    for r in chunks:
        r_end = min(r + chunks.step, rows)
        block_index = 0
        for c0, c1, size in segments:
            x3 = x[r:r_end, c0:c1].float().view(r_end - r, -1, size)
            if granularity == "tensor":
                s = scale.view(1, 1)
            else:
                s = _scale_from_amax(_finite_amax(x3), fmax, pow2_scale)
                scale[r:r_end, block_index : block_index + s.shape[1]] = s
                block_index += s.shape[1]
            y = x3 / s.unsqueeze(2)
            if seed is not None:
                index = _chunk_index(r, r_end, c0, c1, cols, x.device)
                bits = random_bits(index, seed, below_2_32=rows * cols <= 1 << 32)
                y = stochastic_round(y, bits.view(y.shape), dtype)
            q[r:r_end, c0:c1].view(r_end - r, -1, size).copy_(_cast(y, dtype, fmax))
    return q, scale


def torch_fp8_dequantize(q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype, block_size: int) -> torch.Tensor:
    """Inverse of :func:`torch_fp8_quantize` (aten reference).

    Args:
        q: ``(rows, cols)`` float8 tensor.
        scale: float32 scales as returned by the quantize op.
        out_dtype: dtype of the result (the original tensor's).
        block_size: the block size used to quantize (only read for block scales).

    Returns:
        ``(rows, cols)`` tensor of ``out_dtype``, contiguous.

    Raises:
        ValueError: shapes or dtypes of q and scale do not fit together.
    """
    _check_dequantize_args(q, scale)
    rows, cols = q.shape
    out = torch.empty((rows, cols), dtype=out_dtype, device=q.device)
    per_block = scale.shape[1] > 1
    chunks = _row_chunks(rows, cols)
    for r in chunks:
        r_end = min(r + chunks.step, rows)
        s_rows = scale if scale.shape[0] == 1 else scale[r:r_end]
        block_index = 0
        for c0, c1, size in _segments(cols, "block" if per_block else "row", block_size):
            q3 = q[r:r_end, c0:c1].view(r_end - r, -1, size)
            groups = q3.shape[1]
            s = s_rows[:, block_index : block_index + groups] if per_block else s_rows
            block_index += groups
            out[r:r_end, c0:c1].view(r_end - r, -1, size).copy_(_rescale(_code_value(q3), s.unsqueeze(2), out_dtype))
    return out


def _rescale(
    qf: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype, inf: torch.Tensor | None = None
) -> torch.Tensor:
    """float32 ``qf * scale`` (qf: the fp8 values as float32), before the cast to ``out_dtype``.

    ``inf``: where qf is +-inf, when the caller knows it from the codes (the
    decomposed form: a float ``isinf`` runs one lane at a time in inductor's C++
    loops); tested here otherwise.
    """
    # A power-of-two scale can carry a value just past the output dtype's largest
    # finite one (fp16 65504 -> 65536): clamp finite codes, keep e5m2's +-inf as inf.
    top = torch.finfo(out_dtype).max
    return torch.where(torch.isinf(qf) if inf is None else inf, qf, (qf * scale).clamp_(-top, top))


def _check_quantize_args(
    x: torch.Tensor, dtype: torch.dtype, granularity: str, block_size: int, seed: torch.Tensor | None = None
) -> None:
    if x.dim() != 2 or not x.is_floating_point() or x.dtype in FP8_DTYPES:
        raise ValueError(f"fp8_quantize expects a 2-D float32/bfloat16/float16 tensor, got {x.dtype}{tuple(x.shape)}")
    if dtype not in FP8_DTYPES:
        raise ValueError(f"fp8_quantize: dtype must be one of {FP8_DTYPES}, got {dtype}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"fp8_quantize: granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if block_size < 1:
        raise ValueError(f"fp8_quantize: block_size must be >= 1, got {block_size}")
    if seed is not None and (not isinstance(seed, torch.Tensor) or seed.dim() != 0 or seed.dtype != torch.int64):
        got = f"{seed.dtype}{tuple(seed.shape)}" if isinstance(seed, torch.Tensor) else repr(seed)
        raise ValueError(f"fp8_quantize: seed must be None or a 0-d int64 tensor, got {got}")
    if seed is not None and seed.device != x.device:
        raise ValueError(f"fp8_quantize: seed must be on x's device {x.device}, got {seed.device}")


def _check_dequantize_args(q: torch.Tensor, scale: torch.Tensor, code_dtypes: tuple[torch.dtype, ...] = FP8_DTYPES) -> None:
    # code_dtypes: what q may be (the decomposed form stores the fp8 codes as uint8)
    if q.dim() != 2 or q.dtype not in code_dtypes or scale.dtype != torch.float32 or scale.dim() != 2:
        raise ValueError(
            f"fp8_dequantize expects 2-D {'/'.join(map(str, code_dtypes))} q and 2-D float32 scale, got "
            f"{q.dtype}{tuple(q.shape)}, {scale.dtype}{tuple(scale.shape)}"
        )


def _scale_shape(rows: int, cols: int, granularity: str, block_size: int) -> tuple[int, int]:
    if granularity == "tensor":
        return (1, 1)
    if granularity == "row":
        return (rows, 1)
    return (rows, -(-cols // block_size))
