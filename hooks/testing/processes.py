"""Start a test's child process in a known signal state, whatever state the test runner is in.

A child inherits its parent's signal mask and the signals its parent ignores (SIG_IGN survives
``exec``). A test that starts ``furlong train`` or ``furlong serve`` and then sends it a signal
would otherwise depend on the process pytest runs in: an xdist worker after some other test, a
CI script's background job (SIGINT ignored), a launcher that blocks SIGINT. Pass
``preexec_fn=signal_state()`` to ``subprocess.Popen`` or ``subprocess.run``::

    from furlong.hooks.testing.processes import signal_state

    proc = subprocess.Popen([sys.executable, "-m", "furlong.core", "serve", ...], preexec_fn=signal_state())
    proc.send_signal(signal.SIGTERM)

``signal_state(ignored={signal.SIGINT})`` or ``signal_state(blocked={signal.SIGINT})`` starts the
child in one of those inherited states on purpose.
"""

from __future__ import annotations

import signal
from typing import Callable, Collection

__all__ = ["signal_state"]

# Computed here, not in the child: a preexec function runs between fork and exec and should do little.
_RESETTABLE = sorted(signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP})


def signal_state(ignored: Collection[int] = (), blocked: Collection[int] = ()) -> Callable[[], None]:
    """A ``preexec_fn`` giving the child every signal's default action and an empty signal mask, then
    ignoring ``ignored`` and blocking ``blocked``."""
    ignored, blocked = frozenset(ignored), frozenset(blocked)

    def reset() -> None:
        for signum in _RESETTABLE:
            signal.signal(signum, signal.SIG_IGN if signum in ignored else signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    return reset
