"""savedhooks under transformers.Trainer (savedhooks.integrations.transformers): hooks, plans, evaluation, imports."""

import dataclasses
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from models import planner_mlp

import savedhooks as sh
from benchmarks.zoo import step_fn as step
from benchmarks.zoo_entries import LORA_TARGETS, ZOO
from savedhooks.codecs.base import Codec
from savedhooks.integrations.transformers import PlanOnFirstBatch, SavedHooksTrainer

MODEL = "llama"  # a zoo decoder, from its default config at the zoo's tiny size


def _same(x):
    return x


def _rows(inputs: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """One step's batch as a dataset of rows (the Trainer collates them back into batches)."""
    return [{k: v[i] for k, v in inputs.items()} for i in range(len(inputs["input_ids"]))]


def _trainer(savedhooks, tmp_path, compiled=True, steps=3, accumulation=2):
    model, inputs = ZOO[MODEL].build("tiny")
    batch = len(inputs["input_ids"])
    rows = _rows(inputs) * (steps * accumulation)
    args = _training_args(tmp_path, batch, steps, accumulation, compiled)
    torch._dynamo.reset()
    return SavedHooksTrainer(model=model, args=args, train_dataset=rows, savedhooks=savedhooks), inputs


def _training_args(tmp_path, batch, steps, accumulation, compiled):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=batch,
        per_device_eval_batch_size=batch,
        gradient_accumulation_steps=accumulation,
        max_steps=steps,
        learning_rate=0.5,
        optim="sgd",  # updates proportional to the gradients: their SQNR is the gradients'
        lr_scheduler_type="constant",
        torch_compile=compiled,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_drop_last=True,
        seed=0,
    )


def _updates(trainer) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    return {n: p.detach() - before[n] for n, p in trainer.model.named_parameters()}, before


def _step_peak(trainer, inputs) -> int:
    """The activation peak of the Trainer's training step on one batch (compiled by a first call)."""
    model = trainer.model_wrapped
    trainer.training_step(model, dict(inputs))
    trainer.model.zero_grad(set_to_none=True)  # the step's gradients count in its peak, as in sh.plan's
    peak = sh.memory.measure_peak(lambda: trainer.training_step(model, dict(inputs)), device="cpu")
    trainer.model.zero_grad(set_to_none=True)
    return peak


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The Trainer without hooks: its parameter updates after 3 optimizer steps and its step's peak."""
    trainer, inputs = _trainer(None, tmp_path_factory.mktemp("plain"))
    updates, _ = _updates(trainer)
    return updates, _step_peak(trainer, inputs)


@pytest.mark.slow
def test_trainer_with_the_policy_packs_every_micro_batch_and_matches_the_updates(reference, tmp_path):
    """torch_compile=True, 2 micro-batches per optimizer step, 3 steps: the updates match the Trainer's
    without hooks at >= 25 dB, and the training step peaks lower."""
    plain_updates, plain_peak = reference
    packs = []

    def counting(x):
        packs.append(x.shape)
        return x

    trainer, inputs = _trainer(sh.policy(), tmp_path)
    updates, _ = _updates(trainer)
    db, name = sh.metrics.worst_sqnr(plain_updates, updates)
    assert db >= 25, name
    peak = _step_peak(trainer, inputs)
    assert peak < 0.9 * plain_peak
    # every micro-batch runs inside the hooks: an eager pair sees each forward's saved tensors
    trainer, _ = _trainer(sh.hooks.make_hook_pair("counting", counting, _same), tmp_path, compiled=False, steps=1)
    trainer.train()
    one_step = len(packs)  # 2 micro-batches
    assert one_step > 0
    packs.clear()
    trainer.args.max_steps = 2
    trainer.train()
    assert len(packs) == 2 * one_step  # 2 steps of 2 micro-batches


@pytest.mark.slow
def test_trainer_with_a_plan_meets_its_budget_and_matches_the_updates(reference, tmp_path):
    """A plan for 0.7x of the Trainer's measured step peak, made on the first batch: the step measures
    <= 1.05x of the budget, the updates match at >= 25 dB, and training ends with the plan reverted."""
    plain_updates, plain_peak = reference
    budget = int(0.7 * plain_peak)
    trainer, inputs = _trainer(PlanOnFirstBatch(budget_bytes=budget), tmp_path)
    updates, _ = _updates(trainer)
    plan = trainer.savedhooks_plan
    assert plan is not None and plan.budget_bytes == budget
    db, name = sh.metrics.worst_sqnr(plain_updates, updates)
    assert db >= 25, name
    assert not sh.planner.recompute.checkpointed_blocks(trainer.model)  # reverted by train()
    peak = _step_peak(trainer, inputs)  # training_step applies the plan again
    assert peak <= 1.05 * budget


