"""Recompute per block: ``torch.utils.checkpoint`` (non-reentrant) on the blocks a plan chooses.

Design notes
------------
* Blocks are the repeated layers of a model: unless named, the children of its
  largest ``nn.ModuleList`` or ``nn.Sequential`` whose children share one class
  (a transformer's layers). A plan recomputes the first ``k`` of them: their activations live
  longest (from early in the forward to late in the backward).
* Checkpointing a block replaces the block instance's ``forward`` with a call
  of ``torch.utils.checkpoint.checkpoint(original forward, use_reentrant=False)``.
  The module tree, ``state_dict`` keys and hooks are unchanged; under
  ``torch.compile`` dynamo traces the call as its activation-checkpoint
  higher-order op and the partitioner recomputes the block in the backward
  (torch's mechanism; nothing of ours recomputes). :func:`restore_blocks`
  undoes it.
* The time a recompute costs is the block's forward, timed in eager mode in
  one no-grad forward of the whole model (forward pre- and post-hooks; the
  least of three forwards). Eager time is an upper bound of the compiled
  recompute, which inductor fuses.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from savedhooks.fidelity.sensitivity import call_model

__all__ = ["block_seconds", "checkpoint_blocks", "checkpointed", "find_blocks", "resolve_blocks", "restore_blocks"]

_ORIGINAL = "_savedhooks_forward"  # attribute of a checkpointed block: its forward before


def find_blocks(model: torch.nn.Module) -> tuple[str, ...]:
    """The module paths of a model's repeated blocks: the children of its largest list of modules of one class.

    Args:
        model: the module.

    Returns:
        The paths (``"transformer.h.0"``, ...) in order: the children of the
        ``nn.ModuleList`` or ``nn.Sequential`` (the model itself included) of at
        least two modules, all of one class, with the most parameters; empty if
        there is none.

    Raises:
        TypeError: ``model`` is not a module.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"find_blocks: model must be a torch.nn.Module, got {type(model).__name__}")
    best: tuple[int, str, torch.nn.Module] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)) or len(module) < 2:
            continue
        if len({type(child) for child in module}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if best is None or size > best[0]:
            best = (size, name, module)
    if best is None:
        return ()
    _, name, module = best
    return tuple(f"{name}.{i}" if name else str(i) for i in range(len(module)))


def resolve_blocks(model: torch.nn.Module, paths: Sequence[str]) -> list[torch.nn.Module]:
    """The submodules at ``paths``, every path checked before any is used.

    Args:
        model: the module holding the blocks.
        paths: module paths relative to ``model``.

    Returns:
        The blocks, in the order of ``paths``.

    Raises:
        ValueError: a path names no submodule.
    """
    blocks = []
    for path in paths:
        try:
            blocks.append(model.get_submodule(path))
        except AttributeError as error:
            raise ValueError(f"recompute: the model has no submodule {path!r}") from error
    return blocks


def checkpoint_blocks(model: torch.nn.Module, paths: Sequence[str]) -> None:
    """Recompute the named blocks in the backward (``torch.utils.checkpoint``, non-reentrant).

    Idempotent: a block already checkpointed stays checkpointed once.

    Args:
        model: the module holding the blocks.
        paths: module paths relative to ``model``.

    Returns:
        None.

    Raises:
        ValueError: a path names no submodule.
    """
    blocks = resolve_blocks(model, paths)  # every path checked before any block changes
    for block in blocks:
        if _ORIGINAL in vars(block):
            continue
        original = block.forward
        setattr(block, _ORIGINAL, original)
        block.forward = functools.partial(checkpoint, original, use_reentrant=False)


def restore_blocks(model: torch.nn.Module, paths: Sequence[str] | None = None) -> None:
    """Undo :func:`checkpoint_blocks` on the named blocks (default: every block of the model).

    Args:
        model: the module holding the blocks.
        paths: module paths relative to ``model``; ``None``: all submodules.

    Returns:
        None.

    Raises:
        ValueError: a path names no submodule.
    """
    blocks = model.modules() if paths is None else resolve_blocks(model, paths)
    for block in blocks:
        if _ORIGINAL in vars(block):
            del block.forward
            delattr(block, _ORIGINAL)


@contextlib.contextmanager
def checkpointed(model: torch.nn.Module, paths: Sequence[str]) -> Iterator[None]:
    """:func:`checkpoint_blocks` for the duration of a ``with`` block (those it checkpointed are restored after).

    Args:
        model: the module holding the blocks.
        paths: module paths relative to ``model``.

    Returns:
        A context manager.

    Raises:
        ValueError: a path names no submodule.
    """
    fresh = [path for path, block in zip(paths, resolve_blocks(model, paths)) if _ORIGINAL not in vars(block)]
    checkpoint_blocks(model, fresh)
    try:
        yield
    finally:
        restore_blocks(model, fresh)


def block_seconds(model: torch.nn.Module, example_inputs: Any, paths: Sequence[str], repeats: int = 3) -> tuple[float, ...]:
    """Each block's forward time (eager, no grad), the least over ``repeats`` forwards of the whole model.

    Args:
        model: the module.
        example_inputs: as for :func:`savedhooks.plan`.
        paths: the blocks' module paths.
        repeats: forwards to take the least of.

    Returns:
        Seconds per block, in the order of ``paths``.

    Raises:
        ValueError: a path names no submodule, or ``repeats`` < 1.
        RuntimeError: a block did not run in the forward.
    """
    if repeats < 1:
        raise ValueError(f"block_seconds: repeats must be >= 1, got {repeats}")
    blocks = resolve_blocks(model, paths)
    best = [float("inf")] * len(blocks)
    starts: dict[int, float] = {}

    cuda = any(p.is_cuda for p in model.parameters())

    def now() -> float:
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def pre(i: int) -> Callable[..., None]:
        return lambda *_: starts.__setitem__(i, now())

    def post(i: int) -> Callable[..., None]:
        return lambda *_: best.__setitem__(i, min(best[i], now() - starts.pop(i)))

    handles = [h for i, b in enumerate(blocks) for h in (b.register_forward_pre_hook(pre(i)),
                                                          b.register_forward_hook(post(i)))]
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            for _ in range(repeats):
                call_model(model, example_inputs)
    finally:
        for handle in handles:
            handle.remove()
    missing = [path for path, seconds in zip(paths, best) if seconds == float("inf")]
    if missing:
        raise RuntimeError(f"block_seconds: blocks {missing} did not run in the model's forward")
    return tuple(best)
