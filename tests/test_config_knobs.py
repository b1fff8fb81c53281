"""The four-knob invariant: every subset of given knobs, a rollout smaller than one
optimizer step (an error naming all four knobs, never zero steps), and the data-parallel
divisibility checks (against the data-parallel rule the train backend reports in ``configure``)."""

from __future__ import annotations

import pytest

from furlong.core.config import ConfigError, parse_args
from furlong.core.config.launch_args import launch_config

R, N, G, S = "--rollout-batch-size", "--n-samples-per-prompt", "--global-batch-size", "--num-steps-per-rollout"
REQUIRED = ("--rollout-batch-size is required: give the prompts per rollout (or --global-batch-size, the samples "
            "per optimizer step, from which it follows: --rollout-batch-size (?) x --n-samples-per-prompt ({n}) = "
            "--global-batch-size (?) x --num-steps-per-rollout ({s})).")


pytestmark = pytest.mark.usefixtures("cpu_machine")  # the same defaults on every machine


def knobs_argv(given: dict) -> list[str]:
    argv = ["--num-rollout", "3"]
    for flag, value in given.items():
        argv += [flag, str(value)]
    return argv


def knobs_of(args) -> tuple[int, int, int, int]:
    return (args.rollout_batch_size, args.n_samples_per_prompt, args.global_batch_size, args.num_steps_per_rollout)


# One row per subset of given knobs (all 16) with values that work: (given, rbs, n, gbs, S).
SOLVABLE = [
    ({R: 4}, (4, 1, 4, 1)),                       # n := 1, S := 1, gbs = 4*1/1
    ({G: 8}, (8, 1, 8, 1)),                       # n := 1, S := 1, rbs = 8*1/1
    ({R: 4, N: 4}, (4, 4, 16, 1)),                # S := 1, gbs = 4*4/1
    ({R: 8, G: 4}, (8, 1, 4, 2)),                 # n := 1, S = 8*1/4
    ({R: 4, S: 2}, (4, 1, 2, 2)),                 # n := 1, gbs = 4*1/2
    ({N: 4, G: 8}, (2, 4, 8, 1)),                 # S := 1, rbs = 8*1/4
    ({G: 8, S: 2}, (16, 1, 8, 2)),                # n := 1, rbs = 8*2/1
    ({R: 4, N: 4, G: 8}, (4, 4, 8, 2)),           # S = 16/8
    ({R: 4, N: 4, S: 2}, (4, 4, 8, 2)),           # gbs = 16/2
    ({R: 4, G: 8, S: 2}, (4, 4, 8, 2)),           # n = 8*2/4
    ({N: 4, G: 8, S: 2}, (4, 4, 8, 2)),           # rbs = 8*2/4
    ({R: 4, N: 4, G: 8, S: 2}, (4, 4, 8, 2)),     # 4*4 == 8*2
]


@pytest.mark.parametrize("given, expected", SOLVABLE, ids=lambda v: str(v))
def test_knobs_derived_from_given_subset(given, expected):
    args = parse_args(knobs_argv(given))
    assert knobs_of(args) == expected
    assert sorted(set(args.explicit_args) & {"rollout_batch_size", "n_samples_per_prompt", "global_batch_size",
                                             "num_steps_per_rollout"}) == sorted(
        {R: "rollout_batch_size", N: "n_samples_per_prompt", G: "global_batch_size",
         S: "num_steps_per_rollout"}[k] for k in given)


