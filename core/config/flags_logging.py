"""Flags of the ``logging`` and ``debugging`` groups."""

from __future__ import annotations

from ._util import megatron

__all__ = ["add_debugging", "add_logging"]


def add_logging(g, dev) -> None:
    """Add the flags to argument group ``g``; ``dev`` holds the machine-dependent defaults."""
    g.add_argument("--log-dir", default=None, help="Directory for metrics.jsonl and the loggers' files when --save is not given (with --save "
                        "they go to --save).")
    g.add_argument("--log-interval", type=int, default=1,
                   help="Rollouts between stdout metric lines (not supported yet).")
    g.add_argument("--log-passrate", action="store_true", help="Log pass@k over each group (not supported yet).")
    g.add_argument("--log-multi-turn", action="store_true", help="Log multi-turn statistics (not supported yet).")
    g.add_argument("--log-reward-category", default=None, metavar="KEY",
                   help="Log reward statistics per value of this metadata key (not supported yet).")
    g.add_argument("--log-correct-samples", action="store_true",
                   help="Log statistics of correct samples only too (not supported yet).")
    g.add_argument("--custom-rollout-log-function-path", default=None,
                   help="module.function(rollout_id, args, samples, extra, rollout_time); True suppresses default logs "
                        "(not supported yet).")
    g.add_argument("--custom-eval-rollout-log-function-path", default=None,
                   help="module.function(rollout_id, args, data, extra); True suppresses default logs "
                        "(not supported yet).")
    g.add_argument("--use-wandb", action="store_true", help="Log to Weights & Biases.")
    for name in ("project", "group", "mode", "dir", "key", "host", "team", "run-id"):
        g.add_argument(f"--wandb-{name}", default=None, help=f"W&B {name.replace('-', ' ')}.")
    g.add_argument("--disable-wandb-random-suffix", action="store_true", help="Use the W&B group name as is.")
    g.add_argument("--wandb-always-use-train-step", action="store_true",
                   help="Plot rollout metrics against optimizer steps.")
    g.add_argument("--use-tensorboard", action="store_true", help="Log to TensorBoard.")
    g.add_argument("--tb-project-name", default=None, help="TensorBoard log directory.")
    g.add_argument("--tb-experiment-name", default=None, help="TensorBoard run name.")
    g.add_argument("--use-mlflow", action="store_true", help="Log to MLflow (not supported yet).")
    g.add_argument("--mlflow-tracking-uri", default=None, help="MLflow tracking server (not supported yet).")
    g.add_argument("--mlflow-experiment-name", default="furlong", help="MLflow experiment (not supported yet).")
    g.add_argument("--mlflow-run-name", default=None, help="MLflow run name (not supported yet).")
    g.add_argument("--use-prometheus", action="store_true", help="Export Prometheus metrics (not supported yet).")
    g.add_argument("--prometheus-port", type=int, default=None, help="Prometheus exporter port (not supported yet).")


def add_debugging(g, dev) -> None:
    """Add the flags to argument group ``g``; ``dev`` holds the machine-dependent defaults."""
    g.add_argument("--debug", action="store_true", help="Show tracebacks of usage errors.")
    g.add_argument("--print-config", action="store_true", help="Print every resolved flag as JSON and exit.")
    g.add_argument("--custom-config-path", default=None,
                   help="YAML mapping (file, or base64:...) applied after validation; each key overwrites the "
                        "attribute of that name, then everything is validated again.")
    g.add_argument("--debug-rollout-only", action="store_true",
                   help="Run the engines only (no trainer); turns colocate and offload off (not supported yet).")
    g.add_argument("--debug-train-only", action="store_true",
                   help="Run the trainer only (no engines) (not supported yet).")
    g.add_argument("--save-debug-rollout-data", default=None,
                   help="Pickle each rollout to this path template ({rollout_id}) (not supported yet).")
    g.add_argument("--load-debug-rollout-data", default=None,
                   help="Train on pickled rollouts from this path template (implies --debug-train-only) "
                        "(not supported yet).")
    g.add_argument("--dump-details", default=None, metavar="DIR",
                   help="Dump full rollout and train details here (not supported yet).")
    g.add_argument("--debug-exit-after-rollout", type=int, default=None, metavar="K",
                   help="Stop after rollout K (not supported yet).")
    g.add_argument("--check-weight-update-equal", action="store_true",
                   help="Verify engine weights after each sync (not supported yet).")
    g.add_argument("--deterministic-mode", action="store_true", help="Deterministic kernels (not supported yet).")
    megatron(g, "--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad", action="store_false",
             help="Megatron: do not check loss and gradients for NaN.")
