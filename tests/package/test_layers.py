"""The package's import graph: layers import downward only, no circles, no hidden imports.

Read from the source (``ast``), not from ``sys.modules``: an import inside a
function counts as much as one at the top of a module.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]

# The layers, lowest first, with the modules each holds (a prefix holds its submodules).
# A module imports only from its own layer or from one listed before it.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("_torch", ("savedhooks._torch",)),
    ("hostmem", ("savedhooks.hostmem",)),
    ("kernels", ("savedhooks.kernels",)),
    ("memory", ("savedhooks.memory",)),
    ("schedule", ("savedhooks.schedule",)),
    ("hooks", ("savedhooks.hooks",)),
    ("codecs", ("savedhooks.codecs",)),
    ("compiler", ("savedhooks.compiler",)),
    ("fidelity", ("savedhooks.metrics", "savedhooks.fidelity")),
    ("planner", ("savedhooks.planner",)),
    ("integrations", ("savedhooks.integrations",)),
    ("api", ("savedhooks",)),
)


@dataclasses.dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    in_function: bool
    commented: bool


def _modules(root: pathlib.Path = REPO) -> dict[str, pathlib.Path]:
    """Dotted name -> file, for savedhooks/."""
    modules = {}
    for path in (root / "savedhooks").rglob("*.py"):
        parts = ["savedhooks", *path.relative_to(root / "savedhooks").with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules: dict[str, pathlib.Path]) -> str | None:
    """The module an import names: ``a.b.c`` is module ``a.b.c``, or a name in ``a.b``."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _edges(modules: dict[str, pathlib.Path]) -> list[Edge]:
    edges = []
    for module, path in modules.items():
        source = path.read_text()
        lines = source.splitlines()
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]

        def visit(node: ast.AST, in_function: bool, module=module, package=package, lines=lines) -> None:
            for child in ast.iter_child_nodes(node):
                inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                names = []
                if isinstance(child, ast.Import):
                    names = [alias.name for alias in child.names]
                elif isinstance(child, ast.ImportFrom):
                    base = child.module or ""
                    if child.level:
                        anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                        base = ".".join([*anchor, *([child.module] if child.module else [])])
                    names = [f"{base}.{alias.name}" for alias in child.names]
                for name in names:
                    if not name.startswith("savedhooks"):
                        continue
                    target = _resolve(name, modules)
                    if target is not None and target != module:
                        text = lines[child.lineno - 1] + (lines[child.lineno - 2] if child.lineno > 1 else "")
                        edges.append(Edge(module, target, child.lineno, in_function, "#" in text))
                visit(child, inside)

        visit(ast.parse(source), False)
    return edges


def _layer(module: str) -> int:
    best, best_length = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_length:
                best, best_length = index, len(prefix)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to tests/package/test_layers.py's LAYERS")
    return best


@pytest.fixture(scope="module")
def graph():
    modules = _modules()
    return modules, _edges(modules)


def test_every_module_has_a_layer(graph):
    modules, _ = graph
    for module in modules:
        _layer(module)


def test_layers_import_downward_only(graph):
    _, edges = graph
    upward = [
        f"{e.source}:{e.line} ({LAYERS[_layer(e.source)][0]}) imports {e.target} ({LAYERS[_layer(e.target)][0]})"
        for e in edges
        if _layer(e.target) > _layer(e.source)
    ]
    assert not upward, "\n".join(upward)


def test_no_import_circles(graph):
    modules, edges = graph
    following: dict[str, set[str]] = {m: set() for m in modules}
    for e in edges:
        following[e.source].add(e.target)
    # a module's package runs its __init__ first: an edge to a.b.c is also one to a.b and a
    for e in edges:
        parts = e.target.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if parent in modules and parent != e.source and not e.source.startswith(parent + "."):
                following[e.source].add(parent)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        stack.append(module)
        for target in sorted(following[module]):
            if state.get(target) == 1:
                return [*stack[stack.index(target) :], target]
            if target not in state and (circle := visit(target)):
                return circle
        stack.pop()
        state[module] = 2
        return None

    for module in sorted(modules):
        if module not in state and (circle := visit(module)):
            pytest.fail("import circle: " + " -> ".join(circle))


def test_imports_inside_functions_say_why(graph):
    _, edges = graph
    silent = [f"{e.source}:{e.line} imports {e.target}" for e in edges if e.in_function and not e.commented]
    assert not silent, (
        "imports of savedhooks modules inside functions, with no comment naming the reason:\n" + "\n".join(silent)
    )


# The planner's driver (survey, search, check, choose) calls its steps; only the entry point and the
# package's __init__ import it, so no step can call back into it.
DRIVER = "savedhooks.planner.driver"
DRIVER_IMPORTERS = {"savedhooks.planner", "savedhooks.planner.api"}


def test_no_planner_step_imports_the_driver(graph):
    _, edges = graph
    inside = [
        f"{e.source}:{e.line} imports {e.target}"
        for e in edges
        if e.target in (DRIVER, "savedhooks.planner.api")
        and e.source.startswith("savedhooks.planner")
        and e.source not in DRIVER_IMPORTERS
    ]
    assert not inside, "planner modules below the driver import it:\n" + "\n".join(inside)
    assert {e.source for e in edges if e.target == DRIVER} & DRIVER_IMPORTERS, "the driver is not where this test looks"


def test_the_package_never_imports_benchmarks_or_tests():
    found = []
    for folder in ("savedhooks",):
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom)
                    else []
                )
                found += [
                    f"{path.relative_to(REPO)}:{node.lineno} {n}"
                    for n in names
                    if n.split(".")[0] in ("benchmarks", "tests")
                ]
    assert not found, "\n".join(found)


def test_the_checks_see_what_they_check(tmp_path):
    """The graph reader finds an upward import inside a function, a circle, and a silent function-level import."""
    (tmp_path / "savedhooks" / "codecs").mkdir(parents=True)
    (tmp_path / "savedhooks" / "compiler").mkdir()
    (tmp_path / "savedhooks" / "__init__.py").write_text("")
    (tmp_path / "savedhooks" / "codecs" / "__init__.py").write_text("from savedhooks.codecs.a import f\n")
    (tmp_path / "savedhooks" / "codecs" / "a.py").write_text("def f():\n    from savedhooks.compiler.api import g\n")
    (tmp_path / "savedhooks" / "compiler" / "__init__.py").write_text("")
    (tmp_path / "savedhooks" / "compiler" / "api.py").write_text("from savedhooks.codecs import f\n")
    modules = _modules(tmp_path)
    edges = _edges(modules)
    assert Edge("savedhooks.codecs.a", "savedhooks.compiler.api", 2, True, False) in edges
    with pytest.raises(
        AssertionError, match=r"savedhooks.codecs.a:2 \(codecs\) imports savedhooks.compiler.api \(compiler\)"
    ):
        test_layers_import_downward_only((modules, edges))
    with pytest.raises(pytest.fail.Exception, match="import circle"):
        test_no_import_circles((modules, edges))
    with pytest.raises(AssertionError, match="savedhooks.codecs.a:2 imports savedhooks.compiler.api"):
        test_imports_inside_functions_say_why((modules, edges))
