"""Stochastic rounding of the fp8 codec: the hash, the rounding, unbiasedness, SQNR, reproducibility, the codec.

Bit-exactness of the three forms for the same seed is checked with the other fp8
cases: Triton vs the reference in tests/kernel_ops/test_kernels.py (``stochastic ...`` cases
of tests/interpret_kernels.py), the decomposed form in tests/kernel_ops/test_fused_codec.py.
"""

from __future__ import annotations

import math

import interpret_kernels as ik
import pytest
import torch
from models import GraphCapture, train_step_grads

import savedhooks as sh
from savedhooks.codecs.base import pack_saved, unpack_saved
from savedhooks.kernels.fp8 import torch_fp8_dequantize, torch_fp8_quantize
from savedhooks.kernels.fp8_fused import fp8_code, fused_fp8_quantize
from savedhooks.kernels.fp8_stochastic import random_bits, stochastic_round

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
M32 = 0xFFFFFFFF


def _mix32(x: int) -> int:
    """The documented finalizer on Python ints (the model the tensor versions must match)."""
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & M32
    x ^= x >> 15
    x = (x * 0x735A2D97) & M32
    return x ^ (x >> 15)


def _model_bits(index: int, seed: int) -> int:
    k0 = (((seed & M32) ^ 0x1B873593) * 0x61C88647) & M32
    k1 = (seed >> 32) & M32  # Python's >> floors, as the reference's division
    return _mix32((index & M32) ^ k0 ^ ((((index >> 32) ^ k1) * 0x61C88647) & M32))


def test_random_bits_are_the_documented_hash():
    indices = [0, 1, 2, 4095, 123456789, (1 << 32) - 1, 1 << 32, (5 << 32) + 17]
    for seed in (0, 12345, (0x1E3779B9 << 32) + 7, -0x61C8864680B583EB, -1):
        got = random_bits(torch.tensor(indices), torch.tensor(seed)).tolist()
        assert got == [_model_bits(i, seed) for i in indices], seed
        small = torch.tensor(indices[:6])  # below 2**32: the reference's shortcut, same bits
        assert random_bits(small, torch.tensor(seed), below_2_32=True).tolist() == got[:6]


def test_random_bits_look_uniform_and_differ_between_seeds():
    n = 1 << 16
    bits = random_bits(torch.arange(n), torch.tensor(42))
    assert bits.min() >= 0 and bits.max() <= M32 and bits.unique().numel() == n  # a bijection of 32-bit inputs
    ones = torch.stack([(bits >> b) & 1 for b in range(32)]).float().mean(dim=1)
    assert (ones - 0.5).abs().max() < 5 * 0.5 / math.sqrt(n)  # every bit fair within 5 standard errors
    u = (bits & 0xFFFFF).double() / 2**20 - 0.5  # what a normal fp8 value of e4m3 adds: neighbours uncorrelated
    assert (u[1:] * u[:-1]).mean().abs() < 5 / 12 / math.sqrt(n)
    other = random_bits(torch.arange(n), torch.tensor(43))
    assert (bits == other).float().mean() < 1e-3


