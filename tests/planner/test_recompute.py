"""sh.plan's recompute: blocks found and checkpointed with torch's checkpoint, strategies surveyed, plans applied."""

import collections
import dataclasses
import itertools
import types

import pytest
import torch

import savedhooks as sh
from savedhooks.memory.fusion import inlined_nodes
from savedhooks.planner import recompute
from savedhooks.planner.recompute import (
    block_seconds,
    called_modules,
    checkpoint_blocks,
    checkpointed,
    find_blocks,
    restore_blocks,
    save_products,
)
from tests.models import REGISTRY, cast_hook


class _Net(torch.nn.Module):
    """A stem, a ModuleList of same-class blocks (the largest list), a small list of mixed classes, a head."""

    def __init__(self, width: int = 64, blocks: int = 3) -> None:
        super().__init__()
        self.stem = torch.nn.Linear(width, width)
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width))
            for _ in range(blocks)
        )
        self.extras = torch.nn.ModuleList([torch.nn.Linear(width, width), torch.nn.ReLU()])
        self.head = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(self.extras[1](self.extras[0](x)))


def _net():
    torch.manual_seed(0)
    return _Net(), torch.randn(512, 64)


def _loss(y):
    return y.square().mean()


def _grads(model, fn, x):
    model.zero_grad(set_to_none=True)
    _loss(fn(x)).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def _saved_bytes(model, x):
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _loss(model(x)).backward()
    model.zero_grad(set_to_none=True)
    return total


def test_find_blocks_takes_the_largest_list_of_one_class():
    model, _ = _net()
    assert find_blocks(model) == ("layers.0", "layers.1", "layers.2")
    assert find_blocks(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))) == ("0", "1")
    assert find_blocks(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())) == ()
    with pytest.raises(TypeError, match="torch.nn.Module"):
        find_blocks(lambda x: x)


class _Unused(torch.nn.Module):
    """A decoder's layers that run, beside a wider encoder's that the text inputs never reach, and a list of lists."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(3))  # never called
        # larger than the layers as a whole, each inner list smaller
        stage = lambda: torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))  # noqa: E731
        self.stages = torch.nn.ModuleList(stage() for _ in range(2))
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            for layer in stage:
                x = torch.relu(layer(x))
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def test_find_blocks_takes_the_largest_list_whose_blocks_run():
    model, x = _Unused(), torch.randn(4, 16)
    assert find_blocks(model) == ("encoder.0", "encoder.1", "encoder.2")  # by size alone
    with called_modules(model) as ran:
        model(x)
    # the encoder never ran; a list of lists is not called itself
    assert find_blocks(model, ran) == ("layers.0", "layers.1", "layers.2")
    assert sh.planner.Planner(model, (x,)).blocks == ("layers.0", "layers.1", "layers.2")


def test_checkpointed_blocks_give_the_same_gradients_save_less_and_keep_the_module_tree():
    model, x = _net()
    keys = list(model.state_dict())
    reference, saved = _grads(model, model, x), _saved_bytes(model, x)
    checkpoint_blocks(model, find_blocks(model))
    checkpoint_blocks(model, find_blocks(model))  # idempotent: one checkpoint per block
    assert list(model.state_dict()) == keys
    assert all(torch.equal(a, b) for a, b in zip(reference, _grads(model, model, x)))
    # each block saves its input once instead of its two linears' inputs and the GELU's
    assert _saved_bytes(model, x) < saved - 3 * 512 * 256 * 4
    compiled = torch.compile(model, backend="aot_eager")
    assert all(torch.equal(a, b) for a, b in zip(reference, _grads(model, compiled, x)))
    restore_blocks(model)
    assert _saved_bytes(model, x) == saved
    assert all("forward" not in vars(layer) for layer in model.layers)


def test_checkpointed_restores_only_what_it_checkpointed_and_paths_are_checked():
    model, _ = _net()
    checkpoint_blocks(model, ["layers.0"])
    with checkpointed(model, ["layers.0", "layers.1"]):
        assert "forward" in vars(model.layers[1])
    assert "forward" in vars(model.layers[0]) and "forward" not in vars(model.layers[1])
    with pytest.raises(ValueError, match="no submodule 'layers.7'"):
        checkpoint_blocks(model, ["layers.1", "layers.7"])
    assert "forward" not in vars(model.layers[1])  # nothing changed when a path is bad


class _DecoderBlock(torch.nn.Module):
    """Called with cache keywords, and sets and resets a module-level registry, as transformers' decoder layers."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x, past_key_values=None, use_cache=False):
        previous, REGISTRY.active = REGISTRY.active, {"block": self}
        try:
            return x + self.down(torch.nn.functional.gelu(self.up(x)))
        finally:
            REGISTRY.active = previous


