"""Miles' ``--spec MODULE FUNCTION`` values: the model family each names, built here or refused.

Miles selects a model family's Megatron layers through a spec provider of its own plugins
(``miles_plugins.models.*``). This backend builds every model from the ``--hf-checkpoint`` config
instead (:func:`~.config.model_shape`), so a spec only says which family the script expects: a
family built here is accepted with one info line (and must be the family of the config), one that
is not is refused naming what it lacks. The pairs are those Miles' scripts pass
(``scripts/models/*.py``).
"""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["MILES_SPECS", "MilesSpec", "spec_problems"]


@attrs.frozen
class MilesSpec:
    """A Miles spec provider: the ``family`` it builds, the HF ``model_types`` of its checkpoints this
    backend builds from, and ``missing``: what this backend lacks to build it (empty when built)."""

    family: str
    model_types: tuple = ()
    missing: str = ""


MILES_SPECS = {
    ("miles_plugins.models.glm4", "get_glm_spec"): MilesSpec("GLM-4", ("glm4",)),
    ("miles_plugins.models.qwen3_5", "get_qwen3_5_spec"): MilesSpec(
        "Qwen3.5", missing="its Gated DeltaNet linear-attention layers (three of every four layers), the gated "
                           "attention output and the 1 + weight norm scales"),
    ("miles_plugins.models.qwen3_next", "get_qwen3_next_spec"): MilesSpec(
        "Qwen3-Next", missing="its Gated DeltaNet linear-attention layers, the gated attention output, the "
                              "1 + weight norm scales and its shared expert"),
    ("miles_plugins.models.glm5.glm5", "get_glm5_spec"): MilesSpec(
        "GLM-5", missing="multi-latent attention with the DeepSeek sparse-attention indexer, the sigmoid router "
                         "with its expert bias and shared experts"),
    ("miles_plugins.models.deepseek_v4.deepseek_v4", "get_dsv4_spec"): MilesSpec(
        "DeepSeek-V4", missing="its compressed sparse attention with the indexer, hyper-connections and its "
                               "mixture of experts"),
}


def spec_problems(spec: Any, model_type: str | None) -> tuple[list[str], list[str]]:
    """``(errors, infos)`` for the ``--spec`` value ``spec`` (``[module, function]``, or None when not given).

    :param model_type: the ``--hf-checkpoint`` config's ``model_type``, or None when it cannot be read here.
    :returns: one error for a spec of a family not built here (naming what is missing), for one not
        known (listing those known), or for a config of another family than the spec's; else one info line.
    """
    if not spec:
        return [], []
    module, function = (list(spec) + [None, None])[:2]
    given = f"--spec {module} {function}"
    entry = MILES_SPECS.get((module, function))
    if entry is None:
        known = "; ".join(f"{m} {f}" for m, f in MILES_SPECS)
        return [f"{given}: not a Miles model spec known to --train-backend megatron (known: {known}). This "
                "backend builds the model from --hf-checkpoint's config.json; for Qwen2/2.5, Qwen3, Qwen3-MoE and "
                "Llama 3 remove --spec."], []
    if entry.missing:
        return [f"{given} selects {entry.family}, which --train-backend megatron does not build yet: "
                f"{entry.missing} are missing."], []
    if model_type is not None and model_type not in entry.model_types:
        return [f"{given} selects {entry.family}, but --hf-checkpoint's config.json has model_type "
                f"{model_type!r} (expected {', '.join(entry.model_types)})."], []
    return [], [f"{given}: {entry.family}, built by --train-backend megatron from --hf-checkpoint's config.json "
                f"(model_type {', '.join(entry.model_types)})."]
