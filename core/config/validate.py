"""Derivations and validation of the parsed flags, in the fixed order of :func:`validate`.

:func:`validate` mutates the Namespace (derived values) and returns every problem at
once; warnings and info lines are returned too, so a second pass (after a
``--custom-config-path`` overlay) does not log them twice. A derivation fills an
attribute only when its flag was not given (``args.explicit_args``), so running it
again on overlaid values gives the same result as running it once.
"""

from __future__ import annotations

import os

from furlong.hooks.config_report import ConfigReport

from ..plugins.discovery import disabled_problems
from ..plugins.miles_paths import MILES_FLAG_CHOICES, miles_builtin
from . import env, rules
from .fp8_sources import fp8_sources
from .knobs import KNOBS, resolve_knobs
from .unsupported import no_effect_warnings, unsupported_problems
from .eval_config import LONE_PATH_NAME
from .flag_access import flag_value

__all__ = ["validate"]

FULLY_ASYNC_SUFFIX = "generate_rollout_fully_async"

# (attribute, smallest allowed value): checked only when the value is not None.
MINIMUMS: tuple[tuple[str, int], ...] = (
    ("actor_num_nodes", 1), ("actor_num_gpus_per_node", 1), ("rollout_num_gpus", 1),
    ("rollout_num_gpus_per_engine", 1), ("num_gpus_per_node", 1), ("num_rollout", 0),
    ("micro_batch_size", 1), ("max_sampling_waves", 1), ("over_sampling_batch_size", 1),
    ("n_samples_per_eval_prompt", 1), ("eval_interval", 1), ("save_interval", 1),
    ("update_weights_interval", 1), ("log_interval", 1), ("sglang_server_concurrency", 1),
    ("debug_exit_after_rollout", 1), ("save_retain_interval", 1), ("exit_interval", 1),
    ("max_tokens_per_gpu", 1), ("tensor_model_parallel_size", 1), ("pipeline_model_parallel_size", 1),
    ("context_parallel_size", 1), ("expert_model_parallel_size", 1), ("dp_replicate_size", 1),
    ("rollout_max_response_len", 1), ("eval_max_response_len", 1), ("rollout_max_prompt_len", 1),
    ("eval_max_prompt_len", 1), ("lr", 0), ("min_lr", 0), ("weight_decay", 0), ("clip_grad", 0),
    ("lr_warmup_iters", 0), ("eps_clip", 0), ("eps_clip_high", 0), ("kl_loss_coef", 0), ("kl_coef", 0),
    ("value_clip", 0), ("critic_lr", 0), ("critic_lr_warmup_iters", 0), ("num_critic_only_steps", 0),
    ("lr_warmup_init", 0), ("adam_eps", 0), ("tis_clip_low", 0), ("opd_kl_coef", 0), ("train_memory_margin_bytes", 0),
)

# (attribute, interval between 0 and 1 written with its brackets): probabilities, fractions and factors
# that mean nothing outside it; checked only when the value is not None.
FRACTIONS: tuple[tuple[str, str], ...] = (
    ("rollout_top_p", "(0, 1]"), ("eval_top_p", "(0, 1]"), ("gamma", "[0, 1]"), ("lambd", "[0, 1]"),
    ("lr_warmup_fraction", "[0, 1]"), ("adam_beta1", "[0, 1)"), ("adam_beta2", "[0, 1)"),
    ("lora_dropout", "[0, 1)"), ("attention_dropout", "[0, 1)"), ("hidden_dropout", "[0, 1)"),
    ("rotary_percent", "(0, 1]"),
)


def validate(args, command: str | None = None) -> ConfigReport:
    """Derive defaults and check every rule; collect all problems.

    :param args: the parsed Namespace; ``args.explicit_args`` lists the attributes given
        on the command line (or by an overlay).
    :param command: ``"train"`` or ``"train-async"`` enables the checks that depend on
        the loop; None skips them.
    :returns: a :class:`~furlong.hooks.ConfigReport` of the core's findings; the caller
        raises ``ConfigError`` when it has errors.
    """
    f = ConfigReport(plugin="core")  # the core reports the way plugins' configure hooks do
    given = set(args.explicit_args)
    _normalize(args, f, given)
    for message in unsupported_problems(args):
        f.error(message)
    for message in no_effect_warnings(args):
        f.warn(message)
    _basic_values(args, f)
    _four_knobs(args, f, given)
    args.data_parallel_size = world_size(args)  # until the train backend's configure reports its rule
    args.use_critic = False  # until a chosen plugin's configure asks for one (report.use_critic)
    _cluster(args, f, given)
    _offload(args, f, given)
    rules.defaults(args, f, given)
    _over_sampling(args, f, given)
    rules.kl_and_reference(args, f)
    fp8_sources(args, f)
    rules.importance_sampling(args, f)
    rules.saving(args, f, given)
    rules.evaluation(args, f)
    rules.async_and_agents(args, f, given, command)
    rules.custom_tis(args, f)
    rules.lengths(args, f, given)
    rules.performance(args, f, given)
    rules.sglang(args, f)
    return f


