"""Which backward order inductor keeps, and what its code allocates: ``python -m benchmarks.tools.inductor_order``.

``python -m benchmarks.tools.inductor_order [--order ORDER] -- <arguments of python -m benchmarks>``
runs the main benchmark (CPU, inductor rows) and, for every backward graph that
inductor compiles, prints:

* the peak estimates of inductor's ``reorder_for_peak_memory``: the order it was
  given (after savedhooks' pass, where one ran) and its own ``lpmf``, ``bfs``
  and ``dfs`` sorts, and which one it kept (the lowest estimate);
* the replayed peak of the generated wrapper: every ``empty_strided_cpu`` and
  ``del`` of its ``call`` walked in order, graph inputs counted from the start
  and freed at their ``del`` (parameters and incoming gradients stay: their
  owners hold them). It counts what inductor's code allocates, not scratch
  inside extern kernels.

``--order given|lpmf|bfs|dfs`` makes inductor keep that order for backward
graphs instead of its lowest estimate: a diagnostic that patches torch's
``torch._inductor.memory.reorder_for_peak_memory`` for the run (never done by
the library). Comparing the orders shows how much of a step's peak comes from
the order inductor picks for its backward (gpt2-big's ``sh`` row at size 1, for one).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import re
import sys
from collections.abc import Iterator

import torch

__all__ = ["Replay", "main", "replay"]

_ORDERS = ("given", "lpmf", "bfs", "dfs")
_ALLOC = re.compile(r"^(\w+) = empty_strided_cpu\((\([^)]*\)), (\([^)]*\)), torch\.(\w+)\)")
_REUSE = re.compile(r"^(\w+) = (?:reinterpret_tensor\()?(\w+)\b[^;]*; del (\w+)\s+# reuse")
_INPUT = re.compile(r"(\w+) = rand_strided\((\([^)]*\)), (\([^)]*\)), device='cpu', dtype=torch\.(\w+)\)")
_HELD = ("primals", "tangents")
_BACKWARD_CALL = re.compile(r"\btangents_\d+ = args\b")  # a backward's call() unpacks the incoming gradients
_ESTIMATE = re.compile(r"^(Baseline|topological_sort_(\w+)) peak memory: (\d+)$")


@dataclasses.dataclass(frozen=True)
class Replay:
    """What one generated wrapper allocates.

    Attributes:
        input_bytes: the graph's inputs (from its ``rand_strided`` example arguments).
        peak_bytes: the most bytes alive at once, inputs included.
        peak_line: the allocation that reached it.
    """

    input_bytes: int
    peak_bytes: int
    peak_line: str


def _nbytes(shape: str, stride: str, dtype: str) -> int:
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"replay: unknown dtype {dtype!r}")  # noqa: TRY004 - a bad name in the code's text
    dims = [int(x) for x in shape.strip("()").split(",") if x.strip()]
    steps = [int(x) for x in stride.strip("()").split(",") if x.strip()]
    if any(d == 0 for d in dims):
        return 0
    return (1 + sum((d - 1) * s for d, s in zip(dims, steps, strict=True))) * torch_dtype.itemsize


def replay(code: str) -> Replay:
    """Walk the allocations and frees of an inductor CPU wrapper's ``call``.

    Args:
        code: the wrapper's source (what ``TORCH_LOGS=output_code`` prints), with
            its ``get_args`` example inputs.

    Returns:
        A :class:`Replay`.

    Raises:
        ValueError: ``code`` has no ``def call(`` or an unknown dtype.
    """
    _, found, body = code.partition("def call(")
    if not found:
        raise ValueError("replay: no 'def call(' in the code")
    body, _, tail = body.partition("def get_args")
    alive = {name: _nbytes(shape, stride, dtype) for name, shape, stride, dtype in _INPUT.findall(tail)}
    current = inputs = sum(alive.values())
    peak, where = current, "inputs"
    for raw in body.splitlines():
        line = raw.strip()
        if match := _ALLOC.match(line):
            alive[match[1]] = _nbytes(match[2], match[3], match[4])
            current += alive[match[1]]
            if current > peak:
                peak, where = current, line
        elif match := _REUSE.match(line):
            alive[match[1]] = alive.pop(match[3], 0)
        else:
            for name in re.findall(r"\bdel (\w+)", line):
                if not name.startswith(_HELD):
                    current -= alive.pop(name, 0)
    return Replay(inputs, peak, where)


class _Capture(logging.Handler):
    """Collects inductor's peak estimates (its log) and the backward graphs' generated code."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.estimates: list[dict[str, int]] = []  # one per backward graph
        self._backward = False  # whether the estimates being logged are a backward graph's
        self.code: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Reordering for peak memory"):
            from torch._inductor.virtualized import V

            self._backward = V.graph.is_backward
            if self._backward:
                self.estimates.append({})
        elif (match := _ESTIMATE.match(message)) and self._backward:
            self.estimates[-1]["given" if match[1] == "Baseline" else match[2]] = int(match[3])

    def keep_code(self, code: str) -> None:
        """Keep a backward graph's generated wrapper."""
        if _BACKWARD_CALL.search(code):
            self.code.append(code)


@contextlib.contextmanager
def _forced(order: str | None) -> Iterator[None]:
    """Make inductor keep ``order`` for backward graphs (None: leave it alone)."""
    from torch._inductor import memory
    from torch._inductor.virtualized import V

    original = memory.reorder_for_peak_memory

    def reorder(nodes, name_to_buf, name_to_fused_node, graph_inputs, graph_outputs, **kwargs):
        kept = original(nodes, name_to_buf, name_to_fused_node, graph_inputs, graph_outputs, **kwargs)
        if order is None or not V.graph.is_backward:
            return kept
        # the sorts read what planning attaches to the nodes
        _, freeable = memory.prepare_planning_info(nodes, name_to_buf, name_to_fused_node, graph_inputs, graph_outputs)
        if order == "given":
            return nodes
        if order == "lpmf":
            return memory.topological_sort_lpmf(nodes, freeable, name_to_buf, graph_outputs)
        return {"bfs": memory.topological_sort_bfs, "dfs": memory.topological_sort_dfs}[order](nodes)

    memory.reorder_for_peak_memory = reorder
    try:
        yield
    finally:
        memory.reorder_for_peak_memory = original


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark with the capture (and ``--order``); print each backward graph's estimates and replay.

    Args:
        argv: ``[--order ORDER] [--] <python -m benchmarks arguments>`` (default ``sys.argv[1:]``).

    Returns:
        The benchmark's exit status.

    Raises:
        SystemExit: bad arguments.
    """
    from torch._inductor import config as inductor_config
    from torch._inductor.graph import GraphLowering

    from benchmarks.__main__ import main as benchmark_main

    parser = argparse.ArgumentParser(prog="python -m benchmarks.tools.inductor_order", description=__doc__.splitlines()[0])
    parser.add_argument("--order", choices=_ORDERS, default=None,
                        help="the order inductor keeps for backward graphs (default: its lowest estimate)")
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    rest = [a for a in rest if a != "--"]
    capture = _Capture()
    logger = logging.getLogger("torch._inductor.memory")
    saved = logger.level, logger.propagate, GraphLowering.save_output_code
    logger.addHandler(capture)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # ours only: no copy on stderr
    GraphLowering.save_output_code = capture.keep_code  # torch's hook for the generated wrapper
    try:  # a cached graph is not generated again: no code, no estimates
        with _forced(args.order), inductor_config.patch(force_disable_caches=True):
            status = benchmark_main(rest)
    finally:
        logger.removeHandler(capture)
        logger.setLevel(saved[0])
        logger.propagate, GraphLowering.save_output_code = saved[1:]
    _report(capture, args.order)
    return status


def _report(capture: _Capture, order: str | None) -> None:
    print(f"\ninductor's backward graphs, in compile order (order kept: {order or 'the lowest estimate'}); MiB:")
    for i, code in enumerate(capture.code):
        run = replay(code)
        print(f"- backward {i}: generated code peaks at {run.peak_bytes / 2**20:.1f} "
              f"({run.input_bytes / 2**20:.1f} of it inputs)")
    for i, estimate in enumerate(capture.estimates):
        if not estimate:  # a reorder that logged no estimate
            continue
        lowest = min(estimate, key=estimate.get)
        print(f"- backward {i}: inductor's estimates " + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in estimate.items())
              + f"; lowest: {lowest}")


if __name__ == "__main__":
    raise SystemExit(main())
