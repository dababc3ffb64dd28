"""What the Triton ops share: when their kernels run, and when AOTAutograd traces into them.

Design notes
------------
* Each ``savedhooks::triton_*`` op is a ``torch.library.triton_op`` whose body
  allocates the outputs and launches ``wrap_triton(kernel)[grid](...)``. On a GPU
  (kernels compiled by Triton) AOTAutograd decomposes the op into its body, so the
  hook graphs hold ``triton_kernel_wrapper_functional`` nodes and inductor treats
  them as user-defined Triton kernels.
* On CPU the op stays one opaque node in the graph (like the aten ops) and runs:
  - the Triton kernels through the interpreter when Triton was imported with
    ``TRITON_INTERPRET=1`` (``triton.jit`` then returns ``InterpretedFunction``s,
    which ``wrap_triton`` cannot trace: they only run on real tensors);
  - otherwise the aten reference (``savedhooks::fp8_quantize`` etc.).
  :func:`as_triton_op` installs that rule for FunctionalTensorMode.
* A triton_op's body is also its fake implementation. On fake tensors, an
  interpreted kernel is not launched (:func:`launch` skips it): the outputs'
  shapes and dtypes are all a fake run needs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.library import triton_op, wrap_triton

from savedhooks._torch.ops import torch_dispatch_rule
from savedhooks._torch.tensors import FakeTensor, FunctionalTensor, FunctionalTensorMode

__all__ = ["as_triton_op", "is_interpreted", "launch", "runs_triton"]


def is_interpreted(kernel: Any) -> bool:
    """Whether ``kernel`` runs in Triton's CPU interpreter (``TRITON_INTERPRET=1`` at import).

    Args:
        kernel: a ``@triton.jit`` function.

    Returns:
        True for an ``InterpretedFunction``.
    """
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def runs_triton(kernel: Any, t: torch.Tensor) -> bool:
    """Whether an op called with ``t`` launches ``kernel`` (else it runs the aten reference).

    Args:
        kernel: any of the op's ``@triton.jit`` kernels.
        t: the op's main tensor argument.

    Returns:
        True on a GPU, and on CPU under the Triton interpreter.
    """
    return t.device.type != "cpu" or is_interpreted(kernel)


def _compiles(kernel: Any, t: torch.Tensor) -> bool:
    return t.device.type != "cpu" and not is_interpreted(kernel)


def _is_fake(t: torch.Tensor) -> bool:
    return isinstance(t, (FakeTensor, FunctionalTensor)) or t.device.type == "meta"


def launch(kernel: Any, grid: tuple[Any, ...], *args: Any, **kwargs: Any) -> None:
    """Launch ``kernel`` through ``wrap_triton`` (traceable), or skip an interpreted one on fake tensors.

    Args:
        kernel: a ``@triton.jit`` function.
        grid: the launch grid.
        *args: kernel arguments.
        **kwargs: kernel arguments (constexprs, ``num_warps``).

    Raises:
        Whatever Triton raises for a bad launch.
    """
    if is_interpreted(kernel) and any(isinstance(a, torch.Tensor) and _is_fake(a) for a in args):
        return
    wrap_triton(kernel)[grid](*args, **kwargs)


def as_triton_op(name: str, fn: Callable[..., Any], kernel: Any) -> Any:
    """Register ``fn`` as ``torch.library.triton_op(name)``, decomposed by AOTAutograd only on a GPU.

    ``triton_op`` decomposes under every FunctionalTensorMode; on CPU that would
    trace the aten fallback (or an interpreted kernel, which cannot be traced)
    into the graph. Elsewhere than a compiling GPU the op stays one node.

    Args:
        name: ``"savedhooks::triton_<op>"``.
        fn: the op's body (allocates, launches through :func:`launch`); also its fake.
        kernel: one of its kernels (tells whether Triton interprets).

    Returns:
        The ``CustomOpDef``, carrying ``fn``'s docstring.

    Raises:
        Whatever ``torch.library.triton_op`` raises (e.g. a name already taken).
    """
    op = triton_op(name, fn, mutates_args=())
    op.__doc__ = fn.__doc__
    decompose: Callable[..., Any] = torch_dispatch_rule(op, FunctionalTensorMode)  # torch's own rule

    def rule(mode, func, types, args, kwargs):
        first = next(a for a in args if isinstance(a, torch.Tensor))
        if _compiles(kernel, first):
            return decompose(mode, func, types, args, kwargs)
        return mode.__torch_dispatch__(func, types, args, kwargs)

    op.register_torch_dispatch(FunctionalTensorMode, rule)
    return op
