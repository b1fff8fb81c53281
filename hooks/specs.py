"""The hook contract: every hook furlong's core emits, in loop order.

Implementations take keyword arguments and may accept any subset of a spec's arguments.
Implementation parameters take no defaults. Only the plugin manager calls implementations,
in one of two ways:

- from async code (every hook but the two set-up hooks): an implementation may be
  ``async def``; the core awaits it.
- from set-up code (``add_arguments``, ``executor_fit``, ``configure``): these run while the
  parser is built and the flags are configured, before the run's event loop starts, and are
  plain functions: an ``async def`` implementation is an error naming the plugin
  (``add_arguments``: the plugin is set aside), except the old ``async def configure``, which
  still runs, with a ``DeprecationWarning``, until the next minor version.

Both ways time every call of a non-observer hook and report it to ``on_hook_call``. Call
styles:

- *chosen*: only the implementation of the plugin named by the selection flag runs;
  returning None is an error naming the plugin.
- *broadcast*: every enabled implementation runs, each on its own; one failure does not
  stop the others.
- *observer*: broadcast, failures logged as warnings, never timed by ``on_hook_call``.

Every hook but ``add_arguments`` and ``configure`` receives ``config``, the run's frozen
:class:`~furlong.hooks.RunConfig` (typed fields; a plugin's own flags through
``config.plugin_config(name)``). ``configure`` runs before the freeze and receives the
mutable ``argparse.Namespace`` of that set-up step. The old form, an implementation that
takes ``args``, still receives ``config.namespace()`` until the next minor version (with a
``DeprecationWarning``; PLUGINS.md, "Deprecations").
"""

from __future__ import annotations

from argparse import ArgumentParser, Namespace

from .config_report import ConfigReport
from .markers import hookspec
from .run_config import RunConfig
from .protocols import CriticBackend, DataSource, Executor, RolloutContext, RolloutEngine, TrainBackend
from .types import AdvantageInput, AdvantageOutput, DatasetSpec, ExecutorFit, FilterResult, LossInput, LossOutput, Sample

__all__ = [
    "abort",
    "add_arguments",
    "advantage",
    "buffer_pop",
    "configure",
    "critic_backend",
    "data_source",
    "executor",
    "executor_fit",
    "filter",
    "generate",
    "loss",
    "loss_reducer",
    "on_checkpoint_saved",
    "on_eval_end",
    "on_hook_call",
    "on_rollout_end",
    "on_train_step_end",
    "reward",
    "rollout",
    "rollout_engine",
    "train_backend",
]


# --- set-up --------------------------------------------------------------------------


@hookspec
def add_arguments(parser: ArgumentParser) -> None:
    """Add flags that are new and specific to one plugin.

    Call: broadcast, once, when the launch parser is built (before parsing).
    Add an argument group named after the plugin; prefix every flag with the plugin name.
    Flags the core defines (`furlong train --help`, docs/flags.md) are not added again. A plugin
    whose ``add_arguments`` adds a flag the core or another plugin already defines, raises,
    or is ``async def`` is set aside: it adds none of its flags, ``furlong plugins`` lists it
    as broken with the reason, and choosing it is an error. A given flag of a plugin the run
    does not use (not chosen, not declared by a chosen plugin's ``configure`` with
    ``report.use_plugin``, no observer hook) is an error, a reward plugin's a warning.

    :param parser: the ``argparse.ArgumentParser`` of ``furlong train``.
    :returns: nothing.
    """


