"""Triton kernels and their ``torch.library`` ops, installed as ``savedhooks.kernels``.

The folder sits at the repository's top level but is never importable as a bare
``kernels``: PyPI has an unrelated distribution of that name. pyproject maps this
folder to ``savedhooks.kernels`` (setuptools ``package-dir``).

Modules: ``fp8`` and ``bitmask`` hold the aten references (the spec);
``fp8_inductor`` and ``bitmask`` register the opaque ops ``savedhooks::fp8_quantize``
etc. (``fp8_inductor`` runs large CPU tensors through the reference's compiled
form); ``fp8_triton`` and
``bitmask_triton`` the Triton kernels and their ``triton_op``s
``savedhooks::triton_fp8_quantize`` etc. (imported on demand: Triton is optional);
``fp8_fused`` the decomposed fp8 form (plain aten ops, no custom op) that inductor
fuses into neighbouring kernels.
"""

from __future__ import annotations

import importlib

import torch

__all__ = ["OPS", "kernel_op", "triton_available"]

# Op family -> the modules registering its aten op (``savedhooks::<name>``) and its
# Triton op (``savedhooks::triton_<name>``).
OPS = {
    "fp8_quantize": ("savedhooks.kernels.fp8_inductor", "savedhooks.kernels.fp8_triton"),
    "fp8_dequantize": ("savedhooks.kernels.fp8_inductor", "savedhooks.kernels.fp8_triton"),
    "bitmask_pack": ("savedhooks.kernels.bitmask", "savedhooks.kernels.bitmask_triton"),
    "bitmask_unpack": ("savedhooks.kernels.bitmask", "savedhooks.kernels.bitmask_triton"),
}


_TRITON_FOUND: list[bool] = []  # whether triton imports, once asked


@torch.compiler.assume_constant_result
def triton_available() -> bool:
    """Whether the ``triton`` package imports here.

    Asked once; the answer is kept. Dynamo takes the answer as a constant
    (``torch.compiler.assume_constant_result``) where a hook or codec asks
    under ``torch.compile``: traced through, a ``functools`` cache warns and
    its ``importlib`` call is a graph break.

    Returns:
        True when ``import triton`` succeeds.
    """
    if not _TRITON_FOUND:
        try:
            importlib.import_module("triton")
        except ImportError:
            _TRITON_FOUND.append(False)
        else:
            _TRITON_FOUND.append(True)
    return _TRITON_FOUND[0]


def kernel_op(name: str, use_triton: bool):
    """The op of family ``name``: ``torch.ops.savedhooks.<name>`` (aten) or ``triton_<name>``.

    Args:
        name: one of :data:`OPS` (``"fp8_quantize"``, ...).
        use_triton: pick the Triton op (registering it on first use).

    Returns:
        The ``torch.ops.savedhooks`` op packet.

    Raises:
        KeyError: ``name`` is not a known op family.
        ImportError: ``use_triton`` without the triton package.
    """
    aten_module, triton_module = OPS[name]
    if not use_triton:
        importlib.import_module(aten_module)
        return getattr(torch.ops.savedhooks, name)
    importlib.import_module(triton_module)
    return getattr(torch.ops.savedhooks, "triton_" + name)
