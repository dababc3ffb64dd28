"""sh.plan on models as transformers ships them (KV cache on), and its errors for bad input.

A transformers decoder built from its default config has ``use_cache=True``:
a block that a plan checkpoints appends to the cache again when it is
recomputed, and torch's checkpoint fails in the backward. Plans train with the
cache off, as transformers' own gradient checkpointing does.
"""

import dataclasses
import os
import warnings

import pytest
import torch

import savedhooks as sh
from savedhooks.planner.caches import cache_configs, cache_positions, check_no_cache_input, without_cache_arguments

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _gpt2():
    transformers = pytest.importorskip("transformers")
    # the shipped default config, sizes shrunk: use_cache=True, dropout 0.1, SDPA attention
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=256, n_positions=64)
    assert config.use_cache is True
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(0, config.vocab_size, (2, 32))
    return model, {"input_ids": ids, "labels": ids}


def _loss(out):
    return out.loss


@pytest.mark.slow
# full recompute takes the same path through the cache as selective: the suite runs selective
@pytest.mark.parametrize("mode", [pytest.param("full", marks=pytest.mark.extended), "selective"])
def test_gpt2_as_shipped_plans_with_recompute_and_trains_with_the_cache_off_until_revert(mode):
    model, inputs = _gpt2()
    planner = sh.planner.Planner(model, inputs, loss_fn=_loss, backend="aot_eager")
    # a budget between the floor and the baseline: recompute settings are surveyed (they crashed with the cache on)
    plan = planner.plan((planner.baseline_bytes + planner.floor_bytes) // 2)
    assert not planner._skipped, planner._skipped
    recomputing = [s for s in planner.strategies if s[0]]
    assert all(s in planner._surveys for s in recomputing)
    assert model.config.use_cache is True, "planning leaves the config as it was"

    # a plan that recomputes the first block, in each mode (selective checkpointing fails on an op it did not save)
    forced = dataclasses.replace(plan, recompute=planner.blocks[:1], recompute_mode=mode)
    with pytest.warns(UserWarning, match="use_cache=False"):
        forced.apply(model)
    assert model.config.use_cache is False
    # dynamo does not guard on module hooks: code compiled for this model class by another test must not serve
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=sh.backend("aot_eager"))
    for asked in ({}, {"use_cache": True}):  # a cache asked for in the call: the recomputed block runs without it
        model.zero_grad(set_to_none=True)
        with sh.saved_tensors_hooks(forced.hooks):
            out = compiled(**inputs, **asked)
        out.loss.backward()
        assert (out.past_key_values is None) == (not asked)
        if asked:  # GPT-2 hands its cache to a block by position: the recomputed block never appended to it
            lengths = [layer.keys.shape[-2] for layer in out.past_key_values.layers if layer.keys is not None]
            assert lengths == [inputs["input_ids"].shape[1]] * (len(planner.blocks) - 1)
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
    forced.revert(model)
    assert model.config.use_cache is True
    torch._dynamo.reset()


def test_a_checkpointed_block_called_with_a_cache_drops_it_only_when_a_backward_will_recompute_it():
    block = torch.nn.Linear(2, 2)
    kwargs = {"use_cache": True, "cache": object(), "attention_mask": 1}
    dropped = {"use_cache": False, "cache": None, "attention_mask": 1}
    assert without_cache_arguments(block.train(), (), kwargs) == ((), dropped)
    assert kwargs["use_cache"] is True, "the caller's dict is not changed"
    with torch.no_grad():
        assert without_cache_arguments(block, (), kwargs)[1] is kwargs
    assert without_cache_arguments(block.eval(), (), kwargs)[1] is kwargs
    plain = {"attention_mask": 1, "use_cache": False}
    assert without_cache_arguments(block.train(), (), plain)[1] is plain


def test_a_cache_passed_to_a_block_by_position_is_dropped_by_the_name_its_forward_gives_it():
    class Block(torch.nn.Module):
        def forward(self, hidden, past_key_values=None, mask=None, use_cache=False):
            return hidden

    block = Block().train()
    positions = cache_positions(block.forward)
    assert positions == {1: "past_key_values", 3: "use_cache"}
    assert cache_positions(len) == {}, "a forward without a readable signature: keywords only"
    x, cache, mask = torch.ones(1), object(), torch.zeros(1)
    args, kwargs = without_cache_arguments(block, (x, cache, mask, True), {}, positions)
    assert args[0] is x and args[1] is None and args[2] is mask and args[3] is False and kwargs == {}
    # no cache asked for: the very same arguments come back
    given = (x, None, mask)
    assert without_cache_arguments(block, given, {}, positions)[0] is given
    with torch.no_grad():
        assert without_cache_arguments(block, (x, cache), {}, positions)[0][1] is cache
    assert without_cache_arguments(block, (x, cache), {})[0][1] is cache, "without positions: keywords only"


def test_cache_configs_finds_each_config_once_and_only_those_with_the_cache_on():
    class Config:
        def __init__(self, use_cache):
            self.use_cache = use_cache

    shared, off = Config(True), Config(False)
    model = torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.Linear(1, 1), torch.nn.Linear(1, 1))
    model[0].config, model[1].config, model[2].config = shared, shared, off
    assert cache_configs(model) == [shared]


def test_example_inputs_that_ask_for_a_cache_are_refused_naming_the_argument():
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="use_cache=True"):
        check_no_cache_input({"input_ids": ids, "use_cache": True})
    check_no_cache_input({"input_ids": ids, "use_cache": False})
    check_no_cache_input((ids,))


class _Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def test_a_loss_that_is_not_a_scalar_is_refused_before_any_compile():
    with pytest.raises(ValueError, match=r"loss_fn must return a scalar .* shape \(4, 16\)"):
        sh.plan(_Mlp(), (torch.randn(4, 16),), budget_bytes=1 << 20, loss_fn=lambda out: out)
    with pytest.raises(TypeError, match="loss_fn must return a floating scalar tensor"):
        sh.plan(_Mlp(), (torch.randn(4, 16),), budget_bytes=1 << 20, loss_fn=lambda out: 1.0)


def test_inputs_the_model_cannot_take_are_refused_naming_example_inputs():
    with pytest.raises(ValueError, match="raised RuntimeError on example_inputs") as info:
        sh.plan(_Mlp(), (torch.randn(4, 7),), budget_bytes=1 << 20)
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(ValueError, match="on example_inputs"):
        sh.plan(_Mlp(), {"y": torch.randn(4, 16)}, budget_bytes=1 << 20)


def test_a_compiled_model_is_refused():
    model = _Mlp()
    with pytest.raises(ValueError, match="model is compiled already"):
        sh.plan(torch.compile(model), (torch.randn(4, 16),), budget_bytes=1 << 20)
    model.compile()
    with pytest.raises(ValueError, match="model is compiled already"):
        sh.plan(model, (torch.randn(4, 16),), budget_bytes=1 << 20)


def test_the_input_check_leaves_the_model_as_it_was():
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16)).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sh.planner.Planner(model, (torch.randn(8, 16),), backend="aot_eager")
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())


def test_options_passed_by_position_are_refused_before_anything_runs():
    model, x = torch.nn.Linear(8, 8), torch.randn(4, 8)
    with pytest.raises(TypeError, match="positional"):
        sh.plan(model, (x,), 1 << 20)
    with pytest.raises(TypeError, match="positional"):
        sh.planner.Planner(model, (x,), None, "aot_eager")
    planner = sh.planner.Planner(model, (x,), backend="aot_eager")
    with pytest.raises(TypeError, match="positional"):
        planner.plan(1 << 20, True)
