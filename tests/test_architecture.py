"""The package's shape as code: imports point one way, few hide inside functions, and no
function runs longer than a screen without saying why.

Layers, lowest first: profile -> plan -> schedule -> simulate -> execute -> strategy ->
app/cli. A module may import its own layer and the ones below it; ``errors``,
``atomic_files``, ``units`` and ``cluster`` sit below every layer, ``models`` and ``data`` (the recipes' Lightning modules)
beside ``strategy``. Function-level imports count as edges too: an import moved into a
function to dodge a cycle is still a cycle. A function longer than a screen, or a module
longer than 600 lines, says in its docstring why it is "long because".
"""
from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_dapple"
LAYERS = ["profile", "plan", "schedule", "simulate", "execute", "strategy", "app", "cli"]
# the rank of each top-level part; equal ranks may import each other's modules
RANK = {"errors": -2, "atomic_files": -2, "units": -2, "cluster": -1, **{name: index for index, name in enumerate(LAYERS)}, "models": 5, "data": 5, "conf": -1}
RANK["cli"] = RANK["app"]
MAX_FUNCTION_IMPORTS = 15
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 600
LONG_REASON = "long because"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _targets(node: ast.AST, name: str, is_package: bool, known: dict[str, Path]) -> list[str]:
    """The package modules an import statement loads."""
    if isinstance(node, ast.Import):
        candidates = [alias.name for alias in node.names]
    else:
        assert isinstance(node, ast.ImportFrom)
        if node.level:
            base = name.split(".") if is_package else name.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        candidates = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module for alias in node.names]
    out = []
    for target in candidates:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            out.append(target)
    return out


class _Walker(ast.NodeVisitor):
    """Imports (module level and inside functions) and function lengths of one module."""

    def __init__(self) -> None:
        self.imports: list[tuple[ast.AST, bool]] = []
        self.functions: list[ast.FunctionDef | ast.AsyncFunctionDef] = []
        self._depth = 0
        self._typing_only = 0

    def visit_If(self, node: ast.If) -> None:
        typing_only = isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
        self._typing_only += typing_only
        self.generic_visit(node)
        self._typing_only -= typing_only

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.functions.append(node)
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_FunctionDef = _function
    visit_AsyncFunctionDef = _function

    def _import(self, node: ast.AST) -> None:
        # imports under TYPE_CHECKING count too: a cycle hidden there is still a cycle
        self.imports.append((node, self._depth > 0 and not self._typing_only))

    visit_Import = _import
    visit_ImportFrom = _import


def _scan() -> tuple[dict[str, set[str]], list[str], list[str]]:
    """(import graph, function-level imports, over-long functions without a reason)."""
    known = _modules()
    graph: dict[str, set[str]] = {name: set() for name in known}
    inner: list[str] = []
    long_ones: list[str] = []
    for name, path in known.items():
        walker = _Walker()
        walker.visit(ast.parse(path.read_text(), filename=str(path)))
        for node, in_function in walker.imports:
            graph[name].update(_targets(node, name, path.name == "__init__.py", known))
            if in_function and name != PACKAGE.name:  # the root loads its exports lazily on purpose
                inner.append(f"{name}:{node.lineno}")
        for function in walker.functions:
            lines = function.end_lineno - function.lineno + 1
            if lines > MAX_FUNCTION_LINES and LONG_REASON not in (ast.get_docstring(function) or ""):
                long_ones.append(f"{name}.{function.name} ({lines} lines)")
    return graph, inner, long_ones


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def _part(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports from a lower layer into a higher one (the package root is exempt: it only
    re-exports the strategy, lazily)."""
    bad = []
    for source, targets in graph.items():
        low = _part(source)
        if low is None:
            continue
        for target in targets:
            high = _part(target)
            if high is not None and RANK.get(high, 99) > RANK.get(low, 99):
                bad.append(f"{source} -> {target}")
    return sorted(bad)


@pytest.fixture(scope="module")
def scanned() -> tuple[dict[str, set[str]], list[str], list[str]]:
    return _scan()


def test_the_checks_see_what_they_look_for() -> None:
    graph = {"lightning_dapple.plan.a": {"lightning_dapple.schedule.b"}, "lightning_dapple.schedule.b": {"lightning_dapple.plan.a"}}
    assert find_cycles(graph) == [["lightning_dapple.plan.a", "lightning_dapple.schedule.b"]]
    assert layer_violations(graph) == ["lightning_dapple.plan.a -> lightning_dapple.schedule.b"]
    assert set(RANK) >= {_part(name) for name in _modules() if _part(name) is not None}, "a new top-level part needs a rank here"


def test_no_import_cycle(scanned: tuple) -> None:
    graph, _, _ = scanned
    assert len(graph) > 50  # the walk found the package
    assert find_cycles(graph) == []


def test_imports_point_down_the_layers(scanned: tuple) -> None:
    graph, _, _ = scanned
    assert layer_violations(graph) == []


def test_few_imports_inside_functions(scanned: tuple) -> None:
    _, inner, _ = scanned
    assert len(inner) <= MAX_FUNCTION_IMPORTS, f"{len(inner)} function-level imports: {inner}"


def test_no_function_longer_than_a_screen_without_a_reason(scanned: tuple) -> None:
    _, _, long_ones = scanned
    assert long_ones == [], f"split these or say in the docstring why they are {LONG_REASON} ...: {long_ones}"


def test_overridden_lightning_hooks_carry_override() -> None:
    """Every method that replaces one of a Lightning base class's (callbacks, data modules,
    LightningModules, strategies, plugins, launchers) is marked ``@override``, as in
    Lightning's own strategies."""
    unmarked = []
    for name, path in _modules().items():
        module = importlib.import_module(name)
        for node in ast.walk(ast.parse(path.read_text())):
            cls = getattr(module, node.name, None) if isinstance(node, ast.ClassDef) else None
            if not inspect.isclass(cls):
                continue
            bases = [base for base in cls.__mro__[1:] if (base.__module__ or "").startswith("lightning.")]
            for item in node.body:
                if not isinstance(item, ast.FunctionDef) or item.name.startswith("__"):
                    continue
                decorators = [ast.unparse(d) for d in item.decorator_list]
                if any(item.name in vars(base) for base in bases) and "override" not in decorators and not any(d.endswith(".setter") for d in decorators):
                    unmarked.append(f"{name}.{node.name}.{item.name}")
    assert unmarked == []


def test_no_module_longer_than_600_lines_without_a_reason() -> None:
    long_ones = []
    for name, path in _modules().items():
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES and LONG_REASON not in (ast.get_docstring(ast.parse(path.read_text())) or ""):
            long_ones.append(f"{name} ({lines} lines)")
    assert long_ones == [], f"split these or say in the module docstring why they are {LONG_REASON} ...: {long_ones}"
