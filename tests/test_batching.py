"""Micro-batch planning (furlong.core.train.batching): fixed and dynamic, hand-worked plans."""

from __future__ import annotations

import random

import pytest

from furlong.core.train.batching import karmarkar_karp, plan_steps, split_steps


def _plan(lengths, gbs, steps, dp, rank, mbs=1, cap=None, dynamic=False, balance=False, traj=None):
    return plan_steps(lengths, global_batch_size=gbs, num_steps=steps, dp_size=dp, rank=rank, micro_batch_size=mbs,
                      max_tokens_per_gpu=cap, dynamic=dynamic, balance=balance, trajectory_ids=traj)


# --- steps ------------------------------------------------------------------------------


def test_split_steps_takes_consecutive_slices_of_gbs():
    assert split_steps(6, 2, 3) == [[0, 1], [2, 3], [4, 5]]


def test_split_steps_keeps_trajectory_siblings_in_one_step():
    # trajectories 7, 8, 9 in order of first appearance; gbs 1 trajectory per step
    assert split_steps(6, 1, 3, [7, 7, 8, 9, 9, 9]) == [[0, 1], [2], [3, 4, 5]]


def test_split_steps_with_one_sample_trajectories_is_the_plain_rule():
    assert split_steps(4, 2, 2, [10, 11, 12, 13]) == [[0, 1], [2, 3]]


def test_split_steps_rejects_a_count_that_is_not_gbs_times_steps():
    with pytest.raises(ValueError) as err:
        split_steps(5, 2, 3)
    assert str(err.value) == "5 samples cannot fill 3 steps of global batch size 2 (6 samples)"


def test_split_steps_counts_trajectories_not_samples():
    # 2 trajectories (3 samples) fill one step of gbs 2; 3 trajectories do not
    assert split_steps(3, 2, 1, [1, 1, 2]) == [[0, 1, 2]]
    with pytest.raises(ValueError) as err:
        split_steps(4, 2, 1, [1, 1, 2, 3])
    assert str(err.value) == "3 trajectories (4 samples) cannot fill 1 steps of global batch size 2 (2 trajectories)"


# --- fixed micro-batches ------------------------------------------------------------------


def test_fixed_round_robin_over_two_ranks():
    lengths = [5] * 8
    # step 0 = samples 0..3: position p goes to rank p % 2; micro-batch size 1
    assert _plan(lengths, 4, 2, 2, 0) == [[[0], [2]], [[4], [6]]]
    assert _plan(lengths, 4, 2, 2, 1) == [[[1], [3]], [[5], [7]]]


def test_fixed_micro_batch_size_two_on_one_rank():
    assert _plan([3] * 4, 4, 1, 1, 0, mbs=2) == [[[0, 1], [2, 3]]]


def test_fixed_balanced_by_karmarkar_karp():
    # lengths 10, 1, 9, 2: round-robin gives rank 0 {0, 2} = 19 tokens vs rank 1 {1, 3} = 3;
    # KK rows (10, 9) and (2, 1) merge heaviest-with-lightest: {0, 1} = 11 and {2, 3} = 11
    lengths = [10, 1, 9, 2]
    assert _plan(lengths, 4, 1, 2, 0) == [[[0], [2]]]
    assert _plan(lengths, 4, 1, 2, 0, balance=True) == [[[0], [1]]]
    assert _plan(lengths, 4, 1, 2, 1, balance=True) == [[[2], [3]]]


def test_fixed_rejects_a_step_too_small_for_the_ranks():
    with pytest.raises(ValueError) as err:
        _plan([1, 1], 2, 1, 4, 0)
    assert str(err.value) == "step 0: 2 samples cannot give each of 4 ranks 1 micro-batches of up to 1"


# --- dynamic micro-batches ----------------------------------------------------------------


def test_dynamic_first_fit_decreasing_one_rank():
    # cap 8; decreasing order 4(6) 0(5) 2(4) 1(3) 3(2) 5(1):
    # 6 -> bin A; 5 -> bin B; 4 -> bin C; 3 -> B (8); 2 -> A (8); 1 -> C (5)
    lengths = [5, 3, 4, 2, 6, 1]
    assert _plan(lengths, 6, 1, 1, 0, cap=8, dynamic=True) == [[[3, 4], [0, 1], [2, 5]]]


def test_dynamic_raises_bin_count_to_a_multiple_of_dp_round_robin():
    # the 3 bins above (8, 8, 5 tokens) need a 4th for 2 ranks: the heaviest multi-sample bin
    # A = {4: 6, 3: 2} splits into {4} and {3}; bins [4] [3] [0,1] [2,5] dealt round-robin
    lengths = [5, 3, 4, 2, 6, 1]
    assert _plan(lengths, 6, 1, 2, 0, cap=8, dynamic=True) == [[[4], [0, 1]]]
    assert _plan(lengths, 6, 1, 2, 1, cap=8, dynamic=True) == [[[3], [2, 5]]]


