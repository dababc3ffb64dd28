"""Fine-tune a LoRA adapter (PEFT) under ``transformers.Trainer`` with ``sh.policy()``.

The base model is frozen: its layers still save their inputs for the gradients
that reach the adapters, and those activations are what the policy packs (the
frozen weights, saved too, are never packed).
``python docs/examples/lora.py --steps 20`` (tiny sizes; nothing downloaded).
"""

import argparse
import tempfile

import peft
import torch
import transformers
from trainer_policy import byte_dataset, tiny_llama

import savedhooks as sh
from savedhooks.integrations.transformers import SavedHooksTrainer


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="TrainingArguments(torch_compile=True)")
    args = parser.parse_args(argv)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=8, target_modules=targets))
    with tempfile.TemporaryDirectory() as out:
        training = transformers.TrainingArguments(
            output_dir=out, max_steps=args.steps, per_device_train_batch_size=4, learning_rate=1e-3,
            torch_compile=args.compile, use_cpu=not torch.cuda.is_available(), report_to=[],
            save_strategy="no", disable_tqdm=True,
        )  # fmt: skip
        trainer = SavedHooksTrainer(model=model, args=training, train_dataset=byte_dataset(), savedhooks=sh.policy())
        loss = trainer.train().training_loss
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"LoRA ({trainable} trainable parameters) trained {args.steps} steps with sh.policy(): mean loss {loss:.4f}")
    return loss


if __name__ == "__main__":
    main()
