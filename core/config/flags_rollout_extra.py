"""``rollout`` group, part 2: reward and sample hooks, async and partial rollout, agents.
Plugin-selection flags live in the ``plugins`` group."""

from __future__ import annotations

__all__ = ["add"]


def add(g, dev) -> None:
    """Add the flags to argument group ``g``; ``dev`` holds the machine-dependent defaults."""
    g.add_argument("--rm-url", default=None, help="Endpoint of the remote_rm reward (and of an sglang OPD teacher).")
    g.add_argument("--reward-key", default=None, help="Key of the training scalar when rewards are dicts.")
    g.add_argument("--group-rm", action="store_true", help="Score each finished group in one reward call.")
    g.add_argument("--custom-reward-post-process-path", default=None,
                   help="module.function(args, samples) -> (raw_rewards, rewards), replacing group normalization.")
    g.add_argument("--custom-convert-samples-to-train-data-path", default=None,
                   help="module.function replacing the Sample -> train batch conversion (not supported yet).")
    g.add_argument("--rollout-sample-filter-path", default=None,
                   help="module.function(args, groups) that may mark samples remove_sample.")
    g.add_argument("--rollout-all-samples-process-path", default=None,
                   help="module.function(args, all_groups, data_source), also sees dropped groups.")
    g.add_argument("--rollout-data-postprocess-path", default=None,
                   help="module.function(args) run on the trainer after log-probs (not supported yet).")
    g.add_argument("--rollout-submission-granularity", choices=["group", "sample"], default=None,
                   help="When an in-flight slot frees in the fully async rollout: per group, or per sample "
                        "(its default).")
    g.add_argument("--partial-rollout", action="store_true",
                   help="Keep unfinished groups in a buffer and resume them next rollout.")
    g.add_argument("--mask-offpolicy-in-partial-rollout", action="store_true",
                   help="Train only on tokens generated after a partial sample resumed.")
    g.add_argument("--fully-async", action="store_true",
                   help="A producer keeps generating across rollouts (train-async only); same as --rollout fully_async.")
    g.add_argument("--update-weights-interval", type=int, default=1,
                   help="train-async: sync weights every k rollouts.")
    g.add_argument("--async-max-concurrent-samples", type=int, default=None,
                   help="Fully async: most samples in flight (floored to whole groups; at least "
                        "--n-samples-per-prompt).")
    g.add_argument("--async-data-buffer-capacity-factor", type=float, default=2.0,
                   help="Fully async: buffer holds floor(factor x rollout_batch_size) groups.")
    g.add_argument("--max-weight-staleness", type=int, default=None,
                   help="Fully async: drop or retry groups more than this many weight versions old.")
    g.add_argument("--async-unused-samples-handler", choices=["drop", "retry"], default="drop",
                   help="Fully async: what happens to aborted or stale groups.")
    g.add_argument("--custom-async-data-buffer-path", default=None,
                   help="Fully async: custom buffer class (not supported yet).")
    g.add_argument("--keep-old-actor", action="store_true",
                   help="Keep rollout-time weights to recompute old log-probs (not supported yet).")
    g.add_argument("--generate-max-turns", type=int, default=16,
                   help="generate multi_turn: most model turns per sample (default 16).")
    g.add_argument("--generate-tool-specs-path", default=None,
                   help="generate multi_turn: module.attr naming the list of tool specs (OpenAI form), or a .json file.")
    g.add_argument("--generate-tool-call-parser", default=None,
                   help="generate multi_turn: the model's tool-call format (qwen25, qwen, hermes, llama3, mistral, qwen3_coder).")
    g.add_argument("--generate-execute-tool-function-path", default=None,
                   help="generate multi_turn: module.function(name, arguments) -> str running one tool call.")
    g.add_argument("--max-seq-len", type=int, default=None,
                   help="Agents: most tokens in a trajectory (not supported yet).")
    g.add_argument("--use-session-server", nargs="?", const="v1", choices=["v1", "v2"], default=None,
                   help="Agents: route requests through a session server (not supported yet).")
    g.add_argument("--tito-model", default="default",
                   help="Agents: token-in/token-out model; values other than 'default' need --use-session-server.")
    g.add_argument("--session-server-ip", default=None, help="Agents: session server host (not supported yet).")
    g.add_argument("--session-server-port", type=int, nargs="+", default=None,
                   help="Agents: session server port(s) (not supported yet).")