class _DecoderNet(torch.nn.Module):
    def __init__(self, width: int = 16, blocks: int = 2) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_DecoderBlock(width) for _ in range(blocks))

    def forward(self, x, use_cache=True):
        for layer in self.layers:
            x = layer(x, past_key_values=None, use_cache=use_cache)
        return x


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache-asked", "no-cache"])
def test_checkpointed_blocks_called_with_cache_arguments_compile_in_one_graph(use_cache):
    torch.manual_seed(0)
    model, x = _DecoderNet(), torch.randn(4, 16)
    reference = [p.clone() for p in torch.autograd.grad(model(x, use_cache).square().sum(), model.parameters())]
    checkpoint_blocks(model, find_blocks(model))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)  # a graph break raises
    with sh.saved_tensors_hooks(cast_hook(torch.float64)):  # lossless; the registry is traced once, in the forward
        got = torch.autograd.grad(compiled(x, use_cache).square().sum(), model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(reference, got))
    assert REGISTRY.active is None


@pytest.mark.slow
def test_the_planner_surveys_recompute_on_blocks_that_mutate_python_state_and_take_cache_arguments():
    torch.manual_seed(0)
    model, x = _DecoderNet(width=64), torch.randn(512, 64)
    planner = sh.planner.Planner(model, (x,), loss_fn=_loss, backend="aot_eager")
    assert planner.blocks == ("layers.0", "layers.1")
    recomputed = planner.survey(2)  # raises NotCompiledError where a checkpointed block breaks the graph
    assert recomputed.floor_bytes < planner.survey(0).floor_bytes


def test_block_seconds_times_each_block_in_one_forward():
    model, x = _net()
    seconds = block_seconds(model, (x,), find_blocks(model), repeats=2)
    assert len(seconds) == 3 and all(0 < s < 10 for s in seconds)
    with pytest.raises(ValueError, match="repeats"):
        block_seconds(model, (x,), ["layers.0"], repeats=0)
    model.spare = torch.nn.Linear(4, 4)  # never called in the forward
    with pytest.raises(ValueError, match=r"\['spare'\] did not run"):
        block_seconds(model, (x,), ["layers.0", "spare"])


def test_inlined_nodes_leaves_out_what_inductor_realized():
    def f(x):
        t = x.tanh()
        return (t * 2).sum(), (t + 1).sum()

    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(f)(torch.randn(8))
    names = {n.name for n in inlined_nodes(gm.graph)}
    assert "tanh" in names
    assert "tanh" not in {n.name for n in inlined_nodes(gm.graph, realized={"tanh"})}