# One row per subset of given knobs (all 16) with values that cannot work, and the message.
UNSOLVABLE = [
    ({}, REQUIRED.format(n=1, s=1)),
    ({N: 4}, REQUIRED.format(n=4, s=1)),
    ({S: 2}, REQUIRED.format(n=1, s=2)),
    ({N: 4, S: 2}, REQUIRED.format(n=4, s=2)),
    ({R: 0}, "--rollout-batch-size must be a positive whole number, got 0: --rollout-batch-size (0) x "
             "--n-samples-per-prompt (1) = --global-batch-size (?) x --num-steps-per-rollout (1)."),
    ({G: -2}, "--global-batch-size must be a positive whole number, got -2: --rollout-batch-size (?) x "
              "--n-samples-per-prompt (1) = --global-batch-size (-2) x --num-steps-per-rollout (1)."),
    ({R: 4, N: 0}, "--n-samples-per-prompt must be a positive whole number, got 0: --rollout-batch-size (4) x "
                   "--n-samples-per-prompt (0) = --global-batch-size (?) x --num-steps-per-rollout (1)."),
    ({G: 8, S: 0}, "--num-steps-per-rollout must be a positive whole number, got 0: --rollout-batch-size (?) x "
                   "--n-samples-per-prompt (1) = --global-batch-size (8) x --num-steps-per-rollout (0)."),
    # n := 1, S = 4*1/8 = 0.5
    ({R: 4, G: 8}, "--rollout-batch-size (4) x --n-samples-per-prompt (1) = --global-batch-size (8) x "
                   "--num-steps-per-rollout (?) has no whole solution with --num-steps-per-rollout >= 1: "
                   "num_steps_per_rollout = 4 samples per rollout / 8 samples per step = 0.5."),
    # n := 1, gbs = 3*1/2 = 1.5
    ({R: 3, S: 2}, "--rollout-batch-size (3) x --n-samples-per-prompt (1) = --global-batch-size (?) x "
                   "--num-steps-per-rollout (2) has no whole solution with --global-batch-size >= 1: "
                   "global_batch_size = 3 samples per rollout / 2 steps per rollout = 1.5."),
    # S := 1, rbs = 8*1/3 = 2.667
    ({N: 3, G: 8}, "--rollout-batch-size (?) x --n-samples-per-prompt (3) = --global-batch-size (8) x "
                   "--num-steps-per-rollout (1) has no whole solution with --rollout-batch-size >= 1: "
                   "rollout_batch_size = 8 samples per rollout / 3 samples per prompt = 2.667."),
    # S = 4*4/64 = 0.25: a rollout smaller than one step
    ({R: 4, N: 4, G: 64}, "--rollout-batch-size (4) x --n-samples-per-prompt (4) = --global-batch-size (64) x "
                          "--num-steps-per-rollout (?) has no whole solution with --num-steps-per-rollout >= 1: "
                          "num_steps_per_rollout = 16 samples per rollout / 64 samples per step = 0.25."),
    # gbs = 4*4/3 = 5.333 (rejected, not rounded down to 5)
    ({R: 4, N: 4, S: 3}, "--rollout-batch-size (4) x --n-samples-per-prompt (4) = --global-batch-size (?) x "
                         "--num-steps-per-rollout (3) has no whole solution with --global-batch-size >= 1: "
                         "global_batch_size = 16 samples per rollout / 3 steps per rollout = 5.333."),
    # n = 8*2/3 = 5.333
    ({R: 3, G: 8, S: 2}, "--rollout-batch-size (3) x --n-samples-per-prompt (?) = --global-batch-size (8) x "
                         "--num-steps-per-rollout (2) has no whole solution with --n-samples-per-prompt >= 1: "
                         "n_samples_per_prompt = 16 samples per rollout / 3 prompts per rollout = 5.333."),
    # rbs = 8*2/3 = 5.333
    ({N: 3, G: 8, S: 2}, "--rollout-batch-size (?) x --n-samples-per-prompt (3) = --global-batch-size (8) x "
                         "--num-steps-per-rollout (2) has no whole solution with --rollout-batch-size >= 1: "
                         "rollout_batch_size = 16 samples per rollout / 3 samples per prompt = 5.333."),
    # 4*4 = 16 != 8*1 = 8
    ({R: 4, N: 4, G: 8, S: 1}, "--rollout-batch-size (4) x --n-samples-per-prompt (4) = 16 samples per rollout, "
                               "but --global-batch-size (8) x --num-steps-per-rollout (1) = 8 samples per rollout; "
                               "both sides must be equal."),
]


@pytest.mark.parametrize("given, message", UNSOLVABLE, ids=lambda v: str(v)[:60])
def test_knobs_unsolvable_subset_is_one_error(given, message):
    with pytest.raises(ConfigError) as excinfo:
        parse_args(knobs_argv(given))
    assert str(excinfo.value) == message


def test_every_subset_of_the_four_knobs_is_covered():
    subsets = {frozenset(g) for g, _ in SOLVABLE} | {frozenset(g) for g, _ in UNSOLVABLE}
    assert len(subsets) == 16


