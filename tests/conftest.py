r"""Shared pytest fixtures.

Sections:
- plugins: ``plugin_dist`` (a throwaway installed distribution), ``plugin_manager``,
  ``register_plugin``, ``furlong_entry_points``, ``run_furlong``.
- end-to-end runs: the tiny model and data, ``signal_after_rollout_1``, ``serve_server``.
- order and repetition: ``--repeat N`` and ``--shuffle SEED``, and the scheduling of process modules.

Tests that send a signal to a process they start are marked ``signals`` and start it with
``preexec_fn=signal_state()`` (furlong.hooks.testing.processes): default signal actions and an
empty signal mask, so they hold whatever ran before them in the same worker and whatever state
pytest itself inherited. Whoever changes them, or the modules of :data:`PROCESS_MODULES`, checks
that they depend on neither order nor timing by running them shuffled and repeated in one
process, which is the worst case for state one test leaves to the next::

    python -m pytest -n 0 -m signals --repeat 5 --shuffle 1
    python -m pytest -n 0 --shuffle 2 tests/test_ray_executor.py tests/test_serve.py  # a module group

and the signal tests from a parent that ignores SIGINT (as a script's background job has it) and
from one that blocks it::

    (trap '' INT; python -m pytest -n 0 -m signals)
    python -c "import signal as s, subprocess as p, sys; s.pthread_sigmask(s.SIG_BLOCK, {s.SIGINT}); \
sys.exit(p.call(sys.argv[1:]))" python -m pytest -n 0 -m signals
"""

from __future__ import annotations

import importlib
import os
import random
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import attrs
import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


# --- plugins ---------------------------------------------------------------------------


@attrs.define(frozen=True)
class InstalledDist:
    """A distribution written by ``plugin_dist``: ``site`` is the folder put on ``sys.path``."""

    site: Path
    dist: str
    version: str
    package: str

    @property
    def label(self) -> str:
        """``"dist version"``, as the plugin manager prints a plugin's origin."""
        return f"{self.dist} {self.version}"


