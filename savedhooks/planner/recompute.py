"""Recompute per block: ``torch.utils.checkpoint`` (non-reentrant) on the blocks a plan chooses.

Design notes
------------
* Blocks are the repeated layers of a model: unless named, the children of its
  largest ``nn.ModuleList`` or ``nn.Sequential`` whose children share one class
  (a transformer's layers). A plan recomputes the first ``k`` of them: their activations live
  longest (from early in the forward to late in the backward).
* Checkpointing a block replaces the block instance's ``forward`` with a call
  of ``torch.utils.checkpoint.checkpoint(original forward, use_reentrant=False)``.
  The module tree and ``state_dict`` keys are unchanged (one forward
  pre-hook drops KV cache arguments: :mod:`savedhooks.planner.caches`); under
  ``torch.compile`` dynamo traces the call as its activation-checkpoint
  higher-order op and the partitioner recomputes the block in the backward
  (torch's mechanism; nothing of ours recomputes). :func:`restore_blocks`
  undoes it.
* Two modes. ``"full"``: the block's whole forward is recomputed; only its
  inputs stay saved. ``"selective"``: torch's selective activation
  checkpointing (``create_selective_checkpoint_contexts``) with a policy that
  saves the outputs of matrix products and attention (:data:`SAVED_OPS`:
  costly to recompute, and what the plan's codecs then pack) and recomputes
  the rest (norms, activations, residual adds, attention's elementwise parts):
  cheap to recompute, and often as large. The partitioner honours the policy
  under ``torch.compile``.
* The time a recompute costs is the block's forward, timed in eager mode in
  one no-grad forward of the whole model (forward pre- and post-hooks; the
  least of three forwards); for ``"selective"``, times the share of the block's
  op time that is not in the saved ops (every op timed on its own under a
  dispatch mode, in the same forwards: the share holds when the machine is
  busy, a difference of two timings would not). Eager time is an upper bound
  of the compiled recompute, which inductor fuses.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from savedhooks._torch.ops import TorchDispatchMode
from savedhooks.fidelity.sensitivity import call_model, kept_buffers
from savedhooks.planner.caches import cache_positions, caches_off, without_cache_arguments

__all__ = ["FULL", "MODES", "SAVED_OPS", "SELECTIVE", "block_seconds", "called_modules", "check_mode", "checkpoint_blocks",
           "checkpointed", "checkpointed_blocks", "find_blocks", "resolve_blocks", "restore_blocks", "save_products"]

_ORIGINAL = "_savedhooks_forward"  # attribute of a checkpointed block: its forward before
_CACHE_HOOK = "_savedhooks_cache_hook"  # attribute of a checkpointed block: its pre-hook's handle (_no_cache)
FULL, SELECTIVE = "full", "selective"
MODES = (FULL, SELECTIVE)
_aten = torch.ops.aten
# Ops whose outputs selective recompute saves: matrix products and attention (one packet per op family).
SAVED_OPS = frozenset({
    _aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm, _aten.convolution,
    _aten._scaled_dot_product_flash_attention, _aten._scaled_dot_product_flash_attention_for_cpu,
    _aten._scaled_dot_product_efficient_attention, _aten._scaled_dot_product_cudnn_attention,
})


def save_products(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The selective-checkpointing policy of mode ``"selective"``: save :data:`SAVED_OPS`, recompute the rest.

    Args:
        ctx: torch's ``SelectiveCheckpointContext`` (unused).
        op: the ``OpOverload`` being run.
        *args: its arguments (unused).
        **kwargs: its keyword arguments (unused).

    Returns:
        ``CheckpointPolicy.MUST_SAVE`` for a saved op, else ``PREFER_RECOMPUTE``.
    """
    packet = getattr(op, "overloadpacket", None)
    return CheckpointPolicy.MUST_SAVE if packet in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def check_mode(mode: Any, what: str = "recompute mode") -> None:
    """Raise unless ``mode`` is one of :data:`MODES`.

    Args:
        mode: the value to check.
        what: how the error names it.

    Raises:
        ValueError: ``mode`` is not ``"full"`` or ``"selective"``.
    """
    if mode not in MODES:
        raise ValueError(f"{what} must be one of {MODES}, got {mode!r}")


