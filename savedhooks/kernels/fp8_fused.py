"""Scaled float8 quantize / dequantize as plain aten ops that inductor fuses, bit-exact with the reference.

Design notes
------------
* The spec is ``savedhooks.kernels.fp8`` (module docstring): same arguments, same
  scale shapes and bits. These are plain Python functions of aten ops, not custom
  ops: AOTAutograd traces through them while it inlines the hooks, and inductor
  fuses the quantize into the kernel that reads the saved value in the forward and
  the dequantize into the kernel that consumes it in the backward (no full-size
  float buffer between them). In eager mode each op is a full-size pass: the
  opaque ops (chunked aten reference, Triton) are better there.
* No float8 dtype ever reaches a compiled kernel (torch 2.13's inductor C++ backend
  cannot vectorize ``Float8_e4m3fn``): the quantized payload is the fp8 code as
  ``uint8``, computed from the float32 bits (round to nearest even, subnormals
  included; e4m3fn: +-inf and NaN -> the NaN code of their sign, decoded as +-inf,
  clamp to 448; e5m2 keeps +-inf). Decoding rebuilds
  the float32 bits (exact) and rescales as the reference's ``_rescale`` does, with
  the infinities read from the codes (a float ``isinf`` runs one lane at a time in
  inductor's vectorized C++ loops; the integer compare vectorizes).
* The encode uses constant shift amounts only, so that inductor's C++ backend
  vectorizes the kernel it lands in (a per-element shift count, as in a generic
  "shift right by 24 - mantissa bits - exponent" rounding, left whole fused kernels
  as scalar loops). Two paths, selected with ``torch.where``:
  fp8-normal results (``|y| >= 2**(1 - bias)``) round to nearest even on the int32
  bits with constant masks (add ``2**(s-1) - 1`` plus the lowest kept bit, shift by
  ``s = 23 - mantissa bits``: 20 for e4m3fn, 21 for e5m2; a mantissa carry runs into
  the exponent, an exponent overflow into the inf pattern), then rebias the exponent
  with a constant subtraction; the clamp (448 for e4m3fn, 65536 for e5m2, which
  rounds to the inf code) comes first. fp8-subnormal results are float arithmetic:
  ``torch.round(|y| * 2**(bias - 1 + mantissa bits))`` (2**9, 2**16) is exact up
  to the rounding, which is half to even, and the integer is the code (a value that
  rounds up to the smallest normal gives its code, ``2**mantissa bits``).
* Stochastic rounding (a ``seed``): the same two paths with the random bits of
  ``savedhooks.kernels.fp8_stochastic`` added before the truncation (its design
  notes give the arithmetic). The bits come from the hash of the flat index, an
  ``arange`` that inductor turns into index expressions: nothing random is loaded
  or materialized, the hash's int64 arithmetic vectorizes (``VectorizedN<int64_t,
  2>``), and its shifts are constant too, so the quantize kernels stay vectorized
  (``test_inductor_vectorizes_the_quantize_it_fuses`` covers both roundings).
* Groups: ``(rows, groups, size)`` views of the float32 input's column segments, as
  the reference's ``_segments``: a last block shorter than ``block_size`` is its own
  segment, and the results are concatenated. (Zero padding to whole blocks and
  slicing back miscompiles in torch 2.13's C++ backend: an index that divides a
  column by the block size makes it split the column loop into ``cols // block``
  whole blocks, and the columns past them are never written; pinned by the strict
  xfail ``test_torch_inductor_loop_split_bug_drops_the_columns_past_the_last_whole_block``
  in ``tests/compile/test_compile.py``.)
* Division must be IEEE ``x / scale``. Inductor's C++ backend prints ``a / b`` (it
  replaces a division by a constant with a reciprocal multiply only off CPU), but its
  Triton codegen prints float32 ``x / y`` as the approximate ``div.full.f32`` unless
  ``eager_numerics.division_rounding`` is set. Off CPU we therefore divide in float64
  and round to float32: for division, rounding twice (53 then 24 bits) is innocuous
  when 53 >= 2 * 24 + 2 (Figueroa, "When is double rounding innocuous?", 1995), and
  fp64 ``/`` is IEEE in Triton. The scale's ``amax / fmax`` has a constant divisor,
  which inductor off CPU turns into ``amax * (1 / fmax)`` in float64; for fmax = 7 *
  2**k (448, 57344) that is still the correctly rounded float32 quotient (amax / 7
  lies either exactly on a float32 or at least 2**-27 relative from any midpoint,
  far more than the 2**-52 error).
* bf16 / fp16 inputs are widened exactly (``.float()``); outputs are cast from
  float32 with ``.to()`` (round to nearest even, as the reference).
"""