@hookspec
def configure(args: Namespace, report: ConfigReport) -> None:
    """Derive this plugin's flag defaults and check its flags, before any model loads.

    Call: chosen by name: once per run, on every plugin the run chose (for each chosen
    hook in the order data_source, rollout_engine, train_backend, rollout, generate,
    buffer_pop, advantage, loss; then every filter in flag order; then the run-wide
    reward; then the executor), each plugin once even when chosen for several hooks.
    Called after the core validated the flags and resolved the selection, before
    ``--print-config`` prints them. Not called for per-sample rewards
    (``metadata["rm_type"]``) or dotted-path functions. A set-up hook: a plain function
    (``async def`` still runs, with a ``DeprecationWarning``, until the next minor version).

    Derive a default only for a flag the user did not give (``report.default(args,
    dest, value)`` does that; ``args.explicit_args`` lists the given ones); changing a
    given flag is an error naming the plugin. Report problems on ``report`` rather than
    raising: every plugin's errors are printed together, one per line.

    :param args: the validated launch flags; set only your own derived attributes.
    :param report: ``report.error(msg)`` stops the run (exit code 2), ``report.warn(msg)``
        and ``report.info(msg)`` are logged on rank 0; ``report.plugin`` is your name,
        ``report.flags`` the flags that chose you. Name the flag and value in each message.
    :returns: nothing.
    :raises PluginError: also accepted: its message is reported as one error, as written.
        Any other exception is reported as ``plugin 'NAME' (DIST VERSION) failed in
        `configure`: TYPE: MESSAGE``.

    Reference: pytest's ``pytest_configure(config)``.

    Example::

        @hookimpl
        def configure(args, report):
            report.default(args, "policy_ratio_level", "sequence")
            if args.kl_coef != 0:
                report.error(f"--advantage-estimator {report.plugin} needs --kl-coef 0, got {args.kl_coef:g}.")
    """


@hookspec
def executor(config: RunConfig, args: Namespace) -> Executor:
    """Create the executor: what places the train workers and the rollout engines.

    Call: chosen by name (``--executor NAME``; default: the first executor whose
    :func:`executor_fit` says it fits, see there). Called once per process, first thing
    when a run starts, before any data or model loads.

    The loop is written once against what the executor starts: the core hands it a
    picklable ``make_worker(rank, world)`` for each train rank and ``make_engine(i)`` for
    each engine, and drives the workers through the returned
    :class:`~furlong.hooks.WorkerGroup` (``await group.call(method, args_per_rank)``).

    :param config: the run's configuration; read the cluster flags (``--actor-num-nodes``,
        ``--actor-num-gpus-per-node``, ``--rollout-num-gpus``,
        ``--rollout-num-gpus-per-engine``, ``--colocate``, ``--offload-*``).
    :returns: an object meeting :class:`~furlong.hooks.Executor`.
    :raises PluginError: the placement the flags ask for cannot be had (the message
        names the flags and what the machine or cluster offers).
    """


@hookspec
def executor_fit(args: Namespace) -> ExecutorFit:
    """Say whether this plugin's executor fits this machine and launch, and why.

    Call: broadcast, during parsing, to every plugin implementing it, after the core
    validated the flags and before any ``configure``. When ``--executor`` is not given,
    the default is the first executor that fits, asked in this order: plugins outside
    furlong's own distribution first, in name order, then furlong's (``local``, ``ray``,
    whose rules do not overlap). No executor fitting is an error listing every answer.
    The chosen executor's answer (given or default) also sets
    ``config.engines_in_driver``, which engine plugins read instead of the executor's name.
    Plain and quick: read flags and the environment, start nothing.

    :param args: the validated launch flags (the set-up step's Namespace; do not change it).
    :returns: an :class:`~furlong.hooks.ExecutorFit` (``fits``, ``why``, ``engines_in_driver``).

    Example::

        @hookimpl
        def executor_fit(args):
            if os.environ.get("SLURM_JOB_ID"):
                return ExecutorFit(True, "SLURM_JOB_ID is set (inside a Slurm allocation)")
            return ExecutorFit(False, "not inside a Slurm allocation")
    """


@hookspec
def rollout_engine(config: RunConfig, args: Namespace, engine_index: int) -> RolloutEngine:
    """Create the generation engine.

    Call: chosen by name (``--rollout-backend NAME``; default ``sglang`` when a furlong
    plugin of that name is installed and CUDA and the ``sglang`` package are present, else
    ``embedded``). Called once per engine, before the first rollout, in the process the
    executor puts the engine in (the driver's, or an engine actor).

    Every request the core sends carries ``sampling_params["sampling_seed"]`` (a hash of
    ``--seed``, the sample's index and train/eval): honour it and a run samples the same
    tokens in any process and after a resume.

    :param config: the run's configuration.
    :param engine_index: which engine this is (0, 1, ...), e.g. for a per-engine seed.
    :returns: an object meeting :class:`~furlong.hooks.RolloutEngine`.
    """


