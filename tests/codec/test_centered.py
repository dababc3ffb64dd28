"""Centered: fp8 of a tensor's deviation from its per-channel mean (the policy's codec for batch norm inputs)."""

import pytest
import torch
from models import INDUCTOR_CNN_OPTIONS, POLICY_DB, worst_sqnr
from torch import nn

import savedhooks as sh
from savedhooks.codecs.centered import Centered


def _offset_channels(*shape: int) -> torch.Tensor:
    """Values whose channel (dim 1) means are large against their spread, as convolutions make before batch norm."""
    g = torch.Generator().manual_seed(0)
    means = 10 * torch.randn(1, shape[1], *[1] * (len(shape) - 2), generator=g)
    return torch.randn(*shape, generator=g) + means


def _deviation_db(x: torch.Tensor, y: torch.Tensor) -> float:
    mean = x.mean([d for d in range(x.dim()) if d != 1], keepdim=True)
    return sh.fidelity.sqnr(x - mean, y - mean)


def test_centered_keeps_the_deviation_from_the_channel_mean_that_plain_fp8_loses():
    x = _offset_channels(8, 16, 12, 12)
    plain, centered = sh.codecs.Float8(), Centered()
    # measured: plain 10.8 dB, centered 33.0 dB on the deviation that batch norm computes
    assert _deviation_db(x, plain.decode(plain.encode(x))) < 15
    assert _deviation_db(x, centered.decode(centered.encode(x))) > 30
    _, shift = centered.encode(x)
    assert shift.shape == (1, 16, 1, 1) and shift.dtype == torch.float32


def _channel_moments(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dims = [d for d in range(y.dim()) if d != 1]
    return y.double().mean(dims), y.double().var(dims, correction=0)


def test_centered_decodes_each_channels_mean_exactly():
    x = _offset_channels(8, 16, 12, 12)
    y = Centered().decode(Centered().encode(x))
    (mean_x, var_x), (mean_y, _) = _channel_moments(x), _channel_moments(y)
    # float32 rounding of values around 10; fp8 of the deviation alone moves the mean by far more (checked below)
    assert ((mean_y - mean_x).abs() / var_x.sqrt()).max() < 1e-5
    plain = sh.codecs.Float8()
    mean = x.mean([0, 2, 3], keepdim=True)
    inner = plain.decode(plain.encode(x - mean)) + mean
    assert ((_channel_moments(inner)[0] - mean_x).abs() / var_x.sqrt()).max() > 1e-4


def test_batch_norms_backward_from_centered_values_keeps_its_projection():
    """Batch norm's input gradient sums to zero over each channel; from rounded inputs it does not, and that sum
    reaches every gradient before the batch norm. From Centered's values it holds to float32 rounding."""
    x = _offset_channels(8, 16, 12, 12)
    grad_out = torch.randn_like(x)
    dims = [0, 2, 3]
    mean, invstd = x.mean(dims), x.var(dims, correction=0).add(1e-5).rsqrt()

    def channel_sums(saved: torch.Tensor) -> torch.Tensor:
        dx, _, _ = torch.ops.aten.native_batch_norm_backward(
            grad_out, saved, None, None, None, mean, invstd, True, 1e-5, [True, False, False]
        )
        return dx.double().sum(dims).abs().max() / dx.double().abs().sum(dims).max()

    centered, plain = Centered(), sh.codecs.Float8()
    rounded = plain.decode(plain.encode(x - mean[:, None, None])) + mean[:, None, None]  # centred, no shift
    # measured: exact inputs 5e-8, Centered's 4e-8, centred fp8 without the shift 8e-5
    assert channel_sums(x) < 1e-6
    assert channel_sums(centered.decode(centered.encode(x))) < 1e-6
    assert channel_sums(rounded) > 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_centered_gives_back_dtype_shape_and_strides(dtype):
    x = _offset_channels(4, 8, 6, 6).to(dtype).contiguous(memory_format=torch.channels_last)
    codec = Centered()
    y = codec.decode(codec.encode(x))
    assert (y.dtype, y.shape, y.stride()) == (x.dtype, x.shape, x.stride())
    assert _deviation_db(x.float(), y.float()) > 25


def test_a_channel_with_an_infinity_or_nan_is_not_centered_and_the_others_are():
    x = _offset_channels(8, 4, 8, 8)
    x[0, 1, 0, 0], x[0, 2, 3, 3] = float("inf"), float("nan")
    codec = Centered()
    y = codec.decode(codec.encode(x))
    # fp8 e4m3fn's rules: an infinity comes back, a NaN comes back as an infinity (never finite)
    assert y[0, 1, 0, 0] == float("inf") and not y[0, 2, 3, 3].isfinite()
    assert torch.isfinite(y).sum() == x.numel() - 2  # nothing else became non-finite
    clean = [0, 3]
    assert _deviation_db(x[:, clean], y[:, clean]) > 30  # the clean channels keep the centered accuracy
    finite = torch.isfinite(x[:, 1])
    assert sh.fidelity.sqnr(x[:, 1][finite], y[:, 1][finite]) > 25  # plain fp8 of the values there


def test_a_channel_whose_deviation_could_overflow_is_not_centered():
    x = torch.full((4, 2, 8), 60000.0, dtype=torch.float16)
    x[:, 1] = torch.randn(4, 8, dtype=torch.float16) + 100
    x[0, 0, 0] = -60000.0  # centered, -60000 - 52500 would overflow fp16
    codec = Centered()
    y = codec.decode(codec.encode(x))
    _, shift = codec.encode(x)
    assert shift[0, 0, 0] == 0 and shift[0, 1, 0] != 0
    assert torch.isfinite(y).all() and sh.fidelity.sqnr(x.float(), y.float()) > 25


def test_centered_accepts_floating_tensors_that_have_the_channel_dim():
    codec = Centered()
    assert codec.accepts(torch.randn(4, 3)) and not codec.accepts(torch.randn(4))
    assert not Centered(channel_dim=0).accepts(torch.randn(4))  # one dim: no channels to keep apart
    assert not codec.accepts(torch.randn(4, 1, 5).expand(4, 3, 5))  # broadcast: the subtraction would expand it
    assert not codec.accepts(torch.ones(4, 3, dtype=torch.int64)) and not codec.accepts(torch.randn(0, 3))
    assert Centered(channel_dim=2).accepts(torch.randn(2, 3, 4)) and not Centered(channel_dim=2).accepts(
        torch.randn(2, 3)
    )


@pytest.mark.parametrize(
    "kwargs, error",
    [({"channel_dim": -1}, ValueError), ({"channel_dim": True}, ValueError), ({"channel_dim": "1"}, ValueError),
     ({"inner": None}, ValueError), ({"inner": sh.policy()}, ValueError), ({"inner": object()}, TypeError)],
)  # fmt: skip
def test_centered_rejects_bad_configuration(kwargs, error):
    with pytest.raises(error):
        Centered(**kwargs)


@pytest.mark.parametrize("centered", [sh.codecs.Float8(), sh.policy(), sh.fp8()])
def test_policy_takes_only_a_centered_codec_as_centered(centered):
    with pytest.raises(TypeError, match="Centered"):
        sh.policy(centered=centered)


def test_centered_takes_an_inner_codec_as_hooks_or_codec():
    assert Centered(sh.downcast()).inner == sh.codecs.Downcast() and Centered(sh.codecs.Downcast()).inner == sh.codecs.Downcast()
    x = _offset_channels(2, 4, 8, 8)
    y = Centered(sh.codecs.Downcast()).decode(Centered(sh.codecs.Downcast()).encode(x))
    assert _deviation_db(x, y) > 45  # bf16 of the deviation


def _bn_net() -> nn.Module:
    """The benchmark's cnn in small: conv + batch norm + ReLU + max pool, 3 times (positive inputs after the first)."""
    torch.manual_seed(0)

    def block(c_in: int, c_out: int) -> list[nn.Module]:
        return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(), nn.MaxPool2d(2)]

    return nn.Sequential(*block(3, 16), *block(16, 32), *block(32, 32), nn.Flatten(), nn.Linear(32 * 4 * 4, 10))


