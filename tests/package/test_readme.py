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


@pytest.mark.slow
def test_readme_budget_and_custom_hook_examples_run():
    """Every python block runs in turn, in one namespace, as a reader pastes them."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 3, "README lost its budget or hook example"
    namespace: dict[str, object] = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    namespace["example_inputs"] = (namespace["x"],)
    namespace["loss_fn"] = lambda out: out.square().mean()
    for block in blocks[1:]:
        namespace["model"].zero_grad(set_to_none=True)
        exec(compile(block, "README.md", "exec"), namespace)
    hooked = [p.grad.clone() for p in namespace["model"].parameters()]  # the last block: the bf16 hook
    namespace["model"].zero_grad(set_to_none=True)
    namespace["compiled"](namespace["x"]).square().mean().backward()
    plain = [p.grad for p in namespace["model"].parameters()]
    assert any(not torch.equal(h, p) for h, p in zip(hooked, plain))
    assert type(namespace["plan"]).__name__ == "Plan"