def test_dynamic_balanced_by_karmarkar_karp_on_token_sums():
    # bin sums [6, 2, 8, 5]; KK rows (8, 6) spread 2 and (5, 2) spread 3 merge to
    # {bin 3 + bin 0} = 11 and {bin 1 + bin 2} = 10
    lengths = [5, 3, 4, 2, 6, 1]
    assert _plan(lengths, 6, 1, 2, 0, cap=8, dynamic=True, balance=True) == [[[4], [2, 5]]]
    assert _plan(lengths, 6, 1, 2, 1, cap=8, dynamic=True, balance=True) == [[[3], [0, 1]]]


def test_dynamic_gives_an_oversized_sample_its_own_bin():
    # cap 4: sample 0 (5 tokens) alone; samples 1 and 2 share a bin
    assert _plan([5, 1, 1], 3, 1, 1, 0, cap=4, dynamic=True) == [[[0], [1, 2]]]


def test_dynamic_needs_a_cap():
    with pytest.raises(ValueError) as err:
        _plan([1, 2], 2, 1, 1, 0, dynamic=True)
    assert str(err.value) == "dynamic batching needs a positive max_tokens_per_gpu (--max-tokens-per-gpu)"


def test_dynamic_splits_bins_down_to_single_samples_if_needed():
    # one bin {0,1,2} (3 tokens, cap 100) must become 2 for 2 ranks: halves {0,2} and {1}
    assert _plan([1, 1, 1], 3, 1, 2, 0, cap=100, dynamic=True) == [[[0, 2]]]
    assert _plan([1, 1, 1], 3, 1, 2, 1, cap=100, dynamic=True) == [[[1]]]
    # 4 ranks, 4 samples: every sample its own micro-batch
    assert _plan([1, 1, 1, 1], 4, 1, 4, 3, cap=100, dynamic=True) == [[[3]]]


def test_dynamic_errors_when_no_bin_can_be_split():
    # 3 samples can make at most 3 micro-batches, never a multiple of 4 ranks
    with pytest.raises(ValueError) as err:
        _plan([1, 1, 1], 3, 1, 4, 0, cap=100, dynamic=True)
    assert str(err.value) == (
        "step 0: 3 samples cannot fill a multiple of 4 micro-batches (data-parallel size); "
        "use a global batch size with at least that many samples per step"
    )


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("balance", [False, True])
@pytest.mark.parametrize("dp", [1, 2, 4])
def test_plan_properties_on_random_lengths(dynamic, balance, dp):
    rng = random.Random(dp * 10 + dynamic * 2 + balance)
    gbs, steps = 16, 3
    lengths = [rng.randint(1, 40) for _ in range(gbs * steps)]
    plans = [_plan(lengths, gbs, steps, dp, r, mbs=2, cap=50, dynamic=dynamic, balance=balance) for r in range(dp)]
    for s in range(steps):
        counts = {len(plans[r][s]) for r in range(dp)}
        assert len(counts) == 1  # every rank runs the same number of micro-batches
        seen = sorted(i for r in range(dp) for mb in plans[r][s] for i in mb)
        assert seen == list(range(s * gbs, (s + 1) * gbs))  # each sample of the step exactly once
        for r in range(dp):
            for mb in plans[r][s]:
                assert mb and mb == sorted(mb)
                if dynamic:
                    assert sum(lengths[i] for i in mb) <= 50 or len(mb) == 1
                else:
                    assert len(mb) == 2


# --- helpers ------------------------------------------------------------------------------


def test_karmarkar_karp_equal_counts_and_balance():
    # rows (8, 7, 6) and (3, 2, 1) merge heaviest-with-lightest: 8+1, 7+2, 6+3 = 9 each
    assert karmarkar_karp([8, 7, 6, 3, 2, 1], 3) == [[0, 5], [1, 4], [2, 3]]


def test_karmarkar_karp_pads_uneven_counts():
    parts = karmarkar_karp([5, 4, 3], 2)
    assert sorted(i for p in parts for i in p) == [0, 1, 2]
    assert sorted(len(p) for p in parts) == [1, 2]


# --- prompt groups kept whole ----------------------------------------------------------------------------


def _grouped(lengths, groups, cap, dp=1, rank=0):
    return plan_steps(lengths, global_batch_size=len(lengths), num_steps=1, dp_size=dp, rank=rank, micro_batch_size=1,
                      max_tokens_per_gpu=cap, dynamic=True, balance=False, groups=groups)


