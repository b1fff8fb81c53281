"""Flags of Miles and Megatron-LM beyond the ones furlong defines in the other flag modules.

- ``miles``: the Miles flags furlong implements here (epochs, train env vars, chunked
  log-probs, dynamic global batch, rollout fault tolerance, LoRA).
- Miles' backend flags (:data:`MILES_BACKEND_FLAGS`): handed to the train backend like
  Megatron's, judged by what it declares (:class:`furlong.hooks.MegatronFlags`).
- every other flag of Miles' table (``data/miles_args.json``): accepted with its arity and
  refused when given ("not supported yet", :func:`miles_refused`).
- every flag of Megatron-LM's table (``data/megatron_args.json``) that no other module
  defines: accepted with its arity, handed to the train backend.

Table flags are left out of ``--help`` (over a thousand); docs/flags.md says where they go.
"""

from __future__ import annotations

import argparse

from ._util import MEGATRON_ONLY, json_object, megatron
from .tables import add_row, megatron_table, miles_table

__all__ = ["MILES_BACKEND_FLAGS", "add_megatron", "add_miles", "miles_refused"]

# Miles flags that only a train backend can act on (LoRA, Megatron conversion and hooks):
# handed to the backend with the Megatron flags and reported by the same rule when it
# ignores them (furlong.hooks.MegatronFlags).
MILES_BACKEND_FLAGS: frozenset[str] = frozenset({
    "lora_rank", "lora_alpha", "lora_dropout", "target_modules", "exclude_modules",
    "megatron_to_hf_mode", "data_pad_size_multiplier", "custom_megatron_init_path",
    "custom_megatron_before_log_prob_hook_path", "custom_megatron_before_train_step_hook_path",
    "extra_high_precision_layers_megatron", "custom_model_provider_path", "recompute_loss_function", "allgather_cp",
    "freeze_indexer", "dsa_attention_backend", "miles_dsa_topk_backend", "linear_attention_backend",
})


def add_miles(g, dev) -> None:
    """Miles flags furlong implements, then the rest of Miles' table (hidden, refused when given)."""
    g.add_argument("--num-epoch", type=int, default=None,
                   help="Epochs over --prompt-data: --num-rollout = epochs x (prompts // --rollout-batch-size), "
                        "derived once the data is loaded; saves and evaluations also happen at each epoch's end "
                        "(ignored when --num-rollout is given).")
    g.add_argument("--train-env-vars", type=json_object, default={}, metavar="JSON",
                   help="Environment variables for the train workers, as a JSON object.")
    g.add_argument("--log-probs-chunk-size", type=int, default=-1,
                   help="Compute log-probs over the vocabulary this many tokens at a time (less memory, same "
                        "values); -1: the backend's default (fsdp: 4096 tokens, all at once where the logits are not "
                        "a plain projection; megatron: 1 GiB of float32).")
    g.add_argument("--use-dynamic-global-batch-size", action="store_true",
                   help="Train each rollout in one optimizer step over all its samples (rounded down to a "
                        "multiple of the data-parallel size) instead of --global-batch-size.")
    g.add_argument("--use-fault-tolerance", action="store_true",
                   help="Check the rollout engines' health while the run goes on and restart one that fails "
                        "(--ft-components rollout).")
    g.add_argument("--ft-components", nargs="+", choices=["rollout", "train"], default=None,
                   help="Components under --use-fault-tolerance (default: rollout; train is not supported yet).")
    g.add_argument("--rollout-health-check-interval", type=float, default=30.0,
                   help="Seconds between engine health checks (--use-fault-tolerance).")
    g.add_argument("--rollout-health-check-timeout", type=float, default=30.0,
                   help="Seconds an engine may take to answer a health check before it is restarted.")
    g.add_argument("--rollout-health-check-first-wait", type=float, default=0.0,
                   help="Seconds before the first health check (model compilation, warm-up).")
    megatron(g, "--lora-rank", type=int, default=0,
             help="LoRA rank; 0 trains every weight (fsdp: peft; megatron: adapters on its linear layers).")
    megatron(g, "--lora-alpha", type=int, default=16, help="LoRA scaling numerator (scale = alpha / rank).")
    megatron(g, "--lora-dropout", type=float, default=0.0, help="Dropout on the LoRA input, in [0, 1).")
    megatron(g, "--target-modules", default=None,
             help="LoRA targets: 'all-linear' (the default) or comma-separated module names (q_proj,v_proj).")
    megatron(g, "--exclude-modules", default=None, help="Modules kept out of LoRA, comma-separated.")
    megatron(g, "--megatron-to-hf-mode", choices=["raw", "bridge"], default="raw",
             help="Megatron: how Megatron weights are converted to HF names for the engines.")
    megatron(g, "--data-pad-size-multiplier", type=int, default=128,
             help="Megatron: pad packed sequences to a multiple of TP size x this.")
    defined = set(g._option_string_actions)
    for row in miles_table().rows:
        if row.flags[0].startswith(("--sglang-", "--router-", "--eval-sglang-")):
            continue  # passed through to SGLang and its router
        action = add_row(g, row, defined, help=argparse.SUPPRESS, default=argparse.SUPPRESS)
        if action is not None:
            setattr(action, MEGATRON_ONLY, row.dest in MILES_BACKEND_FLAGS)
            action.miles_refused = row.dest not in MILES_BACKEND_FLAGS
            defined |= set(action.option_strings)


def add_megatron(g, dev) -> None:
    """Every flag of Megatron-LM's table not defined yet, with Megatron's arity, hidden.

    The attribute exists only when the flag is given (its default is Megatron's, in the
    table): ``args.megatron_args`` and ``args.megatron_argv`` hold the given ones.
    """
    defined = set(g._option_string_actions)
    for row in megatron_table().rows:
        action = add_row(g, row, defined, help=argparse.SUPPRESS, default=argparse.SUPPRESS)
        if action is not None:
            setattr(action, MEGATRON_ONLY, True)
            defined |= set(action.option_strings)


def miles_refused(parser) -> list[tuple[str, str, tuple]]:
    """``(flag, dest, (default,))`` of every Miles table flag furlong refuses when given."""
    return [(a.option_strings[0], a.dest, (a.default,)) for a in parser._actions
            if getattr(a, "miles_refused", False)]
