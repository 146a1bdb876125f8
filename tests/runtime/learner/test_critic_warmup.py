"""Critic warm-up (``trainer.critic_warmup_steps``): the first steps train the critic alone, the
policy is scored but not moved and its version does not advance; the policy's learning-rate
warm-up starts at its own first update; a resume from a checkpoint continues the count; the run
publishes nothing new during it; a critic-free algorithm refuses the setting. The other reading,
``trainer.critic_warmup=lr``: the policy trains from step 1 while the critic's rate ramps up."""

import pytest
import torch
from test_learner import PAD, _changed, _matched_trajs, _snapshot, _trajs

from saorl.algo.registry import get_preset
from saorl.config import ConfigError, load_config
from saorl.models.critic import Critic
from saorl.models.tiny import build_tiny
from saorl.runtime.learner.single import Learner, OptimConfig


def _learner(**optim):
    policy = build_tiny("tiny-dense", seed=0)
    return Learner(policy, Critic.from_policy(policy), get_preset("sao"),
                   OptimConfig(policy_lr=1e-3, critic_lr=1e-3, **optim), pad_id=PAD)


def test_the_first_steps_move_the_critic_alone_then_the_policy_trains():
    lrn = _learner(critic_warmup_steps=2)
    seen = []
    for step in (1, 2, 3):
        policy, critic = _snapshot(lrn.policy), _snapshot(lrn.critic)
        result = lrn.step(_matched_trajs(lrn.policy, _trajs(seed=step)))  # every ratio 1: all kept
        seen.append((result.frozen, result["critic/warmup"], result["policy/version"]))
        assert _changed(critic, lrn.critic)  # the critic's K updates every step
        if step <= 2:
            assert not _changed(policy, lrn.policy)  # bit for bit
            assert "policy/update_rel" not in result and not result.skipped
            assert result["policy/entropy"] > 0  # scored all the same: the metrics stay meaningful
        else:
            assert _changed(policy, lrn.policy)
    assert seen == [(True, 1.0, 0), (True, 1.0, 0), (False, 0.0, 1)]
    assert lrn.steps_done == 3 and lrn.nonfinite_skips == 0


def test_the_policys_learning_rate_warm_up_starts_at_its_first_update():
    lrn = _learner(critic_warmup_steps=2, warmup_steps=4)
    rows = [lrn.step(_trajs(seed=i)) for i in range(5)]
    crit = [g["lr"] for g in lrn.critic_opt.param_groups]
    assert [r["policy/lr"] for r in rows[2:]] == pytest.approx([2.5e-4, 5e-4, 7.5e-4])
    assert crit == pytest.approx([1e-3])  # the critic's own warm-up: steps 1..4, done at step 5


def test_a_resume_continues_the_count(tmp_path):
    lrn = _learner(critic_warmup_steps=2)
    assert lrn.step(_trajs(seed=1)).frozen
    manifest = {**lrn.save_state(tmp_path), **lrn.counters.state()}
    again = _learner(critic_warmup_steps=2)
    again.load_state(tmp_path, manifest)
    assert [again.step(_trajs(seed=s)).frozen for s in (2, 3)] == [True, False]
    assert again.version == 1


def test_an_algorithm_without_a_critic_refuses_it_and_the_default_is_off():
    assert load_config(None, []).trainer.critic_warmup_steps == 0
    with pytest.raises(ConfigError, match=r"trainer\.critic_warmup_steps: .*grpo.* trains no critic"):
        load_config(None, ["algo.name=grpo", "trainer.batch_size=8", "trainer.critic_warmup_steps=3"])
    lrn = _learner()
    result = lrn.step(_trajs())
    assert not result.frozen and "critic/warmup" not in result
    torch.testing.assert_close(torch.tensor(result["policy/version"]), torch.tensor(1))


