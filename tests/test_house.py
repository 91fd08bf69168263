"""The shape of the house: h3engine's layers import only downward, modules stay short, docstrings stay brief.

Read from the source text with `ast` (nothing is imported), so the checks hold on any machine. Each rule names the
modules that break it, so a failure says what to move.
"""

from __future__ import annotations

import ast
import re
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
    # gguf_ops and scaled_ops dispatch to the Triton kernels or to their twins, checkpoint readers
    # (h3engine.checkpoint.gguf_blocks, .single_file_formats); stored_linear computes with stored bytes through them.
    (
        "h3engine.checkpoint.*",
        "h3engine.models.gguf_ops",
        "h3engine.models.scaled_ops",
        "h3engine.models.stored_linear",
    ),
    ("h3engine.models.parallel.*",),
    ("h3engine.models.quantization", "h3engine.memory.*"),
    (
        "h3engine.engine.sampling.*",
        "h3engine.media.*",
        "h3engine.request.*",
        "h3engine.engine.conditioning.*",
        "h3engine.engine.lora.*",
        "h3engine.engine.preview",
        "h3engine.engine.resolved",
        "h3engine.cli.validation.checkpoint_probe",
        "h3engine.cli.validation.reference",
    ),
    ("h3engine.engine.pipeline",),
    ("h3engine.engine", "h3engine.engine.engine", "h3engine.engine.model_store", "h3engine.engine.options"),
    ("h3engine.runtime.*",),
    ("h3engine.serving.*",),
    ("h3engine.cli.*", "h3engine.__main__"),
)

MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80  # from its `def` line to its last
# Entries at h3engine's top (packages and modules, `__init__.py` and `__main__.py` aside): the layers, by subject.
MAX_TOP_LEVEL_ENTRIES = 10
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


def test_the_top_level_holds_few_entries() -> None:
    top = sorted(
        path.name
        for path in PACKAGE.iterdir()
        if path.name not in ("__init__.py", "__main__.py", "__pycache__")
        and (path.suffix == ".py" or (path / "__init__.py").is_file())
    )
    assert len(top) <= MAX_TOP_LEVEL_ENTRIES, f"h3engine/ holds {len(top)} entries at its top: {top}"


def test_package_init_files_only_say_what_the_package_holds() -> None:
    """A package's `__init__.py` holds its docstring, imports and dunder names (`__version__`) at most: importing
    one module of a package never runs another's code (an engine's subpackage would otherwise import torch and the
    whole engine)."""
    busy = []
    for path in sorted(PACKAGE.rglob("__init__.py")):
        body = ast.parse(path.read_text(encoding="utf-8")).body
        code = [
            node
            for node in body
            if not isinstance(node, ast.Import | ast.ImportFrom | ast.Expr)
            and not (
                isinstance(node, ast.Assign) and all(target.id.startswith("__") for target in node.targets)
            )
        ]
        if code:
            busy.append(str(path.relative_to(REPOSITORY)))
    assert not busy, f"package __init__.py files holding code (move it into a module of the package): {busy}"


def long_functions(root: str) -> dict[str, int]:
    long = {}
    for path in sorted((REPOSITORY / root).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if (count := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(REPOSITORY)}:{node.name}"] = count
    return long


@pytest.mark.parametrize("root", ["h3engine", "ui"])
def test_functions_stay_short(root: str) -> None:
    long = long_functions(root)
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


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


def test_readme_layout_names_files_that_exist() -> None:
    """README's request path and folder list name real files (a moved module fails here, not in a reader's hands)."""
    readme = (REPOSITORY / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Layout of the code") :]
    named = set(re.findall(r"\b((?:h3engine|ui)/[\w/]+\.py)\b", section))
    relative = {
        f"h3engine/{folder}/{name}"
        for folder, name in re.findall(
            r"\b(request|runtime|serving|engine|memory|cli)/([\w]+\.py)\b", section
        )
    }
    assert len(named) >= 7 and len(relative) >= 15, (named, relative)
    missing = sorted(path for path in named | relative if not (REPOSITORY / path).is_file())
    assert not missing, f"README's layout names files that do not exist: {missing}"
