"""Flags of the ``plugins`` group: which plugin serves each hook (PLUGINS.md,
"At a glance"). Names are entry-point names of group ``furlong``, never restricted by
``choices``: any installed plugin's name works; ``furlong plugins`` lists them."""

from __future__ import annotations

__all__ = ["add"]


def add(g, dev) -> None:
    """Add the flags to argument group ``g``; ``dev`` holds the machine-dependent defaults."""
    g.add_argument("--rollout", default="sync", help="rollout plugin: sync or fully_async.")
    g.add_argument("--rollout-function-path", default=None,
                   help="module.function replacing the whole rollout; a path ending in "
                        "generate_rollout_fully_async means --rollout fully_async.")
    g.add_argument("--generate", "--agent-backend", dest="generate", default="single_turn",
                   help="generate plugin (single_turn, multi_turn, ...).")
    g.add_argument("--custom-generate-function-path", default=None,
                   help="async module.function(args, sample, sampling_params) replacing generate.")
    g.add_argument("--custom-agent-function-path", default=None,
                   help="Agent function; an abort function beside it is called on abort.")
    g.add_argument("--rm-type", default=None,
                   help="reward plugin (math, deepscaler, dapo, f1, gpqa, remote_rm, ...); boxed_NAME grades "
                        "the last \\boxed{} with NAME; a sample's metadata rm_type wins.")
    g.add_argument("--custom-rm-path", default=None,
                   help="module.function, sync or async, in one of three forms read from its parameter names: "
                        "Miles' f(args, sample) -> float | dict (with --group-rm: f(args, samples) -> list); "
                        "TRL's f(prompts, completions, **kwargs) -> list; verl's compute_score(data_source, "
                        "solution_str, ground_truth, extra_info) -> float | dict (docs/from-trl.md, "
                        "docs/from-verl.md).")
    g.add_argument("--dynamic-sampling-filter", action="extend", nargs="+", default=None, metavar="NAME",
                   help="filter plugins, applied in order (repeatable), e.g. check_reward_nonzero_std.")
    g.add_argument("--dynamic-sampling-filter-path", default=None,
                   help="module.function(args, samples) -> bool | FilterResult, after the named filters.")
    g.add_argument("--buffer-filter", default="pop_first", help="buffer_pop plugin for partial rollout.")
    g.add_argument("--buffer-filter-path", default=None,
                   help="module.function(args, rollout_id, buffer, num_samples) replacing buffer_pop.")
    g.add_argument("--advantage-estimator", default="grpo",
                   help="advantage plugin: grpo, gspo, ppo, reinforce_plus_plus, reinforce_plus_plus_baseline, "
                        "on_policy_distillation, or any installed one.")
    g.add_argument("--custom-advantage-function-path", default=None,
                   help="module.function(args, batch) -> AdvantageOutput replacing the estimator.")
    g.add_argument("--loss-type", default="policy_loss",
                   help="loss plugin: policy_loss, sft_loss, custom_loss (with --custom-loss-function-path).")
    g.add_argument("--custom-loss-function-path", default=None,
                   help="module.function(args, batch) -> LossOutput (the loss hook's signature).")
    g.add_argument("--rollout-backend", default=dev.rollout_backend,
                   help="rollout_engine plugin: embedded, or sglang (the default when its furlong plugin, "
                        "CUDA and the sglang package are all present).")
    g.add_argument("--train-backend", default=dev.train_backend,
                   help="train_backend plugin: fsdp, or megatron (the default when its furlong plugin, CUDA "
                        "and megatron-core are all present).")
    g.add_argument("--data-source", default="jsonl", help="data_source plugin.")
    g.add_argument("--data-source-path", default=None, help="Custom data source class (module.Class).")
    g.add_argument("--disable-plugins", action="append", default=[], metavar="NAME[,DIST:NAME]",
                   help="Plugins not to load (repeatable; also FURLONG_DISABLE_PLUGINS).")
