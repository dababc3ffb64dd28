"""FSDP2 (``fully_shard``) on two CPU processes, each training under ``sh.saved_tensors_hooks(sh.policy())``.

The script spawns its two ranks itself (gloo on 127.0.0.1, a free port) and
waits for them at most ``--timeout`` seconds. Each rank shards a Llama built
from its config (random init, byte vocabulary; nothing downloaded) per decoder
layer and at the root, and trains a few steps on its own rows of byte tokens;
the hooks are the same one line as in one process. Rank 0 prints the loss
averaged over the ranks. ``python docs/examples/fsdp2.py --steps 10``
(``--compile``: ``torch.compile`` the sharded model).
"""

import argparse
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from quickstart import batches
from torch.distributed.fsdp import fully_shard
from trainer_policy import tiny_llama

import savedhooks as sh

WORLD = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, port: int, steps: int, compile: bool) -> None:
    """One rank: shard the model, train ``steps`` steps under ``sh.policy()``; rank 0 prints the mean loss."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(0)  # the same initial weights on every rank
        model = tiny_llama()
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        step_model = torch.compile(model) if compile else model
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        rows = batches(steps, batch=2 * WORLD, seq=128)  # every rank trains its own half of each batch
        for batch in rows:
            local = {k: v.chunk(WORLD)[rank] for k, v in batch.items()}
            with sh.saved_tensors_hooks(sh.policy()):
                loss = step_model(**local).loss
            loss.backward()  # FSDP2 reduce-scatters the gradients
            optimizer.step()
            optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0:
            print(
                f"trained {steps} steps on {WORLD} ranks (FSDP2) with sh.policy(): mean loss {mean.item() / WORLD:.4f}"
            )
            sys.stdout.flush()
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="torch.compile the sharded model")
    parser.add_argument("--timeout", type=float, default=600, help="seconds to wait for the ranks")
    args = parser.parse_args(argv)
    if not dist.is_available() or not dist.is_gloo_available():
        sys.exit("fsdp2.py: this torch build has no gloo backend")
    context = mp.start_processes(
        rank_main, args=(free_port(), args.steps, args.compile), nprocs=WORLD, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + args.timeout
    while not context.join(timeout=max(deadline - time.monotonic(), 0.1)):  # raises if a rank failed
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            sys.exit(f"fsdp2.py: the ranks did not finish within {args.timeout:.0f} s")


if __name__ == "__main__":
    main()
