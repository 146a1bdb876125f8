import inspect

import pydantic
import pytest
import torch

from saorl.algo.advantages import RunningMeanBaseline
from saorl.algo.gae import length_adaptive_lambda, skip_observation_gae, token_gae
from saorl.algo.losses import dis_policy_loss, ppo_clip_loss
from saorl.algo.registry import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    PRESETS,
    AdaptiveLambda,
    AdvantageInputs,
    AlgoPreset,
    get_advantage_estimator,
    get_policy_loss,
    get_preset,
    list_presets,
)

FIELDS = [
    "name", "mode", "advantage", "policy_loss", "behaviour", "group_size", "use_critic", "critic_updates",
    "freeze_critic_attention", "skip_observation", "value_pretrain", "gamma", "lam_policy", "lam_critic",
    "eps_low", "eps_high", "value_clip", "lm_loss_coef", "entropy_coef", "advantage_values",
    "routing_replay",
    "baseline_momentum", "advantage_norm", "critic_train_layers",
]


def test_presets_exist_validate_and_dispatch():
    assert list_presets() == ["grpo", "grpo_dis", "ppo", "reinforce_rm", "sao", "sao_paper", "vapo"]
    assert list(AlgoPreset.model_fields) == FIELDS
    for name, preset in PRESETS.items():
        assert preset.name == name and get_preset(name) is preset
        assert AlgoPreset.model_validate(preset.model_dump()) == preset  # its dump loads back, validated
        assert preset.advantage in ADVANTAGE_ESTIMATORS and preset.policy_loss in POLICY_LOSSES


def test_preset_contents():
    sao = get_preset("sao")
    assert (sao.mode, sao.advantage, sao.policy_loss, sao.group_size) == ("async", "gae", "dis", 1)
    assert sao.use_critic and sao.critic_updates == 2 and sao.freeze_critic_attention
    assert sao.skip_observation and sao.value_pretrain and sao.lam_critic == 1.0 and sao.gamma == 1.0
    assert (sao.eps_low, sao.eps_high) == (0.3, 5.0)
    paper = get_preset("sao_paper")  # sao with the paper's length-adaptive λ_policy, nothing else
    assert {f for f in FIELDS if getattr(sao, f) != getattr(paper, f)} == {"name", "lam_policy"}
    assert (sao.lam_policy, paper.lam_policy) == (0.95, AdaptiveLambda(alpha=1.5))
    grpo, grpo_dis = get_preset("grpo"), get_preset("grpo_dis")
    assert (grpo.advantage, grpo.policy_loss, grpo.group_size, grpo.use_critic) == ("grpo", "ppo", 8, False)
    assert (grpo.eps_low, grpo.eps_high) == (0.2, 0.2)
    # grpo_dis differs from grpo only in the loss and its band
    diff = {f for f in FIELDS if getattr(grpo, f) != getattr(grpo_dis, f)}
    assert diff == {"name", "policy_loss", "eps_low", "eps_high"}
    vapo = get_preset("vapo")
    assert (vapo.policy_loss, vapo.eps_low, vapo.eps_high) == ("ppo", 0.2, 0.28)
    assert vapo.lam_policy == AdaptiveLambda(alpha=0.05)
    assert vapo.lam_critic == 1.0 and vapo.lm_loss_coef == 0.1 and vapo.value_pretrain
    rm = get_preset("reinforce_rm")
    assert (rm.mode, rm.advantage, rm.policy_loss, rm.use_critic) == ("async", "running_mean", "dis", False)
    assert (rm.eps_low, rm.eps_high) == (sao.eps_low, sao.eps_high)
    ppo = get_preset("ppo")
    assert ppo.use_critic and ppo.critic_updates == 1 and not ppo.freeze_critic_attention


