"""Round-trip SQNR and bytes per element of each codec: ``python -m benchmarks.codec_sqnr``.

Inputs are fp32 (bool for bitmask), 4096 x 1024, seed 0: Gaussian, and
"heavy-tailed" Gaussian rows scaled by log-normal magnitudes (exp(3 N(0,1)),
about ten decades), where SQNR is the mean over rows so that small rows count.
Stochastic rounding draws its seeds from torch's generator (seeded 0 here).

A second table measures the bias of each rounding: the mean of the dequantized
values over ``DRAWS`` packs of one Gaussian ``BIAS_SHAPE`` tensor, minus x.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

import savedhooks as sh
from savedhooks.codecs.base import pack_saved, unpack_saved

ROWS, COLS = 4096, 1024
BIAS_SHAPE, DRAWS = (64, 256), 1000

CODECS = [
    ("fp8(e4m3, block 128)", sh.codecs.Float8(torch.float8_e4m3fn, "block", 128)),
    ("fp8(e4m3, row)", sh.codecs.Float8(torch.float8_e4m3fn, "row")),
    ("fp8(e4m3, tensor)", sh.codecs.Float8(torch.float8_e4m3fn, "tensor")),
    ("fp8(e4m3, block 128, pow2)", sh.codecs.Float8(torch.float8_e4m3fn, "block", 128, True)),
    ("fp8(e5m2, block 128)", sh.codecs.Float8(torch.float8_e5m2, "block", 128)),
    ("fp8(e4m3, block 128, stochastic)", sh.codecs.Float8(torch.float8_e4m3fn, "block", 128, rounding="stochastic")),
    ("fp8(e5m2, block 128, stochastic)", sh.codecs.Float8(torch.float8_e5m2, "block", 128, rounding="stochastic")),
    ("int8 rows", sh.codecs.Int8Rows()),
    ("downcast(bf16)", sh.codecs.Downcast(torch.bfloat16)),
    ("downcast(fp16)", sh.codecs.Downcast(torch.float16)),
]


def payload_bytes(packed) -> int:
    """Bytes of all tensors in a packed payload."""
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(packed) if isinstance(t, torch.Tensor))


def rows() -> list[tuple[str, str, str, str]]:
    """One row per codec: name, bytes per element, SQNR normal, SQNR heavy-tailed (mean per row)."""
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)  # the seeds of stochastic rounding
    normal = torch.randn(ROWS, COLS, generator=gen)
    heavy = torch.randn(ROWS, COLS, generator=gen) * torch.exp(3 * torch.randn(ROWS, 1, generator=gen))
    out = []
    for name, codec in CODECS:
        packed = pack_saved(codec, normal)
        y = unpack_saved(codec, packed)
        y_heavy = unpack_saved(codec, pack_saved(codec, heavy))
        per_row = sh.fidelity.sqnr(heavy, y_heavy, dim=1)
        overflowed = int((~torch.isfinite(y_heavy)).any(dim=1).sum())
        heavy_cell = f"{per_row.mean().item():.1f}"
        if overflowed:  # values beyond the format's range became inf: say so, do not average it away
            heavy_cell = f"{per_row[torch.isfinite(per_row)].mean().item():.1f} ({overflowed} rows overflow to inf)"
        out.append((name, f"{payload_bytes(packed) / normal.numel():.3f}", f"{sh.fidelity.sqnr(normal, y):.1f}", heavy_cell))
    mask = torch.rand(ROWS, COLS, generator=gen) > 0.5
    bits = pack_saved(sh.codecs.Bitmask(), mask)
    exact = torch.equal(unpack_saved(sh.codecs.Bitmask(), bits), mask)
    out.append(("bitmask (bool input)", f"{payload_bytes(bits) / mask.numel():.3f}", "exact" if exact else "WRONG", "-"))
    return out


def bias_rows() -> list[tuple[str, str, str, str]]:
    """Per rounding of fp8(e4m3, block 128): mean |E[x'] - x| over elements relative to the mean
    |x' - x| of round to nearest, the share of elements beyond 3 standard errors of the mean
    (0.27% for a normal z) and the largest |E[x'] - x| in standard errors."""
    torch.manual_seed(0)
    x = torch.randn(*BIAS_SHAPE, generator=torch.Generator().manual_seed(1))
    nearest = sh.codecs.Float8(torch.float8_e4m3fn, "block", 128)
    nearest_error = (unpack_saved(nearest, pack_saved(nearest, x)) - x).abs().double()
    codec = sh.codecs.Float8(torch.float8_e4m3fn, "block", 128, rounding="stochastic")
    first = unpack_saved(codec, pack_saved(codec, x)).double()
    total, squares = torch.zeros_like(first), torch.zeros_like(first)
    for _ in range(DRAWS):  # sums of y - first: exact zeros where an element never changes
        d = unpack_saved(codec, pack_saved(codec, x)).double() - first
        total += d
        squares += d * d
    mean = total / DRAWS
    std_err = ((squares / DRAWS - mean * mean).clamp_min(0) / (DRAWS - 1)).sqrt()
    bias = (first + mean - x.double()).abs()
    z = (bias / std_err)[std_err > 0]  # elements that never changed have no estimate
    beyond = f"{(z > 3).double().mean().item():.2%}"
    return [
        ("nearest", "1.000", "-", "- (deterministic)"),
        ("stochastic", f"{(bias.mean() / nearest_error.mean()).item():.3f}", beyond, f"{z.max().item():.1f}"),
    ]


def main() -> None:
    """Print the markdown tables."""
    print(f"fp32 input {ROWS} x {COLS} (bytes per element: fp32 = 4, bool = 1)")
    print("| codec | bytes / element | SQNR normal (dB) | SQNR heavy-tailed, mean per row (dB) |")
    print("|---|---:|---:|---:|")
    for row in rows():
        print("| " + " | ".join(row) + " |")
    print()
    print(f"bias of fp8(e4m3, block 128): Gaussian {BIAS_SHAPE[0]} x {BIAS_SHAPE[1]}, {DRAWS} packs")
    print("| rounding | mean abs bias / nearest's mean abs error | beyond 3 standard errors | worst (standard errors) |")
    print("|---|---:|---:|---:|")
    for row in bias_rows():
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
