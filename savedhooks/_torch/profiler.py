"""Whether torch's autograd profiler runs (``torch._C._autograd._profiler_enabled``)."""

from __future__ import annotations

import torch

__all__ = ["profiler_enabled"]


def profiler_enabled() -> bool:
    """Whether a ``torch.profiler`` / ``torch.autograd.profiler`` session is active in this process.

    Returns:
        True while a profiler records.
    """
    return torch._C._autograd._profiler_enabled()
