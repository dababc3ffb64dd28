"""The memory model of graphs as inductor runs them on the CPU: several kernels, one call; inputs it copies."""

import pytest
import torch
from torch._inductor import config as inductor_config

import savedhooks as sh
from savedhooks.memory.scratch import EXTERN_STRIDES, op_scratch_bytes
from savedhooks.planner.census import step_timeline, timeline_of
from savedhooks.planner.recording import COPIED_INPUTS, GraphRecorder, KernelCall, kernel_calls
from savedhooks.planner.step import graph_timelines

_MiB = 1 << 20


def _matmul_sum_and_exp(x, w, y):
    # mm (an extern kernel) makes a (4 MiB), a sum reads it for the last time, and
    # exp makes c (2.67 MiB) after it (it reads the sum): the sum and exp kernels run
    # in one C++ function, whose buffers are all allocated before it, while a is
    # freed only after it
    a = x @ w
    b = a.sum(1)
    return b, torch.exp(y) + b[0]


def _recorded_and_measured(fn=_matmul_sum_and_exp, args=None):
    torch._dynamo.reset()
    if args is None:
        args = (torch.randn(512, 64), torch.randn(64, 2048), torch.randn(700, 1000))
    recorder = GraphRecorder()
    compiled = torch.compile(fn, backend="inductor")
    with inductor_config.patch(post_grad_custom_post_pass=recorder, fx_graph_cache=False), recorder.kernel_order():
        compiled(*args)
    measured = sh.memory.measure_peak(compiled, *args, device="cpu")
    torch._dynamo.reset()
    (gm,) = recorder.inferences  # no input needs a gradient: AOTAutograd compiles it for inference
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


def _transposed_copy(x, w):
    # mm makes a (4 MiB); a pointwise kernel reads it transposed, for the last time, and writes c (4 MiB):
    # it reads another index than it writes, so c cannot take a's buffer
    return (x @ w).t().contiguous() + 1


def _softmax(x, w):
    # mm makes s (4 MiB); one kernel reads it for its max, its sum and the output (4 MiB): the output
    # is not written into s, which the kernel's reductions read too
    return torch.softmax(x @ w, dim=-1)


def _masked(x, w):
    # zeros_like becomes a constant fill that inductor computes inside the where's kernel: no buffer
    s = x @ w
    return torch.where(s > 0, s, torch.zeros_like(s)) * 2


@pytest.mark.parametrize("fn", [_transposed_copy, _softmax, _masked], ids=lambda f: f.__name__.strip("_"))
def test_an_output_takes_a_dying_input_s_buffer_only_where_inductor_writes_in_place(fn):
    """The in-place reuse of the model (an output written into a same-size input that dies in its kernel)
    holds only where inductor's ``decide_inplace_update`` allows it: the kernel reads the input at the index
    it writes and no other node of the kernel reads it. Counted as reused, the transposed copy and the
    softmax would be modelled at 4 MiB for 8 MiB measured."""
    gm, measured = _recorded_and_measured(fn, (torch.randn(512, 64), torch.randn(64, 2048)))
    predicted = max(timeline_of(gm, saved=set(), fused=True).live)
    assert measured >= 4 * _MiB
    assert predicted == pytest.approx(measured, rel=0.01)


class _Patches(torch.nn.Module):
    """A patch embedding (a convolution with stride = kernel, as the vit's) and a Linear head; returns a loss."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 64, 8, stride=8)
        self.head = torch.nn.Linear(64 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x)).flatten(1)).square().mean()


def _recorded_training_step(model, loss_of):
    """Compile ``model`` with inductor and run ``loss_of(compiled).backward()`` recording its graphs (the
    compile caches off), then measure the same step: the recorder and the measured CPU peak."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="inductor")
    recorder = GraphRecorder()
    with (
        inductor_config.patch(post_grad_custom_post_pass=recorder, fx_graph_cache=False),
        torch._functorch.config.patch(force_non_lazy_backward_lowering=True, enable_autograd_cache=False),
        recorder.kernel_order(),
    ):
        loss_of(compiled).backward()
    model.zero_grad(set_to_none=True)
    measured = sh.memory.measure_peak(lambda: loss_of(compiled).backward(), device="cpu")
    torch._dynamo.reset()
    return recorder, measured


