"""sh.plan on a transformers decoder as shipped, trained with its own loss, under inductor: plans meet the budget.

With the loss inside the compiled forward (``labels=``), the backward's first
kernel reads the logits (saved, and returned as the model's output) and the
zero gradient of that output for the last time, and writes the logits'
gradient: inductor allocates it beside both, because neither was donated.
The memory model counts that, so the modelled peak of the step, with hooks or
without, is the measured one.
"""

import contextlib
import os

import pytest
import torch

import savedhooks as sh

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _qwen2():
    transformers = pytest.importorskip("transformers")
    # the default config (use_cache=True, GQA, RMSNorm, rotary), sizes shrunk; a vocabulary large
    # enough that the logits are a large share of the step
    config = transformers.Qwen2Config(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=384, vocab_size=8192,
                                      max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).train()
    ids = torch.randint(0, config.vocab_size, (2, 128))
    return model, {"input_ids": ids, "labels": ids}


def _measured(model, inputs, hooks=None):
    compiled = torch.compile(model)

    def step():
        model.zero_grad(set_to_none=True)
        if hooks is None:
            loss = compiled(**inputs).loss
        else:
            with sh.saved_tensors_hooks(hooks):
                loss = compiled(**inputs).loss
        loss.backward()

    step()
    peak = sh.memory.measure_peak(step, device="cpu")
    model.zero_grad(set_to_none=True)
    return peak


@pytest.mark.slow
def test_a_plan_for_a_decoder_with_its_own_loss_meets_its_budget_as_modelled():
    model, inputs = _qwen2()
    planner = sh.planner.Planner(model, inputs, loss_fn=lambda out: out.loss)
    baseline = planner.baseline_bytes
    model.config.use_cache = False  # the no-hook step as a plan trains it
    measured = _measured(model, inputs)
    model.config.use_cache = True
    torch._dynamo.reset()
    assert abs(baseline - measured) <= 0.05 * measured, (baseline, measured)

    budget = (planner.floor_bytes + measured) // 2  # the logits and their gradient set a high floor here
    plan = planner.plan(budget)
    with pytest.warns(UserWarning, match="use_cache=False"):
        plan.apply(model)
    got = _measured(model, inputs, plan.hooks)
    plan.revert(model)
    torch._dynamo.reset()
    assert got <= 1.05 * budget, (got, budget, plan.predicted_peak_bytes)
    assert abs(got - plan.predicted_peak_bytes) <= 0.05 * got, (got, plan.predicted_peak_bytes)


@pytest.mark.slow
def test_a_transformers_model_with_a_graph_break_is_planned_across_its_graphs():
    """ProphetNet as shipped (sizes shrunk by the sweep's builder) breaks its graph where its loss shifts the
    labels (an ``.item()`` assertion): dynamo compiles the step into several graphs, and the plan covers them
    all and meets its budget, checked by measurement."""
    pytest.importorskip("transformers")
    from benchmarks.sweep import select
    from benchmarks.sweep_models import build, loss_of

    (arch,) = select(None, ["seq2seq-lm/prophetnet"], None)
    model, inputs = build(arch)
    assert torch._dynamo.explain(model)(**inputs).graph_break_count >= 1
    torch._dynamo.reset()
    compiled = torch.compile(model)

    def step(hooks=None):
        model.zero_grad(set_to_none=True)
        with sh.saved_tensors_hooks(hooks) if hooks is not None else contextlib.nullcontext():
            loss = loss_of(compiled(**inputs))
        loss.backward()

    step()
    base = sh.memory.measure_peak(step, device="cpu")
    torch._dynamo.reset()
    budget = int(0.8 * base)
    plan = sh.plan(model, inputs, budget_bytes=budget, loss_fn=loss_of)
    assert plan.measured_peak_bytes is not None  # checked by measurement
    plan.apply(model)
    try:
        step(plan.hooks)
        got = sh.memory.measure_peak(lambda: step(plan.hooks), device="cpu")
    finally:
        plan.revert(model)
        model.zero_grad(set_to_none=True)
        torch._dynamo.reset()
    assert got <= 1.05 * budget, (got, budget, plan.predicted_peak_bytes)
