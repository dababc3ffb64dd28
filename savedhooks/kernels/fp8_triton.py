"""Triton kernels for scaled float8 quantize / dequantize, bit-exact with the aten reference.

Design notes
------------
* The spec is ``savedhooks.kernels.fp8`` (module docstring); same op arguments,
  same 2-D ``(rows, cols)`` input (any strides: no copy), same scale shapes.
* Work unit: a *group* is one scale's segment of a row (a block, or a whole row).
  A program takes ``GROUPS`` consecutive groups as a ``(GROUPS, BLOCK)`` tile and
  walks each group in ``BLOCK``-wide steps: amax pass, scale, quantize pass, all
  in one program for ``"row"`` and ``"block"``. ``"tensor"`` takes two passes
  over the data: per-program partial amaxes, one tiny program reducing them to
  the scale, then the quantize pass; there the groups are row pieces of at most
  ``_TILE`` elements, chosen only for parallelism.
* Exact rounding: every conversion that rounds (fp32 -> fp8 code, fp32 -> bf16 /
  fp16 output) is done on the float32 bits with integer arithmetic,
  round-to-nearest-even with subnormals, mirroring c10's conversions. The
  interpreter's own casts are wrong (fp8 at binade boundaries: 124.17 -> 64, not
  128; fp8 and bf16 subnormals flushed or truncated), and the bit arithmetic does
  not depend on the GPU's conversion instructions either.
* Divisions are ``tl.div_rn`` (IEEE), as torch's tensor / tensor division; never
  a multiply by a reciprocal.
* fp8 codes are stored through a ``uint8`` view, bf16 / fp16 outputs through an
  ``int16`` view: no fp8 pointer types are needed.
* Stochastic rounding (a ``seed`` tensor, ``STOCHASTIC``): the random bits are the
  hash of ``savedhooks.kernels.fp8_stochastic`` in uint32 (wrapping multiplies)
  on the element's flat index ``row * cols + col``, the seed loaded from device
  memory (no host sync); the code is rounded as there, on the float32 bits
  (:func:`_fp8_code_stochastic`).
* NaN payloads are not part of the spec: NaN positions (and fp8 NaN codes) match,
  the payload bits of a NaN in the dequantized output may differ from torch's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from savedhooks.kernels.fp8 import _check_dequantize_args, _check_quantize_args, _scale_shape
from savedhooks.kernels.fp8_inductor import fp8_dequantize, fp8_quantize
from savedhooks.kernels.triton_support import as_triton_op, launch, runs_triton

__all__ = ["triton_fp8_dequantize", "triton_fp8_quantize"]

# Elements per program: a 4096-element fp32 tile is 16 KiB, 32 values per thread
# with 4 warps; enough bytes in flight to stream at bandwidth, few enough registers
# to keep several programs per SM. Groups longer than this are walked in steps.
_TILE = 4096
# Partial amaxes reduced per step by the one-program tensor-scale kernel.
_REDUCE_BLOCK = 1024
_TINY = 1.1754943508222875e-38  # smallest normal float32, the reference's _MIN_SCALE


# --- bit-exact conversions --------------------------------------------------------------


@triton.jit
def _rne_shift(v, s):
    """v >> s rounded to nearest, ties to even (v >= 0, 1 <= s <= 25)."""
    q = v >> s
    rem = v & ((1 << s) - 1)
    half = 1 << (s - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    return q + up.to(tl.int32)


@triton.jit
def _round_bits(a, MB: tl.constexpr, BIAS: tl.constexpr):
    """Code (no sign) of the finite float32 with bits ``a >= 0`` in a float of MB mantissa bits.

    Round to nearest even, subnormals included; an exponent overflow carries into
    the all-ones exponent (the inf pattern), as c10's conversions do.
    """
    e = a >> 23
    e_target = tl.maximum(e, 1) - 127 + BIAS
    normal = e_target >= 1
    mant = tl.where(e > 0, (a & 0x7FFFFF) | 0x800000, a & 0x7FFFFF)
    v = tl.where(normal, a - ((127 - BIAS) << 23), mant)
    s = tl.where(normal, 23 - MB, tl.minimum(24 - MB - e_target, 25))
    return _rne_shift(v, s)


@triton.jit
def _fp8_code(y, IS_E4M3: tl.constexpr):
    """float32 -> fp8 code as the reference's ``_cast`` (e4m3fn: +-inf -> NaN code of its sign, clamp to 448; e5m2: as is)."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    is_nan = a > 0x7F800000
    if IS_E4M3:
        code = _round_bits(tl.minimum(a, 0x43E00000), 3, 7) | sign  # 0x43E00000 = 448.0
        code = tl.where(a == 0x7F800000, 0x7F | sign, code)  # inf -> the NaN code of its sign
    else:
        code = tl.where(a >= 0x47800000, 0x7C, _round_bits(a, 2, 15)) | sign  # >= 65536.0 -> inf
    return tl.where(is_nan, 0x7F | sign, code)


