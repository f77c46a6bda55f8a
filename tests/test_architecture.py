"""The shape of the tree: imports point down the layers, no package has an import circle, modules
and functions stay readable, and package code does not carry measurement history.

Static checks over the source (``ast``), so they run in milliseconds and need no GPU. Imports
under ``if TYPE_CHECKING:`` do not count; imports inside functions do (a lazy import that closes a
circle is still a circle a reader has to hold in mind).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("omni_kernels", "omni_diffusion", "omni_serve")
#: what each package may import from the others (the layers, top to bottom)
ALLOWED_OMNI_IMPORTS = {
    "omni_serve": {"omni_serve", "omni_diffusion", "omni_kernels"},
    "omni_diffusion": {"omni_diffusion", "omni_kernels"},
    "omni_kernels": {"omni_kernels"},
}
#: third-party packages a layer must not know about
FORBIDDEN_THIRD_PARTY = {
    "omni_kernels": {"diffusers", "fastapi", "transformers"},
    "omni_diffusion": {"fastapi", "uvicorn"},
}
MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 150
MAX_MODULE_DOCSTRING_LINES = 40
README_MAX_LINES = 200


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    tree: ast.Module
    source: str
    imports: set[str] = field(default_factory=set)

    @property
    def package(self) -> str:
        return self.name if self.is_package else self.name.rpartition(".")[0]


def _load_modules() -> dict[str, Module]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            source = path.read_text()
            modules[".".join(parts)] = Module(".".join(parts), path, is_package, ast.parse(source), source)
    return modules


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(sub) for sub in ast.walk(node))
    return skipped


def _imported_names(module: Module, known: dict[str, Module]) -> set[str]:
    """Dotted names a module imports (absolute), submodules resolved where they are modules."""
    skipped = _type_checking_nodes(module.tree)
    names: set[str] = set()
    for node in ast.walk(module.tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base) + (f".{node.module}" if node.module else "")
            else:
                target = node.module or ""
            submodules = [f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in known]
            names.update(submodules)
            if len(submodules) < len(node.names):
                names.add(target)
        elif (isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module")
              and node.args and isinstance(node.args[0], ast.Constant)):
            names.add(str(node.args[0].value))
    return names


MODULES = _load_modules()
for _module in MODULES.values():
    _module.imports = _imported_names(_module, MODULES)


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return components


def test_no_import_circles():
    graph = {name: {imp for imp in module.imports if imp in MODULES and imp != name}
             for name, module in MODULES.items()}
    circles = _strongly_connected(graph)
    assert not circles, "import circles (each line: modules that import one another):\n" + "\n".join(
        " <-> ".join(circle) for circle in circles)


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_point_down_the_layers(package):
    wrong = []
    for module in MODULES.values():
        if module.name.split(".")[0] != package:
            continue
        for name in module.imports:
            top = name.split(".")[0]
            if top.startswith("omni_") and top in PACKAGES and top not in ALLOWED_OMNI_IMPORTS[package]:
                wrong.append(f"{module.name} imports {name}")
            if top in FORBIDDEN_THIRD_PARTY.get(package, ()):
                wrong.append(f"{module.name} imports {name} ({package} must not know {top})")
    assert not wrong, "\n".join(wrong)


def _is_triton_kernel(node: ast.AST) -> bool:
    return any("triton" in ast.unparse(d) and ("jit" in ast.unparse(d) or "autotune" in ast.unparse(d))
               for d in getattr(node, "decorator_list", ()))


def _holds_triton_kernels(module: Module) -> bool:
    return any(_is_triton_kernel(node) for node in ast.walk(module.tree))


def test_modules_stay_readable_in_size():
    too_long = [f"{m.path.relative_to(ROOT)}: {len(m.source.splitlines())} lines"
                for m in MODULES.values()
                if len(m.source.splitlines()) > MAX_MODULE_LINES and not _holds_triton_kernels(m)]
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines (split by responsibility):\n" + "\n".join(too_long)


@pytest.mark.parametrize("folder", ["bench", "tests"])
def test_benchmarks_and_tests_stay_readable_in_size(folder):
    too_long = [f"{path.relative_to(ROOT)}: {n} lines" for path in sorted((ROOT / folder).rglob("*.py"))
                if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines (split by responsibility):\n" + "\n".join(too_long)


def test_functions_stay_readable_in_size():
    too_long = []
    for module in MODULES.values():
        for node in ast.walk(module.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_triton_kernel(node):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{module.path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines")
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(too_long)


def test_module_docstrings_say_what_and_why_briefly():
    long_docs = []
    for module in MODULES.values():
        doc = ast.get_docstring(module.tree) or ""
        if len(doc.splitlines()) > MAX_MODULE_DOCSTRING_LINES:
            long_docs.append(f"{module.path.relative_to(ROOT)}: {len(doc.splitlines())} lines")
    assert not long_docs, (f"module docstrings over {MAX_MODULE_DOCSTRING_LINES} lines "
                           "(measurement history belongs in bench/results/):\n" + "\n".join(long_docs))


#: a citation of one benchmark record, or of one run on one GPU ("measured on the H200 at 1a2b3c4")
_RUN_CITATION = re.compile(
    r"bench/results/(?!INDEX\.md)[\w./-]+"
    r"|\b(?:measured|timed|ran)\b[^\n]{0,40}\bH[12]00\b"
    r"|\bH[12]00\b[^\n]{0,40}\b(?:at|commit)\s+[0-9a-f]{7,40}\b")


def test_package_code_cites_no_individual_bench_runs():
    citations = []
    for module in MODULES.values():
        for lineno, line in enumerate(module.source.splitlines(), 1):
            if _RUN_CITATION.search(line):
                citations.append(f"{module.path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    assert not citations, ("package code cites benchmark runs (point at bench/results/INDEX.md "
                           "instead):\n" + "\n".join(citations))


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; details go to docs/"
    head = "\n".join(lines[:40])
    assert "make serve" in head and "make test" in head, "the two quick-start commands come first"


def test_the_checks_see_what_they_check():
    # Guards against a vacuous pass: the walker finds the packages, their imports and a known edge.
    assert {"omni_kernels", "omni_diffusion", "omni_serve"} <= set(MODULES)
    assert "omni_diffusion" in {name.split(".")[0] for name in MODULES["omni_serve.worker"].imports}
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _strongly_connected(graph) == [["a", "b", "c"]]
