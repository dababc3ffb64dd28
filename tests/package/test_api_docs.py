"""docs/api.md is what `python docs/api.py` writes from the docstrings, and every public name has one."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

import savedhooks.codecs

# The page documents savedhooks.integrations.transformers, which imports transformers.
pytest.importorskip("transformers")

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "docs" / "api.py"


@pytest.fixture(scope="module")
def api():
    spec = importlib.util.spec_from_file_location("savedhooks_docs_api", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building the class
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_api_page_is_current_and_every_public_name_has_a_docstring(api):
    assert api.check() == [], "run `python docs/api.py` and document the names listed"


def test_check_reports_a_public_function_without_docstring(api, monkeypatch):
    monkeypatch.setattr(savedhooks.codecs.fp8, "__doc__", None)
    problems = api.check()
    assert "no docstring: savedhooks.codecs.fp8" in problems
    assert "api.md is stale: run `python docs/api.py`" in problems


def test_check_reports_a_stale_page(api, tmp_path):
    page = tmp_path / "api.md"
    page.write_text(api.PAGE.read_text() + "an edit by hand\n")
    assert api.check(page) == ["api.md is stale: run `python docs/api.py`"]
    assert api.main(["--check"]) == 0
