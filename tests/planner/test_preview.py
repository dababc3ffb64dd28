"""The planner's estimate of a recompute setting from the survey without recompute, and what it skips."""

import sys

import pytest
import torch
from models import square_mean_loss

from savedhooks.fidelity.select import SavedTensor
from savedhooks.planner.census import Scope, scope_of
from savedhooks.planner.recompute import FULL, SELECTIVE
from savedhooks.planner.search import Option, Unit
from savedhooks.planner.survey import Survey

plan_module = sys.modules["savedhooks.planner.driver"]


def _node(graph, name, stack, *args):
    node = graph.call_function(torch.ops.aten.relu.default, args) if args else graph.placeholder(name)
    node.name = name
    node.meta["nn_module_stack"] = {path: (f"L['self'].{path}", torch.nn.Module) for path in stack}
    return node


def test_a_saved_value_s_scope_is_the_modules_its_maker_and_readers_share():
    graph = torch.fx.Graph()
    x = _node(graph, "x", ())
    inner = _node(graph, "inner", ("model", "model.layers.0", "model.layers.0.mlp"), x)
    read_inside = _node(graph, "read_inside", ("model", "model.layers.0"), inner)
    out = _node(graph, "out", ("model", "model.layers.0"), read_inside)
    next_block = _node(graph, "next_block", ("model", "model.layers.1"), out)
    unstacked = torch.ops.aten.relu.default
    added = graph.call_function(unstacked, (inner,))  # an op AOTAutograd added: no stack, does not narrow
    graph.output((next_block, added))
    # dynamo's source prefix (L['self'].) is dropped; the paths are the model's own
    assert scope_of(inner) == ("model", "model.layers.0")
    assert scope_of(out) == ("model",)  # the block's output: the next block reads it
    assert scope_of(x) == ()


def _survey(scopes):
    """A forward of 3 points, the loss at 3, a backward of 4 (block 1's backward first, at 4; block 0's at 6)."""
    live = (10, 20, 30, 30, 30, 25, 20, 10)
    units = (
        Unit("a", 10, ((1, 6, 10),), (Option("keep", 10, 0.0), Option("fp8", 3, 1.0))),
        Unit("b", 10, ((2, 4, 10),), (Option("keep", 10, 0.0), Option("fp8", 3, 1.0))),
    )
    saved = {u.key: (SavedTensor(f"g0:{u.key}", "mul", (2,), torch.float32, u.bytes),) for u in units}
    return Survey(units, saved, live, "inductor", scopes=scopes)


def test_preview_of_full_recompute_frees_a_block_s_values_until_its_backward_and_drops_their_units():
    scopes = {
        "g0:a": (Scope(("m", "m.0"), "mul", 10), (1, 6)),
        "g0:b": (Scope(("m", "m.1"), "mm", 10), (2, 4)),
        "g0:kept": (Scope(("m", "m.0"), "mm", 5), (1, 7)),  # a value the policy keeps (no unit)
        "g0:output": (Scope(("m",), "add", 5), (2, 7)),  # block 0's output: the next block reads it
    }
    preview = _survey(scopes).preview(("m.0",), FULL, 0.25)
    # block 0's first backward use is point 6 (a's): a (10) and kept (5) are gone from points 1..5
    assert preview.live == (10, 5, 15, 15, 15, 10, 20, 10)
    assert [u.key for u in preview.units] == ["b"]
    assert (preview.recompute, preview.recompute_mode, preview.recompute_seconds) == (("m.0",), FULL, 0.25)
    assert preview.baseline_bytes == 20


def test_preview_of_selective_recompute_keeps_what_products_made():
    scopes = {
        "g0:a": (Scope(("m", "m.0"), "mul", 10), (1, 6)),
        "g0:b": (Scope(("m", "m.0"), "mm", 10), (2, 4)),
    }
    preview = _survey(scopes).preview(("m.0",), SELECTIVE, 0.1)
    # a goes until block 0's first backward use (b's, at 4); b, a product's output, stays saved
    assert preview.live == (10, 10, 20, 20, 30, 25, 20, 10)
    assert [u.key for u in preview.units] == ["b"]


def test_preview_without_scopes_naming_the_blocks_is_the_survey_itself():
    found = _survey({"g0:a": (Scope(("m", "m.5"), "mul", 10), (1, 6))})
    assert found.preview(("m.0",), FULL, 0.0) is found
    assert _survey({}).preview(("m.0",), SELECTIVE, 0.0).live == _survey({}).live


class _Residual(torch.nn.Module):
    """Three residual blocks (Linear 64 -> 256, GELU, Linear 256 -> 64) between a stem and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Linear(64, 64)
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)) for _ in range(3)
        )
        self.head = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


@pytest.mark.slow
def test_the_estimate_of_full_recompute_is_near_its_survey_and_plans_skip_surveys():
    torch.manual_seed(0)
    model, x = _Residual(), torch.randn(512, 64)
    planner = plan_module.Planner(model, (x,), loss_fn=square_mean_loss, backend="aot_eager")
    base = planner.survey(0)
    owned = [scope.paths[-1] for scope, _ in base.scopes.values() if scope.paths and scope.paths[-1] in planner.blocks]
    assert set(owned) == set(planner.blocks)
    k = len(planner.blocks)
    estimated, surveyed = planner._preview(k, FULL), planner.survey(k, FULL)
    # every block's activations are recomputed: the estimate's peak without hooks is the survey's, within 10 %
    assert surveyed.baseline_bytes < 0.8 * base.baseline_bytes
    assert abs(estimated.baseline_bytes - surveyed.baseline_bytes) <= 0.1 * surveyed.baseline_bytes
    # a budget only recompute meets: planned with fewer surveys than settings, each skipped one logged
    budget = (base.floor_bytes + surveyed.floor_bytes) // 2
    fresh = plan_module.Planner(model, (x,), loss_fn=square_mean_loss, backend="aot_eager")
    chosen = fresh.plan(budget, check=False)
    assert chosen.recompute and chosen.predicted_peak_bytes <= budget
    skipped = [line for line in chosen.log if "not surveyed" in line]
    assert len(fresh._surveys) + len(skipped) == len(fresh.strategies), chosen.log


def test_an_estimate_rules_a_setting_out_by_a_floor_margin_that_narrows_once_its_mode_is_surveyed(monkeypatch):
    torch.manual_seed(0)
    planner = plan_module.Planner(_Residual(), (torch.randn(8, 64),), loss_fn=square_mean_loss, backend="aot_eager")
    monkeypatch.setattr(planner, "_estimate", lambda setting, budget: (105.0, 1.0))
    monkeypatch.setattr(planner, "_floor_error", lambda mode: None)
    assert planner._estimate_rules_out((1, FULL), 100, 2.0) is None  # 5 % above the budget: within 10 %
    assert planner._estimate_rules_out((1, FULL), 100, float("inf")) is None  # no plan found yet
    monkeypatch.setattr(planner, "_floor_error", lambda mode: 0.0)  # calibrated: 2 %
    assert "its estimated floor" in planner._estimate_rules_out((1, FULL), 100, 2.0)
    monkeypatch.setattr(planner, "_estimate", lambda setting, budget: (90.0, 2.5))
    assert "estimated at 2500.00 ms, above a plan found (2000.00 ms)" in planner._estimate_rules_out((1, FULL), 100, 2.0)
    assert planner._estimate_rules_out((1, FULL), 100, 2.3) is None  # within 10 % of the plan found