def test_with_overrides_and_frozen():
    sao = get_preset("sao")
    tuned = sao.with_overrides(eps_low=0.8, eps_high=3.0)
    assert (tuned.eps_low, tuned.eps_high) == (0.8, 3.0) and sao.eps_low == 0.3
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        sao.eps_low = 0.1  # type: ignore[misc]
    with pytest.raises(ValueError, match="bogus"):
        sao.with_overrides(bogus=1)
    with pytest.raises(ValueError, match="unknown algorithm 'nope'"):
        get_preset("nope")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("eps_low", 1.0), ("eps_low", -0.1), ("eps_high", 0.0), ("gamma", 1.5), ("gamma", -0.1),
        ("lam_policy", -0.1), ("lam_critic", 2.0), ("critic_updates", 0), ("group_size", 0),
        ("lam_policy", {"adaptive": {"alpha": -1.0}}), ("lam_policy", "adaptive"), ("lam_policy", 1.5),
        ("lam_critic", True), ("value_clip", -1.0), ("baseline_momentum", 1.0), ("lm_loss_coef", -1.0),
        ("entropy_coef", -0.01), ("mode", "bogus"), ("advantage", "vtrace"), ("policy_loss", "a2c"),
        ("use_critic", "yes"), ("group_size", 1.5), ("gamma", float("nan")), ("name", ""),
    ],
)
def test_bad_overrides_name_the_field(field, value):
    with pytest.raises(pydantic.ValidationError, match=field) as info:  # pydantic's error, no hand check
        get_preset("sao").with_overrides(**{field: value})
    assert info.value.errors()[0]["loc"][0] == field


def test_lam_policy_is_one_typed_value():
    rule = AdaptiveLambda(alpha=0.05)
    assert rule.model_dump() == {"adaptive": {"alpha": 0.05}}  # its one spelling, which loads back
    assert AdaptiveLambda.model_validate({"adaptive": {"alpha": 0.05}}) == rule
    assert get_preset("sao").with_overrides(lam_policy={"adaptive": {"alpha": 2.0}}).lam_policy.alpha == 2.0
    assert get_preset("vapo").with_overrides(lam_policy=0.9).lam_policy == 0.9  # a number turns the rule off
    with pytest.raises(pydantic.ValidationError, match="alpha"):
        AdaptiveLambda(alpha=0.0)


def test_cross_field_rules():
    with pytest.raises(ValueError, match="use_critic"):
        get_preset("sao").with_overrides(use_critic=False, critic_updates=0)  # gae needs a critic
    with pytest.raises(ValueError, match="group_size"):
        get_preset("grpo").with_overrides(group_size=1)
    assert get_preset("grpo").with_overrides(critic_updates=0).critic_updates == 0
    with pytest.raises(ValueError, match="lam_policy") as info:  # the adaptive rule is GAE's
        get_preset("grpo").with_overrides(lam_policy=AdaptiveLambda(alpha=1.5))
    assert "'grpo'" in str(info.value)


# --------------------------------------------------------------------------- registries


def _batch():
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [0, 0, 1, 1, 1, 1], [0, 1, 0, 0, 0, 0]])
    response = torch.tensor([[0, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0]])
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(3, 6, generator=g) * response
    values = torch.randn(3, 6, generator=g)
    return rewards, values, mask, response


