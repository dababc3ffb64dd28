"""Where a codec's kernels come from: the Triton ops, the aten reference, or the decomposed form inductor fuses."""

from __future__ import annotations

from typing import Any

import torch

from savedhooks.codecs.placement import inductor_compiling
from savedhooks.hooks import hook_context
from savedhooks.kernels import triton_available

__all__ = [
    "BACKENDS",
    "FUSED",
    "check_backend",
    "inductor_traces",
    "kernel_backend",
    "materializes_better",
    "uses_fused",
    "uses_triton",
]

# Where a codec's kernels come from: Triton on CUDA when it imports ("auto"), always
# the Triton ops ("triton"; on CPU they run the aten reference unless Triton
# interprets), or always the aten reference ("aten"). Same bytes either way.
BACKENDS = ("auto", "triton", "aten")
# Codecs with a decomposed form (plain aten ops inductor fuses) also accept "fused";
# "auto" then picks it while a hook is traced for a compiled graph (see uses_fused).
FUSED = "fused"


def check_backend(what: str, backend: Any, fused: bool = False) -> None:
    """Validate a codec's ``backend`` field.

    Args:
        what: the codec's name, for the message.
        backend: the value given.
        fused: the codec has a decomposed form, so ``"fused"`` is valid too.

    Raises:
        ValueError: ``backend`` is not one of :data:`BACKENDS` (or ``"fused"``), or
            is ``"triton"`` without the triton package.
    """
    choices = BACKENDS + ((FUSED,) if fused else ())
    if backend not in choices:
        raise ValueError(f"{what}: backend must be one of {choices}, got {backend!r}")
    if backend == "triton" and not triton_available():
        raise ValueError(f"{what}: backend='triton' needs the triton package; use 'auto' or 'aten'")


def uses_triton(backend: str, x: torch.Tensor) -> bool:
    """Whether a codec with ``backend`` runs the Triton ops for tensors like ``x``.

    Args:
        backend: one of :data:`BACKENDS`.
        x: the tensor to encode, or the payload to decode (its device decides "auto").

    Returns:
        True for ``"triton"``, and for ``"auto"`` on CUDA when triton imports.
    """
    return backend == "triton" or (backend == "auto" and x.device.type == "cuda" and triton_available())


def uses_fused(backend: str, x: torch.Tensor | None = None) -> bool:
    """Whether a codec with ``backend`` uses its decomposed form (plain aten ops) rather than its ops.

    Args:
        backend: one of :data:`BACKENDS` or ``"fused"``.
        x: the tensor to encode (None: decided for a float32 one).

    Returns:
        True for ``"fused"``, and for ``"auto"`` while AOTAutograd traces the hook
        into a graph that inductor compiles (:func:`savedhooks.hook_context` is set
        and inductor's compile is on the call stack): inductor fuses the decomposed
        form into the neighbouring kernels. Elsewhere ``"auto"`` keeps the ops: in
        eager mode and under ``aot_eager`` each aten op of the decomposed form would
        run as a full-size pass with full-size temporaries. One exception, measured:
        ``"auto"`` keeps the ops for a 16-bit floating tensor on the CPU
        (:func:`materializes_better`).
    """
    if backend == FUSED:
        return True
    if backend != "auto" or not inductor_traces():
        return False
    return x is None or not materializes_better(x)


def inductor_traces() -> bool:
    """Whether a hook runs while AOTAutograd traces it into a graph that inductor compiles.

    Returns:
        True when :func:`savedhooks.hook_context` is set and inductor's compile
        is on the call stack.
    """
    return hook_context() is not None and inductor_compiling()


def materializes_better(x: torch.Tensor) -> bool:
    """A 16-bit floating tensor on the CPU: its opaque decode (a materialized bf16/fp16 tensor) peaks lower.

    Under bf16 autocast, inductor fuses the decomposed decode of the benchmark
    cnn's conv outputs into the kernels that recompute batch norm in the backward
    and holds float32 intermediates of the full shape there, which puts the step
    peak above no hooks; with the opaque ops it stays close to no hooks. The mlp,
    gpt2, llama and vit peak about the same either way. The rule covers the CPU
    only: on CUDA the decomposed form stays the default.

    Args:
        x: the tensor to encode (only its dtype and device are read).

    Returns:
        True for a bf16 or fp16 tensor on the CPU.
    """
    return x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16)


def kernel_backend(backend: str) -> str:
    """The kernel backend (one of :data:`BACKENDS`) for a codec without a decomposed form.

    Args:
        backend: a codec's ``backend`` field.

    Returns:
        ``backend``, or ``"auto"`` for ``"fused"``.
    """
    return "auto" if backend == FUSED else backend
