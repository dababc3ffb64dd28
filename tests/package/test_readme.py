"""The README's code runs as written."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.slow
def test_readme_hook_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    namespace: dict[str, object] = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    model, compiled, x = namespace["model"], namespace["compiled"], namespace["x"]
    hooked = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    compiled(x).square().mean().backward()
    plain = [p.grad for p in model.parameters()]
    assert any(not torch.equal(h, p) for h, p in zip(hooked, plain))  # the example's hook did something
