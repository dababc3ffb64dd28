"""docs/examples: each script runs as a user runs it (tiny sizes, a few steps), and trains."""

import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "docs" / "examples"


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, extra",
    [("trainer_policy.py", ["--compile"]), ("trainer_plan.py", []), ("lora.py", [])],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_example_trains(script, extra):
    if script == "lora.py":
        pytest.importorskip("peft")
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--steps", "2", *extra],
        check=False,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=EXAMPLES,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    loss = float(re.search(r"mean loss ([0-9.]+)", out.stdout).group(1))
    assert 0 < loss < 6  # byte-level LM from random init: ln 256 = 5.5 at the start


def test_every_example_is_tested():
    tested = {"trainer_policy.py", "trainer_plan.py", "lora.py"}
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested
