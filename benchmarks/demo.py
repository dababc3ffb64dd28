"""The foundation demo: measured memory of one training step with and without a hook.

A stand-in for the full benchmark suite (its own issue): one MLP, a bf16 round-trip
hook written with ``@savedhooks.hook`` and the ready-made ``savedhooks.fp8()``,
eager and ``aot_eager``, on CPU. Memory
comes from the profiler's allocation events accumulated in time order, so the
figures are measured, not modelled.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

import savedhooks as sh
from savedhooks.memory import cpu_memory_trace


@sh.hook
def bf16(x):
    """Keep saved floating tensors in bfloat16 (half the bytes of fp32); others untouched."""
    return x.to(torch.bfloat16) if x.dtype == torch.float32 else x


@bf16.unpack
def bf16(packed):
    return packed.to(torch.float32) if packed.dtype == torch.bfloat16 else packed


@dataclasses.dataclass(frozen=True)
class Row:
    """One measured configuration; the table's columns."""

    config: str
    saved_mib: float  # bytes still held after forward (saved for backward + the loss)
    step_peak_mib: float  # peak of forward + backward above the memory live before it
    step_ms: float


def measure(config: str, model: torch.nn.Module, step_fn, x: torch.Tensor, hooks: sh.HookPair | None) -> Row:
    def forward():
        if hooks is None:
            return step_fn(x).square().mean()
        with sh.saved_tensors_hooks(hooks):
            return step_fn(x).square().mean()

    def step():
        model.zero_grad(set_to_none=True)
        forward().backward()
        model.zero_grad(set_to_none=True)  # grads are not activations: free them inside the trace

    step()  # warm-up: compile, allocate nothing persistent afterwards
    holder: list[torch.Tensor] = []
    saved = cpu_memory_trace(lambda: holder.append(forward()))
    holder.clear()
    peak = cpu_memory_trace(step)
    start = time.perf_counter()
    for _ in range(3):
        step()
    ms = (time.perf_counter() - start) / 3 * 1e3
    mib = 2.0**20
    return Row(config, (saved[-1] if saved else 0) / mib, max(peak, default=0) / mib, ms)


def run(width: int, depth: int, batch: int) -> list[Row]:
    """Measure the demo configurations on an MLP; return one row per configuration."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))
    x = torch.randn(batch, width)
    compiled = torch.compile(model, backend="aot_eager")
    placed = torch.compile(model, backend=sh.backend("aot_eager"))
    return [
        measure("eager, no hooks", model, model, x, None),
        measure("eager, @sh.hook bf16", model, model, x, bf16),
        measure("eager, sh.fp8()", model, model, x, sh.fp8()),
        measure("aot_eager, no hooks", model, compiled, x, None),
        measure("aot_eager, @sh.hook bf16 (inlined)", model, compiled, x, bf16),
        measure("aot_eager, sh.fp8() (inlined)", model, compiled, x, sh.fp8()),
        measure("sh.backend('aot_eager'), @sh.hook bf16 (placed)", model, placed, x, bf16),
        measure("sh.backend('aot_eager'), sh.fp8() (placed)", model, placed, x, sh.fp8()),
    ]


def table(rows: list[Row]) -> str:
    """Render rows as a markdown table."""
    lines = ["| configuration | saved after forward (MiB) | step peak (MiB) | step time (ms) |", "|---|---:|---:|---:|"]
    lines += [f"| {r.config} | {r.saved_mib:.1f} | {r.step_peak_mib:.1f} | {r.step_ms:.0f} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Command line entry: parse flags, measure, print the table."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1024)
    args = parser.parse_args(argv)
    print(f"MLP {args.depth} x Linear({args.width}) + GELU, batch {args.batch}, fp32, CPU, torch {torch.__version__}")
    print(table(run(args.width, args.depth, args.batch)))
