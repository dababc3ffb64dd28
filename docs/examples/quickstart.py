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

import torch
from trainer_policy import byte_dataset, tiny_llama

import savedhooks as sh


def batches(steps: int, batch: int, seq: int) -> list[dict[str, torch.Tensor]]:
    """``steps`` causal-LM batches of ``batch`` rows of byte tokens (:func:`trainer_policy.byte_dataset`)."""
    rows = byte_dataset(seq, steps * batch)
    return [{k: torch.stack([r[k] for r in rows[i : i + batch]]) for k in rows[0]} for i in range(0, len(rows), batch)]


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = tiny_llama().to(device)  # LlamaConfig's defaults, sizes shrunk
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
