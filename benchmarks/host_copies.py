"""Host copies on a GPU: what offload can cost, and whether the asynchronous copies keep gradients.

``python -m benchmarks.host_copies`` (CUDA only) prints:

* the device <-> host copy bandwidth, pinned and pageable (1 GiB, median of 5
  timed copies by CUDA events), and what a pinned allocation of 64 MiB costs,
  the first one (cold) and the next ones after a free (torch's pinned
  allocator may hand the freed block back): the figures that bound any
  offload's step time;
* for the stress model of ``tests/compile/test_offload_overlap.py`` (4 x Linear(256) +
  GELU, ``dynamic=True``, 30 steps of random batch sizes), how the gradients
  with ``sh.offload()`` compare with those without hooks, in three variants under
  inductor (the copies asynchronous and placed, asynchronous and left in place,
  synchronous) and one under aot_eager. A copy read before it ends gives stale
  data (tens of dB at best); float32 rounding from another fusion gives about
  140 dB.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time
from unittest import mock

import torch

_GIB = 1 << 30


def copy_gb_per_s(direction: str, pinned: bool, nbytes: int = _GIB, repeats: int = 5) -> float:
    """Median bandwidth of one copy between the GPU and host memory.

    Args:
        direction: ``"D2H"`` or ``"H2D"``.
        pinned: pinned (page-locked) host memory, else pageable.
        nbytes: bytes per copy.
        repeats: timed copies after one warm-up.

    Returns:
        GB/s (1e9 bytes per second), the median over ``repeats``.

    Raises:
        ValueError: an unknown ``direction``.
        RuntimeError: no CUDA device.
    """
    if direction not in ("D2H", "H2D"):
        raise ValueError(f"direction must be 'D2H' or 'H2D', got {direction!r}")
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    dst, src = (host, device) if direction == "D2H" else (device, host)
    times = []
    for _ in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=pinned)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return nbytes / statistics.median(times[1:]) / 1e6


def pinned_alloc_ms(nbytes: int = 64 << 20, repeats: int = 20) -> tuple[float, float]:
    """Milliseconds for pinned host allocations of ``nbytes``, each freed before the next one.

    Args:
        nbytes: bytes per allocation.
        repeats: allocations timed after the first.

    Returns:
        ``(first, then)``: the first allocation and its free, and the mean of
        the ``repeats`` after it (which torch's pinned allocator may serve from
        the block just freed).

    Raises:
        RuntimeError: no CUDA device (pinned memory needs one).
    """
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        times.append((time.perf_counter() - start) * 1e3)
    return times[0], statistics.fmean(times[1:])


@contextlib.contextmanager
def _variant(name: str):
    from savedhooks.compiler import api, overlap

    if name == "async, not placed":
        with mock.patch.object(overlap, "_place", lambda *args, **kwargs: None):
            yield
    elif name == "synchronous":
        with mock.patch.object(api, "overlap_transfers", lambda gm, is_backward: 0):
            yield
    else:
        yield


def offload_stress(backend: str, variant: str = "async, placed", steps: int = 30) -> dict[str, float]:
    """Train the stress model with and without ``sh.offload()`` and compare gradients step by step.

    Args:
        backend: ``"inductor"`` or ``"aot_eager"`` (through ``sh.backend``).
        variant: ``"async, placed"`` (the default path), ``"async, not placed"``
            or ``"synchronous"`` (the copies not split into torch's async ops).
        steps: training steps.

    Returns:
        ``unequal_steps``, ``worst_sqnr_db`` and ``max_abs_diff`` over all steps.

    Raises:
        ValueError: an unknown variant.
    """
    import savedhooks as sh

    if variant not in ("async, placed", "async, not placed", "synchronous"):
        raise ValueError(f"unknown variant {variant!r}")
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(256, 256), torch.nn.GELU())]).cuda()
    compiled = torch.compile(model, backend=sh.backend(backend), dynamic=True)
    rng = random.Random(0)

    def grads(x, hooks):
        model.zero_grad(set_to_none=True)
        with sh.saved_tensors_hooks(hooks) if hooks is not None else contextlib.nullcontext():
            loss = compiled(x).square().sum()
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    unequal, worst, diff = 0, float("inf"), 0.0
    with _variant(variant), torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):  # fmt: skip
        for _ in range(steps):
            x = torch.randn(rng.choice([8, 64, 200, 512]), 256, device="cuda")
            want, got = grads(x, None), grads(x, sh.offload(keep_needed_soon=False))
            unequal += not all(torch.equal(w, g) for w, g in zip(want, got))
            worst = min(worst, *(sh.fidelity.sqnr(w, g) for w, g in zip(want, got)))
            diff = max(diff, *(float((w - g).abs().max()) for w, g in zip(want, got)))
    return {"unequal_steps": unequal, "worst_sqnr_db": worst, "max_abs_diff": diff}


def main(argv: list[str] | None = None) -> int:
    """Print the copy figures and the stress comparison.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        0.

    Raises:
        SystemExit: no CUDA device, or bad flags.
    """
    parser = argparse.ArgumentParser(prog="python -m benchmarks.host_copies", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="stress steps per variant (default 30)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for pinned in (True, False):
        for direction in ("D2H", "H2D"):
            kind = "pinned" if pinned else "pageable"
            print(f"{direction} {kind}: {copy_gb_per_s(direction, pinned):.1f} GB/s (1 GiB)", flush=True)
    first, then = pinned_alloc_ms()
    print(f"pinned allocation of 64 MiB: first {first:.2f} ms, then {then:.3f} ms each (freed in between)", flush=True)
    runs = [("inductor", v) for v in ("async, placed", "async, not placed", "synchronous")]
    for backend, variant in runs + [("aot_eager", "async, placed")]:
        r = offload_stress(backend, variant, args.steps)
        print(f"{backend}, {variant}: {r['unequal_steps']}/{args.steps} steps not bit-equal, worst "
              f"{r['worst_sqnr_db']:.1f} dB, max |diff| {r['max_abs_diff']:.3g}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
