"""@savedhooks.hook in eager mode: identity, filtering, nesting, context, bad input."""

from __future__ import annotations

import dataclasses
import gc
import re
import weakref

import pytest
import torch
from models import bf16, cast_hook, mlp, train_step_grads
from torch._dynamo.exc import BackendCompilerFailed

import savedhooks as sh


def _counting_hook(calls: list[str], tag: str) -> sh.HookPair:
    @sh.hook(name=f"count_{tag}")
    def pack(x):
        calls.append(tag)
        return x

    @pack.unpack
    def pack(packed):
        return packed

    return pack


# --- identity -------------------------------------------------------------------------


def test_equal_configuration_returns_same_pair():
    a, b = cast_hook(torch.bfloat16), cast_hook(torch.bfloat16)
    assert a is b and a.pack is b.pack and a.unpack is b.unpack
    assert a.cache_hash is not None and len(a.cache_hash) == 64


def test_different_configuration_returns_different_pair():
    a, b = cast_hook(torch.bfloat16), cast_hook(torch.float16)
    assert a is not b and a.cache_hash != b.cache_hash


def test_unfingerprintable_capture_warns_and_gets_a_unique_pair():
    scale = torch.tensor(2.0)  # a tensor has no stable value to hash

    def build():
        with pytest.warns(UserWarning, match="process-local identity"):
            return sh.hook(lambda x: x * scale, unpack=lambda p: p / scale, name="scaled")

    a, b = build(), build()
    assert a is not b and a.cache_hash is None
    # no user_cache_hash: AOTAutograd bypasses its cache instead of risking a stale hit
    node = next(n for n in a.pack.graph.nodes if n.op == "call_function")
    assert node.meta["is_wrapped"] and "user_cache_hash" not in node.meta


def test_hook_pair_graph_modules_are_callable_and_carry_the_cache_hash():
    node = next(n for n in bf16.pack.graph.nodes if n.op == "call_function")
    assert node.meta["user_cache_hash"] == bf16.cache_hash
    x = torch.randn(3, 5, requires_grad=True) * 2  # an intermediate: leaves are not packed
    packed = bf16.pack(x)
    y = bf16.unpack(packed)
    assert y.dtype == torch.float32 and torch.equal(y, x.to(torch.bfloat16).float())
    leaf = torch.randn(3, 5)
    assert bf16.unpack(bf16.pack(leaf)) is leaf


# --- eager behaviour --------------------------------------------------------------------


def test_eager_packs_intermediates_only():
    calls: list[str] = []
    hooks = _counting_hook(calls, "a")
    calls.clear()  # the decoration-time probe ran pack once
    model = mlp()
    x = torch.randn(4, 8)
    with sh.saved_tensors_hooks(hooks):
        loss = model(x).sum()
    # Saved: x and W2.t(), W3.t() (a leaf and views of leaves: skipped, as the
    # compiled "donated" filter does) and the two relu outputs, each saved twice
    # (by relu and by the next addmm).
    assert len(calls) == 4
    loss.backward()


@dataclasses.dataclass(frozen=True)
class _StoreAsIs(sh.codecs.Codec):
    """Stores every saved tensor as it is (a policy's "keep" for everything)."""

    def choose(self, x: torch.Tensor) -> int:
        return -1


def test_eager_view_of_a_base_stored_as_is_unpacks_with_its_own_shape():
    # (x @ w).view(4, 16, 16) reads all of the (64, 16) matmul output: its pack shares
    # the base's payload. With the base stored as is, unpack must still return the
    # (4, 16, 16) view, not the (64, 16) base (DDP's output under the planner is such a view).
    x, w = torch.randn(64, 8), torch.randn(8, 16, requires_grad=True)

    def step() -> torch.Tensor:
        (x @ w).view(4, 16, 16).square().sum().backward()
        grad, w.grad = w.grad, None
        return grad

    expected = step()
    with sh.saved_tensors_hooks(_StoreAsIs().hooks()):
        got = step()
    assert torch.equal(got, expected)


def test_eager_gradients_change_under_bf16_and_match_manual_rounding():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(4, 8)
    got = train_step_grads(model, model, x, bf16)

    # Manual reference: the intermediates saved for backward (the relu output h,
    # and y, saved by square) are rounded to bf16 for backward only.
    w1, b1, w2, b2 = (p.detach() for p in model.parameters())
    h = torch.relu(x @ w1.t() + b1)
    y = h @ w2.t() + b2
    gy = 2 * y.to(torch.bfloat16).float()
    hb = h.to(torch.bfloat16).float()
    gw2 = gy.t() @ hb
    gh = (gy @ w2) * (hb > 0)
    gw1 = gh.t() @ x
    torch.testing.assert_close(got[2], gw2)
    torch.testing.assert_close(got[0], gw1)
    assert not torch.equal(gw2, gy.t() @ h)  # the rounding is visible


