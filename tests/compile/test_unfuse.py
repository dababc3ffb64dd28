"""Splitting inductor's late ``addmm`` back into ``mm`` + ``add`` so that the reorder pass can run the ``mm`` early."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import savedhooks as sh
import savedhooks.compiler.api
from savedhooks.compiler.unfuse import join_adjacent, split_late_addmm

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def _fresh_inductor_cache():
    """A cached graph skips post-grad passes: every test here compiles from scratch."""
    from torch._inductor.utils import fresh_cache

    with fresh_cache():
        yield


def _late_bias(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    m = a.relu()
    bias = c.sin().cos()  # made after both matrices
    return torch.addmm(bias, m, b)


def _targets(graph: torch.fx.Graph) -> list:
    return [n.target for n in graph.nodes if n.op == "call_function"]


def test_a_late_bias_is_split_and_fused_again_where_nothing_moved():
    a, b, c = torch.randn(8, 16), torch.randn(16, 4), torch.randn(8, 4)
    gm = make_fx(_late_bias, tracing_mode="fake")(a, b, c)
    mms = split_late_addmm(gm.graph)
    assert len(mms) == 1 and aten.addmm.default not in _targets(gm.graph)
    assert [u.target for u in mms[0].users] == [aten.add.Tensor]
    assert mms[0].meta["val"].shape == (8, 4)
    gm.recompile()
    torch.testing.assert_close(gm(a, b, c), c.sin().cos() + a.relu() @ b, rtol=0, atol=0)
    assert join_adjacent(gm.graph, mms) == 1  # the mm still runs right before its add
    gm.recompile()
    assert aten.addmm.default in _targets(gm.graph) and aten.mm.default not in _targets(gm.graph)
    torch.testing.assert_close(gm(a, b, c), _late_bias(a, b, c))


def _chained_late_biases(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    first = torch.addmm(c.sin().cos(), a, b)  # split: its bias is made after a and b
    return torch.addmm(first, a, d)  # its bias is the add the first split made (a mixture of experts' sum)


def test_an_addmm_whose_bias_a_split_made_is_split_too():
    a, b, c, d = torch.randn(8, 16), torch.randn(16, 4), torch.randn(8, 4), torch.randn(16, 4)
    gm = make_fx(_chained_late_biases, tracing_mode="fake")(a, b, c, d)
    assert len(split_late_addmm(gm.graph)) == 2
    gm.recompile()
    torch.testing.assert_close(gm(a, b, c, d), _chained_late_biases(a, b, c, d))


def test_a_moved_mm_stays_split():
    a, b, c = torch.randn(8, 16), torch.randn(16, 4), torch.randn(8, 4)
    gm = make_fx(_late_bias, tracing_mode="fake")(a, b, c)
    (mm,) = split_late_addmm(gm.graph)
    relu = next(n for n in gm.graph.nodes if n.target is aten.relu.default)
    relu.append(mm)  # what the reorder pass does when running the mm early lowers the peak
    assert join_adjacent(gm.graph, [mm]) == 0
    gm.recompile()
    torch.testing.assert_close(gm(a, b, c), c.sin().cos() + a.relu() @ b, rtol=0, atol=0)


def test_a_linear_layers_addmm_is_left_alone():
    # the bias of a linear layer is an input: it exists before the matrices
    w, bias, x = torch.randn(4, 16), torch.randn(4), torch.randn(8, 16)
    gm = make_fx(lambda x, w, bias: torch.nn.functional.linear(x.relu(), w, bias), tracing_mode="fake")(x, w, bias)
    assert aten.addmm.default in _targets(gm.graph)
    assert split_late_addmm(gm.graph) == []
    assert aten.addmm.default in _targets(gm.graph)


def _backward_peak(module: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> int:
    # The split acts on the loss head, whatever form the codec takes: the opaque op (backend="aten")
    # compiles GPT-2 faster than the decomposed form; with it the split saves at least 0.4x of the logits bytes
    compiled = torch.compile(module)

    def forward() -> torch.Tensor:
        with sh.saved_tensors_hooks(sh.fp8(backend="aten")):
            return compiled(**inputs)

    forward().backward()  # compile
    module.zero_grad(set_to_none=True)
    held = []
    _, peak = sh.memory.measure_peaks(lambda: held.append(forward()), lambda: held.pop().backward(), device="cpu")
    return peak


@pytest.mark.slow
def test_gpt2s_tied_head_gradient_split_frees_the_logits_gradient_early(monkeypatch):
    """GPT-2 with its loss compiled: the head's weight-gradient matmul (an addmm with the embedding's
    gradient, made last) runs at the end of the backward unless split, and the logits' gradient lives until then."""
    pytest.importorskip("transformers")
    from benchmarks.models import make_workload

    workload = make_workload("gpt2")
    logits_bytes = 2 * 256 * 2048 * 4  # batch x seq x vocab floats
    split = _backward_peak(workload.with_loss(), workload.inputs)
    grads = [p.grad for p in workload.model.parameters()]
    workload.model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    monkeypatch.setattr(savedhooks.compiler.api, "split_late_addmm", lambda graph: [])
    with torch._inductor.utils.fresh_cache():
        fused = _backward_peak(workload.with_loss(), workload.inputs)
    assert split <= fused - 0.4 * logits_bytes, (split, fused)
    for got, want in zip(grads, [p.grad for p in workload.model.parameters()]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
