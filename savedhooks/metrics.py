"""Error metrics shared by tests and benchmarks."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

__all__ = ["sqnr", "worst_sqnr"]

# A reference gradient whose norm is under this fraction of the largest one is
# mathematically zero (an attention key bias, which softmax ignores; a bias before
# batch norm): its SQNR would compare rounding noise with rounding noise.
NOISE_FLOOR = 1e-5


def sqnr(reference: torch.Tensor, approximation: torch.Tensor, dim: int | None = None) -> float | torch.Tensor:
    """Signal-to-quantization-noise ratio in dB: ``10 log10(sum ref^2 / sum (ref - approx)^2)``.

    Args:
        reference: the exact values.
        approximation: the values to judge, same shape.
        dim: if given, one SQNR per slice along ``dim`` (e.g. per row, so that
            rows of small magnitude count as much as large ones).

    Returns:
        A float (or a float64 tensor with ``dim``); ``inf`` when the two are
        equal, ``-inf`` when the reference is all zeros and they differ or
        the error is infinite, NaN when the error is NaN.

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
    if math.isnan(e):
        return math.nan
    if e == 0:
        return math.inf
    return 10 * math.log10(s / e) if s > 0 and s / e > 0 else -math.inf


def worst_sqnr(
    reference: Mapping[str, torch.Tensor | None],
    approximation: Mapping[str, torch.Tensor | None],
    noise_floor: float = NOISE_FLOOR,
) -> tuple[float, str | None]:
    """Lowest SQNR over named tensors (parameter gradients), skipping those that are rounding noise.

    Args:
        reference: exact values by name (None: no gradient, skipped).
        approximation: the values to judge, by the same names.
        noise_floor: a reference whose norm is at most this fraction of the
            largest reference norm is skipped (its true value is zero).

    Returns:
        ``(dB, name)`` of the worst tensor; NaN (a gradient with a NaN or an
        infinity where the reference is finite) is worse than any figure;
        ``(inf, None)`` when every one is skipped.

    Raises:
        ValueError: a reference that is not skipped has no approximation, or the
            shapes differ.
    """
    norms = {name: float(ref.double().norm()) for name, ref in reference.items() if ref is not None}
    largest = max(norms.values(), default=0.0)
    worst, worst_name = math.inf, None
    for name, norm in norms.items():
        if norm <= noise_floor * largest:
            continue
        approx = approximation.get(name)
        if approx is None:
            raise ValueError(f"worst_sqnr: {name!r} has a reference but no approximation (no gradient?)")
        db = sqnr(reference[name], approx.detach().to(reference[name].device))
        if math.isnan(db):
            return db, name
        if db < worst or worst_name is None:
            worst, worst_name = db, name
    return worst, worst_name
