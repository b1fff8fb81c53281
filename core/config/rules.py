"""Validation rules after the four knobs and the cluster, called in a fixed order by
:func:`.validate.validate`, each one appending to a :class:`furlong.hooks.ConfigReport` (the
core's own findings)."""

from __future__ import annotations

from .train_rules import pi_old_needs_own_pass, zero_advantage_skip_blocked
from .flag_access import flag_value

__all__ = ["async_and_agents", "defaults", "evaluation", "importance_sampling", "kl_and_reference", "lengths",
           "performance", "saving", "sglang"]

# eval attribute <- rollout attribute it inherits when not given.
EVAL_INHERITS: tuple[tuple[str, str], ...] = (
    ("eval_temperature", "rollout_temperature"),
    ("eval_top_p", "rollout_top_p"),
    ("eval_top_k", "rollout_top_k"),
    ("eval_max_response_len", "rollout_max_response_len"),
    ("eval_input_key", "input_key"),
    ("eval_label_key", "label_key"),
    ("eval_tool_key", "tool_key"),
    ("eval_max_context_len", "rollout_max_context_len"),
    ("eval_reward_key", "reward_key"),
)


def _unset(dest: str, args, given: set[str]) -> bool:
    return dest not in given or flag_value(args, dest) is None


def defaults(args, f, given: set[str]) -> None:
    """Defaults that follow other flags: clip, eval inheritance, caps, schedule.

    Defaults that belong to one plugin are derived by that plugin's ``configure`` hook,
    after the selection (:mod:`furlong.core.config.configure`).
    """
    if _unset("eps_clip_high", args, given):
        args.eps_clip_high = args.eps_clip
    for dest, source in EVAL_INHERITS:
        if _unset(dest, args, given):
            setattr(args, dest, flag_value(args, source))
    if "eval_temperature" in given and args.eval_temperature is not None and args.eval_temperature < 0:
        f.error(f"--eval-temperature must be >= 0 (0 = greedy), got {args.eval_temperature:g}.")
    if _unset("log_probs_max_tokens_per_gpu", args, given):
        args.log_probs_max_tokens_per_gpu = args.max_tokens_per_gpu
    if _unset("policy_ratio_level", args, given):
        args.policy_ratio_level = "token"
    if _unset("tokenizer_model", args, given):
        args.tokenizer_model = args.hf_checkpoint
    if _unset("max_position_embeddings", args, given):
        args.max_position_embeddings = args.seq_length
    if _unset("lr_decay_iters", args, given):
        steps = 1 if args.use_dynamic_global_batch_size else args.num_steps_per_rollout
        ok = isinstance(args.num_rollout, int) and isinstance(steps, int)
        args.lr_decay_iters = args.num_rollout * steps if ok else None
    if "lr_warmup_iters" in given and args.lr_warmup_iters and args.lr_warmup_fraction is not None:
        f.error("--lr-warmup-iters and --lr-warmup-fraction are exclusive; pass one.")
    steps = args.num_steps_per_rollout
    if isinstance(args.num_rollout, int) and isinstance(steps, int) and args.lr_warmup_iters \
            and args.lr_warmup_iters >= args.num_rollout * steps > 0:
        f.warn(f"--lr-warmup-iters {args.lr_warmup_iters} is not below the run's {args.num_rollout * steps} optimizer "
               f"steps (--num-rollout x --num-steps-per-rollout): the learning rate never reaches --lr.")


def kl_and_reference(args, f) -> None:
    """A KL term needs a reference model; KL goes into the rewards or into the loss."""
    users = []
    if args.use_kl_loss:
        users.append("--use-kl-loss")
    if args.kl_coef != 0:
        users.append(f"--kl-coef {args.kl_coef:g}")
    if users and not args.ref_load and not args.hf_checkpoint:
        verb = "needs" if len(users) == 1 else "need"
        f.error(f"{' and '.join(users)} {verb} a reference model: give --ref-load "
                f"(or --hf-checkpoint, used as the reference when --ref-load is absent).")
    if args.ref_update_interval is not None:
        if args.ref_update_interval < 1:
            f.error(f"--ref-update-interval must be >= 1 (rollouts between reference updates), got "
                    f"{args.ref_update_interval}.")
        elif not users:
            f.error("--ref-update-interval updates the reference model, which loads only with --use-kl-loss or "
                    "--kl-coef != 0; add one of them or drop --ref-update-interval.")
    if args.kl_coef != 0 and args.kl_loss_coef != 0:
        f.error(f"--kl-coef ({args.kl_coef:g}) and --kl-loss-coef ({args.kl_loss_coef:g}) are exclusive: the KL goes "
                f"into the rewards or into the loss, not both; set one of them to 0.")


