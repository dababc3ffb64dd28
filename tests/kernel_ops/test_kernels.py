"""Triton kernels: bit-exact with the aten reference, their ops and fakes, the codecs' backend choice.

On CPU the kernels run under the Triton interpreter in a subprocess
(tests/interpret_kernels.py sets TRITON_INTERPRET=1 before triton is imported,
so nothing in this process changes); the same cases run compiled on CUDA behind
the gpu marker.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import interpret_kernels as ik
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import savedhooks as sh
from savedhooks.codecs.backends import uses_triton
from savedhooks.kernels.fp8 import torch_fp8_dequantize, torch_fp8_quantize

REPO = pathlib.Path(__file__).resolve().parents[2]
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs the triton package")


def _interpret(mode: str) -> dict[str, str | None]:
    """Run tests/interpret_kernels.py's ``mode`` cases in a subprocess; each case's failure message, or None.

    One test per mode starts it, so that under pytest-xdist each mode runs once, on
    one worker (a module fixture shared by parametrized cases ran in every worker
    that drew one of them: pytest-xdist's grouping marks do not work with pytest 9.2).
    """
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    script = REPO / "tests" / "interpret_kernels.py"
    command = [sys.executable, str(script), mode]
    done = subprocess.run(command, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _assert_every_case_passes(cases: list[str], results: dict[str, str | None]) -> None:
    missing = [case for case in cases if case not in results]
    assert not missing, f"the checker did not run these cases: {missing}"
    failed = {case: results[case] for case in cases if results[case] is not None}
    assert not failed, "\n".join(f"{case}: {why}" for case, why in failed.items())


NUMERICS = list(ik.numerics_cases())
COMPILE = list(ik.compile_cases())


@pytest.mark.slow
@needs_triton
def test_triton_is_bit_exact_with_aten_under_the_interpreter():
    _assert_every_case_passes(NUMERICS, _interpret("numerics"))


@pytest.mark.slow
@needs_triton
def test_compiled_gradients_triton_equal_aten_under_the_interpreter():
    _assert_every_case_passes(COMPILE, _interpret("compile"))


def test_the_edge_cases_are_the_hard_ones():
    """The reference rounds these up across a binade (the interpreter's own cast gives 64 for 124.17)."""
    q, scale = torch_fp8_quantize(torch.tensor([[124.17, 125.0, 31.9, 448.0]]), E4M3, "row", 128, False)
    assert scale.item() == 1.0 and q.float().tolist() == [[128.0, 128.0, 32.0, 448.0]]
    q, _ = torch_fp8_quantize(torch.tensor([[2.0**-10, 1.5 * 2.0**-9, 448.0]]), E4M3, "row", 128, False)
    assert q.float().tolist() == [[0.0, 2.0**-8, 448.0]]  # fp8 subnormals: ties to even


# --- ops outside the interpreter -----------------------------------------------------------


def _ops():
    # importing registers the ops
    import savedhooks.kernels.bitmask_triton
    import savedhooks.kernels.fp8_triton  # noqa: F401

    return torch.ops.savedhooks


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape, a.dtype, a.device, a.stride()) == (b.shape, b.dtype, b.device, b.stride())


@needs_triton
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
def test_fake_impls_give_the_aten_ops_shapes_and_dtypes(device, granularity):
    ops = _ops()
    with FakeTensorMode():
        inputs = [
            torch.empty(4, 300, device=device),
            torch.empty(1, 7, dtype=torch.bfloat16, device=device),
            torch.empty(64, 48, dtype=torch.float16, device=device).t(),
            torch.empty(0, 5, device=device),
        ]
        seed = torch.empty((), dtype=torch.int64, device=device)
        for x in inputs:
            for dtype, s in ((E4M3, None), (E5M2, None), (E4M3, seed)):
                got = ops.triton_fp8_quantize(x, dtype, granularity, 128, True, s)
                want = ops.fp8_quantize(x, dtype, granularity, 128, True, s)
                assert all(_same(g, w) for g, w in zip(got, want)), (x.shape, granularity)
                y, y_ref = ops.triton_fp8_dequantize(*got, x.dtype, 128), ops.fp8_dequantize(*want, x.dtype, 128)
                assert _same(y, y_ref) and y.shape == x.shape
        mask = torch.empty(1001, dtype=torch.bool, device=device)
        bits = ops.triton_bitmask_pack(mask)
        assert _same(bits, ops.bitmask_pack(mask)) and bits.shape == (126,)
        assert _same(ops.triton_bitmask_unpack(bits, 1001), ops.bitmask_unpack(bits, 1001))


@needs_triton
def test_on_cpu_without_the_interpreter_the_triton_ops_run_the_aten_reference():
    ops = _ops()
    x = torch.randn(8, 300) * 5
    for granularity in ("tensor", "row", "block"):
        q, scale = ops.triton_fp8_quantize(x, E4M3, granularity, 128, False)
        q_ref, scale_ref = torch_fp8_quantize(x, E4M3, granularity, 128, False)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(scale, scale_ref)
        assert torch.equal(ops.triton_fp8_dequantize(q, scale, torch.float32, 128), torch_fp8_dequantize(q, scale, torch.float32, 128))
    mask = torch.rand(77) > 0.5
    assert torch.equal(ops.triton_bitmask_unpack(ops.triton_bitmask_pack(mask), 77), mask)


class _Captured(Exception):
    pass


def _aot_forward_code(fn, x) -> str:
    from functorch.compile import aot_function

    code = []

    def capture(gm, _inputs):
        code.append(gm.code)
        raise _Captured

    with pytest.raises(_Captured):
        aot_function(fn, fw_compiler=capture)(x)
    return code[0]


@needs_triton
def test_aot_autograd_traces_into_the_kernels_on_cuda_and_keeps_one_node_on_cpu():
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    from savedhooks.kernels.fp8_triton import fp8_dequantize_kernel, fp8_quantize_kernel

    ops = _ops()

    def roundtrip(x):
        q, scale = ops.triton_fp8_quantize(x, E4M3, "block", 128, False)
        return ops.triton_fp8_dequantize(q, scale, torch.float32, 128)

    cpu = _aot_forward_code(roundtrip, torch.randn(8, 256))
    assert "savedhooks.triton_fp8_quantize.default" in cpu and "triton_kernel_wrapper" not in cpu
    with FakeTensorMode():  # no GPU needed to trace (Triton's mutation analysis falls back without a driver)
        cuda = _aot_forward_code(roundtrip, torch.empty(8, 256, device="cuda"))
    assert "savedhooks.triton_fp8" not in cuda and cuda.count("triton_kernel_wrapper_functional(") == 2
    indices = [int(part.split(",")[0]) for part in cuda.split("kernel_idx = ")[1:]]
    assert [kernel_side_table.get_kernel(i) for i in indices] == [fp8_quantize_kernel, fp8_dequantize_kernel]


@needs_triton
def test_bad_arguments_raise_as_the_reference():
    ops = _ops()
    with pytest.raises(ValueError, match="2-D"):
        ops.triton_fp8_quantize(torch.randn(4), E4M3, "row", 128, False)
    with pytest.raises(ValueError, match="out_dtype"):
        ops.triton_fp8_dequantize(*ops.fp8_quantize(torch.randn(2, 4), E4M3, "row", 128, False), torch.float64, 128)
    with pytest.raises(ValueError, match="1-D or a contiguous bool"):
        ops.triton_bitmask_pack(torch.zeros(4, 2, dtype=torch.bool).t())
    with pytest.raises(ValueError, match="1-D or a contiguous bool"):
        ops.triton_bitmask_pack(torch.zeros(4, 2))


# --- the codecs' backend choice --------------------------------------------------------------


def test_backend_is_validated_and_part_of_the_hook_identity():
    for make in (lambda b: sh.codecs.Float8(backend=b), lambda b: sh.codecs.Bitmask(b)):
        with pytest.raises(ValueError, match="backend must be one of"):
            make("cuda")
    assert sh.fp8() is sh.fp8(backend="auto") and sh.bitmask() is sh.bitmask("auto")
    aten, auto = sh.fp8(backend="aten"), sh.fp8()
    assert aten is not auto and aten.cache_hash != auto.cache_hash and "backend='aten'" in aten.name


def test_triton_backend_needs_triton(monkeypatch):
    from savedhooks.codecs import backends

    monkeypatch.setattr(backends, "triton_available", lambda: False)
    with pytest.raises(ValueError, match="needs the triton package"):
        sh.codecs.Float8(backend="triton")
    with FakeTensorMode():
        assert not uses_triton("auto", torch.empty(2, device="cuda"))


def test_auto_uses_triton_only_on_cuda():
    assert not uses_triton("auto", torch.empty(2)) and not uses_triton("aten", torch.empty(2))
    with FakeTensorMode():
        x = torch.empty(2, device="cuda")
        assert uses_triton("auto", x) == HAS_TRITON and not uses_triton("aten", x)


def test_dynamo_takes_triton_available_as_a_constant_without_a_warning_or_a_break():
    # codecs ask it under torch.compile on CUDA (uses_triton); traced through, a functools cache warned and
    # its importlib call broke the graph
    import warnings

    from savedhooks.kernels import triton_available

    torch._dynamo.reset()

    @torch.compile(backend="eager", fullgraph=True)
    def step(x):
        return x + 1 if triton_available() else x - 1

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = step(torch.zeros(2))
    assert out.tolist() == ([1.0, 1.0] if HAS_TRITON else [-1.0, -1.0])
    assert not [w for w in caught if "lru_cache" in str(w.message)]


# --- benchmark -----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA behaviour")
def test_kernel_benchmark_refuses_without_cuda_and_times_aten_with_cpu(capsys):
    from benchmarks import kernels

    assert kernels.main(["--sizes", "1"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    assert kernels.main(["--sizes", "1", "--cpu"]) == 0
    out = capsys.readouterr().out
    assert "no GPU figures measured" in out and "| 1 | fp8_quantize block | aten |" in out and "triton" not in out
    assert "| 1 | fp8_dequantize block | reference |" in out and "| 1 | bitmask_pack | reference |" not in out


# --- CUDA: the compiled kernels ---------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("case", NUMERICS)
def test_triton_is_bit_exact_with_aten_on_cuda(case):
    problem = ik.numerics_cases("cuda")[case]()
    assert problem is None, problem


@pytest.mark.gpu
@pytest.mark.parametrize("case", COMPILE)
def test_compiled_gradients_triton_equal_aten_on_cuda(case):
    problem = ik.compile_cases("cuda")[case]()
    assert problem is None, problem


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 4096), (1, 1 << 20), (3000, 1000)])
def test_large_inputs_bit_exact_on_cuda(shape):
    x = torch.randn(shape, device="cuda") * torch.exp(2 * torch.randn(shape[0], 1, device="cuda"))
    for granularity in ("tensor", "row", "block"):
        assert ik.compare_fp8(x, E4M3, granularity, 128, False) is None
        assert ik.compare_fp8(x.bfloat16(), E5M2, granularity, 128, True) is None


