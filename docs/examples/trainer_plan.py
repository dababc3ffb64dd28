"""Train under ``transformers.Trainer`` with an ``sh.plan`` for 0.7 of the activation peak, made on the first batch.

``python docs/examples/trainer_plan.py --steps 20 --compile`` (tiny sizes; nothing downloaded).
"""

import argparse
import tempfile

import torch
import transformers
from trainer_policy import byte_dataset, tiny_llama

from savedhooks.integrations.transformers import PlanOnFirstBatch, SavedHooksTrainer


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--fraction", type=float, default=0.7, help="budget over the modelled peak without hooks")
    parser.add_argument("--compile", action="store_true", help="TrainingArguments(torch_compile=True)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as out:
        training = transformers.TrainingArguments(
            output_dir=out, max_steps=args.steps, per_device_train_batch_size=4, learning_rate=1e-3,
            torch_compile=args.compile, use_cpu=not torch.cuda.is_available(), report_to=[],
            save_strategy="no", disable_tqdm=True, dataloader_drop_last=True,  # every batch at the planned shape
        )  # fmt: skip
        trainer = SavedHooksTrainer(
            model=tiny_llama(), args=training, train_dataset=byte_dataset(),
            savedhooks=PlanOnFirstBatch(fraction=args.fraction),
        )  # fmt: skip
        loss = trainer.train().training_loss
    plan = trainer.savedhooks_plan
    print(f"plan: budget {plan.budget_bytes / 2**20:.2f} MiB, predicted {plan.predicted_peak_bytes / 2**20:.2f} MiB, "
          f"recompute {list(plan.recompute)}; trained {args.steps} steps: mean loss {loss:.4f}")  # fmt: skip
    return loss


if __name__ == "__main__":
    main()