@triton.jit
def _mix32(x):
    """The lowbias32-style finalizer of fp8_stochastic.mix32, on uint32 (multiplies wrap)."""
    x = x ^ (x >> 16)
    x = x * 0x21F0AAAD
    x = x ^ (x >> 15)
    x = x * 0x735A2D97
    return x ^ (x >> 15)


@triton.jit
def _random_bits(index, seed):
    """uint32 bits of (int64 seed, int64 flat index), as fp8_stochastic.random_bits."""
    k0 = ((seed & 0xFFFFFFFF).to(tl.uint32) ^ 0x1B873593) * 0x61C88647  # the scrambled low word
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)  # arithmetic shift: the reference's floor division
    lo = (index & 0xFFFFFFFF).to(tl.uint32)
    hi = (index >> 32).to(tl.uint32)
    return _mix32(lo ^ k0 ^ ((hi ^ k1) * 0x61C88647))


@triton.jit
def _stochastic_bits(a, y, r, MB: tl.constexpr, BIAS: tl.constexpr, TOP: tl.constexpr, SUB_SCALE: tl.constexpr):
    """Code (no sign) of finite float32 bits ``a >= 0`` (value y), rounded stochastically with bits r.

    Normal: clamp to TOP (fmax's bits), add the random low 23 - MB bits, truncate,
    rebias. Subnormal: ``|y| * SUB_SCALE`` (2**(BIAS - 1 + MB + 24)) as int32, plus
    24 random bits, shifted right by 24.
    """
    normal = ((tl.minimum(a, TOP) + (r & ((1 << (23 - MB)) - 1)).to(tl.int32)) >> (23 - MB)) - ((127 - BIAS) << MB)
    is_subnormal = a < ((128 - BIAS) << 23)
    tiny = tl.where(is_subnormal, tl.abs(y), 0.0)
    units = (tiny * SUB_SCALE).to(tl.int32)
    subnormal = (units + (r & 0xFFFFFF).to(tl.int32)) >> 24
    return tl.where(is_subnormal, subnormal, normal)


