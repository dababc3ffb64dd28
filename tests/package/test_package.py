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
    assert pathlib.Path(kernels_file).resolve() == REPO / "savedhooks" / "kernels" / "__init__.py"
    # A bare "kernels" is either absent or an installed package (a virtual environment may live inside the
    # repository), never a folder of this repository's sources.
    installed = "site-packages" in pathlib.Path(bare).parts
    assert bare == "None" or installed or not pathlib.Path(bare).resolve().is_relative_to(REPO)


def test_every_subpackage_is_in_the_wheel():
    # An editable install finds any folder; a wheel only ships what pyproject lists.
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {"savedhooks." + p.parent.name for p in (REPO / "savedhooks").glob("*/__init__.py")}
    assert folders | {"savedhooks", "savedhooks.kernels"} == set(setuptools["packages"])
    assert set(setuptools["packages"]) - {"savedhooks"} == set(setuptools["package-dir"]) - {"savedhooks"}


def _undocumented(named_objects) -> list[str]:
    """What the docstrings of ``(name, object)`` pairs lack.

    Every object has a docstring; a function documents ``Args:`` where it takes
    arguments and ``Returns:`` (or ``Yields:``) where it returns a value. Nothing
    is required where there is nothing to say (no arguments, a None result,
    nothing raised).
    """
    missing = []
    for name, obj in named_objects:
        doc = inspect.getdoc(obj) or ""
        if not doc.strip():
            missing.append(f"{name}: no docstring")
        elif inspect.isfunction(obj) or isinstance(obj, torch.library.CustomOpDef):
            sig = inspect.signature(obj._init_fn if isinstance(obj, torch.library.CustomOpDef) else obj)
            if [p for p in sig.parameters if p not in ("self", "cls")] and "Args:" not in doc:
                missing.append(f"{name}: Args:")
            returns = sig.return_annotation
            if returns not in (inspect.Signature.empty, None, "None") and not ("Returns:" in doc or "Yields:" in doc):
                missing.append(f"{name}: Returns:")
    return missing


def test_public_functions_document_their_arguments_and_results():
    namespaces = [savedhooks, savedhooks.codecs, savedhooks.fidelity, savedhooks.hostmem, savedhooks.memory,
                  savedhooks.metrics, savedhooks.compiler.passes, savedhooks.compiler.api, savedhooks.compiler.input_layout,
                  savedhooks.planner, savedhooks.schedule]
    kernel_modules = ("fp8", "bitmask", "offload")
    namespaces += [savedhooks.kernels] + [importlib.import_module(f"savedhooks.kernels.{m}") for m in kernel_modules]
    if importlib.util.find_spec("triton") is not None:
        names = ("triton_support", "fp8_triton", "bitmask_triton")
        namespaces += [importlib.import_module(f"savedhooks.kernels.{m}") for m in names]
    missing = _undocumented((f"{ns.__name__}.{n}", getattr(ns, n)) for ns in namespaces for n in ns.__all__)
    assert not missing, missing


def test_the_docstring_check_asks_only_for_what_there_is_to_say():
    def scale(x: float) -> float:
        """Twice ``x``.

        Args:
            x: a number.

        Returns:
            ``2 * x``.
        """
        return 2 * x

    def reset() -> None:
        """Forget the cached values."""

    def log(x: float) -> None:
        """Print ``x``."""

    def double(x: float) -> float:
        """Twice ``x``.

        Args:
            x: a number.
        """
        return 2 * x

    def undocumented() -> None:
        pass

    named = [("scale", scale), ("reset", reset), ("log", log), ("double", double), ("undocumented", undocumented)]
    assert _undocumented(named) == ["log: Args:", "double: Returns:", "undocumented: no docstring"]


def test_the_top_level_is_small_with_one_spelling_per_codec():
    from savedhooks.codecs.base import Codec

    assert len(savedhooks.__all__) <= 22, savedhooks.__all__
    assert all(hasattr(savedhooks, name) for name in savedhooks.__all__)
    classes = [name for name, obj in vars(savedhooks).items() if isinstance(obj, type) and issubclass(obj, Codec)]
    assert not classes, f"codec classes at the top level beside their factories: {classes}"
    for factory in ("fp8", "downcast", "bitmask", "offload", "policy"):
        assert isinstance(getattr(savedhooks, factory)(), savedhooks.HookPair)