@hookspec
def train_backend(config: RunConfig, args: Namespace) -> TrainBackend:
    """Create the training backend (the actor, and the reference when KL is used).

    Call: chosen by name (``--train-backend NAME``; default ``megatron`` when a furlong
    plugin of that name is installed and CUDA and megatron-core are present, else
    ``fsdp``). Called once per training rank, before ``init``, in that rank's process (the
    driver's, a ``torchrun`` process or a Ray actor). The backend receives only its rank's
    share of each rollout batch and reports its parallel layout (``layout()``).

    :param config: the run's configuration.
    :returns: an object meeting :class:`~furlong.hooks.TrainBackend`.
    """


@hookspec
def critic_backend(config: RunConfig, args: Namespace) -> CriticBackend:
    """Create the critic (value model) of a run that trains one (``--advantage-estimator ppo``).

    Call: chosen by name (``--train-backend NAME``): a train backend plugin that can build a
    value model implements this hook beside ``train_backend``. A run whose plugins ask for a
    critic (:meth:`~furlong.hooks.ConfigReport.use_critic`) with a ``--train-backend`` that
    does not implement it stops before any model loads with one error. Called once per
    training rank, in that rank's process, before ``init``; the core drives the critic through
    a train group of its own, as it drives the actor.

    :param config: the run's configuration (the critic's flags: ``--critic-load``,
        ``--critic-lr``, ``--critic-lr-warmup-iters``, ``--value-clip``).
    :returns: an object meeting :class:`~furlong.hooks.CriticBackend`.
    """


@hookspec
def data_source(config: RunConfig, args: Namespace, dataset: DatasetSpec) -> DataSource:
    """Create the prompt data source.

    Call: chosen by name (``--data-source NAME``, default ``jsonl``). Called once per run,
    before any model loads, for the training data: a bad file must fail here, naming file
    and line. Called again once per eval dataset.

    :param config: the run's configuration.
    :param dataset: what to read: path, the flag it came from (for messages), row keys,
        shuffling, the prompt-length limit (:class:`~furlong.hooks.DatasetSpec`).
    :returns: an object meeting :class:`~furlong.hooks.DataSource`.
    :raises PluginError: the data is missing, empty or malformed (message names file and line).
    """


# --- rollout ---------------------------------------------------------------------------


@hookspec
def rollout(config: RunConfig, args: Namespace, rollout_id: int, context: RolloutContext) -> list[list[Sample]]:
    """Produce the groups one rollout iteration trains on.

    Call: chosen by name (``--rollout NAME``, default ``sync``; ``--rollout-function-path``).
    Called once per rollout id by the rollout manager.

    :param rollout_id: 0-based rollout iteration.
    :param context: engine, data cursor and the core's hook callers (see RolloutContext).
    :returns: exactly ``--rollout-batch-size`` groups of ``--n-samples-per-prompt``
        generated, scored samples, sorted by their first sample's ``index``.
    """


@hookspec
def generate(
    config: RunConfig, args: Namespace, sample: Sample, sampling_params: dict, engine: RolloutEngine, evaluation: bool
) -> Sample | list[Sample]:
    """Generate the response of one sample.

    Call: chosen by name (``--generate NAME`` / ``--agent-backend``, default
    ``single_turn``; ``--custom-generate-function-path``). Called once per sample whose
    status is ``pending`` or ``aborted``, inside the rollout concurrency limit.

    :param sample: the sample to fill: ``tokens`` (prompt + response ids), ``response``,
        ``response_length`` (tokens), ``rollout_log_probs`` (one float per response
        token), ``weight_versions``, ``status``. A resumed partial sample already holds
        tokens; continue it with the token budget that is left.
    :param sampling_params: a private copy: ``temperature``, ``top_p``, ``top_k``,
        ``max_new_tokens`` (tokens), ``stop``, ``stop_token_ids``, ...
    :param engine: the rollout engine; ``engine.tokenizer`` tokenizes.
    :param evaluation: True for eval rollouts.
    :returns: the same sample, filled, or a list of samples (one trajectory split in parts).
    """


