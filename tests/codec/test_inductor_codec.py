"""The fp8 ops' CPU path for large tensors: the decomposed form compiled by inductor (savedhooks/kernels/fp8_inductor.py).

Bit-exact with the aten reference on the cases chosen for the code paths
(``interpret_kernels.inductor_cases``) and on a tensor above the threshold as the
op sees it; it allocates nothing beyond its outputs but the quantize's per-group
amax (measured, and what the memory model counts); it runs only where it serves
(CPU, large enough, outside compiles and dispatch modes); entering the hooks does
not recompile it; a compile that fails warns once and the reference serves.
"""

from __future__ import annotations

import warnings

import interpret_kernels as ik
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import savedhooks as sh
from savedhooks._torch.dynamo import has_aot_compile
from savedhooks.kernels import fp8_inductor
from savedhooks.kernels.fp8 import torch_fp8_dequantize, torch_fp8_quantize
from savedhooks.kernels.fp8_fused import fused_fp8_dequantize, fused_fp8_quantize
from savedhooks.memory.scratch import _scratch  # peak above the outputs, measured

E4M3 = ik.E4M3
CASES = ik.inductor_cases()
QUANTIZE, DEQUANTIZE = torch.ops.savedhooks.fp8_quantize, torch.ops.savedhooks.fp8_dequantize


@pytest.fixture
def every_size(monkeypatch):
    """The compiled form for tensors of any size (the cases are small)."""
    monkeypatch.setattr(fp8_inductor, "INDUCTOR_MIN_ELEMS", 1)


def _roundtrip_problem(x, dtype, granularity, block, pow2, seed) -> str | None:
    q, scale = torch_fp8_quantize(x, dtype, granularity, block, pow2, seed)
    got_q, got_scale = QUANTIZE(x, dtype, granularity, block, pow2, seed)
    want, got = torch_fp8_dequantize(q, scale, x.dtype, block), DEQUANTIZE(q, scale, x.dtype, block)
    return (
        ik._same_bits("q", q.view(torch.uint8), got_q.view(torch.uint8))
        or ik._same_bits("scale", scale, got_scale)
        or ik._same_bits("dequantized", want, got, nan_payloads=False)
    )


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_the_ops_compiled_form_is_bit_exact_with_the_reference(case, every_size):
    x, in_dtype, dtype, granularity, block, pow2, seed = CASES[case]
    x = x.to(in_dtype)
    assert fp8_inductor.uses_inductor(x)
    problem = _roundtrip_problem(x, dtype, granularity, block, pow2, None if seed is None else torch.tensor(seed))
    assert problem is None, problem


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(4096, 2048), (2048, 1000)])
def test_a_large_tensor_takes_the_compiled_form_with_the_references_bytes(shape, monkeypatch):
    """As the op sees a language model's log-softmax: above the threshold, no monkeypatch."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * torch.logspace(-8, 8, shape[1])
    x[0, :3] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    assert fp8_inductor.uses_inductor(x)
    calls, compiled = [], fp8_inductor._compiled
    monkeypatch.setattr(fp8_inductor, "_compiled", lambda fn: calls.append(fn.__name__) or compiled(fn))
    problem = _roundtrip_problem(x, E4M3, "block", 128, False, None)
    assert problem is None, problem
    assert set(calls) == {"fused_fp8_quantize", "fused_fp8_dequantize"}  # the quantize once per chunk with (2048, 1000)


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape, in_dtype, granularity",
    [((65536, 128), torch.float32, "block"), ((512, 1000), torch.float32, "block"),
     ((512, 688), torch.bfloat16, "block"), ((4096, 64), torch.float32, "row")],
)  # fmt: skip
def test_the_compiled_form_allocates_only_what_the_memory_model_counts(shape, in_dtype, granularity):
    """Measured scratch equals the model's figure, and stays under the reference's 256 KiB target."""
    x = torch.randn(shape, dtype=in_dtype)
    q, scale = QUANTIZE(x, E4M3, granularity, 128, False)  # compile outside the measurement
    DEQUANTIZE(q, scale, in_dtype, 128)
    quantize_scratch = _scratch(lambda: QUANTIZE(x, E4M3, granularity, 128, False))
    dequantize_scratch = _scratch(lambda: DEQUANTIZE(q, scale, in_dtype, 128))
    assert quantize_scratch == fp8_inductor.inductor_scratch_bytes(True, shape, tuple(scale.shape), 128)
    assert dequantize_scratch == fp8_inductor.inductor_scratch_bytes(False, shape, tuple(scale.shape), 128) == 0
    assert quantize_scratch <= 256 * 1024

    def pack(x):
        return QUANTIZE(x, E4M3, granularity, 128, False)

    with FakeTensorMode() as mode:  # the model reads a graph's node, as the reorder pass does
        gm = make_fx(pack)(mode.from_tensor(x))
    node = next(n for n in gm.graph.nodes if n.op == "call_function" and "fp8_quantize" in str(n.target))
    assert sh.memory.op_scratch_bytes(node) == quantize_scratch


def test_the_compiled_form_serves_only_large_real_cpu_tensors_outside_compiles():
    large, small = torch.randn(256, 128), torch.randn(100, 128)
    assert fp8_inductor.uses_inductor(large) and not fp8_inductor.uses_inductor(small)
    with FakeTensorMode():  # fake tensors (compiles) and CUDA tensors never reach it
        assert not fp8_inductor.uses_inductor(torch.empty(256, 128, device="cuda"))
    seen = []

    def pack(x):
        seen.append(fp8_inductor.uses_inductor(x))
        return x * 2

    make_fx(pack)(large)  # under a dispatch mode (make_fx's tracer)
    torch.compile(pack, backend="eager", fullgraph=True)(large)  # while dynamo traces
    assert seen == [False, False]
    # make_fx runs the op's body on the real tensor with its mode popped: FX's tracing flag is still up
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_fx(lambda x: QUANTIZE(x, E4M3, "row", 128, False))(large)
    assert fp8_inductor.uses_inductor(large)  # not turned off by a failed compile


def _variants() -> int:
    """Compiled variants of the codec's two functions in this process."""
    return sum(len(fp8_inductor._compiled(fn).variants) for fn in (fused_fp8_quantize, fused_fp8_dequantize))