def _grads(model, fn, x, hooks):
    model.zero_grad(set_to_none=True)
    with sh.saved_tensors_hooks(hooks) if hooks is not None else torch.enable_grad():
        fn(x).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.slow
def test_the_policy_centers_batch_norm_inputs_under_inductor_and_recovers_the_gradients(monkeypatch):
    """Inductor recomputes batch norm and ReLU from the saved conv output: plain fp8 there would cost the
    gradients, so without a centring codec the policy keeps it; with one it packs it centred."""
    model, x = _bn_net(), torch.randn(8, 3, 32, 32)
    compiled = torch.compile(model, backend="inductor", options=INDUCTOR_CNN_OPTIONS)
    reference = _grads(model, compiled, x, None)
    centered = []
    encode = Centered.encode
    monkeypatch.setattr(Centered, "encode", lambda self, t: centered.append(tuple(t.shape)) or encode(self, t))
    with torch._functorch.config.patch(enable_autograd_cache=False), torch._inductor.config.patch(fx_graph_cache=False):
        plain = worst_sqnr(_grads(model, compiled, x, sh.policy(centered=None)), reference)
        assert not centered
        torch._dynamo.reset()
        got = worst_sqnr(_grads(model, compiled, x, sh.policy()), reference)  # centered by default
    assert set(centered) == {(8, 16, 32, 32), (8, 32, 16, 16), (8, 32, 8, 8)}  # the convolutions' outputs only
    assert got >= POLICY_DB and plain >= POLICY_DB, (got, plain)
    torch._dynamo.reset()
    fp8 = worst_sqnr(_grads(model, compiled, x, sh.fp8()), reference)  # what the kept inputs are spared
    assert got > fp8 + 10, (got, fp8)


@pytest.mark.slow
def test_policy_does_not_center_without_the_decomposed_codec(monkeypatch):
    """Under aot_eager the subtraction would be a full-size temporary in the forward: plain fp8 there."""
    model, x = _bn_net(), torch.randn(4, 3, 32, 32)
    calls = []
    monkeypatch.setattr(Centered, "encode", lambda self, t: calls.append(t) or pytest.fail("centered under aot_eager"))
    _grads(model, torch.compile(model, backend="aot_eager"), x, sh.policy(centered=Centered()))
    assert not calls


def test_policy_centers_what_a_single_batch_norm_op_reads_with_the_decomposed_codec(monkeypatch):
    """aot_eager keeps batch norm as one op: its input (arg 0) is centered, not its outputs, stats or weights."""
    model, x = _bn_net(), torch.randn(4, 3, 32, 32)
    centered = []
    encode = Centered.encode
    monkeypatch.setattr(Centered, "encode", lambda self, t: centered.append(tuple(t.shape)) or encode(self, t))
    hooks = sh.policy(centered=Centered(sh.codecs.Float8(backend="fused")))  # "fused": decomposed even under aot_eager
    got = _grads(model, torch.compile(model, backend="aot_eager"), x, hooks)
    assert set(centered) == {(4, 16, 32, 32), (4, 32, 16, 16), (4, 32, 8, 8)}  # the convolutions' outputs only
    assert worst_sqnr(got, _grads(model, model, x, None)) >= POLICY_DB