def importance_sampling(args, f) -> None:
    """TIS, rollout log-probs, mismatch metrics, on-policy distillation."""
    if args.tis_clip < args.tis_clip_low:
        f.error(f"--tis-clip ({args.tis_clip:g}) must be at least --tis-clip-low ({args.tis_clip_low:g}): the "
                f"importance weights are clamped to [--tis-clip-low, --tis-clip].")
    if args.use_rollout_logprobs and args.use_tis:
        f.error("--use-rollout-logprobs and --use-tis are exclusive: with the engine's log-probs as the old "
                "policy the importance ratio is always 1.")
    if args.get_mismatch_metrics and not args.custom_tis_function_path:
        f.error("--get-mismatch-metrics needs --custom-tis-function-path.")
    if args.use_opd:
        if args.opd_type is None:
            f.error("--use-opd needs --opd-type sglang (a served teacher at --rm-url or --opd-teacher-urls).")
        elif args.opd_type == "megatron":
            f.error("--opd-type megatron is not supported yet: the trainer loads no teacher model. Serve the teacher "
                    "(furlong serve, or SGLang) and give --opd-type sglang --rm-url http://HOST:PORT/generate.")
        elif not args.rm_url and not args.opd_teacher_urls:
            f.error("--opd-type sglang needs the teacher's /generate URL: --rm-url, or --opd-teacher-urls NAME=URL.")
    elif args.opd_type is not None:
        f.warn(f"--opd-type {args.opd_type} does nothing without --use-opd.")
    for item in args.opd_teacher_urls or []:
        name, eq, url = item.partition("=")
        if not (name and eq and url):
            f.error(f"--opd-teacher-urls takes NAME=URL items, got {item!r}.")


def custom_tis(args, f) -> None:
    """``--custom-tis-function-path`` runs where TIS does (after train-async turned --use-tis on by default)."""
    if args.custom_tis_function_path and not (args.use_tis or args.get_mismatch_metrics):
        f.error(f"--custom-tis-function-path {args.custom_tis_function_path} is called only under --use-tis or "
                "--get-mismatch-metrics; add one of them or drop it.")


def saving(args, f, given: set[str]) -> None:
    """Flags that only mean something with --save; the --save-hf template."""
    if args.save_hf:
        try:
            args.save_hf.format(rollout_id=0)
        except (KeyError, IndexError, ValueError) as exc:
            f.error(f"--save-hf {args.save_hf}: a path template may use only {{rollout_id}} ({type(exc).__name__}: "
                    f"{exc}).")
    if args.exit_duration_in_mins is not None and args.exit_duration_in_mins <= 0:
        f.error(f"--exit-duration-in-mins must be more than 0 minutes, got {args.exit_duration_in_mins:g}.")
    if args.exit_on_missing_checkpoint and not args.load:
        f.error("--exit-on-missing-checkpoint has no effect without --load: give --load DIR or drop it.")
    if args.finetune and not args.load:
        f.warn("--finetune loads the weights of a --load checkpoint only, and there is no --load: the run starts "
               "from --ref-load / --hf-checkpoint at rollout 0 as it would without --finetune.")
    if args.save:
        if "save_interval" not in given:
            f.info(f"--save-interval defaults to {args.save_interval} rollouts (it was 10 before 0.0.8).")
        retain, every = args.save_retain_interval, args.save_interval
        if retain is not None and every and retain >= 1 and retain % every:
            f.error(f"--save-retain-interval ({retain}) must be a multiple of --save-interval ({every}), as "
                    "Megatron-LM requires: give --save-retain-interval "
                    f"{every * max(retain // every, 1)} (or drop it to keep every checkpoint).")
        return
    for dest, flag in (("save_interval", "--save-interval"), ("save_trigger_sentinel", "--save-trigger-sentinel"),
                       ("custom_megatron_post_save_hook_path", "--custom-megatron-post-save-hook-path"),
                       ("save_hf", "--save-hf"), ("save_retain_interval", "--save-retain-interval")):
        if dest in given and flag_value(args, dest) is not None:
            f.error(f"{flag} {flag_value(args, dest)} has no effect without --save: give --save DIR or drop {flag}.")


