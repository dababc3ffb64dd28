"""What differs between torch releases: the release and bug table, the detected features, the results row."""

from __future__ import annotations

import pathlib

import pytest
import torch

from benchmarks import compat
from savedhooks._torch import dynamo
from savedhooks._torch.version import BUGS, SUPPORTED, has_bug, release, supported


def test_release_reads_major_and_minor_of_any_torch_version_string():
    assert release("2.14.1+cu130") == (2, 14)
    assert release("2.11.0") == (2, 11)
    assert release("2.15.0.dev20261201+cpu") == (2, 15)
    assert release() == tuple(int(p) for p in torch.__version__.split(".")[:2])
    with pytest.raises(ValueError, match="not a torch version"):
        release("nightly")


def test_the_supported_releases_are_2_11_through_2_14_and_the_installed_one_is_among_them():
    assert SUPPORTED == ((2, 11), (2, 14))
    assert [supported(v) for v in ("2.10.0", "2.11.0", "2.12.1", "2.13.0+cpu", "2.14.1+cu130", "2.15.0")] == [
        False, True, True, True, True, False]  # fmt: skip
    assert supported()


def test_a_bug_is_present_before_the_release_that_fixed_it_only():
    assert has_bug("rng_state_names", "2.11.0") and has_bug("rng_state_names", "2.13.0+cpu")
    assert not has_bug("rng_state_names", "2.14.1+cu130")
    assert all(has_bug("dtype_propagation_setup", v) for v in ("2.11.0", "2.14.1"))  # fixed upstream after 2.14
    assert [has_bug("reorder_conv_relu_maxpool", v) for v in ("2.12.0", "2.13.0", "2.14.0")] == [False, True, False]
    with pytest.raises(KeyError, match="unknown torch bug"):
        has_bug("no such bug")


def test_every_bug_names_the_test_that_pins_it():
    for name, bug in BUGS.items():
        path, _, test = bug.pinned_by.partition("::")
        text = pathlib.Path(path).read_text()
        assert not test or f"def {test}(" in text, name
        assert f'"{name}"' in text or path.endswith("test_torchfixes.py"), name


class _Copyable(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.linear(x).relu()


@pytest.mark.parametrize("torch_has_it", [True, False])
def test_isolated_copies_of_one_class_compile_separately(monkeypatch, torch_has_it):
    """With torch's isolate_recompiles or, before torch 2.13, a code object of its own, each copy compiles."""
    if torch_has_it and not dynamo.HAS_ISOLATE_RECOMPILES:
        pytest.skip("this torch has no isolate_recompiles")
    monkeypatch.setattr(dynamo, "HAS_ISOLATE_RECOMPILES", torch_has_it)
    compiled_graphs = []

    def backend(gm, example_inputs):
        compiled_graphs.append(gm)
        return gm.forward

    torch.compiler.reset()
    x = torch.randn(2, 8)
    for _ in range(2):
        module, kwargs = dynamo.isolated(_Copyable())
        assert kwargs == ({"isolate_recompiles": True} if torch_has_it else {})
        torch.compile(module, backend=backend, **kwargs)(x)
    assert len(compiled_graphs) == 2
    compiled_graphs.clear()
    torch.compiler.reset()
    for _ in range(2):  # without it: the second copy runs the first one's code
        torch.compile(_Copyable(), backend=backend)(x)
    assert len(compiled_graphs) == 1


def test_features_are_read_from_the_compatibility_layer(monkeypatch):
    from savedhooks._torch import aot, inductor, offload

    found = compat.features()
    assert list(found) == list(compat.COLUMNS[1:-2])
    monkeypatch.setattr(offload, "HAS_AO_OPS", False)
    monkeypatch.setattr(dynamo, "HAS_ISOLATE_RECOMPILES", False)
    monkeypatch.setattr(aot, "BACKWARD_FREES_GRADIENTS", False)
    monkeypatch.setattr(inductor, "__getattr__", lambda name: None)  # no roofline estimate, as on torch 2.11
    older = compat.features()
    assert older["async offload"] == "synchronous copies" and older["isolated benchmark copies"] == "own code object"
    assert older["backward frees its gradients"].startswith("no") and older["offload timing"] == "nominal"
    present = [name for name, bug in BUGS.items() if bug.present()]
    assert found["torch bugs worked around or pinned"] == (", ".join(present) or "none")


def test_a_release_s_column_replaces_its_own_and_keeps_the_others_in_version_order():
    cells = tuple(f"c{i}" for i in range(len(compat.COLUMNS) - 1))
    text = compat.merge("", compat.Row("2.14.1+cu130", cells), "python -m benchmarks.compat --tests")
    text = compat.merge(text, compat.Row("2.11.0+cu130", cells), "python -m benchmarks.compat")
    text = compat.merge(text, compat.Row("2.14.1+cu130", ("new",) * len(cells)), "python -m benchmarks.compat --tests")
    lines = text.splitlines()
    assert "| torch | 2.11.0+cu130 | 2.14.1+cu130 |" in lines
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| torch |")]
    assert [r.split(" | ")[0] for r in rows] == [f"| {name}" for name in compat.COLUMNS[1:]]
    assert rows[0] == f"| {compat.COLUMNS[1]} | c0 | new |" and rows[-1].endswith("| c9 | new |")
    assert "- torch 2.11.0+cu130: `python -m benchmarks.compat`" in text
    assert "- torch 2.14.1+cu130: `python -m benchmarks.compat --tests`" in text
    assert compat.merge(text, compat.Row("2.14.1+cu130", ("new",) * len(cells)), "python -m benchmarks.compat --tests") == text


def test_the_command_writes_this_torch_s_column_without_running_the_tests(tmp_path, capsys):
    out = tmp_path / "compat.md"
    assert compat.main(["--out", str(out)]) == 0
    text = out.read_text()
    assert f"| torch | {torch.__version__} |" in text and "| not run |" in text
    assert f"- torch {torch.__version__}: `python -m benchmarks.compat --out {out}`" in text
    assert capsys.readouterr().out.startswith(f"| {torch.__version__} |")