def test_nesting_innermost_wins_and_outer_is_restored():
    calls: list[str] = []
    outer, inner = _counting_hook(calls, "outer"), _counting_hook(calls, "inner")
    calls.clear()
    x = torch.randn(4, 8, requires_grad=True)
    with sh.saved_tensors_hooks(outer):
        a = (x * 2).sin()  # sin saves its (non-leaf) input
        with sh.saved_tensors_hooks(inner):
            b = (x * 3).cos()
        c = (x * 4).tanh()  # tanh saves its output
    assert calls == ["outer", "inner", "outer"]
    (a + b + c).sum().backward()
    calls.clear()
    (x * 5).exp()
    assert calls == []


def test_saved_tensors_hooks_is_reentrant_and_a_decorator():
    calls: list[str] = []
    hooks = sh.saved_tensors_hooks(_counting_hook(calls, "d"))
    calls.clear()

    @hooks
    def step(x):
        with hooks:
            return (x * 2).sin()

    step(torch.randn(3, requires_grad=True)).sum().backward()
    assert calls == ["d"]


def test_hook_context_is_none_in_eager_and_names_the_node_when_compiled():
    seen: list[object] = []

    @sh.hook
    def spy(x):
        ctx = sh.hook_context()
        seen.append(None if ctx is None else ctx.node.target)
        return x

    @spy.unpack
    def spy(packed):
        return packed

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    x = torch.randn(2, 8)
    seen.clear()  # the decoration-time probe ran spy once
    with sh.saved_tensors_hooks(spy):
        model(x).sum().backward()
    assert seen and set(seen) == {None}
    seen.clear()
    with sh.saved_tensors_hooks(spy):
        torch.compile(model, backend="aot_eager")(x).sum().backward()
    assert torch.ops.aten.relu.default in seen


def test_policy_by_producing_op_under_compile():
    """Per-tensor decisions from the hook context survive into the compiled graph."""

    @sh.hook
    def skip_relu(x):
        ctx = sh.hook_context()
        if ctx is not None and ctx.node.target == torch.ops.aten.relu.default:
            return x
        return x.to(torch.bfloat16) if x.is_floating_point() else x

    @skip_relu.unpack
    def skip_relu(packed):
        return packed.float() if packed.dtype == torch.bfloat16 else packed

    from models import GraphCapture

    capture = GraphCapture()
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 2)
    )
    with sh.saved_tensors_hooks(skip_relu):
        torch.compile(model, backend=capture.backend)(torch.randn(2, 8)).sum().backward()
    fw = capture.fw[0]
    # relu's output is saved as is (torch renames the node); gelu's input and output are cast
    assert "relu_hook_0 = torch.ops.aten.relu.default(addmm)" in fw
    assert "_to_copy.default(relu" not in fw
    assert "_to_copy.default(addmm_1, dtype = torch.bfloat16)" in fw


# --- bad input --------------------------------------------------------------------------


def test_non_callable_pack_raises_at_decoration():
    with pytest.raises(sh.HookTypeError, match="decorates a pack function, got int"):
        sh.hook(3)


def test_non_callable_unpack_raises_at_decoration():
    @sh.hook
    def half(x):
        return x.half()

    with pytest.raises(sh.HookTypeError, match="'half'.*must decorate a function, got str"):
        half.unpack("nope")


def test_missing_unpack_raises_when_used():
    @sh.hook
    def lonely(x):
        return x

    with pytest.raises(sh.HookTypeError, match="'lonely' has no unpack function: add one with @lonely.unpack"):
        sh.saved_tensors_hooks(lonely)


@pytest.mark.parametrize("bad", [None, "bf16", (lambda x: x, lambda x: x)])
def test_saved_tensors_hooks_rejects_non_pairs(bad):
    with pytest.raises(TypeError, match="expects a savedhooks.HookPair"):
        sh.saved_tensors_hooks(bad)


def test_unpack_returning_non_tensor_raises_at_decoration():
    @sh.hook
    def tupled(x):
        return x

    with pytest.raises(sh.HookTypeError, match=r"hook 'tupled' \(.*test_hooks.py:\d+\): unpack must return one torch.Tensor, got tuple"):

        @tupled.unpack
        def tupled(packed):
            return (packed,)


def test_pack_mutating_input_raises_at_decoration():
    @sh.hook
    def scale_in_place(x):
        return x.mul_(2)

    with pytest.raises(sh.HookMutationError, match="'scale_in_place'.*pack mutated the saved tensor"):

        @scale_in_place.unpack
        def scale_in_place(packed):
            return packed / 2


