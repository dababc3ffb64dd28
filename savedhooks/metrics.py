"""Error metrics shared by tests and benchmarks."""

from __future__ import annotations

import math

import torch

__all__ = ["sqnr"]


def sqnr(reference: torch.Tensor, approximation: torch.Tensor, dim: int | None = None) -> float | torch.Tensor:
    """Signal-to-quantization-noise ratio in dB: ``10 log10(sum ref^2 / sum (ref - approx)^2)``.

    Args:
        reference: the exact values.
        approximation: the values to judge, same shape.
        dim: if given, one SQNR per slice along ``dim`` (e.g. per row, so that
            rows of small magnitude count as much as large ones).

    Returns:
        A float (or a float64 tensor with ``dim``); ``inf`` when the two are
        equal, ``-inf`` when the reference is all zeros and they differ.

    Raises:
        ValueError: the shapes differ.
    """
    if reference.shape != approximation.shape:
        raise ValueError(f"sqnr: shapes differ, {tuple(reference.shape)} vs {tuple(approximation.shape)}")
    ref = reference.double()
    err = (ref - approximation.double()).pow(2)
    signal = ref.pow(2)
    if dim is not None:
        return 10 * torch.log10(signal.sum(dim) / err.sum(dim))
    s, e = signal.sum().item(), err.sum().item()
    if e == 0:
        return math.inf
    return 10 * math.log10(s / e) if s > 0 else -math.inf