class _WithLoss(torch.nn.Module):
    """The model and its loss in one module: compiled together, the loss's temporaries are modelled too."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _loss(self.model(x))


@pytest.mark.slow
def test_the_planner_recomputes_blocks_when_codecs_alone_cannot_meet_the_budget():
    # which setting wins depends on measured times; each one's plan must meet the budget
    model, x = _net()
    trained = _WithLoss(model)
    planner = sh.planner.Planner(trained, (x,), backend="aot_eager")
    blocks = ("model.layers.0", "model.layers.1", "model.layers.2")
    assert planner.blocks == blocks
    assert planner.strategies == ((0, "full"), *((k, m) for k in (1, 2, 3) for m in ("selective", "full")))
    codecs_only = planner.survey(0)
    assert planner.floor_bytes < codecs_only.floor_bytes, "recompute reaches lower than codecs alone"
    budget = (planner.floor_bytes + codecs_only.floor_bytes) // 2
    planned = planner.plan(budget)
    assert planned.recompute and planned.recompute == planner.blocks[: len(planned.recompute)]
    assert planned.predicted_peak_bytes <= budget and planned.recompute_seconds > 0
    assert planned.seconds >= planned.recompute_seconds
    assert any(line.startswith("recompute 0 blocks: floor") for line in planned.log)
    assert "recomputed blocks: model.layers.0" in planned.report()
    reference = _grads(model, model, x)
    planned.apply(trained)
    compiled = torch.compile(trained, backend=sh.backend("aot_eager"))

    def step():
        with sh.saved_tensors_hooks(planned.hooks):
            compiled(x).backward()

    step()
    model.zero_grad(set_to_none=True)
    measured = sh.memory.measure_peak(step, device="cpu")
    grads = [p.grad for p in model.parameters()]
    assert measured <= budget
    assert abs(measured - planned.predicted_peak_bytes) <= 0.05 * planned.predicted_peak_bytes
    assert min(sh.fidelity.sqnr(r, g) for r, g in zip(reference, grads)) > 25
    planned.revert(trained)
    assert all("forward" not in vars(layer) for layer in model.layers)
    loaded = sh.Plan.from_json(planned.to_json())
    assert loaded == planned and loaded.recompute == planned.recompute


@pytest.mark.slow
def test_a_budget_the_codecs_meet_cheaper_recomputes_nothing_and_bad_blocks_are_refused():
    model, x = _net()
    planner = sh.planner.Planner(model, (x,), loss_fn=_loss, backend="aot_eager")
    unbounded = planner.plan(1 << 40)
    assert unbounded.recompute == () and all(t.choice == "keep" for t in unbounded.tensors)
    assert sh.planner.Planner(model, (x,), blocks=()).strategies == ((0, "full"),)
    with pytest.raises(ValueError, match="no submodule 'nope'"):
        sh.planner.Planner(model, (x,), blocks=["nope"])
    with pytest.raises(TypeError, match="sequence of module paths"):
        sh.planner.Planner(model, (x,), blocks="layers.0")
    with pytest.raises(ValueError, match="k must be in 0..3"):
        planner.survey(4)
    with pytest.raises(ValueError, match="mode must be"):
        planner.survey(1, "some")


@pytest.mark.slow
def test_a_recompute_setting_with_checkpointed_dropout_is_planned_and_its_peak_predicted():
    # AOTAutograd leaves no meta["val"] on the run_and_save_rng_state / run_with_rng_state nodes that a
    # checkpointed dropout becomes; the memory model reads their values from their getitems
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[
            torch.nn.Sequential(
                torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(256, 64)
            )
            for _ in range(2)
        ]
    )
    x = torch.randn(512, 64)
    planner = sh.planner.Planner(model, (x,), loss_fn=_loss, backend="aot_eager")
    assert not any("not planned" in line for line in planner.plan(1 << 40).log)
    recomputed = planner.survey(2)  # both blocks, whole
    planned = recomputed.plan(recomputed.baseline_bytes)  # nothing packed: the recompute alone
    planned.apply(model)
    compiled = torch.compile(model, backend=sh.backend("aot_eager"))

    def step():
        with sh.saved_tensors_hooks(planned.hooks):
            _loss(compiled(x)).backward()

    step()
    model.zero_grad(set_to_none=True)
    measured = sh.memory.measure_peak(step, device="cpu")
    planned.revert(model)
    assert abs(measured - planned.predicted_peak_bytes) <= 0.05 * planned.predicted_peak_bytes


class _Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class _EagerOuter(torch.nn.Module):
    """Its own forward runs eagerly and only the blocks' frames compile, as below DDP's forward."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Block(width) for _ in range(2))

    @torch._dynamo.disable(recursive=False)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_recompute_setting_that_leaves_nothing_compiled_is_skipped_with_a_warning():
    # torch.utils.checkpoint runs its region eagerly unless dynamo traces the call
    # from a compiled frame: with both blocks checkpointed nothing compiles; with
    # one, the other compiles and the checkpointed one runs eagerly, outside what
    # the memory model sees (it was planned so): skipped too
    torch.manual_seed(0)
    planner = sh.planner.Planner(_EagerOuter(), (torch.randn(256, 64),), loss_fn=_loss, backend="aot_eager")
    with pytest.warns(UserWarning, match="recomputing 2 blocks is not planned: plan: the model did not compile"):
        planner.floor_bytes  # noqa: B018  surveys every setting
    planned = planner.plan(1 << 40)
    assert any(line.startswith("recompute 2 blocks: not planned") for line in planned.log)
    assert any(line.startswith("recompute 1 blocks: not planned") and "ran 0 checkpointed regions" in line
               for line in planned.log), planned.log
    assert planned.recompute == ()
    with pytest.raises(sh.planner.NotCompiledError, match="did dynamo fall back to eager"):
        sh.planner.survey(_EagerOuter(), (torch.randn(256, 64),), _loss, "aot_eager",
                          recompute=["layers.0", "layers.1"])


