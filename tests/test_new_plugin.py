"""``furlong new-plugin``: the package it writes installs with pip, loads, and passes its own tests untouched.

The scaffold is pip-installed (editable, no network) into the environment running this
test and uninstalled when the module's tests finish, even on failure.
"""

from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys

import pytest

from furlong.core.cli.commands import main
from furlong.hooks import specs

pytestmark = pytest.mark.timeout(240)

DIST = "furlong-every-hook"


def _pip(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *argv], capture_output=True, text=True, timeout=150)


@pytest.fixture(scope="module")
def scaffold(tmp_path_factory):
    """``furlong new-plugin every_hook`` with every hook, pip-installed for this module."""
    parent = tmp_path_factory.mktemp("scaffold")
    argv = ["new-plugin", "every_hook", "--dir", str(parent)]
    for hook in specs.__all__:
        argv += ["--hook", hook]
    assert main(argv) == 0
    root = parent / DIST
    try:
        proc = _pip("install", "--no-build-isolation", "--no-deps", "-e", str(root))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        yield root
    finally:
        if _pip("show", DIST).returncode == 0:
            _pip("uninstall", "-y", DIST)


def test_the_scaffold_s_own_tests_pass_after_pip_install(scaffold):
    env = {k: v for k, v in os.environ.items() if k not in ("FURLONG_DISABLE_PLUGINS", "PYTHONPATH")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=scaffold, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 passed" in proc.stdout


def test_each_stub_has_the_hookspec_s_new_form_signature_and_docstring(scaffold):
    tree = ast.parse((scaffold / "furlong_every_hook" / "__init__.py").read_text())
    functions = {node.name: node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    assert sorted(functions) == sorted(specs.__all__)
    for hook, node in functions.items():
        spec = getattr(specs, hook)
        names = list(inspect.signature(spec).parameters)
        new_form = [n for n in names if not (n == "args" and "config" in names)]  # `args` is the deprecated form
        assert [a.arg for a in node.args.args] == new_form, hook
        assert ast.get_docstring(node) == inspect.getdoc(spec), hook
        assert [ast.unparse(d) for d in node.decorator_list] == ["hookimpl"], hook


def test_the_pyproject_registers_the_entry_point(scaffold):
    import tomllib

    project = tomllib.loads((scaffold / "pyproject.toml").read_text())["project"]
    assert project["name"] == DIST
    assert project["entry-points"]["furlong"] == {"every_hook": "furlong_every_hook"}


@pytest.mark.parametrize(("argv", "expected"), [
    (["new-plugin", "Exact-Match", "--hook", "reward"],
     "error: new-plugin 'Exact-Match': a plugin name is lower case letters, digits and '_', starting with a letter "
     "(it becomes a module name and what users type after a flag)."),
    (["new-plugin", "exact", "--hook", "rewards"],
     "error: --hook 'rewards': no such hook. Did you mean 'reward'? Hooks: " + ", ".join(specs.__all__) + "."),
])
def test_bad_arguments_are_one_error(tmp_path, capsys, argv, expected):
    assert main(argv + ["--dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err.splitlines() == [expected]
    assert list(tmp_path.iterdir()) == []


def test_an_existing_folder_is_left_alone(tmp_path, capsys):
    (tmp_path / "furlong-exact").mkdir()
    assert main(["new-plugin", "exact", "--hook", "reward", "--dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"error: new-plugin exact: {tmp_path / 'furlong-exact'} already exists; "
                                       "choose another --dir or remove it.\n")
    assert list((tmp_path / "furlong-exact").iterdir()) == []
