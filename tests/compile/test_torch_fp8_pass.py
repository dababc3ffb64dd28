"""torch's own fp8 activation pass (the partitioner's ``activation_quantization_aten_pass``), as the benchmark runs it."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import savedhooks as sh
from benchmarks.torch_options import TORCH_FP8, torch_fp8_pass
from tests.models import torch_bug

MIN_SQNR_DB = 25.0  # the zoo's gradient floor; e4m3 with row scales clears it on this model


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64), torch.nn.GELU(),
                               torch.nn.Linear(64, 1))


def _grads(model: torch.nn.Module, options: dict[str, object] | None) -> dict[str, torch.Tensor]:
    """One training step's parameter gradients: eager (``options`` None), else aot_eager under the pass."""
    torch.compiler.reset()
    model.zero_grad(set_to_none=True)
    x = torch.randn(128, 64, generator=torch.Generator().manual_seed(1))
    if options is None:
        model(x).square().mean().backward()
    else:
        with torch_fp8_pass(options):
            torch.compile(model, backend="aot_eager")(x).square().mean().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _worst_sqnr_with_the_pass(options: dict[str, object]) -> float:
    model = _mlp()
    reference = _grads(model, None)
    counters.clear()
    got = _grads(model, options)
    ran = [counters["inductor"][f"activation_quantization_{g}_aten_pass"] for g in ("fwd", "bwd")]
    if ran != [1, 1]:  # not an AssertionError: the xfail below must not pass for this
        pytest.fail(f"the pass did not run once in each graph: {ran}")
    return sh.metrics.worst_sqnr(reference, got)[0]


def test_the_benchmarks_torch_fp8_options_give_faithful_gradients():
    assert _worst_sqnr_with_the_pass(TORCH_FP8) >= MIN_SQNR_DB


@torch_bug("fp8_pass_use_scaling", raises=AssertionError)
def test_torch_fp8_pass_with_use_scaling_unset_unscales_what_it_scaled():
    options = {k: v for k, v in TORCH_FP8.items() if k != "use_scaling"}
    assert _worst_sqnr_with_the_pass(options) >= MIN_SQNR_DB


def _masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention under an additive causal mask built in the graph (0 or -inf), as transformers' decoders pass it."""
    n = q.shape[-2]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    mask = torch.where(causal, 0.0, float("-inf"))  # saved for the backward: SDPA's backward reads its mask
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@torch_bug("fp8_pass_infinite_amax", raises=AssertionError)
def test_torch_fp8_pass_keeps_a_saved_additive_mask_finite():
    q, k, v = (torch.randn(1, 2, 16, 8, generator=torch.Generator().manual_seed(i), requires_grad=True)
               for i in range(3))
    torch.compiler.reset()
    counters.clear()
    with torch_fp8_pass(TORCH_FP8):
        torch.compile(_masked_attention, backend="aot_eager")(q, k, v).square().sum().backward()
    if counters["inductor"]["activation_quantization_fwd_aten_pass"] != 1:
        pytest.fail("the pass did not run")
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert torch.isfinite(t.grad).all(), f"{name}'s gradient is not finite"
