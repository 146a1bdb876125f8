"""The trainer update on real tiny models: which parameters move, DIS masking, NaN safety."""

import math
import random

import pytest
import torch

import saorl.runtime.learner.single as learner_mod
from saorl.algo.registry import get_preset
from saorl.data.batch import collate
from saorl.data.trajectory import Episode, Trajectory
from saorl.models.critic import Critic
from saorl.models.logprobs import token_logprobs
from saorl.models.tiny import build_tiny
from saorl.runtime.learner.single import Learner, OptimConfig

PAD = 1


def _trajs(n=4, seed=0, logprob=-2.0, reward_every=2):
    """Multi-turn trajectories: prompt, action, observation, action; varied lengths and rewards."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p, a1, o, a2 = rng.randint(3, 6), rng.randint(2, 5), rng.randint(2, 4), rng.randint(2, 5)
        ids = [rng.randint(2, 1000) for _ in range(p + a1 + o + a2)]
        mask = [0] * p + [1] * a1 + [0] * o + [1] * a2
        lp = [logprob if m else 0.0 for m in mask]
        rewards = [0.0] * len(ids)
        rewards[-1] = 1.0 if i % reward_every == 0 else 0.0
        versions = [0 if m else -1 for m in mask]
        out.append(Trajectory(ids, mask, lp, rewards, versions, p, task_id=f"t{i}",
                              episode=Episode(success=rewards[-1] > 0)))
    return out


def _snapshot(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _changed(before, module):
    return {n for n, p in module.named_parameters() if not torch.equal(before[n], p.detach())}


def _learner(name="sao", kind="tiny-moe", **over):
    policy = build_tiny(kind, seed=0)
    preset = get_preset(name).with_overrides(**over) if over else get_preset(name)
    critic = Critic.from_policy(policy) if preset.use_critic else None
    return Learner(policy, critic, preset, OptimConfig(policy_lr=1e-3, critic_lr=1e-3), pad_id=PAD)


def _matched_trajs(policy, trajs):
    """Rollout logprobs equal to the policy's own: every ratio is exactly 1 (all kept)."""
    b = collate(trajs, PAD)
    with torch.no_grad():
        lp = token_logprobs(policy, b.input_ids, b.attention_mask)
    out = []
    for i, t in enumerate(trajs):
        lps = [float(lp[i, j]) if m else 0.0 for j, m in enumerate(t.action_mask)]
        out.append(Trajectory(t.token_ids, t.action_mask, lps, t.rewards, t.versions, t.prompt_len, t.task_id,
                              episode=t.episode))
    return out


def test_sao_step_critic_k_updates_with_frozen_attention():
    lrn = _learner("sao")
    critic_before, policy_before = _snapshot(lrn.critic), _snapshot(lrn.policy)
    passes = []
    real_forward = lrn.critic.forward

    def counting(*a, **k):
        passes.append(torch.is_grad_enabled())
        return real_forward(*a, **k)

    lrn.critic.forward = counting
    m = lrn.step(_matched_trajs(lrn.policy, _trajs()))
    # K = 2 training passes, then one evaluation with the updated critic; nothing else
    assert passes == [True, True, False]
    moved = _changed(critic_before, lrn.critic)
    assert moved, "the critic did not train"
    assert all("mlp.experts" in n or n.startswith("value_head") for n in moved), moved
    assert any("mlp.experts.gate_up_proj" in n for n in moved)
    frozen = [n for n in critic_before if "self_attn" in n or "embed_tokens" in n or "norm" in n]
    assert frozen and not (set(frozen) & moved)
    assert _changed(policy_before, lrn.policy), "the policy did not train"
    assert m["critic/value_loss_after"] < m["critic/value_loss"]
    assert m["policy/version"] == 1 and lrn.version == 1
    assert m["policy/dis_kept_frac"] == pytest.approx(1.0)
    assert all(math.isfinite(v) for v in m.values() if not isinstance(v, list))
    assert sum(m["policy/ratio_hist"]) == sum(sum(t.action_mask) for t in _trajs())


