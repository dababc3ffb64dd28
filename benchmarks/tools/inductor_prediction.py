"""Predicted against measured peaks of inductor steps: ``python -m benchmarks.tools.inductor_prediction``.

The main job predicts its aot_eager rows (``predicted MiB``); for inductor it
measures only. This runs a benchmark model compiled with plain
``torch.compile`` (inductor), without hooks and inside
``sh.saved_tensors_hooks(...)``, keeps inductor's post-grad graphs and its
kernels' order as the planner's check does
(:class:`savedhooks.planner.recording.GraphRecorder`, appended after the pass
that entering the hooks installs), and prints the step peak the planner's model
gives them (:func:`savedhooks.planner.census.step_timeline`: kernel order,
fusion, in-place reuse, scratch) next to the measured one (CPU, after a
warm-up step). An eager loss (the default; ``--compiled-loss`` compiles it
with the model) is at the loss point as ``sh.plan`` models it: its peak
measured on the model's output, which the step drops once the loss has read
it (:func:`savedhooks.planner.step.loss_peak`). It is measured without hooks:
the benchmark's cross-entropy saves its log-softmax, which every codec stores
as it is outside compiled graphs, and its targets, a leaf.
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._inductor import config as inductor_config

import savedhooks as sh
from benchmarks.models import MODELS, make_workload
from savedhooks.compiler.api import post_grad_passes
from savedhooks.planner.census import step_timeline
from savedhooks.planner.recording import GraphRecorder
from savedhooks.planner.step import graph_timelines, loss_peak

__all__ = ["CONFIGS", "predicted_and_measured"]

CONFIGS = {"compiled": None, "sh": sh.fp8, "sh policy": sh.policy}
_MiB = 1 << 20


@contextlib.contextmanager
def _recording(recorder: GraphRecorder):
    """Append ``recorder`` to inductor's post-grad slot, compile the backward with the forward, keep kernel order."""
    passes = post_grad_passes(inductor_config.post_grad_custom_post_pass)
    with (
        inductor_config.patch(post_grad_custom_post_pass=(*passes, recorder)),
        torch._functorch.config.patch(force_non_lazy_backward_lowering=True),
        recorder.kernel_order(),
    ):
        yield


def predicted_and_measured(model: str, size: float, config: str, compiled_loss: bool = False) -> tuple[int, int]:
    """The modelled and the measured step peak of one benchmark model under inductor.

    Args:
        model: a key of ``benchmarks.models.MODELS``.
        size: batch multiplier.
        config: a key of :data:`CONFIGS`.
        compiled_loss: compile the loss with the model.

    Returns:
        ``(predicted, measured)`` bytes above what is alive before the step.

    Raises:
        KeyError: unknown model or configuration.
        RuntimeError: the step did not compile into as many backward graphs as forward graphs.
    """
    hooks = CONFIGS[config]() if CONFIGS[config] else None
    torch._dynamo.reset()
    workload = make_workload(model, size)
    workload.compiled_loss = compiled_loss
    compiled = torch.compile(workload.with_loss() if compiled_loss else workload.model, backend="inductor")
    recorder = GraphRecorder()
    outputs: list[Any] = []  # the model's output in the recorded step (eager loss)

    def step(record: bool = False) -> None:
        with contextlib.ExitStack() as stack:
            if hooks is not None:
                stack.enter_context(sh.saved_tensors_hooks(hooks))
            if record:
                stack.enter_context(_recording(recorder))
            out = compiled(**workload.inputs)
            if record and not compiled_loss:
                outputs.append(pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, out))
            loss = out if compiled_loss else workload.loss_of(out)
            del out
        loss.backward()

    with inductor_config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        step(record=True)
    workload.model.zero_grad(set_to_none=True)
    measured = sh.memory.measure_peak(step, device="cpu")
    workload.model.zero_grad(set_to_none=True)
    if not recorder.forwards or len(recorder.forwards) != len(recorder.backwards):
        raise RuntimeError(f"{len(recorder.forwards)} forward and {len(recorder.backwards)} backward graphs recorded")
    forwards, backwards = graph_timelines(recorder, fused=True)
    loss = loss_peak(workload.loss_of, outputs.pop(), torch.device("cpu"), 0) if outputs else 0
    predicted = max(step_timeline(forwards, backwards, [], loss).live, default=0)
    torch._dynamo.reset()
    return predicted, measured


def main(argv: Any = None) -> None:
    """Print predicted and measured peaks per model and configuration (see the module docstring).

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``).

    Returns:
        None.

    Raises:
        SystemExit: bad arguments.
    """
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tools.inductor_prediction")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=["mlp", "cnn", "gpt2", "llama", "vit"])
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=["compiled", "sh"])
    parser.add_argument("--size", type=float, default=1.0)
    parser.add_argument("--compiled-loss", action="store_true", help="compile the loss with the model")
    args = parser.parse_args(argv)
    print("| model | config | predicted MiB | measured MiB | predicted / measured |")
    print("|---|---|---:|---:|---:|")
    for model in args.models:
        for config in args.configs:
            predicted, measured = predicted_and_measured(model, args.size, config, args.compiled_loss)
            ratio = predicted / measured if measured else float("nan")
            print(f"| {model} | {config} | {predicted / _MiB:.2f} | {measured / _MiB:.2f} | {ratio:.2f} |", flush=True)


if __name__ == "__main__":
    main()
