"""A plan used at input shapes it was not made for: its choices hold per saved-tensor role, and its peak scales."""

import contextlib
import dataclasses
import operator
import warnings

import pytest
import torch
from models import planner_mlp, square_mean_loss

import savedhooks as sh
from savedhooks.planner.census import plan_key, ranked_name

GREW = "made for smaller input shapes"


@pytest.fixture(scope="module")
def planned():
    model, x = planner_mlp()
    planner = sh.planner.Planner(model, (x,), loss_fn=square_mean_loss, backend="inductor", blocks=())
    return model, x, planner.plan((planner.floor_bytes + planner.baseline_bytes) // 2)


def _step(model, x, hooks, dynamic=None):
    torch._dynamo.reset()
    compiled = torch.compile(model, dynamic=dynamic)
    with sh.saved_tensors_hooks(hooks):
        square_mean_loss(compiled(x)).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


@contextlib.contextmanager
def _uncached():
    """Inductor's and AOTAutograd's compile caches off: hooks run (and warn) only while a graph compiles, and a
    graph compiled with the same hooks at the same shapes before (an earlier run) would be read back instead."""
    with (
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        yield


_CHOSEN: dict[tuple[str, str, str], str] = {}  # (ranked node name or "eager", op, dtype) -> codec name


class _Recording(sh.planner.Planned):
    """The plan's codec, recording what it chooses per role into ``_CHOSEN``."""

    def choose(self, t):
        index = super().choose(t)
        context = sh.hooks.hook_context()
        _, op, _, dtype = plan_key(t).split("|")
        role = (ranked_name(context.node) if context else "eager", op, dtype)
        _CHOSEN[role] = "keep" if index < 0 else repr(self.codecs()[index])
        return index


def _chosen(plan, model, x, dynamic=None):
    """The codec name each saved tensor got, by role, as the plan's hooks chose them."""
    _CHOSEN.clear()
    _step(model, x, _Recording(plan.hooks.codec.choices).hooks(), dynamic)
    return dict(_CHOSEN)


@pytest.mark.slow
@pytest.mark.parametrize("rows", [320, 768], ids=["smaller batch", "larger batch"])
def test_a_plan_at_other_shapes_applies_its_choice_per_role(planned, rows):
    """Every saved tensor the plan names at 512 rows gets the same choice at other row counts, and the
    gradients stay within 25 dB of the step without hooks."""
    model, x, plan = planned
    at_plan = _chosen(plan, model, x)
    other = torch.randn(rows, x.shape[1], generator=torch.Generator().manual_seed(1))
    assert _chosen(plan, model, other) == at_plan
    assert set(at_plan.values()) - {"keep"}, "the plan packs nothing"
    exact = _step(model, other, sh.hooks.make_hook_pair("identity", lambda t: t, lambda t: t))
    db, _ = sh.metrics.worst_sqnr(dict(enumerate(exact)), dict(enumerate(_step(model, other, plan.hooks))))
    assert db >= 25


@pytest.mark.slow
@pytest.mark.parametrize("rows", [320, 768], ids=["smaller batch", "larger batch"])
def test_a_plan_warns_once_where_its_saved_tensors_grow(planned, rows):
    """The hooks run (and warn) as the graph compiles (:func:`_uncached`)."""
    model, x, plan = planned
    other = torch.randn(rows, x.shape[1], generator=torch.Generator().manual_seed(1))
    with _uncached(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _step(model, other, plan.hooks)
    grew = [str(w.message) for w in caught if GREW in str(w.message)]
    if rows < len(x):
        assert not grew
    else:
        assert len(grew) == 1, grew
        assert f"{rows}x" in grew[0] and "512x" in grew[0] and "1.50x its elements" in grew[0]


@pytest.mark.slow
@pytest.mark.parametrize("dynamic", [None, True], ids=["static", "dynamic"])
def test_a_plan_at_its_own_shapes_does_not_warn(planned, dynamic):
    """At the planned shapes every saved tensor is named, compiled with static or dynamic shapes (the keys
    carry the sizes' hints)."""
    model, x, plan = planned
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _step(model, x, plan.hooks, dynamic)
    assert not [w for w in caught if "sh.plan" in str(w.message)]


def test_ranked_names_skip_size_arithmetic():
    """A graph compiled with dynamic shapes numbers its size arithmetic among the tensor ops of one name; the
    ranked name counts the tensor ops alone."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    first = graph.create_node("call_function", torch.ops.aten.add.Tensor, (x, x), name="add")
    size = graph.create_node("call_function", torch.ops.aten.sym_size.int, (x, 0), name="sym_size_int")
    arithmetic = graph.create_node("call_function", operator.add, (size, 1), name="add")
    second = graph.create_node("call_function", torch.ops.aten.add.Tensor, (first, x), name="add")
    for node, value in (
        (x, torch.empty(2)),
        (first, torch.empty(2)),
        (size, 2),
        (arithmetic, 3),
        (second, torch.empty(2)),
    ):
        node.meta["val"] = value
    assert (first.name, arithmetic.name, second.name) == ("add", "add_1", "add_2")
    assert (ranked_name(first), ranked_name(second)) == ("add", "add_1")


# ------------------------------------------------------------------------------------------- a zoo decoder


@pytest.fixture(scope="module")
def decoder():
    """The zoo's llama (default config, tiny sizes, dropout off) at batch 8 x 64 tokens, planned at 0.7x of its
    measured compiled peak with codecs alone (``blocks=()``: one survey; the blocks a plan recomputes are
    recomputed at any shape, its codec choices are what this tests)."""
    pytest.importorskip("transformers")
    from benchmarks import zoo, zoo_entries

    entry = zoo.ZOO["llama"]
    dims = dataclasses.replace(zoo.SIZES["tiny"], batch=8, seq=64)
    config, cls = entry.config(dims)
    zoo_entries.without_dropout(config)
    torch.manual_seed(0)
    model = getattr(zoo_entries._transformers(), cls)(config).train()

    def inputs(batch, seq):
        dims_there = dataclasses.replace(dims, batch=batch, seq=seq)
        return entry.inputs(dims_there, torch.Generator().manual_seed(1), config)

    at_plan = inputs(8, 64)
    peak, _ = zoo._measure(zoo.step_fn(zoo._compiled(model), model, at_plan, entry.loss_of), model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = sh.plan(model, at_plan, budget_bytes=int(0.7 * peak), loss_fn=entry.loss_of, blocks=())
    return model, inputs, entry.loss_of, plan, peak


@pytest.mark.slow
def test_a_decoder_s_plan_keeps_its_share_of_the_peak_at_a_smaller_batch_and_a_longer_sequence(decoder):
    """Made at batch 8, used at batch 5 and at 1.5x the sequence (one compile each, dynamic after the first
    change, as a training loop meets them): the peak stays within the plan's share of the step without hooks
    at those shapes (the documented bound, with the planner's 5 %), within the budget at the smaller batch,
    and the gradients within 25 dB of the eager step."""
    from benchmarks import zoo

    model, inputs, loss_of, plan, peak_at_plan = decoder
    share = plan.budget_bytes / peak_at_plan
    shapes = {"batch 5": inputs(5, 64), "seq x1.5": inputs(8, 96)}
    reference = zoo._compiled(model)
    without = {name: zoo._measure(zoo.step_fn(reference, model, x, loss_of), model)[0] for name, x in shapes.items()}
    plan.apply(model)
    try:
        compiled = zoo._compiled(model)
        with _uncached(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            measured = {}
            for name, x in shapes.items():
                step = zoo.step_fn(compiled, model, x, loss_of, lambda: sh.saved_tensors_hooks(plan.hooks))
                measured[name], grads = zoo._measure(step, model)
                _, exact = zoo._measure(zoo.step_fn(model, model, x, loss_of), model, steps=0)
                db, worst = zoo._sqnr(exact, grads)
                assert db >= 25, (name, db, worst)
    finally:
        plan.revert(model)
    for name, peak in measured.items():
        assert peak <= 1.05 * share * without[name], (name, peak / without[name], share)
    assert measured["batch 5"] <= 1.05 * plan.budget_bytes
    assert measured["seq x1.5"] > plan.budget_bytes  # the budget was for the shorter sequence
    grew = [str(w.message) for w in caught if GREW in str(w.message)]
    assert grew and all("x96x" in m or "768x" in m for m in grew), grew
