"""The core's step objective: loss plugin + reducer, exact over micro-batches and ranks."""

import asyncio
import functools

import pytest
import torch

from furlong.core.config.launch_args import launch_config
from furlong.core.train import reduction
from furlong.core.train.objective import StepObjective
from furlong.core.plugins.manager import get_plugin_manager
from furlong import hooks
from furlong.hooks import LossOutput, PluginError, TrainBatch, hookimpl

DEFAULTS = dict(
    eps_clip=0.2, eps_clip_high=0.2, eps_clip_c=None, kl_loss_type="k1", kl_loss_coef=0.0,
    use_kl_loss=False, entropy_coef=0.0, use_tis=False, tis_clip=2.0, tis_clip_low=0.0,
    calculate_per_token_loss=False, policy_ratio_level="token", use_opsm=False, opsm_delta=1e-4,
    use_unbiased_kl=False, value_clip=0.2, mask_truncated_samples=False,
    custom_pg_loss_reducer_function_path=None, use_rollout_logprobs=False,
)
FLAG = "--loss-type"


@functools.cache
def _base_config():
    return launch_config(**DEFAULTS)


def make_config(**overrides):
    return _base_config().replace(**overrides)


@pytest.fixture(scope="module")
def pm():
    return get_plugin_manager()


def train_batch(masks, steps, **fields):
    return TrainBatch(tokens=[[0] * (len(m) + 2) for m in masks], response_lengths=[len(m) for m in masks],
                      loss_masks=masks, steps=steps, **fields)


def call(objective, ids, log_probs, entropy=None, values=None):
    """The objective's loss and its metrics read as floats (it returns them as 0-dim tensors)."""
    loss, metrics = asyncio.run(objective(ids, log_probs, entropy, values))
    assert all(isinstance(v, torch.Tensor) and v.ndim == 0 and not v.requires_grad for v in metrics.values())
    return loss, {k: float(v) for k, v in metrics.items()}


# --- a rollout of six samples with every policy-loss term on ---------------------------

LENGTHS = [3, 5, 2, 4, 1, 3]
TRAJECTORIES = [0, 0, 1, 2, 3, 3]


def rollout_data():
    gen = torch.Generator().manual_seed(7)
    masks = [(torch.rand(t, generator=gen) > 0.3).float() for t in LENGTHS]
    masks[2] = torch.zeros(LENGTHS[2])  # a removed sample: mask 0, still counted
    masks[0][0] = 1.0

    def rows(scale=1.0, shift=0.0):
        return [torch.rand(t, generator=gen) * scale + shift for t in LENGTHS]

    return dict(
        masks=masks, old=rows(-1.0, -0.2), ref=rows(-1.0, -0.2), adv=rows(2.0, -1.0),
        logp=rows(-1.0, -0.2), entropy=rows(0.5, 0.1), rollout=rows(-1.0, -0.2),
    )


FULL_ARGS = dict(use_kl_loss=True, kl_loss_coef=0.05, kl_loss_type="k3", entropy_coef=0.01, use_tis=True,
                 eps_clip_c=3.0)
SPLITS = [
    [[0, 1, 2, 3, 4, 5]],
    [[0, 1], [2, 3], [4, 5]],
    [[3], [0, 5, 1], [4, 2]],
    [[5], [4], [3], [2], [1], [0]],
]


def run_split(pm, data, split, config, trajectory_ids):
    batch = train_batch(data["masks"], [split], old_log_probs=data["old"], ref_log_probs=data["ref"],
                        advantages=data["adv"], rollout_log_probs=data["rollout"])
    objective = StepObjective(config, pm, batch, "policy_loss", FLAG, trajectory_ids=trajectory_ids)
    leaves = [lp.clone().requires_grad_(True) for lp in data["logp"]]
    ent_leaves = [e.clone().requires_grad_(True) for e in data["entropy"]]
    total, metrics = None, {}
    for mb in split:
        loss, m = call(objective, mb, [leaves[i] for i in mb], [ent_leaves[i] for i in mb])
        total = loss if total is None else total + loss
        for k, v in m.items():
            metrics[k] = metrics.get(k, 0.0) + v
    total.backward()
    return total.item(), metrics, [x.grad.clone() for x in leaves], [e.grad.clone() for e in ent_leaves]


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("trajectory_ids", [None, TRAJECTORIES])
def test_step_objective_does_not_depend_on_micro_batching(pm, per_token, trajectory_ids):
    data = rollout_data()
    config = make_config(calculate_per_token_loss=per_token, **FULL_ARGS)
    results = [run_split(pm, data, split, config, trajectory_ids) for split in SPLITS]
    ref_loss, ref_metrics, ref_grads, ref_ent_grads = results[0]
    for loss, metrics, grads, ent_grads in results[1:]:
        assert loss == pytest.approx(ref_loss, abs=1e-6)
        assert metrics == pytest.approx(ref_metrics, abs=1e-6)
        for g, r in zip(grads + ent_grads, ref_grads + ref_ent_grads):
            assert torch.allclose(g, r, atol=1e-7)
    # the reference value against SPEC 4.6 computed directly from the plugin's per-token loss
    out = pm.get_plugin("policy_loss").loss(config=config, batch=_loss_input(data))
    masks = data["masks"]
    sums = [float((t * m).sum()) for t, m in zip(out.token_loss, masks)]
    if per_token:
        expected = sum(sums) / sum(float(m.sum()) for m in masks)
    else:
        ids = trajectory_ids or list(range(6))
        d = {t: sum(float(m.sum()) for m, u in zip(masks, ids) if u == t) for t in set(ids)}
        expected = sum(s / max(d[u], 1.0) for s, u in zip(sums, ids)) / len(d)
    assert ref_loss == pytest.approx(expected, abs=1e-6)
    assert ref_metrics["loss"] == pytest.approx(expected, abs=1e-6)
    # the removed sample gets no gradient
    assert torch.equal(ref_grads[2], torch.zeros(LENGTHS[2]))