def _same_bytes(got, want) -> bool:
    """Whether two ``(q, scale)`` pairs hold the same bytes."""
    return all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, want))


def test_entering_the_hooks_does_not_recompile_the_compiled_form(every_size):
    x = torch.randn(64, 128)
    q, scale = QUANTIZE(x, E4M3, "row", 128, False)
    DEQUANTIZE(q, scale, torch.float32, 128)
    before = _variants()
    with sh.saved_tensors_hooks(sh.fp8()), torch.enable_grad():
        q, scale = QUANTIZE(x, E4M3, "row", 128, False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        DEQUANTIZE(q, scale, torch.float32, 128)
    assert _variants() == before


@pytest.mark.slow
@pytest.mark.skipif(not has_aot_compile(), reason="precompiled variants need aot_compile (torch 2.12+)")
def test_the_compiled_variants_outlive_a_dynamo_reset(every_size):
    """Dynamo's reset (tests, benchmark rows) must not trace the codec again; without caches dynamo serves."""
    x = torch.randn(64, 256)
    want = QUANTIZE(x, E4M3, "block", 128, False)
    before, graphs = _variants(), torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    got = QUANTIZE(x * 1, E4M3, "block", 128, False)
    assert _variants() == before and torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert _same_bytes(got, want)
    with torch._inductor.config.patch(force_disable_caches=True):  # aot_compile refuses: dynamo's cache serves
        got = QUANTIZE(x, E4M3, "block", 128, False)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 1 and _variants() == before
    assert _same_bytes(got, want)


@pytest.mark.skipif(not has_aot_compile(), reason="precompiled variants need aot_compile (torch 2.12+)")
def test_past_the_variant_limit_the_path_turns_off_and_the_reference_serves(monkeypatch, every_size):
    monkeypatch.setattr(fp8_inductor, "RECOMPILE_LIMIT", 0)  # no variant may be compiled
    monkeypatch.setattr(fp8_inductor, "_compiled", fp8_inductor._Variants)  # fresh, empty lists
    monkeypatch.setitem(fp8_inductor._state, "enabled", True)
    x = torch.randn(64, 256)
    with pytest.warns(RuntimeWarning, match="0 compiled variants"):
        got = QUANTIZE(x, E4M3, "block", 128, False)
    assert not fp8_inductor.uses_inductor(x)
    assert _same_bytes(got, torch_fp8_quantize(x, E4M3, "block", 128, False))


def test_a_failing_compile_warns_once_and_the_reference_serves(monkeypatch, every_size):
    def broken(fn):
        def run(*args):
            raise RuntimeError("no C++ compiler")

        return run

    monkeypatch.setattr(fp8_inductor, "_compiled", broken)
    monkeypatch.setitem(fp8_inductor._state, "enabled", True)
    x = torch.randn(64, 200)
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
        q, scale = QUANTIZE(x, E4M3, "block", 128, False)
    assert not fp8_inductor.uses_inductor(x)  # off for the process: no second warning
    want_q, want_scale = torch_fp8_quantize(x, E4M3, "block", 128, False)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale, want_scale)


def test_bad_arguments_raise_before_compiling(every_size):
    with pytest.raises(ValueError, match="granularity"):
        fp8_inductor.inductor_fp8_quantize(torch.randn(4, 4), E4M3, "column", 128, False)
    with pytest.raises(ValueError, match="fp8_dequantize expects"):
        fp8_inductor.inductor_fp8_dequantize(torch.zeros(4, 4, dtype=torch.uint8), torch.ones(4, 1), torch.float32, 128)
