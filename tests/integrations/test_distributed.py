"""FSDP2 and DDP (2 CPU processes, gloo on 127.0.0.1) + torch.compile + savedhooks, against one process.

savedhooks rides on torch's own engines: nothing of ours is distributed. Each
test runs the three configurations of ``tests/distributed_worker.py`` in one
pair of processes, each bounded in CPU time (and all in wall time, against a hang).
"""

from __future__ import annotations

import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import savedhooks as sh
from tests import distributed_worker as worker
from tests.models import POLICY_DB, worst_sqnr

# Each rank's CPU time is bounded (imports included): the test's own cost, which other test
# workers sharing the cores do not change. Wall time only guards against a hang: under that load
# a pair of processes can take twice its CPU time and more.
CPU_BOUND_S = 60
TIMEOUT_S = 300
pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(how: str, out: str, configs: tuple[str, ...] = worker.CONFIGS) -> dict:
    context = mp.start_processes(
        worker.run, args=(2, _free_port(), how, out, configs), nprocs=2, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + TIMEOUT_S
    while not context.join(timeout=max(deadline - time.monotonic(), 0.1)):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{how}: 2 processes did not finish within {TIMEOUT_S} s")
    result = torch.load(out)
    assert max(result["cpu_s"]) < CPU_BOUND_S, f"{how}: CPU seconds per rank {result['cpu_s']}"
    return result


def _one_process(config: str) -> list[torch.Tensor]:
    model, x = worker.model_and_batch()
    worker.step(model, x, worker.hooks_for(config))
    return [p.grad for p in model.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["fsdp2", "ddp"])
def test_two_processes_match_without_hooks_and_one_process(how, tmp_path):
    out = tmp_path / "grads.pt"
    result = _spawn(how, str(out))
    grads, saved = result["grads"], result["saved"]
    # the same setup without hooks: bit-exact for a lossless hook, the policy's fidelity goal for sh.policy()
    for got, want in zip(grads["lossless"], grads["no hooks"], strict=True):
        assert torch.equal(got, want)
    assert worst_sqnr(grads["policy"], grads["no hooks"]) >= POLICY_DB
    # one process on the whole batch: the setup is right (mean over the batch), and the policy meets its goal
    single = _one_process("no hooks")
    for got, want in zip(grads["no hooks"], single, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert worst_sqnr(grads["policy"], single) >= POLICY_DB
    # and packs: float64 doubles exactly what goes through the hooks; the policy removes a part of it (fp8 with
    # its scales keeps 0.28x of a float32 tensor, int8 rows about as much for attention's value; the layer norms'
    # inputs, attention's query, key and output, statistics and small tensors stay as they are: 0.39x measured)
    through_hooks = saved["lossless"] - saved["no hooks"]
    assert through_hooks > 0 and saved["no hooks"] - saved["policy"] >= 0.33 * through_hooks


@pytest.mark.slow
@pytest.mark.parametrize("how", ["fsdp2", "ddp"])
def test_the_ranks_plan_their_step_together_with_checks(how, tmp_path):
    # sh.plan on the wrapped model in every rank (its half of the batch), codecs only, checked on every rank
    # together (rank 0 searches; the checks run in lockstep, as a check per rank would run different numbers
    # of compiled steps and gloo would abort on mismatched collectives under FSDP2), applied and run under
    # torch's engine
    out = tmp_path / "grads.pt"
    result = _spawn(how, str(out), ("no hooks", "planned"))
    grads, saved = result["grads"], result["saved"]
    plans = [sh.Plan.from_json(text) for text in result["plans"]]
    assert plans[0] == plans[1]  # rank 0's plan, on every rank
    plan = plans[0]
    assert plan.floor_bytes <= plan.predicted_peak_bytes <= plan.budget_bytes < plan.baseline_peak_bytes
    assert any(t.choice != "keep" for t in plan.tensors) and not plan.recompute
    assert any(": check 1:" in line for line in plan.log) and "not checked (check=False)" not in plan.log
    # a budget no plan meets: every rank raises, naming the same floor (rank 0's error, sent to the other)
    assert result["floors"][0] == result["floors"][1] > 0
    # a check that raises on rank 1 only: both ranks leave it together, rank 0 keeps the survey's plan
    failing = [sh.Plan.from_json(text) for text in result["failed"]]
    assert failing[0] == failing[1]
    assert any("not checked: CheckFailed" in line and "planted on rank 1" in line for line in failing[0].log)
    assert failing[0].log[-1].endswith("its check failed: the survey's model alone")
    assert worst_sqnr(grads["planned"], grads["no hooks"]) >= POLICY_DB
    assert saved["planned"] < saved["no hooks"]
