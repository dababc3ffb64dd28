"""Where a training step peaks: ``python -m benchmarks.tools.peak_ops --model gpt2 --size 8 --config sh``.

Runs one step of a benchmark model compiled with inductor (or ``--backend``; CPU),
optionally with checkpointing per block (``--checkpoint``) or under bf16 autocast
(``--bf16``, as the benchmark's ``bf16`` rows), under the
profiler with memory events, and prints the peak above what was live before
the step, the ops running at that moment (outermost first), and the bytes
alive at the end of the forward (the loss included) and of the backward. The
configurations: ``compiled`` (no hooks), ``sh`` (``sh.fp8()``) and ``sh policy``
(``sh.policy()``), all plain ``torch.compile(model)``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
from typing import Any

import torch

import savedhooks as sh
from benchmarks.models import MODELS, make_workload
from savedhooks.memory.measure import CALL_MARK, cpu_allocations, profiled_nodes, traced_bytes

__all__ = ["peak_ops"]

_HOOKS = {"compiled": None, "sh": sh.fp8, "sh policy": sh.policy}
_FORWARD, _BACKWARD = "## forward", "## backward"


def peak_ops(model: str, size: float, config: str, backend: str = "inductor", checkpoint: bool = False,
             bf16: bool = False, compiled_loss: bool = False) -> dict[str, Any]:
    """Profile one warm step; see the module docstring.

    Args:
        model: a key of ``benchmarks.models.MODELS``.
        size: batch multiplier.
        config: ``"compiled"``, ``"sh"`` or ``"sh policy"``.
        backend: the ``torch.compile`` backend.
        checkpoint: checkpointing per block on (as the benchmark's checkpoint configurations).
        bf16: run the step under CPU bf16 autocast (as the benchmark's ``bf16`` configurations).
        compiled_loss: compile the loss with the model (as ``python -m benchmarks --compiled-loss``).

    Returns:
        ``{"peak": bytes, "ops": [op names at the peak], "forward": bytes, "backward": bytes}``.

    Raises:
        KeyError: unknown model or configuration.
    """
    hooks = _HOOKS[config]() if _HOOKS[config] else None
    workload = make_workload(model, size)
    workload.set_checkpointing(checkpoint)
    workload.compiled_loss = compiled_loss
    forward = workload.compiled_step(functools.partial(torch.compile, backend=backend))

    def step() -> None:
        hooked = sh.saved_tensors_hooks(hooks) if hooks else contextlib.nullcontext()
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        with torch.profiler.record_function(_FORWARD), hooked, autocast:
            loss = forward()
        with torch.profiler.record_function(_BACKWARD):
            loss.backward()
        workload.model.zero_grad(set_to_none=True)

    step()  # compile
    nodes = profiled_nodes(step)
    timeline = traced_bytes(cpu_allocations(nodes))
    at, peak = max(timeline, key=lambda point: point[1], default=(0, 0))
    ops = [n for n in nodes if n.name not in ("[memory]", CALL_MARK) and n.start_time_ns <= at <= n.end_time_ns]

    def live_at_end(name: str) -> int:
        end = max(n.end_time_ns for n in nodes if n.name == name)
        return max([b for t, b in timeline if t <= end][-1:] or [0])

    return {"peak": peak, "ops": [n.name for n in sorted(ops, key=lambda n: n.start_time_ns)],
            "forward": live_at_end(_FORWARD), "backward": live_at_end(_BACKWARD)}  # fmt: skip


def main() -> None:
    """Print the peak, the ops at the peak and the live bytes after forward and backward (MiB)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tools.peak_ops")
    parser.add_argument("--model", choices=list(MODELS), default="gpt2")
    parser.add_argument("--size", type=float, default=8.0)
    parser.add_argument("--config", choices=list(_HOOKS), default="sh")
    parser.add_argument("--backend", choices=("inductor", "aot_eager"), default="inductor")
    parser.add_argument("--checkpoint", action="store_true", help="checkpointing per block")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (CPU)")
    parser.add_argument("--compiled-loss", action="store_true", help="compile the loss with the model")
    args = parser.parse_args()
    result = peak_ops(args.model, args.size, args.config, args.backend, args.checkpoint, args.bf16, args.compiled_loss)
    mib = 2.0**20
    what = f"{args.config}{' + checkpoint' if args.checkpoint else ''}{', bf16 autocast' if args.bf16 else ''}, {args.backend}"
    what += ", loss compiled" if args.compiled_loss else ""
    print(f"{args.model} --size {args.size:g}, {what}: step peak {result['peak'] / mib:.1f} MiB")
    print("ops running at the peak: " + " > ".join(op[:80] for op in result["ops"]))
    print(
        f"live after the forward {result['forward'] / mib:.1f} MiB, after the backward {result['backward'] / mib:.1f}"
    )


if __name__ == "__main__":
    main()
