"""Kernel bandwidth: GB/s of each Triton kernel and of the aten path, ``python -m benchmarks.kernels``.

For inputs from 1 MB to 1 GB (bytes of the fp32 / bf16 input; bool for bitmask)
it times fp8 quantize (tensor / row / block 128, e4m3), fp8 dequantize (block
128) and bitmask pack / unpack, each with ``backend`` Triton and aten, and
reports effective GB/s = (bytes read once + bytes written) / time, next to the
device's memory bandwidth: the theoretical peak from the device properties and
a measured device-to-device copy. The tensor-granularity quantize reads its
input twice (two passes); its figure still counts one read.

Needs a CUDA device. Without one it refuses (exit code 2), unless ``--cpu`` is
given: then only the aten path is timed, on CPU, with no GPU figures at all. On
CPU the fp8 ops run the inductor-compiled decomposed form from one chunk of
elements on (``savedhooks.kernels.fp8_inductor``): backend ``aten`` is that op
path, and ``reference`` the chunked aten reference it replaces (same bytes).
Options: ``--sizes 1,4,16`` (MB), ``--dtype bf16``, ``--csv PATH``.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from collections.abc import Callable

import torch

from savedhooks.kernels import kernel_op, triton_available
from savedhooks.kernels.fp8 import torch_fp8_dequantize, torch_fp8_quantize

MB = 1 << 20
DEFAULT_SIZES_MB = (1, 4, 16, 64, 256, 1024)
COLS = 4096  # a row of the 2-D view the codecs hand over; a multiple of the block
E4M3 = torch.float8_e4m3fn
# CPU: the chunked aten references, timed beside the ops (which compile the decomposed form there)
REFERENCES = {"fp8_quantize": torch_fp8_quantize, "fp8_dequantize": torch_fp8_dequantize}


def _time_ms(fn: Callable[[], object], device: str, reps: int) -> float:
    """Median milliseconds of ``fn`` (CUDA: events and triton's do_bench with L2 flush)."""
    if device == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=5, rep=max(reps, 20), return_mode="median"))
    fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _cases(size_bytes: int, dtype: torch.dtype, device: str):
    """(name, op family, backend-less call builder, bytes moved) for one input size."""
    n = max(size_bytes // dtype.itemsize, COLS)
    x = torch.randn(n // COLS, COLS, device=device).to(dtype)
    rows = x.shape[0]
    q, scale = kernel_op("fp8_quantize", False)(x, E4M3, "block", 128, False)
    mask = torch.rand(size_bytes, device=device) > 0.5
    packed = kernel_op("bitmask_pack", False)(mask)
    out = x.numel() * dtype.itemsize
    scales = {"tensor": 4, "row": 4 * rows, "block": 4 * rows * (COLS // 128)}
    for granularity in ("tensor", "row", "block"):
        yield (f"fp8_quantize {granularity}", "fp8_quantize", (x, E4M3, granularity, 128, False),
               out + x.numel() + scales[granularity])  # fmt: skip
    yield "fp8_dequantize block", "fp8_dequantize", (q, scale, dtype, 128), q.numel() + scales["block"] + out
    yield "bitmask_pack", "bitmask_pack", (mask,), mask.numel() + packed.numel()
    yield "bitmask_unpack", "bitmask_unpack", (packed, mask.numel()), packed.numel() + mask.numel()


def peak_bandwidth_gbs() -> float | None:
    """Theoretical DRAM bandwidth of CUDA device 0 in GB/s (double data rate), if torch reports it."""
    props = torch.cuda.get_device_properties(0)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9 if clock_khz and bus_bits else None


def copy_bandwidth_gbs(device: str) -> float:
    """Measured device-to-device copy of 256 MB: read + write bytes over time."""
    x = torch.empty(256 * MB, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    return 2 * x.numel() / _time_ms(lambda: y.copy_(x), device, 10) / 1e6


def run(sizes_mb: tuple[int, ...], dtype: torch.dtype, device: str, reps: int = 10) -> list[dict[str, object]]:
    """One row per (size, kernel, backend): milliseconds and GB/s.

    Args:
        sizes_mb: input sizes in MiB.
        dtype: the floating input dtype (fp32 or bf16).
        device: ``"cuda"`` (Triton and aten) or ``"cpu"`` (the aten ops, and the
            fp8 references as backend ``"reference"``).
        reps: timed repetitions (CPU) / minimum for do_bench (CUDA).

    Returns:
        Rows as dicts: size_mb, kernel, backend, ms, gbs.

    Raises:
        RuntimeError: a kernel fails.
    """
    backends = ("triton", "aten") if device == "cuda" and triton_available() else ("aten",)
    backends += ("reference",) if device == "cpu" else ()
    rows = []
    for size in sizes_mb:
        for name, family, args, moved in _cases(size * MB, dtype, device):
            for backend in backends:
                if backend == "reference" and family not in REFERENCES:
                    continue
                op = REFERENCES[family] if backend == "reference" else kernel_op(family, backend == "triton")
                ms = _time_ms(lambda op=op, args=args: op(*args), device, reps)
                rows.append({"size_mb": size, "kernel": name, "backend": backend, "ms": ms, "gbs": moved / ms / 1e6})
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run, print a markdown table (and a CSV when asked); 2 without CUDA and ``--cpu``."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES_MB)), help="input sizes in MB")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--cpu", action="store_true", help="without CUDA: time the aten path on CPU only")
    parser.add_argument("--csv", help="also write the rows to this CSV file")
    args = parser.parse_args(argv)
    sizes = tuple(int(s) for s in args.sizes.split(","))
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    if torch.cuda.is_available():
        device = "cuda"
        peak, copy = peak_bandwidth_gbs(), copy_bandwidth_gbs(device)
        print(f"{torch.cuda.get_device_name(0)}: peak {peak or float('nan'):.0f} GB/s, measured copy {copy:.0f} GB/s")
    elif args.cpu:
        device, peak, copy = "cpu", None, copy_bandwidth_gbs("cpu")
        print(f"no CUDA device: aten path on CPU only (measured copy {copy:.1f} GB/s); no GPU figures measured")
    else:
        print("benchmarks.kernels needs a CUDA device (Triton kernels); none here, so no GPU figures. "
              "Use --cpu to time the aten path on CPU.", file=sys.stderr)  # fmt: skip
        return 2
    rows = run(sizes, dtype, device)
    print(f"input {args.dtype}; GB/s = (input read once + output written) / time")
    print("| size (MB) | kernel | backend | ms | GB/s | % of copy | % of peak |")
    print("|---:|---|---|---:|---:|---:|---:|")
    for r in rows:
        of_peak = f"{100 * r['gbs'] / peak:.0f}" if peak else "-"
        print(f"| {r['size_mb']} | {r['kernel']} | {r['backend']} | {r['ms']:.3f} | {r['gbs']:.1f} | "
              f"{100 * r['gbs'] / copy:.0f} | {of_peak} |")  # fmt: skip
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
