"""Data types shared by the core and every plugin.

Tensors are torch tensors. "Per sample" lists are in batch order. ``T_i`` is the
response length of sample ``i`` in tokens.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs

__all__ = [
    "AdvantageInput",
    "AdvantageOutput",
    "DatasetSpec",
    "ExecutorFit",
    "FilterResult",
    "GenerateOutput",
    "LossInput",
    "LossOutput",
    "ParallelLayout",
    "Sample",
    "Status",
    "TrainBatch",
    "WeightBucket",
]


class Status(str, enum.Enum):
    """Lifecycle of a :class:`Sample` (PLUGINS.md, `generate`).

    ``pending``: never generated. ``completed``: the engine stopped on a stop string or
    token. ``truncated``: the token budget ran out. ``aborted``: the rollout aborted the
    request (or never started it). ``failed``: set only by custom generate plugins.
    """

    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


_PER_TOKEN_FIELDS = ("loss_mask", "rollout_log_probs", "teacher_log_probs", "opd_reverse_kl")


@attrs.define(eq=False)
class Sample:
    """One prompt-response pair: the unit that rollouts produce and training consumes.

    ``tokens`` holds prompt and response token ids; the last ``response_length`` of them
    are the response. Per-token lists (``loss_mask``, ``rollout_log_probs``, ...) have
    ``response_length`` entries. Unknown keys given to :meth:`from_dict` are kept in
    ``extra`` and written back by :meth:`to_dict`.

    ``rollout_routed_experts`` (mixture-of-experts models, ``--use-rollout-routing-replay``):
    the experts the engine routed each token to, int ``[len(tokens) - 1, num_moe_layers, topk]``
    (a numpy array or nested lists): row ``t`` is the routing of input position ``t`` of prompt
    and response (the last token is never fed to the model), layer by layer in model order.
    """

    prompt: str | list[dict] = ""
    label: Any = None
    metadata: dict = attrs.field(factory=dict)
    group_index: int | None = None
    index: int | None = None
    trajectory_id: int | None = None
    tokens: list[int] = attrs.field(factory=list)
    response: str = ""
    response_length: int = 0
    reward: float | dict | None = None
    loss_mask: list[int] | None = None
    rollout_log_probs: list[float] | None = None
    teacher_log_probs: list[float] | None = None
    opd_reverse_kl: list[float] | None = None
    weight_versions: list[str] = attrs.field(factory=list)
    status: Status = attrs.field(default=Status.PENDING, converter=Status)
    remove_sample: bool = False
    train_metadata: dict | None = None
    generate_function_path: str | None = None
    routing_key: str | None = None
    non_generation_time: float = 0.0
    rollout_routed_experts: Any = None
    extra: dict = attrs.field(factory=dict)

    @property
    def effective_response_length(self) -> int:
        """Number of response tokens that are trained on (sum of the loss mask)."""
        if self.loss_mask is None:
            return self.response_length
        return int(sum(self.loss_mask))

    @property
    def oldest_weight_version(self) -> int | None:
        """Smallest numeric engine weight version this sample was generated with."""
        numeric = [int(v) for v in self.weight_versions if str(v).lstrip("-").isdigit()]
        return min(numeric) if numeric else None

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    def validate(self) -> None:
        """Check the length invariants; raise ``ValueError`` naming the field at fault."""
        if len(self.tokens) < self.response_length:
            raise ValueError(
                f"sample {self.index}: len(tokens)={len(self.tokens)} < response_length={self.response_length}"
            )
        for name in _PER_TOKEN_FIELDS:
            value = getattr(self, name)
            if value is not None and len(value) != self.response_length:
                raise ValueError(
                    f"sample {self.index}: len({name})={len(value)} != response_length={self.response_length}"
                )
        routed = self.rollout_routed_experts
        if routed is not None and len(routed) != max(len(self.tokens) - 1, 0):
            raise ValueError(f"sample {self.index}: len(rollout_routed_experts)={len(routed)} != "
                             f"len(tokens) - 1={len(self.tokens) - 1}")

    def reset_for_retry(self) -> None:
        """Clear everything generation produced and mark the sample aborted (fully-async retry)."""
        self.tokens = []
        self.response = ""
        self.response_length = 0
        self.reward = None
        self.loss_mask = None
        self.rollout_log_probs = None
        self.teacher_log_probs = None
        self.opd_reverse_kl = None
        self.rollout_routed_experts = None
        self.weight_versions = []
        self.status = Status.ABORTED

    def to_dict(self) -> dict:
        """JSON-serializable dict; ``from_dict(to_dict())`` gives an equal sample."""
        out = {f.name: getattr(self, f.name) for f in attrs.fields(Sample) if f.name != "extra"}
        out["status"] = self.status.value
        if hasattr(self.rollout_routed_experts, "tolist"):
            out["rollout_routed_experts"] = self.rollout_routed_experts.tolist()
        out.update(self.extra)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "Sample":
        """Inverse of :meth:`to_dict`. Accepts Miles' ``rollout_id`` for ``trajectory_id``."""
        data = dict(data)
        if "rollout_id" in data and "trajectory_id" not in data:
            data["trajectory_id"] = data.pop("rollout_id")
        known = {f.name for f in attrs.fields(Sample)} - {"extra"}
        kwargs = {k: data.pop(k) for k in list(data) if k in known}
        return cls(**kwargs, extra=data)


