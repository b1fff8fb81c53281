"""Learning-rate schedule of the fsdp backend (Megatron's OptimizerParamScheduler semantics).

Counted in optimizer steps; Megatron counts samples (``steps x gbs``), which gives the
same values because every length scales by ``gbs``.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from furlong.hooks import PluginError, RunConfig

__all__ = ["LRSchedule", "lr_at"]

_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
_WSD_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")


def lr_at(
    step: float,
    *,
    lr: float,
    min_lr: float,
    warmup: float,
    decay: float,
    style: str,
    init: float = 0.0,
    wsd_decay: float | None = None,
    wsd_style: str = "exponential",
) -> float:
    """Learning rate of optimizer step ``step`` (0-based; the first step uses ``lr_at(0)``).

    Warmup (``step < warmup``): ``init + (lr - init) * step / warmup``. Then, with
    ``rho = (step - warmup) / (decay - warmup)``: constant ``lr`` (never decays, as in
    Megatron); linear ``lr - (lr - min_lr) * rho``; cosine
    ``min_lr + (lr - min_lr) * (1 + cos(pi * rho)) / 2``; inverse-square-root
    ``max(min_lr, lr * sqrt(max(warmup, 1) / max(step, 1)))``; WSD: ``lr`` until
    ``decay - wsd_decay``, then annealed over ``wsd_decay`` steps with ``r`` the anneal
    fraction: linear ``1 - r``, cosine ``(1 + cos(pi r)) / 2``, exponential
    ``2 * 0.5**r - 1``, minus_sqrt ``1 - sqrt(r)`` (coefficient of ``lr - min_lr`` above
    ``min_lr``). After ``decay`` steps: ``min_lr`` (all styles but constant).

    Reference: Megatron-LM ``OptimizerParamScheduler.get_lr``.
    """
    if warmup > 0 and step < warmup:
        return init + (lr - init) * step / warmup
    if style == "constant":
        return lr
    if step > decay:
        return min_lr
    if style == "inverse-square-root":
        return max(min_lr, lr * math.sqrt(max(warmup, 1)) / math.sqrt(max(step, 1)))
    span = decay - warmup
    rho = (step - warmup) / span if span > 0 else 1.0
    if style == "linear":
        coeff = 1.0 - rho
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * rho) + 1.0)
    elif style == "WSD":
        anneal_start = decay - wsd_decay
        if step <= anneal_start:
            coeff = 1.0
        else:
            r = (step - anneal_start) / wsd_decay
            coeff = {"linear": 1.0 - r, "cosine": 0.5 * (math.cos(math.pi * r) + 1.0),
                     "exponential": 2.0 * 0.5**r - 1.0, "minus_sqrt": 1.0 - math.sqrt(r)}[wsd_style]
    else:
        raise ValueError(f"unknown lr decay style {style!r}")
    return min_lr + coeff * (lr - min_lr)


@attrs.define
class LRSchedule:
    """The resolved schedule: lengths in optimizer steps. Build it with :meth:`from_config`."""

    lr: float
    min_lr: float
    warmup: float
    decay: float
    style: str
    init: float
    wsd_decay: float | None = None
    wsd_style: str = "exponential"

    @classmethod
    def from_config(cls, config: RunConfig) -> "LRSchedule":
        """Resolve ``--lr``, ``--min-lr``, ``--lr-decay-style``, ``--lr-decay-iters`` (default: total
        steps ``T = num_rollout * num_steps_per_rollout``), ``--lr-warmup-iters`` or
        ``--lr-warmup-fraction`` (of the decay steps), ``--lr-warmup-init``,
        ``--lr-wsd-decay-iters`` and ``--lr-wsd-decay-style`` (WSD only).

        :raises PluginError: an unknown style, WSD without ``--lr-wsd-decay-iters``, or a
            warmup longer than the decay.
        """
        style = config.lr_decay_style or "constant"
        if style not in _STYLES:
            raise PluginError(f"--lr-decay-style {style!r}: the fsdp backend supports {', '.join(_STYLES)}.")
        steps_per_rollout = config.num_steps_per_rollout
        if not steps_per_rollout:
            steps_per_rollout = config.rollout_batch_size * config.n_samples_per_prompt // config.global_batch_size
        total = int(config.num_rollout) * int(steps_per_rollout)
        decay = config.lr_decay_iters if config.lr_decay_iters is not None else total
        fraction = config.lr_warmup_fraction
        warmup = fraction * decay if fraction is not None else (config.lr_warmup_iters or 0)
        if style != "constant" and warmup > decay:
            raise PluginError(
                f"--lr-warmup-iters/--lr-warmup-fraction give {warmup:g} warmup steps, more than the "
                f"{decay:g} decay steps (--lr-decay-iters, default num_rollout x steps per rollout); shorten the warmup."
            )
        wsd_decay = config.lr_wsd_decay_iters
        wsd_style = config.lr_wsd_decay_style
        if style == "WSD":
            if not wsd_decay:
                raise PluginError("--lr-decay-style WSD needs --lr-wsd-decay-iters (steps of the final anneal).")
            if wsd_style not in _WSD_STYLES:
                raise PluginError(f"--lr-wsd-decay-style {wsd_style!r}: choose one of {', '.join(_WSD_STYLES)}.")
        return cls(lr=float(config.lr), min_lr=float(config.min_lr or 0.0), warmup=warmup,
                   decay=decay, style=style, init=float(config.lr_warmup_init or 0.0),
                   wsd_decay=wsd_decay, wsd_style=wsd_style)

    def __call__(self, step: int) -> float:
        """Learning rate of optimizer step ``step`` (0-based)."""
        return lr_at(step, lr=self.lr, min_lr=self.min_lr, warmup=self.warmup, decay=self.decay, style=self.style,
                     init=self.init, wsd_decay=self.wsd_decay, wsd_style=self.wsd_style)
