"""Checks of the installed torch release, for code that differs between releases."""

from __future__ import annotations

import torch

__all__ = ["is_torch_2_13"]


def is_torch_2_13() -> bool:
    """Whether the installed torch is a 2.13 release.

    Returns:
        True for ``torch.__version__`` 2.13.x (any local suffix).
    """
    return torch.__version__.startswith("2.13.")
