"""The memory model of graphs as inductor runs them on the CPU: several kernels, one call."""

import pytest
import torch
from torch._inductor import config as inductor_config

import savedhooks as sh
from savedhooks.planner.census import timeline_of
from savedhooks.planner.recording import GraphRecorder, KernelCall, kernel_calls

_MiB = 1 << 20


def _matmul_sum_and_exp(x, w, y):
    # mm (an extern kernel) makes a (4 MiB), a sum reads it for the last time, and
    # exp makes c (2.67 MiB) after it (it reads the sum): the sum and exp kernels run
    # in one C++ function, whose buffers are all allocated before it, while a is
    # freed only after it
    a = x @ w
    b = a.sum(1)
    return b, torch.exp(y) + b[0]


def _recorded_and_measured():
    torch._dynamo.reset()
    args = (torch.randn(512, 64), torch.randn(64, 2048), torch.randn(700, 1000))
    recorder = GraphRecorder()
    compiled = torch.compile(_matmul_sum_and_exp, backend="inductor")
    with inductor_config.patch(post_grad_custom_post_pass=recorder, fx_graph_cache=False), recorder.kernel_order():
        compiled(*args)
    measured = sh.memory.measure_peak(compiled, *args, device="cpu")
    torch._dynamo.reset()
    (gm,) = recorder.forwards
    return gm, measured


def test_kernels_run_as_one_cpu_call_are_modelled_as_inductor_runs_them():
    gm, measured = _recorded_and_measured()
    calls = kernel_calls(gm)
    (run,) = [call for call in calls if "sum_1" in call.made]
    assert "add" in run.made and not run.extern  # one C++ function
    assert KernelCall(("mm",), extern=True) in calls  # the extern kernel is a call of its own
    predicted = max(timeline_of(gm, saved=set(), fused=True).live)
    assert measured > 6.5 * _MiB  # a and c alive together
    assert predicted == pytest.approx(measured, rel=0.01)
    # without the calls (each node on its own) the model frees a before c is made
    gm.meta.pop("savedhooks_kernel_calls")
    assert max(timeline_of(gm, saved=set(), fused=True).live) < 0.7 * measured