@attrs.define
class FilterResult:
    """What a ``filter`` implementation decides for one group.

    ``reason`` is a short snake_case word counted in ``rollout/dynamic_filter/drop_<reason>``
    when ``keep`` is False; None is not counted.
    """

    keep: bool
    reason: str | None = None


@attrs.define
class GenerateOutput:
    """What :meth:`RolloutEngine.generate` returns for one request.

    ``output_ids``: generated token ids (excluding the prompt). ``output_log_probs``: log-prob
    of each generated token under the sampling distribution (temperature applied), float,
    one per id. ``finish_reason``: ``"stop"``, ``"length"`` or ``"abort"``.
    ``weight_version``: the engine's weight version as a string; for a request whose
    tokens straddle a weight update, the version of its first tokens (the oldest).
    ``weight_version_spans``: for such a request, ``(version, start, end)`` per stretch of
    output tokens ``[start, end)`` generated under one version (SGLang's
    ``meta_info.weight_versions``); empty otherwise. ``routed_experts``: for a
    mixture-of-experts model whose engine records routing (``--use-rollout-routing-replay``),
    the experts each fed token was routed to, int ``[len(input_ids) + len(output_ids) - 1,
    num_moe_layers, topk]`` (numpy; row ``t`` = input position ``t``, the last output token is
    never fed); None when the engine does not record it.
    """

    output_ids: list[int]
    output_log_probs: list[float]
    finish_reason: str
    weight_version: str = "0"
    text: str | None = None
    weight_version_spans: list[tuple[str, int, int]] = attrs.field(factory=list)
    routed_experts: Any = None


@attrs.define
class AdvantageInput:
    """Input of the ``advantage`` hook: one whole rollout batch of ``N`` samples.

    ``rewards`` float32 [N]; ``group_ids`` int64 [N] (samples of one prompt share an id);
    ``trajectory_ids`` int64 [N] (samples of one trajectory share an id and a reward);
    ``loss_masks`` list of N tensors [T_i] (1 = token trained). Optional per-token lists of
    N float32 tensors [T_i]: ``log_probs`` (pi_old), ``ref_log_probs``, ``kl`` (reward-shaping
    KL computed by the core when ``--kl-coef`` != 0), ``values``, ``teacher_log_probs``.
    """

    rewards: Any
    group_ids: Any
    loss_masks: list
    trajectory_ids: Any = None
    log_probs: list | None = None
    ref_log_probs: list | None = None
    kl: list | None = None
    values: list | None = None
    teacher_log_probs: list | None = None


@attrs.define
class AdvantageOutput:
    """Output of the ``advantage`` hook: ``advantages`` and ``returns``, lists of N float32 [T_i]."""

    advantages: list
    returns: list | None = None


@attrs.define
class LossInput:
    """Input of the ``loss`` hook for one micro-batch of ``N`` samples.

    Every field is a list of N float32 tensors [T_i]. ``log_probs`` is the current policy
    (carries grad); ``old_log_probs`` is pi_old (no grad); ``loss_masks`` 0/1.
    """

    log_probs: list
    old_log_probs: list
    advantages: list
    loss_masks: list
    ref_log_probs: list | None = None
    rollout_log_probs: list | None = None
    entropy: list | None = None
    values: list | None = None
    old_values: list | None = None
    returns: list | None = None


@attrs.define
class LossOutput:
    """Output of the ``loss`` hook: per-token values only; the core reduces them.

    ``token_loss``: list of N float32 [T_i] carrying grad, the objective to minimize.
    ``token_metrics``: name -> list of N tensors [T_i] (at least ``pg_loss``,
    ``pg_clipfrac``, ``ppo_kl``; ``kl_loss``/``entropy_loss`` when computed).
    """

    token_loss: list
    token_metrics: dict = attrs.field(factory=dict)