def test_advantages_from_the_critic_before_its_updates():
    """advantage_values=before_update: the same step, but the advantages use the values the critic
    had before its K steps on this batch (identical seeds: the critics start equal)."""
    after, before = _learner("sao"), _learner("sao", advantage_values="before_update")
    trajs = _matched_trajs(after.policy, _trajs())
    m_after, m_before = after.step(trajs), before.step(trajs)
    assert m_after["critic/value_loss"] == pytest.approx(m_before["critic/value_loss"])
    assert m_after["critic/value_loss_after"] < m_after["critic/value_loss"]
    assert m_after["advantage/mean"] != pytest.approx(m_before["advantage/mean"], abs=1e-6)
    # values before the update are the critic's untrained estimates, near 0: advantages ~ returns
    returns_mean = m_before["critic/return_mean"]
    assert abs(m_before["advantage/mean"] - returns_mean) < abs(m_after["advantage/mean"] - returns_mean)


def test_full_critic_moves_attention_too():
    lrn = _learner("sao", freeze_critic_attention=False)
    before = _snapshot(lrn.critic)
    lrn.step(_trajs())
    moved = _changed(before, lrn.critic)
    assert any("self_attn.q_proj" in n for n in moved)


def test_dis_masks_out_of_band_tokens_in_a_real_step():
    lrn = _learner("sao")
    trajs = _matched_trajs(lrn.policy, _trajs())
    # push half the action tokens far out of the band (ratio = e^5 > 1 + eps_high = 6)
    shifted = []
    n_action = n_out = 0
    for t in trajs:
        lp = list(t.rollout_logprobs)
        for j, m in enumerate(t.action_mask):
            if m:
                n_action += 1
                if j % 2 == 0:
                    lp[j] -= 5.0
                    n_out += 1
        shifted.append(Trajectory(t.token_ids, t.action_mask, lp, t.rewards, t.versions, t.prompt_len,
                                  t.task_id, episode=t.episode))
    m = lrn.step(shifted)
    assert m["policy/dis_kept_frac"] == pytest.approx(1 - n_out / n_action, abs=1e-6)
    assert m["policy/dis_masked_high_frac"] == pytest.approx(n_out / n_action, abs=1e-6)


def _shifted(trajs, shift, every=2):
    """``trajs`` with every ``every``-th action token's rollout log-prob lowered by ``shift``."""
    out = []
    for t in trajs:
        lp = [x - shift if m and j % every == 0 else x for j, (x, m) in enumerate(zip(t.rollout_logprobs,
                                                                                     t.action_mask))]
        out.append(Trajectory(t.token_ids, t.action_mask, lp, t.rewards, t.versions, t.prompt_len, t.task_id,
                              episode=t.episode))
    return out


def test_mismatch_is_logged_per_staleness_and_behaviour_trainer_corrects_nothing():
    lrn = _learner("sao")
    trajs = _shifted(_matched_trajs(lrn.policy, _trajs()), 5.0)
    m = lrn.step(trajs)  # learner version 0, every token sampled by version 0: staleness 0
    assert m["mismatch/outside_band_frac_s0"] == pytest.approx(1 - m["policy/dis_kept_frac"], abs=1e-6)
    # KL(rollout || trainer) from the k3 estimator: half the tokens have log r = 5, the rest 0
    n = sum(t.num_action_tokens for t in trajs)
    shifted = sum(1 for t in trajs for j, a in enumerate(t.action_mask) if a and j % 2 == 0)
    assert m["mismatch/kl_s0"] == pytest.approx(shifted * (math.exp(5) - 1 - 5) / n, rel=1e-4)
    assert m["mismatch/tokens_s0"] == n and "mismatch/kl_s1" not in m
    uncorrected = _learner("sao", behaviour="trainer")
    trajs = _shifted(_matched_trajs(uncorrected.policy, _trajs()), 5.0)
    m = uncorrected.step(trajs)
    assert m["policy/dis_kept_frac"] == 1.0 and m["policy/ratio_mean"] == pytest.approx(1.0)
    assert m["mismatch/outside_band_frac"] > 0  # the mismatch is there, only not corrected


def test_all_tokens_masked_leaves_policy_bit_identical():
    lrn = _learner("sao")
    trajs = [Trajectory(t.token_ids, t.action_mask, [-30.0 if m else 0.0 for m in t.action_mask], t.rewards,
                        t.versions, t.prompt_len, t.task_id) for t in _trajs()]
    before = _snapshot(lrn.policy)
    m = lrn.step(trajs)
    assert m["policy/dis_kept_frac"] == 0.0
    assert not _changed(before, lrn.policy)


