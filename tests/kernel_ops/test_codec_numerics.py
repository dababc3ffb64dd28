"""Codec round trips on tensors: SQNR thresholds, heavy tails, edge inputs, layouts."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import savedhooks as sh
from savedhooks.codecs.base import pack_saved, unpack_saved
from savedhooks.codecs.bits import SignBits
from savedhooks.kernels import fp8_inductor
from savedhooks.kernels.bitmask import torch_bitfield_pack, torch_bitfield_unpack
from savedhooks.kernels.fp8 import torch_fp8_dequantize, torch_fp8_quantize
from savedhooks.kernels.fp8_fused import fused_fp8_dequantize

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
GRANULARITIES = ("tensor", "row", "block")


@pytest.fixture(autouse=True)
def _aten_reference(monkeypatch):
    """The fp8 ops run their aten reference (the spec) at every size here: the numerics are its.

    With the compiled path on, large CPU tensors would run the decomposed form
    compiled by inductor, whose bytes ``tests/codec/test_inductor_codec.py`` checks equal
    to the reference's on the kernels' sweep; compiling a variant per dtype,
    granularity and input dtype here would add 38 compiles to the suite.
    """
    monkeypatch.setitem(fp8_inductor._state, "enabled", False)


def roundtrip(codec: sh.codecs.Codec, x: torch.Tensor) -> torch.Tensor:
    return unpack_saved(codec, pack_saved(codec, x))


# Thresholds sit ~3 dB under what the format gives on Gaussian data
# (e4m3 ~31.5 dB, e5m2 ~25.6 dB, bf16 ~52 dB, fp16 ~70 dB): a wrong scale or
# rounding mode loses far more than that.
@pytest.mark.parametrize(
    "dtype, granularity, in_dtype",
    list(itertools.product((E4M3, E5M2), GRANULARITIES, (torch.float32, torch.bfloat16, torch.float16))),
)
def test_fp8_sqnr_on_normal_data(dtype, granularity, in_dtype):
    x = torch.randn(256, 384).to(in_dtype)
    y = roundtrip(sh.codecs.Float8(dtype, granularity), x)
    assert y.dtype == in_dtype and y.shape == x.shape
    assert sh.fidelity.sqnr(x, y) >= (28.0 if dtype == E4M3 else 23.0)


@pytest.mark.parametrize("dtype, threshold", [(torch.bfloat16, 48.0), (torch.float16, 66.0)])
def test_downcast_sqnr(dtype, threshold):
    x = torch.randn(256, 384)
    y = roundtrip(sh.codecs.Downcast(dtype), x)
    assert y.dtype == torch.float32 and sh.fidelity.sqnr(x, y) >= threshold


def test_heavy_tailed_rows_block_and_row_keep_every_row():
    # Row magnitudes log-normal over ~10 decades: one scale per tensor flushes the small rows.
    x = torch.randn(512, 256) * torch.exp(3 * torch.randn(512, 1))
    per_row = {g: sh.fidelity.sqnr(x, roundtrip(sh.codecs.Float8(E4M3, g), x), dim=1) for g in GRANULARITIES}
    for g in ("row", "block"):
        assert per_row[g].mean() >= 28.0 and per_row[g].min() >= 25.0
    flushed = (roundtrip(sh.codecs.Float8(E4M3, "tensor"), x) == 0) & (x != 0)
    assert flushed.float().mean() > 0.1  # the contrast: per-tensor loses many rows entirely


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_pow2_scales_make_requantization_idempotent(dtype, granularity):
    codec = sh.codecs.Float8(dtype, granularity, pow2_scale=True)
    once = roundtrip(codec, torch.randn(64, 200) * 7)
    twice = roundtrip(codec, once)
    assert torch.equal(once, twice)
    _, scale = torch_fp8_quantize(torch.randn(64, 200), dtype, granularity, 128, True)
    mantissa, _ = torch.frexp(scale)
    assert torch.all(mantissa == 0.5)  # powers of two


def test_block_scales_shape_with_a_short_last_block():
    q, scale = torch_fp8_quantize(torch.randn(3, 300), E4M3, "block", 128, False)
    assert q.shape == (3, 300) and scale.shape == (3, 3)
    tail = torch.zeros(3, 300)
    tail[:, 256:] = 1000.0  # only the last (short) block is large
    _, scale = torch_fp8_quantize(tail, E4M3, "block", 128, False)
    assert torch.all(scale[:, :2] == 1.0) and torch.allclose(scale[:, 2], torch.tensor(1000.0 / 448))


def test_rows_wider_than_a_block_run_on_across_row_ends():
    # Llama's MLP rows are 688 wide (5 blocks and 48): with 16 rows, the tensor holds 86 whole blocks
    x = (torch.randn(16, 688) * torch.exp(torch.randn(16, 1))).requires_grad_().sin()  # made by an op
    payload = pack_saved(sh.codecs.Float8(), x)
    q, scale = payload[1][0], payload[1][1]
    assert q.shape == (86, 128) and scale.shape == (86, 1)  # no short block, one scale per 128 values
    assert sh.fidelity.sqnr(x.detach(), unpack_saved(sh.codecs.Float8(), payload)) >= 28.0
    # the compiled form decodes it with no join (a cat made inductor store the whole dequantized tensor)
    decode = make_fx(lambda q, s: fused_fp8_dequantize(q, s, E4M3, torch.float32, 128))(q.view(torch.uint8), scale)
    assert not [n for n in decode.graph.nodes if n.target is torch.ops.aten.cat.default]
    # a size that no block count divides keeps its short last block per row
    odd = torch.randn(15, 688).requires_grad_().sin()
    assert pack_saved(sh.codecs.Float8(), odd)[1][1].shape == (15, 6)


def test_chunked_reference_gives_identical_bits(monkeypatch):
    import savedhooks.kernels.fp8 as fp8_kernels

    x = torch.randn(300, 70) * torch.exp(torch.randn(300, 1))
    for granularity in GRANULARITIES:
        whole = torch_fp8_quantize(x, E4M3, granularity, 32, False)
        monkeypatch.setattr(fp8_kernels, "_CHUNK_ELEMS", 100)  # 1 row per chunk
        chunked = torch_fp8_quantize(x, E4M3, granularity, 32, False)
        monkeypatch.undo()
        assert torch.equal(whole[0].view(torch.uint8), chunked[0].view(torch.uint8))
        assert torch.equal(whole[1], chunked[1])
        assert torch.equal(torch_fp8_dequantize(*whole, torch.float32, 32), torch_fp8_dequantize(*chunked, torch.float32, 32))


# --- non-finite values and edge inputs ----------------------------------------------------


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_non_finite_values_stay_non_finite_and_neighbours_stay_accurate(granularity):
    x = torch.randn(8, 256)
    x[0, 3], x[1, 5], x[2, 7] = float("nan"), float("inf"), float("-inf")
    for dtype in (E4M3, E5M2):
        y = roundtrip(sh.codecs.Float8(dtype, granularity), x)
        # infinities come back exact (e4m3fn has none: its NaN codes carry them, never a silent +-448)
        assert y[1, 5] == math.inf and y[2, 7] == -math.inf
        if dtype == E5M2:
            assert torch.isnan(y[0, 3])
        else:  # a NaN takes the NaN code of its sign: back as +-inf, still not finite
            assert y[0, 3] == math.inf
        finite = torch.isfinite(x)
        assert torch.isfinite(y[finite]).all()
        assert sh.fidelity.sqnr(x[finite], y[finite]) >= (28.0 if dtype == E4M3 else 23.0)


def _edge_inputs():
    f32 = torch.float32
    base = torch.randn(4, 6, 10, 12)
    yield "empty", torch.empty(0, 5)
    yield "0-d", torch.tensor(3.25)
    yield "one element", torch.tensor([[-7.5]])
    yield "last dim 1", torch.randn(33, 1)
    yield "last dim not a multiple of the block", torch.randn(5, 130)
    yield "all zeros", torch.zeros(4, 256)
    yield "all equal", torch.full((4, 256), -2.5)
    yield "max finite", torch.tensor([[torch.finfo(f32).max, -torch.finfo(f32).max, 1.0]])
    yield "subnormals", torch.tensor([[1e-40, -3e-42, 1e-45, 0.0]])
    yield "transposed", torch.randn(64, 48).t()
    yield "non-contiguous slice", torch.randn(16, 64)[:, ::2]
    yield "channels_last", base.to(memory_format=torch.channels_last)
    yield "bf16 channels_last", base.to(torch.bfloat16, memory_format=torch.channels_last)


@pytest.mark.parametrize("case, x", list(_edge_inputs()), ids=[c for c, _ in _edge_inputs()])
@pytest.mark.parametrize("codec", [sh.codecs.Float8(E4M3, "block"), sh.codecs.Float8(E5M2, "row"), sh.codecs.Float8(E4M3, "tensor"), sh.codecs.Downcast(torch.bfloat16)], ids=repr)
def test_edge_inputs_round_trip(case, x, codec):
    y = roundtrip(codec, x)
    assert y.shape == x.shape and y.dtype == x.dtype
    if x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last) or x.t().is_contiguous():
        assert y.stride() == x.stride()  # the layout backward saw is restored
    if x.numel() == 0:
        return
    if case == "max finite":
        if isinstance(codec, sh.codecs.Downcast):  # beyond bf16's range: torch's cast overflows (documented)
            assert torch.equal(y[0, :2], torch.tensor([math.inf, -math.inf]))
        else:  # the extremes survive finite and exact to fp8 precision; 1.0 is below the group's range
            torch.testing.assert_close(y[0, :2], x[0, :2], rtol=2**-4, atol=0)
        return
    assert torch.isfinite(y).all()
    if case in ("all zeros", "subnormals"):
        assert torch.all((y == 0) == (x == 0)) or case == "subnormals"
        assert (y - x).abs().max() <= 1e-38  # nothing but tiny absolute error
        return
    worst = 0.0625 if isinstance(codec, sh.codecs.Float8) and codec.dtype == E4M3 else 0.125
    if isinstance(codec, sh.codecs.Downcast):
        worst = 2**-8
    # per element: relative error of the format, measured against the group's amax for tiny values
    scale = x.abs().amax().clamp_min(1e-30)
    assert ((y.float() - x.float()).abs() <= worst * x.float().abs() + worst * scale / 16).all()


def test_downcast_to_the_same_dtype_is_bit_exact_and_copies_nothing():
    x = torch.randn(8, 8, dtype=torch.bfloat16)
    packed = pack_saved(sh.codecs.Downcast(torch.bfloat16), x)
    assert packed[1][0] is x and torch.equal(unpack_saved(sh.codecs.Downcast(torch.bfloat16), packed), x)


@pytest.mark.parametrize("shape", [(0,), (), (1,), (7,), (8,), (9,), (3, 5, 17), (64, 130)])
def test_bitmask_is_bit_exact(shape):
    x = torch.rand(shape) > 0.5
    bits, *_ = pack_saved(sh.codecs.Bitmask(), x)[1] if x.numel() else (None,)
    y = roundtrip(sh.codecs.Bitmask(), x)
    assert y.dtype == torch.bool and torch.equal(y, x)
    if x.numel():
        assert bits.dtype == torch.uint8 and bits.numel() == (x.numel() + 7) // 8


def test_bitmask_keeps_layout_of_transposed_masks():
    x = (torch.randn(40, 24) > 0).t()
    y = roundtrip(sh.codecs.Bitmask(), x)
    assert torch.equal(y, x) and y.stride() == x.stride()


@pytest.mark.parametrize("bits", [1, 2, 4])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 1001])
def test_bit_fields_round_trip(bits, n):
    values = torch.randint(0, 2**bits, (n,), dtype=torch.uint8)
    packed = torch_bitfield_pack(values, bits)
    assert packed.numel() == math.ceil(n * bits / 8)
    assert torch.equal(torch_bitfield_unpack(packed, bits, n), values)
    assert torch.equal(torch_bitfield_unpack(packed, bits, n - 1), values[:-1])


def test_bit_fields_reject_bad_input():
    with pytest.raises(ValueError, match="1, 2, 4"):
        torch_bitfield_pack(torch.zeros(4, dtype=torch.uint8), 3)
    with pytest.raises(ValueError, match="1-D uint8"):
        torch_bitfield_pack(torch.zeros(4, dtype=torch.int8), 2)
    with pytest.raises(ValueError, match="cannot unpack 9 values"):
        torch_bitfield_unpack(torch.zeros(2, dtype=torch.uint8), 4, 9)


def test_sign_bits_decode_to_the_sign():
    x = torch.tensor([[-1.0, 0.0, 2.5, float("nan"), 1e-30]])
    y = SignBits().decode(SignBits().encode(x))
    assert torch.equal(y, torch.tensor([[0.0, 0.0, 1.0, 0.0, 1.0]]))


@pytest.mark.parametrize("x", [torch.arange(10), torch.rand(4) > 0.5, torch.randn(3, dtype=torch.float64)], ids=["int64", "bool", "float64"])
def test_fp8_stores_other_dtypes_as_they_are(x):
    packed = pack_saved(sh.codecs.Float8(), x)
    assert packed[0] == -1 and packed[1] is x


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: sh.fp8(dtype=torch.bfloat16), "dtype must be one of"),
        (lambda: sh.fp8(granularity="col"), "granularity must be one of"),
        (lambda: sh.fp8(block_size=0), "block_size must be a positive int"),
        (lambda: sh.fp8(pow2_scale="yes"), "pow2_scale must be a bool"),
        (lambda: sh.downcast(torch.int8), "floating torch.dtype"),
        (lambda: sh.policy(min_bytes=-1), "min_bytes"),
        (lambda: sh.offload(device="nowhere"), "device must name a torch device"),
    ],
)
def test_bad_configuration_raises(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_codec_arguments_must_be_codecs():
    @sh.hook
    def mine(x):
        return x

    @mine.unpack
    def mine(packed):
        return packed

    with pytest.raises(TypeError, match="must be a savedhooks codec"):
        sh.offload(mine)
    with pytest.raises(TypeError, match="must be a savedhooks codec"):
        sh.policy(floating="fp8")


def test_equal_configurations_give_the_same_pair():
    assert sh.fp8() is sh.fp8(torch.float8_e4m3fn, "block", 128, False)
    assert sh.fp8() is not sh.fp8(block_size=64)
    assert sh.offload(sh.fp8()) is sh.offload(sh.codecs.Float8())
    assert sh.policy() is sh.policy()


# --- payload size and temporaries -------------------------------------------------------------


def _payload_bytes(packed) -> int:
    import torch.utils._pytree as pytree

    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(packed) if isinstance(t, torch.Tensor))


def test_broadcast_tensors_are_packed_once():
    """Expanded K/V (grouped-query attention) hold 1/8 of their elements: so does the payload."""
    base = torch.randn(2, 1, 64, 128)
    x = base.expand(2, 8, 64, 128)
    packed = pack_saved(sh.codecs.Float8(), x)
    assert _payload_bytes(packed) == base.numel() * (1 + 4 / 128)
    y = unpack_saved(sh.codecs.Float8(), packed)
    assert y.shape == x.shape and y.stride() == x.stride()
    torch.testing.assert_close(y, roundtrip(sh.codecs.Float8(), base.clone()).expand_as(x), rtol=0, atol=0)


def test_narrow_inner_dims_cost_about_one_byte_per_element():
    x = torch.randn(8, 3, 32, 32).to(memory_format=torch.channels_last)  # innermost dim in memory: C = 3
    packed = pack_saved(sh.codecs.Float8(), x)
    assert _payload_bytes(packed) / x.numel() < 1.05
    y = unpack_saved(sh.codecs.Float8(), packed)
    assert y.stride() == x.stride() and sh.fidelity.sqnr(x, y) >= 28.0


@pytest.mark.parametrize(
    "dtype, width, scales_per_row",
    [(torch.float32, 8, 0), (torch.float32, 16, 1), (torch.bfloat16, 16, 0), (torch.float16, 16, 0),
     (torch.bfloat16, 32, 1)],
)  # fmt: skip
def test_rows_of_fewer_bytes_than_half_a_block_are_blocked_across_rows(dtype, width, scales_per_row):
    """A row's float32 scale costs at most 1/16 of its bytes: 16-bit rows of 16 values (32 bytes) share blocks.

    (The benchmark's cnn under bf16 autocast saves such 16-wide rows.)
    """
    x = (torch.randn(64, width) * torch.logspace(-2, 2, 64).unsqueeze(1)).to(dtype)  # rows of different scales
    packed = pack_saved(sh.codecs.Float8(), x)
    rows = x.numel() // width
    scales = scales_per_row * rows if scales_per_row else x.numel() // 128
    assert _payload_bytes(packed) == x.numel() + 4 * scales
    y = unpack_saved(sh.codecs.Float8(), packed)
    assert y.dtype == dtype and y.shape == x.shape
    # shared scales lose nothing above e4m3's subnormals here (a 10^4 range of rows fits its normal range)
    assert sh.fidelity.sqnr(x.float(), y.float()) >= 28.0


def test_columns_of_scalars_are_stored_as_they_are():
    """(B, T, 1) statistics: a scale per value would cost 5 bytes for 4."""
    for x in (torch.randn(64, 1), torch.randn(2, 16, 1), torch.tensor(1.5)):
        packed = pack_saved(sh.codecs.Float8(), x)
        assert packed[0] == -1 and packed[1] is x


def test_wide_rows_keep_the_reference_temporaries_small():
    from savedhooks.memory import cpu_memory_trace

    x = torch.randn(1 << 21)  # 8 MiB in one row
    outputs: list = []
    trace = cpu_memory_trace(lambda: outputs.append(pack_saved(sh.codecs.Float8(), x)))
    payload = _payload_bytes(outputs[0])
    # q + scales, plus float32 temporaries of a few chunks of 2**18 elements (1 MiB each)
    assert max(trace) <= payload + 4 * (1 << 20)
