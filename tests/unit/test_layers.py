"""The project's layers and their import rules (README, "Layout"), read off the source: no arrow runs back up, no
import circle, one import namespace, every run file named once, and a task or flow that only looks at a run's
files does not import torch."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import hlat.core.layout
from hlat import cli
from tests.layout import project_modules

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("core", "training", "infra", "tasks", "flows", "hlat")
# What each layer may import of the others ("hlat": the CLI and deployment tooling in hlat/ itself).
ALLOWED = {
    "core": set(),
    "training": {"core"},
    "infra": {"core"},
    "tasks": {"core", "training", "infra"},
    "flows": {"core", "training", "infra", "tasks"},
    "hlat": {"core", "training", "infra", "tasks", "flows"},
}
# Third-party packages a layer must not import (anywhere in it, lazily included).
FORBIDDEN = {
    "core": {"torch", "prefect", "prefect_aws"},
    "infra": {"torch", "prefect", "prefect_aws"},
    "training": {"prefect", "prefect_aws"},
}


def layer_of(module: str) -> str:
    """The layer of 'hlat.<layer>[.<module>]'; 'hlat' for hlat's own modules (hlat.cli, hlat.deploy)."""
    parts = module.split(".")
    return parts[1] if len(parts) >= 2 and parts[1] in LAYERS[:-1] else "hlat"


def _under_main_guard(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Inside `if __name__ == "__main__":` (a flow file run as a script hands its arguments to the CLI)."""
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            return True
    return False


def imports(path: Path) -> list[tuple[str, int]]:
    """(imported module, line) for every import of the file, inside functions too (not under a main guard)."""
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if _under_main_guard(node, parents):
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, node.lineno))
        elif isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno) for alias in node.names)
    return found


def test_every_layer_imports_only_the_layers_below_it_and_none_of_its_forbidden_packages() -> None:
    wrong = []
    for module, path in project_modules().items():
        layer = layer_of(module)
        for imported, line in imports(path):
            top = imported.split(".")[0]
            if top == "hlat" and imported != "hlat":
                target = layer_of(imported)
                if target != layer and target not in ALLOWED[layer]:
                    wrong.append(f"{path.relative_to(ROOT)}:{line} ({layer}) imports {imported} ({target})")
            if top in FORBIDDEN.get(layer, ()):
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({layer}) imports {imported}")
    assert not wrong, "\n".join(wrong)


# Test fault injection: installed by HLAT_JOB_HOOKS / HLAT_BACKEND_HOOKS through the hook points, never imported.
FAULT_MODULES = {"hlat.training.faults", "hlat.infra.backends.local_faults"}


def _imported_names(path: Path) -> list[tuple[str, int]]:
    """(module, line) for each import of the file, and (module.name, line) for each name a `from` import takes
    (`from hlat.training import faults` imports hlat.training.faults)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, node.lineno))
            found.extend((f"{node.module}.{alias.name}", node.lineno) for alias in node.names)
        elif isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno) for alias in node.names)
    return found


def test_no_module_imports_a_fault_module_and_the_hook_points_name_no_fault() -> None:
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {imported}"
        for module, path in project_modules().items()
        if module not in FAULT_MODULES
        for imported, line in _imported_names(path)
        if imported in FAULT_MODULES
    ]
    assert not wrong, "\n".join(wrong)
    for module in ("hlat.training.hooks", "hlat.infra.backends.local_daemon", "hlat.infra.backends.local"):
        text = project_modules()[module].read_text()
        named = [name for name in ("HLAT_FAULT", "HLAT_LOCAL_FAULTS", "HLAT_PREPARE_FAULTS") if name in text]
        assert not named, f"{module} names {named}: fault variables belong to the fault modules"


def test_one_import_namespace_no_module_imports_a_layer_by_its_bare_name() -> None:
    files = [*project_modules().values(), *ROOT.glob("tests/**/*.py"), *ROOT.glob("benchmarks/*.py")]
    bare = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in files
        for name, line in imports(path)
        if name.split(".")[0] in {"core", "training", "infra", "tasks", "flows"}
    ]
    assert not bare, "\n".join(bare)