def _check_disabled_plugins(args, f: ConfigReport) -> None:
    """A ``--disable-plugins`` or ``FURLONG_DISABLE_PLUGINS`` name (or ``DIST:NAME``) that no installed entry
    point has is a typo that would otherwise leave the plugin meant loaded."""
    for problem in disabled_problems(args.disable_plugins):
        f.error(problem)


def _normalize(args, f: ConfigReport, given: set[str]) -> None:
    """Spellings that mean the same thing become one."""
    args.disable_plugins = [p.strip() for item in args.disable_plugins or [] for p in item.split(",") if p.strip()]
    _check_disabled_plugins(args, f)
    path = args.rollout_function_path
    fully_async = MILES_FLAG_CHOICES["fully_async"][1]  # the rollout plugin --fully-async chooses
    builtin = fully_async if path and path.endswith(FULLY_ASYNC_SUFFIX) else miles_builtin(path, "rollout")
    if builtin is not None:
        f.info(f"--rollout-function-path {path}: furlong's built-in plugin '{builtin}' does this; using it "
               f"(--rollout {builtin}).")
        args.rollout_function_path = None
        args.fully_async = args.fully_async or builtin == fully_async
        if "rollout" not in given:
            args.rollout = builtin
    if args.fully_async and args.rollout != fully_async:
        if "rollout" in given:
            f.error(f"--fully-async and --rollout {args.rollout} both choose the rollout; pass only one.")
        else:
            args.rollout = fully_async
    args.fully_async = args.rollout == fully_async
    if args.moe_token_dispatcher_type == "allgather":
        args.moe_token_dispatcher_type = "alltoall"
        f.info("--moe-token-dispatcher-type allgather is run as alltoall.")
    if args.use_rollout_routing_replay and not args.use_routing_replay:
        args.use_routing_replay = True
        f.info("--use-rollout-routing-replay implies --use-routing-replay.")
    if args.dump_details and not args.save_debug_rollout_data:
        args.save_debug_rollout_data = os.path.join(args.dump_details, "rollout_data", "{rollout_id}.pt")
    if args.load_debug_rollout_data and not args.debug_train_only:
        args.debug_train_only = True
        f.info("--load-debug-rollout-data implies --debug-train-only.")
    if args.debug_rollout_only and args.debug_train_only:
        f.error("--debug-rollout-only and --debug-train-only are exclusive: the first runs only the engines, "
                "the second only the trainer.")
    if args.eval_prompt_data and len(args.eval_prompt_data) == 1:
        args.eval_prompt_data = [LONE_PATH_NAME, args.eval_prompt_data[0]]
        args.eval_prompt_data_lone = True


def _basic_values(args, f: ConfigReport) -> None:
    if args.num_rollout is None and args.num_epoch is None:
        f.error("--num-rollout is required: give the number of rollout iterations to run "
                "(it used to default to 1000; --num-rollout 0 only evaluates).")
    elif args.num_rollout is not None and args.num_epoch is not None:
        f.info("--num-rollout is given: --num-epoch is ignored.")
    elif args.num_rollout is None:
        f.info(f"--num-rollout comes from --num-epoch {args.num_epoch} once the data is loaded.")
    if args.num_epoch is not None and args.num_epoch < 1:
        f.error(f"--num-epoch must be at least 1, got {args.num_epoch}.")
    _fault_tolerance(args, f)
    for dest, low in MINIMUMS:
        value = flag_value(args, dest)
        if value is not None and value < low:
            f.error(f"--{dest.replace('_', '-')} must be at least {low}, got {value:g}.")
    if args.rollout_temperature <= 0:
        f.error(f"--rollout-temperature must be > 0, got {args.rollout_temperature:g} "
                f"(greedy decoding is for evaluation only: --eval-temperature 0).")
    for dest, interval in FRACTIONS:
        value = flag_value(args, dest)
        if value is not None and not _within(value, interval):
            f.error(f"--{dest.replace('_', '-')} must be in {interval}, got {value:g}.")
    for dest in ("rollout_top_k", "eval_top_k"):
        value = flag_value(args, dest)
        if value is not None and value != -1 and value < 1:
            f.error(f"--{dest.replace('_', '-')} must be -1 (off) or at least 1, got {value}.")
    start, total = args.start_rollout_id, args.num_rollout
    if start is not None and total is not None and total > 0 and start >= total:
        f.error(f"--start-rollout-id {start} is not below --num-rollout {total}: there is nothing to run.")
    if args.eps_clip_c is not None and args.eps_clip_c <= 1:
        f.error(f"--eps-clip-c must be greater than 1 (the dual-clip bound), got {args.eps_clip_c:g}.")
    if args.fp16:
        if args.bf16 and "bf16" in args.explicit_args:
            f.error("--bf16 and --fp16 are exclusive; pass one.")
        args.bf16 = False


