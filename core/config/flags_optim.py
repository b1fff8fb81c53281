"""Flags of the ``optimizer`` group (OPTIMIZER_ARGS of a Miles script). Megatron names; the
fsdp backend maps them. Defaults are furlong's documented ones, the same on both backends."""

from __future__ import annotations

from ._util import megatron

__all__ = ["add"]


def add(g, dev) -> None:
    """Add the flags to argument group ``g``; ``dev`` holds the machine-dependent defaults."""
    g.add_argument("--optimizer", choices=["adam", "sgd"], default="adam", help="adam (AdamW) or sgd.")
    g.add_argument("--lr", type=float, default=1e-6, help="Learning rate.")
    g.add_argument("--min-lr", type=float, default=0.0, help="Floor of the decay schedules.")
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
                   default="constant", help="Learning-rate schedule after warmup.")
    g.add_argument("--lr-decay-iters", type=int, default=None,
                   help="Steps of the decay (default: total optimizer steps = num_rollout x num_steps_per_rollout).")
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="Linear warmup steps.")
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="Warmup as a fraction of --lr-decay-iters, in [0, 1] (exclusive with --lr-warmup-iters).")
    g.add_argument("--lr-warmup-init", type=float, default=0.0, help="Learning rate at the start of warmup.")
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None,
                   help="WSD: steps of the final anneal (Megatron name); required with --lr-decay-style WSD.")
    g.add_argument("--lr-wsd-decay-style", choices=["exponential", "linear", "cosine", "minus_sqrt"],
                   default="exponential", help="WSD: shape of the final anneal (Megatron name).")
    g.add_argument("--weight-decay", type=float, default=0.1, help="Decoupled weight decay.")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1, in [0, 1).")
    g.add_argument("--adam-beta2", type=float, default=0.98, help="Adam beta2, in [0, 1).")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon (>= 0).")
    g.add_argument("--clip-grad", type=float, default=1.0, help="Global gradient L2-norm clip.")
    megatron(g, "--optimizer-cpu-offload", action="store_true",
             help="Megatron: megatron-core's distributed optimizer with its state on the host "
                  "(--optimizer-offload-fraction of it); needs CUDA (implies --use-distributed-optimizer).")
    megatron(g, "--overlap-cpu-optimizer-d2h-h2d", action="store_true",
             help="Megatron: overlap the host optimizer's copies with the step (with --optimizer-cpu-offload).")
    megatron(g, "--use-precision-aware-optimizer", action="store_true",
             help="Megatron: megatron-core's precision-aware distributed optimizer; needs CUDA (implies "
                  "--use-distributed-optimizer).")