def test_unpack_mutating_payload_raises_at_decoration():
    @sh.hook
    def copy(x):
        return x.clone()

    with pytest.raises(sh.HookMutationError, match="'copy'.*unpack mutated the packed payload"):

        @copy.unpack
        def copy(packed):
            return packed.mul_(1)


def test_unpack_returning_wrong_dtype_raises_at_decoration():
    @sh.hook
    def lossy(x):
        return x.to(torch.bfloat16)

    with pytest.raises(sh.HookMismatchError, match="'lossy'.*unpack returned dtype torch.bfloat16, the saved tensor was torch.float32"):

        @lossy.unpack
        def lossy(packed):
            return packed  # forgot to cast back


def test_pack_returning_unsupported_value_raises():
    class Box:
        def __init__(self, t):
            self.t = t

    with pytest.raises(sh.HookTypeError, match="'boxed'.*pack returned a Box"):
        sh.hook(lambda x: Box(x), unpack=lambda b: b.t, name="boxed")


def _data_dependent_mutating_hook():
    # Mutates only tensors unlike the 4 x 8 probe: the contract is checked at first use.
    @sh.hook
    def sneaky(x):
        if x.shape != (4, 8):
            x.add_(0)
        return x.clone()

    @sneaky.unpack
    def sneaky(packed):
        return packed

    return sneaky


def test_mutation_the_probe_cannot_see_raises_in_eager():
    hooks = _data_dependent_mutating_hook()
    x = torch.randn(3, 5, requires_grad=True)
    with pytest.raises(sh.HookMutationError, match="'sneaky'.*pack mutated the saved tensor"):
        with sh.saved_tensors_hooks(hooks):
            (x * 2).sin()


def test_contract_errors_name_the_hook_under_compile():
    @sh.hook
    def drift(x):
        return x.clone()

    @drift.unpack
    def drift(packed):
        # Shape only breaks for saved tensors the meta probe (4 x 8) does not cover.
        return packed if packed.shape[-1] == 8 else packed[..., :1]

    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    # torch wraps backend errors; ours is the inner exception, of our type.
    with pytest.raises(BackendCompilerFailed) as failed:
        with sh.saved_tensors_hooks(drift):
            torch.compile(model, backend="aot_eager")(torch.randn(3, 4)).sum().backward()
    assert isinstance(failed.value.inner_exception, sh.HookMismatchError)
    assert re.search(r"'drift'.*unpack returned shape \(3, 1\), the saved tensor had \(3, 6\)", str(failed.value))


def _truncating_hook():
    @sh.hook
    def truncate(x):
        return x.clone()

    @truncate.unpack
    def truncate(packed):
        return packed if packed.shape == (4, 8) else packed[:1]  # wrong for anything but the probe

    return truncate


@pytest.mark.parametrize("dynamic", [False, True])
def test_wrong_unpack_shape_is_caught_with_dynamic_shapes(dynamic):
    """With symbolic sizes the check compares against the saved value's symbolic shape."""
    w = torch.randn(8, 16, requires_grad=True)
    compiled = torch.compile(lambda x: (x @ w).sin().sum(), backend="aot_eager", dynamic=dynamic)
    with pytest.raises(BackendCompilerFailed) as failed:
        with sh.saved_tensors_hooks(_truncating_hook()):
            compiled(torch.randn(6, 8)).backward()
    assert isinstance(failed.value.inner_exception, sh.HookMismatchError)


def test_dynamic_shapes_compile_once_and_match_eager():
    w = torch.randn(8, 16, requires_grad=True)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda x: (x @ w).sin().sum(), backend=counter, dynamic=True)
    for rows in (3, 5, 7):
        x = torch.randn(rows, 8)
        w.grad = None
        with sh.saved_tensors_hooks(bf16):
            compiled(x).backward()
        got = w.grad.clone()
        w.grad = None
        with sh.saved_tensors_hooks(bf16):
            (x @ w).sin().sum().backward()
        torch.testing.assert_close(got, w.grad)
    assert counter.frame_count == 1


def test_hooks_entered_inside_a_compiled_function():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(4, 8, requires_grad=True)  # a leaf that requires grad: never packed, in either mode

    def step(inp):
        with sh.saved_tensors_hooks(bf16):
            return model(inp).square().sum()

    want = train_step_grads(model, model, x, bf16)
    plain = train_step_grads(model, model, x)
    assert any(not torch.equal(p, w) for p, w in zip(plain, want))  # the hook does something
    model.zero_grad(set_to_none=True)
    torch.compile(step, backend="aot_eager")(x).backward()
    for p, w in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, w)


