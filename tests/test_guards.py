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
    assert (1, "furlong.core.plugins.manager") in [(1, name) for _, name in _imports(REPO / "core" / "cli" / "commands.py")]
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


# --- who calls plugin and user code --------------------------------------------------------

_MANAGER = Path("core/plugins/manager.py")
# the contract kit (furlong.hooks.testing) checks one implementation in isolation, in a plugin author's
# tests: it is no part of a run, and furlong.hooks may not import the plugin manager
_KIT_CALLER = Path("hooks/testing/checks.py")
_LOADERS = {"import_dotted", "import_module", "__import__", "exec_module", "run_path", "make_adapter"}
# hooks/_moved.py imports furlong.kit's own modules for the old furlong.hooks paths, never a user's
_MOVED = Path("hooks/_moved.py")
# where a dotted path may be imported outside core/plugins, each with why it is no hook implementation
_LOADERS_ALLOWED = {
    # the one importer of a user's dotted path; core/plugins/adapters.py wraps hook functions with it
    Path("kit/dotted.py"): "the loader itself",
    # Miles' tool-execution function and tool specs: data and a helper the plugin calls, checked there
    # (a non-string result is that plugin's error naming the flag), not a hook of their own
    Path("builtin_plugins/generate/multi_turn.py"): "--generate-execute-tool-function-path, --generate-tool-specs-path",
}


def _hook_calls(source: str) -> list[tuple[int, str]]:
    """Calls that run a hook implementation without the plugin manager's two ways: ``X.function(...)``
    (a pluggy HookImpl's function), ``X._call(...)``/``X._call_setup(...)``/``X._call_sync(...)`` on
    another object than ``self``, and pluggy's own ``X.hook.NAME(...)``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        func = node.func
        on_self = isinstance(func.value, ast.Name) and func.value.id == "self"
        if (func.attr == "function"
                or func.attr in ("_call", "_call_setup", "_call_sync") and not on_self
                or isinstance(func.value, ast.Attribute) and func.value.attr == "hook"):
            found.append((node.lineno, ast.unparse(func)))
    return found


def _loader_uses(source: str) -> list[tuple[int, str]]:
    """Names and calls that import code by a dotted path (``import_dotted``, ``importlib.import_module``, ...)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in _LOADERS:
                found.append((node.lineno, ast.unparse(node.func)))
        elif isinstance(node, ast.ImportFrom):
            found += [(node.lineno, f"imports {alias.name}") for alias in node.names if alias.name in _LOADERS]
    return found


def test_the_call_detectors_see_each_way_around_the_manager():
    source = textwrap.dedent("""
        from furlong.core.plugins.adapters import import_dotted
        result = pm._call_sync("configure", impl, {"args": args})
        impl.function(parser=parser)
        pm.hook.abort(args=args, rollout_id=1)
        fn = import_dotted(path, flag)
        module = importlib.import_module(name)
        self._call(method)  # another class's own helper
        pm.hook.configure.get_hookimpls()
    """)
    assert _hook_calls(source) == [(3, "pm._call_sync"), (4, "impl.function"), (5, "pm.hook.abort")]
    assert _loader_uses(source) == [(2, "imports import_dotted"), (6, "import_dotted"),
                                    (7, "importlib.import_module")]


def test_hooks_are_called_only_by_the_plugin_manager():
    bad = [f"{path.relative_to(REPO)}:{line} calls {what}"
           for folder in PACKAGES for path in _py_files(folder)
           if path.relative_to(REPO) not in (_MANAGER, _KIT_CALLER)
           for line, what in _hook_calls(path.read_text())]
    assert bad == [], "call hooks through the plugin manager (call_chosen, broadcast, notify, run_filters, call_setup)"


def test_dotted_paths_are_imported_only_by_the_adapters():
    bad = [f"{path.relative_to(REPO)}:{line}: {what}"
           for folder in PACKAGES for path in _py_files(folder)
           if path.relative_to(REPO).parts[:2] != ("core", "plugins") and path.relative_to(REPO) != _MOVED
           and path.relative_to(REPO) not in _LOADERS_ALLOWED
           for line, what in _loader_uses(path.read_text())]
    assert bad == [], "wrap a dotted-path flag's function as an adapter plugin (core/plugins/adapters.py)"


# --- core names no plugin ----------------------------------------------------------------

# Comparisons of a built-in plugin's name that core may make, each with why it is no choice of plugin:
# ``(file, name)``. Everything else that decides behaviour by a plugin's name belongs in that plugin
# (its ``configure``, ``executor_fit``, a report it makes) or in a Protocol member core reads.
NAME_COMPARISONS_ALLOWED = {
    # --opd-type names the kind of teacher (an SGLang server or a Megatron checkpoint), not a plugin
    ("core/config/rules.py", "megatron"),
    # "math" is the kind of a Megatron flag (it changes the computation), not the reward plugin
    ("core/config/megatron_support.py", "math"),
    # the zero-advantage skip is exact only for this loss; no loss plugin declares that yet
    ("core/config/train_rules.py", "policy_loss"),
}