def find_blocks(model: torch.nn.Module, ran: Collection[torch.nn.Module] | None = None) -> tuple[str, ...]:
    """The module paths of a model's repeated blocks: the children of its largest list of modules of one class.

    Args:
        model: the module.
        ran: the modules a forward of the model called (:func:`called_modules`);
            when given, a list counts only if every one of its children is
            among them (a multimodal model's audio encoder does not run on
            text; a list of lists is never called itself). None: every list
            counts.

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
    for name, module in _block_lists(model):
        if ran is not None and not all(child in ran for child in module):
            continue
        size = sum(p.numel() for p in module.parameters())
        if best is None or size > best[0]:
            best = (size, name, module)
    if best is None:
        return ()
    _, name, module = best
    return tuple(f"{name}.{i}" if name else str(i) for i in range(len(module)))


def _block_lists(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """The model's lists of at least two modules, all of one class, with their paths."""
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)) and len(module) >= 2:
            if len({type(child) for child in module}) == 1:
                yield name, module


@contextlib.contextmanager
def called_modules(model: torch.nn.Module) -> Iterator[set[torch.nn.Module]]:
    """Collect, while open, the children of the model's block lists that a forward calls (see :func:`find_blocks`).

    Args:
        model: the module.

    Yields:
        The set of called modules, filled as the forward runs.
    """
    ran: set[torch.nn.Module] = set()
    children = {child for _, module in _block_lists(model) for child in module}
    handles = [child.register_forward_pre_hook(lambda module, _: ran.add(module)) for child in children]
    try:
        yield ran
    finally:
        for handle in handles:
            handle.remove()


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


def checkpoint_blocks(model: torch.nn.Module, paths: Sequence[str], mode: str = FULL) -> None:
    """Recompute the named blocks in the backward (``torch.utils.checkpoint``, non-reentrant).

    Idempotent: a block already checkpointed stays checkpointed once, in the
    mode it was checkpointed with. A checkpointed block called in train mode
    with grad enabled runs without a KV cache (``use_cache=False``, cache
    arguments None, by keyword or by position: :func:`savedhooks.planner.caches.without_cache_arguments`).

    Args:
        model: the module holding the blocks.
        paths: module paths relative to ``model``.
        mode: ``"full"`` (the whole block) or ``"selective"`` (all but
            :data:`SAVED_OPS`, through torch's selective activation checkpointing).

    Raises:
        ValueError: a path names no submodule, or an unknown ``mode``.
    """
    check_mode(mode)
    blocks = resolve_blocks(model, paths)  # every path checked before any block changes
    keywords: dict[str, Any] = {"use_reentrant": False}
    if mode == SELECTIVE:
        keywords["context_fn"] = functools.partial(create_selective_checkpoint_contexts, save_products)
    for block in blocks:
        if _ORIGINAL in vars(block):
            continue
        original = block.forward
        setattr(block, _ORIGINAL, original)
        block.forward = functools.partial(checkpoint, original, **keywords)
        # outside the checkpoint, like the module's other hooks; the forward stays torch's own frame
        no_cache = functools.partial(_no_cache, positions=cache_positions(original))  # read once, not traced
        setattr(block, _CACHE_HOOK, block.register_forward_pre_hook(no_cache, with_kwargs=True))


def _no_cache(
    block: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], positions: dict[int, str]
) -> Any:
    """A checkpointed block's forward pre-hook: its KV cache arguments dropped when a backward will recompute it.

    Returns the arguments in every case (unchanged ones included): dynamo
    cannot trace an identity test of two tuples, and a graph break here would
    split the compiled model around every checkpointed block.
    """
    return without_cache_arguments(block, args, kwargs, positions)


def checkpointed_blocks(model: torch.nn.Module) -> dict[str, str]:
    """The blocks :func:`checkpoint_blocks` changed (a plan's ``apply``) and not restored, with their modes.

    Args:
        model: a module.

    Returns:
        Module path -> ``"full"`` or ``"selective"``, in module order.
    """
    found = {}
    for path, module in model.named_modules():
        if _ORIGINAL in vars(module):
            keywords = getattr(vars(module).get("forward"), "keywords", {})
            found[path] = SELECTIVE if "context_fn" in keywords else FULL
    return found


def restore_blocks(model: torch.nn.Module, paths: Sequence[str] | None = None) -> None:
    """Undo :func:`checkpoint_blocks` on the named blocks (default: every block of the model).

    Args:
        model: the module holding the blocks.
        paths: module paths relative to ``model``; ``None``: all submodules.

    Raises:
        ValueError: a path names no submodule.
    """
    blocks = model.modules() if paths is None else resolve_blocks(model, paths)
    for block in blocks:
        if _ORIGINAL in vars(block):
            del block.forward
            delattr(block, _ORIGINAL)
            vars(block).pop(_CACHE_HOOK).remove()


