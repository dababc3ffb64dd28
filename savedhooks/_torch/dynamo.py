"""Dynamo internals: its config, the compiled-module wrapper type, debugging backends, the tracing context.

``torch._dynamo.config`` (recompile limits, float specialisation),
``torch._dynamo.OptimizedModule`` (what ``torch.compile(module)`` returns),
``torch._dynamo.backends.debugging``'s ``aot_eager`` and ``boxed_nop`` (the
backend savedhooks places hooks in, and the runner it ends with), and
``torch._guards.TracingContext`` (the compile in progress) have no public
spelling in torch 2.13. ``torch.compiler.disable`` and ``torch.compiler.reset``
are public and used directly.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
from typing import Any

import torch
from torch._dynamo import OptimizedModule, config
from torch._dynamo.backends.debugging import aot_eager, boxed_nop
from torch._guards import TracingContext

__all__ = ["HAS_ISOLATE_RECOMPILES", "OptimizedModule", "aot_eager", "boxed_nop", "checkpoint_side_effects_once",
           "config", "graph_breaks", "has_aot_compile", "is_compiled_module", "isolated", "tracing_context"]

# torch.compile(..., isolate_recompiles=True): torch 2.13 and later
HAS_ISOLATE_RECOMPILES = "isolate_recompiles" in inspect.signature(torch.compile).parameters


def checkpoint_side_effects_once() -> contextlib.AbstractContextManager:
    """Let dynamo trace a checkpointed forward that mutates Python state, the mutation run once.

    By default dynamo cannot trace a ``torch.utils.checkpoint`` region whose
    forward mutates an object from outside it (eager checkpointing replays the
    mutation in the recompute; a compiled backward cannot), and breaks the
    graph around the region. transformers' attention layers (with the
    ``kernels`` package, which transformers 5.25 requires) set and reset a
    module-level registry in every forward: without the option each
    checkpointed decoder block splits the compiled model. With
    ``skip_fwd_side_effects_in_bwd_under_checkpoint`` the mutation runs in the
    forward only, as torchtitan compiles its checkpointed blocks.

    Returns:
        The ``torch._dynamo.config`` patch, a context manager; a null context on
        a torch without the option.
    """
    if not hasattr(config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        return contextlib.nullcontext()
    return config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)


def tracing_context() -> TracingContext | None:
    """The tracing context of the compile running on this thread.

    Returns:
        ``torch._guards.TracingContext.try_get()``: the context (which carries
        AOTAutograd's ``fw_metadata`` once it traces), or None outside a compile.
    """
    return TracingContext.try_get()


def is_compiled_module(model: Any) -> bool:
    """Whether a module is ``torch.compile``'s wrapper of one, or was compiled in place by ``.compile()``.

    Args:
        model: a module.

    Returns:
        True for an ``OptimizedModule`` or a module with a compiled call (``Module._compiled_call_impl``).
    """
    return isinstance(model, OptimizedModule) or getattr(model, "_compiled_call_impl", None) is not None


def isolated(module: torch.nn.Module) -> tuple[torch.nn.Module, dict[str, Any]]:
    """A module whose compiled code will be its own, and the ``torch.compile`` arguments that make it so.

    Dynamo keeps compiled code on the code object of the frame it captures (a
    module's ``forward``), shared by every instance of the class, and a copy
    compiled under a setting its guards do not cover (a ``torch._functorch.config``
    patch) would run another copy's code. Where ``torch.compile`` takes
    ``isolate_recompiles`` (torch 2.13+), that is the answer. Before it, the
    module gets an instance-level ``forward`` over a copy of its class's code
    object, which dynamo keys its cache entries on: same code, entries of its own.

    Args:
        module: the module about to be compiled (changed in place before torch 2.13).

    Returns:
        ``(module, kwargs)``: pass ``kwargs`` to ``torch.compile`` with it.
    """
    if HAS_ISOLATE_RECOMPILES:
        return module, {"isolate_recompiles": True}
    forward = type(module).forward
    code = forward.__code__.replace()  # a new code object: its own dynamo cache entries
    copy = types.FunctionType(code, forward.__globals__, forward.__name__, forward.__defaults__, forward.__closure__)
    copy.__kwdefaults__ = forward.__kwdefaults__
    module.forward = types.MethodType(copy, module)
    return module, {}


@functools.cache
def has_aot_compile() -> bool:
    """Whether a ``torch.compile``'d function can be precompiled with its ``aot_compile`` method (torch 2.12+).

    Returns:
        True where the compiled function has ``aot_compile``.
    """
    return hasattr(torch.compile(lambda x: x), "aot_compile")


@contextlib.contextmanager
def graph_breaks():
    """Collect the graph breaks dynamo meets inside the block: the first line of each reason, once each.

    Reads dynamo's ``counters["graph_break"]`` (cumulative over the process)
    before and after the block.

    Yields:
        A list, filled when the block ends.
    """
    from torch._dynamo.utils import counters

    before = dict(counters["graph_break"])
    reasons: list[str] = []
    try:
        yield reasons
    finally:
        for reason, count in counters["graph_break"].items():
            if count > before.get(reason, 0):
                lines = [line.strip() for line in str(reason).strip().splitlines() if line.strip()]
                reasons.append(lines[0] if lines else "")

