"""The policy's allowlist: lossy codecs only where every backward reader of a saved tensor tolerates them.

Five small models whose backward reads saved tensors with ops outside the list (a loss computed by a
recursion in log space, a sampling op, a cumulative product, a spectral op, a custom autograd.Function):
under eager and plain torch.compile, ``sh.policy()`` keeps their gradients at 25 dB or better and its
peak at most 1.02x of the step without hooks, where unguarded fp8 hurts them.
"""

from __future__ import annotations

import contextlib
import pathlib

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import savedhooks as sh
from benchmarks.unlisted_ops import MODELS, _ExpNormalize, build
from savedhooks.codecs.tolerance import FAMILIES, TOLERANT_OPS, Reader, eager_reader, tolerates, verdict
from savedhooks.fidelity import Census, keyed_run
from savedhooks.planner import Planned
from savedhooks.planner.census import plan_key
from tests.models import POLICY_DB


def _model(name: str) -> tuple[nn.Module, torch.Tensor]:
    return build(name)


def _census(codec, fn, x) -> list[tuple[int, ...]]:
    with keyed_run() as run, sh.saved_tensors_hooks(Census(codec).hooks()):
        fn(x)
    return sorted(tuple(t.shape) for t in run.census)


@pytest.mark.parametrize("name", list(MODELS))
def test_policy_keeps_gradients_and_peak_where_the_backward_reads_with_ops_off_the_list_eager(name):
    model, x = _model(name)
    result = sh.fidelity.check(model, x, sh.policy(), backend=None, device="cpu")
    assert result.ok and result.worst_db >= POLICY_DB, str(result)
    assert result.peak_ratio <= 1.02, str(result)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_policy_keeps_gradients_and_peak_where_the_backward_reads_with_ops_off_the_list_compiled(name):
    model, x = _model(name)
    try:
        torch._dynamo.reset()
        result = sh.fidelity.check(model, x, sh.policy(), backend="inductor", device="cpu")
    finally:
        torch._dynamo.reset()
    assert result.ok and result.worst_db >= POLICY_DB, str(result)
    assert result.peak_ratio <= 1.02, str(result)


@pytest.mark.parametrize("name", ["log-space recursion", "custom Function"])
def test_unguarded_fp8_hurts_the_models_the_policy_protects(name):
    model, x = _model(name)
    result = sh.fidelity.check(model, x, sh.fp8(), backend=None, device="cpu")
    assert not result.ok and result.worst_db < POLICY_DB - 10, str(result)
    assert "BAD GRADIENTS" in str(result) and result.worst in dict(model.named_parameters())


def test_the_policy_keeps_what_a_custom_function_and_a_log_space_recursion_save_and_packs_the_rest():
    model, x = _model("custom Function")
    assert _census(sh.codecs.Policy(), model, x) == []  # the custom Function's input and output
    model, x = _model("log-space recursion")
    assert _census(sh.codecs.Policy(), model, x) == []  # logsumexp's input and output; emissions: narrow softmax
    # an ordinary MLP with its loss is packed whole: every saver is on the list
    torch.manual_seed(0)
    mlp, x = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4)), torch.randn(64, 32)
    assert _census(sh.codecs.Policy(), lambda x: mlp(x).square().mean(), x) == [(64, 64)] * 4
    # without the loss, the last layer's saver is the region's last node: nothing shows it, so its input is kept
    assert _census(sh.codecs.Policy(), mlp, x) == [(64, 64)] * 3


def test_a_backward_inside_the_context_packs_what_is_still_held_as_the_context_s_exit_does():
    torch.manual_seed(0)
    mlp, x = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4)), torch.randn(64, 32)
    outside = _census(sh.codecs.Policy(), lambda x: mlp(x).square().mean(), x)
    with keyed_run() as run, sh.saved_tensors_hooks(Census(sh.codecs.Policy()).hooks()):
        mlp(x).square().mean().backward()  # every saved tensor is still held when the backward starts
    assert outside == sorted(tuple(t.shape) for t in run.census) == [(64, 64)] * 4


