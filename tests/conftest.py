"""Shared fixtures: seeds, a fresh dynamo state per test, and the one GPU marker."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed_and_reset_dynamo():
    torch.manual_seed(0)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
