"""Checks of the Triton kernels on CPU under the Triton interpreter; run by tests/kernel_ops/test_kernels.py.

``python tests/interpret_kernels.py numerics|compile [case ...]`` sets
``TRITON_INTERPRET=1`` before anything imports triton (so it runs in its own
process), runs the cases and prints one JSON object ``{case: null | "what
differs"}`` as the last line. Each case compares the Triton op with the aten
reference bit for bit. Imported (by the tests, for case names and the CUDA runs)
it changes no environment and imports no triton until a case runs.
"""

from __future__ import annotations

import os

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"

import itertools
import json
import sys
import traceback
from collections.abc import Callable, Iterator

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
GRANULARITIES = ("tensor", "row", "block")
# Last dims: 1, odd, below / at / above a block, several blocks with a short last one,
# longer than one 4096-wide kernel step (a row walked in two steps).
SHAPES = [(1, 1), (1, 7), (5, 128), (17, 33), (64, 48), (3, 300), (2, 1000), (1, 4100)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _same_bits(name: str, want: torch.Tensor, got: torch.Tensor, nan_payloads: bool = True) -> str | None:
    """None when equal bit for bit (NaN payloads only compared when asked), else a description."""
    if want.shape != got.shape or want.dtype != got.dtype:
        return f"{name}: {want.dtype}{tuple(want.shape)} vs {got.dtype}{tuple(got.shape)}"
    if not nan_payloads and want.is_floating_point():
        nan = torch.isnan(want)
        if not torch.equal(nan, torch.isnan(got)):
            return f"{name}: NaN positions differ"
        want, got = want[~nan], got[~nan]
    differ = (_bits(want) != _bits(got)).nonzero()
    if len(differ):
        first = tuple(differ[0].tolist())
        return f"{name}: {len(differ)} elements differ, first at {first}: {want[first].item()!r} vs {got[first].item()!r}"
    return None


def fp8_impl(impl: str):
    """``(quantize, dequantize)`` of ``impl`` with the reference's signatures (seed included) and results.

    ``"triton"``: the Triton ops; ``"fused"``: the decomposed form (its uint8 codes
    viewed as the fp8 dtype).
    """
    if impl == "triton":
        from savedhooks.kernels.fp8_triton import triton_fp8_dequantize, triton_fp8_quantize

        return triton_fp8_quantize, triton_fp8_dequantize
    from savedhooks.kernels.fp8_fused import fused_fp8_dequantize, fused_fp8_quantize

    def quantize(x, dtype, granularity, block_size, pow2, seed=None):
        codes, scale = fused_fp8_quantize(x, dtype, granularity, block_size, pow2, seed)
        return codes.view(dtype), scale

    def dequantize(q, scale, out_dtype, block_size):
        return fused_fp8_dequantize(q.view(torch.uint8), scale, q.dtype, out_dtype, block_size)

    return quantize, dequantize


def compare_fp8(
    x: torch.Tensor,
    dtype: torch.dtype,
    granularity: str,
    block_size: int,
    pow2: bool,
    impl: str = "triton",
    seed: int | None = None,
) -> str | None:
    """Quantize with the reference and ``impl`` (see :func:`fp8_impl`), compare q and scale bits;
    dequantize the same payload with both. ``seed``: stochastic rounding with that seed."""
    from savedhooks.kernels.fp8 import torch_fp8_dequantize, torch_fp8_quantize

    quantize, dequantize = fp8_impl(impl)
    s = None if seed is None else torch.tensor(seed, dtype=torch.int64, device=x.device)
    want_q, want_s = torch_fp8_quantize(x, dtype, granularity, block_size, pow2, s)
    got_q, got_s = quantize(x, dtype, granularity, block_size, pow2, s)
    label = f"{x.dtype} {tuple(x.shape)} {dtype} {granularity} {block_size} pow2={pow2} seed={seed}"
    problem = _same_bits(f"{label} q", want_q, got_q) or _same_bits(f"{label} scale", want_s, got_s)
    if problem:
        return problem
    want = torch_fp8_dequantize(want_q, want_s, x.dtype, block_size)
    return _same_bits(f"{label} dequantized", want, dequantize(want_q, want_s, x.dtype, block_size), False)


def _all(checks: Iterator[str | None]) -> str | None:
    problems = [p for p in checks if p]
    return "; ".join(problems[:3]) + (f" (+{len(problems) - 3} more)" if len(problems) > 3 else "") if problems else None


def sweep_case(
    shape: tuple[int, int], in_dtype: torch.dtype, device: str = "cpu", impl: str = "triton", seed: int | None = None
) -> str | None:
    gen = torch.Generator().manual_seed(shape[0] * 10007 + shape[1])
    x = torch.randn(shape, generator=gen) * torch.exp(2 * torch.randn(shape[0], 1, generator=gen))  # rows 1e-3..1e3
    x = x.to(device, in_dtype)
    blocks = (128, 16, 100, 7) if shape == (3, 300) else (128 if shape[1] >= 128 else 16,)
    return _all(
        compare_fp8(x, dtype, g, b, pow2, impl, seed)
        for dtype, g, b, pow2 in itertools.product((E4M3, E5M2), GRANULARITIES, blocks, (False, True))
        if g == "block" or b == blocks[0]
    )


def fp8_grid(dtype: torch.dtype) -> torch.Tensor:
    """Every finite non-negative fp8 value, the midpoints between neighbours (ties) and their fp32 neighbours."""
    values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    values = values[torch.isfinite(values) & (values >= 0)].unique()
    mid = (values[1:] + values[:-1]) / 2
    return torch.cat([values, mid, mid.nextafter(torch.tensor(0.0)), mid.nextafter(torch.tensor(1e9))])


def edge_inputs() -> Iterator[tuple[str, torch.Tensor, tuple[int, ...]]]:
    """(name, 2-D fp32 input, block sizes to try)."""
    for dtype in (E4M3, E5M2):
        fmax = torch.finfo(dtype).max
        grid = fp8_grid(dtype)
        # With the group's amax at fmax the scale is exactly 1 and every grid value is cast as is:
        # ties round to even, 124.17 / 125 round up to 128, subnormals stay subnormal.
        row = torch.cat([torch.tensor([fmax, 124.17, 125.0, 31.9, -124.17, -31.9]), grid, -grid])
        yield f"{dtype} grid at scale 1", row.view(1, -1), (row.numel(),)
        yield f"{dtype} grid scaled", (row * 3.7).view(1, -1), (row.numel(), 64)
    yield "binade boundaries", torch.tensor([[124.17, 125.0, 31.9, 448.0], [0.9999, 1.0625, 1.1875, 448.0]]), (4, 2)
    yield "fp32 subnormals", torch.tensor([[1e-40, -3e-42, 1e-45, 0.0], [1e-40, 1.0, -1e-45, 2.0**-126]]), (4, 2)
    yield "zeros and signed zeros", torch.tensor([[0.0, -0.0, 0.0, 0.0], [-0.0, -0.0, 5.0, -0.0]]), (4, 2)
    f32max = torch.finfo(torch.float32).max
    yield "max values", torch.tensor([[f32max, -f32max, 1.0, 65504.0], [3.3895e38, 65504.0, -65504.0, 1e-3]]), (4, 2)
    nan, inf = float("nan"), float("inf")
    yield "non-finite", torch.tensor([[nan, -nan, inf, -inf, 1.0, -2.0, 3e-3, 0.0],
                                      [nan, nan, nan, nan, inf, inf, -inf, -inf]]), (8, 4, 2)  # fmt: skip


def edge_case(
    x: torch.Tensor,
    blocks: tuple[int, ...],
    in_dtype: torch.dtype,
    device: str = "cpu",
    impl: str = "triton",
    seed: int | None = None,
) -> str | None:
    x = x.to(device, in_dtype)
    return _all(
        compare_fp8(x, dtype, g, b, pow2, impl, seed)
        for dtype, g, b, pow2 in itertools.product((E4M3, E5M2), GRANULARITIES, blocks, (False, True))
        if g == "block" or b == blocks[0]
    )


def non_contiguous_case(kind: str, device: str = "cpu", impl: str = "triton", seed: int | None = None) -> str | None:
    gen = torch.Generator().manual_seed(0)
    base = (torch.randn(40, 66, generator=gen) * torch.exp(torch.randn(40, 1, generator=gen))).to(device)
    x = {"transposed": base.t(), "column slice": base[:, ::3], "offset window": base[3:, 5:]}[kind]
    assert not x.is_contiguous()
    return _all(
        compare_fp8(x, dtype, g, 16, pow2, impl, seed) for dtype, g, pow2 in itertools.product((E4M3, E5M2), GRANULARITIES, (False, True))
    )


def bitmask_case(n: int, step: int, device: str = "cpu") -> str | None:
    from savedhooks.kernels.bitmask import torch_bitmask_pack, torch_bitmask_unpack
    from savedhooks.kernels.bitmask_triton import triton_bitmask_pack, triton_bitmask_unpack

    x = (torch.rand(n * step, generator=torch.Generator().manual_seed(n)) > 0.4).to(device)[::step]
    want = torch_bitmask_pack(x.contiguous())
    rows = x.contiguous()[: n - n % 3].view(3, -1)  # a contiguous 2-D mask: its bits in memory order
    return (
        _same_bits("pack", want, triton_bitmask_pack(x))
        or _same_bits("unpack", torch_bitmask_unpack(want, n), triton_bitmask_unpack(want, n))
        or _same_bits("round trip", x.contiguous(), triton_bitmask_unpack(triton_bitmask_pack(x), n))
        or _same_bits("2-D pack", torch_bitmask_pack(rows.reshape(-1)), triton_bitmask_pack(rows))
        or _same_bits("2-D reference", torch_bitmask_pack(rows.reshape(-1)), torch_bitmask_pack(rows))
    )


def codec_case(codec_name: str, x: torch.Tensor) -> str | None:
    """Codec payloads from backend='triton' and 'aten' are the same bytes; unpacks agree."""
    import torch.utils._pytree as pytree

    import savedhooks as sh
    from savedhooks.codecs.bits import SignBits

    make = {"fp8 block": lambda b: sh.codecs.Float8(backend=b), "fp8 e5m2 row pow2": lambda b: sh.codecs.Float8(E5M2, "row", 128, True, b),
            "fp8 tensor": lambda b: sh.codecs.Float8(granularity="tensor", backend=b), "bitmask": lambda b: sh.codecs.Bitmask(b),
            "sign bits": lambda b: SignBits(b)}[codec_name]  # fmt: skip
    packed = {b: make(b).encode(x) for b in ("aten", "triton")}
    leaves = {b: pytree.tree_leaves(p) for b, p in packed.items()}
    for i, (w, g) in enumerate(zip(leaves["aten"], leaves["triton"])):
        if isinstance(w, torch.Tensor):
            problem = _same_bits(f"payload leaf {i}", w, g)
        else:
            problem = None if w == g else f"payload leaf {i}: {w!r} vs {g!r}"
        if problem:
            return problem
    want, got = (make(b).decode(packed[b]) for b in ("aten", "triton"))
    if want.stride() != got.stride():
        return f"strides {want.stride()} vs {got.stride()}"
    return _same_bits("unpacked", want, got, False)


def codec_inputs() -> Iterator[tuple[str, Callable[[str], torch.Tensor]]]:
    """(name, device -> input): layouts the codecs restore (``.to(device)`` would not keep them all)."""
    gen = torch.Generator().manual_seed(0)
    base, wide, small = torch.randn(2, 3, 8, 10, generator=gen), torch.randn(24, 40, generator=gen), torch.randn(2, 1, 5, 40, generator=gen)
    yield "4-D", lambda d: base.to(d)
    yield "channels_last", lambda d: base.to(d).to(memory_format=torch.channels_last)
    yield "transposed", lambda d: wide.to(d).t()
    yield "broadcast", lambda d: small.to(d).expand(2, 3, 5, 40)
    yield "bf16 3-D", lambda d: torch.randn(3, 7, 50, generator=gen).to(d, torch.bfloat16)
    yield "bool 3-D", lambda d: (torch.rand(3, 7, 50, generator=gen) > 0.5).to(d)


# Seeds of the stochastic-rounding cases: high 32 bits zero, set, and a negative int64.
SEEDS = (12345, (0x1E3779B9 << 32) + 7, -0x61C8864680B583EB)


def _with_dtypes(items: list, every_dtype: bool) -> list[tuple]:
    """(item, input dtype) pairs: every dtype for each item, or the dtypes taken in turn."""
    if every_dtype:
        return list(itertools.product(items, FLOATS))
    return list(zip(items, itertools.cycle(FLOATS)))


def fp8_cases(
    device: str = "cpu", impl: str = "triton", stochastic: bool = False, every_dtype: bool = True
) -> dict[str, Callable[[], str | None]]:
    """fp8 case name -> check of ``impl`` (see :func:`fp8_impl`) against the reference.

    ``stochastic``: the same cases with stochastic rounding, named ``"stochastic ..."``,
    the seed cycling through :data:`SEEDS`. ``every_dtype=False``: each shape and edge
    input with one input dtype (they take turns), a third of the cases.
    """
    cases: dict[str, Callable[[], str | None]] = {}
    prefix = "stochastic " if stochastic else ""
    seeds = itertools.cycle(SEEDS if stochastic else (None,))
    for shape, dt in _with_dtypes(SHAPES, every_dtype):
        seed = next(seeds)
        cases[f"{prefix}sweep {shape} {dt}"] = lambda s=shape, d=dt, k=seed: sweep_case(s, d, device, impl, k)
    for (name, x, blocks), dt in _with_dtypes(list(edge_inputs()), every_dtype):
        seed = next(seeds)
        cases[f"{prefix}edge {name} {dt}"] = lambda x=x, b=blocks, d=dt, k=seed: edge_case(x, b, d, device, impl, k)
    for kind in ("transposed", "column slice", "offset window"):
        seed = next(seeds)
        cases[f"{prefix}non-contiguous {kind}"] = lambda k=kind, s=seed: non_contiguous_case(k, device, impl, s)
    return cases


def inductor_cases() -> dict[str, tuple]:
    """Cases for compiled forms of the fp8 codec, chosen for the code paths, one compile each.

    Vectorized body and scalar tail, ties and subnormals, non-finite values, a short
    last block, each granularity, stochastic rounding. Name -> (input, input dtype,
    fp8 dtype, granularity, block size, pow2, seed).
    """
    edges = {name: x for name, x, _ in edge_inputs()}
    sweep = torch.randn(17, 33, generator=torch.Generator().manual_seed(0)) * torch.exp(
        2 * torch.randn(17, 1, generator=torch.Generator().manual_seed(1))
    )
    return {
        "e4m3 grid at scale 1, row": (edges[f"{E4M3} grid at scale 1"], torch.float32, E4M3, "row", 128, False, None),
        "e5m2 grid scaled, fp16, block 64 with a short last block, pow2": (
            edges[f"{E5M2} grid scaled"], torch.float16, E5M2, "block", 64, True, None),
        "non-finite, block 3 (short last block), pow2": (edges["non-finite"], torch.float32, E4M3, "block", 3, True, None),
        "non-finite, bf16, tensor": (edges["non-finite"], torch.bfloat16, E5M2, "tensor", 128, False, None),
        "sweep (17, 33), bf16, tensor": (sweep, torch.bfloat16, E4M3, "tensor", 128, False, None),
        # stochastic rounding: fp8 subnormals, ties, a short last block, inf / NaN, a negative 64-bit seed
        "stochastic, e4m3 grid scaled, block 64 with a short last block": (
            edges[f"{E4M3} grid scaled"], torch.float32, E4M3, "block", 64, False, SEEDS[2]),
        "stochastic, non-finite, bf16, tensor": (edges["non-finite"], torch.bfloat16, E5M2, "tensor", 128, False, 7),
    }  # fmt: skip


def numerics_cases(device: str = "cpu") -> dict[str, Callable[[], str | None]]:
    """Case name -> check; ``device`` is where the tensors live (CUDA runs the compiled kernels)."""
    # stochastic rounding: on CPU (the interpreter, ~1 s a case) each input with one input dtype
    cases = {**fp8_cases(device), **fp8_cases(device, stochastic=True, every_dtype=device != "cpu")}
    for n, step in ((1, 1), (7, 1), (8, 1), (9, 3), (100, 1), (16385, 1), (40001, 2)):
        cases[f"bitmask {n} step {step}"] = lambda n=n, s=step: bitmask_case(n, s, device)
    codecs = ("fp8 block", "fp8 e5m2 row pow2", "fp8 tensor", "bitmask", "sign bits")
    for (input_name, make), codec in itertools.product(list(codec_inputs()), codecs):
        if input_name.startswith("bool") == (codec == "bitmask"):
            cases[f"codec {codec} {input_name}"] = lambda c=codec, m=make: codec_case(c, m(device))
    return cases


def compile_cases(device: str = "cpu") -> dict[str, Callable[[], str | None]]:
    """Case name -> check that a compiled training step gives the same gradients with both backends."""
    from models import GraphCapture, mlp, train_step_grads, transformer

    import savedhooks as sh

    def dropout_mlp() -> torch.nn.Module:  # saves a bool mask: the bitmask codec's kernels
        return torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Dropout(0.3), torch.nn.Linear(64, 4))

    def grads_match(make_model, shape, backend: str, codec: str) -> str | None:
        torch.manual_seed(0)
        model, x = make_model().to(device), torch.randn(*shape, device=device)
        grads = {}
        for kernels in ("aten", "triton"):
            torch._dynamo.reset()
            torch.manual_seed(1)  # same dropout masks
            capture = GraphCapture()
            fn = torch.compile(model, backend=capture.backend if backend == "capture" else backend)
            hooks = sh.fp8(backend=kernels) if codec == "fp8" else sh.bitmask(backend=kernels)
            grads[kernels] = train_step_grads(model, fn, x, hooks)
            fw = "\n".join(capture.fw)
            # CPU: the Triton op is one opaque node; CUDA: AOTAutograd traced into its kernels
            want = f"savedhooks.triton_{codec}_" if device == "cpu" else "triton_kernel_wrapper_functional"
            if backend == "capture" and kernels == "triton" and (want not in fw or f"savedhooks.{codec}_" in fw):
                return f"the forward graph should call {want}, not savedhooks.{codec}_*:\n{fw}"
        for i, (a, t) in enumerate(zip(grads["aten"], grads["triton"])):
            if not torch.equal(a, t):
                return f"gradient {i} differs: max |diff| {(a - t).abs().max().item()}"
        return None

    models = [("mlp", lambda: mlp(32), (16, 8), "fp8"), ("transformer", lambda: transformer(1, 32), (2, 8, 32), "fp8"),
              ("dropout mlp", dropout_mlp, (16, 8), "bitmask")]  # fmt: skip
    return {
        f"{name} {codec} {backend}": (lambda m=m, s=s, b=backend, c=codec: grads_match(m, s, b, c))
        for name, m, s, codec in models
        for backend in ("capture", "aot_eager", "inductor")
    }


def main() -> None:
    cases = numerics_cases() if sys.argv[1] == "numerics" else compile_cases()
    only = set(sys.argv[2:])
    results = {}
    for name, run in cases.items():
        if only and name not in only:
            continue
        try:
            results[name] = run()
        except Exception:  # noqa: BLE001 - reported as the case's failure
            results[name] = traceback.format_exc(limit=-4)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
