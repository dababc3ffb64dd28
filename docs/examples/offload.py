"""``sh.offload()`` on CUDA: the tensors a compiled step saves for backward wait in pinned host memory.

A Llama built from its config (random init, byte vocabulary; nothing
downloaded) trains a few steps compiled with plain ``torch.compile`` under
``sh.saved_tensors_hooks(sh.offload())``; then ``sh.memory.measure_peak``
measures one step (forward and backward) on the GPU with the hooks and without
them. ``sh.offload(sh.fp8())`` packs before the copy. Without a CUDA device the
script says so and exits with code 0. ``python docs/examples/offload.py --steps 20 --seq 1024``.
"""

import argparse
import contextlib

import torch
import transformers
from quickstart import batches

import savedhooks as sh


def main(argv: list[str] | None = None) -> float | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--fp8", action="store_true", help="sh.offload(sh.fp8()): pack in float8, then offload")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("offload.py: no CUDA device; sh.offload() moves saved tensors from a GPU to host memory, skipped")
        return None
    hooks = sh.offload(sh.fp8()) if args.fp8 else sh.offload()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256)  # fmt: skip
    model = transformers.LlamaForCausalLM(config).cuda()
    compiled = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = [{k: v.cuda() for k, v in b.items()} for b in batches(args.steps, args.batch, args.seq)]

    for batch in data:
        with sh.saved_tensors_hooks(hooks):
            loss = compiled(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # gradients stay allocated: the peaks below are activations

    def step(with_hooks: bool) -> None:
        with sh.saved_tensors_hooks(hooks) if with_hooks else contextlib.nullcontext():
            out = compiled(**data[0]).loss
        out.backward()

    step(False)  # compiles the step without hooks before it is measured
    offloaded = sh.memory.measure_peak(step, True, device="cuda")
    plain = sh.memory.measure_peak(step, False, device="cuda")
    mib = 2**20
    print(f"peak of one step on {torch.cuda.get_device_name()}: {offloaded / mib:.2f} MiB with "
          f"sh.offload(), {plain / mib:.2f} MiB without hooks ({offloaded / plain:.2f}x); "
          f"trained {args.steps} steps: last loss {loss.item():.4f}")  # fmt: skip
    return loss.item()


if __name__ == "__main__":
    main()
