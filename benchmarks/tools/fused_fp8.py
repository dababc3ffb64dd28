"""The fp8 codec's opaque op vs its decomposed form under inductor: ``python -m benchmarks.tools.fused_fp8``.

A GELU-MLP training step (Linear -> GELU -> Linear, widths ``--dim`` and 4x,
``--tokens`` rows; with ``--batch B`` as a transformer's ``(B, tokens / B, dim)``
activations, so that the GELU runs on a 3-D view of the first Linear's output) compiled with inductor inside ``sh.saved_tensors_hooks(sh.fp8(backend=...))``
for ``backend`` "aten" (the opaque ``savedhooks::fp8_*`` ops) and "auto" (in
the compiled graphs the decomposed form inductor fuses; the op for the one
tensor that eager autograd saves outside them, the model's output), plus the
same step without hooks. Reports the
median step time (``--reps`` steps after warm-up) and the measured peak bytes of
one step (``sh.memory.measure_peak``: CUDA allocator statistics, CPU profiler
events), as ratios to the opaque op. Runs on CUDA when available, else CPU
(``--cpu`` forces it). Not part of ``python -m benchmarks``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import savedhooks as sh


def gelu_mlp(dim: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))


def _step(model, fn, x, hooks) -> None:
    model.zero_grad(set_to_none=True)
    if hooks is None:
        fn(x).square().sum().backward()
        return
    with sh.saved_tensors_hooks(hooks):
        loss = fn(x).square().sum()
    loss.backward()


def measure(
    backend: str | None, dim: int, tokens: int, reps: int, device: str, batch: int | None = None
) -> tuple[float, int]:
    """(median step seconds, peak bytes of a step) for fp8 with ``backend`` (None: no hooks)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    shape = (tokens, dim) if batch is None else (batch, tokens // batch, dim)
    model, x = gelu_mlp(dim).to(device), torch.randn(shape, device=device)
    fn = torch.compile(model, backend="inductor")
    hooks = None if backend is None else sh.fp8(backend=backend)
    for _ in range(3):  # compile, then warm caches
        _step(model, fn, x, hooks)
    times = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        _step(model, fn, x, hooks)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    peak = sh.memory.measure_peak(lambda: _step(model, fn, x, hooks), device=device)
    return statistics.median(times), peak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=None,
                        help="inputs of shape (batch, tokens / batch, dim), as a transformer's (default: 2-D)")
    parser.add_argument("--cpu", action="store_true", help="run on CPU even when CUDA is available")
    args = parser.parse_args(argv)
    if args.batch is not None and (args.batch < 1 or args.tokens % args.batch):
        parser.error(f"--batch must be a positive divisor of --tokens ({args.tokens}), got {args.batch}")
    device = "cpu" if args.cpu or not torch.cuda.is_available() else "cuda"
    results = {name: measure(backend, args.dim, args.tokens, args.reps, device, args.batch)
               for name, backend in (("opaque op", "aten"), ("fused (auto)", "auto"), ("no hooks", None))}  # fmt: skip
    base_time, base_peak = results["opaque op"]
    rows = f"{args.tokens}x{args.dim}" if args.batch is None else f"{args.batch}x{args.tokens // args.batch}x{args.dim}"
    print(f"GELU-MLP {rows} (hidden {4 * args.dim}), inductor, {device}, "
          f"median of {args.reps} steps; ratios to the opaque op")  # fmt: skip
    print("| fp8 form | step time | peak |")
    print("|---|---|---|")
    for name, (seconds, peak) in results.items():
        print(f"| {name} | {seconds / base_time:.2f}x ({seconds * 1e3:.1f} ms) | {peak / base_peak:.2f}x ({peak / 2**20:.1f} MiB) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