def evaluation(args, f) -> None:
    """Eval sets: NAME PATH pairs; --eval-interval needs at least one set."""
    data = args.eval_prompt_data
    if data and len(data) % 2:
        f.error(f"--eval-prompt-data takes NAME PATH pairs (or one PATH, read as 'aime PATH'); "
                f"got {len(data)} values: {' '.join(data)}.")
    if args.eval_interval is not None and not data and not args.eval_config:
        f.error(f"--eval-interval {args.eval_interval} needs an eval set: give --eval-prompt-data NAME PATH "
                f"or --eval-config FILE.")
    if args.eval_temperature == 0 and args.n_samples_per_eval_prompt > 1:
        f.warn(f"--eval-temperature 0 is greedy: the {args.n_samples_per_eval_prompt} samples per eval prompt "
               "(--n-samples-per-eval-prompt) are identical; 1 gives the same numbers faster.")
    if args.eval_sglang_passthrough and not args.eval_num_gpus:
        shown = " ".join(f"--eval-sglang-{k.replace('_', '-')}" for k in args.eval_sglang_passthrough)
        f.error(f"{shown}: --eval-sglang-* flags configure the dedicated eval fleet, which needs --eval-num-gpus > 0.")
    eval_fleet(args, f)


# the flags of the eval fleet's snapshots and dispatch, which mean nothing without --eval-num-gpus
FLEET_FLAGS = (("eval_hf_dir", "--eval-hf-dir"), ("eval_max_in_flight", "--eval-max-in-flight"),
               ("eval_overflow_policy", "--eval-overflow-policy"), ("eval_keep_snapshots", "--eval-keep-snapshots"),
               ("eval_num_gpus_per_engine", "--eval-num-gpus-per-engine"))


def eval_fleet(args, f) -> None:
    """The dedicated eval fleet (``--eval-num-gpus``, core/run/eval_fleet.py): sizes, a snapshot source, an eval
    interval; its other flags given without it do nothing (a warning)."""
    given = set(args.explicit_args)
    if args.eval_num_gpus < 0:
        f.error(f"--eval-num-gpus must be 0 (evaluate on the rollout engines) or more, got {args.eval_num_gpus}.")
    if args.eval_num_gpus_per_engine < 1:
        f.error(f"--eval-num-gpus-per-engine must be at least 1, got {args.eval_num_gpus_per_engine}.")
    if args.eval_max_in_flight < 1:
        f.error(f"--eval-max-in-flight must be at least 1 (evaluations pending at once), got {args.eval_max_in_flight}.")
    if args.eval_keep_snapshots < 0:
        f.error(f"--eval-keep-snapshots must be 0 or more, got {args.eval_keep_snapshots}.")
    if args.eval_num_gpus <= 0:
        shown = [flag for dest, flag in FLEET_FLAGS if dest in given]
        if shown:
            f.warn(f"{', '.join(shown)} {'configure' if len(shown) > 1 else 'configures'} the dedicated eval fleet and "
                   "does nothing without --eval-num-gpus N (evaluation runs on the rollout engines).")
        return
    per = args.eval_num_gpus_per_engine
    if per >= 1 and args.eval_num_gpus % per:
        f.error(f"--eval-num-gpus ({args.eval_num_gpus}) must be a multiple of --eval-num-gpus-per-engine ({per}): "
                "every eval engine gets the same number of GPUs.")
    if args.eval_interval is None:
        f.error(f"--eval-num-gpus {args.eval_num_gpus} evaluates at eval points: give --eval-interval N and "
                "--eval-prompt-data NAME PATH.")
    for dest, flag in (("debug_train_only", "--debug-train-only"), ("debug_rollout_only", "--debug-rollout-only")):
        if flag_value(args, dest):
            f.error(f"--eval-num-gpus evaluates snapshots of the trainer's weights while the engines generate; "
                    f"{flag} runs only one of the two: drop --eval-num-gpus (or {flag}).")
    if args.eval_hf_dir:
        return
    if not args.save_hf:
        f.error(f"--eval-num-gpus {args.eval_num_gpus} feeds its engines a weight snapshot at each eval point: give "
                "--eval-hf-dir DIR (snapshots written there, tmpfs such as /dev/shm/... keeps them off disk), or "
                "--save-hf PATH to evaluate the Hugging Face exports of the checkpoints.")
    elif args.eval_interval and (not args.save_interval or args.eval_interval % args.save_interval):
        f.error(f"--eval-num-gpus without --eval-hf-dir evaluates the --save-hf exports, so --eval-interval "
                f"({args.eval_interval}) must be a multiple of --save-interval ({args.save_interval}); give "
                "--eval-hf-dir DIR for snapshots of their own.")