def test_a_run_with_a_critic_warm_up_trains_journals_and_publishes_after_it(tmp_path, monkeypatch):
    import json

    from saorl.training import train

    published = []
    real = Learner.publish

    def publish(self, sync):
        published.append(self.version)
        return real(self, sync)

    monkeypatch.setattr(Learner, "publish", publish)

    cfg = load_config(None, ["model.policy=tiny-dense", "sft.enabled=false", "value_pretrain.enabled=false",
                             "runtime.backend=inprocess", "env.num_test_tasks=4", "run.eval_tasks=2",
                             "run.progress=false", "run.report_to=none", "rollout.max_new_tokens=8",
                             "rollout.max_total_tokens=64", "trainer.steps=3",
                             "trainer.critic_warmup_steps=2", f"run.out_dir={tmp_path}"])
    run_dir, last = train(cfg, tmp_path / "run")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("step", 0) > 0]
    assert [(r["critic/warmup"], r["policy/version"]) for r in steps] == [(1.0, 0), (1.0, 0), (0.0, 1)]
    trained = [json.loads(line) for line in (run_dir / "trained.jsonl").read_text().splitlines()]
    assert len([t for t in trained if "step" in t]) == 3  # every step's trajectories consumed and recorded
    assert last["policy/version"] == 1
    assert published[-1:] == [1] and published.count(0) <= 1  # the start's version 0, not once a warm-up step


# ------------------------------------------------ the other reading: the critic's rate warmed up
def test_lr_warm_up_trains_the_policy_from_step_1_and_ramps_the_critics_rate():
    # critic_lr 1e-3 ramped over 4 steps: k/4 of it at step k = 1..4, all of it from step 5 on
    lrn = _learner(critic_warmup_steps=4, critic_warmup="lr")
    seen = []
    for step in range(1, 7):
        policy = _snapshot(lrn.policy)
        result = lrn.step(_matched_trajs(lrn.policy, _trajs(seed=step)))
        assert not result.frozen and result["critic/warmup"] == 0.0
        assert _changed(policy, lrn.policy)  # the policy moves from the first step on
        seen.append((lrn.critic_opt.param_groups[0]["lr"], result["critic/lr"], result["policy/lr"],
                     result["policy/version"]))
    assert [s[0] for s in seen] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    assert [s[1] for s in seen] == pytest.approx([s[0] for s in seen])  # logged as it was used
    assert [s[2] for s in seen] == pytest.approx([1e-3] * 6)  # the policy's rate untouched
    assert [s[3] for s in seen] == [1, 2, 3, 4, 5, 6]


def test_lr_warm_up_multiplies_with_the_lr_warm_up_and_resumes_mid_ramp(tmp_path):
    # warmup_steps 2 (both rates) × the critic's ramp over 4: step 1 1/2·1/4, step 2 1·2/4, step 3 3/4
    lrn = _learner(critic_warmup_steps=4, critic_warmup="lr", warmup_steps=2)
    rates = [lrn.step(_trajs(seed=1))["critic/lr"]]
    manifest = {**lrn.save_state(tmp_path), **lrn.counters.state()}
    again = _learner(critic_warmup_steps=4, critic_warmup="lr", warmup_steps=2)
    again.load_state(tmp_path, manifest)
    rates += [again.step(_trajs(seed=s))["critic/lr"] for s in (2, 3)]
    assert rates == pytest.approx([1e-3 * 0.5 * 0.25, 1e-3 * 0.5, 1e-3 * 0.75])


def test_steps_stays_the_default_and_lr_needs_a_length():
    cfg = load_config(None, ["trainer.critic_warmup_steps=3"])
    assert cfg.trainer.critic_warmup == "steps"
    assert OptimConfig.from_trainer(cfg.trainer).critic_warmup == "steps"
    lr = load_config(None, ["trainer.critic_warmup=lr", "trainer.critic_warmup_steps=3"]).trainer
    assert lr.critic_warmup == "lr"
    with pytest.raises(ConfigError, match=r"trainer\.critic_warmup: 'lr' ramps .* which is 0"):
        load_config(None, ["trainer.critic_warmup=lr"])
    with pytest.raises(ConfigError, match=r"trainer\.critic_warmup"):
        load_config(None, ["trainer.critic_warmup=both", "trainer.critic_warmup_steps=3"])