def _loss_input(data):
    from furlong.hooks import LossInput

    return LossInput(log_probs=data["logp"], old_log_probs=data["old"], advantages=data["adv"],
                     loss_masks=data["masks"], ref_log_probs=data["ref"], rollout_log_probs=data["rollout"],
                     entropy=data["entropy"])


def test_objective_call_has_the_protocol_signature():
    import inspect

    ours = list(inspect.signature(StepObjective.__call__).parameters)
    assert ours == list(inspect.signature(hooks.StepObjective.__call__).parameters)


def test_data_parallel_ranks_with_global_denominators_match_one_rank(pm):
    data = rollout_data()
    config = make_config(**FULL_ARGS)
    single_loss, single_metrics, single_grads, _ = run_split(pm, data, [[0, 1, 2, 3, 4, 5]], config, TRAJECTORIES)
    masks = reduction.effective_loss_masks(data["masks"], None, False)
    steps = reduction.step_denominators(masks, [[0, 1, 2, 3, 4, 5]], TRAJECTORIES)
    denoms = reduction.sample_denominators(masks, TRAJECTORIES)
    total_loss, metrics, grads = 0.0, {}, {}
    # siblings 0 and 1 of trajectory 0 sit on different ranks
    for rank_ids, micro in (([0, 2, 4], [[0, 1], [2]]), ([1, 3, 5], [[0, 1, 2]])):
        pick = {k: [v[i] for i in rank_ids] for k, v in data.items()}
        batch = train_batch(pick["masks"], [micro], old_log_probs=pick["old"], ref_log_probs=pick["ref"],
                            advantages=pick["adv"], rollout_log_probs=pick["rollout"])
        objective = StepObjective(config, pm, batch, "policy_loss", FLAG, dp_world_size=2,
                                  trajectory_ids=[TRAJECTORIES[i] for i in rank_ids],
                                  sample_denominators=[denoms[i] for i in rank_ids], step_denominators=steps)
        leaves = [lp.clone().requires_grad_(True) for lp in pick["logp"]]
        for mb in micro:
            loss, m = call(objective, mb, [leaves[i] for i in mb], [pick["entropy"][i] for i in mb])
            loss.backward()
            total_loss += loss.item()
            for k, v in m.items():
                metrics[k] = metrics.get(k, 0.0) + v
        for local, global_id in enumerate(rank_ids):
            grads[global_id] = leaves[local].grad
    # backends sum gradients over data-parallel ranks: the ranks' sums equal one rank's step
    assert total_loss == pytest.approx(single_loss, abs=1e-6)
    assert metrics == pytest.approx(single_metrics, abs=1e-6)
    for i in range(6):
        assert torch.allclose(grads[i], single_grads[i], atol=1e-7)


def test_data_parallel_without_global_denominators_is_an_error(pm):
    with pytest.raises(ValueError) as excinfo:
        StepObjective(make_config(), pm, train_batch([torch.ones(1)], [[[0]]]), "sft_loss", FLAG, dp_world_size=2)
    assert str(excinfo.value).startswith("StepObjective: dp_world_size > 1 needs step_denominators")


def test_c007_through_the_objective(pm):
    masks = [torch.tensor([1.0] * 6 + [0.0] * 4), torch.ones(4)]
    # sft_loss: token loss -logp -> 1.0 on A, 2.0 on B
    logp = [torch.full((10,), -1.0, requires_grad=True), torch.full((4,), -2.0, requires_grad=True)]
    for per_token, expected in ((True, 1.4), (False, 1.5)):
        objective = StepObjective(make_config(calculate_per_token_loss=per_token), pm,
                                  train_batch(masks, [[[0], [1]]]), "sft_loss", FLAG)
        first, m0 = call(objective, [0], logp[:1])
        second, m1 = call(objective, [1], logp[1:])
        assert (first + second).item() == pytest.approx(expected)
        assert m0["loss"] + m1["loss"] == pytest.approx(expected)