def async_and_agents(args, f, given: set[str], command: str | None) -> None:
    """Train-async, partial rollout, agents and session servers.

    The fully async rollout's own rules live in its ``configure``; the one left here is
    a selection conflict: ``--fully-async`` and ``--rollout-function-path`` both choose
    the rollout.
    """
    if args.fully_async and args.rollout_function_path:
        f.error("--fully-async cannot be combined with --rollout-function-path (both choose the rollout).")
    if command == "train" and "update_weights_interval" in given and args.update_weights_interval != 1:
        # accepted, as Miles' synchronous loop accepts it, but said: it would otherwise do nothing unseen
        f.warn(f"--update-weights-interval {args.update_weights_interval} is read by furlong train-async only; "
               "furlong train syncs the weights after every rollout.")
    if command == "train-async" and args.colocate:
        f.error("furlong train-async cannot run with --colocate (training and generation overlap); "
                "use furlong train.")
    elif command == "train-async" and args.offload_rollout:
        f.error("furlong train-async cannot run with --offload-rollout: the engines generate the next rollout "
                "while the trainer trains, so they cannot give their memory up; use furlong train.")
    if args.colocate and args.update_weight_transfer_mode in ("p2p", "disk-delta"):
        f.error(f"--colocate cannot use --update-weight-transfer-mode {args.update_weight_transfer_mode}; "
                f"colocated engines receive weights in place.")
    if command == "train-async" and "use_tis" not in given and not args.use_rollout_logprobs:
        # measured on the demo (docs/modes.md): one step off-policy without a correction lowered the test
        # reward in every seed, --use-tis kept nearly all of the sync gain
        args.use_tis = True
        f.info("furlong train-async: --use-tis is on (rollouts are generated one or more weight versions behind "
               "the trainer); --no-use-tis trains without an off-policy correction.")
    if args.partial_rollout and args.num_steps_per_rollout and args.num_steps_per_rollout > 1 and not args.use_tis:
        f.warn(f"--partial-rollout with --num-steps-per-rollout {args.num_steps_per_rollout} trains on samples "
               f"from older policies; add --use-tis to correct for it.")
    limit = args.async_max_concurrent_samples
    if limit is not None and limit < args.n_samples_per_prompt:
        f.error(f"--async-max-concurrent-samples ({limit}) must be at least --n-samples-per-prompt "
                f"({args.n_samples_per_prompt}): a whole group is in flight at once.")
    if args.tito_model != "default" and not args.use_session_server:
        f.error(f"--tito-model {args.tito_model} needs --use-session-server.")
    if args.custom_agent_function_path and args.pause_generation_mode == "abort":
        f.error("--custom-agent-function-path cannot use --pause-generation-mode abort (agents keep their "
                "requests open across weight updates).")


def lengths(args, f, given: set[str]) -> None:
    """Prompt length cap from the context cap."""
    context = args.rollout_max_context_len
    if context is None:
        return
    if _unset("rollout_max_prompt_len", args, given):
        args.rollout_max_prompt_len = context - 1
    elif args.rollout_max_prompt_len > context - 1:
        f.error(f"--rollout-max-prompt-len ({args.rollout_max_prompt_len}) must be at most "
                f"--rollout-max-context-len - 1 ({context - 1}): a prompt needs room for one response token.")


