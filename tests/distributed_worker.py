"""One rank of the 2-process gloo tests (tests/test_distributed.py): FSDP2 or DDP, compiled, under savedhooks.

Kept out of the test module so that spawned processes import only this file.
"""

from __future__ import annotations

import contextlib
import copy
import os

import torch
import torch.distributed as dist

import savedhooks as sh
from tests.models import TransformerBlock, cast_hook, transformer

BATCH, SEQ, DIM = 4, 16, 32
CONFIGS = ("no hooks", "lossless", "policy")


def model_and_batch() -> tuple[torch.nn.Module, torch.Tensor]:
    """The model every rank and the one-process reference start from, and the whole batch."""
    torch.manual_seed(0)
    return transformer(2, DIM), torch.randn(BATCH, SEQ, DIM)


def hooks_for(config: str) -> sh.HookPair | None:
    """The hooks of a configuration: none, float32 kept as float64 (lossless), or ``sh.policy()``."""
    return {"no hooks": None, "lossless": cast_hook(torch.float64), "policy": sh.policy()}[config]


def step(model: torch.nn.Module, x: torch.Tensor, hooks: sh.HookPair | None) -> int:
    """Compile (aot_eager) and run a step of mean(model(x)^2), then run it again measured.

    Returns:
        The bytes the measured forward leaves alive for backward (CPU memory trace);
        the gradients in ``.grad`` are the measured step's.
    """
    compiled = torch.compile(model, backend="aot_eager")
    losses = []

    def forward() -> None:
        with sh.saved_tensors_hooks(hooks) if hooks is not None else contextlib.nullcontext():
            losses.append(compiled(x).square().mean())

    forward()  # compiles
    losses.pop().backward()
    model.zero_grad(set_to_none=True)
    saved = sh.memory.cpu_memory_trace(forward)[-1]
    losses.pop().backward()
    return saved


def _wrap(model: torch.nn.Module, how: str) -> torch.nn.Module:
    if how == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for module in model:
        if isinstance(module, TransformerBlock):
            fully_shard(module)
    return fully_shard(model)


def run(rank: int, world: int, port: int, how: str, out: str) -> None:
    """Run every configuration on this rank's half of the batch; rank 0 saves the full gradients to ``out``.

    Args:
        rank: this process's rank.
        world: the number of processes.
        port: a free TCP port on 127.0.0.1 for the rendezvous.
        how: ``"fsdp2"`` (``fully_shard`` per block and at the root) or ``"ddp"``.
        out: where rank 0 writes ``{"grads": {config: [grad per parameter]}, "saved": {config: bytes}}``
            (``torch.save``; bytes: what rank 0's forward left alive for backward).

    Returns:
        None.

    Raises:
        Whatever the step raises (the parent sees a non-zero exit).
    """
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        base, x = model_and_batch()
        local = x.chunk(world)[rank]
        grads, saved = {}, {}
        for config in CONFIGS:
            torch._dynamo.reset()
            model = _wrap(copy.deepcopy(base), how)
            saved[config] = step(model, local, hooks_for(config))
            full = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in model.parameters()]
            grads[config] = [g.detach().clone() for g in full]
        if rank == 0:
            torch.save({"grads": grads, "saved": saved}, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()
