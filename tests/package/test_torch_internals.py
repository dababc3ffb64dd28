"""torch's internals are reached only through ``savedhooks._torch``.

Read from the source (``ast``) of ``savedhooks/``. Outside
``savedhooks/_torch/`` none of these may appear:

* an import of a torch module with a ``_``-prefixed component, or of a
  ``_``-prefixed name from a torch module (``import torch._dynamo``,
  ``from torch.fx.node import _side_effectful_functions``);
* an attribute chain rooted at ``torch`` with a ``_``-prefixed (non-dunder)
  component (``torch._dynamo.config``), except operator names under
  ``torch.ops.<namespace>`` (``torch.ops.aten._to_copy``) and attributes of
  module-level names bound to ``torch.ops...`` (``_aten = torch.ops.aten``);
* ``sys._getframe``;
* a ``_``-prefixed attribute that savedhooks does not define anywhere
  (``tensor._version``, ``op._schema``, ``module._buffers``), read as
  ``obj._name`` or through ``getattr`` / ``hasattr`` with a string, unless
  :data:`FOREIGN_PRIVATES` lists it. A name counts as defined by a ``def``, a
  ``class``, an assignment or attribute store (dataclass fields and
  ``__slots__`` included), an argument, the ``as`` name of an import, or a
  string handed to ``setattr`` / ``delattr`` / ``object.__setattr__``. A
  string read with ``getattr`` defines nothing: it is checked as a read.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
FOLDERS = ("savedhooks",)
COMPAT = "savedhooks/_torch/"  # the package allowed to reach torch's internals


@dataclasses.dataclass(frozen=True)
class ForeignPrivate:
    """A private attribute of a library other than torch that a file may use, and why."""

    path: str
    name: str
    reason: str


FOREIGN_PRIVATES: tuple[ForeignPrivate, ...] = (
    ForeignPrivate(
        "savedhooks/integrations/transformers.py",
        "_prepare_inputs",
        "transformers' Trainer._prepare_inputs: the batch as the Trainer's own step sees it (on its device)",
    ),
)


@dataclasses.dataclass(frozen=True)
class Access:
    """A use of a torch internal (or of an undefined private) outside the compatibility package."""

    path: str
    line: int
    text: str
    rule: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line} {self.text} ({self.rule})"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _sources(root: pathlib.Path = REPO) -> dict[str, ast.Module]:
    """Path relative to ``root`` (``/``-separated) -> parsed module, for every Python file of the package."""
    return {
        path.relative_to(root).as_posix(): ast.parse(path.read_text(), filename=str(path))
        for folder in FOLDERS
        for path in sorted((root / folder).rglob("*.py"))
    }


def _string_constants(tree: ast.Module) -> dict[str, str]:
    """Module-level ``NAME = "text"`` bindings, to read a name handed to ``getattr`` through a constant."""
    constants = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            constants.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
    return constants


def _attribute_string(call: ast.Call, constants: dict[str, str]) -> str | None:
    """The attribute name a ``getattr``-like call names (its second argument), when it is a known string."""
    if len(call.args) < 2:
        return None
    arg = call.args[1]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    return constants.get(arg.id) if isinstance(arg, ast.Name) else None


def _call_name(call: ast.Call) -> str | None:
    """``setattr`` for ``setattr(...)``, ``__setattr__`` for ``object.__setattr__(...)``; else None."""
    if isinstance(call.func, ast.Name):
        return call.func.id
    if isinstance(call.func, ast.Attribute):
        return call.func.attr
    return None


def _defined(trees: dict[str, ast.Module]) -> set[str]:
    """Every name savedhooks defines: defs, classes, stores, arguments, ``as`` names, set attributes."""
    names: set[str] = set()
    for tree in trees.values():
        constants = _string_constants(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
                names.add(node.attr)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Import):
                names.update(a.asname or a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                # a name imported as itself is defined where it comes from (checked there if it is ours)
                names.update(a.asname for a in node.names if a.asname)
            elif isinstance(node, (ast.Global, ast.Nonlocal)):
                names.update(node.names)
            elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets
            ):
                if isinstance(node.value, (ast.Tuple, ast.List)):
                    names.update(e.value for e in node.value.elts if isinstance(e, ast.Constant))
            elif isinstance(node, ast.Call) and _call_name(node) in (
                "setattr",
                "delattr",
                "__setattr__",
                "__delattr__",
            ):
                name = _attribute_string(node, constants)
                if name is not None:
                    names.add(name)
    return names


def _chain(node: ast.Attribute) -> tuple[str | None, list[str]]:
    """``a.b.c`` -> ("a", ["b", "c"]); the root is None when the chain starts at a call, subscript, ..."""
    attrs = []
    value: ast.expr = node
    while isinstance(value, ast.Attribute):
        attrs.append(value.attr)
        value = value.value
    return (value.id if isinstance(value, ast.Name) else None), attrs[::-1]


def _ops_aliases(tree: ast.Module) -> set[str]:
    """Module-level names bound to ``torch.ops`` or a namespace of it (``_aten = torch.ops.aten``)."""
    aliases = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute):
            root, attrs = _chain(node.value)
            if root == "torch" and attrs[:1] == ["ops"]:
                aliases.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return aliases


def _torch_module(name: str) -> bool:
    return name == "torch" or name.startswith("torch.")


def find_accesses(
    trees: dict[str, ast.Module], allowed: tuple[ForeignPrivate, ...] = FOREIGN_PRIVATES
) -> tuple[list[Access], set[ForeignPrivate]]:
    """The uses of torch internals outside ``savedhooks/_torch/``, and the allowlist entries that were needed.

    Args:
        trees: path -> parsed module, as :func:`_sources` returns.
        allowed: the foreign privates each file may use.

    Returns:
        The accesses found (sorted by file and line) and the entries of ``allowed`` that matched one.
    """
    defined = _defined(trees)
    found: list[Access] = []
    used: set[ForeignPrivate] = set()

    def foreign(path: str, line: int, text: str, name: str, rule: str) -> None:
        if name in defined:
            return
        entry = next((a for a in allowed if a.path == path and a.name == name), None)
        if entry is not None:
            used.add(entry)
        else:
            found.append(Access(path, line, text, rule))

    for path, tree in trees.items():
        if path.startswith(COMPAT):
            continue
        aliases = _ops_aliases(tree)
        constants = _string_constants(tree)
        inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if _torch_module(alias.name) and any(_private(p) for p in alias.name.split(".")):
                        found.append(Access(path, node.lineno, f"import {alias.name}", "private torch module"))
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [a.name for a in node.names]
                text = f"from {node.module} import {', '.join(names)}"
                if _torch_module(node.module):
                    if any(_private(p) for p in node.module.split(".")):
                        found.append(Access(path, node.lineno, text, "private torch module"))
                    elif any(_private(n) for n in names):
                        found.append(Access(path, node.lineno, text, "private torch name"))
                elif node.module == "sys" and "_getframe" in names:
                    found.append(Access(path, node.lineno, text, "sys._getframe"))
            elif isinstance(node, ast.Attribute) and id(node) not in inner:
                root, attrs = _chain(node)
                text = ".".join([root or "<expr>", *attrs])
                if root == "torch":
                    if attrs[:1] != ["ops"] and any(_private(a) for a in attrs):
                        found.append(Access(path, node.lineno, text, "private torch attribute"))
                    continue
                if root in aliases:  # operator names of a torch.ops namespace
                    continue
                if root == "sys" and attrs[:1] == ["_getframe"]:
                    found.append(Access(path, node.lineno, text, "sys._getframe"))
                    continue
                # the last name of a store defines it; every other name of the chain is read
                reads = attrs if isinstance(node.ctx, ast.Load) else attrs[:-1]
                for k, attr in enumerate(reads):
                    if _private(attr):
                        shown = ".".join([root or "<expr>", *attrs[: k + 1]])
                        foreign(path, node.lineno, shown, attr, "private attribute savedhooks does not define")
            elif isinstance(node, ast.Call) and _call_name(node) in ("getattr", "hasattr"):
                name = _attribute_string(node, constants)
                if name is not None and _private(name):
                    text = f"{_call_name(node)}(..., {name!r})"
                    foreign(path, node.lineno, text, name, "private attribute savedhooks does not define")
    return sorted(found, key=lambda a: (a.path, a.line, a.text)), used


def test_no_torch_internals_outside_the_compat_package():
    found, _ = find_accesses(_sources())
    assert not found, "torch internals outside savedhooks/_torch/ (add a wrapper there):\n" + "\n".join(map(str, found))


def test_every_allowed_foreign_private_is_still_used():
    _, used = find_accesses(_sources())
    stale = [f"{a.path}: {a.name}" for a in FOREIGN_PRIVATES if a not in used]
    assert not stale, "FOREIGN_PRIVATES entries no longer needed:\n" + "\n".join(stale)


def compat_imports_of_savedhooks(trees: dict[str, ast.Module]) -> list[str]:
    """Imports, in ``savedhooks/_torch/``, of savedhooks modules outside it (relative ones that climb out too).

    Args:
        trees: path -> parsed module, as :func:`_sources` returns.

    Returns:
        ``path:line module`` for each such import.
    """
    found = []
    for path, tree in trees.items():
        if not path.startswith(COMPAT):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                # the package has no subpackages: level 1 stays inside it, a higher level leaves it
                names = (
                    [node.module or ""]
                    if not node.level
                    else ["savedhooks._torch" if node.level == 1 else "savedhooks"]
                )
            else:
                continue
            found += [
                f"{path}:{node.lineno} {n}"
                for n in names
                if n.split(".")[0] == "savedhooks"
                and not (n == "savedhooks._torch" or n.startswith("savedhooks._torch."))
            ]
    return found


def test_the_compat_package_imports_nothing_else_from_savedhooks():
    found = compat_imports_of_savedhooks(_sources())
    assert not found, "savedhooks/_torch/ imports from the rest of savedhooks:\n" + "\n".join(found)


SYNTHETIC = """\
import sys
import torch
import torch._dynamo
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.node import _side_effectful_functions
from sys import _getframe

