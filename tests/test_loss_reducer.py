"""Loss reducers as plugins: ``--loss-reducer NAME`` (built-in ``dr_grpo``) and Miles' dotted-path factory."""

import asyncio
import os

import pytest
import torch

from furlong.core.config.launch_args import launch_args, launch_config
from furlong.core.train.objective import StepObjective
from furlong.core.plugins.selection import chosen_reducer
from furlong.hooks import ConfigReport, PluginError, TrainBatch, hookimpl

FLAGS = dict(eps_clip=0.2, eps_clip_high=0.2, eps_clip_c=None, kl_loss_type="k1", kl_loss_coef=0.0,
             use_kl_loss=False, entropy_coef=0.0, use_tis=False, tis_clip=2.0, tis_clip_low=0.0,
             calculate_per_token_loss=False, policy_ratio_level="token", use_opsm=False, opsm_delta=1e-4,
             use_unbiased_kl=False, value_clip=0.2, mask_truncated_samples=False, use_rollout_logprobs=False,
             custom_pg_loss_reducer_function_path=None, loss_reducer=None, rollout_max_response_len=8)

# two samples of one step: advantages 1.0 on 2 trained tokens (a third is masked), -1.0 on 4 tokens
MASKS = [torch.tensor([1.0, 1.0, 0.0]), torch.ones(4)]
ADVANTAGES = [torch.tensor([1.0, 1.0, 5.0]), torch.full((4,), -1.0)]


def _step_loss(pm, **flags):
    """Loss and grads of policy_loss on one step where pi = pi_old (ratio 1: pg per token = -A)."""
    config = launch_config(**{**FLAGS, **flags})
    batch = TrainBatch(tokens=[[0] * 5, [0] * 6], response_lengths=[3, 4], loss_masks=MASKS, steps=[[[0, 1]]],
                       old_log_probs=[torch.zeros(3), torch.zeros(4)], advantages=ADVANTAGES)
    objective = StepObjective(config, pm, batch, "policy_loss", "--loss-type")
    log_probs = [torch.zeros(3, requires_grad=True), torch.zeros(4, requires_grad=True)]
    loss, metrics = asyncio.run(objective([0, 1], log_probs, None))
    loss.backward()
    return [loss.item(), float(metrics["pg_loss"]), *[g for lp in log_probs for g in lp.grad.tolist()]]


def test_hook_loss_reducer_dr_grpo_divides_every_response_by_the_budget(plugin_manager):
    # (1/n_s) * sum_i sum_t (-A_it) m_it / L_max = (1/2) * (-2 + 4) / 8 = 0.125; d/dlogp = -A/16 on trained tokens
    assert _step_loss(plugin_manager, loss_reducer="dr_grpo") == pytest.approx(
        [0.125, 0.125, -1 / 16, -1 / 16, 0.0, 1 / 16, 1 / 16, 1 / 16, 1 / 16])
    # the core's default, per-sample mean: (1/2) * (-2/2 + 4/4) = 0: the two responses cancel
    assert _step_loss(plugin_manager) == pytest.approx([0.0, 0.0, -0.25, -0.25, 0.0, 0.125, 0.125, 0.125, 0.125])


class SampleMean:
    """The core's per-sample mean written as a reducer plugin: must reproduce the default loss."""

    @hookimpl
    def loss_reducer(self, values, loss_masks):
        return sum((v * m).sum() / m.sum().clamp(min=1) for v, m in zip(values, loss_masks))


def test_a_third_party_reducer_is_chosen_by_name(plugin_manager, register_plugin):
    register_plugin(SampleMean(), "sample_mean")
    default = _step_loss(plugin_manager)
    assert _step_loss(plugin_manager, loss_reducer="sample_mean") == pytest.approx(default)


REDUCER_MODULE = '''
def constant(total_lengths, response_lengths, loss_masks, calculate_per_token_loss):
    import torch
    mask = torch.cat([m.reshape(-1) for m in loss_masks])
    return lambda values: (values * mask).sum() / 8
'''


def test_a_dotted_path_factory_matches_the_named_plugin(plugin_manager, tmp_path, monkeypatch):
    (tmp_path / "furlong_reducer_factory.py").write_text(REDUCER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    named = _step_loss(plugin_manager, loss_reducer="dr_grpo")
    dotted = _step_loss(plugin_manager, custom_pg_loss_reducer_function_path="furlong_reducer_factory.constant")
    assert dotted == pytest.approx(named)


def _choice_error(pm, **flags) -> str:
    with pytest.raises(PluginError) as excinfo:
        chosen_reducer(launch_args(**{**FLAGS, **flags}, explicit_args=sorted(flags)), pm)
    return str(excinfo.value)


def test_an_unknown_reducer_name_lists_the_reducers(plugin_manager):
    assert _choice_error(plugin_manager, loss_reducer="dr_grop") == (
        "--loss-reducer 'dr_grop': no installed plugin of that name implements `loss_reducer`.\n"
        "  Available: dr_grpo (furlong 0.1.0.dev0).\n"
        "  Did you mean 'dr_grpo'? List them with: furlong plugins --hook loss_reducer")


@pytest.mark.parametrize(("path", "message"), [
    ("noreducer", "--custom-pg-loss-reducer-function-path 'noreducer': expected a dotted path 'module.function'."),
    ("furlong_no_such_module.fn",
     "--custom-pg-loss-reducer-function-path 'furlong_no_such_module.fn': cannot import module "
     "'furlong_no_such_module': ModuleNotFoundError: No module named 'furlong_no_such_module' (not installed, not on "
     "PYTHONPATH and not in the working directory {cwd}: run furlong from the folder holding it, or set PYTHONPATH to "
     "that folder)"),
    ("math.no_such_fn",
     "--custom-pg-loss-reducer-function-path 'math.no_such_fn': module 'math' has no attribute 'no_such_fn'"),
    ("math.pi",
     "--custom-pg-loss-reducer-function-path 'math.pi': 'pi' is a float, not callable; point the flag at a "
     "function."),
])
def test_a_bad_reducer_path_names_flag_module_and_attribute(plugin_manager, path, message):
    assert _choice_error(plugin_manager, custom_pg_loss_reducer_function_path=path) == message.replace("{cwd}",
                                                                                                        os.getcwd())


def test_dr_grpo_refuses_the_per_token_step_factor(plugin_manager):
    report = ConfigReport(plugin="dr_grpo", flags=("--loss-reducer",))
    plugin_manager.get_plugin("dr_grpo").configure(args=launch_args(**{**FLAGS, "calculate_per_token_loss": True}),
                                                   report=report)
    assert report.errors == [
        "--loss-reducer dr_grpo divides each response by --rollout-max-response-len and the step by its sample "
        "count; drop --calculate-per-token-loss, which divides by the token count."]
