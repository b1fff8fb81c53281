"""The run configuration every hook but ``add_arguments`` and ``configure`` receives: typed, frozen, built once.

``furlong train`` parses its flags, lets every chosen plugin derive and check its own in
``configure`` (on the mutable ``argparse.Namespace`` of that set-up step), and then freezes
the result into one :class:`RunConfig`. From then on nothing changes it: core and plugins
read typed fields, never ``getattr`` with a default of their own, and what varies per call
(an engine's index, an evaluation set) is a hook argument.

- One field per flag furlong core defines, named like the flag's attribute (``--lr`` ->
  ``config.lr``), typed as the flag parses; lists become tuples and dicts read-only maps.
- What a run derives from its flags (``train_mode``, ``explicit_args``, ``data_parallel_size``, ...).
- Each plugin's own flags, and the values its ``configure`` derived: :meth:`RunConfig.plugin_config`.
- Megatron-LM flags given to a train backend: ``megatron_args`` and ``megatron_argv``.
- A Miles-style function that takes ``args`` gets :meth:`RunConfig.namespace`, a fresh
  ``argparse.Namespace`` holding all of the above as attributes.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Mapping
from typing import Any

import attrs

__all__ = ["FrozenMap", "PluginConfig", "RunConfig", "freeze_value", "thaw_value"]


class FrozenMap(Mapping):
    """A read-only, picklable mapping (a flag whose value is a JSON object, or a plugin's section)."""

    __slots__ = ("_data",)

    def __init__(self, data: Mapping | None = None) -> None:
        object.__setattr__(self, "_data", dict(data or {}))

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is read-only")

    def __getstate__(self) -> dict:
        return self._data

    def __setstate__(self, state: dict) -> None:
        object.__setattr__(self, "_data", dict(state))

    def __eq__(self, other: object) -> bool:
        return dict(self._data) == dict(other) if isinstance(other, Mapping) else NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._data.items(), key=repr)))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._data!r})"


class PluginConfig(FrozenMap):
    """One plugin's section of the run configuration: its flags (``dest -> value``, with the
    defaults its ``add_arguments`` declared, or the values given) and the values its
    ``configure`` derived with :meth:`ConfigReport.derive`. Read as attributes
    (``section.my_reward_scale``) or as a mapping.

    :raises AttributeError: reading a name the plugin neither declared nor derived (the
        message lists what the section holds).
    """

    __slots__ = ("_plugin", "_others")

    def __init__(self, plugin: str, data: Mapping | None = None, others: tuple[str, ...] = ()) -> None:
        super().__init__(data)
        object.__setattr__(self, "_plugin", plugin)
        object.__setattr__(self, "_others", others)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self._data[name]
        except KeyError:
            if self._data:
                held = f"its section holds: {', '.join(sorted(self._data))}"
            else:
                others = ", ".join(sorted(self._others)) or "none"
                held = f"it has no section: it added no flag, or no plugin is called that; sections: {others}"
            raise AttributeError(f"plugin '{self._plugin}' has no flag or derived value '{name}' ({held})") from None

    def __getstate__(self) -> dict:
        return {"plugin": self._plugin, "data": self._data, "others": self._others}

    def __setstate__(self, state: dict) -> None:
        object.__setattr__(self, "_plugin", state["plugin"])
        object.__setattr__(self, "_data", dict(state["data"]))
        object.__setattr__(self, "_others", tuple(state.get("others", ())))

    def __repr__(self) -> str:
        return f"PluginConfig({self._plugin!r}, {self._data!r})"