@contextlib.contextmanager
def checkpointed(model: torch.nn.Module, paths: Sequence[str], mode: str = FULL) -> Iterator[None]:
    """:func:`checkpoint_blocks` for the duration of a ``with`` block (those it checkpointed are restored after).

    Args:
        model: the module holding the blocks.
        paths: module paths relative to ``model``.
        mode: as for :func:`checkpoint_blocks`.

    Returns:
        A context manager.

    Raises:
        ValueError: a path names no submodule, or an unknown ``mode``.
    """
    check_mode(mode)
    fresh = [path for path, block in zip(paths, resolve_blocks(model, paths)) if _ORIGINAL not in vars(block)]
    checkpoint_blocks(model, fresh, mode)
    try:
        yield
    finally:
        restore_blocks(model, fresh)


def block_seconds(
    model: torch.nn.Module, example_inputs: Any, paths: Sequence[str], repeats: int = 3, mode: str = FULL
) -> tuple[float, ...]:
    """Each block's recompute time: its forward (eager, no grad), the least over ``repeats`` forwards of the model.

    Args:
        model: the module.
        example_inputs: as for :func:`savedhooks.plan`.
        paths: the blocks' module paths.
        repeats: forwards to take the least of.
        mode: ``"full"``: the whole forward; ``"selective"``: its share not
            spent in :data:`SAVED_OPS` (which selective recompute saves).

    Returns:
        Seconds per block, in the order of ``paths``.

    Raises:
        ValueError: a path names no submodule, ``repeats`` < 1, an unknown
            ``mode``, or a block did not run in the forward.
    """
    if repeats < 1:
        raise ValueError(f"block_seconds: repeats must be >= 1, got {repeats}")
    check_mode(mode)
    blocks = resolve_blocks(model, paths)
    cuda = any(p.is_cuda for p in model.parameters())

    def now() -> float:
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    deltas = _block_deltas(model, example_inputs, blocks, repeats, lambda: (now(),), contextlib.nullcontext())
    missing = [path for path, d in zip(paths, deltas) if not d]
    if missing:
        raise ValueError(
            f"block_seconds: blocks {missing} did not run in the model's forward (pass blocks= the blocks it runs)"
        )
    seconds = tuple(min(t for (t,) in d) for d in deltas)
    if mode == FULL:
        return seconds
    # the saved ops' share of each block's op time, both timed op by op in the same forwards
    timer = _OpTimer(now)
    shares = _block_deltas(model, example_inputs, blocks, repeats, lambda: (timer.saved, timer.all), timer)
    return tuple(total * (1 - sum(s for s, _ in d) / max(sum(a for _, a in d), 1e-12))
                 for total, d in zip(seconds, shares))


class _OpTimer(TorchDispatchMode):
    """Adds up the time of each op call, timed on its own: all ops, and those in :data:`SAVED_OPS`."""

    def __init__(self, now: Callable[[], float]) -> None:
        super().__init__()
        self.now, self.saved, self.all = now, 0.0, 0.0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        start = self.now()
        out = func(*args, **(kwargs or {}))
        seconds = self.now() - start
        self.all += seconds
        if func.overloadpacket in SAVED_OPS:
            self.saved += seconds
        return out


def _block_deltas(
    model: torch.nn.Module, example_inputs: Any, blocks: list[torch.nn.Module], repeats: int,
    clock: Callable[[], tuple[float, ...]], mode: contextlib.AbstractContextManager[Any],
) -> list[list[tuple[float, ...]]]:
    """Per block, ``clock``'s advance across its forward in each of ``repeats`` no-grad forwards of the model."""
    deltas: list[list[tuple[float, ...]]] = [[] for _ in blocks]
    starts: dict[int, tuple[float, ...]] = {}

    def pre(i: int) -> Callable[..., None]:
        return lambda *_: starts.__setitem__(i, clock())

    def post(i: int) -> Callable[..., None]:
        return lambda *_: deltas[i].append(tuple(b - a for a, b in zip(starts.pop(i), clock())))

    handles = [h for i, b in enumerate(blocks) for h in (b.register_forward_pre_hook(pre(i)),
                                                          b.register_forward_hook(post(i)))]
    try:
        with torch.no_grad(), kept_buffers(model), caches_off(model), torch.random.fork_rng(devices=[]), mode:
            for _ in range(repeats):
                call_model(model, example_inputs)
    finally:
        for handle in handles:
            handle.remove()
    return deltas
