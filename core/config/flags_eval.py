"""Flags of the ``eval`` group. Unset eval sampling values inherit the
rollout ones (see validate.py); ``--n-samples-per-eval-prompt`` does not."""

from __future__ import annotations

__all__ = ["add"]


def add(g, dev) -> None:
    """Add the flags to argument group ``g``; ``dev`` holds the machine-dependent defaults."""
    g.add_argument("--eval-interval", type=int, default=None,
                   help="Rollouts between evaluations; needs --eval-prompt-data or --eval-config.")
    g.add_argument("--eval-prompt-data", nargs="+", default=None, metavar="NAME PATH",
                   help="Eval sets as NAME PATH pairs; a single PATH means 'aime PATH' (Miles' rule).")
    g.add_argument("--eval-config", default=None,
                   help="YAML file (or base64:...) with eval: {defaults, datasets}; replaces --eval-prompt-data.")
    g.add_argument("--skip-eval-before-train", action="store_true", help="No evaluation before the first rollout.")
    g.add_argument("--n-samples-per-eval-prompt", type=int, default=1, help="Samples per eval prompt.")
    g.add_argument("--eval-temperature", type=float, default=None,
                   help="Eval temperature, 0 = greedy (default: --rollout-temperature).")
    g.add_argument("--eval-top-p", type=float, default=None, help="Eval nucleus mass, in (0, 1] (default: --rollout-top-p).")
    g.add_argument("--eval-top-k", type=int, default=None, help="Eval top-k (default: --rollout-top-k).")
    g.add_argument("--eval-max-response-len", type=int, default=None,
                   help="Eval max new tokens (default: --rollout-max-response-len).")
    g.add_argument("--eval-input-key", default=None, help="Eval prompt field (default: --input-key).")
    g.add_argument("--eval-label-key", default=None, help="Eval label field (default: --label-key).")
    g.add_argument("--eval-tool-key", default=None, help="Eval tools field (default: --tool-key).")
    g.add_argument("--eval-max-prompt-len", type=int, default=None, help="Drop longer eval prompts (default: keep all).")
    g.add_argument("--eval-max-context-len", type=int, default=None,
                   help="Eval cap on prompt + response tokens (default: --rollout-max-context-len).")
    g.add_argument("--eval-reward-key", default=None, help="Eval reward dict key (default: --reward-key).")
    g.add_argument("--eval-function-path", default=None,
                   help="module.function replacing the eval rollout (default: the rollout function) "
                        "(not supported yet).")
    g.add_argument("--eval-num-gpus", type=int, default=0,
                   help="GPUs of a dedicated eval fleet, train-async only (not supported yet).")
    g.add_argument("--eval-num-gpus-per-engine", type=int, default=1, help="GPUs per eval engine (not supported yet).")
    g.add_argument("--eval-hf-dir", default=None, help="Where eval weight snapshots are written (not supported yet).")
    g.add_argument("--eval-max-in-flight", type=int, default=2,
                   help="Most eval snapshots evaluated at once (not supported yet).")
    g.add_argument("--eval-overflow-policy", choices=["backpressure", "skip"], default="backpressure",
                   help="What happens when more snapshots wait than --eval-max-in-flight (not supported yet).")
    g.add_argument("--eval-keep-snapshots", type=int, default=2,
                   help="Eval weight snapshots kept on disk (not supported yet).")
