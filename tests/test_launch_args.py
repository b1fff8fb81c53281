"""``launch_args``: the one factory for the launch flags tests hand hooks, backends and the core."""

from __future__ import annotations

import pytest

from furlong.core.config import build_parser
from furlong.core.config.launch_args import DERIVED, launch_args
from furlong.core.plugins.manager import get_plugin_manager


def test_every_flag_has_the_value_of_a_run_that_gives_only_the_required_ones():
    args = launch_args()
    assert (args.num_rollout, args.rollout_batch_size) == (1, 1)
    assert args.save_interval == 100 and args.train_backend == "fsdp" and args.explicit_args == [
        "num_rollout", "rollout_batch_size"]


def test_overrides_are_set_after_parsing_and_are_not_explicit():
    args = launch_args("--num-rollout", "3", lr=1e-2, sgd_momentum=0.5, explicit_args=["lr"], train_mode="async")
    assert (args.num_rollout, args.lr, args.sgd_momentum) == (3, 1e-2, 0.5)  # sgd_momentum: left unset by the parse
    assert (args.explicit_args, args.train_mode) == (["lr"], "async")
    # derived from --num-rollout by the parse, not again from an override
    assert launch_args("--num-rollout", "3").lr_decay_iters == 3
    assert launch_args(num_rollout=3).lr_decay_iters == 1


def test_an_override_no_flag_defines_is_an_error():
    with pytest.raises(TypeError, match="no flag sets no_such_flag, sgd_momentun;"):
        launch_args(sgd_momentun=0.5, no_such_flag=True)


def test_the_derived_attributes_tests_may_set_are_not_flags():
    dests = {action.dest for action in build_parser(get_plugin_manager())._actions}
    assert DERIVED and not DERIVED & dests
    assert set(DERIVED) <= set(vars(launch_args()))


def test_num_epoch_stands_for_num_rollout_which_the_run_derives_from_it():
    args = launch_args("--num-epoch", "2")
    assert (args.num_epoch, args.num_rollout) == (2, None)
