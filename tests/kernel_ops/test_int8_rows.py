"""Int8Rows: int8 codes with a float32 scale per row; SQNR thresholds, non-finite values, layouts, bad input."""

from __future__ import annotations

import math

import pytest
import torch

import savedhooks as sh
from savedhooks.codecs.base import pack_saved, unpack_saved
from savedhooks.codecs.int8 import torch_int8_row_dequantize, torch_int8_row_quantize


def roundtrip(codec: sh.codecs.Codec, x: torch.Tensor) -> torch.Tensor:
    return unpack_saved(codec, pack_saved(codec, x))


# Gaussian rows give ~43 dB (384 wide) and ~44.5 dB (64 wide, a head's vector); e4m3 blocks ~32 dB.
@pytest.mark.parametrize("shape", [(256, 384), (2, 4, 128, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_rows_sqnr_on_normal_data(shape, dtype):
    torch.manual_seed(0)
    x = torch.randn(*shape).to(dtype)
    y = roundtrip(sh.codecs.Int8Rows(), x)
    assert y.dtype == dtype and y.shape == x.shape
    assert sh.fidelity.sqnr(x, y) >= 40.0
    assert sh.fidelity.sqnr(x, y) >= sh.fidelity.sqnr(x, roundtrip(sh.codecs.Float8(), x)) + 8.0


def test_int8_rows_keep_every_row_of_heavy_tailed_magnitudes():
    # Row magnitudes log-normal over ~10 decades: each row has its own scale.
    torch.manual_seed(0)
    x = torch.randn(512, 256) * torch.exp(3 * torch.randn(512, 1))
    per_row = sh.fidelity.sqnr(x, roundtrip(sh.codecs.Int8Rows(), x), dim=1)
    assert per_row.mean() >= 40.0 and per_row.min() >= 36.0


def test_int8_row_codes_and_scales():
    x = torch.tensor([[1.0, -0.5, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0], [-254.0, 127.0, 3.0, 0.4]])
    codes, scale = torch_int8_row_quantize(x)
    assert codes.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (3, 1)
    assert codes.tolist() == [[127, -64, 32, 0], [0, 0, 0, 0], [-127, 64, 2, 0]]  # half to even: -63.5 -> -64, 1.5 -> 2
    assert torch.equal(scale.flatten(), torch.tensor([1.0 / 127, 0.0, 2.0]))  # float32
    y = torch_int8_row_dequantize(codes, scale, torch.float32)
    assert torch.equal(y[1], torch.zeros(4))  # a row of zeros comes back as zeros, not NaN
    assert (y - x).abs().le(scale / 2 + 1e-7).all()  # half a step at most


def test_non_finite_values_come_back_nan_and_leave_their_row_accurate():
    torch.manual_seed(0)
    x = torch.randn(4, 64)
    x[0, 3], x[1, 5], x[2, 7] = math.nan, math.inf, -math.inf
    y = roundtrip(sh.codecs.Int8Rows(), x)
    assert torch.isnan(y[0, 3]) and torch.isnan(y[1, 5]) and torch.isnan(y[2, 7])
    finite = torch.isfinite(x)
    assert torch.isfinite(y[finite]).all()
    assert sh.fidelity.sqnr(x[finite], y[finite]) >= 40.0


@pytest.mark.parametrize(
    "x",
    [
        torch.randn(64, 48).t(),
        torch.randn(2, 16, 8, 32).transpose(1, 2),  # attention's (B, H, T, D) view of (B, T, H, D)
        torch.randn(4, 32, 6, 6).to(memory_format=torch.channels_last),
        torch.randn(3, 1, 64).expand(3, 5, 64),  # grouped-query attention's expanded key
    ],
    ids=["transposed", "heads", "channels_last", "expanded"],
)
def test_layouts_round_trip_with_their_strides(x):
    y = roundtrip(sh.codecs.Int8Rows(), x)
    assert y.shape == x.shape and y.stride() == x.stride()
    assert sh.fidelity.sqnr(x, y) >= 40.0


def test_what_int8_rows_accepts():
    codec = sh.codecs.Int8Rows(min_row=16)
    assert codec.accepts(torch.randn(4, 16)) and codec.accepts(torch.randn(4, 16, dtype=torch.bfloat16))
    assert not codec.accepts(torch.randn(16, 8))  # rows of 8: a scale per 8 values
    assert codec.accepts(torch.randn(8, 16).t())  # rows are the innermost dim in memory: 16 here
    assert not codec.accepts(torch.randn(4, 16, dtype=torch.float64))
    assert not codec.accepts(torch.zeros(4, 16, dtype=torch.int64)) and not codec.accepts(torch.empty(0, 16))
    x = torch.randn(16, 8)
    assert pack_saved(codec, x)[1] is x  # not accepted: stored as it is


@pytest.mark.parametrize("min_row", [0, -1, 2.0, True, "16"])
def test_bad_min_row_is_refused(min_row):
    with pytest.raises(ValueError, match="Int8Rows: min_row must be a positive int"):
        sh.codecs.Int8Rows(min_row=min_row)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_int8_rows_through_compiled_attention(backend):
    """A saved tensor made by ops that record grad (fused attention's operands) round trips under compile."""
    torch.manual_seed(0)
    proj = torch.nn.Linear(64, 3 * 64)
    x = torch.randn(2, 32, 64)

    def attention(x):
        q, k, v = proj(x).view(2, 32, 3, 4, 16).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    def grads(hooks):
        proj.zero_grad(set_to_none=True)
        with sh.saved_tensors_hooks(hooks) if hooks is not None else torch.enable_grad():
            out = torch.compile(attention, backend=backend)(x)
        out.square().sum().backward()
        return [p.grad.clone() for p in proj.parameters()]

    torch._dynamo.reset()
    exact = grads(None)
    int8 = grads(sh.codecs.Int8Rows().hooks())
    fp8 = grads(sh.fp8())
    for e, i, f in zip(exact, int8, fp8):
        assert sh.fidelity.sqnr(e, i) >= 30.0
        assert sh.fidelity.sqnr(e, i) > sh.fidelity.sqnr(e, f)
