"""The models the reorder benchmarks and tests share.

An 8-layer MLP and a 4-layer transformer (fp32), with the input shapes used, and
the tests' small CNN. The transformer and CNN come from ``tests/models.py``.
"""

from __future__ import annotations

import functools
import importlib
import pathlib
import sys

import torch

__all__ = ["MODELS", "mlp", "test_models", "transformer4"]


def test_models():
    """The test suite's model module (``tests/models.py``), importable from anywhere in the repo.

    Args:
        None.

    Returns:
        The module.

    Raises:
        ImportError: the repository's ``tests`` folder is missing.
    """
    tests = str(pathlib.Path(__file__).resolve().parent.parent / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    return importlib.import_module("models")


def mlp(depth: int) -> torch.nn.Module:
    """``depth`` Linear(256) + GELU layers and a Linear(256, 1) head, seeded.

    Args:
        depth: number of Linear + GELU layers (at least 1).

    Returns:
        The model.

    Raises:
        ValueError: ``depth`` < 1.
    """
    if depth < 1:
        raise ValueError(f"mlp: depth must be >= 1, got {depth}")
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(256, 256), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(256, 1))


def transformer4() -> torch.nn.Module:
    """Four pre-norm transformer blocks of width 64 (``tests/models.py``), seeded.

    Args:
        None.

    Returns:
        The model.
    """
    torch.manual_seed(0)
    return test_models().transformer(layers=4, dim=64)


MODELS = {"8-layer MLP": (functools.partial(mlp, 8), (2048, 256)), "4-layer transformer": (transformer4, (8, 128, 64))}