def test_ops_that_share_a_reader_s_sequence_number_without_a_gradient_do_not_hide_it():
    """Under compile, batch norm's ``num_batches_tracked += 1`` shares the convolution's ``seq_nr`` and the
    running statistics' copies back share the last op's: the convolution's and the linear's inputs are packed."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 8, 3, padding=1),
        nn.BatchNorm2d(8), nn.Flatten(), nn.Linear(8 * 64, 10),
    )  # fmt: skip
    x = torch.randn(32, 3, 8, 8)
    norms = ("native_batch_norm_legit_functional",)
    try:
        torch._dynamo.reset()
        packed = _census(sh.codecs.Policy(allow=norms), torch.compile(net, backend="aot_eager"), x)
        torch._dynamo.reset()
        plain = _census(sh.codecs.Policy(), torch.compile(net, backend="aot_eager"), x)
    finally:
        torch._dynamo.reset()
    # the first conv's output (batch norm's input, allowed), relu's (the second conv's input), the linear's input
    assert packed.count((32, 16, 8, 8)) == 2 and (32, 512) in packed, packed
    # without the allowance batch norm's input is kept: under aot_eager no codec centres it
    assert plain.count((32, 16, 8, 8)) == 1 and (32, 512) in plain, plain


def test_a_mean_subtracting_norm_s_input_is_kept_unless_centred_and_rms_norm_s_is_packed():
    from savedhooks.codecs.tolerance import Reader, _tolerated

    for op in ("native_layer_norm", "native_group_norm", "native_batch_norm_legit_functional"):
        assert not _tolerated(Reader(op, "input"), ()) and _tolerated(Reader(op, "input"), (), centred=True)
    assert _tolerated(Reader("rms_norm", "input"), ())
    for op in ("sigmoid", "tanh"):  # they save their output: saturation
        assert not _tolerated(Reader(op, "result"), ())
    sdpa = "scaled_dot_product_flash_attention_for_cpu"  # the value alone; an operand not told is kept
    assert [_tolerated(Reader(sdpa, "input", operand=o), ()) for o in ("value", "query", "key", "output", "")] == [
        True, False, False, False, False]
    assert _tolerated(Reader(sdpa, "input", operand="query"), (sdpa,))
    torch.manual_seed(0)
    shifted = torch.randn(64, 256, 128) + 20.0  # a mean large against the spread (a post-norm residual stream)
    ln = nn.LayerNorm(128)
    mlp = nn.Linear(128, 128)
    with sh.saved_tensors_hooks(sh.policy()):
        y = ln(mlp(shifted))
    ref = ln(mlp(shifted))
    grads = [torch.autograd.grad(out.square().sum(), ln.weight)[0] for out in (y, ref)]
    assert sh.metrics.sqnr(grads[1], grads[0]) > 60  # kept: only the reassociation of the sums


def test_allow_extends_the_list_by_op_name():
    model, x = _model("cumulative")
    kept = _census(sh.codecs.Policy(), model, x)
    allowed = _census(sh.codecs.Policy(allow=("cumprod",)), model, x)
    assert (16, 64, 64) not in kept and (16, 64, 64) in allowed, (kept, allowed)
    with pytest.raises(ValueError, match="allow"):
        sh.policy(allow="cumprod")


def test_eager_reader_names_autograd_nodes_and_refuses_custom_functions():
    a = torch.randn(4, 4, requires_grad=True)
    assert eager_reader((a @ a).grad_fn).op == "mm"
    assert eager_reader(F.layer_norm(a, (4,)).grad_fn).op == "native_layer_norm"
    assert eager_reader(a.pow(2).grad_fn).exponent == 2
    assert eager_reader(_ExpNormalize.apply(a).grad_fn) is None
    assert tolerates("mm", "input") and tolerates("exp", "result") and not tolerates("exp", "input")
    assert not tolerates("ctc_loss", "input") and tolerates("ctc_loss", "input", extra=("ctc_loss",))


def test_every_family_states_a_reason_and_ops_appear_once():
    seen = [op for f in FAMILIES for op in f.ops]
    assert len(seen) == len(set(seen)) == len(TOLERANT_OPS)
    assert all(f.reason and f.role in ("any", "input", "result", "centred") for f in FAMILIES)
    assert all(f.error in ("block", "relative") for f in FAMILIES)


def test_the_verdict_is_block_only_where_every_reader_is_linear_in_the_value():
    mm, gelu = Reader("mm", "input"), Reader("gelu", "input")
    relu, exp = Reader("relu", "result"), Reader("exp", "result")
    assert verdict([mm, gelu]) == "block"
    assert verdict([mm, relu]) == "relative"  # ReLU compares with 0: small values must keep their sign
    assert verdict([exp]) == "relative"  # exp's output spans decades
    assert verdict([mm, Reader("ctc_loss", "input")]) is None and verdict([]) is None and verdict(None) is None
    assert verdict([Reader("ctc_loss", "input")], extra=("ctc_loss",)) == "relative"  # allowed: each value's precision
    assert verdict([Reader("native_layer_norm", "input")], centred=True) == "relative"


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_the_policy_packs_factors_in_int8_blocks_and_a_mask_s_value_in_fp8(backend):
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = nn.Sequential(
        nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 64)
    )
    fn = model if backend is None else torch.compile(model, backend=backend)
    x = torch.randn(4, 64, 64)
    with keyed_run() as run, sh.saved_tensors_hooks(Census(sh.codecs.Policy()).hooks()):
        fn(x).sum().backward()
    chosen = {(t.shape[-1], type(t.packed_as).__name__) for t in run.census}
    # the hidden 256-wide values: GELU's input and the second Linear's input are read linearly (int8 blocks);
    # ReLU's output, which the last Linear also reads, is compared with 0 (fp8)
    assert (256, "Int8Blocks") in chosen and (256, "Float8") in chosen, chosen
    assert all(codec in ("Int8Blocks", "Float8") for _, codec in chosen), chosen


def _plan_keys(fn, x) -> tuple[str, ...]:
    """The plan keys of the floating tensors one forward of ``fn`` saves."""
    keys: list[str] = []

    @sh.hook
    def record(t):
        if t.is_floating_point():
            keys.append(plan_key(t))
        return t

    @record.unpack
    def record(t):
        return t

    with sh.saved_tensors_hooks(record):
        fn(x)
    return tuple(dict.fromkeys(keys))


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_a_plan_packs_lossy_only_what_the_policy_s_list_allows(backend):
    """A plan that names fp8 for every floating tensor still keeps what a custom Function, logsumexp or cumprod reads."""
    for name, allowed_ops in (
        ("custom Function", set()),
        ("log-space recursion", {"LogSoftmax", "_log_softmax"}),  # read by log-softmax's own backward only
        ("cumulative", {"Sigmoid", "Addmm", "addmm", "mm", "Mm", "view"}),
    ):
        model, x = _model(name)
        fn = model if backend is None else torch.compile(model, backend=backend)
        torch._dynamo.reset()
        planned = Planned(tuple((key, "fp8") for key in _plan_keys(fn, x)), fallback=None)
        torch._dynamo.reset()
        with keyed_run() as run, sh.saved_tensors_hooks(Census(planned).hooks()):
            fn(x)
        packed = {t.op for t in run.census}
        assert packed <= allowed_ops, (name, packed)
        assert not any(t.shape in ((16, 16, 16), (16, 64, 64)) for t in run.census), name  # logsumexp's, cumprod's


def test_tensors_held_until_their_savers_are_known_cost_no_memory_when_kept():
    """Eager: the policy holds each floating tensor until its savers are known; the cumulative model keeps them
    all (cumprod reads them), and its forward and backward peak exactly as without hooks."""
    model, x = _model("cumulative")
    state = {}

    def peaks(hooks):
        def forward():
            with sh.saved_tensors_hooks(hooks) if hooks is not None else contextlib.nullcontext():
                state["loss"] = model(x)

        def backward():
            state.pop("loss").backward()

        forward()
        backward()
        model.zero_grad(set_to_none=True)
        return sh.memory.measure_peaks(forward, backward, device="cpu")

    assert peaks(sh.policy()) == peaks(None)


def test_a_held_tensor_is_packed_once_all_its_savers_are_found_not_when_the_window_fills():
    """Eager: each GELU output is saved by the GELU and by the next matmul; once a later pack finds both, it is
    packed then, so a deep stack holds as few tensors as a shallow one at the end of its forward."""
    from savedhooks.hooks import eager as hooks_module

    def held_at_the_end(depth):
        torch.manual_seed(0)
        mlp = nn.Sequential(*(m for _ in range(depth) for m in (nn.Linear(64, 64), nn.GELU())), nn.Linear(64, 4))
        with sh.saved_tensors_hooks(sh.policy()):
            loss = mlp(torch.randn(64, 64)).square().mean()
            held = len(hooks_module._active.stack[-1].held)
        loss.backward()
        return held

    assert held_at_the_end(8) == held_at_the_end(2) < sh.codecs.Policy().eager_window


def test_the_docs_list_every_family_with_its_reason():
    page = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "fidelity.md").read_text()
    table = page[page.index("| family | ops (forward) |"):]
    for family in FAMILIES:
        assert f"\n| {family.name} |" in table, family.name
        row = table[table.index(f"\n| {family.name} |"):].split("\n")[1]
        assert f" | {family.error} | " in row, (family.name, family.error)


class _KeyBias(nn.Module):
    """Attention written out whose rows are spread evenly, with a learned per-key bias that is zero at
    initialization (transformers' Doge: a dynamic mask ``exp(A * softplus(dt))`` with ``A = 0``): the bias
    scale's gradient sums the probabilities' gradient over rows that sum to zero, and the values share a
    large common part, so the row sums of ``g * y`` in softmax's backward cancel."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.gate, self.out = nn.Linear(64, 192), nn.Linear(64, 1), nn.Linear(64, 64)
        self.scale = nn.Parameter(torch.zeros(1))
        with torch.no_grad():
            self.qkv.bias[128:] += 3.0  # the values' common part
            self.qkv.weight[:128] *= 0.1  # small logits: rows spread evenly

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        bias = self.scale * F.softplus(self.gate(x)).transpose(1, 2)  # (batch, 1, keys)
        probs = torch.softmax(q @ k.transpose(1, 2) / 8 + bias, dim=-1)
        return self.out(probs @ v)


def _traced() -> contextlib.ExitStack:
    """Compiles that trace the hooks (no graph from inductor's or AOTAutograd's cache): a census sees them."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
    stack.enter_context(torch._inductor.config.patch(fx_graph_cache=False))
    return stack


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_the_policy_packs_softmax_probabilities_in_int8_rows_where_fp8_s_error_cancels_into_a_gradient(backend):
    torch.manual_seed(0)
    model, x = _KeyBias(), torch.randn(4, 64, 64)

    def gradients(codec=None):
        torch._dynamo.reset()
        fn = model if backend == "eager" else torch.compile(model, backend=backend)
        model.zero_grad(set_to_none=True)
        with sh.saved_tensors_hooks(codec.hooks()) if codec is not None else contextlib.nullcontext():
            loss = fn(x).square().mean()
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    try:
        want = gradients()
        policy = sh.codecs.Policy()
        db, worst = sh.metrics.worst_sqnr(want, gradients(policy))
        assert db >= 30.0, (db, worst)
        if backend == "eager":  # eager mode packs what bmm saves, a view of the probabilities: int8 blocks
            return
        torch._dynamo.reset()
        with keyed_run() as run, sh.saved_tensors_hooks(Census(policy).hooks()), _traced():
            torch.compile(model, backend=backend)(x)
        probs = [t.packed_as for t in run.census if t.op in ("_softmax", "div")]  # div: inductor decomposes it
        assert probs and all(isinstance(c, sh.codecs.Int8Rows) for c in probs), run.census
        # the same probabilities in fp8 (no int8 codec): the bias scale's gradient is noise
        fp8 = sh.metrics.sqnr(want["scale"], gradients(sh.codecs.Policy(attention=None, blocks=None))["scale"])
        assert fp8 < 10.0, fp8
    finally:
        torch._dynamo.reset()