class TestC016:
    """A rollout smaller than the global batch: num_rollout 3, rbs 4, n 4 -> 16 samples."""

    base = ["--num-rollout", "3", R, "4", N, "4"]

    def test_global_batch_larger_than_rollout_names_all_four_knobs(self):
        with pytest.raises(ConfigError) as excinfo:
            parse_args(self.base + [G, "64"])
        message = str(excinfo.value)
        for text in ("--rollout-batch-size (4)", "--n-samples-per-prompt (4)", "--global-batch-size (64)",
                     "--num-steps-per-rollout (?)", "16 samples per rollout", "64 samples per step"):
            assert text in message

    @pytest.mark.parametrize("gbs, steps, total", [(16, 1, 3), (8, 2, 6)])
    def test_valid_global_batch_sizes(self, gbs, steps, total):
        args = parse_args(self.base + [G, str(gbs)])
        assert args.num_steps_per_rollout == steps
        assert args.lr_decay_iters == total  # total optimizer steps = num_rollout x S = 3 x S

    def test_two_steps_without_global_batch_derives_eight(self):
        args = parse_args(self.base + [S, "2"])
        assert args.global_batch_size == 8  # 16 / 2

    def test_three_steps_is_rejected_not_rounded(self):
        with pytest.raises(ConfigError, match=r"global_batch_size = 16 samples per rollout / 3 steps"):
            parse_args(self.base + [S, "3"])


MEGATRON4 = ["--train-backend", "megatron", "--hf-checkpoint", "examples/demo/model", "--actor-num-gpus-per-node", "4"]


@pytest.mark.parametrize("extra, message", [
    # D = 4 / (TP 1 x PP 1 x CP 1) = 4; gbs 6 % 4 != 0
    (MEGATRON4 + [R, "6"],
     "--global-batch-size (6) must be divisible by the data-parallel size 4 (actor_num_nodes 1 x "
     "actor_num_gpus_per_node 4 / (TP 1 x PP 1 x CP 1)): every rank trains on the same number of samples per step."),
    # D = 4 / 2 = 2; gbs 8 / 2 = 4 samples per rank, 4 % 3 != 0
    (MEGATRON4 + ["--tensor-model-parallel-size", "2", "--sequence-parallel", R, "8", "--micro-batch-size", "3"],
     "--global-batch-size (8) / data-parallel size 2 = 4 samples per rank per step is not a multiple of "
     "--micro-batch-size (3); change one of them or use --use-dynamic-batch-size."),
    # 4 GPUs cannot hold TP 3
    (MEGATRON4 + ["--tensor-model-parallel-size", "3", "--sequence-parallel", R, "8"],
     "trainer world size 4 (actor_num_nodes 1 x actor_num_gpus_per_node 4) is not divisible by TP 3 x PP 1 x "
     "CP 1 = 3."),
    # fsdp: D = world size 2; gbs 3 % 2 != 0
    (["--actor-num-gpus-per-node", "2", R, "3"],
     "--global-batch-size (3) must be divisible by the data-parallel size 2 (actor_num_nodes 1 x "
     "actor_num_gpus_per_node 2, --train-backend fsdp): every rank trains on the same number of samples per step."),
])
def test_data_parallel_divisibility(extra, message):
    with pytest.raises(ConfigError) as excinfo:
        launch_config("--num-rollout", "1", *extra)
    assert message in str(excinfo.value).splitlines()  # the backend may add problems of its own


def test_a_world_size_taken_from_this_machine_says_so():
    with pytest.raises(ConfigError) as excinfo:
        launch_config("--num-rollout", "1", "--train-backend", "megatron", "--tensor-model-parallel-size", "2",
                      "--sequence-parallel", R, "8")
    assert ("trainer world size 1 (actor_num_nodes 1 x actor_num_gpus_per_node 1) is not divisible by TP 2 x PP 1 x "
            "CP 1 = 2 (--actor-num-gpus-per-node was not given: 1 is this machine's GPU count, 1 without CUDA; give "
            "the GPUs per node the trainer will run on).") in str(excinfo.value).splitlines()


def test_data_parallel_size_megatron_and_micro_batch_skip_under_dynamic_batching():
    # D = 8 / (TP 2 x PP 1 x CP 2) = 2; gbs 8 / 2 = 4, 4 % 3 ignored with dynamic batching
    args = launch_config("--num-rollout", "1", "--train-backend", "megatron", "--hf-checkpoint", "examples/demo/model",
                         "--actor-num-gpus-per-node", "8", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                         "--context-parallel-size", "2", R, "8", "--micro-batch-size", "3", "--use-dynamic-batch-size",
                         "--max-tokens-per-gpu", "4096")
    assert args.data_parallel_size == 2
    assert args.global_batch_size == 8