@triton.jit
def _fp8_code_stochastic(y, r, IS_E4M3: tl.constexpr):
    """float32 -> fp8 code with stochastic rounding (uint32 random bits r); non-finite as :func:`_fp8_code`."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    if IS_E4M3:  # fmax 448 = 0x43E00000; subnormal scale 2**33
        code = _stochastic_bits(a, y, r, 3, 7, 0x43E00000, 8589934592.0) | sign
        code = tl.where(a == 0x7F800000, 0x7F | sign, code)  # inf -> the NaN code of its sign
    else:  # fmax 57344 = 0x47600000; subnormal scale 2**40
        code = _stochastic_bits(a, y, r, 2, 15, 0x47600000, 1099511627776.0) | sign
        code = tl.where(a == 0x7F800000, 0x7C | sign, code)  # inf stays inf
    return tl.where(a > 0x7F800000, 0x7F | sign, code)


@triton.jit
def _fp8_value(code, IS_E4M3: tl.constexpr):
    """fp8 code -> float32, exact; the sign is set as a bit (``-0.0`` stays negative: compiled Triton writes
    ``-x`` as ``0 - x``, which is ``+0.0`` for ``x = 0``)."""
    sign = (code & 0x80) << 24
    if IS_E4M3:
        e = (code >> 3) & 0xF
        m = code & 0x7
        bits = ((e + 120) << 23) | (m << 20)
        tiny = m.to(tl.float32) * 0.001953125  # subnormal: m * 2**-9
        special = (code & 0x7F) == 0x7F
        special_value = float("inf")  # e4m3fn's NaN codes carry +-inf
    else:
        e = (code >> 2) & 0x1F
        m = code & 0x3
        bits = ((e + 112) << 23) | (m << 21)
        tiny = m.to(tl.float32) * 1.52587890625e-05  # subnormal: m * 2**-16
        special = e == 31
        special_value = tl.where(m == 0, float("inf"), float("nan"))
    magnitude = tl.where(e == 0, tiny, bits.to(tl.float32, bitcast=True))
    magnitude = tl.where(special, special_value, magnitude)
    return (magnitude.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _to_16_bits(y, MB: tl.constexpr, BIAS: tl.constexpr):
    """float32 -> bf16 (MB=7) / fp16 (MB=10) bits, round to nearest even; y finite or inf or NaN."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 16) & 0x8000
    a = bits & 0x7FFFFFFF
    inf_code = ((1 << (15 - MB)) - 1) << MB  # constexpr arithmetic: MB is one
    code = tl.where(a >= 0x7F800000, inf_code, _round_bits(a, MB, BIAS))
    code = tl.where(a > 0x7F800000, inf_code | (1 << (MB - 1)), code)  # a quiet NaN
    return (code | sign).to(tl.int16)