def test_token_budget_keeps_each_prompt_group_in_one_micro_batch_where_it_fits():
    # two groups of three samples whose lengths interleave: by length alone the groups are split
    lengths = [9, 4, 2, 8, 5, 3]
    groups = ["a", "a", "a", "b", "b", "b"]
    # by length: 9 | 8 | 9 + 5 | 8 + 4 | 8 + 4 + 3 | 9 + 5 + 2
    assert _plan(lengths, 6, 1, 1, 0, cap=16, dynamic=True) == [[[0, 2, 4], [1, 3, 5]]]
    # by group: b (16 tokens) first, then a (15)
    assert _grouped(lengths, groups, cap=16) == [[[3, 4, 5], [0, 1, 2]]]
    # a group over the budget goes sample by sample (9, 8); the others stay whole (2 + 3 beside the 9)
    assert _grouped([9, 8, 2, 3], ["a", "a", "b", "b"], cap=14) == [[[0, 2, 3], [1]]]
    # every micro-batch within the budget, every sample once
    plan = _grouped([7, 6, 5, 4, 3, 2, 1, 1], [0, 0, 1, 1, 2, 2, 3, 3], cap=10)[0]
    assert sorted(i for mb in plan for i in mb) == list(range(8))
    assert all(sum([7, 6, 5, 4, 3, 2, 1, 1][i] for i in mb) <= 10 for mb in plan)
    # items: group (2, 3) of 9, then 7 and 6 (their group's 13 is over 10), group (4, 5) of 5, group (6, 7) of 2
    assert plan == [[2, 3], [0, 6, 7], [1], [4, 5]]


def test_prompt_groups_change_nothing_without_a_token_budget():
    lengths, groups = [9, 4, 2, 8, 5, 3], [0, 0, 0, 1, 1, 1]
    fixed = plan_steps(lengths, global_batch_size=6, num_steps=1, dp_size=2, rank=0, micro_batch_size=2,
                       max_tokens_per_gpu=None, dynamic=False, balance=False, groups=groups)
    assert fixed == _plan(lengths, 6, 1, 2, 0, mbs=2)


def test_a_bin_halved_for_more_ranks_is_cut_between_its_groups():
    plans = [plan_steps([10, 10, 10, 10], global_batch_size=4, num_steps=1, dp_size=2, rank=r, micro_batch_size=1,
                        max_tokens_per_gpu=40, dynamic=True, balance=False, groups=[0, 0, 1, 1]) for r in range(2)]
    assert plans == [[[[0, 1]]], [[[2, 3]]]]
    # one group in the bin: its samples are dealt as before
    plans = [plan_steps([10, 10, 10, 10], global_batch_size=4, num_steps=1, dp_size=2, rank=r, micro_batch_size=1,
                        max_tokens_per_gpu=40, dynamic=True, balance=False, groups=[0] * 4) for r in range(2)]
    assert plans == [[[[0, 2]]], [[[1, 3]]]]


def test_a_step_whole_groups_cannot_spread_over_the_ranks_is_planned_by_sample():
    lengths, tids, groups = [140, 84, 14, 169, 221, 250, 150], [0, 0, 1, 1, 2, 2, 3], [0, 0, 1, 1, 2, 2, 3]
    for rank in range(4):
        kwargs = dict(global_batch_size=4, num_steps=1, dp_size=4, rank=rank, micro_batch_size=1,
                      max_tokens_per_gpu=302, dynamic=True, balance=False, trajectory_ids=tids)
        assert plan_steps(lengths, groups=groups, **kwargs) == plan_steps(lengths, **kwargs)


def test_grouped_plans_keep_every_sample_once_within_the_budget_and_whole_groups_on_one_rank():
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 24)
        lengths = [rng.randint(1, 300) for _ in range(n)]
        groups = [rng.randint(0, max(1, n // 3)) for _ in range(n)]
        cap, dp, balance = rng.randint(100, 1500), rng.choice([1, 1, 2, 3]), rng.random() < 0.5
        if n < dp:
            continue
        try:
            plans = [plan_steps(lengths, global_batch_size=n, num_steps=1, dp_size=dp, rank=r, micro_batch_size=1,
                                max_tokens_per_gpu=cap, dynamic=True, balance=balance, groups=groups)[0]
                     for r in range(dp)]
        except ValueError:  # as without groups: too few samples for a multiple of dp micro-batches
            with pytest.raises(ValueError):
                plan_steps(lengths, global_batch_size=n, num_steps=1, dp_size=dp, rank=0, micro_batch_size=1,
                           max_tokens_per_gpu=cap, dynamic=True, balance=False)
            continue
        micro = [mb for plan in plans for mb in plan]
        assert sorted(i for mb in micro for i in mb) == list(range(n))
        assert len({len(plan) for plan in plans}) == 1
        assert all(len(mb) == 1 or sum(lengths[i] for i in mb) <= cap for mb in micro)
        if dp == 1:
            for g in set(groups):
                members = [i for i in range(n) if groups[i] == g]
                if sum(lengths[i] for i in members) <= cap:
                    assert any(set(members) <= set(mb) for mb in micro), (lengths, groups, cap)
