"""Dr. GRPO's loss reduction: every response divided by the same constant, not by its own length.

GRPO's per-sample mean weighs each token of a response by ``1/|o_i|``, so long wrong
answers are penalised less per token than short ones and responses grow. Dr. GRPO
(Liu et al., 2025, "Understanding R1-Zero-Like Training: A Critical Perspective",
arXiv:2503.20783, section 3.2) divides every response by one constant, the generation
budget. With the core's step factor ``1/n_s`` the step loss is
``L_s = (1/n_s) * sum_i sum_t x_it m_it / L_max``, ``L_max`` = ``--rollout-max-response-len``.
Pair it with ``--disable-grpo-std-normalization`` for the paper's unbiased advantage.
"""

from __future__ import annotations

from furlong.hooks import hookimpl
from furlong.kit.masked import masked_sum


@hookimpl
def configure(args, report):
    """The constant is ``--rollout-max-response-len``; the step factor must be the sample count."""
    if args.calculate_per_token_loss:
        report.error(f"--loss-reducer {report.plugin} divides each response by --rollout-max-response-len and the "
                     "step by its sample count; drop --calculate-per-token-loss, which divides by the token count.")
    if not args.rollout_max_response_len:
        report.error(f"--loss-reducer {report.plugin} needs --rollout-max-response-len (the constant it divides "
                     f"by), got {args.rollout_max_response_len}.")


@hookimpl
def loss_reducer(config, values, loss_masks):
    """``sum_i sum_t x_it m_it / L_max`` over the micro-batch: a 0-dim float32 tensor keeping the graph.

    :param values: N float32 tensors [T_i] carrying grad; :param loss_masks: N 0/1 tensors [T_i].
    Masked positions are selected away, so a NaN there changes neither value nor gradient.
    """
    return masked_sum(values, loss_masks) / float(config.rollout_max_response_len)