_aten = torch.ops.aten
SCHEMA = "_schema"


class Mine:
    __slots__ = ("_slot",)

    def __init__(self, t):
        self._mine = 1
        object.__setattr__(self, "_set", 2)
        self._slot = self._mine + self._set


def f(t, op, trainer):
    a = torch._C._autograd._profiler_enabled()
    b = sys._getframe(1)
    c = t._version
    d = getattr(op, "_schema", None)
    e = hasattr(op, SCHEMA)
    g = t.untyped_storage()._cdata
    ok = (_aten._scaled_dot_product_flash_attention.default, torch.ops.aten._to_copy.default, torch.__version__)
    return trainer._prepare_inputs(t), Mine(t)._mine, ok
"""


def test_the_checker_fails_on_each_rule(tmp_path):
    """Each rule finds its case in a synthetic package; the compat package and allowed names pass."""
    for folder in ("savedhooks/_torch", "savedhooks/kernels"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "savedhooks" / "__init__.py").write_text("")
    (tmp_path / "savedhooks" / "_torch" / "__init__.py").write_text(
        "import torch._dynamo\nx = torch._C\ny = x._version\n"
    )
    (tmp_path / "savedhooks" / "a.py").write_text(SYNTHETIC)
    (tmp_path / "savedhooks" / "kernels" / "k.py").write_text("import torch\n\nc = torch._inductor.config\n")
    allowed = (ForeignPrivate("savedhooks/a.py", "_prepare_inputs", "a test"),)
    found, used = find_accesses(_sources(tmp_path), allowed)
    assert [str(a) for a in found] == [
        "savedhooks/a.py:3 import torch._dynamo (private torch module)",
        "savedhooks/a.py:4 from torch._subclasses.fake_tensor import FakeTensor (private torch module)",
        "savedhooks/a.py:5 from torch.fx.node import _side_effectful_functions (private torch name)",
        "savedhooks/a.py:6 from sys import _getframe (sys._getframe)",
        "savedhooks/a.py:22 torch._C._autograd._profiler_enabled (private torch attribute)",
        "savedhooks/a.py:23 sys._getframe (sys._getframe)",
        "savedhooks/a.py:24 t._version (private attribute savedhooks does not define)",
        "savedhooks/a.py:25 getattr(..., '_schema') (private attribute savedhooks does not define)",
        "savedhooks/a.py:26 hasattr(..., '_schema') (private attribute savedhooks does not define)",
        "savedhooks/a.py:27 <expr>._cdata (private attribute savedhooks does not define)",
        "savedhooks/kernels/k.py:3 torch._inductor.config (private torch attribute)",
    ]
    assert used == set(allowed)
    assert compat_imports_of_savedhooks(_sources(tmp_path)) == []
    (tmp_path / "savedhooks" / "_torch" / "b.py").write_text(
        "from savedhooks._torch import x\nfrom . import y\nfrom savedhooks.memory import z\nfrom .. import w\n"
    )
    assert compat_imports_of_savedhooks(_sources(tmp_path)) == [
        "savedhooks/_torch/b.py:3 savedhooks.memory",
        "savedhooks/_torch/b.py:4 savedhooks",
    ]
    # without its allowlist entry, the foreign private is found too
    found, _ = find_accesses(_sources(tmp_path), ())
    assert "savedhooks/a.py:29 trainer._prepare_inputs (private attribute savedhooks does not define)" in map(
        str, found
    )
