"""sh.plan on models that are not one compiled loop over blocks that all run.

A graph break inside the loop over the blocks makes dynamo run the model's
forward eagerly and compile each block's forward as a frame of its own; the
blocks of one class then share one compiled graph, which runs once per block.
The memory model counts such a graph once per run, not once per compile
(counted once, the prediction would fall far under the measured peak). A
block of the model's ModuleList that its forward never calls is left out of
recompute with a warning naming it.
"""

import warnings

import pytest
import torch
from models import measured_step_peak as _measured_peak
from models import square_mean_loss as _loss

import savedhooks as sh
from savedhooks.planner.step import run_order


class _Block(torch.nn.Module):
    """Linear-GELU-Linear with a residual: a frame dynamo compiles (nn.Sequential's forward is torch's own)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class _BrokenLoop(torch.nn.Module):
    """Three blocks with a graph break after the first, inside the loop."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.layers):
            x = block(x)
            if i == 0:
                torch._dynamo.graph_break()
        return x


def test_run_order_takes_the_runs_where_they_count_every_graph():
    assert run_order([0, 1, 1], 2) == (0, 1, 1)
    assert run_order([0, 0], 1) == (0, 0)
    # a recorded graph no run counted (its compile recorded several forwards): each graph once
    assert run_order([0, 0], 2) == (0, 1)
    assert run_order([], 3) == (0, 1, 2)


@pytest.mark.slow
def test_a_graph_run_once_per_block_is_counted_per_run_and_eager_checkpoints_are_not_planned():
    torch.manual_seed(0)
    model, x = _BrokenLoop(), torch.randn(256, 64)
    planner = sh.planner.Planner(model, (x,), loss_fn=_loss, backend="aot_eager")
    # the checkpointed blocks run eagerly (torch.utils.checkpoint from an eager frame): those settings are skipped
    with pytest.warns(UserWarning, match="checkpointed regions"):
        planner.floor_bytes  # noqa: B018  surveys every setting
    unbounded = planner.plan(1 << 40)
    kept, _ = _measured_peak(model, x, unbounded.hooks)
    assert abs(planner.baseline_bytes - kept) <= 0.02 * kept, (planner.baseline_bytes, kept)
    floor = planner.floor_bytes
    for budget in ((planner.baseline_bytes + floor) // 2, floor):
        plan = planner.plan(budget)
        assert {t.choice for t in plan.tensors} - {"keep"}, "below the baseline something is packed"
        measured, _ = _measured_peak(plan.apply(model), x, plan.hooks)
        plan.revert(model)
        assert measured <= budget + 0.02 * budget
        assert abs(measured - plan.predicted_peak_bytes) <= 0.02 * plan.predicted_peak_bytes, (budget, measured)


class _Wrapped(torch.nn.Module):
    """One _Block class before and after the broken loop of another: the runs interleave (N, B, ..., B, N)."""

    def __init__(self) -> None:
        super().__init__()
        self.pre, self.post, self.loop = _Block(), _Block(), _BrokenLoop()
        self.loop.layers = torch.nn.ModuleList(_Other() for _ in range(3))

    @torch._dynamo.disable(recursive=False)  # its frame eager: the two outer blocks' frames share one graph
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.loop(self.pre(x)))


class _Other(torch.nn.Module):
    """A block of another class (another compiled graph than _Block's)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.exp(self.linear(x).clamp(max=0.0))


@pytest.mark.slow
def test_interleaved_runs_of_two_reused_graphs_pair_each_backward_with_its_forward():
    # a backward compiles when it first runs, in the backward of its graph's last forward run: here the outer
    # blocks' graph (run first and last) compiles its backward first, which paired it with the loop's forward
    torch.manual_seed(0)
    model, x = _Wrapped(), torch.randn(256, 64, requires_grad=True)  # both outer blocks' inputs need grad
    planner = sh.planner.Planner(model, (x,), loss_fn=_loss, backend="aot_eager", blocks=())
    survey = planner.survey(0)
    assert {t.op for ts in survey.saved.values() for t in ts} >= {"gelu", "exp"}
    kept, _ = _measured_peak(model, x, planner.plan(1 << 40).hooks)
    assert abs(planner.baseline_bytes - kept) <= 0.02 * kept, (planner.baseline_bytes, kept)
    plan = planner.plan((planner.baseline_bytes + planner.floor_bytes) // 2)
    measured, _ = _measured_peak(model, x, plan.hooks)
    assert abs(measured - plan.predicted_peak_bytes) <= 0.02 * plan.predicted_peak_bytes, measured


class _BreaksBeforeTheLayers(torch.nn.Module):
    """A scale computed from the input alone (a graph no gradient flows through), a graph break, then two Linears."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = (x.abs() > 0.5).float().mean(-1, keepdim=True) + 1.0
        torch._dynamo.graph_break()
        return self.b(torch.nn.functional.gelu(self.a(x))) * scale


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_model_with_graph_breaks_and_a_graph_without_a_backward_is_planned_within_its_budget(backend):
    # the scale's graph compiles for inference (no input needs a gradient) and saves nothing; filed as a forward
    # it left the forward graphs without a backward each, and the planner refused the model
    torch.manual_seed(0)
    model, x = _BreaksBeforeTheLayers(), torch.randn(512, 64)
    planner = sh.planner.Planner(model, (x,), loss_fn=_loss, backend=backend)
    kept, want = _measured_peak(model, x, planner.plan(1 << 40).hooks, backend)
    assert abs(planner.baseline_bytes - kept) <= 0.05 * kept, (planner.baseline_bytes, kept)
    budget = (planner.baseline_bytes + planner.floor_bytes) // 2
    plan = planner.plan(budget)
    assert {t.choice for t in plan.tensors} - {"keep"}, "below the baseline something is packed"
    measured, got = _measured_peak(plan.apply(model), x, plan.hooks, backend)
    plan.revert(model)
    assert measured <= 1.02 * budget, (measured, budget)
    assert min(sh.metrics.sqnr(w, g) for w, g in zip(want, got)) >= 20