def _literal_names(node: ast.AST) -> list[str]:
    """The string constants an operand of a comparison is: ``"x"`` or a tuple, list or set of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def _plugin_name_comparisons(path: Path, names: set[str]) -> list[tuple[int, str]]:
    """``(line, name)`` of each ``==``, ``!=``, ``in``, ``not in`` or ``match`` case on a literal that is in ``names``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                found += [(node.lineno, value) for value in _literal_names(operand) if value in names]
        elif isinstance(node, ast.MatchValue):
            found += [(node.lineno, value) for value in _literal_names(node.value) if value in names]
    return found


def test_core_compares_no_selection_to_a_builtin_plugin_name(furlong_entry_points):
    """Core decides nothing by a built-in plugin's name: a DeepSpeed backend or a Slurm executor must
    need no core edit. Names may appear as data (the parser's flag defaults, the machine defaults'
    table, Miles' dotted-path and switch-flag tables, messages); what is refused is comparing a value
    to one (``args.train_backend == "megatron"``, ``name in ("local", "ray")``, ``case "sglang":``)."""
    names = set(furlong_entry_points)
    found = [(str(path.relative_to(REPO)), line, name) for path in _py_files("core")
             for line, name in _plugin_name_comparisons(path, names)]
    bad = [f"{path}:{line} compares with plugin name {name!r}" for path, line, name in found
           if (path, name) not in NAME_COMPARISONS_ALLOWED]
    assert bad == []
    assert {(path, name) for path, _, name in found} == NAME_COMPARISONS_ALLOWED, "an allowed comparison is gone"


def test_the_plugin_name_guard_sees_comparisons_in_every_form(tmp_path):
    source = tmp_path / "sample.py"
    source.write_text(textwrap.dedent("""
        a = x == "megatron"
        b = "local" != y
        c = z in ("ray", "other")
        match w:
            case "sglang":
                pass
        d = x == "not_a_plugin"
        e = {"fsdp": 1}
    """))
    assert _plugin_name_comparisons(source, {"megatron", "local", "ray", "sglang", "fsdp"}) == [
        (2, "megatron"), (3, "local"), (4, "ray"), (6, "sglang")]


# --- core reads the typed configuration ------------------------------------------------------

_FLAGS_NAME = re.compile(r"(^|_)(args|config)$")


def _defaulted_flag_reads(source: str) -> list[tuple[int, str]]:
    """``getattr(<args|config>, "name", default)``: a named flag read with a default of its own, which can
    disagree with the parser's (every flag is set after parsing, every field of a RunConfig always). A name
    computed from a table (Miles' flags, which the parse leaves unset unless given) is no such read."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                and len(node.args) == 3 and isinstance(node.args[1], ast.Constant)):
            target = node.args[0]
            name = target.id if isinstance(target, ast.Name) else target.attr if isinstance(target, ast.Attribute) else ""
            if _FLAGS_NAME.search(name):
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_defaulted_read_detector_sees_args_and_config():
    source = textwrap.dedent("""
        a = getattr(args, "lr", 0.1)
        b = getattr(self.config, "seed", None)
        c = getattr(args, "lr")
        d = getattr(model_config, "vocab_size", 0)
        e = getattr(engine, "x", None)
        f = getattr(args, dest, None)
    """)
    assert _defaulted_flag_reads(source) == [(2, "getattr(args, 'lr', 0.1)"), (3, "getattr(self.config, 'seed', None)"),
                                             (5, "getattr(model_config, 'vocab_size', 0)")]


def test_core_reads_flags_without_defaults_of_its_own():
    bad = [f"{path.relative_to(REPO)}:{line}: {call}" for path in _py_files("core")
           for line, call in _defaulted_flag_reads(path.read_text()) if not call.startswith("getattr(model_config")]
    assert bad == [], "read the flag as an attribute: the parse sets every flag, the RunConfig has every field"


_FLAG_ACCESS = Path("core/config/flag_access.py")


def _flag_getattrs(source: str) -> list[tuple[int, str]]:
    """Every ``getattr(<args|config>, ...)``, named or computed, with or without a default."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" and node.args:
            target = node.args[0]
            name = target.id if isinstance(target, ast.Name) else target.attr if isinstance(target, ast.Attribute) else ""
            if name in ("args", "config"):
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_core_reads_a_flag_by_a_computed_name_only_through_flag_value():
    assert _flag_getattrs("a = getattr(args, dest)\nb = getattr(self.config, 'x', 1)\nc = getattr(engine, 'y')\n") \
        == [(1, "getattr(args, dest)"), (2, "getattr(self.config, 'x', 1)")]
    bad = [f"{path.relative_to(REPO)}:{line}: {call}" for path in _py_files("core")
           if path.relative_to(REPO) != _FLAG_ACCESS for line, call in _flag_getattrs(path.read_text())]
    assert bad == [], "read args.<name> / config.<name>; a name from a table goes through flag_access.flag_value"


def test_the_configuration_imports_no_part_that_runs():
    """core/config/ parses, checks and freezes flags: it imports none of the parts that run (rollout, train,
    run, serve, cli), so reading flags never loads training or storage code."""
    running = [f"furlong.core.{part}" for part in ("rollout", "train", "run", "serve", "cli")]
    bad = [f"{path.relative_to(REPO)}:{line} imports {name}" for path in _py_files("core/config")
           for line, name in _imports(path) if any(_within(name, part) for part in running)]
    assert bad == []