def test_selective_recompute_saves_the_products_and_recomputes_the_rest():
    # torch's selective checkpointing with save_products: each block's first Linear
    # output (addmm) stays saved, its GELU is recomputed from it; whole-block
    # recompute saves neither
    model, x = _net()
    blocks = find_blocks(model)
    ops = {}
    for mode in ("full", "selective"):
        found = sh.planner.survey(model, (x,), _loss, "aot_eager", recompute=blocks, recompute_seconds=0.0,
                                  recompute_mode=mode)
        assert found.recompute_mode == mode
        ops[mode] = collections.Counter(t.op for ts in found.saved.values() for t in ts)
    assert ops["selective"]["addmm"] == ops["full"]["addmm"] + len(blocks)
    assert ops["selective"]["gelu"] == ops["full"]["gelu"] == 0
    with pytest.raises(ValueError, match="recompute mode"):
        checkpoint_blocks(model, blocks, "some")
    assert save_products(None, torch.ops.aten.addmm.default).name == "MUST_SAVE"
    assert save_products(None, torch.ops.aten.gelu.default).name == "PREFER_RECOMPUTE"


def test_selective_block_seconds_leaves_out_the_saved_ops_share(monkeypatch):
    # a clock that advances one tick per reading makes the timing exact: each block
    # is one tick across its forward, each op one tick on its own; a block runs
    # t, addmm, gelu, t, addmm, of which the two addmm are saved: 3/5 of a tick
    # is left to recompute (a wall clock cannot be compared inside pytest)
    ticks = itertools.count()
    monkeypatch.setattr(recompute, "time", types.SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    model, x = _net()
    blocks = find_blocks(model)
    assert block_seconds(model, (x,), blocks, repeats=2, mode="full") == (1.0,) * len(blocks)
    assert block_seconds(model, (x,), blocks, repeats=2, mode="selective") == pytest.approx([3 / 5] * len(blocks))


@pytest.mark.slow
def test_a_selective_plan_applies_round_trips_and_trains_the_same():
    model, x = _net()
    planner = sh.planner.Planner(model, (x,), loss_fn=_loss, backend="aot_eager")
    planned = planner.survey(3, "selective").plan(1 << 40)
    assert planned.recompute == planner.blocks and planned.recompute_mode == "selective"
    assert "(selective: matrix products and attention saved)" in planned.report()
    loaded = sh.Plan.from_json(planned.to_json())
    assert loaded == planned
    with pytest.raises(ValueError, match="recompute_mode"):
        dataclasses.replace(planned, recompute_mode="some")
    reference = _grads(model, model, x)
    planned.apply(model)
    compiled = torch.compile(model, backend="aot_eager")
    assert [torch.equal(r, g) for r, g in zip(reference, _grads(model, compiled, x))] == [True] * len(reference)
    planned.revert(model)
    assert all("forward" not in vars(layer) for layer in model.layers)


@pytest.mark.slow
def test_the_model_still_compiles_after_the_planner_compiled_it_many_times():
    # 7 recompute settings, 2 compiles each: more entries for the model's forward than
    # dynamo's recompile limit (8); left in its cache, the user's compile would run eagerly
    model, x = _net()
    planner = sh.planner.Planner(model, (x,), loss_fn=_loss, backend="aot_eager")
    assert len(planner.strategies) == 7 and planner.floor_bytes > 0
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(model, backend=keep)(x)
    assert len(graphs) == 1


def test_a_budget_the_codecs_meet_surveys_only_the_settings_whose_recompute_could_be_cheaper_and_plans_the_same(
    monkeypatch,
):
    # blocks timed at 1 s each: the codecs of half the saved bytes model far less, so no recompute is surveyed
    monkeypatch.setattr(sh.planner.driver, "recompute_seconds", lambda model, inputs, paths, mode: (1.0,) * len(paths))
    model, x = _net()
    lazy = sh.planner.Planner(model, (x,), loss_fn=_loss, backend="aot_eager")
    codecs_only = lazy.survey(0)
    budget = (codecs_only.baseline_bytes + codecs_only.floor_bytes) // 2
    planned = lazy.plan(budget)
    assert 0 < planned.seconds < 1.0 and planned.recompute == ()
    assert list(lazy._surveys) == [(0, "full")]
    assert sum("not surveyed: its recompute alone models 1000.00 ms" in line for line in planned.log) == 2
    assert sum("not surveyed: its recompute alone" in line for line in planned.log) == len(lazy.strategies) - 1
    assert planned.compiles == 1 + len(lazy._checked) and planned.steps >= planned.compiles
    assert f"planning: {planned.planning_seconds:.1f} s, {planned.compiles} compiles, {planned.steps}" in planned.report()
    full = sh.planner.Planner(model, (x,), loss_fn=_loss, backend="aot_eager")
    full.floor_bytes  # noqa: B018  surveys every setting
    surveyed = full.plan(budget)  # the same choice; its floor is over every setting, its log says more
    assert surveyed.floor_bytes <= planned.floor_bytes and surveyed.compiles == len(full.strategies) + len(full._checked)
    assert dataclasses.replace(surveyed, log=(), floor_bytes=0) == dataclasses.replace(planned, log=(), floor_bytes=0)
    loaded = sh.Plan.from_json(planned.to_json())
    assert (loaded.compiles, loaded.steps) == (planned.compiles, planned.steps)


def test_settings_whose_recompute_models_no_time_are_surveyed_until_one_cannot_be_cheaper(monkeypatch):
    # the first block free to recompute, the others 1 s each: recompute 1 block (both modes) could beat the codecs
    monkeypatch.setattr(sh.planner.driver, "recompute_seconds",
                        lambda model, inputs, paths, mode: (0.0,) + (1.0,) * (len(paths) - 1))  # fmt: skip
    model, x = _net()
    planner = sh.planner.Planner(model, (x,), loss_fn=_loss, backend="aot_eager")
    codecs_only = planner.survey(0)
    planned = planner.plan((codecs_only.baseline_bytes + codecs_only.floor_bytes) // 2)
    # recomputing 1 block could beat the codecs: surveyed in the order of their estimates until a plan found is
    # cheaper than what is left (the recompute alone, or the estimate from the first survey)
    cheap = {(1, "selective"), (1, "full")}
    assert (0, "full") in planner._surveys and set(planner._surveys) <= {(0, "full"), *cheap}
    for k, mode in cheap - set(planner._surveys):
        prefix = f"{sh.planner.driver._name(k, mode)}: not surveyed: "
        assert any(line.startswith(prefix) for line in planned.log), planned.log
    others = set(planner.strategies) - {(0, "full"), *cheap}
    assert sum("not surveyed: its recompute alone models 1000.00 ms" in line for line in planned.log) == 2
    assert sum("not surveyed: " in line for line in planned.log) == len(others) + 3 - len(planner._surveys)
    assert planned.compiles == len(planner._surveys) + len(planner._checked)