class _UnusedBranch(torch.nn.Module):
    """Two outputs compiled apart (a graph break between them); the loss reads the first only."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.nn.functional.gelu(self.a(x))
        torch._dynamo.graph_break()
        return y, torch.exp(self.b(x))


def test_a_graph_whose_backward_never_runs_is_refused_with_the_breaks_named_not_a_wrapper_blamed():
    torch.manual_seed(0)
    with pytest.raises(sh.planner.NotCompiledError, match="has graph breaks") as caught:
        sh.plan(_UnusedBranch(), (torch.randn(256, 64),), budget_bytes=1 << 20, loss_fn=lambda out: _loss(out[0]),
                backend="aot_eager")
    message = str(caught.value)
    assert "2 forward graphs that need a gradient, 1 of them with a backward" in message
    assert "graph_break()" in message and "DDP" not in message


class _SpareBlock(torch.nn.Module):
    """Three blocks in the ModuleList; the forward runs the first two."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers[:2]:
            x = block(x)
        return x


@pytest.mark.slow
def test_a_block_the_forward_never_runs_leaves_recompute_out_with_a_warning_naming_it():
    torch.manual_seed(0)
    model, x = _SpareBlock(), torch.randn(256, 64)
    # found by the planner, a list one of whose blocks never runs on the inputs is not taken as blocks
    assert sh.planner.Planner(model, (x,), loss_fn=_loss, backend="aot_eager").blocks == ()
    every = ["layers.0", "layers.1", "layers.2"]
    planner = sh.planner.Planner(model, (x,), loss_fn=_loss, backend="aot_eager", blocks=every)
    with pytest.warns(UserWarning, match=r"blocks \['layers.2'\] did not run in the model's forward"):
        floor = planner.floor_bytes  # surveys every setting
    plan = planner.plan((planner.baseline_bytes + floor) // 2)
    assert plan.recompute == () and {t.choice for t in plan.tensors} - {"keep"}
    # the blocks it runs, named, are surveyed with recompute too (no setting skipped), down to a floor no higher
    named = sh.planner.Planner(model, (x,), loss_fn=_loss, backend="aot_eager", blocks=["layers.0", "layers.1"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert len(named.strategies) > 1 and named.floor_bytes <= planner.floor_bytes
    assert named._skipped == {}


class _NormBlock(torch.nn.Module):
    """Linear, batch norm (running statistics: buffers a training step updates), ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.norm = torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.linear(x)))


class _Normed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_NormBlock() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return x


@pytest.mark.slow
def test_planning_and_sensitivity_leave_the_model_s_buffers_as_they_were():
    # the surveys, checks, recompute timings and sensitivity steps each ran a training step: batch norm's
    # running statistics moved and num_batches_tracked counted them (14 after one sh.plan)
    torch.manual_seed(0)
    model, x = _Normed(), torch.randn(128, 64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    planner = sh.planner.Planner(model, (x,), loss_fn=_loss, backend="aot_eager")
    planner.plan((planner.baseline_bytes + planner.floor_bytes) // 2)  # surveys every setting, checks a plan
    sh.fidelity.sensitivity(model, (x,), loss_fn=_loss, verbose=False)
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before), [k for k in before if not torch.equal(before[k], after[k])]
    loss = _loss(model(x))  # the model still trains: a step of its own moves them
    loss.backward()
    assert not torch.equal(before["layers.0.norm.running_mean"], model.layers[0].norm.running_mean)


def _recomputing(paths, mode="full"):
    return sh.Plan(tensors=(), budget_bytes=1, predicted_peak_bytes=1, baseline_peak_bytes=1, floor_bytes=1,
                   backend="aot_eager", recompute=tuple(paths), recompute_mode=mode)


def test_a_model_with_a_plan_applied_is_not_planned_again_nor_given_another_plan_over_it():
    # planned again, its surveys modelled the checkpointed blocks as never recomputed; applied over, the
    # first plan's blocks (and mode) stayed, and the second plan's revert left them checkpointed
    model, x = _Normed(), torch.randn(128, 64)
    first = _recomputing(["layers.0", "layers.1"], "selective")
    first.apply(model)
    assert first.apply(model) is model  # the same plan again changes nothing
    with pytest.raises(ValueError, match=r"blocks \['layers.0', 'layers.1'\] are checkpointed by a plan's apply"):
        sh.planner.Planner(model, (x,), loss_fn=_loss, backend="aot_eager")
    for other in (_recomputing(["layers.0", "layers.1"]), _recomputing(["layers.0"], "selective")):
        with pytest.raises(ValueError, match="checkpointed already, not as this plan recomputes them"):
            other.apply(model)
    first.revert(model)
    assert sh.planner.recompute.checkpointed_blocks(model) == {}
    second = _recomputing(["layers.1"])
    assert sh.planner.recompute.checkpointed_blocks(second.apply(model)) == {"layers.1": "full"}
    second.revert(model)