def _within(value: float, interval: str) -> bool:
    """Is ``value`` in ``interval``, written ``(0, 1]``, ``[0, 1)``...: bounds 0 and 1, brackets open or closed?"""
    above = value > 0 if interval[0] == "(" else value >= 0
    below = value < 1 if interval[-1] == ")" else value <= 1
    return above and below


def _fault_tolerance(args, f: ConfigReport) -> None:
    """``--use-fault-tolerance``: rollout engines only; positive health-check timings."""
    components = args.ft_components or []
    if components and not args.use_fault_tolerance:
        f.warn(f"--ft-components {' '.join(components)} is ignored without --use-fault-tolerance.")
    if args.use_fault_tolerance and "train" in components:
        f.error("--ft-components train is not supported yet (train-worker fault tolerance); use rollout.")
    for dest in ("rollout_health_check_interval", "rollout_health_check_timeout"):
        if flag_value(args, dest) <= 0:
            f.error(f"--{dest.replace('_', '-')} must be > 0 seconds, got {flag_value(args, dest):g}.")
    if args.rollout_health_check_first_wait < 0:
        f.error(f"--rollout-health-check-first-wait must be >= 0 seconds, got {args.rollout_health_check_first_wait:g}.")


def world_size(args) -> int:
    return args.actor_num_nodes * args.actor_num_gpus_per_node


def _four_knobs(args, f: ConfigReport, given: set[str]) -> None:
    values = {k: flag_value(args, k) for k in KNOBS}
    knobs, problem = resolve_knobs(values, given & set(KNOBS))
    if problem:
        f.error(problem)
        return
    for k, v in knobs.items():
        setattr(args, k, v)


def _cluster(args, f: ConfigReport, given: set[str]) -> None:
    if args.debug_rollout_only and (args.colocate or args.offload):
        f.info("--debug-rollout-only turns --colocate and --offload off.")
        args.colocate = args.offload = False
    world = world_size(args)
    if args.colocate:
        if "rollout_num_gpus" in given and args.rollout_num_gpus != world:
            f.warn(f"--rollout-num-gpus {args.rollout_num_gpus} is ignored under --colocate: the engines share "
                   f"the trainer's {world} GPUs (actor_num_nodes x actor_num_gpus_per_node).")
        args.rollout_num_gpus = world


_OFFLOAD_FLAGS = (("--colocate", "colocate"), ("--offload", "offload"), ("--offload-train", "offload_train"),
                  ("--offload-rollout", "offload_rollout"))


def _offload(args, f: ConfigReport, given: set[str]) -> None:
    for dest in ("offload_train", "offload_rollout"):
        if dest not in given or flag_value(args, dest) is None:
            setattr(args, dest, bool(args.offload or args.colocate))
    if args.debug_rollout_only:
        args.offload_train = args.offload_rollout = False
    asked = [flag for flag, dest in _OFFLOAD_FLAGS if dest in given and flag_value(args, dest)]
    on_this_machine = int(args.actor_num_nodes or 1) == 1  # (several nodes: the trainer's GPUs are elsewhere)
    if asked and (args.offload_train or args.offload_rollout) and on_this_machine and not env.cuda_available():
        f.warn(f"{', '.join(asked)}: offloading to host memory changes nothing on this machine, which has no GPU "
               "(the weights and optimizer state are in host memory already).")


def _over_sampling(args, f: ConfigReport, given: set[str]) -> None:
    rbs = args.rollout_batch_size
    if "over_sampling_batch_size" not in given or args.over_sampling_batch_size is None:
        args.over_sampling_batch_size = rbs
    elif rbs is not None and args.over_sampling_batch_size < rbs:
        f.error(f"--over-sampling-batch-size ({args.over_sampling_batch_size}) must be at least "
                f"--rollout-batch-size ({rbs}): each wave draws at least one rollout's worth of prompts.")
