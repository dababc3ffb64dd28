"""Packaging: the kernels folder imports as savedhooks.kernels; the public API is documented."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import pathlib
import subprocess
import sys

import pytest
import torch

import savedhooks
import savedhooks.codecs
import savedhooks.compiler.api
import savedhooks.compiler.input_layout
import savedhooks.compiler.passes
import savedhooks.fidelity
import savedhooks.hostmem
import savedhooks.kernels
import savedhooks.memory
import savedhooks.metrics
import savedhooks.schedule

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_kernels_resolve_to_this_repo_and_never_as_bare_kernels():
    # Run from a neutral directory so the repository root is not on sys.path.
    code = (
        "import importlib.util, savedhooks.kernels as k;"
        "spec = importlib.util.find_spec('kernels');"
        "print(k.__file__); print(spec.origin if spec else None)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, check=True)
    kernels_file, bare = out.stdout.split()
    assert pathlib.Path(kernels_file).resolve() == REPO / "kernels" / "__init__.py"
    # A bare "kernels" is either absent or someone else's, never this folder.
    assert bare == "None" or not pathlib.Path(bare).resolve().is_relative_to(REPO)


def test_every_subpackage_is_in_the_wheel():
    # An editable install finds any folder; a wheel only ships what pyproject lists.
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {"savedhooks." + p.parent.name for p in (REPO / "savedhooks").glob("*/__init__.py")}
    assert folders | {"savedhooks", "savedhooks.kernels"} == set(setuptools["packages"])
    assert set(setuptools["packages"]) - {"savedhooks"} == set(setuptools["package-dir"]) - {"savedhooks"}


def test_public_functions_document_args_returns_raises():
    missing = []
    namespaces = [savedhooks, savedhooks.codecs, savedhooks.fidelity, savedhooks.hostmem, savedhooks.memory,
                  savedhooks.metrics, savedhooks.compiler.passes, savedhooks.compiler.api, savedhooks.compiler.input_layout,
                  savedhooks.planner, savedhooks.schedule]
    kernel_modules = ("fp8", "bitmask", "offload")
    namespaces += [savedhooks.kernels] + [importlib.import_module(f"savedhooks.kernels.{m}") for m in kernel_modules]
    if importlib.util.find_spec("triton") is not None:
        names = ("triton_support", "fp8_triton", "bitmask_triton")
        namespaces += [importlib.import_module(f"savedhooks.kernels.{m}") for m in names]
    for name, obj in [(f"{ns.__name__}.{n}", getattr(ns, n)) for ns in namespaces for n in ns.__all__]:
        if inspect.isfunction(obj) or isinstance(obj, torch.library.CustomOpDef):
            doc = inspect.getdoc(obj) or ""
            missing += [f"{name}: {s}" for s in ("Args:", "Returns:", "Raises:") if s not in doc]
        elif not (inspect.getdoc(obj) or "").strip():
            missing.append(f"{name}: no docstring")
    assert not missing, missing


def test_the_top_level_is_small_with_one_spelling_per_codec():
    from savedhooks.codecs.base import Codec

    assert len(savedhooks.__all__) <= 22, savedhooks.__all__
    assert all(hasattr(savedhooks, name) for name in savedhooks.__all__)
    classes = [name for name, obj in vars(savedhooks).items() if isinstance(obj, type) and issubclass(obj, Codec)]
    assert not classes, f"codec classes at the top level beside their factories: {classes}"
    for factory in ("fp8", "downcast", "bitmask", "offload", "policy"):
        assert isinstance(getattr(savedhooks, factory)(), savedhooks.HookPair)