@attrs.frozen(kw_only=True)
class RunConfig:
    """A run's configuration (see the module docstring). Build it through the parser
    (``furlong.core.config.launch_config`` in tests, the CLI in a run), never by hand:
    every field is required and typed as its flag parses.
    """

    # --- cluster ---
    actor_num_nodes: int
    actor_num_gpus_per_node: int
    rollout_num_gpus: int | None
    rollout_num_gpus_per_engine: int
    num_gpus_per_node: int
    colocate: bool
    offload: bool
    offload_train: bool
    offload_rollout: bool
    offload_rollout_level: tuple[str, ...]
    executor: str | None
    seed: int
    distributed_backend: str
    distributed_timeout_minutes: int
    # --- model and checkpoints ---
    hf_checkpoint: str | None
    model_name: str | None
    ref_load: str | None
    ref_ckpt_step: int | None
    load: str | None
    save: str | None
    save_interval: int
    save_hf: str | None
    save_trigger_sentinel: str | None
    save_retain_interval: int | None
    exit_interval: int | None
    exit_duration_in_mins: float | None
    no_save_optim: bool
    no_load_optim: bool
    no_load_rng: bool
    async_save: bool
    start_rollout_id: int | None
    custom_megatron_post_save_hook_path: str | None
    tokenizer_model: str | None
    finetune: bool
    ckpt_step: int | None
    exit_on_missing_checkpoint: bool
    pretrained_checkpoint: str | None
    use_checkpoint_opt_param_scheduler: bool
    override_opt_param_scheduler: bool
    num_layers: int | None
    hidden_size: int | None
    ffn_hidden_size: int | None
    num_attention_heads: int | None
    num_query_groups: int | None
    kv_channels: int | None
    rotary_base: int | None
    rotary_percent: float | None
    norm_epsilon: float | None
    vocab_size: int | None
    padded_vocab_size: int | None
    num_experts: int | None
    moe_router_topk: int | None
    moe_ffn_hidden_size: int | None
    mtp_num_layers: int | None
    seq_length: int
    max_position_embeddings: int | None
    make_vocab_size_divisible_by: int | None
    moe_aux_loss_coeff: tuple[float, ...] | None
    position_embedding_type: str | None
    normalization: str | None
    moe_token_dispatcher_type: str
    spec: tuple[str, ...] | None
    group_query_attention: bool
    use_rotary_position_embeddings: bool
    swiglu: bool
    disable_bias_linear: bool
    add_qkv_bias: bool
    qk_layernorm: bool
    untie_embeddings_and_output_weights: bool
    moe_grouped_gemm: bool
    # --- rollout ---
    prompt_data: str | None
    input_key: str
    label_key: str | None
    metadata_key: str
    tool_key: str
    loss_mask_type: str
    multimodal_keys: Mapping[str, Any] | None
    apply_chat_template: bool
    apply_chat_template_kwargs: Mapping[str, Any]
    chat_template_path: str | None
    rollout_shuffle: bool
    rollout_seed: int
    num_rollout: int | None
    rollout_batch_size: int | None
    n_samples_per_prompt: int
    global_batch_size: int | None
    num_steps_per_rollout: int | None
    over_sampling_batch_size: int | None
    max_sampling_waves: int
    micro_batch_size: int
    balance_data: bool
    rollout_max_context_len: int | None
    rollout_max_prompt_len: int | None
    disable_rollout_global_dataset: bool
    rollout_temperature: float
    rollout_top_p: float
    rollout_top_k: int
    rollout_max_response_len: int | None
    rollout_stop: tuple[str, ...] | None
    rollout_stop_token_ids: tuple[int, ...] | None
    rollout_skip_special_tokens: bool
    rm_url: str | None
    reward_key: str | None
    group_rm: bool
    custom_reward_post_process_path: str | None
    custom_convert_samples_to_train_data_path: str | None
    rollout_sample_filter_path: str | None
    rollout_all_samples_process_path: str | None
    rollout_data_postprocess_path: str | None
    rollout_submission_granularity: str | None
    partial_rollout: bool
    mask_offpolicy_in_partial_rollout: bool
    fully_async: bool
    update_weights_interval: int
    async_max_concurrent_samples: int | None
    async_data_buffer_capacity_factor: float
    max_weight_staleness: int | None
    async_unused_samples_handler: str
    custom_async_data_buffer_path: str | None
    keep_old_actor: bool
    generate_max_turns: int
    generate_tool_specs_path: str | None
    generate_tool_call_parser: str | None
    generate_execute_tool_function_path: str | None
    max_seq_len: int | None
    use_session_server: str | None
    tito_model: str
    session_server_ip: str | None
    session_server_port: tuple[int, ...] | None
    # --- eval ---
    eval_interval: int | None
    eval_prompt_data: tuple[str, ...] | None
    eval_config: str | None
    skip_eval_before_train: bool
    n_samples_per_eval_prompt: int
    eval_temperature: float | None
    eval_top_p: float | None
    eval_top_k: int | None
    eval_max_response_len: int | None
    eval_input_key: str | None
    eval_label_key: str | None
    eval_tool_key: str | None
    eval_max_prompt_len: int | None
    eval_max_context_len: int | None
    eval_reward_key: str | None
    eval_function_path: str | None
    eval_num_gpus: int
    eval_num_gpus_per_engine: int
    eval_hf_dir: str | None
    eval_max_in_flight: int
    eval_overflow_policy: str
    eval_keep_snapshots: int
    # --- performance ---
    use_dynamic_batch_size: bool
    max_tokens_per_gpu: int | None
    log_probs_max_tokens_per_gpu: int | None
    balance_by_flops: bool
    qkv_format: str
    gradient_checkpointing: bool
    fsdp_cpu_offload: bool
    train_torch_compile: bool
    fsdp_cpu_backend: str
    dp_replicate_size: int
    attn_implementation: str
    keep_fp32_master: bool
    train_memory_margin_bytes: int
    reuse_train_log_probs: bool
    skip_zero_advantage_samples: bool
    bf16: bool
    fp16: bool
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    virtual_pipeline_model_parallel_size: int | None
    context_parallel_size: int
    expert_model_parallel_size: int
    expert_tensor_parallel_size: int | None
    recompute_num_layers: int | None
    sequence_parallel: bool
    recompute_granularity: str | None
    recompute_method: str | None
    attention_dropout: float | None
    hidden_dropout: float | None
    attention_backend: str | None
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    use_distributed_optimizer: bool
    attention_softmax_in_fp32: bool
    accumulate_allreduce_grads_in_fp32: bool
    # --- algorithm ---
    eps_clip: float
    eps_clip_high: float | None
    eps_clip_c: float | None
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    use_unbiased_kl: bool
    kl_coef: float
    entropy_coef: float
    observe_training_entropy: bool
    calculate_per_token_loss: bool
    mask_truncated_samples: bool
    policy_ratio_level: str | None
    use_tis: bool
    tis_clip: float
    tis_clip_low: float
    custom_tis_function_path: str | None
    use_rollout_logprobs: bool
    get_mismatch_metrics: bool
    custom_pg_loss_reducer_function_path: str | None
    loss_reducer: str | None
    use_opsm: bool
    opsm_delta: float
    normalize_advantages: bool
    disable_grpo_std_normalization: bool
    disable_rewards_normalization: bool
    gamma: float
    lambd: float
    value_clip: float
    num_critic_only_steps: int
    critic_load: str | None
    critic_save: str | None
    critic_lr: float | None
    critic_lr_warmup_iters: int
    ref_update_interval: int | None
    use_opd: bool
    opd_type: str | None
    opd_kl_coef: float
    opd_teacher_load: str | None
    opd_teacher_urls: tuple[str, ...] | None
    opd_teacher_key: str
    disable_compute_advantages_and_returns: bool
    use_routing_replay: bool
    use_rollout_routing_replay: bool
    true_on_policy_mode: bool
    reset_optimizer_states: bool
    # --- optimizer ---
    optimizer: str
    lr: float
    min_lr: float
    lr_decay_style: str
    lr_decay_iters: int | None
    lr_warmup_iters: int
    lr_warmup_fraction: float | None
    lr_warmup_init: float
    lr_wsd_decay_iters: int | None
    lr_wsd_decay_style: str
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    clip_grad: float
    optimizer_cpu_offload: bool
    overlap_cpu_optimizer_d2h_h2d: bool
    use_precision_aware_optimizer: bool
    # --- SGLang and router ---
    sglang_router_ip: str | None
    sglang_router_port: int | None
    sglang_router_policy: str | None
    sglang_router_request_timeout_secs: int
    sglang_server_concurrency: int
    update_weight_transfer_mode: str
    update_weight_buffer_size: int
    pause_generation_mode: str
    rollout_external: bool
    rollout_external_engine_addrs: tuple[str, ...] | None
    # --- logging ---
    log_dir: str | None
    log_interval: int
    log_passrate: bool
    log_multi_turn: bool
    log_reward_category: str | None
    log_correct_samples: bool
    custom_rollout_log_function_path: str | None
    custom_eval_rollout_log_function_path: str | None
    use_wandb: bool
    wandb_project: str | None
    wandb_group: str | None
    wandb_mode: str | None
    wandb_dir: str | None
    wandb_key: str | None
    wandb_host: str | None
    wandb_team: str | None
    wandb_run_id: str | None
    disable_wandb_random_suffix: bool
    wandb_always_use_train_step: bool
    use_tensorboard: bool
    tb_project_name: str | None
    tb_experiment_name: str | None
    use_mlflow: bool
    mlflow_tracking_uri: str | None
    mlflow_experiment_name: str
    mlflow_run_name: str | None
    mlflow_run_id: str | None
    use_prometheus: bool
    prometheus_port: int | None
    prometheus_run_name: str | None
    # --- debugging ---
    debug: bool
    print_config: bool
    custom_config_path: str | None
    debug_rollout_only: bool
    debug_train_only: bool
    save_debug_rollout_data: str | None
    load_debug_rollout_data: str | None
    dump_details: str | None
    debug_exit_after_rollout: int | None
    check_weight_update_equal: bool
    deterministic_mode: bool
    check_for_nan_in_loss_and_grad: bool
    # --- plugins ---
    rollout: str
    rollout_function_path: str | None
    generate: str
    custom_generate_function_path: str | None
    custom_agent_function_path: str | None
    rm_type: str | None
    custom_rm_path: str | None
    dynamic_sampling_filter: tuple[str, ...] | None
    dynamic_sampling_filter_path: str | None
    buffer_filter: str
    buffer_filter_path: str | None
    advantage_estimator: str
    custom_advantage_function_path: str | None
    loss_type: str
    custom_loss_function_path: str | None
    rollout_backend: str
    train_backend: str
    data_source: str
    data_source_path: str | None
    disable_plugins: tuple[str, ...]
    # --- Miles ---
    num_epoch: int | None
    train_env_vars: Mapping[str, Any]
    log_probs_chunk_size: int
    use_dynamic_global_batch_size: bool
    use_fault_tolerance: bool
    ft_components: tuple[str, ...] | None
    rollout_health_check_interval: float
    rollout_health_check_timeout: float
    rollout_health_check_first_wait: float
    lora_rank: int
    lora_alpha: int
    lora_dropout: float
    target_modules: str | None
    exclude_modules: str | None
    megatron_to_hf_mode: str
    data_pad_size_multiplier: int

    # --- derived by the run ---
    train_mode: str | None
    """``"sync"`` (``furlong train``) or ``"async"`` (``furlong train-async``); None for flags parsed
    without a command (a test of the set-up step)."""
    explicit_args: tuple[str, ...]
    """Attribute names of the flags given (command line or ``--custom-config-path``), sorted."""
    plugin_flags_given: Mapping[str, str]
    """``{flag: plugin}`` of the given flags a plugin added, each flag as typed (``--no-X`` of a ``--X/--no-X``
    flag; the ``--X`` spelling for a value set by ``--custom-config-path``)."""
    megatron_flags_given: tuple[str, ...]
    """Megatron-LM-only flags given, as typed."""
    megatron_args: Mapping[str, Any]
    """``{dest: value}`` of the Megatron-LM-only flags given."""
    megatron_argv: tuple[str, ...]
    """Those flags with their values, as typed: what a backend hands Megatron-LM's own parser."""
    sglang_passthrough: Mapping[str, Any]
    """``--sglang-*`` flags furlong does not define, for the SGLang server."""
    custom_config_extras: Mapping[str, Any]
    """``{key: value}`` of the ``--custom-config-path`` keys that are no flag, for the custom functions that
    read them (Miles' TIS/RS settings ``tis_mode``, ``rs_lower_bound``...); also attributes of :meth:`namespace`."""
    router_passthrough: Mapping[str, Any]
    """``--router-*`` flags furlong does not define, for the router."""
    eval_sglang_passthrough: Mapping[str, Any]
    """``--eval-sglang-*`` flags furlong does not define, for the evaluation servers."""
    data_parallel_size: int
    """Data-parallel ranks of the trainer, as the train backend's layout rule gives them
    (:meth:`~furlong.hooks.ConfigReport.data_parallel_rule`)."""
    use_critic: bool
    """The run trains a critic (value model) beside the actor: a chosen plugin asked for one
    (:meth:`~furlong.hooks.ConfigReport.use_critic`) and the train backend builds it."""
    engines_in_driver: bool
    """The chosen executor runs the rollout engines in the driver's process, on its host
    (:class:`~furlong.hooks.ExecutorFit`)."""
    packed_by_default: str | None
    """Why micro-batches are packed by token budget (``--max-tokens-per-gpu`` or the default budget)."""
    sglang_tp_size: int | None
    """Tensor-parallel size of one SGLang server."""
    num_rollout_per_epoch: int | None
    """Rollouts per epoch under ``--num-epoch`` (known once the data is loaded), else None."""
    eval_engine: bool
    """True in the configuration a ``rollout_engine`` hook gets for an engine of the dedicated eval fleet
    (``--eval-num-gpus``): ``rollout_num_gpus_per_engine`` and ``sglang_tp_size`` are then
    ``--eval-num-gpus-per-engine``, ``sglang_passthrough`` has the ``--eval-sglang-*`` values over the rollout
    engines' ones; the fleet's GPUs follow the rollout engines' ``rollout_num_gpus``. Such an engine serves
    its own requests (not through the rollout engines' router) and is fed weight snapshots from disk
    (``update_weights_from_disk``), never the trainer's weight sync."""
    eval_prompt_data_lone: bool
    """``--eval-prompt-data`` was given one value, which Miles' rule reads as the path of an eval set named
    ``aime`` (``eval_prompt_data`` then holds the pair ``("aime", path)``, as Miles' arguments do)."""
    plugins: Mapping[str, PluginConfig]
    """Each plugin's section (see :meth:`plugin_config`)."""

    def plugin_config(self, name: str) -> PluginConfig:
        """Plugin ``name``'s section: its flags and the values its ``configure`` derived.

        A plugin with no flags gets an empty section (reading from it names the sections there are).
        """
        return self.plugins.get(name) or PluginConfig(name, others=tuple(self.plugins))

    def __getattr__(self, name: str) -> Any:
        # only reached for a name that is no field: say where a plugin's own flag lives
        if name.startswith("_"):
            raise AttributeError(name)
        owners = [plugin for plugin, section in self.plugins.items() if name in section]
        where = (f"it is a flag of plugin '{owners[0]}': read config.plugin_config({owners[0]!r}).{name}" if owners
                 else "no core flag and no plugin's flag has that name")
        raise AttributeError(f"'RunConfig' object has no attribute '{name}': {where}")

    def given(self, dest: str) -> bool:
        """True when the flag with attribute ``dest`` was given."""
        return dest in self.explicit_args

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with ``changes`` (field name -> value); for tests and for the values a run derives
        once its data is loaded (``--num-epoch``). Values are frozen as in a built config.

        :raises TypeError: a name that is no field.
        """
        return attrs.evolve(self, **{name: freeze_value(value) for name, value in changes.items()})

    def namespace(self) -> argparse.Namespace:
        """A fresh ``argparse.Namespace`` with every field, every plugin's section, every
        Megatron-LM flag given and every ``custom_config_extras`` key, as attributes (tuples as lists, maps as dicts): what a
        Miles-style ``module.function(args, ...)`` receives. Changing it changes nothing here.
        """
        values = {field.name: thaw_value(getattr(self, field.name)) for field in attrs.fields(type(self))
                  if field.name != "plugins"}
        for section in self.plugins.values():
            values.update({dest: thaw_value(value) for dest, value in section.items()})
        values.update({dest: thaw_value(value) for dest, value in self.megatron_args.items() if dest not in values})
        values.update({key: thaw_value(value) for key, value in self.custom_config_extras.items() if key not in values})
        return argparse.Namespace(**values)


def freeze_value(value: Any) -> Any:
    """Lists to tuples and dicts to :class:`FrozenMap`, recursively; other values as they are."""
    if isinstance(value, (list, tuple)):
        return tuple(freeze_value(item) for item in value)
    if isinstance(value, Mapping) and not isinstance(value, FrozenMap):
        return FrozenMap({key: freeze_value(item) for key, item in value.items()})
    return value


def thaw_value(value: Any) -> Any:
    """The inverse of :func:`freeze_value`: tuples to lists and read-only maps to dicts."""
    if isinstance(value, tuple):
        return [thaw_value(item) for item in value]
    if isinstance(value, FrozenMap):
        return {key: thaw_value(item) for key, item in value.items()}
    return value
