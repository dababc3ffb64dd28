"""The decomposed fp8 form (savedhooks/kernels/fp8_fused.py): bit-exact with the aten reference, fused by inductor.

Eager: every fp8 case of the kernel tests (tests/interpret_kernels.py: shape
sweep, edge values, non-contiguous inputs). Compiled with inductor (CPU): a few
cases chosen for the code paths (vectorized body and scalar tail, ties and
subnormals, non-finite values, a short last block, each granularity), each
compile costing seconds. Then the codec: which form ``backend`` picks, the
backward of a GELU-MLP dequantizing inside the GELU-backward kernel, and
gradients equal to those with the opaque op.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re

import interpret_kernels as ik
import pytest
import torch
from models import GraphCapture, train_step, train_step_grads, transformer

import savedhooks as sh
from savedhooks.codecs.backends import uses_fused
from savedhooks.codecs.base import pack_saved, unpack_saved
from savedhooks.kernels.fp8 import _code_value, torch_fp8_dequantize, torch_fp8_quantize
from savedhooks.kernels.fp8_fused import fp8_code, fp8_value, fused_fp8_dequantize, fused_fp8_quantize

E4M3, E5M2 = ik.E4M3, ik.E5M2
FP8_CASES = ik.fp8_cases("cpu", "fused")
STOCHASTIC_CASES = ik.fp8_cases("cpu", "fused", stochastic=True)


@pytest.mark.parametrize("case", list(FP8_CASES))
def test_fused_is_bit_exact_with_the_reference_eager(case):
    problem = FP8_CASES[case]()
    assert problem is None, problem


@pytest.mark.parametrize("case", list(STOCHASTIC_CASES))
def test_fused_stochastic_rounding_is_bit_exact_with_the_reference_eager(case):
    """Same seed, same bytes: the hash of the flat index and the rounding on the bits agree with the reference."""
    problem = STOCHASTIC_CASES[case]()
    assert problem is None, problem


def test_the_float64_division_used_off_cpu_is_bit_exact_too(monkeypatch):
    """Off CPU the form divides in float64 and rounds (inductor's Triton ``/`` is approximate); same bits."""
    from savedhooks.kernels import fp8_fused

    monkeypatch.setattr(fp8_fused, "_exact_div", lambda a, b: (a.double() / b.double()).float())
    names = [n for n in FP8_CASES if n.startswith(("edge", "sweep (17, 33)", "sweep (3, 300)"))]
    problems = [p for p in (FP8_CASES[n]() for n in names) if p]
    assert not problems, problems[:3]


def test_every_code_round_trips():
    for dtype in (E4M3, E5M2):
        codes = torch.arange(256, dtype=torch.uint8)
        want = _code_value(codes.view(dtype))  # the reference's reading: e4m3fn's NaN codes are +-inf
        got = fp8_value(codes, dtype)
        assert ik._same_bits(f"{dtype} values", want, got, nan_payloads=False) is None
        kept = ~torch.isnan(want)  # every code but e5m2's NaNs comes back as itself, +-inf included
        assert torch.equal(fp8_code(got[kept], dtype), codes[kept].int())
        assert int(kept.sum()) == (256 if dtype == E4M3 else 250)


def test_the_sign_set_as_a_bit_off_cpu_decodes_every_code_as_the_reference(monkeypatch):
    """Off the CPU the decode sets the sign bit (no float negation, which Triton makes ``0 - x``); same bits."""
    from savedhooks.kernels import fp8_fused

    negation = ik._same_bits("", torch.tensor([-0.0]), fp8_fused._apply_sign(torch.zeros(1), torch.tensor([0x80])))
    assert negation is None  # on the CPU, a true negation
    monkeypatch.setattr(fp8_fused, "_apply_sign", functools.partial(fp8_fused._apply_sign, bitwise=True))
    for dtype in (E4M3, E5M2):
        codes = torch.arange(256, dtype=torch.uint8)
        got = fp8_value(codes, dtype)
        assert ik._same_bits(f"{dtype} values", _code_value(codes.view(dtype)), got, nan_payloads=False) is None
        assert torch.signbit(got[0x80]) and not torch.signbit(got[0])


COMPILED = ik.inductor_cases()


def _hash_vectorizes(in_dtype: torch.dtype) -> bool:
    """Whether inductor's C++ backend vectorizes the stochastic quantize kernel on this CPU.

    On an AVX2-only CPU (``VecAVX2``) it falls back to a scalar loop for bf16
    input; float32 input vectorizes on AVX2 and AVX-512.
    """
    from torch._inductor import cpu_vec_isa

    return in_dtype == torch.float32 or "avx512" in str(cpu_vec_isa.pick_vec_isa())


def _compiled_case(case: str, device: str) -> tuple[str | None, list[str]]:
    """Compile ``COMPILED[case]``'s round trip with inductor on ``device``: (problem or None, inductor's code)."""
    from torch._inductor.utils import run_and_get_code

    x, in_dtype, dtype, granularity, block, pow2, seed = COMPILED[case]
    x = x.to(device=device, dtype=in_dtype)
    seed = None if seed is None else torch.tensor(seed, device=device)
    q, scale = torch_fp8_quantize(x, dtype, granularity, block, pow2, seed)

    def roundtrip(x, codes, scale, seed):
        # the decode in the codes' own shape and computed in a flat one (scales expanded when they tile)
        decoded = [fused_fp8_dequantize(codes, scale, dtype, in_dtype, block, shape) for shape in (None, (x.numel(),))]
        return fused_fp8_quantize(x, dtype, granularity, block, pow2, seed), *decoded

    compiled = torch.compile(roundtrip, backend="inductor", fullgraph=True)
    ((got_q, got_scale), got, flat), codes = run_and_get_code(compiled, x, q.view(torch.uint8), scale, seed)
    want = torch_fp8_dequantize(q, scale, in_dtype, block)
    if device != "cpu":  # the sign of a NaN code follows the device's NaN propagation (see the CUDA test)
        q, got_q = _unsigned_nan_codes(q, dtype), _unsigned_nan_codes(got_q, dtype)
    problem = (
        ik._same_bits("q", q.view(torch.uint8), got_q)
        or ik._same_bits("scale", scale, got_scale)
        or ik._same_bits("dequantized", want, got, nan_payloads=False)
        or ik._same_bits("dequantized in a flat shape", want.view(-1), flat, nan_payloads=False)
    )
    return problem, codes


def _unsigned_nan_codes(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 codes with the sign bit of every NaN code cleared (other codes as they are)."""
    codes = codes.view(torch.uint8)
    return torch.where(torch.isnan(codes.view(dtype).float()), codes & 0x7F, codes)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(COMPILED))
def test_fused_is_bit_exact_with_the_reference_under_inductor(case):
    problem, codes = _compiled_case(case, "cpu")
    seed, in_dtype = COMPILED[case][6], COMPILED[case][1]
    if seed is not None and _hash_vectorizes(in_dtype):
        # the hash vectorizes too (a transformer step, as below, takes ~85 s to compile with it)
        quantizing = _quantize_kernels(codes[0])
        assert quantizing and not _scalar(quantizing), _scalar(quantizing)
        assert all("VectorizedN<int64_t,2>" in body and str(0x21F0AAAD) in body for body in quantizing.values())
    assert problem is None, problem


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(COMPILED))
def test_fused_is_bit_exact_with_the_reference_under_inductor_on_cuda(case):
    """Inductor's Triton code for the decomposed form: the same bytes as the aten reference (on the GPU).

    The edge inputs hold every fp8 code, -0.0 among them: Triton 3.6 compiles a
    float negation to ``0 - x``, which would decode it to +0.0, so off the CPU the
    decode sets the sign as a bit. The sign of a NaN code is not compared: with a
    NaN scale, ``x / scale`` is a NaN whose sign the device's arithmetic chooses,
    and the reference's and inductor's codes may differ there (127 against 255).
    Every other code is compared.
    """
    problem, codes = _compiled_case(case, "cuda")
    assert any("@triton.jit" in code for code in codes), "inductor generated no Triton kernel"
    assert problem is None, problem


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_every_code_decodes_to_its_value_under_inductor_on_cuda(dtype):
    """All 256 codes, -0.0 among them, decoded by inductor's Triton code: the reference's values, bit for bit."""
    codes = torch.arange(256, dtype=torch.uint8)
    decode = torch.compile(lambda c: fp8_value(c, dtype), backend="inductor")
    got = decode(codes.cuda()).cpu()
    assert ik._same_bits(f"{dtype} values", _code_value(codes.view(dtype)), got, nan_payloads=False) is None


def test_bad_arguments_raise_as_the_reference():
    with pytest.raises(ValueError, match="2-D"):
        fused_fp8_quantize(torch.randn(4), E4M3, "row", 128, False)
    with pytest.raises(ValueError, match="granularity"):
        fused_fp8_quantize(torch.randn(2, 4), E4M3, "column", 128, False)
    codes, scale = fused_fp8_quantize(torch.randn(2, 4), E4M3, "row", 128, False)
    with pytest.raises(ValueError, match="uint8"):
        fused_fp8_dequantize(codes.view(E4M3), scale, E4M3, torch.float32, 128)
    with pytest.raises(ValueError, match="dtype must be one of"):
        fused_fp8_dequantize(codes, scale, torch.uint8, torch.float32, 128)
    empty_q, empty_scale = fused_fp8_quantize(torch.empty(0, 5), E4M3, "block", 2, False)
    assert empty_q.shape == (0, 5) and empty_scale.shape == (0, 3)


# --- the codec --------------------------------------------------------------------------------


def test_backend_fused_is_valid_for_fp8_only():
    assert sh.fp8(backend="fused") is not sh.fp8() and "backend='fused'" in sh.fp8(backend="fused").name
    with pytest.raises(ValueError, match="backend must be one of"):
        sh.codecs.Bitmask("fused")
    assert uses_fused("fused") and not uses_fused("auto") and not uses_fused("aten")  # eager: no hook context


@pytest.mark.parametrize(
    "make", [lambda: torch.randn(4, 300) * 3, lambda: torch.randn(2, 3, 8, 10).to(memory_format=torch.channels_last)]
)
def test_codec_payloads_of_both_forms_are_the_same_bytes(make):
    x = make()
    for codec in (sh.codecs.Float8(), sh.codecs.Float8(E5M2, "row", 128, True), sh.codecs.Float8(granularity="tensor")):
        fused_codec = dataclasses.replace(codec, backend="fused")
        q, scale, _, _, fused = pack_saved(fused_codec, x)[1]
        q_op, scale_op, _, _, fused_op = pack_saved(codec, x)[1]
        assert fused and not fused_op and q.dtype == torch.uint8 and q_op.dtype == codec.dtype
        assert torch.equal(q, q_op.view(torch.uint8)) and torch.equal(scale, scale_op)
        a = unpack_saved(fused_codec, pack_saved(fused_codec, x))
        b = unpack_saved(codec, pack_saved(codec, x))
        assert a.stride() == b.stride() and torch.equal(a, b)


def test_fused_backend_traces_plain_aten_ops():
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    capture = GraphCapture()
    hooks = sh.fp8(backend="fused")
    train_step_grads(model, torch.compile(model, backend=capture.backend), torch.randn(16, 8), hooks)
    code = capture.fw[0] + capture.bw[0]
    assert "savedhooks.fp8_" not in code and "torch.uint8" in code and "float8" not in code
    assert "aten.div.Tensor(" in code and "aten.view.dtype(" in code and "aten.__rshift__." in code


@pytest.mark.slow
def test_auto_is_fused_only_where_inductor_compiles():
    """aot_eager would run each decomposed op as a full-size pass: there "auto" keeps the op, as in eager."""
    from torch._inductor.utils import run_and_get_code

    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    x = torch.randn(16, 8)
    capture = GraphCapture()
    train_step_grads(model, torch.compile(model, backend=capture.backend), x, sh.fp8())
    assert "savedhooks.fp8_quantize" in capture.fw[0] and "savedhooks.fp8_dequantize" in capture.bw[0]
    torch._dynamo.reset()
    fn = torch.compile(model, backend="inductor")
    _, codes = run_and_get_code(lambda: train_step(model, fn, x, sh.fp8()))
    assert "fp8_quantize" not in codes[0] and "uint8_t" in codes[0] and "fp8_dequantize" not in codes[-1]
    # eager: no hook context, "auto" runs the op (the payload is float8)
    assert pack_saved(sh.codecs.Float8(), torch.randn(4, 256))[1][0].dtype == E4M3


@pytest.mark.slow
def test_auto_keeps_the_op_for_16_bit_tensors_on_the_cpu_under_inductor():
    from torch._inductor.utils import run_and_get_code

    model, x = _gelu_mlp(), torch.randn(32, 16)
    torch._dynamo.reset()
    fn = torch.compile(model, backend="inductor")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, codes = run_and_get_code(lambda: train_step(model, fn, x, sh.fp8()))
    assert "savedhooks.fp8_quantize" in codes[0] and "savedhooks.fp8_dequantize" in codes[-1]


def _conv_bn_net() -> torch.nn.Module:
    torch.manual_seed(0)

    def block(c_in: int, c_out: int) -> torch.nn.Module:
        conv = torch.nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        return torch.nn.Sequential(conv, torch.nn.BatchNorm2d(c_out), torch.nn.ReLU(), torch.nn.MaxPool2d(2))

    return torch.nn.Sequential(block(3, 16), block(16, 32), torch.nn.Flatten(), torch.nn.Linear(32 * 4 * 4, 10))


def _bf16_step_peak(hooks: sh.HookPair | None) -> int:
    torch._dynamo.reset()
    model, x = _conv_bn_net(), torch.randn(32, 3, 16, 16)
    fn = torch.compile(model, backend="inductor")

    def step():
        model.zero_grad(set_to_none=True)
        with sh.saved_tensors_hooks(hooks) if hooks else contextlib.nullcontext(), \
                torch.autocast("cpu", dtype=torch.bfloat16):  # fmt: skip
            loss = fn(x).float().square().sum()
        loss.backward()

    step()
    return sh.memory.measure_peak(step, device="cpu")


@pytest.mark.slow
def test_bf16_conv_batch_norm_step_peaks_no_higher_than_without_hooks():
    """The decomposed decode of a bf16 conv output, fused by inductor into the kernels that recompute
    batch norm in the backward, holds float32 intermediates of the full shape there (a step peak above
    no hooks); the opaque op, which "auto" keeps for 16-bit tensors on the CPU, does not."""
    plain = _bf16_step_peak(None)
    assert _bf16_step_peak(sh.policy()) <= plain
    # the batch norms' inputs allowed plain fp8 (the tolerance rules would keep them), decoded by the fused form
    norms = ("native_batch_norm_legit_functional",)
    assert _bf16_step_peak(sh.policy(floating=sh.fp8(backend="fused"), allow=norms)) > 1.1 * plain  # why the rule exists


def _code_reads(code: str) -> dict[str, int]:
    """How many kernel calls of inductor's (CPU) code read each ``uint8`` buffer (the fp8 codes): name -> calls."""
    reads: dict[str, int] = {}
    for name, types in re.findall(r"\n(cpp_fused\w*) = async_compile.cpp_pybinding\(\[([^\]]*)\]", code):
        types = [t.strip().strip("'") for t in types.split(",")]
        for call in re.findall(rf"\n\s*{name}\(([^)]*)\)", code):
            for arg, kind in zip(call.split(","), types):
                if kind == "const uint8_t*":
                    reads[arg.strip()] = reads.get(arg.strip(), 0) + 1
    return reads


@pytest.mark.slow
@pytest.mark.parametrize(
    "hooks", [sh.fp8(), sh.policy()], ids=["fp8", "policy"]
)
def test_each_convolution_outputs_codes_are_read_by_one_backward_kernel(hooks):
    """The decode is inlined into each backward kernel that reads the value, and inductor realizes
    (CPU) a pointwise node of over 50 ops that has several readers. A heavier decode (the policy's
    centered one with two more ops) would have the ReLU masks (decode, batch norm, compare) computed up
    front in kernels of their own, and each convolution output's codes read twice: a higher step peak
    and a slower step on the benchmark cnn."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    model, x = _conv_bn_net(), torch.randn(32, 3, 16, 16)
    fn = torch.compile(model, backend="inductor")
    reads = _code_reads(run_and_get_code(lambda: train_step(model, fn, x, hooks))[1][-1])
    convolutions = {name: n for name, n in reads.items() if name.startswith("convolution")}
    assert len(convolutions) == 2, reads
    assert all(n == 1 for n in convolutions.values()), reads


def _gelu_mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))


def _step_code(model: torch.nn.Module, x: torch.Tensor, backend: str) -> list[str]:
    """Inductor's (CPU) code of a training step under ``sh.fp8(backend=backend)``: forward first, backward last."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    fn = torch.compile(model, backend="inductor")
    # reorder=False: torch's own order on both sides, so that only the codec differs (the pass
    # changes which freed buffers inductor reuses, and with them the count of allocations)
    _, codes = run_and_get_code(lambda: train_step(model, fn, x, sh.fp8(backend=backend), reorder=False))
    return codes


def _backward_code(backend: str) -> str:
    torch.manual_seed(0)
    return _step_code(_gelu_mlp(), torch.randn(32, 16), backend)[-1]


def _gelu_backward_reads_codes(code: str) -> bool:
    """Whether the kernel computing GELU's backward reads uint8 codes of a saved tensor itself."""
    signatures = re.findall(r"(cpp_fused\w*gelu_backward\w*) = async_compile.cpp_pybinding\(\[([^\]]*)\]", code)
    calls = {name: re.search(rf"\n\s*{name}\(([^)]*)\)", code).group(1) for name, _ in signatures}
    return any(
        "const uint8_t*" in types and any(arg.strip().endswith("_hook_1") for arg in calls[name].split(","))
        for name, types in signatures
    )


def _full_size_float_buffers(code: str) -> int:
    """(32, 64) float32 buffers the backward allocates, by inductor or by an opaque op."""
    allocated = len(re.findall(r"empty_strided_cpu\(\(32, 64\), \(64, 1\), torch\.float32\)", code))
    return allocated + len(re.findall(r"= torch\.ops\.savedhooks\.fp8_dequantize", code))


@pytest.mark.slow
def test_inductor_fuses_the_dequantize_into_the_gelu_backward_kernel():
    fused, opaque = _backward_code("fused"), _backward_code("aten")
    assert _gelu_backward_reads_codes(fused), fused
    assert not _gelu_backward_reads_codes(opaque)  # the check can fail: the op materializes a float tensor first
    assert "fp8_dequantize" not in fused and "fp8_dequantize" in opaque
    # GELU's input is dequantized inside the kernel: one full-size float buffer fewer; and GELU's
    # output, decoded for the weight's gradient in the kernel that sums the bias's, one more (a
    # heavier decode was computed in a kernel of its own into a buffer of its own)
    assert _full_size_float_buffers(fused) == _full_size_float_buffers(opaque) - 2


def _triton_kernels(code: str) -> dict[str, str]:
    """Inductor's Triton kernels in ``code``: name -> source (its ``triton_meta`` signature included)."""
    return dict(re.findall(r"\n(triton_\w+) = async_compile\.triton\('\w+', r?'''(.*?)'''", code, re.DOTALL))


@pytest.mark.gpu
def test_inductor_fuses_the_dequantize_into_the_gelu_backward_kernel_on_cuda():
    """Inductor's Triton backward: a GELU-backward kernel reads the uint8 codes; fewer full-size float buffers."""
    torch.manual_seed(0)
    model, x = _gelu_mlp().cuda(), torch.randn(32, 16, device="cuda")
    fused, opaque = (_step_code(model, x, backend)[-1] for backend in ("fused", "aten"))
    kernels = _triton_kernels(fused)
    reading = [name for name, body in kernels.items() if "gelu" in name and "'*u8'" in body]
    assert reading, f"no GELU kernel reads uint8 codes: {list(kernels)}"
    assert "fp8_dequantize" not in fused and "fp8_dequantize" in opaque

    def float_buffers(code: str) -> int:
        allocated = len(re.findall(r"empty_strided_cuda\(\(32, 64\), \(64, 1\), torch\.float32\)", code))
        return allocated + len(re.findall(r"= torch\.ops\.savedhooks\.fp8_dequantize", code))

    assert float_buffers(fused) < float_buffers(opaque), (float_buffers(fused), float_buffers(opaque))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("model", ["gelu mlp", "transformer"])
def test_gradients_with_the_fused_form_equal_those_with_the_op(model, backend):
    make, shape = {"gelu mlp": (_gelu_mlp, (32, 16)), "transformer": (lambda: transformer(1, 32), (2, 8, 32))}[model]
    torch.manual_seed(0)
    net, x = make(), torch.randn(*shape)
    grads = {}
    for kernels in ("aten", "fused"):
        torch._dynamo.reset()
        grads[kernels] = train_step_grads(net, torch.compile(net, backend=backend), x, sh.fp8(backend=kernels))
    plain = train_step_grads(net, net, x)
    assert any(not torch.equal(p, f) for p, f in zip(plain, grads["fused"]))  # fp8 did change something
    for i, (a, f) in enumerate(zip(grads["aten"], grads["fused"])):
        assert torch.equal(a, f), f"gradient {i}: max |diff| {(a - f).abs().max().item()}"


def _quantize_kernels(code: str) -> dict[str, str]:
    """Inductor's C++ kernels that write fp8 codes (a non-const ``uint8_t*`` argument): name -> body."""
    kernels = re.findall(
        r"\n(cpp_fused\w*) = async_compile.cpp_pybinding\(\[([^\]]*)\], r?'''(.*?)'''", code, re.DOTALL
    )
    return {name: body for name, types, body in kernels if "'uint8_t*'" in types}


def _scalar(kernels: dict[str, str]) -> list[str]:
    """Names of the kernels inductor left as scalar loops (a ``max_shift`` guard is how scalar code shifts)."""
    return [name for name, body in kernels.items() if "max_shift" in body or "Vectorized<int32_t>" not in body]


@pytest.mark.slow
def test_inductor_vectorizes_the_quantize_it_fuses():
    """The encode's shifts are constant: inductor's C++ backend keeps the fused kernels vectorized.

    A transformer block's forward quantizes the GELU output inside a kernel that
    reads it through a reshaped view; with a per-element shift count the encode
    made that kernel a scalar loop (``max_shift`` guards are how the scalar codegen
    prints a shift; the vector codegen prints none). Stochastic rounding is checked
    on the compiled bit-exact cases above: with its hash this step compiles for
    ~85 s (its quantize kernels were vectorized too when checked).
    """
    torch.manual_seed(0)
    quantizing = _quantize_kernels(_step_code(transformer(1, 128), torch.randn(4, 96, 128), "fused")[0])
    assert quantizing, "no kernel writes fp8 codes"
    assert not _scalar(quantizing), f"quantize kernels not vectorized: {_scalar(quantizing)}"
    # the blocks of 128 as rows are a view through (rows, blocks, 128): viewed at once, inductor loaded the
    # layer-norm + GELU value it quantizes through ``(x1 + 128 * x0) % 512``, lane by lane into a buffer
    gathering = [name for name, body in quantizing.items() if "_inner] =" in body]
    assert not gathering, f"quantize kernels that gather their input: {gathering}"


@pytest.mark.parametrize(
    "shape, granularity, block, view",
    [((6, 256), "block", 64, (3, 2, 16, 16)), ((5, 40), "row", 128, (8, 25)), ((16, 128), "block", 128, (4, 4, 2, 64))],
)
def test_the_dequantize_in_the_saved_tensors_shape_is_bit_exact_under_inductor(shape, granularity, block, view):
    """Rows of codes that span rows of ``view``: the scales, tiling them, are expanded into it; same bits as the reference."""
    torch.manual_seed(0)
    x = torch.randn(shape) * torch.logspace(-3, 3, shape[0]).unsqueeze(1)  # rows of different scales
    q, scale = torch_fp8_quantize(x, E4M3, granularity, block, False)
    decode = torch.compile(
        lambda c, s: fused_fp8_dequantize(c, s, E4M3, torch.float32, block, view), backend="inductor"
    )
    got = decode(q.view(torch.uint8), scale)
    assert got.shape == view
    assert torch.equal(got, torch_fp8_dequantize(q, scale, torch.float32, block).view(view))


def _dequantize_kernels(code: str) -> dict[str, str]:
    """Inductor's C++ kernels that read fp8 codes (a ``const uint8_t*`` argument): name -> body."""
    kernels = re.findall(
        r"\n(cpp_fused\w*) = async_compile.cpp_pybinding\(\[([^\]]*)\], r?'''(.*?)'''", code, re.DOTALL
    )
    return {name: body for name, types, body in kernels if "'const uint8_t*'" in types}


@pytest.mark.slow
def test_inductor_vectorizes_the_dequantize_of_rows_blocked_across_rows():
    """Rows of 8 values are quantized in blocks of 128 that span 16 rows.

    Dequantized as ``(blocks, 128)`` and viewed back, inductor indexed the codes
    through ``128 * (i // 128) + i % 128`` and left the consuming GELU-backward
    kernel scalar; computed in the saved tensor's own shape it stays vectorized
    (the benchmark's cnn: its ``(32, 128, 8, 8)`` convolution outputs).
    """
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    decoding = _dequantize_kernels(_step_code(net, torch.randn(4, 32, 8, 8), "fused")[-1])
    assert any("gelu" in name for name in decoding), f"no GELU-backward kernel reads codes: {list(decoding)}"
    assert not _scalar(decoding), f"dequantize kernels not vectorized: {_scalar(decoding)}"
