"""Train a transformers decoder under ``transformers.Trainer`` with ``sh.policy()`` packing its saved tensors.

Tiny sizes and a corpus Python ships (byte tokens of a standard-library module's
source): nothing is downloaded. ``python docs/examples/trainer_policy.py --steps 20 --compile``.
"""

import argparse
import inspect
import tempfile
import textwrap

import torch
import transformers

import savedhooks as sh
from savedhooks.integrations.transformers import SavedHooksTrainer


def byte_dataset(seq: int = 128, rows: int = 64) -> list[dict[str, torch.Tensor]]:
    """Windows of byte tokens (0..255) from the source of ``textwrap``, as causal-LM rows (labels = inputs)."""
    data = torch.tensor(list(inspect.getsource(textwrap).encode()), dtype=torch.long)
    starts = torch.randint(0, len(data) - seq, (rows,), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": data[s : s + seq], "labels": data[s : s + seq]} for s in starts.tolist()]


def tiny_llama() -> transformers.PreTrainedModel:
    """Llama from its default config with only the sizes shrunk (byte vocabulary)."""
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256)  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="TrainingArguments(torch_compile=True)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as out:
        training = transformers.TrainingArguments(
            output_dir=out, max_steps=args.steps, per_device_train_batch_size=4, gradient_accumulation_steps=2,
            learning_rate=1e-3, torch_compile=args.compile, use_cpu=not torch.cuda.is_available(),
            report_to=[], save_strategy="no", disable_tqdm=True,
        )  # fmt: skip
        trainer = SavedHooksTrainer(
            model=tiny_llama(), args=training, train_dataset=byte_dataset(), savedhooks=sh.policy()
        )
        loss = trainer.train().training_loss
    print(f"trained {args.steps} steps with sh.policy(): mean loss {loss:.4f}")
    return loss


if __name__ == "__main__":
    main()
