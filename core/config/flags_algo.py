"""Flags of the ``algorithm`` group: the RL objective (GRPO_ARGS of a Miles script).
The estimator and the loss are chosen in the ``plugins`` group."""

from __future__ import annotations

import argparse

from ._util import float_or_inf, megatron

__all__ = ["add"]


def add(g, dev) -> None:
    """Add the flags to argument group ``g``; ``dev`` holds the machine-dependent defaults."""
    g.add_argument("--eps-clip", type=float, default=0.2, help="PPO clip range, lower side.")
    g.add_argument("--eps-clip-high", type=float, default=None, help="PPO clip range, upper side (default: --eps-clip).")
    g.add_argument("--eps-clip-c", type=float, default=None, help="Dual-clip constant c (> 1); off when unset.")
    g.add_argument("--use-kl-loss", action="store_true",
                   help="Load the reference model and add kl_loss_coef x KL to the loss (coef 0 = log only).")
    g.add_argument("--kl-loss-coef", type=float, default=0.0, help="Weight of the KL loss term.")
    g.add_argument("--kl-loss-type", choices=["k1", "k2", "k3", "low_var_kl"], default="k1",
                   help="KL estimator, for the loss and for reward shaping.")
    g.add_argument("--use-unbiased-kl", action="store_true", help="Multiply the KL by pi_theta / pi_old.")
    g.add_argument("--kl-coef", type=float, default=0.0,
                   help="KL folded into the rewards (ppo, reinforce++); exclusive with --kl-loss-coef.")
    g.add_argument("--entropy-coef", type=float, default=0.0, help="Entropy bonus weight.")
    g.add_argument("--observe-training-entropy", action="store_true", help="Log entropy even when its weight is 0.")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="Average the loss over all trainable tokens of a step instead of per sample.")
    g.add_argument("--mask-truncated-samples", action="store_true",
                   help="Truncated samples get loss mask 0 and leave the loss denominators.")
    g.add_argument("--policy-ratio-level", choices=["token", "sequence"], default=None,
                   help="PPO ratio per token, or GSPO's per sequence (default: token; the gspo estimator "
                        "makes it sequence unless given).")
    g.add_argument("--use-tis", action=argparse.BooleanOptionalAction, default=False,
                   help="Truncated importance sampling against rollout log-probs (on by default under furlong "
                        "train-async unless --use-rollout-logprobs is given; --no-use-tis turns it off).")
    g.add_argument("--tis-clip", type=float_or_inf, default=2.0,
                   help="TIS upper clip, at least --tis-clip-low (inf: no upper truncation).")
    g.add_argument("--tis-clip-low", type=float, default=0.0, help="TIS lower clip (>= 0).")
    g.add_argument("--custom-tis-function-path", default=None,
                   help="module.function(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, "
                        "total_lengths, response_lengths, **kw) -> (pg_loss, loss_masks, metrics): Miles' custom "
                        "TIS/rejection sampling, replacing the built-in TIS (needs --use-tis or "
                        "--get-mismatch-metrics).")
    g.add_argument("--use-rollout-logprobs", action="store_true",
                   help="Use the engine's log-probs as pi_old (exclusive with --use-tis).")
    g.add_argument("--get-mismatch-metrics", action="store_true",
                   help="Log train/rollout mismatch metrics (train_rollout_logprob_abs_diff, train_rollout_kl, the "
                        "custom TIS function's and ois), computing the trainer's log-probs even under "
                        "--use-rollout-logprobs; the --custom-tis-function-path function weights the loss as under "
                        "--use-tis. Needs --custom-tis-function-path.")
    g.add_argument("--custom-pg-loss-reducer-function-path", default=None,
                   help="module.function reducing the policy-gradient term.")
    g.add_argument("--loss-reducer", default=None, metavar="NAME",
                   help="loss_reducer plugin reducing the policy-gradient term (e.g. dr_grpo); default: the core's "
                        "per-sample or per-token mean.")
    g.add_argument("--use-opsm", action="store_true", help="Off-policy sequence masking.")
    g.add_argument("--opsm-delta", type=float, default=1e-4, help="OPSM threshold.")
    g.add_argument("--normalize-advantages", action="store_true",
                   help="Whiten advantages over the rollout (required by the reinforce++ estimators).")
    g.add_argument("--disable-grpo-std-normalization", action="store_true",
                   help="Do not divide by the group std (forced when --n-samples-per-prompt is 1).")
    g.add_argument("--disable-rewards-normalization", action="store_true", help="Do not subtract the group mean.")
    g.add_argument("--gamma", type=float, default=1.0, help="Discount factor, in [0, 1].")
    g.add_argument("--lambd", type=float, default=1.0, help="GAE lambda, in [0, 1].")
    g.add_argument("--value-clip", type=float_or_inf, default=0.2,
                   help="ppo: clip of the critic's values around their values at scoring time (value loss); >= 0, "
                        "inf: no clipping.")
    g.add_argument("--num-critic-only-steps", type=int, default=0,
                   help="ppo: the first N rollouts train only the critic (the actor waits); N at least --num-rollout "
                        "trains no actor (warned).")
    g.add_argument("--critic-load", default=None,
                   help="ppo: critic to start from: a critic checkpoint folder (iter_* and its marker) or a Hugging "
                        "Face directory (default: the critic of --load, else --hf-checkpoint with a fresh value "
                        "head).")
    g.add_argument("--critic-save", default=None, help="ppo: critic checkpoint folder (default: --save + '_critic').")
    g.add_argument("--critic-lr", type=float, default=None, help="ppo: critic learning rate (default: --lr).")
    g.add_argument("--critic-lr-warmup-iters", type=int, default=0,
                   help="ppo: critic learning-rate warmup, in optimizer steps.")
    g.add_argument("--ref-update-interval", type=int, default=None,
                   help="Copy the actor into the reference every k rollouts (not supported yet).")
    g.add_argument("--use-opd", action="store_true", help="On-policy distillation on top of the estimator.")
    g.add_argument("--opd-type", choices=["sglang", "megatron"], default=None,
                   help="OPD teacher: sglang = a served model (SGLang's /generate, or furlong serve) at --rm-url or "
                        "--opd-teacher-urls; megatron (a teacher checkpoint in the trainer) is not supported yet. "
                        "Required with --use-opd.")
    g.add_argument("--opd-kl-coef", type=float, default=1.0, help="OPD KL weight (>= 0).")
    megatron(g, "--opd-teacher-load", default=None, help="Megatron: the OPD teacher checkpoint (--opd-type megatron).")
    g.add_argument("--opd-teacher-urls", nargs="+", default=None, metavar="NAME=URL",
                   help="OPD sglang teachers by name: a sample's metadata[--opd-teacher-key] picks one; the name "
                        "'default' (else --rm-url) serves the others.")
    g.add_argument("--opd-teacher-key", default="opd_teacher",
                   help="The sample metadata key naming its OPD teacher (--opd-teacher-urls).")
    g.add_argument("--disable-compute-advantages-and-returns", action="store_true",
                   help="Skip the advantage estimator: no advantages or returns (supervised fine-tuning with "
                        "--loss-type sft_loss).")
    g.add_argument("--use-routing-replay", action="store_true",
                   help="MoE routing replay: the training forward routes each token to the experts the old-log-prob "
                        "pass chose (a train backend that replays routing, on a mixture-of-experts model).")
    g.add_argument("--use-rollout-routing-replay", action="store_true",
                   help="Replay the rollout engine's MoE routing (Sample.rollout_routed_experts) in the trainer's "
                        "forward passes; implies --use-routing-replay.")
    g.add_argument("--true-on-policy-mode", action="store_true",
                   help="Bit-identical rollout and training numerics (not supported yet).")
    g.add_argument("--reset-optimizer-states", action="store_true", help="Zero the Adam state at each rollout.")
