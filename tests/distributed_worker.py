"""One rank of the 2-process gloo tests (tests/integrations/test_distributed.py): FSDP2 or DDP, compiled, under savedhooks.

Kept out of the test module so that spawned processes import only this file.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

import savedhooks as sh
from tests.models import TransformerBlock, cast_hook, transformer

BATCH, SEQ, DIM = 4, 16, 32
CONFIGS = ("no hooks", "lossless", "policy")


class Net(torch.nn.Module):
    """The test transformer behind a forward of its own.

    Under DDP, dynamo compiles the frames below DDP's forward that are user code;
    ``nn.Sequential.forward`` is torch code and would run eagerly, and with every
    block checkpointed nothing would be compiled at all.
    """

    def __init__(self) -> None:
        super().__init__()
        self.layers = transformer(2, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def model_and_batch() -> tuple[torch.nn.Module, torch.Tensor]:
    """The model every rank and the one-process reference start from, and the whole batch."""
    torch.manual_seed(0)
    return Net(), torch.randn(BATCH, SEQ, DIM)


def loss_of(y: torch.Tensor) -> torch.Tensor:
    """The loss every configuration trains."""
    return y.square().mean()


def hooks_for(config: str) -> sh.HookPair | None:
    """The hooks of a configuration: none, float32 kept as float64 (lossless), or ``sh.policy()``."""
    return {"no hooks": None, "lossless": cast_hook(torch.float64), "policy": sh.policy()}[config]


def step(model: torch.nn.Module, x: torch.Tensor, hooks: sh.HookPair | None) -> int:
    """Compile (aot_eager) and run a step of mean(model(x)^2), then run it twice more measured.

    Returns:
        The bytes the measured forward leaves alive for backward (CPU memory trace
        of the main thread's allocations, :func:`_left_alive`; the least of the two); the gradients in ``.grad`` are the last step's.
    """
    compiled = torch.compile(model, backend="aot_eager")
    losses = []

    def forward() -> None:
        with sh.saved_tensors_hooks(hooks) if hooks is not None else contextlib.nullcontext():
            losses.append(loss_of(compiled(x)))

    forward()  # compiles
    losses.pop().backward()
    saved = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        saved.append(_left_alive(forward))
        losses.pop().backward()
    return min(saved)


# FSDP2's op that all-gathers a module's parameters. Gloo's async work holds the output buffer and may
# let go of it on a worker thread after the forward returns: then a block's parameters would count as held.
_ALL_GATHER = "FSDP::all_gather ("


def _left_alive(fn) -> int:
    """The bytes the calling thread allocates in ``fn`` and still holds when it returns.

    Allocations inside FSDP2's all-gather are left out: they hold parameters in
    transit, not tensors saved for backward.
    """
    nodes = sh.memory.measure.profiled_nodes(fn)
    caller = next(n.start_tid for n in nodes if n.name == sh.memory.measure.CALL_MARK)

    def in_all_gather(node) -> bool:
        while node is not None and not node.name.startswith(_ALL_GATHER):
            node = node.parent
        return node is not None

    kept = [n for n in nodes if not in_all_gather(n)]
    live = sh.memory.measure.traced_bytes(sh.memory.measure.cpu_allocations(kept), caller)
    return live[-1][1] if live else 0


def _wrap(model: torch.nn.Module, how: str) -> torch.nn.Module:
    if how == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for module in list(model.modules()):
        if isinstance(module, TransformerBlock):
            fully_shard(module)
    return fully_shard(model)


def _planner(model: torch.nn.Module, x: torch.Tensor) -> sh.planner.Planner:
    """A planner on the wrapped model, codecs only (``blocks=()``).

    With a block to recompute, the choice between packing and recomputing
    rests on op timings, and a recompute that meets the budget alone packs
    nothing and needs no check; codecs only, every plan below the peak without
    hooks packs, and its check runs on every rank together.
    """
    return sh.planner.Planner(model, (x,), loss_fn=loss_of, backend="aot_eager", blocks=())


def planned_step(model: torch.nn.Module, x: torch.Tensor, how: str) -> tuple[int, sh.Plan, int]:
    """Plan the step on every rank (``sh.planner.Planner`` on the wrapped model), apply the plan, run :func:`step`.

    The budget is halfway between the modelled peak without hooks and the
    planner's floor (:func:`_planner`: codecs only). The plans are checked, on every rank
    together (``savedhooks.planner.lockstep``). Then a budget of one byte,
    which every rank must refuse with the same floor.

    Returns:
        The bytes the measured forward leaves alive for backward, the plan, and
        the floor the one-byte budget's error named.
    """
    planner = _planner(model, x)
    plan = planner.plan((planner.baseline_bytes + planner.floor_bytes) // 2)
    try:
        planner.plan(1)
        floor = 0
    except sh.InfeasibleBudgetError as error:
        floor = error.floor_bytes
    return step(plan.apply(model), x, plan.hooks), plan, floor


def plan_with_a_failing_check(model: torch.nn.Module, x: torch.Tensor, how: str) -> sh.Plan:
    """Plan the same budget as :func:`planned_step`, where the first check raises on rank 1 only, after its step.

    (A check that fails before or inside its step, while the other ranks run
    the step's collectives, cannot be recovered: gloo aborts, or the ranks wait.)

    Returns:
        The plan (every rank must get rank 0's, its check logged as failed on every rank).
    """
    planner = _planner(model, x)
    module = sys.modules["savedhooks.planner.driver"]
    original = module.check_peak

    def fails_once(*args, **kwargs):  # after its step: the memory model cannot read the graphs, say
        module.check_peak = original
        original(*args, **kwargs)
        raise ValueError("planted on rank 1")

    if dist.get_rank() == 1:
        module.check_peak = fails_once
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # rank 0 warns that the check failed; its log says so
            return planner.plan((planner.baseline_bytes + planner.floor_bytes) // 2)
    finally:
        module.check_peak = original


def run(rank: int, world: int, port: int, how: str, out: str, configs: tuple[str, ...] = CONFIGS) -> None:
    """Run every configuration on this rank's half of the batch; rank 0 saves the full gradients to ``out``.

    Args:
        rank: this process's rank.
        world: the number of processes.
        port: a free TCP port on 127.0.0.1 for the rendezvous.
        how: ``"fsdp2"`` (``fully_shard`` per block and at the root) or ``"ddp"``.
        out: where rank 0 writes ``{"grads": {config: [grad per parameter]}, "saved": {config: bytes},
            "plans": [each rank's plan as JSON], "floors": [the floor each rank's error named for a
            budget of one byte], "failed": [each rank's plan, its first check failing on rank 1], "cpu_s":
            [each rank's CPU seconds]}`` (``torch.save``; bytes: what rank 0's forward left alive for
            backward; plans, floors and failed: with the ``"planned"`` configuration).
        configs: from :data:`CONFIGS`, and ``"planned"`` (:func:`planned_step`).

    Returns:
        None.

    Raises:
        Whatever the step raises (the parent sees a non-zero exit).
    """
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # one intra-op thread per rank: the ranks share the machine's cores with the other test workers,
    # and oversubscribed threads can slow a test past its time bound under load
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        base, x = model_and_batch()
        local = x.chunk(world)[rank]
        grads, saved, plans, floors, failed = {}, {}, [None] * world, [None] * world, [None] * world
        for config in configs:
            torch._dynamo.reset()
            model = _wrap(copy.deepcopy(base), how)
            if config == "planned":
                saved[config], plan, floor = planned_step(model, local, how)
                dist.all_gather_object(plans, plan.to_json())
                dist.all_gather_object(floors, floor)
                torch._dynamo.reset()
                failing = plan_with_a_failing_check(_wrap(copy.deepcopy(base), how), local, how)
                dist.all_gather_object(failed, failing.to_json())
            else:
                saved[config] = step(model, local, hooks_for(config))
            full = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in model.parameters()]
            grads[config] = [g.detach().clone() for g in full]
        cpu_s = [None] * world
        dist.all_gather_object(cpu_s, time.process_time())  # this process's CPU seconds, imports included
        if rank == 0:
            result = {"grads": grads, "saved": saved, "plans": plans, "floors": floors, "failed": failed}
            torch.save({**result, "cpu_s": cpu_s}, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()