@triton.jit
def _load_f32(ptrs, mask, BF16_BITS: tl.constexpr):
    """Load as float32; bf16 given as int16 bits is widened exactly (the interpreter flushes its subnormals)."""
    if BF16_BITS:
        return (tl.load(ptrs, mask=mask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _finite_abs(x):
    a = tl.abs(x)
    return tl.where(a < float("inf"), a, 0.0)  # NaN and inf count as 0, as in the reference


@triton.jit
def _scale_from_amax(amax, FMAX: tl.constexpr, POW2: tl.constexpr):
    scale = tl.where(amax > 0, tl.div_rn(amax, tl.full(amax.shape, FMAX, tl.float32)), 1.0)
    scale = tl.maximum(scale, 1.1754943508222875e-38)
    if POW2:  # round up to a power of two: a mantissa carry, as the reference's _pow2_ceil
        scale = ((scale.to(tl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)
    return scale


@triton.jit
def _group_tile(pid, step, n_groups, cols, groups_per_row, group_size, GROUPS: tl.constexpr, BLOCK: tl.constexpr):
    """Groups of program ``pid`` and the columns of its ``step``-th BLOCK: (group ids, rows, cols, mask)."""
    g = pid * GROUPS + tl.arange(0, GROUPS)
    row = g // groups_per_row
    start = (g % groups_per_row) * group_size
    k = step + tl.arange(0, BLOCK)
    length = tl.minimum(group_size, cols - start)
    mask = (g < n_groups)[:, None] & (k[None, :] < length[:, None])
    col = start[:, None] + k[None, :]
    return g, row.to(tl.int64)[:, None], col.to(tl.int64), mask


# --- kernels ----------------------------------------------------------------------------


@triton.jit
def fp8_quantize_kernel(
    x_ptr, q_ptr, scale_ptr, seed_ptr, n_groups, cols, groups_per_row, group_size, stride_r, stride_c,
    FMAX: tl.constexpr, IS_E4M3: tl.constexpr, POW2: tl.constexpr, MODE: tl.constexpr, BF16_BITS: tl.constexpr,
    STOCHASTIC: tl.constexpr, GROUPS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Quantize GROUPS groups. MODE 0: own scales (row / block), stored at ``scale_ptr[g]``;
    1: only the program's amax, stored at ``scale_ptr[pid]``; 2: the one scale at ``scale_ptr[0]``.
    STOCHASTIC: round stochastically with the int64 seed at ``seed_ptr`` (else never read)."""
    pid = tl.program_id(0)
    if MODE != 2:
        amax = tl.zeros([GROUPS], dtype=tl.float32)
        for step in range(0, group_size, BLOCK):
            g, row, col, mask = _group_tile(pid, step, n_groups, cols, groups_per_row, group_size, GROUPS, BLOCK)
            x = _load_f32(x_ptr + row * stride_r + col * stride_c, mask, BF16_BITS)
            amax = tl.maximum(amax, tl.max(_finite_abs(x), axis=1))
    if MODE == 1:
        tl.store(scale_ptr + pid, tl.max(amax, axis=0))
    else:
        if MODE == 0:
            scale = _scale_from_amax(amax, FMAX, POW2)
            g = pid * GROUPS + tl.arange(0, GROUPS)
            tl.store(scale_ptr + g, scale, mask=g < n_groups)
            scale = scale[:, None]
        else:
            scale = tl.load(scale_ptr)
        for step in range(0, group_size, BLOCK):
            g, row, col, mask = _group_tile(pid, step, n_groups, cols, groups_per_row, group_size, GROUPS, BLOCK)
            x = _load_f32(x_ptr + row * stride_r + col * stride_c, mask, BF16_BITS)
            y = tl.div_rn(x, scale + tl.zeros_like(x))
            if STOCHASTIC:
                code = _fp8_code_stochastic(y, _random_bits(row * cols + col, tl.load(seed_ptr)), IS_E4M3)
            else:
                code = _fp8_code(y, IS_E4M3)
            tl.store(q_ptr + row * cols + col, code.to(tl.uint8), mask=mask)


@triton.jit
def fp8_tensor_scale_kernel(partial_ptr, scale_ptr, n, FMAX: tl.constexpr, POW2: tl.constexpr, BLOCK: tl.constexpr):
    """One program: the max of ``n`` partial amaxes, turned into the tensor's scale."""
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.load(partial_ptr + offs, mask=offs < n, other=0.0))
    total = tl.zeros_like(amax) + tl.max(amax, axis=0)
    tl.store(scale_ptr, tl.max(_scale_from_amax(total, FMAX, POW2), axis=0))


@triton.jit
def fp8_dequantize_kernel(
    q_ptr, scale_ptr, out_ptr, n_groups, cols, groups_per_row, group_size, stride_r, stride_c, scale_div,
    TOP: tl.constexpr, IS_E4M3: tl.constexpr, OUT_MB: tl.constexpr, OUT_BIAS: tl.constexpr,
    ONE_SCALE: tl.constexpr, GROUPS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Dequantize GROUPS groups; group g reads scale ``scale_ptr[g // scale_div]``, or ``scale_ptr[0]``.

    OUT_MB: 23 writes float32, 7 bfloat16, 10 float16 (through an int16 view).
    """
    pid = tl.program_id(0)
    for step in range(0, group_size, BLOCK):
        g, row, col, mask = _group_tile(pid, step, n_groups, cols, groups_per_row, group_size, GROUPS, BLOCK)
        code = tl.load(q_ptr + row * stride_r + col * stride_c, mask=mask, other=0).to(tl.int32)
        qf = _fp8_value(code, IS_E4M3)
        if ONE_SCALE:
            scale = tl.load(scale_ptr)
        else:
            scale = tl.load(scale_ptr + g // scale_div, mask=g < n_groups, other=1.0)[:, None]
        y = qf * scale
        y = tl.where(y > TOP, TOP, tl.where(y < -TOP, -TOP, y))  # NaN passes (tl.minimum may drop it)
        y = tl.where((qf == float("inf")) | (qf == -float("inf")), qf, y)
        if OUT_MB == 23:
            tl.store(out_ptr + row * cols + col, y, mask=mask)
        else:
            tl.store(out_ptr + row * cols + col, _to_16_bits(y, OUT_MB, OUT_BIAS), mask=mask)


# --- launchers: torch.library ops ------------------------------------------------------


def _tile(group_size: int) -> tuple[int, int]:
    """(GROUPS, BLOCK): BLOCK covers a group (at most _TILE wide), GROUPS fills a _TILE-element tile."""
    block = min(triton.next_power_of_2(max(group_size, 1)), _TILE)
    return _TILE // block, block


def _groups(rows: int, cols: int, group_size: int) -> tuple[int, int, int]:
    """(n_groups, groups_per_row, group_size) for groups of ``group_size`` columns (last one shorter)."""
    group_size = max(1, min(group_size, cols))
    per_row = triton.cdiv(cols, group_size)
    return rows * per_row, per_row, group_size


def triton_fp8_quantize(
    x: torch.Tensor,
    dtype: torch.dtype,
    granularity: str,
    block_size: int,
    pow2_scale: bool,
    seed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D tensor to float8 with float32 scales (Triton; ``torch.ops.savedhooks.triton_fp8_quantize``).

    Same arguments, results and bits as :func:`savedhooks.kernels.fp8.torch_fp8_quantize`.
    Runs the Triton kernels on a GPU and, under ``TRITON_INTERPRET=1``, on CPU;
    otherwise on CPU it runs the aten reference.

    Args:
        x: ``(rows, cols)`` float32, bfloat16 or float16 tensor, any strides.
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        granularity: ``"tensor"`` (two passes), ``"row"`` or ``"block"`` (one pass).
        block_size: elements per block; ignored unless granularity is ``"block"``.
        pow2_scale: round scales up to powers of two.
        seed: None (round to nearest even) or a 0-d int64 tensor on x's device:
            stochastic rounding, the reference's bytes for the same seed.

    Returns:
        ``(q, scale)``: contiguous q of x's shape and ``dtype``; float32 scale of
        shape ``(1, 1)``, ``(rows, 1)`` or ``(rows, ceil(cols / block_size))``.

    Raises:
        ValueError: as the reference, for invalid arguments.
    """
    _check_quantize_args(x, dtype, granularity, block_size, seed)
    if not runs_triton(fp8_quantize_kernel, x):
        return fp8_quantize(x, dtype, granularity, block_size, pow2_scale, seed)
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=dtype, device=x.device)
    if x.numel() == 0:
        return q, torch.ones(_scale_shape(rows, cols, granularity, block_size), dtype=torch.float32, device=x.device)
    scale = torch.empty(_scale_shape(rows, cols, granularity, block_size), dtype=torch.float32, device=x.device)
    bf16_bits = x.dtype == torch.bfloat16
    consts = {"FMAX": torch.finfo(dtype).max, "IS_E4M3": dtype == torch.float8_e4m3fn, "POW2": pow2_scale,
              "BF16_BITS": bf16_bits}  # fmt: skip
    args = (x.view(torch.int16) if bf16_bits else x, q.view(torch.uint8))
    stochastic = seed is not None
    if granularity != "tensor":
        n_groups, per_row, size = _groups(rows, cols, block_size if granularity == "block" else cols)
        groups, block = _tile(size)
        grid = (triton.cdiv(n_groups, groups),)
        launch(fp8_quantize_kernel, grid, *args, scale, seed if stochastic else scale, n_groups, cols, per_row, size,
               *x.stride(), MODE=0, STOCHASTIC=stochastic, GROUPS=groups, BLOCK=block, **consts)  # fmt: skip
        return q, scale
    n_groups, per_row, size = _groups(rows, cols, _TILE)
    groups, block = _tile(size)
    grid = (triton.cdiv(n_groups, groups),)
    partial = torch.empty(grid[0], dtype=torch.float32, device=x.device)
    launch(fp8_quantize_kernel, grid, *args, partial, partial, n_groups, cols, per_row, size, *x.stride(),
           MODE=1, STOCHASTIC=False, GROUPS=groups, BLOCK=block, **consts)  # fmt: skip
    launch(fp8_tensor_scale_kernel, (1,), partial, scale, grid[0], FMAX=consts["FMAX"], POW2=pow2_scale,
           BLOCK=_REDUCE_BLOCK)  # fmt: skip
    launch(fp8_quantize_kernel, grid, *args, scale, seed if stochastic else scale, n_groups, cols, per_row, size,
           *x.stride(), MODE=2, STOCHASTIC=stochastic, GROUPS=groups, BLOCK=block, **consts)  # fmt: skip
    return q, scale


triton_fp8_quantize = as_triton_op("savedhooks::triton_fp8_quantize", triton_fp8_quantize, fp8_quantize_kernel)

# output dtype -> (OUT_MB, OUT_BIAS): mantissa bits and exponent bias of its bits (23: stored as float32)
_OUT_FORMATS = {torch.float32: (23, 127), torch.bfloat16: (7, 127), torch.float16: (10, 15)}


def triton_fp8_dequantize(q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype, block_size: int) -> torch.Tensor:
    """Inverse of :func:`triton_fp8_quantize` (``torch.ops.savedhooks.triton_fp8_dequantize``).

    Same arguments, result and bits (NaN payloads aside) as
    :func:`savedhooks.kernels.fp8.torch_fp8_dequantize`; runs where
    :func:`triton_fp8_quantize` runs its kernels, else the aten reference.

    Args:
        q: ``(rows, cols)`` float8 tensor, any strides.
        scale: float32 scales as returned by the quantize op.
        out_dtype: float32, bfloat16 or float16.
        block_size: the block size used to quantize (only read for block scales).

    Returns:
        ``(rows, cols)`` contiguous tensor of ``out_dtype``.

    Raises:
        ValueError: shapes or dtypes of q and scale do not fit together, or
            ``out_dtype`` is not float32 / bfloat16 / float16.
    """
    _check_dequantize_args(q, scale)
    if out_dtype not in _OUT_FORMATS:
        raise ValueError(f"fp8_dequantize: out_dtype must be one of {tuple(_OUT_FORMATS)}, got {out_dtype}")
    if not runs_triton(fp8_dequantize_kernel, q):
        return fp8_dequantize(q, scale, out_dtype, block_size)
    rows, cols = q.shape
    out = torch.empty((rows, cols), dtype=out_dtype, device=q.device)
    if q.numel() == 0:
        return out
    if scale.numel() > 1 and scale.shape[0] == 1:  # one row of scales for every row, as the reference allows
        scale = scale.expand(rows, scale.shape[1])
    scale = scale.contiguous()
    if scale.shape[1] > 1:  # block scales: a group is a block, scale index g
        (n_groups, per_row, size), scale_div = _groups(rows, cols, block_size), 1
    else:  # one scale per row (index g // per_row) or per tensor: groups only split rows
        n_groups, per_row, size = _groups(rows, cols, _TILE)
        scale_div = per_row
    groups, block = _tile(size)
    out_mb, out_bias = _OUT_FORMATS[out_dtype]
    launch(fp8_dequantize_kernel, (triton.cdiv(n_groups, groups),), q.view(torch.uint8), scale,
           out if out_mb == 23 else out.view(torch.int16), n_groups, cols, per_row, size, *q.stride(), scale_div,
           TOP=torch.finfo(out_dtype).max, IS_E4M3=q.dtype == torch.float8_e4m3fn, OUT_MB=out_mb,
           OUT_BIAS=out_bias, ONE_SCALE=scale.numel() == 1, GROUPS=groups,
           BLOCK=block)  # fmt: skip
    return out


triton_fp8_dequantize = as_triton_op("savedhooks::triton_fp8_dequantize", triton_fp8_dequantize, fp8_dequantize_kernel)
