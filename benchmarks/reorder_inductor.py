"""Measured peaks of inductor with and without the reorder pass: ``python -m benchmarks.reorder_inductor``.

One training step of the acceptance models (8-layer MLP, 4-layer transformer)
and a 4-layer MLP (fp32, CPU) under ``sh.fp8()``, forward and backward peaks measured in turn in
one profiling session (``sh.memory.measure_peaks``; each above what was live before it), for:

* ``inductor``: torch's default (its ``reorder_for_peak_memory`` on), the hooks
  entered with ``reorder=False``;
* plain ``torch.compile`` inside ``sh.saved_tensors_hooks`` (the default usage,
  which adds the pass itself);
* ``sh.backend("inductor")``: the same pass given as a backend;
* both again with inductor's own reordering off;
* the pass applied to forward graphs as well (``sh.compiler.reorder_pass(forward=True)``),
  with inductor's reordering on and off.

Where inductor's own reordering is off, the forward graph runs in the order the
post-grad passes leave, so the memory model can be checked against it: the
"predicted" column is :func:`savedhooks.memory.simulate` of that graph with
inductor's fusion modelled (``fused=True``), above its inputs.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass

import savedhooks as sh
from benchmarks.acceptance import MODELS as ACCEPTANCE
from benchmarks.acceptance import mlp
from savedhooks.compiler.passes import is_backward_graph

__all__ = ["CONFIGS", "MODELS", "ForwardPrediction", "measured_peaks"]

# On the 4-layer MLP an order that leaves zero-byte nodes at the start of the
# backward peaks well above inductor's own (savedhooks.schedule.sink_free moves them).
MODELS = {**ACCEPTANCE, "4-layer MLP": (functools.partial(mlp, 4), ACCEPTANCE["8-layer MLP"][1])}


class ForwardPrediction(CustomGraphPass):
    """A post-grad pass that records the model's forward peak (fused, above the inputs) of each forward graph."""

    def __init__(self) -> None:
        self.peaks: list[int] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        if is_backward_graph(graph):
            return
        memory = sh.memory.build_graph_memory(torch.fx.GraphModule(torch.nn.Module(), graph), fused=True)
        device = torch.device("cpu")
        during, _, _ = sh.memory.simulate(memory, device)
        inputs = sum(b.nbytes for b in memory.buffers if b.is_input and b.device == device)
        self.peaks.append(max(during, default=inputs) - inputs)

    def uuid(self) -> None:  # never cached: it must see every compile
        return None


_OFF = {"reorder_for_peak_memory": False}
# label -> (backend, inductor options or None, whether saved_tensors_hooks adds its pass, forward prediction or None)
CONFIGS = {
    "inductor": lambda: ("inductor", None, False, None),
    "plain torch.compile in sh.saved_tensors_hooks": lambda: ("inductor", None, True, None),
    "inductor + savedhooks pass": lambda: (sh.backend("inductor"), None, False, None),
    "inductor, its reorder off": lambda: _predicting(()),
    "inductor, its reorder off + savedhooks pass": lambda: _predicting((sh.compiler.reorder_pass(),)),
    "inductor + savedhooks pass, forward too": lambda: (
        "inductor", {"post_grad_custom_post_pass": sh.compiler.reorder_pass(forward=True)}, False, None),
    "inductor, its reorder off + savedhooks pass, forward too": lambda: _predicting((sh.compiler.reorder_pass(forward=True),)),
}


def _predicting(passes: tuple) -> tuple:
    """Inductor with its reorder off, ``passes`` and then a :class:`ForwardPrediction` in the post-grad slot."""
    recorder = ForwardPrediction()
    return "inductor", {**_OFF, "post_grad_custom_post_pass": (*passes, recorder)}, False, recorder


def measured_peaks(model: torch.nn.Module, backend, options, x: torch.Tensor, reorder: bool = False,
                   hooks=None) -> tuple[int, int]:
    """Measured forward and backward peak bytes of one compiled step under ``hooks`` (default ``sh.fp8()``; CPU).

    Args:
        model: the model (its gradients are cleared).
        backend: a ``torch.compile`` backend.
        options: inductor options, or None.
        x: the input.
        reorder: ``saved_tensors_hooks(..., reorder=)``: whether entering the
            hooks adds the pass to inductor's config (off: torch's own order).
        hooks: the saved-tensor hooks, default ``sh.fp8()``.

    Returns:
        ``(forward peak, backward peak)`` above what was live before each.

    Raises:
        Whatever compiling or running the model raises.
    """
    compiled = torch.compile(model, backend=backend, options=options) if options else torch.compile(
        model, backend=backend)

    hooks = sh.fp8() if hooks is None else hooks

    def forward():
        with sh.saved_tensors_hooks(hooks, reorder=reorder):
            return compiled(x).square().mean()

    forward().backward()  # compile
    model.zero_grad(set_to_none=True)
    held = []
    fw, bw = sh.memory.measure_peaks(lambda: held.append(forward()), lambda: held.pop().backward(), device="cpu")
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    return fw, bw


def main() -> None:
    """Print a markdown table of measured peaks (MiB)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.reorder_inductor")
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args()
    print("| model | configuration | forward peak MiB | predicted forward MiB | backward peak MiB | compile + steps s |")
    print("|---|---|---:|---:|---:|---:|")
    for name in args.models:
        make, shape = MODELS[name]
        x = torch.randn(*shape)
        for label, config in CONFIGS.items():
            start = time.perf_counter()
            backend, options, reorder, recorder = config()
            fw, bw = measured_peaks(make(), backend, options, x, reorder)
            predicted = f"{recorder.peaks[-1] / 2**20:.2f}" if recorder is not None and recorder.peaks else ""
            print(f"| {name} | {label} | {fw / 2**20:.2f} | {predicted} | {bw / 2**20:.2f} | "
                  f"{time.perf_counter() - start:.0f} |", flush=True)


if __name__ == "__main__":
    main()