def test_hook_capturing_a_tensor_names_itself_when_compile_fails():
    scale = torch.tensor(2.0)
    with pytest.warns(UserWarning, match="process-local identity"):
        hooks = sh.hook(lambda x: x * scale, unpack=lambda p: p / scale, name="scaled")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    with pytest.raises(BackendCompilerFailed) as failed:
        with sh.saved_tensors_hooks(hooks):
            torch.compile(model, backend="aot_eager")(torch.randn(2, 4)).sum().backward()
    notes = getattr(failed.value.inner_exception, "__notes__", [])
    assert any("savedhooks hook 'scaled'" in note for note in notes), notes


def test_process_local_hooks_are_not_kept_alive():
    from savedhooks.hooks import eager as hooks_module

    scale = torch.tensor(2.0)
    registered = len(hooks_module._FUNCTIONS)
    with pytest.warns(UserWarning, match="process-local identity"):
        pair = sh.hook(lambda x: x * scale, unpack=lambda p: p / scale, name="scaled")  # noqa: F821 - scale is deleted below on purpose
    x = torch.randn(3, 5, requires_grad=True)
    with sh.saved_tensors_hooks(pair):
        (x * 1).sin().sum().backward()
    assert len(hooks_module._FUNCTIONS) == registered
    ref = weakref.ref(scale)
    del pair, scale
    gc.collect()
    assert ref() is None


def test_eager_packs_masks_made_in_the_forward():
    """Non-floating leaves made in the forward (native_dropout's bool mask) are packed, as under compile."""
    seen: list[torch.dtype] = []

    @sh.hook
    def spy(x):
        seen.append(x.dtype)
        return x.clone()

    @spy.unpack
    def spy(packed):
        return packed

    seen.clear()
    w = torch.randn(8, 16, requires_grad=True)
    with sh.saved_tensors_hooks(spy):
        out, mask = torch.native_dropout(torch.randn(4, 8) @ w, 0.5, True)  # what CUDA and compile use
        out.sum().backward()
    assert seen == [torch.bool]  # the mask; not the input, not w


def test_mutation_through_data_is_caught_at_decoration():
    @sh.hook
    def via_data(x):
        x.data.mul_(2)  # .data has its own version counter
        return x.clone()

    with pytest.raises(sh.HookMutationError, match="'via_data'.*pack mutated the saved tensor's values"):

        @via_data.unpack
        def via_data(packed):
            return packed


def test_late_global_gets_its_cache_hash_when_entered():
    namespace = {"torch": torch, "sh": sh}
    exec(
        "@sh.hook\n"
        "def late(x):\n"
        "    return x.to(LOW) if x.is_floating_point() else x\n"
        "@late.unpack\n"
        "def late(p):\n"
        "    return p.float() if p.dtype == LOW else p\n",
        namespace,
    )
    pair = namespace["late"]
    node = next(n for n in pair.pack.graph.nodes if n.op == "call_function")
    assert "user_cache_hash" not in node.meta  # LOW is unknown: no hash, no stale cache hit
    namespace["LOW"] = torch.bfloat16  # e.g. set in main() after parsing flags
    with sh.saved_tensors_hooks(pair):
        first = node.meta["user_cache_hash"]
    namespace["LOW"] = torch.float16
    with sh.saved_tensors_hooks(pair):
        assert node.meta["user_cache_hash"] != first


def test_compiled_hooks_see_saved_values_the_forward_also_returns_but_never_its_inputs():
    """A saved value the forward returns too (a decoder's key and value with a KV cache) reaches
    the hooks under compile, as in eager mode; graph inputs and views of them are stored as they are."""
    seen: list[tuple[object, tuple[int, ...]]] = []

    @sh.hook
    def spy(x):
        ctx = sh.hook_context()
        if ctx is not None:
            seen.append((ctx.node.target, tuple(x.shape)))
        return x.clone()

    @spy.unpack
    def spy(packed):
        return packed

    w1 = torch.randn(8, 16, requires_grad=True)
    w2 = torch.randn(16, 4, requires_grad=True)

    def forward(x):
        h = torch.relu(x.view(6, 8) @ w1)  # saved by the second matmul and by relu's backward
        return h @ w2, h  # h is also an output

    x = torch.randn(2, 3, 8, requires_grad=True)
    expected = [g.clone() for g in torch.autograd.grad(sum(t.square().sum() for t in forward(x)), (x, w1, w2))]
    seen.clear()
    with sh.saved_tensors_hooks(spy):
        out, h = torch.compile(forward, backend="aot_eager")(x)
    grads = torch.autograd.grad(out.square().sum() + h.square().sum(), (x, w1, w2))
    assert torch.ops.aten.relu.default in {target for target, _ in seen}
    assert all(target != "x" and shape != (6, 8) for target, shape in seen)  # x and its view: not packed
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want)
