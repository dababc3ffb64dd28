"""The model's output in a planned step: dropped once the loss has read it, or kept to the end (``output_held``)."""

import dataclasses
import json

import pytest
import torch

import savedhooks as sh
from savedhooks.planner.census import GraphTimeline, step_timeline
from savedhooks.planner.step import loss_peak

_OUTPUT_BYTES = 1024 * 1024 * 4  # the wide head's float32 output


def _wide_head() -> tuple[torch.nn.Module, torch.Tensor]:
    """Two GELU layers and a 4 MiB output: where the output lives shows in the peak, and packing lowers it."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(1024, 1024))
    return model, torch.randn(1024, 64)


_TARGETS = torch.softmax(torch.arange(1024.0).expand(1024, 1024), -1)  # soft targets, made once


def _cross_entropy(out: torch.Tensor) -> torch.Tensor:
    """Soft-target cross-entropy: it saves its log-softmax, not its input (the output can go after its forward)."""
    return torch.nn.functional.cross_entropy(out, _TARGETS)


def _step_peak(model: torch.nn.Module, x: torch.Tensor, hooks: sh.HookPair, backend: str, held: bool) -> int:
    """Measured CPU peak of one warm step with placement, the output kept to the end or dropped."""
    compiled = torch.compile(model, backend=sh.backend("aot_eager") if backend == "aot_eager" else backend)

    def step() -> None:
        with sh.saved_tensors_hooks(hooks):
            out = compiled(x)
            loss = _cross_entropy(out)
            if not held:
                del out
        loss.backward()

    step()
    model.zero_grad(set_to_none=True)
    peak = sh.memory.measure_peak(step, device="cpu")
    model.zero_grad(set_to_none=True)
    return peak


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_each_plan_predicts_the_loop_it_was_made_for_and_a_kept_output_needs_output_held(backend):
    """Checked plans for both loops measure their prediction; the dropping loop's plan is short for a keeping loop.

    Each loop gets a plan modelled for it (the loss point and the backward),
    measured within 1 % of its prediction; the dropping loop's plan, run by a
    loop that keeps the output, peaks above its prediction by about the
    output's bytes.
    """
    model, x = _wide_head()
    plans, measured = {}, {}
    for held in (True, False):
        planner = sh.planner.Planner(model, (x,), loss_fn=_cross_entropy, backend=backend, blocks=(), output_held=held)
        plans[held] = planner.plan((planner.baseline_bytes + planner.floor_bytes) // 2)
        assert plans[held].output_held is held and {t.choice for t in plans[held].tensors} - {"keep"}
        measured[held] = _step_peak(model, x, plans[held].hooks, backend, held)
        torch._dynamo.reset()
    for held, plan in plans.items():
        assert abs(measured[held] - plan.predicted_peak_bytes) <= 0.01 * measured[held], held
    # the plan made for a loop that drops the output, run by one that keeps it: above its prediction
    kept = _step_peak(model, x, plans[False].hooks, backend, held=True)
    assert kept >= plans[False].predicted_peak_bytes + _OUTPUT_BYTES // 2


def test_the_loss_peak_counts_the_output_until_the_loss_lets_it_go():
    """Above the output: a loop keeping it holds it next to its gradient; one dropping it frees it after the forward."""
    out = torch.randn(1024, 1024)
    cpu = torch.device("cpu")
    held, dropped = loss_peak(_cross_entropy, out, cpu, 0, True), loss_peak(_cross_entropy, out, cpu, 0, False)
    assert abs(held - dropped - _OUTPUT_BYTES) <= 64  # the anchor's scalar gradient
    # a loss that saves its input (a square) keeps the output through its backward either way
    square = lambda t: t.square().mean()
    assert loss_peak(square, out, cpu, 0, True) == loss_peak(square, out, cpu, 0, False)


def test_a_kept_output_adds_its_bytes_to_the_backward_points_only():
    fw = GraphTimeline(live=(10, 20), at={}, retained=20)
    bw = GraphTimeline(live=(3, -20), at={})
    dropped = step_timeline([fw], [bw], [], loss_bytes=5)
    held = step_timeline([fw], [bw], [], loss_bytes=5, held_output=4)
    assert dropped.live == (10, 20, 25, 23, 0)
    assert held.live == (10, 20, 25, 27, 4)


def test_output_held_is_kept_in_json_checked_and_false_for_older_plans():
    plan = sh.Plan((), 1 << 20, 1 << 19, 1 << 21, 1 << 18, "inductor", output_held=True)
    assert sh.Plan.from_json(plan.to_json()) == plan
    assert "the model's output: kept to the end of the step" in plan.report()
    older = json.loads(plan.to_json())
    del older["output_held"]
    older["version"] = 4
    assert sh.Plan.from_json(json.dumps(older)) == dataclasses.replace(plan, output_held=False)
    with pytest.raises(TypeError, match="output_held must be a bool"):
        dataclasses.replace(plan, output_held=1)
    model, x = _wide_head()
    with pytest.raises(TypeError, match="output_held must be a bool"):
        sh.plan(model, (x,), budget_bytes=1 << 20, loss_fn=_cross_entropy, output_held="yes")


def test_a_complex_output_handed_to_the_loss_gets_its_gradient_through():
    out = torch.randn(256, 256, dtype=torch.complex64)
    peak = loss_peak(lambda t: t.abs().square().mean(), out, torch.device("cpu"), 0, False)
    assert peak > 0


class _LogSoftmaxHead(torch.nn.Module):
    """An MNIST-style model: its output is a ``log_softmax``, which its own backward reads too."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.body(x), -1)


def test_an_output_the_forward_also_saves_outlives_a_loop_that_drops_it():
    """The log-softmax head's output stays saved after the loop drops it, next to its gradient in the backward."""
    torch.manual_seed(0)
    model, x = _LogSoftmaxHead(), torch.randn(1024, 64)
    targets = torch.randint(0, 1024, (1024,))

    def nll(out: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.nll_loss(out, targets)

    found = sh.planner.survey(model, (x,), loss_fn=nll, backend="aot_eager")
    plan = found.plan(found.baseline_bytes)  # keeps everything: the step as compiled without hooks
    compiled = torch.compile(model, backend=sh.backend("aot_eager"))

    def step() -> None:
        with sh.saved_tensors_hooks(plan.hooks):
            loss = nll(compiled(x))
        loss.backward()

    step()
    model.zero_grad(set_to_none=True)
    measured = sh.memory.measure_peak(step, device="cpu")
    assert abs(measured - plan.predicted_peak_bytes) <= 0.01 * measured, (measured, plan.predicted_peak_bytes)