DEFAULT_TOKENS_PER_MICRO_BATCH = 8192
"""Token budget of one micro-batch when a run sets neither ``--micro-batch-size`` nor
``--use-dynamic-batch-size`` (and no ``--max-tokens-per-gpu``): samples are packed by tokens."""


def default_packing(args, f, given: set[str]) -> None:
    """Pack micro-batches by tokens unless the run chose a micro-batch rule.

    One sample per forward pass (``--micro-batch-size 1``, the flag's default) is the slowest
    way to train; the loss is exact under any split of a step into micro-batches, so packing
    changes only the speed. ``args.packed_by_default`` names where the budget came from; the
    train group logs the choice when training starts.
    """
    if "micro_batch_size" in given or args.use_dynamic_batch_size:
        args.packed_by_default = None
        return
    args.use_dynamic_batch_size = True
    args.packed_by_default = "--max-tokens-per-gpu" if "max_tokens_per_gpu" in given else "the default budget"
    if args.max_tokens_per_gpu is None:
        args.max_tokens_per_gpu = DEFAULT_TOKENS_PER_MICRO_BATCH


def performance(args, f, given: set[str]) -> None:
    """Dynamic batching, the default token packing and where pi_old comes from (each train backend checks its
    own parallel layout in ``configure``)."""
    default_packing(args, f, given)
    _off_unless_exact(args, f, given, "reuse_train_log_probs", pi_old_needs_own_pass(args),
                      "pi_old cannot come from the training forward here")
    _off_unless_exact(args, f, given, "skip_zero_advantage_samples", zero_advantage_skip_blocked(args),
                      "a sample's loss might not vanish at zero advantage")
    if not args.keep_fp32_master and not args.bf16:
        f.error("--no-keep-fp32-master changes only --bf16 runs (without --bf16 the parameters are float32); add "
                "--bf16 or drop it.")
    cap = args.max_tokens_per_gpu
    if args.use_dynamic_batch_size:
        if cap is None:
            f.error("--use-dynamic-batch-size requires --max-tokens-per-gpu (the token cap per micro-batch per GPU).")
        elif args.rollout_max_response_len is not None and args.rollout_max_response_len > cap:
            f.warn(f"--rollout-max-response-len ({args.rollout_max_response_len}) is larger than --max-tokens-per-gpu "
                   f"({cap}): a longer sample gets a micro-batch of its own above the cap and may run out of memory.")


def _off_unless_exact(args, f, given: set[str], dest: str, reason: str | None, what: str) -> None:
    """Turn the on-by-default speed-up ``dest`` off when ``reason`` says the flags make it inexact
    (``--print-config`` shows it off); the same flag given explicitly is an error naming the reason."""
    if reason and flag_value(args, dest):
        if dest in given:
            f.error(f"--{dest.replace('_', '-')}: {what} ({reason}); drop it.")
        setattr(args, dest, False)


def sglang(args, f) -> None:
    """Pass-through values that core derives or checks."""
    sg = args.sglang_passthrough
    args.sglang_tp_size = args.rollout_num_gpus_per_engine
    user_tp = sg.pop("tp_size", None)
    if user_tp is not None and str(user_tp) != str(args.sglang_tp_size):
        f.warn(f"--sglang-tp-size {user_tp} is replaced by --rollout-num-gpus-per-engine ({args.sglang_tp_size}).")
    if args.colocate:
        prefill = sg.setdefault("cuda_graph_backend_prefill", "disabled")
        if prefill != "disabled":
            f.warn(f"--sglang-cuda-graph-backend-prefill {prefill} under --colocate may run out of memory "
                   f"(NVLS buffers); furlong's default there is 'disabled'.")
    if args.chat_template_path:
        sg.setdefault("chat_template", args.chat_template_path)
    dp = sg.get("dp_size")
    if dp is not None:
        try:
            dp_size = int(dp)
        except (TypeError, ValueError):
            f.error(f"--sglang-dp-size must be a whole number, got {dp!r}.")
            return
        if dp_size > 1 and not sg.get("enable_dp_attention"):
            f.error(f"--sglang-dp-size {dp_size} requires --sglang-enable-dp-attention.")
    if sg.get("enable_dp_attention"):
        args.router_passthrough.setdefault("dp_aware", True)
