"""Packaging layout: what the wheel holds, and how the test session imports furlong.

Under ``pip install -e .`` a sub-package missing from pyproject's ``packages`` still
imports while the wheel lacks it, so the wheel is built and read here. The build runs on a
copy of the sources, so it leaves no ``build/`` or ``*.egg-info`` in the repository.
"""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FOLDERS = {"hooks": "furlong/hooks", "kit": "furlong/kit", "core": "furlong/core", "builtin_plugins": "furlong/builtin_plugins"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """The furlong wheel, built with ``pip wheel . --no-deps --no-build-isolation``."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for folder in FOLDERS:
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (path,) = out.glob("furlong-*.whl")
    with zipfile.ZipFile(path) as zf:
        yield zf


def _source_files(suffix: str = ".py") -> set[str]:
    """Every source file of the three package folders, as its path inside the wheel."""
    files = set()
    for folder, target in FOLDERS.items():
        for path in (REPO / folder).rglob(f"*{suffix}"):
            if "__pycache__" not in path.parts:
                files.add(f"{target}/{path.relative_to(REPO / folder).as_posix()}")
    return files


@pytest.mark.timeout(300)
def test_wheel_holds_every_sub_package(wheel):
    names = set(wheel.namelist())
    packages = {f for f in _source_files() if f.endswith("/__init__.py")}
    assert len(packages) >= 3
    assert sorted(packages - names) == [], "add the missing sub-packages to [tool.setuptools] packages in pyproject.toml"


@pytest.mark.timeout(300)
def test_wheel_holds_every_module(wheel):
    assert sorted(_source_files() - set(wheel.namelist())) == []


@pytest.mark.timeout(300)
def test_wheel_has_no_top_level_core_or_hooks_and_no_furlong_init(wheel):
    tops = {name.split("/")[0] for name in wheel.namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"furlong"}
    assert "furlong/__init__.py" not in wheel.namelist()  # furlong is a namespace package


@pytest.mark.timeout(300)
def test_wheel_entry_points_equal_pyproject(wheel, furlong_entry_points):
    (path,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    parser = configparser.ConfigParser()
    parser.optionxform = str  # keep names as written
    parser.read_string(wheel.read(path).decode())
    assert dict(parser["furlong"]) == furlong_entry_points
    with open(REPO / "pyproject.toml", "rb") as fh:
        scripts = tomllib.load(fh)["project"]["scripts"]
    assert dict(parser["console_scripts"]) == scripts == {"furlong": "furlong.core.cli:main"}


def test_pyproject_packages_match_the_source_folders():
    with open(REPO / "pyproject.toml", "rb") as fh:
        tool = tomllib.load(fh)["tool"]["setuptools"]
    assert tool["package-dir"] == {"furlong.hooks": "hooks", "furlong.kit": "kit", "furlong.core": "core",
                                   "furlong.builtin_plugins": "builtin_plugins"}
    expected = sorted(p[: -len("/__init__.py")].replace("/", ".") for p in _source_files() if p.endswith("/__init__.py"))
    assert sorted(tool["packages"]) == expected


def test_session_never_imports_core_or_hooks_as_top_level_packages():
    # --import-mode=importlib: tests import furlong.core, never the folder core/ as "core"
    import furlong.core
    import furlong.hooks

    assert [name for name in ("core", "hooks", "builtin_plugins") if name in sys.modules] == []
    assert Path(furlong.core.__file__).resolve() == REPO / "core" / "__init__.py"
    assert Path(furlong.hooks.__file__).resolve() == REPO / "hooks" / "__init__.py"


def test_one_sample_class_in_the_session():
    # a second copy of the contract (imported as "hooks.types") would make isinstance checks fail
    from furlong.hooks import Sample

    copies = [m for name, m in sys.modules.items() if name.endswith("hooks.types")]
    assert [m.Sample for m in copies] == [Sample]