@pytest.mark.gpu
def test_inductor_compiles_the_kernels_as_user_defined_triton():
    from models import mlp, train_step
    from torch._inductor.utils import run_and_get_code

    model = mlp(64).cuda()
    fn = torch.compile(model)
    _, codes = run_and_get_code(lambda: train_step(model, fn, torch.randn(32, 8, device="cuda"), sh.fp8(backend="triton")))
    code = "\n".join(codes)
    assert "fp8_quantize_kernel" in code and "fp8_dequantize_kernel" in code


# --- CUDA code generation without a GPU --------------------------------------------------------


def _compile_for_sm90(fn, signature: dict[str, str], constexprs: dict[str, object]) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for name in constexprs:
        signature[name] = "constexpr"
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]


@needs_triton
def test_kernels_compile_for_a_cuda_target_and_divide_exactly():
    """Triton compiles every kernel variant to PTX (and a cubin) for sm_90 with no GPU; divisions are div.rn."""
    from savedhooks.kernels.bitmask_triton import bitmask_pack_kernel, bitmask_unpack_kernel
    from savedhooks.kernels.fp8_triton import fp8_dequantize_kernel, fp8_quantize_kernel, fp8_tensor_scale_kernel

    groups = {name: "i32" for name in ("n_groups", "cols", "groups_per_row", "group_size", "stride_r", "stride_c")}
    ptx = []
    variants = ((0, True, False, False), (0, False, True, False), (1, True, False, False), (2, False, False, False),
                (0, True, False, True), (2, False, True, True))  # fmt: skip
    for mode, e4m3, bf16, stochastic in variants:
        signature = {"x_ptr": "*i16" if bf16 else "*fp32", "q_ptr": "*u8", "scale_ptr": "*fp32",
                     "seed_ptr": "*i64" if stochastic else "*fp32", **groups}  # fmt: skip
        consts = {"FMAX": 448.0 if e4m3 else 57344.0, "IS_E4M3": e4m3, "POW2": mode == 0, "MODE": mode,
                  "BF16_BITS": bf16, "STOCHASTIC": stochastic, "GROUPS": 32, "BLOCK": 128}  # fmt: skip
        ptx.append(_compile_for_sm90(fp8_quantize_kernel, signature, consts))
    signature = {"partial_ptr": "*fp32", "scale_ptr": "*fp32", "n": "i32"}
    ptx.append(_compile_for_sm90(fp8_tensor_scale_kernel, signature, {"FMAX": 448.0, "POW2": True, "BLOCK": 1024}))
    for out_mb, out_bias, one_scale in ((23, 127, True), (7, 127, False), (10, 15, False)):
        signature = {"q_ptr": "*u8", "scale_ptr": "*fp32", "out_ptr": "*fp32" if out_mb == 23 else "*i16", **groups,
                     "scale_div": "i32"}  # fmt: skip
        consts = {"TOP": 65504.0, "IS_E4M3": out_mb != 7, "OUT_MB": out_mb, "OUT_BIAS": out_bias,
                  "ONE_SCALE": one_scale, "GROUPS": 1, "BLOCK": 4096}  # fmt: skip
        ptx.append(_compile_for_sm90(fp8_dequantize_kernel, signature, consts))
    signature = {"x_ptr": "*u8", "out_ptr": "*u8", "n": "i32", "n_bytes": "i32"}
    ptx.append(_compile_for_sm90(bitmask_pack_kernel, signature, {"BYTES": 2048}))
    signature = {"packed_ptr": "*u8", "out_ptr": "*u8", "n": "i32"}
    ptx.append(_compile_for_sm90(bitmask_unpack_kernel, signature, {"BLOCK": 16384}))
    quantize = "\n".join(ptx[:7])
    multiplier = str(0x21F0AAAD)  # the stochastic variants hash; the others do not
    assert all(multiplier in p for p in ptx[4:6]) and not any(multiplier in p for p in ptx[:4])
    assert "div.rn.f32" in quantize and "div.full.f32" not in quantize and "div.approx.f32" not in quantize
    # Decoded signs are set as a bit: Triton 3.6 compiles -x to `sub.f32 0, x`, which would make -0.0 codes +0.0
    dequantize = "\n".join(ptx[7:10])
    assert "sub.f32" not in dequantize and "neg.f32" not in dequantize