def test_nan_loss_is_skipped_and_never_reaches_the_weights(monkeypatch):
    lrn = _learner("sao")
    real = learner_mod.POLICY_LOSSES["dis"]

    def poisoned(*a, **k):
        loss, metrics = real(*a, **k)
        return loss * float("nan"), metrics

    monkeypatch.setitem(learner_mod.POLICY_LOSSES, "dis", poisoned)
    before = _snapshot(lrn.policy)
    m = lrn.step(_matched_trajs(lrn.policy, _trajs()))
    assert not _changed(before, lrn.policy)
    assert m["train/nonfinite_skips"] == 1 and lrn.version == 0
    # the optimizer state is untouched too: the next good step trains normally
    monkeypatch.setitem(learner_mod.POLICY_LOSSES, "dis", real)
    m = lrn.step(_matched_trajs(lrn.policy, _trajs()))
    assert _changed(before, lrn.policy) and lrn.version == 1
    assert all(torch.isfinite(p).all() for p in lrn.policy.parameters())


def _opt_state(opt):
    return {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in st.items()}
            for k, st in opt.state_dict()["state"].items()}


@pytest.mark.parametrize("budget", [4096, pytest.param(40, marks=pytest.mark.slow)])
def test_an_update_that_makes_the_weights_non_finite_is_rolled_back(budget):
    # finite loss and gradients, but a learning rate of inf (the config refuses it; the Learner's
    # own API does not) turns every parameter non-finite; budget 40: packed micro-batches, whose
    # accumulated gradients make one step, skipped as a whole
    lrn = _learner("sao", kind="tiny-dense")
    lrn.max_tokens = budget
    trajs = _trajs()
    m = lrn.step(_matched_trajs(lrn.policy, trajs))
    assert lrn.version == 1 and lrn.nonfinite_skips == 0
    assert (m["throughput/microbatches"] > 1) == (budget == 40)
    policy, critic = _snapshot(lrn.policy), _snapshot(lrn.critic)
    states = _opt_state(lrn.policy_opt), _opt_state(lrn.critic_opt)
    lrn.optim.policy_lr = lrn.optim.critic_lr = math.inf
    m = lrn.step(_matched_trajs(lrn.policy, trajs))
    assert m["train/nonfinite_skips"] == 3 and lrn.version == 1  # 2 critic steps + the policy step
    assert not _changed(policy, lrn.policy) and not _changed(critic, lrn.critic)
    for before, opt in zip(states, (lrn.policy_opt, lrn.critic_opt)):
        after = _opt_state(opt)
        assert after.keys() == before.keys()
        for k in before:
            assert after[k]["step"] == before[k]["step"]
            assert torch.equal(after[k]["exp_avg"], before[k]["exp_avg"])
            assert torch.equal(after[k]["exp_avg_sq"], before[k]["exp_avg_sq"])
    lrn.optim.policy_lr = lrn.optim.critic_lr = 1e-3
    lrn.step(_matched_trajs(lrn.policy, trajs))
    assert lrn.version == 2 and _changed(policy, lrn.policy)
    assert all(torch.isfinite(p).all() for p in lrn.policy.parameters())


@pytest.mark.parametrize("name", ["grpo", "grpo_dis", "vapo", "ppo", "reinforce_rm"])
def test_every_baseline_takes_a_step(name):
    lrn = _learner(name, kind="tiny-dense")
    before = _snapshot(lrn.policy)
    trajs = _trajs(n=8 if get_preset(name).group_size > 1 else 4)
    gids = [i // 2 for i in range(len(trajs))]
    m = lrn.step(_matched_trajs(lrn.policy, trajs), gids)
    assert _changed(before, lrn.policy)
    assert all(math.isfinite(v) for v in m.values() if isinstance(v, float))
    if get_preset(name).use_critic:
        assert "critic/value_loss" in m
    if name == "vapo":
        assert "policy/lm_loss" in m


def test_warmup_scales_the_learning_rate():
    policy = build_tiny("tiny-dense", seed=0)
    lrn = Learner(policy, None, get_preset("reinforce_rm"), OptimConfig(policy_lr=1e-3, warmup_steps=4),
                  pad_id=PAD)
    lrs = [lrn.step(_trajs())["policy/lr"] for _ in range(5)]
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])