from __future__ import annotations

import torch

from savedhooks.kernels.fp8 import (
    FP8_DTYPES,
    _check_dequantize_args,
    _check_quantize_args,
    _rescale,
    _scale_from_amax,
    _scale_shape,
    _segments,
)
from savedhooks.kernels.fp8_stochastic import FMAX_BITS, SUBNORMAL_BITS, random_bits
from savedhooks.kernels.fp8_stochastic import FP8_FORMATS as _FORMATS

__all__ = ["fp8_code", "fp8_value", "fused_fp8_dequantize", "fused_fp8_quantize"]
_E4M3_MAX_BITS = 0x43E00000  # 448.0
_E5M2_INF_FROM = 0x47800000  # 65536.0: float32 magnitudes from here on are inf in e5m2
_INF_BITS = 0x7F800000


def _exact_div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 ``a / b`` for inductor's C++ and Triton codegen alike (see notes)."""
    if a.device.type == "cpu":
        return a / b
    return (a.double() / b.double()).float()


def _normal_code(a: torch.Tensor, mantissa_bits: int, bias: int) -> torch.Tensor:
    """Code (no sign) of the float32 with int32 bits ``a`` (finite, >= 0) that is normal in the fp8 format.

    Round to nearest even on the float32 bits with constant masks: adding
    ``2**(s-1) - 1`` plus the lowest kept bit carries into the kept bits exactly
    when the dropped ``s = 23 - mantissa_bits`` bits are above half, or at half with
    an odd lowest kept bit (a mantissa carry runs into the exponent, an exponent
    overflow into the inf pattern). Rebiasing the exponent is then a constant
    subtraction. Constant shifts only: inductor's C++ vectorizer keeps the loop.
    """
    shift = 23 - mantissa_bits
    rounded = a + ((1 << (shift - 1)) - 1) + ((a >> shift) & 1)
    return (rounded >> shift) - ((127 - bias) << mantissa_bits)


def _subnormal_code(magnitude: torch.Tensor, mantissa_bits: int, bias: int) -> torch.Tensor:
    """Code of a float32 magnitude below the format's smallest normal ``2**(1 - bias)``.

    ``magnitude * 2**(bias - 1 + mantissa_bits)`` is exact (a power of two, no
    overflow) and counts the magnitude in units of the smallest subnormal, so its
    round half to even (``torch.round``) is the code; a magnitude that rounds up to
    the smallest normal gives ``2**mantissa_bits``, which is that normal's code.
    """
    return torch.round(magnitude * 2.0 ** (bias - 1 + mantissa_bits)).int()


