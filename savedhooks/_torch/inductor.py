"""Inductor internals: its config, the custom graph pass type, IR and virtualized graph, compile entry points.

``torch._inductor.config`` (the post-grad pass slot, caches), ``CustomGraphPass``
(the base of a pass inductor keys its cache on), ``ir`` and ``V`` (the graph
being lowered, read at scheduling time) are imported with this module, which
``import savedhooks`` imports (its compilers subclass ``CustomGraphPass``).
``compile_fx``, ``GraphLowering``, inductor's ``memory`` module (its
peak-memory reordering) and ``estimate_roofline_runtime_ms`` are loaded on
first access as attributes of this module (``inductor.compile_fx``), so that
``import savedhooks`` does not import them.
"""

from __future__ import annotations

import sys
from typing import Any

from torch._inductor import config, ir
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.virtualized import V

# also, loaded on first access (module ``__getattr__``): compile_fx, GraphLowering, memory, estimate_roofline_runtime_ms
__all__ = ["CustomGraphPass", "V", "compiling", "config", "ir"]


def __getattr__(name: str) -> Any:
    """Load an entry point of inductor on first access (module ``__getattr__``).

    Args:
        name: ``compile_fx``, ``GraphLowering``, ``memory`` or ``estimate_roofline_runtime_ms``.

    Returns:
        ``torch._inductor.compile_fx.compile_fx``, ``torch._inductor.graph.GraphLowering``,
        the module ``torch._inductor.memory``, or
        ``torch._inductor.fx_passes.overlap_scheduling.estimate_roofline_runtime_ms``
        (None on torch 2.11, which has no such estimate).

    Raises:
        AttributeError: any other name.
    """
    if name == "compile_fx":
        from torch._inductor.compile_fx import compile_fx

        return compile_fx
    if name == "GraphLowering":
        from torch._inductor.graph import GraphLowering

        return GraphLowering
    if name == "memory":
        from torch._inductor import memory

        return memory
    if name == "estimate_roofline_runtime_ms":  # torch 2.12+; None before
        from torch._inductor.fx_passes import overlap_scheduling

        return getattr(overlap_scheduling, "estimate_roofline_runtime_ms", None)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def compiling() -> bool:
    """Whether the caller runs inside inductor's ``compile_fx`` (AOTAutograd called by inductor).

    Walks the call stack from the caller for ``torch._inductor.compile_fx._compile_fx_main``.

    Returns:
        True when inductor's ``_compile_fx_main`` is on the call stack.
    """
    compile_fx = sys.modules.get("torch._inductor.compile_fx")  # never imported: inductor is not compiling
    main = getattr(compile_fx, "_compile_fx_main", None)
    frame = sys._getframe(1)
    while main is not None and frame is not None:
        if frame.f_code is main.__code__:
            return True
        frame = frame.f_back
    return False
