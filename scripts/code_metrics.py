"""Measure how a Python tree reads: docstring prose, imports, function and class sizes, circles, tests per code line.

    python scripts/code_metrics.py                      # this project (the package-dir mapping of pyproject.toml)
    python scripts/code_metrics.py --tree DIR:PKG:TESTS # another tree: its package folder and its tests folder

docs/layout.md quotes the figures beside two anchors' (torchtitan, OLMo-core) measured by this script.
Definitions, the same for every tree:
- code lines: source lines that are not blank, not comment-only and not inside a string statement (a docstring);
- docstring words: words of every string statement (module, class, function and attribute docstrings);
- sentence: a run of docstring text ending in ". ", "? ", "! " or the end of the docstring;
- internal import: an import of the tree's own package; "inside functions" counts those in a function body;
- circle: a strongly connected group of two or more modules, function-level imports included.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LONG_FUNCTION = 60
LONG_MODULE_DOCSTRING = 20
SENTENCE_END = re.compile(r"[.!?](?:\s|$)")


@dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    source: str


@dataclass
class Metrics:
    modules: int = 0
    code_lines: int = 0
    test_lines: int = 0
    docstring_words: int = 0
    sentences: int = 0
    long_module_docstrings: list[str] = field(default_factory=list)
    functions: int = 0
    long_functions: int = 0
    largest_class: tuple[int, str] = (0, "")
    imports: int = 0
    imports_in_functions: int = 0
    circles: list[list[str]] = field(default_factory=list)

    def rows(self) -> list[tuple[str, str]]:
        return [
            ("modules", f"{self.modules}"),
            ("code lines", f"{self.code_lines:,}"),
            ("tests / code lines", f"{self.test_lines / max(self.code_lines, 1):.2f}"),
            ("docstring words per code line", f"{self.docstring_words / max(self.code_lines, 1):.2f}"),
            ("words per docstring sentence", f"{self.docstring_words / max(self.sentences, 1):.1f}"),
            (f"module docstrings over {LONG_MODULE_DOCSTRING} lines", f"{len(self.long_module_docstrings)}"),
            (f"functions over {LONG_FUNCTION} lines", f"{100 * self.long_functions / max(self.functions, 1):.1f}%"),
            ("largest class (lines)", f"{self.largest_class[0]} ({self.largest_class[1]})"),
            ("internal imports inside functions", f"{100 * self.imports_in_functions / max(self.imports, 1):.1f}%"),
            ("import circles", f"{len(self.circles)}"),
        ]


def docstring_nodes(tree: ast.AST) -> Iterator[ast.Constant]:
    """Every string statement: the docstrings of modules, classes and functions, and attribute docstrings."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            yield node.value


def code_lines(module: Module) -> int:
    prose = set()
    for node in docstring_nodes(module.tree):
        prose.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return sum(
        1
        for number, line in enumerate(module.source.splitlines(), start=1)
        if line.strip() and not line.strip().startswith("#") and number not in prose
    )


def internal_imports(module: Module, package: str) -> Iterator[tuple[str, bool]]:
    """(imported module, inside a function) for each import of the package's own modules."""

    def visit(node: ast.AST, in_function: bool) -> Iterator[tuple[str, bool]]:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name == package or alias.name.startswith(package + "."):
                        yield alias.name, in_function
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = module.name.split(".")
                    keep = len(parts) - child.level + (1 if module.path.name == "__init__.py" else 0)
                    base = ".".join(parts[:keep] + ([base] if base else []))
                if base == package or base.startswith(package + "."):
                    for alias in child.names:
                        yield f"{base}.{alias.name}", in_function
            yield from visit(child, nested)

    yield from visit(module.tree, False)


def resolve(name: str, modules: dict[str, Module]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of two or more modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    sys.setrecursionlimit(10_000)

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def load(folders: dict[str, Path], skip: re.Pattern[str] | None = None) -> dict[str, Module]:
    modules: dict[str, Module] = {}
    for package, folder in folders.items():
        for path in sorted(folder.rglob("*.py")):
            relative = path.relative_to(folder)
            if skip and skip.search(relative.as_posix()):
                continue
            parts = list(relative.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join([package, *parts])
            if name in modules:
                continue
            source = path.read_text(errors="replace")
            try:
                tree = ast.parse(source)
            except SyntaxError:
                continue
            modules[name] = Module(name, path, tree, source)
    return modules


def measure(modules: dict[str, Module], tests: list[Module], package: str) -> tuple[Metrics, dict[str, set[str]]]:
    metrics = Metrics(modules=len(modules))
    graph: dict[str, set[str]] = {}
    for module in modules.values():
        metrics.code_lines += code_lines(module)
        for node in docstring_nodes(module.tree):
            text = node.value
            metrics.docstring_words += len(text.split())
            metrics.sentences += max(1, len(SENTENCE_END.findall(text.strip())))
        doc = ast.get_docstring(module.tree, clean=False)
        if doc and doc.count("\n") + 1 > LONG_MODULE_DOCSTRING:
            metrics.long_module_docstrings.append(module.name)
        for node in ast.walk(module.tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                metrics.functions += 1
                metrics.long_functions += (node.end_lineno or node.lineno) - node.lineno + 1 > LONG_FUNCTION
            elif isinstance(node, ast.ClassDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                metrics.largest_class = max(metrics.largest_class, (size, f"{module.name}.{node.name}"))
        edges = graph.setdefault(module.name, set())
        for imported, in_function in internal_imports(module, package):
            metrics.imports += 1
            metrics.imports_in_functions += in_function
            target = resolve(imported, modules)
            if target and target != module.name:
                edges.add(target)
    metrics.test_lines = sum(code_lines(test) for test in tests)
    metrics.circles = circles(graph)
    return metrics, graph


def reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def this_project() -> tuple[dict[str, Module], list[Module], str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mapping = config["tool"]["setuptools"]["package-dir"]
    folders = {package: ROOT / folder for package, folder in mapping.items() if package.count(".") <= 1}
    modules = load(folders)
    tests = list(load({"tests": ROOT / "tests"}).values())
    return modules, tests, "hlat"


def other_tree(spec: str) -> tuple[dict[str, Module], list[Module], str]:
    folder, package, tests_folder = spec.split(":")
    skip = re.compile(r"(^|/)(tests?|test_[^/]*\.py)(/|$)")
    modules = load({package: Path(folder)}, skip=skip)
    tests = list(load({"tests": Path(tests_folder)}).values())
    inline = [m for m in load({package: Path(folder)}).values() if m.name not in modules]
    return modules, tests + inline, package


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", help="FOLDER:PACKAGE:TESTS of another tree (default: this project)")
    args = parser.parse_args()
    modules, tests, package = other_tree(args.tree) if args.tree else this_project()
    metrics, graph = measure(modules, tests, package)
    width = max(len(label) for label, _ in metrics.rows())
    for label, value in metrics.rows():
        print(f"{label:<{width}}  {value}")
    for group in metrics.circles:
        print(f"  circle: {' <-> '.join(group)}")
    if not args.tree:
        for stage in ("prepare_data", "train_tokenizer", "precompile", "burn_in", "train", "evaluate"):
            # A stage is its flow, its tasks and, where it runs a job, its job program.
            starts = [
                f"hlat.{layer}.{stage}" for layer in ("flows", "tasks", "training") if f"hlat.{layer}.{stage}" in graph
            ]
            reached = set().union(*(reach(graph, start) for start in starts))
            print(f"{'modules the ' + stage + ' stage reaches':<{width}}  {len(reached)} of {len(modules)}")


if __name__ == "__main__":
    main()