@pytest.mark.slow
@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="inductor copies to channels_last with mkldnn")
def test_inputs_that_inductor_copies_for_a_convolution_are_held_to_the_backward():
    """Inductor runs the convolution channels_last on the CPU: it copies the image (1.5 MiB) and the weight,
    and saves the copies for the backward, where the FX graph saves the inputs themselves (held anyway).
    The model counts the copies and meets the measured peak within 1 %; without them it would predict
    less than half of it."""
    torch.manual_seed(0)
    model, x = _Patches(), torch.randn(32, 3, 64, 64)
    recorder, measured = _recorded_training_step(model, lambda compiled: compiled(x))
    (forward,) = recorder.forwards
    placeholders = {n.name: n.meta["val"].shape for n in forward.graph.find_nodes(op="placeholder")}
    assert sorted(placeholders[n] for n in forward.meta[COPIED_INPUTS]) == sorted([x.shape, model.conv.weight.shape])
    forwards, backwards = graph_timelines(recorder, fused=True)
    assert max(step_timeline(forwards, backwards, []).live) == pytest.approx(measured, rel=0.01)
    copies = x.nbytes + model.conv.weight.nbytes
    forward.meta[COPIED_INPUTS] = ()
    without, backwards_without = graph_timelines(recorder, fused=True)
    assert max(step_timeline(without, backwards_without, []).live) < 0.5 * measured
    # held to the end of the forward, and freed in the backward
    assert forwards[0].retained - without[0].retained == copies
    assert backwards[0].live[-1] - backwards_without[0].live[-1] == -copies


class _DepthwiseBlock(torch.nn.Module):
    """A ConvNeXt block: a depthwise 7x7 convolution, then LayerNorm and an MLP over channels-last features."""

    def __init__(self, channels: int = 64) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(channels, channels, 7, padding=3, groups=channels)
        self.norm = torch.nn.LayerNorm(channels)
        self.up, self.down = torch.nn.Linear(channels, 4 * channels), torch.nn.Linear(4 * channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x).permute(0, 2, 3, 1)  # NCHW -> NHWC
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(y)))).permute(0, 3, 1, 2)


@pytest.mark.slow
def test_a_convolution_s_scratch_is_measured_with_the_strides_inductor_passes_it():
    """The depthwise convolution's backward gets, in the FX graph, a gradient in the channels_last strides of
    the permuted MLP output; inductor computes that gradient itself and passes it contiguous. On the CPU the
    op allocates several times as much on the graph's strides (how much depends on the CPU's kernels): the
    step is predicted at its measured peak with the strides inductor passes, and each convolution's
    scratch is larger on the graph's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_DepthwiseBlock(), _DepthwiseBlock())
    x = torch.randn(8, 64, 8, 8)
    recorder, measured = _recorded_training_step(model, lambda compiled: compiled(x).square().mean())
    (backward,) = recorder.backwards
    convs = [n for n in backward.graph.nodes if n.target is torch.ops.aten.convolution_backward.default]
    assert convs and all(EXTERN_STRIDES in n.meta for n in convs)
    in_graph = [n.args[0].meta["val"].stride() for n in convs]
    assert any(n.meta[EXTERN_STRIDES][0] != tuple(s) for n, s in zip(convs, in_graph, strict=True))
    forwards, backwards = graph_timelines(recorder, fused=True)
    assert max(step_timeline(forwards, backwards, []).live) == pytest.approx(measured, rel=0.05)
    passed = [op_scratch_bytes(n, fused=True) for n in convs]
    for node in convs:
        del node.meta[EXTERN_STRIDES]
    on_graph_strides = [op_scratch_bytes(n, fused=True) for n in convs]
    assert all(mine > theirs > 0 for mine, theirs in zip(on_graph_strides, passed, strict=True))


def test_a_graph_with_a_tensor_constant_is_recorded_with_its_constant():
    """A tensor built from literals in the forward is a constant of the graph (a get_attr node): the recorded
    graph module holds it, as the graph inductor compiles does."""
    torch._dynamo.reset()
    recorder = GraphRecorder()
    x = torch.randn(8, 4)
    compiled = torch.compile(lambda x: x * torch.tensor([1.0, 2.0, 3.0, 4.0]), backend="inductor")
    with inductor_config.patch(post_grad_custom_post_pass=recorder, fx_graph_cache=False):
        compiled(x)
    torch._dynamo.reset()
    (gm,) = recorder.inferences
    (constant,) = [n.target for n in gm.graph.find_nodes(op="get_attr")]
    assert torch.equal(getattr(gm, constant), torch.tensor([1.0, 2.0, 3.0, 4.0]))
