"""Stochastic rounding of the fp8 code: the random bits and the aten reference of the rounding.

Design notes
------------
* Stochastic rounding (SR) rounds ``|y| = |x / scale|`` down to the fp8 grid point
  below it or up to the one above, up with probability (distance to the lower
  point) / (grid spacing). Then ``E[q] = y`` for every finite y in the format's
  range: the quantization error is zero-mean per element, at the cost of a larger
  variance than round to nearest (about 3 dB of SQNR: the error's variance doubles). Scales,
  saturation (finite values never round past fmax, in e5m2 too) and non-finite
  values are as with round to nearest.
* The random bits are a counter-based hash, not a random tensor: ``bits(i) =
  mix32(lo(i) ^ k0 ^ ((hi(i) ^ k1) * 0x61C88647 mod 2**32))``, where ``i`` is the element's flat index
  in the op's 2-D ``(rows, cols)`` view (row-major, whatever the strides: the
  position in memory order for the codecs' views), ``lo`` / ``hi`` its low and high
  32 bits, ``k1`` the high 32 bits of the int64 ``seed`` and ``k0`` its low 32 bits
  scrambled, ``((low ^ 0x1B873593) * 0x61C88647) mod 2**32`` (a bijection; with the
  raw low bits, as ``mix32(0) = 0``, element ``i = seed`` of a small seed would
  always get zero bits, and so always round down).
  ``mix32`` is a lowbias32-style finalizer (xorshift 16, multiply, xorshift 15,
  multiply, xorshift 15) with the multipliers ``0x21F0AAAD`` and ``0x735A2D97``
  from Chris Wellons' hash prospector (both below 2**31). Each element's bits
  depend only on (seed, i), so the aten reference computes them per chunk (no
  full-size random tensor, any chunking gives the same bits), the Triton kernel
  per tile in uint32, and inductor per element from index expressions. For a
  uniformly random low seed word the 32 bits of every element are exactly uniform
  (``mix32``, the scramble and ``^ k0`` are bijections); the codec draws the seed in
  ``[0, 2**32)`` from torch's generator. One round of ``mix32`` per element, not
  two: a round is ten int64 operations per element (two AVX2 vectors each in
  inductor's C++, which compiles slowly): a second round would add to the compile
  time of every kernel that quantizes, the first training step's above all.
* aten has no uint32 arithmetic: the hash runs in int64 on values in ``[0, 2**32)``,
  masked to 32 bits after each multiply. All multipliers are below 2**31, so no
  product reaches 2**63 (no signed overflow anywhere, in eager kernels or in
  inductor's C++); Triton computes the same values in uint32 with wrapping
  multiplies. ``k1`` is a floor division by 2**32, not a shift: inductor prints a
  shift of a scalar with a ``max_shift`` guard, a division without one.
* fp8-normal results (``|y| >= 2**(1 - bias)``): on the float32 bits ``a`` (after
  the clamp to fmax's bits), add the random low ``s = 23 - mantissa bits`` bits
  and truncate them: the kept bits go up by one exactly when ``u + (a mod 2**s)
  >= 2**s``, i.e. with probability ``(a mod 2**s) / 2**s``, exact because y has
  no bits below those (a mantissa carry runs into the exponent; fmax's dropped
  bits are zero, so nothing rounds past it).
* fp8-subnormal results: ``|y| * 2**(bias - 1 + mantissa bits)`` counts y in
  units of the smallest subnormal (exact, below ``2**mantissa bits``); in fixed
  point with 24 fraction bits, truncated to an int32 (exact up to bits of y
  below 2**-24 units), plus 24 random bits, shifted right by 24: round up with
  probability equal to the fraction truncated to 24 bits, so the mean is exact to
  within 2**-24 of a subnormal step. A count that reaches ``2**mantissa bits`` is
  the smallest normal's code.
* The reference rounds y onto the fp8 grid in float32 this way and then casts
  with torch (exact: the value is on the grid); the Triton kernel and the
  decomposed form compute the code directly. Same bytes for the same seed.
"""

from __future__ import annotations

import torch

__all__ = [
    "FMAX_BITS",
    "FP8_FORMATS",
    "HASH_MULTIPLIERS",
    "KEY_MULTIPLIER",
    "KEY_XOR",
    "mix32",
    "random_bits",
    "seed_keys",
    "stochastic_round",
]

