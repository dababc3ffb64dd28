"""Shared fixtures: the slow and GPU markers, seeds, a fresh dynamo state per test, codec costs kept per session,
a directory all pytest-xdist workers share."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    skip_gpu = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "extended" in item.keywords:  # the extended tier is slow too: the fast tier leaves it out
            item.add_marker(pytest.mark.slow)
        if skip_gpu is not None and "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed_and_reset_dynamo():
    torch.manual_seed(0)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True, scope="session")
def _codec_costs_per_session(tmp_path_factory):
    # sh.plan keeps measured codec costs on disk (savedhooks.planner.costs): not in the user's home
    patch = pytest.MonkeyPatch()
    patch.setenv("SAVEDHOOKS_CACHE_DIR", str(tmp_path_factory.mktemp("savedhooks_cache")))
    yield
    patch.undo()


@pytest.fixture(scope="session")
def shared_tmp_dir(tmp_path_factory, worker_id):
    """A directory that every pytest-xdist worker of this run sees (their common base; without xdist, the base).

    For work that several tests share and that should be done once per run, not once per worker.
    """
    base = tmp_path_factory.getbasetemp()
    return base if worker_id == "master" else base.parent
