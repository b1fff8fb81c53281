"""The repository cites only what it holds, and the documentation says what the code does."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def _tracked(suffix: str = "") -> list[Path]:
    names = subprocess.run(["git", "ls-files", f"*{suffix}"], cwd=REPO_ROOT, capture_output=True, text=True,
                           check=True).stdout.splitlines()
    return [REPO_ROOT / name for name in names]


def test_the_docs_cite_no_markdown_file_the_repository_lacks():
    """A page that cites a markdown file the repository does not hold sends readers nowhere."""
    have = {path.name for path in _tracked(".md")}
    missing = []
    for page in _tracked(".md"):
        for name in set(re.findall(r"\b([A-Z][A-Z_-]*\.md)\b", page.read_text(encoding="utf-8"))):
            if name not in have:
                missing.append(f"{page.relative_to(REPO_ROOT)}: {name}")
    assert sorted(missing) == []


# Design notes that were never part of the repository, and the folder beside it that held
# them. Built from parts so that this file does not itself mention them.
_OUTSIDE = re.compile(r"\b(?:%s)\.md\b|(?:\.\./|/work/)%s\b" % (
    "|".join(["SPEC", "DESIGN", "STYLE", "CASES", "RAY_SGLANG", "MEGATRON"]), "shared"))


def test_no_tracked_file_points_outside_the_repository():
    """Code, docstrings, tests, docs and scripts cite only pages a clone holds: a pointer to the
    design notes or the folder they were kept in sends a maintainer nowhere."""
    found = []
    for path in _tracked():
        if not path.is_file():
            continue  # deleted in the working tree, not yet committed
        data = path.read_bytes()
        if b"\0" in data:
            continue  # binary (weights)
        for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
            if _OUTSIDE.search(line):
                found.append(f"{path.relative_to(REPO_ROOT)}:{number}: {line.strip()}")
    assert not found, "lines that point outside the repository:\n" + "\n".join(found)


def test_the_debugging_group_lists_the_modes_that_work_and_the_refused_table_does_not():
    from furlong.core.config.unsupported import UNSUPPORTED

    text = (REPO_ROOT / "docs" / "flags.md").read_text(encoding="utf-8")
    row = next(line for line in text.splitlines() if line.startswith("| debugging |"))
    assert "refused" not in row
    for flag in ("--debug-rollout-only", "--debug-train-only", "--dump-details", "--check-weight-update-equal"):
        assert f"`{flag}`" in row
        assert flag not in {r.flag for r in UNSUPPORTED}
        assert f"| `{flag}`" not in text  # no row of the refused table starts with it


def test_the_math_section_describes_a_response_without_a_box_as_the_code_grades_it():
    import asyncio

    from furlong.builtin_plugins.rewards.math_reward import reward
    from furlong.hooks import Sample

    from .configs import flag_defaults

    text = (REPO_ROOT / "PLUGINS.md").read_text(encoding="utf-8")
    section = text[text.index("#### `math`"):text.index("#### `deepscaler`")]
    assert "no box scores 0" not in section and "`Answer: X`" in section
    samples = [Sample(response="So 7 + 5 = 12.\nAnswer: 12", label="12"), Sample(response="12", label="12"),
               Sample(response="It is \\boxed{1", label="1")]
    assert asyncio.run(reward(flag_defaults(), samples)) == [1, 0, 0]


def test_the_miles_style_demo_needs_nothing_run_first():
    head = (REPO_ROOT / "examples" / "launch" / "miles_style_demo.sh").read_text(encoding="utf-8").split("set -euo")[0]
    assert "nothing to run first" in head
    assert not re.search(r"^#\s+python examples/demo/make_demo\.py", head, re.M)
