"""Flags of the ``SGLang and router`` group. Every other ``--sglang-X`` and
``--router-X`` flag passes through to SGLang / the router (see passthrough.py)."""

from __future__ import annotations

from ._util import port_number

__all__ = ["add"]

MIB = 1 << 20


def add(g, dev) -> None:
    """Add the flags to argument group ``g``; ``dev`` holds the machine-dependent defaults."""
    g.add_argument("--sglang-router-ip", default=None,
                   help="Use this running router (no router is launched; engines register with it).")
    g.add_argument("--sglang-router-port", type=port_number, default=None, help="Port of the router.")
    g.add_argument("--sglang-router-policy", default=None,
                   help="Router policy; consistent_hashing and manual add a per-sample routing key header.")
    g.add_argument("--sglang-router-request-timeout-secs", type=int, default=14400, help="Router request timeout.")
    g.add_argument("--sglang-server-concurrency", type=int, default=512,
                   help="In-flight requests per engine (rollout semaphore = this x engines).")
    g.add_argument("--update-weight-transfer-mode", choices=["broadcast", "p2p", "disk-delta"], default="broadcast",
                   help="How weights reach separate engines (p2p and disk-delta are not supported yet).")
    g.add_argument("--update-weight-buffer-size", type=int, default=512 * MIB, help="Weight-sync bucket size in bytes.")
    g.add_argument("--pause-generation-mode", choices=["abort", "retract", "in_place"], default="retract",
                   help="How engines pause during weight updates.")
    g.add_argument("--rollout-external", action="store_true",
                   help="Use SGLang servers someone else started (--rollout-backend sglang).")
    g.add_argument("--rollout-external-engine-addrs", nargs="+", default=None, metavar="HOST:PORT",
                   help="Addresses of the running servers for --rollout-external, one engine each.")
