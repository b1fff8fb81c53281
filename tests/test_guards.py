"""Guards that keep the contract, its documentation, its tests and the packaging in step."""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from furlong.core.plugins.manager import FurlongPluginManager, get_plugin_manager
from furlong.hooks import specs

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"
PACKAGES = {"hooks": "furlong.hooks", "kit": "furlong.kit", "core": "furlong.core", "builtin_plugins": "furlong.builtin_plugins"}


def _hooks_in_loop_order() -> list[str]:
    """Hook names in the order specs.py defines them (the loop order)."""
    return sorted(specs.__all__, key=lambda name: inspect.getsourcelines(getattr(specs, name))[1])


def _spec_heading(name: str) -> str:
    """The section heading of hook ``name``: its arguments in the new form (the deprecated ``args`` left out
    where the hook takes ``config``)."""
    argnames = getattr(FurlongPluginManager().hook, name).spec.argnames
    shown = [a for a in argnames if not (a == "args" and "config" in argnames)]
    return f"## {name}({', '.join(shown)})"


# --- documentation and tests -----------------------------------------------------------


def test_every_hookspec_has_its_plugins_md_section_in_loop_order():
    text = (REPO / "PLUGINS.md").read_text()
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    expected = [_spec_heading(name) for name in _hooks_in_loop_order()]
    missing = [h for h in expected if h not in headings]
    assert missing == [], f"PLUGINS.md lacks the section headings {missing}"
    assert [h for h in headings if h in expected] == expected, "PLUGINS.md hook sections are not in loop order"


def test_plugins_md_has_no_section_for_a_hook_that_does_not_exist():
    text = (REPO / "PLUGINS.md").read_text()
    signature = re.compile(r"^## (\w+)\(")
    documented = {m.group(1) for line in text.splitlines() if (m := signature.match(line))}
    assert documented - set(specs.__all__) == set()


def _hook_tests() -> dict[str, list[str]]:
    """``test_hook_<hook>_...`` function names in tests/, each given to the longest hook name it starts with."""
    found: dict[str, list[str]] = {name: [] for name in specs.__all__}
    by_length = sorted(specs.__all__, key=len, reverse=True)
    for path in sorted(TESTS.rglob("test_*.py")):
        for test in re.findall(r"^\s*(?:async\s+)?def (test_hook_\w+)\(", path.read_text(), flags=re.M):
            hook = next((h for h in by_length if test.startswith(f"test_hook_{h}_")), None)
            if hook:
                found[hook].append(f"{path.name}::{test}")
    return found


def test_every_hook_has_its_own_test():
    missing = sorted(hook for hook, tests in _hook_tests().items() if not tests)
    assert missing == [], f"hooks without a test_hook_<name>_... test in tests/: {missing}"


def test_hook_test_names_go_to_the_longest_matching_hook():
    # `rollout` is a prefix of `rollout_engine`: a rollout_engine test must not count for rollout
    found = _hook_tests()
    assert all(not t.split("::")[1].startswith("test_hook_rollout_engine_") for t in found["rollout"])
    assert any(t.split("::")[1].startswith("test_hook_rollout_engine_") for t in found["rollout_engine"])


# --- entry points ----------------------------------------------------------------------


@pytest.fixture
def loaded(monkeypatch):
    monkeypatch.delenv("FURLONG_DISABLE_PLUGINS", raising=False)
    return get_plugin_manager()


def test_pyproject_entry_points_equal_what_the_manager_finds_for_furlong(loaded, furlong_entry_points):
    found = {name: rec.value for name, rec in loaded.records.items() if rec.dist == "furlong"}
    found.update({name: rec.value for name, (rec, _) in loaded.broken.items() if rec and rec.dist == "furlong"})
    assert found == furlong_entry_points, (
        "the installed furlong metadata differs from pyproject.toml; "
        "run: pip install -e . --no-deps --no-build-isolation"
    )


def test_every_builtin_entry_point_loads(loaded, furlong_entry_points):
    broken = {name: error for name, (rec, error) in loaded.broken.items() if rec and rec.dist == "furlong"}
    assert broken == {}
    assert sorted(name for name, rec in loaded.records.items() if rec.dist == "furlong") == sorted(furlong_entry_points)
    assert {name for name in loaded.conflicts if name in furlong_entry_points} == set()


# --- import rules ----------------------------------------------------------------------


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = [PACKAGES[rel.parts[0]], *rel.parts[1:]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, absolute module)`` of every import in ``path``, relative ones resolved."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            out.append((node.lineno, target))
            out += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]
    return out


def _strings(path: Path) -> list[tuple[int, str]]:
    """String constants that are not docstrings."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings]


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _py_files(folder: str) -> list[Path]:
    return sorted((REPO / folder).rglob("*.py"))


def test_import_resolution_of_relative_imports(tmp_path):
    # what _imports sees in core/cli/commands.py: "from ..plugins.manager import X" -> furlong.core.plugins.manager
    assert (1, "furlong.core.plugins.manager") in [(1, name) for _, name in _imports(REPO / "core" / "cli" / "main.py")]
    assert _module_name(REPO / "builtin_plugins" / "__init__.py") == "furlong.builtin_plugins"


def test_core_never_imports_builtin_plugins_in_its_source():
    bad = [f"{path.relative_to(REPO)}:{line} imports {name}"
           for path in _py_files("core") for line, name in _imports(path)
           if _within(name, "furlong.builtin_plugins") or _within(name, "builtin_plugins")]
    bad += [f"{path.relative_to(REPO)}:{line} names {value!r}"
            for path in _py_files("core") for line, value in _strings(path)
            if value.startswith(("furlong.builtin_plugins", "builtin_plugins."))]
    assert bad == []


def test_importing_every_core_module_loads_no_builtin_plugin():
    script = textwrap.dedent("""
        import importlib, pkgutil, sys
        import furlong.core
        names = sorted(m.name for m in pkgutil.walk_packages(furlong.core.__path__, "furlong.core.")
                       if not m.name.endswith("__main__"))
        for name in names:
            importlib.import_module(name)
        leaked = sorted(m for m in sys.modules if m.startswith("furlong.builtin_plugins"))
        print(len(names), leaked)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=TESTS.parent.parent, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr
    count, leaked = proc.stdout.strip().split(" ", 1)
    assert int(count) >= 5  # plugins, discovery, selection, adapters, cli at least
    assert leaked == "[]"


def test_builtin_plugins_import_no_core_and_no_other_plugin(furlong_entry_points):
    plugin_modules = {value.partition(":")[0] for value in furlong_entry_points.values()}
    bad = []
    for path in _py_files("builtin_plugins"):
        module = _module_name(path)
        own = {m for m in plugin_modules if _within(module, m)}  # the plugin (module or package) it belongs to
        for line, name in _imports(path):
            if _within(name, "furlong.core") or _within(name, "core"):
                bad.append(f"{path.relative_to(REPO)}:{line} imports {name}")
            other = next((m for m in plugin_modules if _within(name, m) and m not in own), None)
            if other:
                bad.append(f"{path.relative_to(REPO)}:{line} imports plugin {other}")
    assert bad == []


def test_hooks_import_neither_core_nor_builtin_plugins():
    bad = [f"{path.relative_to(REPO)}:{line} imports {name}"
           for path in _py_files("hooks") for line, name in _imports(path)
           if any(_within(name, p) for p in ("furlong.core", "furlong.builtin_plugins", "core", "builtin_plugins"))]
    assert bad == []
