"""The three-line usage on a transformers decoder: ``sh.policy()`` packs what the compiled step saves for backward.

A Llama built from its config (random init, byte vocabulary; nothing
downloaded) trains a few steps on byte tokens of a standard-library module's
source, compiled with plain ``torch.compile``, its saved tensors packed by
``sh.policy()``. Then ``sh.memory.measure_peak`` measures one training step
(forward and backward) with the hooks and without them, and the script prints
both peaks and the last loss. ``python docs/examples/quickstart.py --steps 20``
(on CPU, inductor compiles C++: it needs a compiler).
"""

import argparse
import contextlib
import inspect
import textwrap

import torch
import transformers

import savedhooks as sh


def batches(steps: int, batch: int, seq: int) -> list[dict[str, torch.Tensor]]:
    """Rows of byte tokens (0..255) of the source of ``textwrap``, as causal-LM batches (labels = inputs)."""
    data = torch.tensor(list(inspect.getsource(textwrap).encode()), dtype=torch.long)
    starts = torch.randint(0, len(data) - seq, (steps, batch), generator=torch.Generator().manual_seed(0))
    rows = [torch.stack([data[s : s + seq] for s in row]) for row in starts.tolist()]
    return [{"input_ids": r, "labels": r} for r in rows]


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256)  # fmt: skip
    model = transformers.LlamaForCausalLM(config).to(device)
    compiled = torch.compile(model)  # plain inductor
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = [{k: v.to(device) for k, v in b.items()} for b in batches(args.steps, args.batch, args.seq)]

    for batch in data:
        with sh.saved_tensors_hooks(sh.policy()):  # the three lines: saved activations packed
            loss = compiled(**batch).loss
        loss.backward()  # outside the block is fine
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # gradients stay allocated: the peaks below are activations

    def step(hooks: sh.HookPair | None) -> None:
        with sh.saved_tensors_hooks(hooks) if hooks is not None else contextlib.nullcontext():
            out = compiled(**data[0]).loss
        out.backward()

    step(None)  # compiles the step without hooks before it is measured
    packed = sh.memory.measure_peak(step, sh.policy(), device=device)
    plain = sh.memory.measure_peak(step, None, device=device)
    mib = 2**20
    print(f"peak of one step ({device}): {packed / mib:.2f} MiB with sh.policy(), {plain / mib:.2f} MiB without hooks "
          f"({packed / plain:.2f}x)")  # fmt: skip
    print(f"trained {args.steps} steps with sh.policy(): last loss {loss.item():.4f}")
    return loss.item()


if __name__ == "__main__":
    main()
