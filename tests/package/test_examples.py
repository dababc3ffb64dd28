"""docs/examples: each script runs as a user runs it (tiny sizes, a few steps), and trains."""

import pathlib
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "docs" / "examples"


def figures(pattern: str, stdout: str) -> list[float]:
    """The figures ``pattern`` reads in the script's output (each ``{}`` one number)."""
    match = re.search(pattern.replace("{}", r"([0-9.]+|inf)"), stdout)
    assert match, f"{pattern!r} not in the output: {stdout[-2000:]!r}"
    return [float(g) for g in match.groups()]


def packs_below_no_hooks(stdout: str) -> None:
    packed, plain = figures(r"{} MiB with sh\.\w+\(\), {} MiB without hooks", stdout)
    assert 0 < packed < plain


def plan_meets_its_budget(stdout: str) -> None:
    predicted, budget = figures(r"predicted peak {} MiB, budget {} MiB", stdout)
    assert 0 < predicted <= budget


def gradients_stay_close(stdout: str) -> None:
    eager, compiled = figures(r"eager {} dB, compiled {} dB", stdout)
    assert eager > 40 and compiled > 40  # int8 with one scale per row


def needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("sh.offload() moves saved tensors off a CUDA device: needs one")


def needs_gloo() -> None:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs gloo")


# script -> (extra arguments, what runs before (a skip), what its output must show besides the loss)
EXAMPLE_RUNS = {
    "trainer_policy.py": (["--compile"], None, None),
    "trainer_plan.py": ([], None, None),
    "lora.py": ([], lambda: pytest.importorskip("peft"), None),
    "quickstart.py": ([], None, packs_below_no_hooks),
    "plan_json.py": ([], None, plan_meets_its_budget),
    "custom_hook.py": ([], None, gradients_stay_close),
    "fsdp2.py": (["--timeout", "600"], needs_gloo, None),
    "offload.py": ([], needs_cuda, packs_below_no_hooks),
}


# the extended tier runs these: other tests check their paths more strictly (a compiled Llama from its
# default config with sh.policy() against the same compile without hooks: tests/integrations/test_zoo.py;
# the compiled Trainer with sh.policy(), and with a plan made on its first batch, for a budget or a fraction
# of the modelled peak: tests/integrations/test_trainer.py; a plan read back from JSON:
# tests/planner/test_planner.py)
EXTENDED = ("quickstart.py", "trainer_policy.py", "trainer_plan.py", "plan_json.py")


def _marks(script: str) -> list:
    return [pytest.mark.gpu] if script == "offload.py" else [pytest.mark.extended] if script in EXTENDED else []


@pytest.mark.slow
@pytest.mark.parametrize("script", [pytest.param(s, marks=_marks(s)) for s in EXAMPLE_RUNS])
def test_example_trains(script):
    extra, before, check = EXAMPLE_RUNS[script]
    if before is not None:
        before()
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--steps", "2", *extra],
        check=False,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=EXAMPLES,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (loss,) = figures(r"(?:mean|last) loss {}", out.stdout.strip().splitlines()[-1])
    assert 0 < loss < 6  # byte-level LM from random init: ln 256 = 5.5 at the start
    if check is not None:
        check(out.stdout)


def test_every_example_is_tested():
    assert {p.name for p in EXAMPLES.glob("*.py")} == set(EXAMPLE_RUNS)