def test_update_rel_is_the_policys_relative_parameter_movement_of_the_step():
    learner = _learner("sao", kind="tiny-dense")
    trajs = _matched_trajs(learner.policy, _trajs())
    before = _snapshot(learner.policy)
    m = learner.step(trajs)
    moved = sum(float(((p.detach() - before[n]) ** 2).sum()) for n, p in learner.policy.named_parameters())
    total = sum(float((b ** 2).sum()) for b in before.values())
    assert m["policy/update_rel"] > 0
    assert math.isclose(m["policy/update_rel"], math.sqrt(moved / total), rel_tol=1e-4)


def test_batch_advantage_norm_whitens_over_the_action_tokens():
    """``algo.advantage_norm: batch``: the advantages the loss sees are the estimator's, less their
    mean over the batch's action tokens, over their std; off the action tokens 0; ``none`` leaves
    them as they are (the default of every preset)."""
    seen = {}
    for norm in ("none", "batch"):
        learner = _learner("sao", kind="tiny-dense", advantage_norm=norm)
        original = learner._advantages

        def spy(*a, norm=norm, original=original, **k):
            return seen.setdefault(norm, original(*a, **k))

        learner._advantages = spy
        learner.step(_matched_trajs(learner.policy, _trajs()))
    act = collate(_trajs(), PAD).action_mask.bool()
    raw, white = seen["none"][act].double(), seen["batch"]
    want = (raw - raw.mean()) / (raw.std(unbiased=False) + 1e-8)
    assert raw.std() > 0 and torch.allclose(white[act].double(), want, atol=1e-5)
    assert abs(float(white[act].mean())) < 1e-5 and abs(float(white[act].std(unbiased=False)) - 1) < 1e-4
    assert torch.count_nonzero(white[~act]) == 0


def test_the_optimizer_settings_are_the_trainer_fields_of_the_same_names():
    from saorl.config import load_config
    from saorl.runtime.learner.single import OptimConfig

    t = load_config(None, ["trainer.policy_lr=2e-5", "trainer.critic_lr=3e-4", "trainer.weight_decay=0.1",
                           "trainer.grad_clip=0.5", "trainer.warmup_steps=7"]).trainer
    assert OptimConfig.from_trainer(t) == OptimConfig(policy_lr=2e-5, critic_lr=3e-4, weight_decay=0.1,
                                                      grad_clip=0.5, warmup_steps=7)


def test_staleness_lr_ref_scales_the_policy_rate_by_the_batchs_mean_staleness():
    """``trainer.staleness_lr_ref``: the policy's rate is ``policy_lr × min(1, ref / s̄)``, s̄ the
    batch's mean staleness over its action tokens; the critic's rate is left alone; no effect at
    staleness at or below the reference."""
    def run(versions_of, ref, learner_version):
        policy = build_tiny("tiny-dense", seed=0)
        lrn = Learner(policy, Critic.from_policy(policy), get_preset("sao"),
                      OptimConfig(policy_lr=1e-3, critic_lr=2e-3, staleness_lr_ref=ref), pad_id=PAD)
        lrn.counters.version = learner_version
        trajs = _trajs()
        for i, t in enumerate(trajs):
            t.versions = [versions_of(i) if m else -1 for m in t.action_mask]
        m = lrn.step(trajs)
        return m["policy/lr"], lrn.critic_opt.param_groups[0]["lr"], trajs

    # trajectory i sampled at version i, trainer at 10: staleness 10 - i on its action tokens
    lr, critic_lr, trajs = run(lambda i: i, 2.0, 10)
    tokens = [(10 - i, sum(t.action_mask)) for i, t in enumerate(trajs)]
    mean = sum(s * n for s, n in tokens) / sum(n for _, n in tokens)
    assert mean > 2.0 and lr == pytest.approx(1e-3 * 2.0 / mean) and critic_lr == pytest.approx(2e-3)
    assert run(lambda i: 9, 2.0, 10)[0] == pytest.approx(1e-3)  # staleness 1 <= 2: unchanged
    assert run(lambda i: 10, 2.0, 10)[0] == pytest.approx(1e-3)  # staleness 0: unchanged
    assert run(lambda i: 0, None, 10)[0] == pytest.approx(1e-3)  # off
