"""A third-party plugin distribution, end to end: the PLUGINS.md example, pip-installed.

The files are taken from the "Write and publish a plugin in 5 minutes" section of
PLUGINS.md (the code blocks whose first line is ``# file: PATH``), so the documented
example is the one tested. ``pip install --no-build-isolation --no-deps`` needs no
network. The distribution is uninstalled when the module's tests finish, even on failure.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DIST = "furlong-exact-match"
KNOBS = ["--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4"]


def _documented_files() -> dict[str, str]:
    """``{relative path: text}`` of every ``# file: PATH`` code block in PLUGINS.md."""
    text = (REPO / "PLUGINS.md").read_text()
    files = {}
    for body in re.findall(r"```\w*\n(.*?)```", text, flags=re.S):
        first, _, rest = body.partition("\n")
        match = re.fullmatch(r"# file: (\S+)", first.strip())
        if match:
            files[match.group(1)] = rest
    return files


def _pip(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *argv], capture_output=True, text=True, timeout=150)


def _installed() -> bool:
    return _pip("show", DIST).returncode == 0


@pytest.fixture(scope="module")
def installed_plugin(tmp_path_factory):
    """Install the PLUGINS.md example into the current environment for this module."""
    root = tmp_path_factory.mktemp("plugin_project")
    files = _documented_files()
    assert sorted(files) == [f"{DIST}/furlong_exact_match.py", f"{DIST}/pyproject.toml"]
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    try:
        proc = _pip("install", "--no-build-isolation", "--no-deps", str(root / DIST))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        yield root / DIST
    finally:
        if _installed():
            _pip("uninstall", "-y", DIST)


def _furlong(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "furlong.core", *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.timeout(180)
def test_installed_plugin_is_listed_with_its_distribution_and_version(installed_plugin, tmp_path):
    proc = _furlong("plugins", "--json", "--hook", "reward", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = [row for row in json.loads(proc.stdout) if row["name"] == "exact_match"]
    assert rows == [{"name": "exact_match", "hooks": ["add_arguments", "reward"], "distribution": DIST,
                     "version": "0.1.0", "status": "ok", "detail": "furlong_exact_match"}]


@pytest.mark.timeout(180)
def test_installed_plugin_is_called_through_the_chosen_reward_hook(installed_plugin, tmp_path):
    script = textwrap.dedent("""
        import asyncio, json
        from furlong.core.config.launch_args import launch_config
        from furlong.core.plugins.manager import get_plugin_manager
        from furlong.hooks import Sample

        pm = get_plugin_manager()
        samples = [Sample(response="so the answer is\\n  ABC \\n", label="abc"),
                   Sample(response="abd", label="abc"), Sample(response="", label=""),
                   Sample(response="12</s>", label="12"), Sample(response="x\\n12<|im_end|>\\n", label="12")]
        out = {}
        for fold in (False, True):
            config = launch_config("--rm-type", "exact_match", *(["--exact-match-ignore-case"] if fold else []), pm=pm)
            out[str(fold)] = asyncio.run(pm.call_chosen("reward", "exact_match", "--rm-type",
                                                        config=config, samples=samples))
        # --rm-type boxed_exact_match: the core grades the last box's content in the form the plugin's
        # boxed_response gives (PLUGINS.md's example returns the content itself)
        from furlong.core.plugins.selection import resolve_selection
        from furlong.core.rollout.rewards import RewardScorer

        config = launch_config("--rm-type", "boxed_exact_match", pm=pm)
        boxed = [Sample(response="so \\\\boxed{12} and then \\\\boxed{6}", label="6"),
                 Sample(response="\\\\boxed{7}", label="6"), Sample(response="6", label="6")]
        asyncio.run(RewardScorer(config, pm, resolve_selection(config.namespace(), pm)).score(boxed))
        out["boxed"] = [s.reward for s in boxed]
        print(json.dumps([pm.origin("exact_match"), out]))
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    origin, rewards = json.loads(proc.stdout)
    assert origin == f"{DIST} 0.1.0"
    # last non-empty line vs label: "ABC" vs "abc" matches only case-folded; "abd" never; "" == "" always;
    # the end-of-sequence text a response keeps is not part of the answer
    assert rewards == {"False": [0.0, 0.0, 1.0, 1.0, 1.0], "True": [1.0, 0.0, 1.0, 1.0, 1.0],
                       "boxed": [1.0, 0.0, 0.0]}  # the last box's content; a response without a box grades as ""


@pytest.mark.timeout(180)
def test_installed_plugin_is_chosen_by_furlong_train_with_its_own_flag(installed_plugin, tmp_path):
    proc = _furlong("train", "--print-config", "--rm-type", "exact_match", "--exact-match-ignore-case", *KNOBS,
                    cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    config = json.loads(proc.stdout)
    assert config["plugins"]["reward"] == "exact_match"
    assert config["args"]["exact_match_ignore_case"] is True
    assert config["args"]["rm_type"] == "exact_match"


@pytest.mark.timeout(180)
def test_uninstalled_plugin_is_gone(installed_plugin, tmp_path):
    proc = _pip("uninstall", "-y", DIST)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    listed = _furlong("plugins", "--json", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert [row["name"] for row in json.loads(listed.stdout) if row["distribution"] == DIST] == []
