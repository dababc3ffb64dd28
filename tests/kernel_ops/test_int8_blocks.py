"""Int8Blocks: int8 codes with a float32 scale per block of values in memory order; SQNR bounds, layouts, bad input."""

from __future__ import annotations

import math

import pytest
import torch

import savedhooks as sh
from savedhooks.codecs.base import pack_saved, unpack_saved
from tests.kernel_ops.test_int8_rows import roundtrip


def block_bound_db(block_size: int) -> float:
    """The SQNR no block can go below: each value within amax / 254, the block holding at least amax**2."""
    return 20 * math.log10(254) - 10 * math.log10(block_size)


@pytest.mark.parametrize("shape", [(256, 384), (2, 4, 128, 64), (3, 5, 7, 11)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_blocks_sqnr_on_normal_data(shape, dtype):
    torch.manual_seed(0)
    x = torch.randn(*shape).to(dtype)
    y = roundtrip(sh.codecs.Int8Blocks(), x)
    assert y.dtype == dtype and y.shape == x.shape
    assert sh.fidelity.sqnr(x, y) >= 42.0
    assert sh.fidelity.sqnr(x, y) >= sh.fidelity.sqnr(x, roundtrip(sh.codecs.Float8(), x)) + 10.0


@pytest.mark.parametrize("block_size", [16, 64, 256])
def test_every_block_holds_the_bound_on_adversarial_data(block_size):
    # one spike per block and the rest just under half a step: the worst the levels can do
    torch.manual_seed(0)
    blocks = torch.full((64, block_size), 0.5 / 127 * 0.999) * torch.randn(64, block_size).sign()
    blocks[:, 0] = 1.0
    y = roundtrip(sh.codecs.Int8Blocks(block_size), blocks.flatten()).view(64, block_size)
    per_block = sh.fidelity.sqnr(blocks, y, dim=1)
    assert per_block.min() >= block_bound_db(block_size)
    assert per_block.max() <= block_bound_db(block_size) + 0.5  # within a spike of the bound: it is tight


def test_an_outlier_coarsens_its_own_block_only():
    torch.manual_seed(0)
    x = torch.randn(32, 512)
    x[:, 7] *= 1000.0  # a massive channel in the first block of every row
    y = roundtrip(sh.codecs.Int8Blocks(), x)
    rest = sh.fidelity.sqnr(x[:, 64:], y[:, 64:])
    assert rest >= 42.0  # the other blocks keep their own scale
    assert sh.fidelity.sqnr(x[:, :64], y[:, :64]) >= block_bound_db(64)


def test_small_values_under_half_a_step_become_zero():
    x = torch.zeros(64)
    x[0], x[1], x[2] = 1.0, 0.003, -0.004  # half a step is 1 / 254 = 0.0039
    y = roundtrip(sh.codecs.Int8Blocks(), x)
    assert y[1] == 0.0 and y[2] == -1.0 / 127 and y[0] == 1.0


def test_non_finite_values_come_back_nan_and_leave_their_block_accurate():
    torch.manual_seed(0)
    x = torch.randn(4, 128)
    x[0, 3], x[1, 5], x[2, 7] = math.nan, math.inf, -math.inf
    y = roundtrip(sh.codecs.Int8Blocks(), x)
    assert torch.isnan(y[0, 3]) and torch.isnan(y[1, 5]) and torch.isnan(y[2, 7])
    finite = torch.isfinite(x)
    assert sh.fidelity.sqnr(x[finite], y[finite]) >= 42.0


@pytest.mark.parametrize(
    "x",
    [
        torch.randn(64, 48).t(),
        torch.randn(2, 16, 8, 32).transpose(1, 2),
        torch.randn(4, 32, 6, 6).to(memory_format=torch.channels_last),
        torch.randn(3, 1, 64).expand(3, 5, 64),
        torch.randn(5, 3, 7),  # 105 values: a scale per row of 7
    ],
    ids=["transposed", "heads", "channels_last", "expanded", "not-a-multiple"],
)
def test_layouts_round_trip_with_their_strides(x):
    y = roundtrip(sh.codecs.Int8Blocks(), x)
    assert y.shape == x.shape and y.stride() == x.stride()
    assert sh.fidelity.sqnr(x, y) >= 40.0


def test_what_int8_blocks_accepts_and_their_bytes():
    codec = sh.codecs.Int8Blocks()
    assert codec.accepts(torch.randn(64)) and codec.accepts(torch.randn(4, 16, dtype=torch.bfloat16))
    assert not codec.accepts(torch.randn(63)) and not codec.accepts(torch.randn(64, dtype=torch.float64))
    assert not codec.accepts(torch.zeros(64, dtype=torch.int64))
    codes, scale = pack_saved(codec, torch.randn(16, 256))[1][:2]
    assert codes.dtype == torch.int8 and codes.numel() == 16 * 256 and scale.numel() == 16 * 256 // 64
    x = torch.randn(8)
    assert pack_saved(codec, x)[1] is x  # not accepted: stored as it is


@pytest.mark.parametrize("codec", [sh.codecs.Int8Blocks(), sh.codecs.Int8Rows()], ids=["blocks", "rows"])
def test_eager_packing_and_unpacking_hold_a_chunk_of_temporaries_not_the_tensor_s_size(codec):
    x = torch.randn(1 << 12, 1 << 10)  # 16 MiB; whole-tensor float32 temporaries would take several times that
    payload = []
    pack_peak = sh.memory.measure_peak(lambda: payload.append(pack_saved(codec, x)), device="cpu")
    assert pack_peak < 2**20 + x.numel(), pack_peak  # the 1-byte codes, their scales, a chunk's temporaries
    out = []
    unpack_peak = sh.memory.measure_peak(lambda: out.append(unpack_saved(codec, payload[0])), device="cpu")
    assert unpack_peak < 2**20 + x.numel() * 4, unpack_peak  # the float32 result and a chunk's temporaries
    assert torch.equal(out[0], roundtrip(codec, x))


@pytest.mark.parametrize("block_size", [0, 1, -4, 2.0, True, "64"])
def test_bad_block_size_is_refused(block_size):
    with pytest.raises(ValueError, match="Int8Blocks: block_size must be an int of at least 2"):
        sh.codecs.Int8Blocks(block_size=block_size)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_int8_blocks_under_compile_beat_fp8_on_a_mlp(backend):
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    x = torch.randn(8, 32, 64)

    def grads(hooks):
        mlp.zero_grad(set_to_none=True)
        with sh.saved_tensors_hooks(hooks) if hooks is not None else torch.enable_grad():
            out = torch.compile(mlp, backend=backend)(x)
        out.square().sum().backward()
        # the gradients formed from saved values (the last bias's is not)
        return [mlp[0].weight.grad.clone(), mlp[0].bias.grad.clone(), mlp[2].weight.grad.clone()]

    torch._dynamo.reset()
    exact = grads(None)
    blocks = grads(sh.codecs.Int8Blocks().hooks())
    fp8 = grads(sh.fp8())
    for e, b, f in zip(exact, blocks, fp8):
        assert sh.fidelity.sqnr(e, b) >= 38.0
        assert sh.fidelity.sqnr(e, b) > sh.fidelity.sqnr(e, f) + 6.0