@attrs.define
class TrainBatch:
    """What the core hands a :class:`~furlong.hooks.TrainBackend` for one rollout.

    ``tokens[i]``: prompt+response ids of sample i; ``response_lengths[i]``: T_i.
    ``steps[s][m]``: indices (into this batch) of the samples of micro-batch ``m`` of
    optimizer step ``s`` on this rank; the core packs micro-batches (fixed size or dynamic
    under ``--max-tokens-per-gpu``). ``objective``: the core's loss objective (a
    :class:`~furlong.hooks.StepObjective`) the backend calls once per micro-batch.
    Per-token lists (``loss_masks``, ``old_log_probs``, ...) are N float32 tensors [T_i].
    ``truncated[i]``: sample i ran out of token budget (for ``--mask-truncated-samples``).
    ``routed_experts[i]``: under ``--use-rollout-routing-replay``, the experts the engine routed
    sample i's tokens to (``Sample.rollout_routed_experts``: int64 ``[len(tokens[i]) - 1,
    num_moe_layers, topk]``), which the backend replays; None otherwise.
    ``values``: a critic's batch only (:class:`~furlong.hooks.CriticBackend`): N float32 [T_i],
    the critic's values when the rollout was scored (the clipped value loss's ``v_old``).
    """

    tokens: list
    response_lengths: list
    loss_masks: list
    steps: list = attrs.field(factory=list)
    objective: Any = None
    advantages: list | None = None
    returns: list | None = None
    old_log_probs: list | None = None
    ref_log_probs: list | None = None
    rollout_log_probs: list | None = None
    rewards: list | None = None
    truncated: list | None = None
    sample_indices: list | None = None
    routed_experts: list | None = None
    temperature: float = 1.0
    values: list | None = None


@attrs.frozen(kw_only=True)
class DatasetSpec:
    """Which prompts a ``data_source`` reads: the training data, or one evaluation set.

    ``path``: what the flag gave (a file, a folder, a dataset name; the plugin decides how
    to read it); ``flag``: where it came from, for messages (``"--prompt-data"``,
    ``"--eval-prompt-data gsm8k"``, ``"--eval-config dataset 'aime'"``); ``name``: the
    evaluation set's name, ``None`` for the training data; the ``*_key`` fields: the row
    keys of ``--input-key``, ``--label-key``, ``--metadata-key`` (comma-separated),
    ``--tool-key`` (or the evaluation set's own); ``shuffle``: shuffle every epoch with
    ``seed`` (never for evaluation); ``max_prompt_len``: drop prompts longer than this many
    tokens (``None``: keep all).
    """

    path: str | None
    flag: str
    name: str | None = None
    input_key: str | None = None
    label_key: str | None = None
    metadata_key: str | None = None
    tool_key: str | None = None
    shuffle: bool = False
    seed: int = 0
    max_prompt_len: int | None = None

    @property
    def evaluation(self) -> bool:
        """True for an evaluation set."""
        return self.name is not None


@attrs.define(frozen=True)
class ParallelLayout:
    """Where one train rank sits in its backend's parallelism (reported by ``TrainBackend.layout()``).

    ``dp_rank``/``dp_size``: the data-parallel rank and size; ranks that share a
    ``dp_rank`` (tensor, pipeline or context-parallel peers) receive the same
    micro-batches. ``returns_outputs``: whether this rank's log-probs and step metrics
    are the ones the core keeps (one rank per data-parallel rank, e.g. TP rank 0 on the
    last pipeline stage). ``rank``/``world``: the rank among all train ranks.
    ``shares_prompts``: the samples of a micro-batch that share a prompt (a GRPO group) run it
    once (prompt sharing), so the core's token-budget planner (``--use-dynamic-batch-size``)
    places each group as one item (on one data-parallel rank it lands whole in a micro-batch
    wherever it fits); False: micro-batches are packed by length.
    Plain values only: a layout travels from a remote worker to the driver.
    """

    dp_rank: int = 0
    dp_size: int = 1
    returns_outputs: bool = True
    rank: int = 0
    world: int = 1
    shares_prompts: bool = False


@attrs.define(frozen=True)
class ExecutorFit:
    """What an executor plugin says of this machine and launch (the ``executor_fit`` hook).

    ``fits``: the executor can place this run here as the flags stand; when ``--executor``
    is not given, the first executor that fits is the default. ``why``: one phrase saying
    what decided it (shown by ``--print-config``, e.g. ``"RAY_ADDRESS is set (ray job
    submit)"``). ``engines_in_driver``: the rollout engines run in the driver's process,
    on the driver's host (engines may then share one process and reach each other on
    127.0.0.1); False when each engine runs in a process of its own, wherever the
    executor puts it. An executor plugin without ``executor_fit`` never becomes the
    default and counts as ``ExecutorFit(False, "", engines_in_driver=False)``.
    """

    fits: bool
    why: str
    engines_in_driver: bool = False


@attrs.define
class WeightBucket:
    """One bucket of a weight sync: Hugging Face names with their dtypes and shapes.

    ``dtypes`` are torch dtype names without the ``torch.`` prefix (``"bfloat16"``), as
    SGLang's ``/update_weights_from_distributed`` takes them; ``shapes`` are lists of
    ints. ``tensors`` holds the tensors when the bucket travels in-process, and is None
    when only the metadata travels (the tensors follow by broadcast over the weight
    update group).
    """

    names: list
    dtypes: list
    shapes: list
    tensors: list | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the bucket's tensors (from dtypes and shapes)."""
        import math

        import torch

        return sum(math.prod(shape) * getattr(torch, dtype).itemsize for dtype, shape in zip(self.dtypes, self.shapes))