def test_no_import_circle_among_the_modules() -> None:
    """Function-level imports count, and so does the CLI's one import by name: each command's module."""
    modules = project_modules()
    graph = {
        module: {
            name
            for imported, _ in imports(path)
            for name in (imported, imported.rpartition(".")[0])
            # (a module of a package imports its siblings while the package's __init__ is being imported)
            if name in modules and name != module and not module.startswith(f"{name}.")
        }
        for module, path in modules.items()
    }
    graph["hlat.cli"] |= {f"hlat.commands.{c.module}" for c in cli.COMMANDS.values()} | {f"hlat.commands.{cli.ERRORS}"}
    done: set[str] = set()

    def visit(module: str, stack: list[str]) -> None:
        if module in stack:
            raise AssertionError("import circle: " + " -> ".join([*stack[stack.index(module) :], module]))
        if module in done:
            return
        for dep in sorted(graph[module]):
            visit(dep, [*stack, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


def test_every_run_file_name_is_defined_once_in_the_layout() -> None:
    names = {
        value
        for key, value in vars(hlat.core.layout).items()
        if key.isupper() and isinstance(value, str) and key not in {"STAGE_DIRS"}
    }
    redefined = []
    for module, path in project_modules().items():
        if module == "hlat.core.layout":
            continue
        for node in ast.parse(path.read_text()).body:
            constant = isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Constant)
            if constant and node.value.value in names:  # type: ignore[union-attr]
                redefined.append(f"{path.relative_to(ROOT)}:{node.lineno} = {node.value.value!r}")
    assert not redefined, "defined again outside core/layout.py:\n" + "\n".join(redefined)


@pytest.mark.parametrize(
    "module",
    [
        "hlat.core.config",
        "hlat.core.presets",
        "hlat.core.layout",
        "hlat.core.contract",
        "hlat.core.environment",
        "hlat.infra.stage_jobs",
        "hlat.infra.dry_run",
        "hlat.infra.reports.eval_report",
        "hlat.infra.backends.local_daemon",
        "hlat.infra.cost.planner",
        "hlat.tasks.train",
        "hlat.tasks.evaluate",
        "hlat.tasks.precompile",
        "hlat.tasks.burn_in",
        "hlat.flows.evaluate",
        "hlat.flows.pretrain",
        "hlat.cli",
        "hlat.commands.runs",
    ],
)
def test_looking_at_a_run_imports_no_torch(module: str) -> None:
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False", f"importing {module} imports torch"


@pytest.mark.parametrize("program", ["train", "precompile", "burn_in", "evaluate", "prepare_data"])
def test_a_job_program_starts_from_its_uploaded_source_as_sagemaker_starts_it(program: str, tmp_path: Path) -> None:
    """SageMaker's Torchrun driver runs the entry script by path from the uploaded source, where hlat is not
    installed, from another folder: the program imports the uploaded hlat package, and only it. (The editable
    install's finder is taken out first, so the program finds hlat as a job would.)"""
    from hlat.infra.backends.sagemaker_source import ENTRY_SCRIPT, JOB_MODULE_ENV, stage_source

    source = tmp_path / "code"
    stage_source(source, None)
    code = (
        "import os, runpy, sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if '__editable__' not in getattr(f, '__module__', '')]\n"
        "sys.path[0] = os.path.dirname(sys.argv[1])  # as `python <script>` sets it\n"
        "assert not any(m == 'hlat' or m.startswith('hlat.') for m in sys.modules)\n"
        "sys.argv = [sys.argv[1], '--help']\n"
        "try:\n"
        "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "finally:\n"
        "    print('from:', sorted({os.path.dirname(m.__file__) for n, m in sys.modules.items()\n"
        "                           if n.split('.')[0] == 'hlat' and getattr(m, '__file__', None)}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(source / ENTRY_SCRIPT)],
        cwd=tmp_path, capture_output=True, text=True, timeout=180,
        env={**os.environ, JOB_MODULE_ENV: f"hlat.training.{program}"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"python -m hlat.training.{program}" in out.stdout
    folders = ast.literal_eval(out.stdout.rsplit("from: ", 1)[1].strip())
    assert folders and all(folder.startswith(str(source)) for folder in folders)


def _run_names() -> dict[str, str]:
    """core/layout.py's names of a run's top-level folders and of paths relative to the run: constant -> value."""
    return {
        key: value
        for key, value in vars(hlat.core.layout).items()
        if key.isupper() and isinstance(value, str) and (key.endswith("_DIR") or "/" in value)
    }


def _named(node: ast.expr, names: dict[str, str]) -> bool:
    """`node` is one of the layout's names (CHECKPOINTS_DIR, or layout.CHECKPOINTS_DIR)."""
    return (isinstance(node, ast.Name) and node.id in names) or (isinstance(node, ast.Attribute) and node.attr in names)


def _docstrings(tree: ast.AST) -> set[int]:
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }


def run_paths_built(tree: ast.AST, names: dict[str, str]) -> list[tuple[int, str]]:
    """Where `tree` builds a path in a run from the layout's run-level names: an f-string that joins one to more
    with a slash, a literal starting with one of the run's folders ("jobs/..."), `NAME + ...`, or a join
    (`child`, `uri`, `path`, "/".join) of a name and something else. Paths inside a sub-folder (a checkpoint's
    marker beside its step folder) are the sub-folder's own business."""
    folders = tuple(f"{value}/" for key, value in names.items() if key.endswith("_DIR"))
    skip = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            parts = node.values
            for i, part in enumerate(parts):
                if not (isinstance(part, ast.FormattedValue) and _named(part.value, names)):
                    continue
                before = parts[i - 1] if i else None
                after = parts[i + 1] if i + 1 < len(parts) else None
                slash_before = isinstance(before, ast.Constant) and str(before.value).endswith("/")
                slash_after = isinstance(after, ast.Constant) and str(after.value).startswith("/")
                alone = isinstance(after, ast.Constant) and after.value == "/" and i + 2 == len(parts)
                if (slash_before or slash_after) and not alone:
                    found.append((node.lineno, ast.unparse(node)))
                    break
            first = parts[0] if parts else None
            if isinstance(first, ast.Constant) and str(first.value).startswith(folders):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            if node.value.startswith(folders):
                found.append((node.lineno, repr(node.value)))
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and _named(node.left, names):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            args = node.args[0].elts if node.func.attr == "join" and node.args and isinstance(
                node.args[0], (ast.List, ast.Tuple)) else node.args  # fmt: skip
            if node.func.attr in {"child", "uri", "path", "join"} and len(args) > 1 and _named(args[0], names):
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_no_run_path_is_built_outside_the_layout() -> None:
    names = _run_names()
    built = []
    for module, path in project_modules().items():
        if module == "hlat.core.layout":
            continue
        for line, text in run_paths_built(ast.parse(path.read_text()), names):
            built.append(f"{path.relative_to(ROOT)}:{line}: {text}")
    assert not built, "run paths built outside core/layout.py (name them there):\n" + "\n".join(built)


def test_the_run_path_check_finds_what_it_looks_for() -> None:
    names = {"JOBS_DIR": "jobs"}
    sources = [
        'p = f"{JOBS_DIR}/{stage}-supervisor.json"',
        'p = f"jobs/{stage}-lease.json"',
        'p = "jobs/status-clock"',
        "p = run.uri(JOBS_DIR, name, 'output.log')",
        'p = JOBS_DIR + "/x"',
        'p = "/".join([JOBS_DIR, "x"])',
    ]
    for source in sources:
        assert run_paths_built(ast.parse(source), names), source
    for source in ["p = run.child(JOBS_DIR)", 'p = f"see {CONFIG_FILE}"', 'p = "jobsite/x"']:
        assert not run_paths_built(ast.parse(source), names), source


def test_no_parameter_named_run_is_a_storage() -> None:
    """The job side and the control plane hand each other one shape, `core.run.Run`."""
    storages = []
    for path in project_modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                args = node.args
                for arg in (*args.posonlyargs, *args.args, *args.kwonlyargs):
                    if arg.arg == "run" and arg.annotation is not None and "Storage" in ast.unparse(arg.annotation):
                        storages.append(f"{path.relative_to(ROOT)}:{node.lineno}: run: {ast.unparse(arg.annotation)}")
            # A dataclass's or NamedTuple's field is its constructor's parameter.
            if isinstance(node, ast.ClassDef):
                for field in node.body:
                    if (
                        isinstance(field, ast.AnnAssign)
                        and isinstance(field.target, ast.Name)
                        and field.target.id == "run"
                        and "Storage" in ast.unparse(field.annotation)
                    ):
                        storages.append(f"{path.relative_to(ROOT)}:{field.lineno}: field run: Storage")
    assert not storages, "parameters named run that are a Storage (take a Run):\n" + "\n".join(storages)


def test_the_cli_parses_without_importing_a_command_module_prefect_torch_or_boto3() -> None:
    """`hlat --help` and a mistyped option stay fast: the command modules are imported when their command runs."""
    code = (
        "import sys, hlat.cli; hlat.cli.build_parser().format_help()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('prefect', 'torch', 'boto3')"
        " or m.startswith('hlat.commands.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_every_command_of_the_parser_has_its_handler_in_the_table() -> None:
    parser = cli.build_parser()
    (sub,) = (a for a in parser._actions if a.dest == "command")
    assert sorted(sub.choices) == sorted(cli.COMMANDS)
    for name, command in cli.COMMANDS.items():
        assert callable(getattr(cli.command_module(command.module), command.handler)), name
    assert callable(cli.command_module(cli.ERRORS).known_error)