@hookspec
def reward(config: RunConfig, args: Namespace, samples: list[Sample]) -> list[float | dict]:
    """Score finished samples.

    Call: chosen by name, per sample: ``--custom-rm-path`` wins, then
    ``sample.metadata["rm_type"]``, then ``--rm-type``; ``boxed_<name>`` grades the last
    ``\\boxed{}`` with plugin ``<name>``. Called with one sample, or with a whole group
    under ``--group-rm``. Never called for aborted samples.

    :param samples: finished samples (``response``, ``label``, ``metadata``).
    :returns: one reward per sample, in order: a float, or a dict reduced with ``--reward-key``.
    """


@hookspec
def filter(config: RunConfig, args: Namespace, samples: list[Sample], rollout_id: int) -> FilterResult | bool:
    """Decide whether one finished, scored group is kept for training (dynamic sampling).

    Call: every filter named by ``--dynamic-sampling-filter`` (and
    ``--dynamic-sampling-filter-path``), one by one in flag order; the first that rejects
    gives the reason. Called once per finished group.

    :param samples: the group's samples (one prompt), rewards set.
    :param rollout_id: the current rollout.
    :returns: ``FilterResult(keep, reason)`` or a bare bool (= keep, no reason).
    """


@hookspec
def buffer_pop(
    config: RunConfig, args: Namespace, rollout_id: int, buffer: list[list[Sample]], num_samples: int
) -> list[list[Sample]]:
    """Choose which buffered partial groups leave the buffer at the start of a rollout.

    Call: chosen by name (``--buffer-filter NAME``, default ``pop_first``;
    ``--buffer-filter-path``). Called when the partial-rollout buffer is not empty.

    :param buffer: groups waiting in the buffer; remove the returned ones in place.
    :param num_samples: the most groups to return.
    :returns: at most ``num_samples`` groups, removed from ``buffer``.
    """


@hookspec
def abort(config: RunConfig, args: Namespace, rollout_id: int) -> None:
    """Tear down external work when a rollout aborts its leftovers.

    Call: broadcast to every enabled implementation after the engine's abort requests were
    sent and before pending tasks are awaited; failures are logged as warnings.

    :param rollout_id: the rollout being aborted.
    """


# --- training ----------------------------------------------------------------------------


@hookspec
def advantage(config: RunConfig, args: Namespace, batch: AdvantageInput) -> AdvantageOutput:
    """Turn one rollout batch's rewards into per-token advantages and returns.

    Call: chosen by name (``--advantage-estimator NAME``, default ``grpo``;
    ``--custom-advantage-function-path``). Called once per rollout on the whole batch,
    after old/reference log-probs exist, between the core's reward post-processing and its
    OPD and whitening stages.

    Shapes: ``N`` samples, ``T_i`` response tokens of sample ``i``.

    :param batch: ``rewards`` float32 [N]; ``group_ids`` int64 [N]; ``trajectory_ids``
        int64 [N]; ``loss_masks`` N x [T_i]; optional ``log_probs``, ``ref_log_probs``,
        ``kl``, ``values``, ``teacher_log_probs`` (N x float32 [T_i]).
    :returns: ``AdvantageOutput(advantages, returns)``: N float32 tensors [T_i] each
        (``returns`` may be None).
    :raises PluginError: the batch lacks a field the estimator needs.
    """