def _write_dist(
    site: Path,
    dist: str,
    package: str,
    source: str,
    entry_points: dict[str, str],
    version: str = "0.1.0",
    files: dict[str, str] | None = None,
) -> InstalledDist:
    """Write package ``package`` and ``<dist>-<version>.dist-info`` (group ``furlong``) into ``site``."""
    site = Path(site)
    pkg_dir = site / package
    pkg_dir.mkdir(parents=True, exist_ok=True)
    (pkg_dir / "__init__.py").write_text(textwrap.dedent(source))
    for rel, text in (files or {}).items():
        path = site / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    lines = ["[furlong]"] + [f"{name} = {value}" for name, value in entry_points.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    (info / "RECORD").write_text("")
    return InstalledDist(site=site, dist=dist, version=version, package=package)


@pytest.fixture(scope="session")
def write_dist():
    """``write_dist(site, dist, package, source, entry_points, version="0.1.0", files=None)``.

    Writes a distribution like ``plugin_dist`` does but leaves ``sys.path`` alone: for
    module-scoped set-ups whose distributions are only seen by subprocesses (put ``site``
    on their ``PYTHONPATH``).
    """
    return _write_dist


@pytest.fixture
def plugin_dist(tmp_path, monkeypatch):
    """Factory that installs a throwaway plugin distribution for this test only.

    ``plugin_dist(dist, package, source, entry_points, version="0.1.0", files=None, site=None)``
    writes ``<tmp>/site/<package>/__init__.py`` (``source``, dedented), any extra
    ``files`` (``{"<package>/other.py": text}``), and
    ``<tmp>/site/<dist>-<version>.dist-info/{METADATA,entry_points.txt,RECORD}`` with
    ``entry_points`` (``{name: "module[:object]"}``) in group ``furlong``. The site folder
    is prepended to ``sys.path`` and import caches are invalidated, so discovery goes
    through the real ``importlib.metadata``. ``site`` may be given to write a second copy
    elsewhere. On teardown the package's modules are removed from ``sys.modules``.
    Returns an :class:`InstalledDist`.
    """
    packages: list[str] = []
    prepended: set[Path] = set()

    def make(dist, package, source, entry_points, version="0.1.0", files=None, site=None) -> InstalledDist:
        site = Path(site or tmp_path / "site")
        installed = _write_dist(site, dist, package, source, entry_points, version=version, files=files)
        if site not in prepended:
            monkeypatch.syspath_prepend(str(site))
            prepended.add(site)
        importlib.invalidate_caches()
        packages.append(package)
        return installed

    yield make
    for package in packages:
        for mod in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
            del sys.modules[mod]
    importlib.invalidate_caches()


@pytest.fixture
def plugin_manager(monkeypatch):
    """A fresh plugin manager with every installed ``furlong`` entry point loaded.

    ``FURLONG_DISABLE_PLUGINS`` and ``FURLONG_TRACE_HOOKS`` are cleared first, so the
    caller's environment does not change what a test sees.
    """
    from furlong.core.plugins.manager import get_plugin_manager

    monkeypatch.delenv("FURLONG_DISABLE_PLUGINS", raising=False)
    monkeypatch.delenv("FURLONG_TRACE_HOOKS", raising=False)
    return get_plugin_manager()


@pytest.fixture
def register_plugin(plugin_manager):
    """``register_plugin(obj, name)``: register ``obj`` in ``plugin_manager`` for this test.

    Fails the test with the manager's reason when the plugin does not validate (an
    unknown hook, an argument the spec lacks). Unregistered on teardown.
    """
    names: list[str] = []

    def register(obj: object, name: str) -> object:
        if not plugin_manager.register_checked(obj, name):
            _, reason = plugin_manager.broken.pop(name)
            pytest.fail(f"plugin '{name}' did not register: {reason}")
        names.append(name)
        return obj

    yield register
    for name in names:
        if plugin_manager.get_plugin(name) is not None:
            plugin_manager.unregister(name=name)


@pytest.fixture(scope="session")
def furlong_entry_points() -> dict[str, str]:
    """``[project.entry-points.furlong]`` of pyproject.toml: built-in name -> module."""
    with open(REPO_ROOT / "pyproject.toml", "rb") as fh:
        return dict(tomllib.load(fh)["project"]["entry-points"]["furlong"])


@pytest.fixture(scope="session")
def installed_plugins(furlong_entry_points) -> list[str]:
    """``DIST:NAME`` of furlong's built-ins and of every plugin distribution installed beside it
    (the contrib/ packages, ...): disabling them leaves only what a test installs itself."""
    from furlong.core.plugins.discovery import read_entry_points

    return sorted({f"furlong:{name}" for name in furlong_entry_points}
                  | {f"{record.dist}:{record.name}" for record in read_entry_points()})


@pytest.fixture
def load_plugins(monkeypatch, installed_plugins):
    """``load_plugins(disable=())``: a fresh manager with furlong's own built-ins disabled.

    For tests whose expected text lists the plugins of a hook: only the distributions the
    test made with ``plugin_dist`` (and what it registers itself) are seen. Built-ins and
    other installed plugin distributions are disabled the way a user would, with
    ``DIST:NAME``.
    """
    from furlong.core.plugins.manager import get_plugin_manager

    monkeypatch.delenv("FURLONG_DISABLE_PLUGINS", raising=False)
    monkeypatch.delenv("FURLONG_TRACE_HOOKS", raising=False)

    def load(disable=()):
        return get_plugin_manager(installed_plugins + list(disable))

    return load


@pytest.fixture
def run_furlong(tmp_path):
    """``run_furlong(*argv, sites=(), env=None)``: run ``python -m furlong.core`` in a subprocess.

    ``sites`` (folders from ``plugin_dist``) go first on ``PYTHONPATH``; ``env`` adds
    variables. ``FURLONG_DISABLE_PLUGINS``/``FURLONG_TRACE_HOOKS`` are cleared unless
    given. Runs in ``tmp_path``; returns the ``CompletedProcess`` (text, captured).
    """

    def run(*argv: str, sites=(), env: dict[str, str] | None = None, timeout: float = 120):
        full_env = {k: v for k, v in os.environ.items()
                    if k not in ("FURLONG_DISABLE_PLUGINS", "FURLONG_TRACE_HOOKS", "PYTHONPATH")}
        paths = [str(s) for s in sites] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        if paths:
            full_env["PYTHONPATH"] = os.pathsep.join(paths)
        full_env.update(env or {})
        return subprocess.run(
            [sys.executable, "-m", "furlong.core", *argv],
            cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=timeout,
        )

    return run


# --- end-to-end runs -------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_torch_thread():
    """Two cores are shared by parallel work; torch's spinning thread pool makes tiny models crawl."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama with a character tokenizer (tests/tiny_model.py), built once per session."""
    from .tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model") / "model")


@pytest.fixture(scope="session")
def tiny_moe_model_dir(tmp_path_factory):
    """A tiny random Qwen3-MoE (4 experts, top 2) with the character tokenizer, built once per session."""
    from .tiny_model import build_tiny_moe_model

    return build_tiny_moe_model(tmp_path_factory.mktemp("tiny_moe_model") / "model")


@pytest.fixture(scope="session")
def arithmetic_jsonl(tmp_path_factory):
    """60 prompts ``a+b=`` with integer labels, as JSONL (``prompt``/``label``)."""
    import json

    path = tmp_path_factory.mktemp("data") / "arith.jsonl"
    rows = [{"prompt": f"{a}+{b}=", "label": str(a + b)} for a in range(10) for b in range(6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def cpu_machine(monkeypatch):
    """The same flag defaults on every machine: no CUDA, no SGLang, no megatron-core.

    Use with ``pytestmark = pytest.mark.usefixtures("cpu_machine")``.
    """
    import furlong.core.config.env as env

    monkeypatch.setattr(env, "cuda_available", lambda: False)
    monkeypatch.setattr(env, "sglang_available", lambda: False)
    monkeypatch.setattr(env, "megatron_available", lambda: False)


@pytest.fixture
def signal_after_rollout_1(tmp_path):
    """``signal_after_rollout_1(signum, *argv, ignored=(), blocked=())``: run ``python *argv`` in ``tmp_path``
    (one torch thread, a private Ray), send it ``signum`` once it prints rollout 1's summary line, and return
    ``(exit code, stdout and stderr)``.

    The process starts with default signal actions and an empty mask, then ignores ``ignored`` and blocks
    ``blocked``, as if its parent had (furlong.hooks.testing.processes). A process that has not exited 120 s
    after the signal is killed and fails the test.
    """
    from furlong.hooks.testing.processes import signal_state

    def run(signum: int, *argv: str, ignored=(), blocked=()) -> tuple[int, str]:
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env["OMP_NUM_THREADS"] = "1"
        proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env, cwd=tmp_path, preexec_fn=signal_state(ignored, blocked))
        output = []
        try:
            for line in proc.stdout:
                output.append(line)
                if line.startswith("rollout    1 "):
                    proc.send_signal(signum)
                    break
            try:
                output.append(proc.communicate(timeout=120)[0])
            except subprocess.TimeoutExpired:
                proc.kill()
                output.append(proc.communicate()[0])
                pytest.fail(f"still running 120 s after signal {signum}:\n{''.join(output)[-3000:]}")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        return proc.returncode, "".join(output)

    return run


@pytest.fixture(scope="session")
def serve_server(tiny_model_dir, tmp_path_factory):
    """One ``furlong serve`` process on the tiny model for the session (tests/serve_helpers.py).

    Tests that change its weights, weight version or pause state put them back.
    """
    from .serve_helpers import running_server

    with running_server(tiny_model_dir, log_dir=tmp_path_factory.mktemp("serve")) as server:
        yield server


# --- order and repetition -------------------------------------------------------------


def pytest_addoption(parser):
    group = parser.getgroup("furlong", "furlong's test order checks (tests/conftest.py's module doc)")
    group.addoption("--repeat", type=int, default=1, metavar="N", help="run every selected test N times")
    group.addoption("--shuffle", type=int, default=None, metavar="SEED",
                    help="run the selected tests in an order shuffled with SEED (the same SEED, the same order)")


_PRIVATE_TMP: list[str] = []


def pytest_configure(config):
    config.addinivalue_line("markers", "signals: sends a signal to a process the test started (tests/conftest.py)")
    _private_temp_folder()


def _private_temp_folder() -> None:
    """Point TMPDIR (for this process and every process it starts) at a folder of its own, removed at the end.

    What the tests' processes write to "the system's temporary folder" (the log of a server a
    test killed, which furlong keeps for its user; weight buckets; Ray's session files, which
    Ray puts under TMPDIR on Linux) then goes with the test run. The name stays short: Ray's
    socket paths below it must fit in 107 bytes.
    """
    import tempfile

    folder = tempfile.mkdtemp(prefix="fl-", dir="/tmp" if os.path.isdir("/tmp") else None)
    os.environ["TMPDIR"] = folder
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    _PRIVATE_TMP.append(folder)


def pytest_unconfigure(config):
    import shutil

    for folder in _PRIVATE_TMP:
        shutil.rmtree(folder, ignore_errors=True)


def pytest_generate_tests(metafunc):
    """``--repeat N``: every test once per round, as if parametrized with ``round0`` ... ``round<N-1>``."""
    rounds = metafunc.config.getoption("repeat", 1)
    if rounds > 1:
        metafunc.fixturenames.append("repeat_round")  # a parameter the test function does not take
        metafunc.parametrize("repeat_round", range(rounds), ids=[f"round{i}" for i in range(rounds)])


def pytest_collection_modifyitems(config, items):
    """``--shuffle SEED``: the collected tests in a seeded random order (every xdist worker collects the same)."""
    seed = config.getoption("shuffle", None)
    if seed is not None:
        random.Random(seed).shuffle(items)


# Modules whose tests start Ray, servers or routers, or look for leftover ones: one after the other on one worker
# (another worker's processes would look like leftovers, and a test that kills an actor by name could find them).
PROCESS_MODULES = ("test_ray_executor.py", "test_sglang_engine.py", "test_sglang_conformance.py", "test_sglang_cleanup.py", "test_sglang_launch.py",
                   "test_serve.py", "test_serve_fixtures.py", "test_opd_teacher.py", "test_serve_routed_experts.py",
                   "contrib/tool-use/tests/")


def pytest_xdist_make_scheduler(config, log):
    """Under ``-n N`` (pyproject's addopts): each module runs whole on one worker (its module-scoped fixtures are
    built once), and the modules of :data:`PROCESS_MODULES` all on the same worker."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "processes" if any(m in module for m in PROCESS_MODULES) else module

    return ModuleScheduling(config, log)