# fp8 dtype -> (mantissa bits, exponent bias)
FP8_FORMATS = {torch.float8_e4m3fn: (3, 7), torch.float8_e5m2: (2, 15)}
# lowbias32-style finalizer constants (hash prospector), both odd and below 2**31
HASH_MULTIPLIERS = (0x21F0AAAD, 0x735A2D97)
# the scramble of the seed's low word: xor, then an odd multiplier below 2**31 (2**32 / golden ratio, negated)
KEY_XOR, KEY_MULTIPLIER = 0x1B873593, 0x61C88647
_M32 = 0xFFFFFFFF
# float32 bits of each format's fmax (448, 57344): the clamp before rounding; their low bits are zero
FMAX_BITS = {torch.float8_e4m3fn: 0x43E00000, torch.float8_e5m2: 0x47600000}
# fraction bits of the subnormal path's fixed point (and random bits it uses)
SUBNORMAL_BITS = 24


def mix32(x: torch.Tensor) -> torch.Tensor:
    """The 32-bit finalizer on int64 values in ``[0, 2**32)`` (a bijection of that range).

    Args:
        x: int64 tensor, every value in ``[0, 2**32)``.

    Returns:
        int64 tensor of x's shape, values in ``[0, 2**32)``.

    Raises:
        Nothing (values outside the range give other, unspecified bits).
    """
    m1, m2 = HASH_MULTIPLIERS
    x = x ^ (x >> 16)
    x = (x * m1) & _M32
    x = x ^ (x >> 15)
    x = (x * m2) & _M32
    return x ^ (x >> 15)


def seed_keys(seed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two 32-bit keys of an int64 seed, as int64 in ``[0, 2**32)``: its low bits scrambled, its high bits.

    Args:
        seed: int64 tensor (0-d for the ops).

    Returns:
        ``(k0, k1)``: int64 tensors of seed's shape.
    """
    k0 = (((seed & _M32) ^ KEY_XOR) * KEY_MULTIPLIER) & _M32
    return k0, torch.div(seed, 1 << 32, rounding_mode="floor") & _M32


def random_bits(index: torch.Tensor, seed: torch.Tensor, below_2_32: bool = False) -> torch.Tensor:
    """32 random bits per element: the hash of (seed, flat index) (see the design notes).

    Args:
        index: int64 tensor of non-negative flat indices in the op's ``(rows, cols)`` view.
        seed: 0-d int64 tensor.
        below_2_32: every index is below 2**32 (the caller knows): the high word's
            term is the same for all, computed once (same bits, fewer full-size ops).

    Returns:
        int64 tensor of index's shape, values in ``[0, 2**32)``.
    """
    k0, k1 = seed_keys(seed)
    if below_2_32:
        return mix32(index ^ (k0 ^ ((k1 * KEY_MULTIPLIER) & _M32)))
    high = (((index >> 32) ^ k1) * KEY_MULTIPLIER) & _M32
    return mix32((index & _M32) ^ k0 ^ high)


def stochastic_round(y: torch.Tensor, bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round float32 ``y`` (already divided by its scale) onto ``dtype``'s grid, stochastically.

    Finite values are rounded (fp8 subnormals included) and saturate at fmax;
    NaN and +-inf are returned as they are (the cast decides what they become).

    Args:
        y: float32 tensor.
        bits: int64 random bits in ``[0, 2**32)`` of y's shape (:func:`random_bits`).
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.

    Returns:
        float32 tensor of y's shape whose finite values are exactly representable in ``dtype``.

    Raises:
        KeyError: ``dtype`` is not a float8 dtype.
    """
    mantissa_bits, bias = FP8_FORMATS[dtype]
    shift = 23 - mantissa_bits
    a = y.view(torch.int32) & 0x7FFFFFFF
    low = (bits & ((1 << shift) - 1)).int()
    normal = ((a.clamp_max(FMAX_BITS[dtype]) + low) & -(1 << shift)).view(torch.float32)
    subnormal = a < ((128 - bias) << 23)  # below 2**(1 - bias)
    tiny = torch.where(subnormal, y.abs(), 0.0)  # no large or non-finite value reaches the int conversion
    units = (tiny * 2.0 ** (bias - 1 + mantissa_bits + SUBNORMAL_BITS)).int()
    count = (units + (bits & ((1 << SUBNORMAL_BITS) - 1)).int()) >> SUBNORMAL_BITS
    magnitude = torch.where(subnormal, count.float() * 2.0 ** (1 - bias - mantissa_bits), normal)
    return torch.where(torch.isfinite(y), torch.copysign(magnitude, y), y)
