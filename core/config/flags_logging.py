"""Flags of the ``logging`` and ``debugging`` groups."""

from __future__ import annotations

from ._util import megatron, port_number

__all__ = ["add_debugging", "add_logging"]


def add_logging(g, dev) -> None:
    """Add the flags to argument group ``g``; ``dev`` holds the machine-dependent defaults."""
    g.add_argument("--log-dir", default=None, help="Directory for metrics.jsonl and the loggers' files when --save is not given (with --save "
                        "they go to --save).")
    g.add_argument("--log-interval", type=int, default=1, metavar="N",
                   help="Print the console line after every N-th rollout (and the last); metrics.jsonl and the "
                        "loggers get every rollout.")
    g.add_argument("--log-passrate", action="store_true",
                   help="Log pass@k (k = 1, 2, 4, ... up to the group size) of each rollout's and evaluation's "
                        "groups; a sample passes when its reward is 1.")
    g.add_argument("--log-multi-turn", action="store_true",
                   help="Log response lengths with and without tool/observation tokens and the turns per sample "
                        "(metadata round_number): multi_turn/...")
    g.add_argument("--log-reward-category", default=None, metavar="KEY",
                   help="Log the share of samples per value of KEY in their reward dict: rollout/error_cat/<value>.")
    g.add_argument("--log-correct-samples", action="store_true",
                   help="Log the length quartiles and mean negative log-prob of the correct samples "
                        "(rollout/correct_length/pNN, rollout/correct_entropy).")
    g.add_argument("--custom-rollout-log-function-path", default=None,
                   help="module.function(rollout_id, args, samples, extra, rollout_time), run after each rollout; "
                        "returning True leaves out the default sample metrics.")
    g.add_argument("--custom-eval-rollout-log-function-path", default=None,
                   help="module.function(rollout_id, args, data, extra), run after each evaluation; returning True "
                        "leaves out the default eval/ metrics.")
    g.add_argument("--use-wandb", action="store_true", help="Log to Weights & Biases.")
    for name in ("project", "group", "mode", "dir", "key", "host", "team", "run-id"):
        g.add_argument(f"--wandb-{name}", default=None, help=f"W&B {name.replace('-', ' ')}.")
    g.add_argument("--disable-wandb-random-suffix", action="store_true", help="Use the W&B group name as is.")
    g.add_argument("--wandb-always-use-train-step", action="store_true",
                   help="Plot rollout metrics against optimizer steps.")
    g.add_argument("--use-tensorboard", action="store_true", help="Log to TensorBoard.")
    g.add_argument("--tb-project-name", default=None, help="TensorBoard log directory.")
    g.add_argument("--tb-experiment-name", default=None, help="TensorBoard run name.")
    g.add_argument("--use-mlflow", action="store_true",
                   help="Log to MLflow (pip install 'furlong[mlflow]').")
    g.add_argument("--mlflow-tracking-uri", default=None,
                   help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else a file store in "
                        "<--save or --log-dir>/mlruns).")
    g.add_argument("--mlflow-experiment-name", default="furlong", help="MLflow experiment (created when missing).")
    g.add_argument("--mlflow-run-name", default=None, help="MLflow run name (default: --wandb-group).")
    g.add_argument("--mlflow-run-id", default=None, help="Log into this existing MLflow run.")
    g.add_argument("--use-prometheus", action="store_true",
                   help="Serve the metrics as Prometheus gauges on /metrics (pip install 'furlong[prometheus]').")
    g.add_argument("--prometheus-port", type=port_number, default=None,
                   help="Port of the /metrics server (default: $PROMETHEUS_PORT, else 9090).")
    g.add_argument("--prometheus-run-name", default=None,
                   help="The run_name label of every gauge (default: --wandb-group, else furlong).")

def add_debugging(g, dev) -> None:
    """Add the flags to argument group ``g``; ``dev`` holds the machine-dependent defaults."""
    g.add_argument("--debug", action="store_true", help="Show tracebacks of usage errors.")
    g.add_argument("--print-config", action="store_true", help="Print every resolved flag as JSON and exit.")
    g.add_argument("--custom-config-path", default=None,
                   help="YAML mapping (file, or base64:...) applied after validation; each key overwrites the "
                        "attribute of that name, then everything is validated again.")
    g.add_argument("--debug-rollout-only", action="store_true",
                   help="Run the engines only (no trainer, no weight sync, no checkpoint); turns colocate and "
                        "offload off.")
    g.add_argument("--debug-train-only", action="store_true",
                   help="Run the trainer only: no engine, no weight sync, no evaluation (rollouts come from "
                        "--load-debug-rollout-data).")
    g.add_argument("--save-debug-rollout-data", default=None, metavar="PATH",
                   help="Write each rollout's samples to PATH with {rollout_id} filled in (eval rollouts: "
                        "eval_<id>).")
    g.add_argument("--load-debug-rollout-data", default=None, metavar="PATH",
                   help="Train on the rollouts --save-debug-rollout-data wrote ({rollout_id} filled in); implies "
                        "--debug-train-only.")
    g.add_argument("--dump-details", default=None, metavar="DIR",
                   help="Write each rollout's samples to DIR/rollout_data/<id>.pt and what each data-parallel rank "
                        "trained on to DIR/train_data/<id>_<rank>.pt.")
    g.add_argument("--debug-exit-after-rollout", type=int, default=None, metavar="N",
                   help="Stop after the N-th rollout of this run (counted from the rollout it starts or resumes at).")
    g.add_argument("--check-weight-update-equal", action="store_true",
                   help="After every weight sync, check that each engine's weights equal the trainer's bit for bit "
                        "(embedded engine in the driver's process).")
    g.add_argument("--deterministic-mode", action="store_true",
                   help="Deterministic torch kernels (an operation without one is an error) in every process, "
                        "cuBLAS workspace fixed, TF32 off; megatron-core's deterministic mode.")
    megatron(g, "--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad", action="store_false",
             help="Megatron: do not check loss and gradients for NaN.")