def test_evaluation_runs_without_the_hooks(tmp_path):
    """evaluate() and predict() call the model outside the hooks, training_step inside them. Evaluation
    records no graph, so the model carries a probe that does: an op saving a tensor under enable_grad."""
    calls = []

    def pack(x):
        calls.append(x.shape)
        return x

    pair = sh.hooks.make_hook_pair("counting", pack, _same)
    trainer, inputs = _trainer(pair, tmp_path, compiled=False, steps=1)
    leaf = torch.ones(3, requires_grad=True)

    def probe(module, args, kwargs):
        with torch.enable_grad():
            leaf.exp()  # exp saves its output: a pack hook in force is called

    trainer.model.register_forward_pre_hook(probe, with_kwargs=True)
    trainer.eval_dataset = _rows(inputs)
    trainer.train()
    assert calls
    calls.clear()
    trainer.evaluate()
    trainer.predict(_rows(inputs))
    assert not calls
    with sh.saved_tensors_hooks(pair):  # the probe sees hooks that are in force
        trainer.evaluate()
    assert calls


class _WithLoss(torch.nn.Module):
    """The planner tests' MLP returning its loss as a transformers model does when given labels (``outputs[0]``)."""

    def __init__(self):
        super().__init__()
        self.body, _ = planner_mlp()

    def forward(self, x, labels):
        return (torch.nn.functional.mse_loss(self.body(x), labels),)


@pytest.mark.slow
def test_plan_on_first_batch_with_a_fraction_plans_for_that_share_of_the_modelled_peak_without_hooks():
    model = _WithLoss()
    batch = {"x": torch.randn(512, 64), "labels": torch.randn(512, 64)}
    kwargs = {"backend": "aot_eager", "blocks": ()}
    plan = PlanOnFirstBatch(fraction=0.6, plan_kwargs={**kwargs, "check": False}).make(model, batch)
    baseline = sh.planner.Planner(model, batch, loss_fn=lambda out: out[0], **kwargs).baseline_bytes
    assert plan.budget_bytes == int(0.6 * baseline)
    assert 0 < plan.predicted_peak_bytes <= plan.budget_bytes


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "exactly one"),
        ({"budget_bytes": 1, "fraction": 0.5}, "exactly one"),
        ({"fraction": 1.5}, "fraction"),
        ({"budget_bytes": -3}, "budget_bytes"),
        ({"fraction": 0.5, "plan_kwargs": {"budget": 1}}, "budget"),
    ],
)
def test_plan_on_first_batch_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PlanOnFirstBatch(**kwargs)


def test_the_trainer_rejects_what_is_not_hooks(tmp_path):
    model, inputs = ZOO[MODEL].build("tiny")
    args = _training_args(tmp_path, 2, 1, 1, False)
    with pytest.raises(TypeError, match="savedhooks="):
        SavedHooksTrainer(model=model, args=args, train_dataset=_rows(inputs), savedhooks="policy")


@pytest.mark.slow
def test_import_savedhooks_needs_neither_transformers_nor_peft():
    """In a fresh interpreter where importing transformers, accelerate or peft fails, savedhooks imports
    and does not try to."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('transformers', 'accelerate', 'peft'):\n"
        "            raise ImportError('hidden: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import savedhooks, savedhooks.integrations\n"
        "assert not {'transformers', 'accelerate', 'peft'} & set(sys.modules)\n"
        "try:\n"
        "    import savedhooks.integrations.transformers\n"
        "except ImportError as e:\n"
        "    print('integration:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "integration: hidden: transformers" in out.stdout


_PACKED: list[torch.Tensor] = []


@dataclasses.dataclass(frozen=True)
class _Watching(Codec):
    """The policy, recording each saved tensor it packs; it holds in eager mode what the policy holds."""

    inner: Codec = sh.codecs.Policy()

    def codecs(self):
        return self.inner.codecs()

    @property
    def eager_window(self):
        return self.inner.eager_window

    def eager_holds(self, x):
        return self.inner.eager_holds(x)

    def choose(self, x):
        index = self.inner.choose(x)
        if index >= 0:
            _PACKED.append(x)
        return index


@pytest.mark.slow
def test_lora_packs_activations_never_the_frozen_base_weights():
    """A zoo decoder with PEFT LoRA on every projection (base frozen): the policy packs the saved
    activations and none of the frozen weights the base layers save for their input gradients; the step
    peaks below the same LoRA model without hooks, eager and compiled."""
    pytest.importorskip("peft")
    lora, inputs = ZOO["llama-lora"].build("tiny")
    frozen = {p.untyped_storage().data_ptr() for p in lora.parameters() if not p.requires_grad}
    assert len(frozen) > 2 * len(LORA_TARGETS)
    loss_of = ZOO[MODEL].loss_of
    _PACKED.clear()
    step(lora, lora, inputs, loss_of, lambda: sh.saved_tensors_hooks(_Watching().hooks()))()
    assert len(_PACKED) > len(LORA_TARGETS)
    assert not [t.shape for t in _PACKED if t.untyped_storage().data_ptr() in frozen]
    _PACKED.clear()
    lora.zero_grad(set_to_none=True)
    for fn in (lora, torch.compile(lora)):
        torch._dynamo.reset()
        plain = step(fn, lora, inputs, loss_of)
        packed = step(fn, lora, inputs, loss_of, lambda: sh.saved_tensors_hooks(sh.policy()))
        plain(), packed()  # compile both
        lora.zero_grad(set_to_none=True)
        peaks = [sh.memory.measure_peak(s, device="cpu") for s in (plain, lora.zero_grad, packed)]
        assert peaks[2] < 0.8 * peaks[0]
    torch._dynamo.reset()
