"""Compare the decomposed fp8 encode with the reference cast on every float32 bit pattern (a script, not a test).

``python tests/exhaustive_fp8_code.py`` checks all 2**32 patterns in both fp8
formats (tens of minutes on a small CPU, eager mode); ``--chunks A B`` checks
chunks A to B - 1 of 2**26 patterns each (64 in all). The reference is
``savedhooks.kernels.fp8``'s cast (the spec): codes must be equal, except that
where the reference gives a NaN, any NaN code of the format passes (NaN payloads
are not specified). Prints the mismatch count per format and exits 1 on any.
"""

from __future__ import annotations

import argparse
import sys

import torch

from savedhooks.kernels.fp8 import _cast
from savedhooks.kernels.fp8_fused import fp8_code

CHUNK = 1 << 26
FORMATS = (torch.float8_e4m3fn, torch.float8_e5m2)


def mismatches(chunk: int, dtype: torch.dtype) -> int:
    """Patterns of one chunk whose code differs from the reference's (NaN codes compared as NaN)."""
    bits = torch.arange(chunk * CHUNK - 2**31, (chunk + 1) * CHUNK - 2**31, dtype=torch.int64).to(torch.int32)
    y = bits.view(torch.float32)
    ours = fp8_code(y, dtype).to(torch.uint8)
    reference = _cast(y.clone(), dtype, torch.finfo(dtype).max)
    reference_nan = torch.isnan(reference.float())
    ours_nan = torch.isnan(ours.view(dtype).float())
    return int(((ours != reference.view(torch.uint8)) & ~reference_nan).sum() + (reference_nan & ~ours_nan).sum())


def main() -> int:
    parser = argparse.ArgumentParser(prog="python tests/exhaustive_fp8_code.py")
    parser.add_argument("--chunks", type=int, nargs=2, default=(0, 64), metavar=("A", "B"))
    args = parser.parse_args()
    total = {dtype: 0 for dtype in FORMATS}
    for chunk in range(*args.chunks):
        for dtype in FORMATS:
            total[dtype] += mismatches(chunk, dtype)
        print(f"chunk {chunk}: " + ", ".join(f"{d}: {n}" for d, n in total.items()), flush=True)
    return 1 if any(total.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
