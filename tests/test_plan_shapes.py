"""A plan used at input shapes it was not made for: it runs, its unnamed tensors get the policy, a warning says so."""

import warnings

import pytest
import torch
from models import planner_mlp, square_mean_loss

import savedhooks as sh


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


@pytest.mark.parametrize("rows", [320, 768], ids=["smaller batch", "larger batch"])
def test_a_plan_at_other_shapes_runs_with_the_policy_and_warns_once(planned, rows):
    model, x, plan = planned
    other = torch.randn(rows, x.shape[1], generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grads = _step(model, other, plan.hooks)
    reshaped = [w for w in caught if "made for other input shapes" in str(w.message)]
    assert len(reshaped) == 1, [str(w.message) for w in caught]
    assert "512x" in str(reshaped[0].message) and f"{rows}x" in str(reshaped[0].message)
    exact = _step(model, other, sh.make_hook_pair("identity", lambda t: t, lambda t: t))
    db, _ = sh.metrics.worst_sqnr(dict(enumerate(exact)), dict(enumerate(grads)))
    assert db >= 25


@pytest.mark.parametrize("dynamic", [None, True], ids=["static", "dynamic"])
def test_a_plan_at_its_own_shapes_does_not_warn(planned, dynamic):
    """At the planned shapes every saved tensor is named, compiled with static or dynamic shapes (the keys
    carry the sizes' hints)."""
    model, x, plan = planned
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _step(model, x, plan.hooks, dynamic)
    assert not [w for w in caught if "made for other input shapes" in str(w.message)]