def _neighbours(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lower grid point, an off-grid value between, upper grid point) for every pair of neighbours >= 0."""
    values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    grid = values[torch.isfinite(values) & (values >= 0)].unique()
    lo, hi = grid[:-1], grid[1:]
    return lo, lo + (hi - lo) * 0.3, hi


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_the_random_bits_pick_the_neighbour_and_grid_values_stay(dtype):
    """Bits 0 round toward zero, all-ones away from zero; grid values never move; nothing passes fmax."""
    lo, mid, hi = _neighbours(dtype)
    fmax = torch.finfo(dtype).max
    cases = {
        "grid": (torch.cat([lo, hi, -lo, -hi]), None, None),
        "down": (torch.cat([mid, -mid]), 0, torch.cat([lo, -lo])),
        "up": (torch.cat([mid, -mid]), M32, torch.cat([hi, -hi])),
        "past fmax": (torch.tensor([fmax, fmax * (1 + 2**-23), -fmax * (1 + 2**-20)]), M32,
                      torch.tensor([fmax, fmax, -fmax])),
    }  # fmt: skip
    for name, (y, fixed, want) in cases.items():
        bits = random_bits(torch.arange(y.numel()), torch.tensor(9)) if fixed is None else torch.full(y.shape, fixed)
        want = y if want is None else want
        got = stochastic_round(y, bits, dtype)
        assert torch.equal(got, want), (name, (got - want).abs().max())
        assert torch.equal(fp8_code(y, dtype, bits), want.to(dtype).view(torch.uint8).int()), name


def test_non_finite_values_are_kept_as_with_round_to_nearest():
    x = torch.tensor([[float("nan"), float("inf"), -float("inf"), 1.0, -3e-3, 0.0, -0.0, 2.0]])
    for dtype in (E4M3, E5M2):
        nearest, _ = torch_fp8_quantize(x, dtype, "row", 128, False)
        for seed in range(20):
            q, _ = torch_fp8_quantize(x, dtype, "row", 128, False, torch.tensor(seed))
            assert torch.equal(q.view(torch.uint8)[:, :3], nearest.view(torch.uint8)[:, :3])  # NaN, +-inf (e4m3: the NaN codes of their sign)
            assert torch.equal(q.view(torch.uint8)[:, 5:7], nearest.view(torch.uint8)[:, 5:7])  # signed zeros


def _off_grid_values(dtype: torch.dtype, n: int) -> torch.Tensor:
    """A row of fmax (so the scale is exactly 1) and n values log-uniform from the fp8 subnormals to near fmax,
    both signs, none on the grid."""
    gen = torch.Generator().manual_seed(0)
    mantissa_bits, bias = {E4M3: (3, 7), E5M2: (2, 15)}[dtype]
    smallest = 2.0 ** (1 - bias - mantissa_bits)
    fmax = torch.finfo(dtype).max
    logs = torch.rand(n, generator=gen) * (math.log2(fmax / 2) - math.log2(smallest / 4)) + math.log2(smallest / 4)
    values = torch.exp2(logs) * torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    on_grid = values.to(dtype).float() == values
    assert not on_grid.any()
    return torch.cat([torch.tensor([fmax]), values]).view(1, -1)


@pytest.mark.parametrize("dtype, draws", [(E4M3, 2000), (E5M2, 1000)])
def test_stochastic_rounding_is_unbiased(dtype, draws):
    """The mean over seeds converges to x (each element within 5 standard errors); round to nearest does not.

    Per element, a draw is the lower neighbour or the upper one, so its variance is
    ``(x - lo) * (hi - x)``; the standard error of the mean over n draws is
    ``sqrt(var / n)``. 148 (e4m3) / 64 (e5m2) of the 512 values lie in the fp8
    subnormal range. Measured: largest |z| 2.8 (e4m3) / 4.5 (e5m2); mean |bias| is
    0.026 / 0.047 of round to nearest's mean error, which is beyond 5 standard
    errors for 98% / 96% of the values.
    """
    x = _off_grid_values(dtype, 512)
    seeds = torch.randint(0, 1 << 32, (draws,), generator=torch.Generator().manual_seed(1))
    total = torch.zeros(x.shape, dtype=torch.float64)
    for seed in seeds:
        q, scale = torch_fp8_quantize(x, dtype, "row", 128, False, seed)
        total += torch_fp8_dequantize(q, scale, torch.float32, 128).double()
    assert scale.item() == 1.0
    mean = total / draws
    # the neighbours: rounded toward zero (random bits 0) and away from it (all ones)
    lo = stochastic_round(x, torch.zeros(x.shape, dtype=torch.int64), dtype).double()
    hi = stochastic_round(x, torch.full(x.shape, M32), dtype).double()
    xd = x.double()
    std_err = ((xd - lo).abs() * (hi - xd).abs() / draws).sqrt()
    error = (mean - xd).abs()
    within = error <= 5 * std_err + (hi - lo).abs() * 2**-23  # the subnormal path's 24-bit fraction
    assert within.all(), (
        f"{(~within).sum().item()} elements biased, worst z {(error / std_err)[~within].max().item():.1f}"
    )
    nearest = (torch_fp8_quantize(x, dtype, "row", 128, False)[0].float().double() - xd).abs()
    # the contrast: round to nearest's mean error is deterministic, far outside those bounds
    assert (nearest > 5 * std_err).float().mean() > 0.5
    assert nearest.mean() > 10 * error.mean()


@pytest.mark.slow
@pytest.mark.parametrize("dtype, floor", [(E4M3, 26.0), (E5M2, 20.0)])
def test_the_sqnr_it_costs_on_gaussian_data(dtype, floor):
    """Measured (256 x 384, seed 0): e4m3 block 31.8 -> 28.8 dB, e5m2 25.8 -> 22.8 dB, 3 dB as the variance doubles."""
    x = torch.randn(256, 384)
    nearest, stochastic = (sh.codecs.Float8(dtype, rounding=r) for r in ("nearest", "stochastic"))
    sqnr_nearest = sh.fidelity.sqnr(x, unpack_saved(nearest, pack_saved(nearest, x)))
    sqnr = sh.fidelity.sqnr(x, unpack_saved(stochastic, pack_saved(stochastic, x)))
    assert sqnr_nearest - 3.5 <= sqnr <= sqnr_nearest - 2.5 and sqnr >= floor  # can fail: not stochastic, or worse


def test_codec_is_reproducible_under_manual_seed_and_nearest_is_unchanged():
    x = torch.randn(64, 300)
    codec = sh.codecs.Float8(rounding="stochastic")
    payloads = []
    for seed in (3, 3, 4):
        torch.manual_seed(seed)
        payloads.append(pack_saved(codec, x)[1][0].view(torch.uint8))
    assert torch.equal(payloads[0], payloads[1]) and not torch.equal(payloads[0], payloads[2])
    second = pack_saved(codec, x)[1][0].view(torch.uint8)  # the generator moved on: another seed
    assert not torch.equal(second, payloads[2])
    # round to nearest draws nothing and is torch's own cast of x / scale
    state = torch.random.get_rng_state()
    q, scale, *_ = pack_saved(sh.codecs.Float8(granularity="row"), x)[1]
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(q.view(torch.uint8), (x / scale).to(E4M3).view(torch.uint8))
    assert sh.fp8() is sh.fp8(rounding="nearest")


def test_rounding_and_seed_are_validated():
    with pytest.raises(ValueError, match="rounding must be one of"):
        sh.codecs.Float8(rounding="floor")
    stochastic = sh.fp8(rounding="stochastic")
    assert stochastic is not sh.fp8() and "rounding='stochastic'" in stochastic.name
    for seed in (torch.tensor([1]), torch.tensor(1.0), torch.tensor(1, dtype=torch.int32)):
        with pytest.raises(ValueError, match="seed must be None or a 0-d int64 tensor"):
            torch_fp8_quantize(torch.randn(2, 4), E4M3, "row", 128, False, seed)
        with pytest.raises(ValueError, match="seed must be None"):
            fused_fp8_quantize(torch.randn(2, 4), E4M3, "row", 128, False, seed)


def test_chunking_changes_no_bits(monkeypatch):
    import savedhooks.kernels.fp8 as fp8_kernels

    x = torch.randn(300, 70) * torch.exp(torch.randn(300, 1))
    seed = torch.tensor(ik.SEEDS[2])
    for granularity in ("tensor", "row", "block"):
        whole = torch_fp8_quantize(x, E4M3, granularity, 32, False, seed)[0].view(torch.uint8)
        monkeypatch.setattr(fp8_kernels, "_CHUNK_ELEMS", 100)  # 1 row per chunk
        chunked = torch_fp8_quantize(x, E4M3, granularity, 32, False, seed)[0].view(torch.uint8)
        monkeypatch.undo()
        assert torch.equal(whole, chunked)


# --- the codec in training steps ----------------------------------------------------------------


def _gelu_mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))


def _check_gradients(plain, grads, again, nearest) -> None:
    for i, (p, g) in enumerate(zip(plain, grads)):
        assert torch.isfinite(g).all(), i
        assert sh.fidelity.sqnr(p, g) >= 25.0, (i, sh.fidelity.sqnr(p, g))  # measured 32-40 dB (nearest: 34-41 dB)
    assert all(torch.equal(a, b) for a, b in zip(grads, again))  # same torch.manual_seed, same gradients
    assert any(not torch.equal(a, b) for a, b in zip(grads, nearest))  # stochastic rounding did round differently


def _steps(model, fn, x, rounding: str) -> list[list[torch.Tensor]]:
    grads = []
    for _ in range(2):
        torch.manual_seed(1)
        grads.append(train_step_grads(model, fn, x, sh.fp8(rounding=rounding)))
    return grads


def test_eager_training_step_with_stochastic_rounding():
    """Eager: the GELU input (an addmm output, not a leaf) is packed with a seed from torch's generator."""
    torch.manual_seed(0)
    model, x = _gelu_mlp(), torch.randn(32, 16)
    plain = train_step_grads(model, model, x)
    state = torch.random.get_rng_state()
    grads, again = _steps(model, model, x, "stochastic")
    torch.manual_seed(1)
    assert not torch.equal(torch.random.get_rng_state(), state)
    _check_gradients(plain, grads, again, _steps(model, model, x, "nearest")[0])


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_training_step_with_stochastic_rounding(backend):
    """The seed draw is a graph op: the opaque op's seed argument under aot_eager, the fused form under inductor."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    model, x = _gelu_mlp(), torch.randn(32, 16)
    plain = train_step_grads(model, model, x)
    nearest = _steps(model, model, x, "nearest")[0]  # eager: the same bytes as compiled round to nearest
    if backend == "aot_eager":
        capture = GraphCapture()
        grads, again = _steps(model, torch.compile(model, backend=capture.backend), x, "stochastic")
        assert "aten.randint.low(0, 4294967296, []" in capture.fw[0]
        assert "torch.float8_e4m3fn, 'block', 128, False, randint)" in capture.fw[0]
    else:
        fn = torch.compile(model, backend="inductor")
        (grads, again), codes = run_and_get_code(lambda: _steps(model, fn, x, "stochastic"))
        assert "randint" in codes[0] and "uint8_t*" in codes[0] and "fp8_quantize" not in codes[0]
    _check_gradients(plain, grads, again, nearest)


# --- CUDA ------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_stochastic_codec_on_cuda_triton_and_aten_write_the_same_bytes():
    x = torch.randn(64, 1000, device="cuda") * torch.exp(torch.randn(64, 1, device="cuda"))
    payloads = {}
    for backend in ("aten", "triton"):
        torch.manual_seed(5)
        payloads[backend] = pack_saved(sh.codecs.Float8(backend=backend, rounding="stochastic"), x)[1][0].view(torch.uint8)
    assert torch.equal(payloads["aten"], payloads["triton"])


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_training_step_with_stochastic_rounding_on_cuda(backend):
    torch.manual_seed(0)
    model, x = _gelu_mlp().cuda(), torch.randn(32, 16, device="cuda")
    plain = train_step_grads(model, model, x)
    grads, again = _steps(model, torch.compile(model, backend=backend), x, "stochastic")
    _check_gradients(plain, grads, again, _steps(model, model, x, "nearest")[0])