def test_c009_through_the_objective(pm):
    masks = [torch.ones(8), torch.ones(12), torch.ones(20)]
    logp = [torch.full((8,), -0.5), torch.full((12,), -1.0), torch.full((20,), -3.0)]
    config = make_config(calculate_per_token_loss=True, mask_truncated_samples=True)
    objective = StepObjective(config, pm, train_batch(masks, [[[0, 1], [2]]]), "sft_loss", FLAG,
                              truncated=[False, False, True])
    a, _ = call(objective, [0, 1], [x.clone().requires_grad_(True) for x in logp[:2]])
    b, _ = call(objective, [2], [logp[2].clone().requires_grad_(True)])
    assert (a + b).item() == pytest.approx(0.8)
    # the flags may also come on the TrainBatch
    everything = StepObjective(config, pm, train_batch(masks, [[[0, 1, 2]]], truncated=[True] * 3), "sft_loss", FLAG)
    leaves = [x.clone().requires_grad_(True) for x in logp]
    loss, metrics = call(everything, [0, 1, 2], leaves)
    assert loss.item() == 0.0 and metrics["loss"] == 0.0
    loss.backward()
    assert all(torch.equal(x.grad, torch.zeros_like(x)) for x in leaves)


def test_c010_total_loss_and_kl_gradient_through_the_objective(pm):
    # pg 0.5 (rho 1, A -0.5), k1 KL 0.2, coef 0.1 -> 0.52 and d(total)/d(KL) = +0.1
    ref = torch.tensor([-0.2], requires_grad=True)
    batch = train_batch([torch.ones(1)], [[[0]]], old_log_probs=[torch.zeros(1)], advantages=[torch.tensor([-0.5])],
                        ref_log_probs=[ref])
    objective = StepObjective(make_config(use_kl_loss=True, kl_loss_coef=0.1), pm, batch, "policy_loss", FLAG)
    loss, metrics = call(objective, [0], [torch.zeros(1, requires_grad=True)])
    assert loss.item() == pytest.approx(0.52)
    assert metrics == pytest.approx({"loss": 0.52, "pg_loss": 0.5, "kl_loss": 0.2, "pg_clipfrac": 0.0, "ppo_kl": 0.0})
    loss.backward()
    assert ref.grad.tolist() == pytest.approx([-0.1])


def test_identical_policy_and_reference_leave_the_loss_equal_to_pg_loss(pm):
    lp = torch.tensor([-0.7, -1.3])
    batch = train_batch([torch.ones(2)], [[[0]]], old_log_probs=[lp + 0.1], advantages=[torch.tensor([1.0, -2.0])],
                        ref_log_probs=[lp.clone()])
    for kl_type in ("k1", "k2", "k3", "low_var_kl"):
        config = make_config(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type=kl_type)
        _, metrics = call(StepObjective(config, pm, batch, "policy_loss", FLAG), [0], [lp.clone().requires_grad_(True)])
        assert metrics["kl_loss"] == 0.0
        assert metrics["loss"] == metrics["pg_loss"]


def test_rollout_log_probs_are_pi_old_with_use_rollout_logprobs(pm):
    batch = train_batch([torch.ones(1)], [[[0]]], old_log_probs=[torch.tensor([5.0])],
                        rollout_log_probs=[torch.tensor([-0.1])], advantages=[torch.ones(1)])
    _, metrics = call(StepObjective(make_config(use_rollout_logprobs=True), pm, batch, "policy_loss", FLAG),
                      [0], [torch.zeros(1, requires_grad=True)])
    # delta = logp_old - logp = -0.1 - 0
    assert metrics["ppo_kl"] == pytest.approx(-0.1)


REDUCER_MODULE = '''
import torch

def masked_sum(total_lengths, response_lengths, loss_masks, calculate_per_token_loss):
    assert total_lengths == [r + 2 for r in response_lengths]
    mask = torch.cat([m.reshape(-1) for m in loss_masks])
    return lambda values: (values * mask).sum()
'''


