"""The suite's split over pytest-xdist workers keeps process-starting modules together (tests/conftest.py)."""

from __future__ import annotations

import re
from pathlib import Path

from .conftest import PROCESS_MODULES

ROOT = Path(__file__).resolve().parents[1]


def test_every_module_that_takes_the_session_server_runs_with_the_process_modules():
    # a module whose tests or fixtures take serve_server starts the session's ``furlong serve``, which lives until
    # its worker's session ends: started on the other worker, it would look like a server left over by the tests
    # that check for leftovers
    takers = sorted(p.relative_to(ROOT).as_posix() for p in [*ROOT.glob("tests/test_*.py"),
                                                             *ROOT.glob("contrib/*/tests/test_*.py")]
                    if re.search(r"def \w+\([^)]*\bserve_server\b", p.read_text()))
    assert "tests/test_serve.py" in takers
    assert [t for t in takers if not any(m in t for m in PROCESS_MODULES)] == []
