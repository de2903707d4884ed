"""The layers hold: the core library (libs/jobplane) imports no role and not the command, and
no role imports another role or the command (services/jobplane_cli composes them all).

Checked on the source with ``ast``, so an import inside a function (a lazy import) counts as
much as one at the top of a module; see docs/architecture.md, "Layers"."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from jobplane import errors

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "libs" / "jobplane"
SERVICES = ROOT / "services"
ROLES = ("jobplane_api", "jobplane_scheduler", "jobplane_worker")
COMMAND = "jobplane_cli"
#: Functions that import a module named by their first argument.
DYNAMIC_IMPORTS = {"import_module", "__import__"}


def imported(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """Every absolute module name ``tree`` imports, wherever the statement is, with its line:
    ``import a.b``, ``from a.b import c`` and ``importlib.import_module("a.b")``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            first = node.args[0]
            if (
                name in DYNAMIC_IMPORTS
                and isinstance(first, ast.Constant)
                and isinstance(first.value, str)
            ):
                yield node.lineno, first.value


def violations(package: Path, forbidden: set[str]) -> list[str]:
    """``file:line module`` for each import under ``package`` of a forbidden top-level
    package."""
    found = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for line, module in imported(tree):
            if module.split(".")[0] in forbidden:
                found.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return found


def test_the_core_imports_no_role_and_not_the_command() -> None:
    assert list(CORE.rglob("*.py")), f"no modules under {CORE}"
    assert violations(CORE, {*ROLES, COMMAND}) == []


@pytest.mark.parametrize("role", ROLES)
def test_a_role_imports_no_other_role_and_not_the_command(role: str) -> None:
    package = SERVICES / role
    assert list(package.rglob("*.py")), f"no modules under {package}"
    assert violations(package, {*ROLES, COMMAND} - {role}) == []


def test_every_kind_of_import_is_seen() -> None:
    """The check itself: nested, ``from`` and dynamic imports are all found."""
    source = (
        "import jobplane_api.main\n"
        "def f():\n"
        "    from jobplane_cli.main import run\n"
        "    import importlib\n"
        "    importlib.import_module('jobplane_worker.worker')\n"
        "    __import__('jobplane_scheduler')\n"
        "from . import sibling\n"
    )
    found = {module for _, module in imported(ast.parse(source))}
    assert found == {
        "jobplane_api.main",
        "jobplane_cli.main",
        "importlib",
        "jobplane_worker.worker",
        "jobplane_scheduler",
    }


def test_every_error_of_the_core_lives_in_errors_py_and_derives_from_jobplane_error() -> None:
    defined_elsewhere = []
    for path in sorted(CORE.rglob("*.py")):
        if path.name == "errors.py" and path.parent == CORE:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(
                _name_of(base).endswith(("Error", "Exception")) for base in node.bases
            ):
                defined_elsewhere.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert defined_elsewhere == []
    for name in dir(errors):
        value = getattr(errors, name)
        if isinstance(value, type) and issubclass(value, Exception):
            assert value is errors.JobplaneError or issubclass(value, errors.JobplaneError), name


def _name_of(base: ast.expr) -> str:
    if isinstance(base, ast.Name):
        return base.id
    if isinstance(base, ast.Attribute):
        return base.attr
    return ""


def test_every_error_a_role_defines_derives_from_jobplane_error() -> None:
    """A role's own exceptions (refusals, a failed child) are Jobplane's too: a caller
    catching ``JobplaneError`` catches them."""
    outside = []
    for path in sorted((ROOT / "services").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(
                _name_of(base) in {"Exception", "BaseException", "RuntimeError", "ValueError"}
                for base in node.bases
            ):
                outside.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert outside == []