def test_custom_pg_reducer_replaces_the_pg_term_only(pm, tmp_path, monkeypatch):
    (tmp_path / "furlong_test_reducers.py").write_text(REDUCER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    masks = [torch.tensor([1.0, 1.0, 0.0]), torch.ones(1)]
    batch = train_batch(masks, [[[0, 1]]], old_log_probs=[torch.zeros(3), torch.zeros(1)],
                        advantages=[torch.tensor([1.0, 2.0, 9.0]), torch.tensor([-1.0])])
    config = make_config(entropy_coef=0.1, custom_pg_loss_reducer_function_path="furlong_test_reducers.masked_sum")
    objective = StepObjective(config, pm, batch, "policy_loss", FLAG)
    logp = [torch.zeros(3, requires_grad=True), torch.zeros(1, requires_grad=True)]
    loss, metrics = call(objective, [0, 1], logp, [torch.full((3,), 0.5), torch.full((1,), 0.2)])
    # pg per token: [-1, -2, masked], [1]; custom: masked sum -2, times 1/n_s = 1/2 -> -1.0
    # entropy: per-sample means 0.5 and 0.2 -> (0.5 + 0.2)/2 = 0.35; loss = -1.0 - 0.1*0.35 = -1.035
    assert metrics["pg_loss"] == pytest.approx(-1.0)
    assert loss.item() == pytest.approx(-1.035)
    loss.backward()
    # d/dlogp of -rho*A summed, / 2: [-0.5, -1.0, 0], [0.5]
    assert logp[0].grad.tolist() == pytest.approx([-0.5, -1.0, 0.0])
    assert logp[1].grad.tolist() == pytest.approx([0.5])


def test_custom_pg_reducer_needs_a_pg_loss_term(pm, tmp_path, monkeypatch):
    (tmp_path / "furlong_test_reducers2.py").write_text(REDUCER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = make_config(custom_pg_loss_reducer_function_path="furlong_test_reducers2.masked_sum")
    objective = StepObjective(config, pm, train_batch([torch.ones(1)], [[[0]]]), "sft_loss", FLAG)
    with pytest.raises(PluginError) as excinfo:
        call(objective, [0], [torch.zeros(1, requires_grad=True)])
    assert str(excinfo.value) == (
        "--custom-pg-loss-reducer-function-path 'furlong_test_reducers2.masked_sum': --loss-type 'sft_loss' must "
        "report its per-token policy-gradient term, carrying grad, as token_metrics['pg_loss'] for a loss reducer."
    )


def test_bad_custom_pg_reducer_path_fails_when_the_objective_is_built(pm):
    config = make_config(custom_pg_loss_reducer_function_path="math.no_such_reducer")
    with pytest.raises(PluginError) as excinfo:
        StepObjective(config, pm, train_batch([torch.ones(1)], [[[0]]]), "policy_loss", FLAG)
    assert str(excinfo.value) == (
        "--custom-pg-loss-reducer-function-path 'math.no_such_reducer': "
        "module 'math' has no attribute 'no_such_reducer'"
    )


class ReducesItself:
    @hookimpl
    def loss(self, batch):
        return LossOutput(token_loss=[lp.sum().reshape(1) for lp in batch.log_probs])


def test_a_loss_that_reduces_itself_is_an_error():
    pm = get_plugin_manager()
    pm.register(ReducesItself(), name="reduces_itself")
    objective = StepObjective(make_config(), pm, train_batch([torch.ones(3)], [[[0]]]), "reduces_itself", FLAG)
    with pytest.raises(PluginError) as excinfo:
        call(objective, [0], [torch.zeros(3, requires_grad=True)])
    assert str(excinfo.value) == (
        "--loss-type 'reduces_itself': token_loss[0] has 1 values but the sample has 3 response tokens; "
        "return per-token values and let the core reduce them."
    )


def test_a_micro_batch_mixing_steps_is_an_error(pm):
    objective = StepObjective(make_config(), pm, train_batch([torch.ones(1), torch.ones(1)], [[[0]], [[1]]]),
                              "sft_loss", FLAG)
    with pytest.raises(ValueError) as excinfo:
        call(objective, [0, 1], [torch.zeros(1, requires_grad=True), torch.zeros(1, requires_grad=True)])
    assert str(excinfo.value) == "one micro-batch mixes samples of steps [0, 1]"


def test_each_step_uses_its_own_denominators(pm):
    masks = [torch.ones(2), torch.ones(3), torch.ones(5)]
    objective = StepObjective(make_config(calculate_per_token_loss=True), pm,
                              train_batch(masks, [[[0], [1]], [[2]]]), "sft_loss", FLAG)
    a, _ = call(objective, [0], [torch.full((2,), -1.0, requires_grad=True)])
    b, _ = call(objective, [1], [torch.full((3,), -2.0, requires_grad=True)])
    c, _ = call(objective, [2], [torch.full((5,), -4.0, requires_grad=True)])
    # step 0: (2*1 + 3*2) / 5 = 1.6; step 1: 5*4/5 = 4
    assert (a + b).item() == pytest.approx(1.6)
    assert c.item() == pytest.approx(4.0)