@hookspec
def loss(config: RunConfig, args: Namespace, batch: LossInput) -> LossOutput:
    """Per-token objective of one micro-batch; the core reduces it.

    Call: chosen by name (``--loss-type NAME``, default ``policy_loss``;
    ``--custom-loss-function-path``). Called once per micro-batch with grad enabled.

    :param batch: N x [T_i] float32 tensors: ``log_probs`` (grad), ``old_log_probs``,
        ``advantages``, ``loss_masks``, optional ``ref_log_probs``, ``rollout_log_probs``,
        ``entropy``, ``values``, ``returns``.
    :returns: ``LossOutput(token_loss, token_metrics)``: per-token tensors only. Never
        reduce: the core applies masks and denominators over the whole optimizer step.
    """


@hookspec
def loss_reducer(config: RunConfig, args: Namespace, values: list, loss_masks: list, total_lengths: list[int]):
    """Reduce one micro-batch's per-token policy-gradient values to its share of the step loss.

    Call: chosen by name (``--loss-reducer NAME``; ``--custom-pg-loss-reducer-function-path``
    takes Miles' factory ``fn(total_lengths, response_lengths, loss_masks,
    calculate_per_token_loss) -> reducer``). Not called unless one of the two flags is given:
    by default the core reduces everything itself. Called once per micro-batch with grad
    enabled, on the ``token_metrics["pg_loss"]`` the loss plugin returned. The core
    multiplies what it returns by the step factor, ``1/n_s`` (trajectories in the optimizer
    step, over every micro-batch and rank) or ``1/N_s`` under ``--calculate-per-token-loss``
    (trained tokens in the step), and adds the rest of ``token_loss`` (``token_loss -
    pg_loss``) reduced the core's way. The core's own pg reduction corresponds to
    ``sum_i sum_t x_it m_it / |m_i|`` here.

    :param values: N float32 tensors [T_i], the per-token policy-gradient term, carrying grad.
    :param loss_masks: N float32 0/1 tensors [T_i] (truncated samples already zeroed under
        ``--mask-truncated-samples``).
    :param total_lengths: N ints: prompt + response tokens of each sample.
    :returns: a 0-dim float32 tensor carrying grad: the micro-batch's weighted sum (never a
        mean over the micro-batch: the step factor makes the mean, whatever the packing).

    Reference: Dr. GRPO (Liu et al., 2025, "Understanding R1-Zero-Like Training: A Critical
    Perspective", arXiv:2503.20783) divides by a constant instead of ``|m_i|``: built-in ``dr_grpo``.
    """


# --- observers ---------------------------------------------------------------------------


@hookspec
def on_rollout_end(config: RunConfig, args: Namespace, rollout_id: int, metrics: dict) -> None:
    """Observer: a rollout iteration finished (rollout, training, weight sync).

    :param metrics: ``rollout/...`` and ``perf/...`` values (floats), step key ``rollout/step``.
    """


@hookspec
def on_train_step_end(config: RunConfig, args: Namespace, rollout_id: int, step: int, metrics: dict) -> None:
    """Observer: one optimizer step finished.

    :param step: global optimizer step (``rollout_id * num_steps_per_rollout + s``).
    :param metrics: ``train/...`` values (floats).
    """


@hookspec
def on_eval_end(config: RunConfig, args: Namespace, rollout_id: int, metrics: dict) -> None:
    """Observer: an evaluation finished. ``metrics`` holds ``eval/<name>`` and friends."""


@hookspec
def on_checkpoint_saved(config: RunConfig, args: Namespace, rollout_id: int, path: str) -> None:
    """Observer: checkpoint ``path`` (``<save>/iter_NNNNNNN``) is complete and marked latest."""


@hookspec
def on_hook_call(hook: str, plugin: str, seconds: float, error: str | None) -> None:
    """Observer: a non-observer hook implementation returned or raised.

    Call: observer, around every call of a non-observer hook, set-up hooks included
    (``add_arguments`` twice per plugin: on a scratch parser that checks for clashing
    flags, then on the real one). May be ``async def``: after a set-up call it is run to
    the end when no event loop is running, else scheduled on the running loop.

    :param hook: hook name; :param plugin: plugin name; :param seconds: wall-clock
        duration in seconds; :param error: ``"ExcType: message"`` when it raised, else None.
    """
