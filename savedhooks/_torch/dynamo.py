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

from typing import Any

from torch._dynamo import OptimizedModule, config
from torch._dynamo.backends.debugging import aot_eager, boxed_nop
from torch._guards import TracingContext

__all__ = ["OptimizedModule", "aot_eager", "boxed_nop", "config", "is_compiled_module", "tracing_context"]


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