def test_gae_estimator_dispatch():
    rewards, values, mask, response = _batch()
    est = get_advantage_estimator("gae")
    adv, ret = est(AdvantageInputs(rewards, mask, gamma=0.9, lam=0.8, values=values))
    ref = skip_observation_gae(rewards, values, mask, 0.9, 0.8)
    assert torch.equal(adv, ref[0]) and torch.equal(ret, ref[1])
    adv, _ = est(AdvantageInputs(rewards, mask, values=values, lam=AdaptiveLambda(alpha=0.5)))
    ref_adv, _ = skip_observation_gae(rewards, values, mask, 1.0, length_adaptive_lambda(mask, 0.5))
    assert torch.equal(adv, ref_adv)
    inputs = AdvantageInputs(rewards, mask, values=values, response_mask=response, skip_observation=False)
    adv, _ = est(inputs)
    assert torch.equal(adv, token_gae(rewards, values, response, 1.0, 1.0)[0])
    # VAPO's length-adaptive λ on the token chain still counts action tokens only
    vapo = AdvantageInputs(rewards, mask, values=values, response_mask=response, skip_observation=False,
                           lam=AdaptiveLambda(alpha=0.5))
    lam = length_adaptive_lambda(mask, 0.5)
    assert not torch.equal(lam, length_adaptive_lambda(response, 0.5))
    assert torch.equal(est(vapo)[0], token_gae(rewards, values, response, 1.0, lam)[0])
    with pytest.raises(ValueError, match="values"):
        est(AdvantageInputs(rewards, mask))
    with pytest.raises(ValueError, match="response_mask"):
        est(AdvantageInputs(rewards, mask, values=values, skip_observation=False))


def test_critic_free_estimators_dispatch():
    rewards, _, mask, _ = _batch()
    scores = rewards.sum(1)
    inputs = AdvantageInputs(rewards, mask, group_ids=torch.tensor([0, 0, 1]))
    adv, ret = get_advantage_estimator("grpo")(inputs)
    assert ret is None and torch.all(adv[2] == 0)  # singleton group
    assert adv[0, 1].item() == pytest.approx(-adv[1, 2].item())
    baseline = RunningMeanBaseline(0.9, init=0.5)
    adv, ret = get_advantage_estimator("running_mean")(AdvantageInputs(rewards, mask, baseline=baseline))
    assert ret is None and baseline.num_updates == 1
    torch.testing.assert_close(adv, (scores - 0.5)[:, None] * mask)
    with pytest.raises(ValueError, match="group_ids"):
        get_advantage_estimator("grpo")(AdvantageInputs(rewards, mask))
    with pytest.raises(ValueError, match="baseline"):
        get_advantage_estimator("running_mean")(AdvantageInputs(rewards, mask))
    with pytest.raises(ValueError, match="vtrace"):
        get_advantage_estimator("vtrace")


def test_policy_losses_share_one_signature():
    assert {"dis": dis_policy_loss, "ppo": ppo_clip_loss} == POLICY_LOSSES
    params = {k: list(inspect.signature(fn).parameters) for k, fn in POLICY_LOSSES.items()}
    assert all(len(p) == 6 for p in params.values())
    rewards, _, mask, _ = _batch()
    logprobs = (-torch.rand(3, 6)).requires_grad_(True)
    for kind in POLICY_LOSSES:
        loss, metrics = get_policy_loss(kind)(logprobs, logprobs.detach(), rewards, mask, 0.2, 0.28)
        assert loss.dim() == 0 and all(isinstance(v, float) for v in metrics.values())
        assert all(k.startswith("policy/") for k in metrics)
    with pytest.raises(ValueError, match="a2c"):
        get_policy_loss("a2c")


def test_the_registry_says_which_estimators_keep_a_running_baseline():
    from saorl.algo.registry import RUNNING_BASELINE_ESTIMATORS, keeps_running_baseline

    assert set(ADVANTAGE_ESTIMATORS) >= RUNNING_BASELINE_ESTIMATORS
    assert keeps_running_baseline("running_mean")
    assert not keeps_running_baseline("gae") and not keeps_running_baseline("grpo")
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        keeps_running_baseline("running-mean")


def test_the_learner_never_branches_on_an_estimators_name():
    """The learner asks the registry what an estimator needs, so a new estimator is one row there."""
    import re
    from pathlib import Path

    import saorl.runtime.learner as learner

    for path in Path(learner.__file__).parent.rglob("*.py"):
        names = "|".join(ADVANTAGE_ESTIMATORS)
        hits = re.findall(rf"advantage\s*[!=]=\s*[\"'](?:{names})[\"']", path.read_text())
        assert not hits, f"{path.name} compares an advantage estimator's name: {hits}"
