"""KV caches off while a plan trains: a recomputed block must not append to a cache a second time.

Design notes
------------
* A transformers decoder built from its shipped config has ``use_cache=True``:
  each layer appends its keys and values to a cache object in the forward. A
  block that :mod:`savedhooks.planner.recompute` checkpoints runs its forward
  again in the backward, appends again, and torch's checkpoint fails (its
  recomputed ops no longer match the saved ones). transformers' own gradient
  checkpointing trains with the cache off; plans do the same.
* The setting lives in the configs the model's modules hold (``module.config``,
  one object shared by most modules, separate copies in encoder-decoder
  stacks). Every config whose ``use_cache`` is true is set to ``False``:
  while the planner runs its steps (:func:`caches_off`), and from
  ``Plan.apply`` to ``Plan.revert`` (:func:`turn_caches_off`,
  :func:`restore_caches`), for every plan, recompute or not. A model trained
  with the cache on also returns each layer's keys and values: forward
  outputs, which the caller may hold to the end of the step, so that packing
  them frees nothing.
* A cache asked for in the call itself (``use_cache=True`` among the keyword
  arguments, a cache object passed to a block by keyword or by position) is
  not a config: a checkpointed
  block called with grad enabled in train mode drops those arguments
  (:func:`without_cache_arguments`), as transformers' checkpointed layers do,
  and the planner refuses example inputs that ask for a cache.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["CACHE_ARGUMENTS", "cache_configs", "cache_positions", "caches_off", "check_no_cache_input", "restore_caches",
           "turn_caches_off", "without_cache_arguments"]

# keyword arguments through which transformers' layers receive a KV cache (names vary by model and release)
CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value", "layer_past")
_TURNED_OFF = "_savedhooks_caches_off"  # attribute of a model: the configs Plan.apply set to use_cache=False


def cache_configs(model: torch.nn.Module) -> list[Any]:
    """The distinct configs held by ``model``'s modules (``module.config``) whose ``use_cache`` is true.

    Args:
        model: a module (a transformers model, or anything holding one).

    Returns:
        The config objects, each once, in module order; empty for a model
        without them.
    """
    found: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "use_cache", False) is True:
            found.setdefault(id(config), config)
    return list(found.values())


@contextlib.contextmanager
def caches_off(model: torch.nn.Module) -> Iterator[None]:
    """``use_cache=False`` on the model's configs for the duration of a ``with`` block (those changed are restored).

    Args:
        model: the module.

    Returns:
        A context manager.

    Raises:
        Nothing (what the block raises passes through, after the configs are restored).
    """
    configs = cache_configs(model)
    for config in configs:
        config.use_cache = False
    try:
        yield
    finally:
        for config in configs:
            config.use_cache = True


def turn_caches_off(model: torch.nn.Module) -> list[Any]:
    """Set ``use_cache=False`` on the model's configs until :func:`restore_caches` (``Plan.apply``).

    Args:
        model: the module.

    Returns:
        The configs changed by this call (empty where none had the cache on).
    """
    configs = cache_configs(model)
    for config in configs:
        config.use_cache = False
    if configs:
        object.__setattr__(model, _TURNED_OFF, (*getattr(model, _TURNED_OFF, ()), *configs))
    return configs


def restore_caches(model: torch.nn.Module) -> None:
    """Undo :func:`turn_caches_off` on ``model`` (nothing where it changed nothing).

    Args:
        model: the module.
    """
    for config in vars(model).pop(_TURNED_OFF, ()):
        config.use_cache = True


def check_no_cache_input(example_inputs: Any, what: str = "plan") -> None:
    """Refuse example inputs that ask the model for a KV cache.

    Args:
        example_inputs: as for :func:`savedhooks.plan`.
        what: how the error names the caller.

    Raises:
        ValueError: ``example_inputs`` is a dict with ``use_cache`` true or a
            cache argument (:data:`CACHE_ARGUMENTS`) that is not None.
    """
    if not isinstance(example_inputs, Mapping):
        return
    asked = [name for name in ("use_cache", *CACHE_ARGUMENTS) if _asks(example_inputs.get(name))]
    if asked:
        raise ValueError(
            f"{what}: example_inputs pass {asked[0]}={example_inputs[asked[0]]!r}: a plan trains without a KV cache "
            "(recomputed blocks would append to it again); leave it out (the plan sets the config's use_cache to "
            "False while it runs) or pass use_cache=False"
        )


def without_cache_arguments(
    block: Any, args: tuple[Any, ...], kwargs: dict[str, Any], positions: Mapping[int, str] | None = None
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A checkpointed block's arguments without a KV cache, when the call records a backward.

    A cache reaches a block by keyword or by position (GPT-2's model passes
    its cache as the block's second positional argument); both are dropped.

    Args:
        block: the block (a module; its ``training`` flag is read).
        args: the positional arguments of its forward call.
        kwargs: the keyword arguments of its forward call.
        positions: which positional arguments are a cache or ``use_cache``
            (:func:`cache_positions` of the block's forward, read once when the
            block is checkpointed: a forward pre-hook runs inside dynamo's
            trace); None: keyword arguments only.

    Returns:
        ``(args, kwargs)`` as given, or copies with ``use_cache=False`` and each
        cache argument (:data:`CACHE_ARGUMENTS`) None, when ``block`` is in train
        mode, grad is enabled (a recompute will run) and the call asks for a
        cache; a call without grad (evaluation, generation) keeps its cache.
    """
    if not (getattr(block, "training", False) and torch.is_grad_enabled()):
        return args, kwargs
    positions = positions or {}
    asked = [i for i, name in positions.items() if i < len(args) and _asks(args[i])]
    if not asked and not any(_asks(kwargs.get(name)) for name in ("use_cache", *CACHE_ARGUMENTS)):
        return args, kwargs
    kept_args = list(args)
    for i in asked:
        kept_args[i] = False if positions[i] == "use_cache" else None
    kept = dict(kwargs)
    if kept.get("use_cache"):
        kept["use_cache"] = False
    for name in CACHE_ARGUMENTS:
        if kept.get(name) is not None:
            kept[name] = None
    return tuple(kept_args), kept


def cache_positions(forward: Callable[..., Any]) -> dict[int, str]:
    """The positions of a forward's parameters named ``use_cache`` or a cache argument (:data:`CACHE_ARGUMENTS`).

    Args:
        forward: a module's bound ``forward`` (its signature, through
            ``functools.wraps``, names the parameters; ``self`` is not among them).

    Returns:
        Position -> parameter name, for the parameters that can be passed by
        position; empty where the forward has no readable signature (a builtin).
    """
    try:
        parameters = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):  # a forward without a signature (a builtin, a C extension)
        return {}
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return {
        i: p.name
        for i, p in enumerate(parameters)
        if p.kind in positional and p.name in ("use_cache", *CACHE_ARGUMENTS)
    }


def _asks(value: Any) -> bool:
    """Whether an argument's value asks for a cache: anything but None and False (a tensor is not compared)."""
    return value is not None and value is not False
