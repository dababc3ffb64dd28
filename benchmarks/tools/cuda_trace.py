"""Where a CUDA training step peaks: the allocator's trace of one step, and the blocks alive at its peak.

``python -m benchmarks.tools.cuda_trace --model llama --size 8 --config sh`` (GPU only)
builds a benchmark configuration as the main job does (``--config``: a name of
``benchmarks.configs.CONFIGS``, or ``plan floor`` / ``plan <fraction>`` for
``sh.plan`` at the lowest budget it meets or at that fraction of its modelled
no-hook peak), runs two warm steps, measures one (``sh.memory.measure_peak``)
and records one with ``torch.cuda.memory._record_memory_history``. It prints
the measured peak, a plan's prediction, and the largest blocks alive at the
trace's peak with the first Python frames that allocated them: in inductor's
generated code the frame's line is the kernel or extern call, and the frames
after it name the model's source. ``--out`` keeps the snapshot (gzip pickle) for
``torch.cuda.memory._snapshot`` viewers.

The CPU counterpart is ``python -m benchmarks.tools.peak_ops`` (the profiler's memory
events). What it shows on CUDA that the CPU counterpart cannot: a CUDA
reduction's staging buffer, or a plan peaking inside the memory-efficient
attention's backward.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import os
import pathlib
import pickle
from typing import Any

import torch

import savedhooks as sh
from benchmarks.configs import CONFIGS, Config, plan_at, planned, planner_for
from benchmarks.models import MODELS, Workload, make_workload

__all__ = ["TracePeak", "main", "peak_of_trace"]

_MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class TracePeak:
    """The peak of an allocator trace, above what was allocated when the trace began.

    Attributes:
        nbytes: the peak.
        event: the index of the trace event at which it was reached.
        live: ``(bytes, frames)`` of each block allocated during the trace and
            alive at the peak, largest first; frames are ``name@file:line``,
            innermost first.
    """

    nbytes: int
    event: int
    live: tuple[tuple[int, tuple[str, ...]], ...]


def peak_of_trace(events: list[dict[str, Any]]) -> TracePeak:
    """Replay the allocations and frees of one device's trace and find its peak.

    Args:
        events: ``torch.cuda.memory._snapshot()["device_traces"][i]``: dicts with
            ``action``, ``addr``, ``size`` and ``frames``. Only ``alloc`` and
            ``free_completed`` change what is alive; a free of a block
            allocated before the trace began is ignored.

    Returns:
        A :class:`TracePeak` (0 bytes at event -1 for a trace that allocates nothing).

    Raises:
        KeyError: an event lacks ``action``, ``addr`` or ``size``.
    """
    live: dict[int, dict[str, Any]] = {}
    current, best, at, kept = 0, 0, -1, {}
    for i, event in enumerate(events):
        if event["action"] == "alloc":
            live[event["addr"]] = event
            current += event["size"]
        elif event["action"] == "free_completed" and event["addr"] in live:
            current -= live.pop(event["addr"])["size"]
        else:
            continue
        if current > best:
            best, at, kept = current, i, dict(live)
    blocks = [(e["size"], tuple(_frame(f) for f in e.get("frames", []))) for e in kept.values()]
    return TracePeak(best, at, tuple(sorted(blocks, key=lambda b: -b[0])))


def _frame(frame: dict[str, Any]) -> str:
    return f"{frame['name']}@{os.path.basename(frame['filename'])}:{frame['line']}"


def _config(workload: Workload, name: str, backend: str) -> tuple[Config, int | None]:
    """The configuration named ``name`` and a plan's predicted peak (None for the others)."""
    if not name.startswith("plan "):
        return CONFIGS[name], None
    planner = planner_for(workload, backend)
    label = name.removeprefix("plan ")
    plan = plan_at(planner, label)
    return planned(label, plan), plan.predicted_peak_bytes


def main(argv: list[str] | None = None) -> int:
    """Trace one step on the GPU and print where it peaks (see the module docstring).

    Args:
        argv: the command line (default ``sys.argv[1:]``).

    Returns:
        0.

    Raises:
        SystemExit: bad flags, an unknown configuration, or no CUDA device.
    """
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tools.cuda_trace", description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(MODELS), default="llama")
    parser.add_argument("--size", type=float, default=8.0, help="batch multiplier (default 8)")
    parser.add_argument("--config", default="sh", help="a benchmark configuration, or 'plan floor' / 'plan <f>'")
    parser.add_argument("--backend", choices=("inductor", "aot_eager"), default="inductor")
    parser.add_argument("--compiled-loss", action="store_true", help="compile the loss with the model")
    parser.add_argument("--top", type=int, default=30, help="blocks to print (default 30)")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="folder for the snapshot (gzip pickle)")
    args = parser.parse_args(argv)
    if not (args.config in CONFIGS or args.config == "plan floor" or _fraction(args.config)):
        parser.error(f"--config: {args.config!r} is no configuration of benchmarks.configs.CONFIGS nor 'plan <f>'")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (the CPU counterpart: python -m benchmarks.tools.peak_ops)")
    workload = make_workload(args.model, args.size, "cuda")
    workload.compiled_loss = args.compiled_loss
    config, predicted = _config(workload, args.config, args.backend)
    torch._dynamo.reset()
    torch.manual_seed(0)
    step = config.build(workload, args.backend)

    def train() -> None:
        workload.model.zero_grad(set_to_none=True)
        step.forward().backward()

    try:
        train()
        train()
        measured = sh.memory.measure_peak(train, device="cuda")
        workload.model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
        try:
            train()
            torch.cuda.synchronize()
            snapshot = torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
    finally:
        step.close()
    peak = peak_of_trace(snapshot["device_traces"][torch.cuda.current_device()])
    told = "" if predicted is None else f", predicted {predicted / _MIB:.2f} MiB"
    print(f"{args.model} / {args.config} / {args.backend}: measured {measured / _MIB:.2f} MiB{told}")
    print(f"traced step: peak {peak.nbytes / _MIB:.2f} MiB at event {peak.event}, {len(peak.live)} blocks alive")
    for nbytes, frames in peak.live[: args.top]:
        print(f"{nbytes / _MIB:9.2f} MiB | {' < '.join(frames[:4])}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"cuda_trace_{args.model}_{args.config.replace(' ', '_')}.pickle.gz"
        with gzip.open(path, "wb") as f:
            pickle.dump(snapshot, f)
        print(f"wrote {path}")
    return 0


def _fraction(name: str) -> bool:
    label = name.removeprefix("plan ")
    try:
        return name.startswith("plan ") and 0 < float(label) <= 1
    except ValueError:
        return False


if __name__ == "__main__":
    raise SystemExit(main())