def _stochastic_normal_code(a: torch.Tensor, bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Code (no sign) of float32 bits ``a >= 0`` normal in the fp8 format, rounded stochastically.

    Clamp to fmax's bits, add the random low ``s = 23 - mantissa_bits`` bits, drop
    them (a carry rounds up), rebias: constant shifts and masks only.
    """
    mantissa_bits, bias = _FORMATS[dtype]
    shift = 23 - mantissa_bits
    rounded = a.clamp_max(FMAX_BITS[dtype]) + (bits & ((1 << shift) - 1)).int()
    return (rounded >> shift) - ((127 - bias) << mantissa_bits)


def _stochastic_subnormal_code(magnitude: torch.Tensor, bits: torch.Tensor, mantissa_bits: int, bias: int) -> torch.Tensor:
    """Code of a float32 magnitude below ``2**(1 - bias)``, rounded stochastically.

    The count of smallest subnormals in fixed point (24 fraction bits, truncated)
    plus 24 random bits, shifted right by 24.
    """
    units = (magnitude * 2.0 ** (bias - 1 + mantissa_bits + SUBNORMAL_BITS)).int()
    return (units + (bits & ((1 << SUBNORMAL_BITS) - 1)).int()) >> SUBNORMAL_BITS


def fp8_code(y: torch.Tensor, dtype: torch.dtype, random: torch.Tensor | None = None) -> torch.Tensor:
    """The fp8 code of each float32 value, as the reference's cast (from the bits, int32 arithmetic).

    Args:
        y: float32 tensor (already divided by its scale).
        dtype: ``torch.float8_e4m3fn`` (+-inf and NaN -> the NaN code of their sign,
            magnitudes clamped to 448) or ``torch.float8_e5m2`` (keeps +-inf and NaN).
        random: None (round to nearest even), or int64 random bits in ``[0, 2**32)``
            broadcastable to y (``fp8_stochastic.random_bits``): stochastic rounding,
            finite values saturate at fmax in both formats.

    Returns:
        int32 tensor of y's shape holding the codes, 0..255.

    Raises:
        KeyError: ``dtype`` is not a float8 dtype.
    """
    mantissa_bits, bias = _FORMATS[dtype]
    bits = y.view(torch.int32)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    # e4m3fn clamps to 448; in e5m2 the clamp bound 65536 rounds to the inf code itself
    top = _E4M3_MAX_BITS if dtype == torch.float8_e4m3fn else _E5M2_INF_FROM
    subnormal = a < ((128 - bias) << 23)  # below 2**(1 - bias)
    tiny = torch.where(subnormal, y.abs(), 0.0)  # no huge or NaN magnitude reaches the float -> int conversion
    if random is None:
        small, large = _subnormal_code(tiny, mantissa_bits, bias), _normal_code(a.clamp_max(top), mantissa_bits, bias)
    else:
        small = _stochastic_subnormal_code(tiny, random, mantissa_bits, bias)
        large = _stochastic_normal_code(a, random, dtype)
    code = torch.where(subnormal, small, large) | sign
    if dtype == torch.float8_e4m3fn:
        code = torch.where(a == _INF_BITS, 0x7F | sign, code)  # no inf in e4m3fn: the NaN code of its sign
    elif random is not None:
        code = torch.where(a == _INF_BITS, 0x7C | sign, code)  # the fmax clamp took e5m2's inf: put it back
    return torch.where(a > _INF_BITS, 0x7F | sign, code)  # NaN


def _inf_code(code: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Where int32 ``code`` decodes to +-inf: ``isinf`` of :func:`fp8_value`, read from the bits.

    Inductor's C++ backend computes a float ``isinf`` one lane at a time inside
    vectorized loops; the integer compare vectorizes.
    """
    if dtype == torch.float8_e4m3fn:
        return (code & 0x7F) == 0x7F  # the NaN codes carry +-inf
    mantissa_bits, _ = _FORMATS[dtype]
    return (code & 0x7F) == (((1 << (7 - mantissa_bits)) - 1) << mantissa_bits)  # exponent all ones, mantissa 0


def fp8_value(code: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float32 value of each fp8 code (exact), rebuilt from its bits.

    Args:
        code: integer tensor of fp8 codes (0..255), e.g. the ``uint8`` payload.
        dtype: the float8 dtype the codes are in.

    Returns:
        float32 tensor of code's shape.

    Raises:
        KeyError: ``dtype`` is not a float8 dtype.
    """
    # Few ops on purpose: the decode is inlined into every backward kernel that reads the value, and
    # inductor realizes a pointwise node of over 50 ops (CPU) that has several readers. The cnn's
    # ReLU masks (decode, batch norm, compare) sit just under it: two ops more would have inductor
    # compute them all up front in separate kernels, a higher step peak and a slower step.
    mantissa_bits, bias = _FORMATS[dtype]
    code = code.int()
    low = code & 0x7F  # exponent and mantissa fields
    normal = ((low << (23 - mantissa_bits)) + ((127 - bias) << 23)).view(torch.float32)
    subnormal = low.float() * 2.0 ** (1 - bias - mantissa_bits)  # exponent 0: low is the mantissa; exact
    magnitude = torch.where(low < (1 << mantissa_bits), subnormal, normal)
    if dtype == torch.float8_e4m3fn:
        magnitude = torch.where(low == 0x7F, float("inf"), magnitude)  # the NaN codes carry +-inf
    else:
        top = 0x80 - (1 << mantissa_bits)  # the all-ones exponent: inf with a zero mantissa, else NaN
        magnitude = torch.where(low >= top, torch.where(low == top, float("inf"), float("nan")), magnitude)
    return _apply_sign(magnitude, code)


def _apply_sign(magnitude: torch.Tensor, code: torch.Tensor, bitwise: bool | None = None) -> torch.Tensor:
    """``magnitude`` (float32, sign bit clear) with the sign of int32 ``code``.

    On CPU a negation (few ops: see :func:`fp8_value`). Off the CPU (``bitwise``
    None and the code not on the CPU, or ``bitwise`` True) the sign is set as a
    bit: Triton 3.6 compiles a float negation to ``0 - x``, which would decode
    code 0x80 (-0.0) to +0.0 under inductor.
    """
    if bitwise is None:
        bitwise = code.device.type != "cpu"
    if not bitwise:
        return torch.where(code >= 0x80, -magnitude, magnitude)
    return (magnitude.view(torch.int32) | ((code.int() & 0x80) << 24)).view(torch.float32)


def _finite_amax_of_bits(x3: torch.Tensor) -> torch.Tensor:
    """The reference's per-group amax over finite values, finiteness read from the float32 bits.

    Inductor's C++ backend computes ``nan_to_num``'s float ``isnan`` one lane at a
    time inside vectorized loops; the integer compare vectorizes.
    """
    finite = (x3.view(torch.int32) & 0x7FFFFFFF) < _INF_BITS
    return torch.where(finite, x3.abs(), 0.0).amax(dim=2)


def _split(x: torch.Tensor, segments: list[tuple[int, int, int]]) -> list[torch.Tensor]:
    """``(rows, groups, size)`` views of x's column segments (see the reference's ``_segments``)."""
    return [x[:, c0:c1].reshape(x.shape[0], -1, size) for c0, c1, size in segments]


def _join(parts: list[torch.Tensor]) -> torch.Tensor:
    """Invert :func:`_split`: the ``(rows, cols)`` result (``(rows, groups)`` for per-group values)."""
    flat = [p.reshape(p.shape[0], -1) for p in parts]
    return flat[0] if len(flat) == 1 else torch.cat(flat, dim=1)


def fused_fp8_quantize(
    x: torch.Tensor,
    dtype: torch.dtype,
    granularity: str,
    block_size: int,
    pow2_scale: bool,
    seed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D floating tensor to fp8 codes with float32 scales, in aten ops inductor fuses.

    The codes are the bits of :func:`savedhooks.kernels.fp8.torch_fp8_quantize`'s
    result (``q.view(torch.uint8)``), the scales are equal bit for bit.

    Args:
        x: ``(rows, cols)`` float32, bfloat16 or float16 tensor, any strides.
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` (the codes' format).
        granularity: ``"tensor"``, ``"row"`` or ``"block"`` (1 x block_size along dim 1).
        block_size: elements per block; ignored unless granularity is ``"block"``.
        pow2_scale: round scales up to powers of two.
        seed: None (round to nearest even) or a 0-d int64 tensor: stochastic
            rounding, the reference's bytes for the same seed.

    Returns:
        ``(codes, scale)``: contiguous ``uint8`` codes of x's shape; float32 scale of
        shape ``(1, 1)``, ``(rows, 1)`` or ``(rows, ceil(cols / block_size))``.

    Raises:
        ValueError: as the reference, for invalid arguments.
    """
    _check_quantize_args(x, dtype, granularity, block_size, seed)
    rows, cols = x.shape
    scale_shape = _scale_shape(rows, cols, granularity, block_size)
    if x.numel() == 0:
        return x.new_empty((rows, cols), dtype=torch.uint8), x.new_ones(scale_shape, dtype=torch.float32)
    x2 = x.float().reshape(1, -1) if granularity == "tensor" else x.float()
    segments = _segments(x2.shape[1], granularity, block_size)
    parts = _split(x2, segments)
    scales = [_scale_from_amax(_finite_amax_of_bits(p), torch.finfo(dtype).max, pow2_scale, divide=_exact_div) for p in parts]
    if seed is None:
        bits = [None] * len(parts)
    else:  # the flat index in the (rows, cols) view: an arange, index expressions for inductor
        index = torch.arange(x2.numel(), dtype=torch.int64, device=x.device).view(x2.shape)
        bits = [random_bits(i, seed) for i in _split(index, segments)]
    codes = [fp8_code(_exact_div(p, s.unsqueeze(2)), dtype, b).to(torch.uint8) for p, s, b in zip(parts, scales, bits)]
    return _join(codes).view(rows, cols), _join(scales).view(scale_shape)


def fused_fp8_dequantize(
    codes: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    out_dtype: torch.dtype,
    block_size: int,
    shape: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Inverse of :func:`fused_fp8_quantize`, in aten ops inductor fuses into the consumer.

    Same bits (NaN payloads aside) as :func:`savedhooks.kernels.fp8.torch_fp8_dequantize`
    of ``codes.view(dtype)``.

    Args:
        codes: ``(rows, cols)`` ``uint8`` fp8 codes.
        scale: float32 scales as returned by the quantize.
        dtype: the float8 dtype of the codes.
        out_dtype: dtype of the result (the original tensor's).
        block_size: the block size used to quantize (only read for block scales).
        shape: the contiguous shape the caller views the result as (the saved
            tensor's, in memory order), or None. Where a row of codes spans rows
            of ``shape`` (its innermost size is not a multiple of ``cols``: rows
            of 8 in blocks of 128) and the scales tile the codes evenly, the
            values are computed in that shape, the codes and the expanded scales
            viewed into it. Inductor indexes a view of a graph input affinely, but
            such a view of a computed ``(blocks, block_size)`` result through
            ``(i // block) * block + i % block``, which its C++ backend does not
            simplify and leaves the consuming kernel scalar (the cnn's
            ``(32, 128, 8, 8)`` convolution outputs, ``tests/kernel_ops/test_fused_codec.py``).
            Where the blocks align with the rows the view is affine already, and
            the expanded scales measured a higher backward peak (a 4-layer MLP:
            ``tests/compile/test_passes.py``). In eager mode the expanded scales are a
            full-size copy: pass a shape only while tracing for inductor.

    Returns:
        ``(rows, cols)`` contiguous tensor of ``out_dtype`` (``shape`` when given).

    Raises:
        ValueError: shapes or dtypes of codes and scale do not fit together, or
            ``dtype`` is not a float8 dtype.
    """
    _check_dequantize_args(codes, scale, (torch.uint8,))
    if dtype not in FP8_DTYPES:
        raise ValueError(f"fp8_dequantize: dtype must be one of {FP8_DTYPES}, got {dtype}")
    rows, cols = codes.shape
    if shape is not None and shape[-1] % cols and _tiles(scale, cols, block_size):
        expanded = scale.view(scale.shape[0], -1, 1).expand(rows, -1, cols // scale.shape[1])
        return _dequantize(codes.view(shape), expanded.reshape(shape), dtype, out_dtype)
    if scale.shape[1] == 1:  # row or tensor scales broadcast as they are
        out = _dequantize(codes, scale, dtype, out_dtype)
    else:
        out = _dequantize_blocks(codes, scale, dtype, out_dtype, block_size)
    return out if shape is None else out.view(shape)


def _dequantize_blocks(
    codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, out_dtype: torch.dtype, block_size: int
) -> torch.Tensor:
    """Block scales (one row of them for all rows, or one row per row): each column segment rescaled, then joined."""
    rows, cols = codes.shape
    qf, inf = fp8_value(codes, dtype), _inf_code(codes.int(), dtype)
    parts, start = [], 0
    for c0, c1, size in _segments(cols, "block", block_size):
        part, part_inf = (t[:, c0:c1].reshape(rows, -1, size) for t in (qf, inf))
        groups = part.shape[1]
        s = scale[:, start : start + groups].unsqueeze(2)
        # cast each part: a join of float32 parts made inductor store them before the cast
        parts.append(_rescale(part, s, out_dtype, part_inf).to(out_dtype))
        start += groups
    return _join(parts)


def _tiles(scale: torch.Tensor, cols: int, block_size: int) -> bool:
    """Whether each scale covers whole, equal column ranges of every row (no short last block)."""
    return scale.shape[1] == 1 or cols == scale.shape[1] * block_size


def _dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, out_dtype: torch.dtype) -> torch.Tensor:
    """``codes``' values times ``scale`` (broadcast against them), cast to ``out_dtype``."""
    return _rescale(fp8_value(codes, dtype), scale, out_dtype, _inf_code(codes.int(), dtype)).to(out_dtype)
