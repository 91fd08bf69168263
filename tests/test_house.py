"""The shape of the house: h3engine's layers import only downward, modules stay short, docstrings stay brief.

Read from the source text with `ast` (nothing is imported), so the checks hold on any machine. Each rule names the
modules that break it, so a failure says what to move.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]
PACKAGE = REPOSITORY / "h3engine"

# Lowest first. A module may import modules of its own layer or of lower ones, never of a higher one. A name ending
# in ".*" stands for a package and every module in it; the most specific name that matches a module places it.
LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "h3engine",
        "h3engine.errors",
        "h3engine.request.geometry",
        "h3engine.models.kernels",
        "h3engine.request.limits",
        "h3engine.models.ops.*",
        "h3engine.cli.validation",
        "h3engine.engine.trace",
        "h3engine.cli.validation.compare",
    ),
    ("h3engine.models.*",),
    ("h3engine.checkpoint.*",),
    ("h3engine.models.parallel.*",),
    ("h3engine.models.quantization", "h3engine.memory.*"),
    (
        "h3engine.engine.sampling.*",
        "h3engine.media.*",
        "h3engine.request.*",
        "h3engine.engine.conditioning.*",
        "h3engine.engine.lora.*",
        "h3engine.cli.validation.checkpoint_probe",
        "h3engine.cli.validation.reference",
    ),
    ("h3engine.engine.pipeline",),
    ("h3engine.engine", "h3engine.engine.engine", "h3engine.engine.model_store", "h3engine.engine.options"),
    ("h3engine.runtime.*",),
    ("h3engine.serving.*",),
    ("h3engine.cli.*", "h3engine.__main__"),
)

MAX_MODULE_LINES = 800
MAX_TOP_LEVEL_MODULES = 10  # h3engine/*.py; the rest is grouped by subject into packages
MAX_MODULE_DOCSTRING_LINES = 15


def module_name(path: Path) -> str:
    parts = path.relative_to(REPOSITORY).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> int | None:
    matches = [
        (len(name), index)
        for index, names in enumerate(LAYERS)
        for name in names
        if module == name or (name.endswith(".*") and (module + ".").startswith(name[:-1]))
    ]
    return max(matches)[1] if matches else None


def resolved_import(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module an `import from` names (relative imports resolved against the importing module)."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def h3engine_imports(module: str, path: Path) -> set[str]:
    """Every h3engine module this one imports; `from h3engine.x import y` counts h3engine.x.y when that is a module."""
    known = modules()
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = resolved_import(module, path, node)
            submodules = {f"{target}.{alias.name}" for alias in node.names} & known.keys()
            found.update(submodules or {target})
    return {name for name in found if name == "h3engine" or name.startswith("h3engine.")}


def test_every_module_has_a_layer() -> None:
    unplaced = sorted(name for name in modules() if layer_of(name) is None)
    assert not unplaced, f"modules missing from LAYERS in {__file__}: {unplaced}"


def test_imports_point_only_downward() -> None:
    upward = []
    for module, path in modules().items():
        own = layer_of(module)
        for imported in sorted(h3engine_imports(module, path)):
            target = layer_of(imported)
            if own is not None and target is not None and target > own:
                upward.append(f"{module} (layer {own}) imports {imported} (layer {target})")
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_the_layer_rule_can_fail() -> None:
    """The checker sees an upward import when one is there (a model importing the pipeline)."""
    assert layer_of("h3engine.models.dit") < layer_of("h3engine.engine.pipeline")
    assert layer_of("h3engine.runtime.rank") > layer_of("h3engine.engine")
    tree = ast.parse("from ..engine.pipeline import run_generation\nfrom . import audio_vae\n")
    nodes = [node for node in tree.body if isinstance(node, ast.ImportFrom)]
    path = PACKAGE / "models" / "dit.py"
    assert resolved_import("h3engine.models.dit", path, nodes[0]) == "h3engine.engine.pipeline"
    assert resolved_import("h3engine.models.dit", path, nodes[1]) == "h3engine.models"


def test_the_top_level_holds_few_modules() -> None:
    top = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, f"h3engine/ holds {len(top)} modules at its top level: {top}"


@pytest.mark.parametrize("root", ["h3engine", "ui"])
def test_modules_stay_short(root: str) -> None:
    long = {
        str(path.relative_to(REPOSITORY)): count
        for path in sorted((REPOSITORY / root).rglob("*.py"))
        if (count := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


@pytest.mark.parametrize("root", ["h3engine", "ui", "benchmarks"])
def test_module_docstrings_stay_brief(root: str) -> None:
    long = {}
    for path in sorted((REPOSITORY / root).rglob("*.py")):
        docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False) or ""
        if (count := len(docstring.strip().splitlines())) > MAX_MODULE_DOCSTRING_LINES:
            long[str(path.relative_to(REPOSITORY))] = count
    assert not long, f"module docstrings over {MAX_MODULE_DOCSTRING_LINES} lines: {long}"


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of a module graph (Tarjan's strongly connected components of more than one module, or a
    module importing itself), each sorted, found in a stable order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def module_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of `package` it imports, anywhere in its text: inside functions and under
    TYPE_CHECKING too (an import moved into a function still ties the two modules together)."""
    graph = {}
    for module, path in modules().items():
        if module == package or module.startswith(package + "."):
            imported = h3engine_imports(module, path) - {module, package}
            graph[module] = {name for name in imported if name.startswith(package + ".")}
    return graph


def test_no_import_circle() -> None:
    """No two modules of h3engine import each other, directly or round a loop; imports inside functions and under
    TYPE_CHECKING count (an import moved into a function still ties the two modules together)."""
    cycles = import_cycles(module_graph("h3engine"))
    assert not cycles, f"import circles (move the shared part into a module both import): {cycles}"


def test_the_circle_rule_can_fail() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert import_cycles(graph) == [["a", "b", "c"], ["e"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []
