"""Value pretraining: the critic fits Monte-Carlo returns of a fixed policy; cached; the CLI."""

import json
import math
import random

import pytest
import torch

import saorl.stages.value_pretrain as vp
from saorl.cli import main
from saorl.config import load_config
from saorl.data.batch import collate
from saorl.data.trajectory import Trajectory
from saorl.envs.base import Env, StepResult, Task
from saorl.models.critic import Critic
from saorl.models.loading import load_policy
from saorl.models.serialize import load_critic, save_critic
from saorl.models.tiny import build_tiny


class CoinEnv(Env):
    """One turn. Task "heads" pays 1 whatever the action, "tails" pays 0: the return is a function
    of the prompt only, so a critic can learn it from a handful of rollouts."""

    name = "coin"
    stop_strings = ("\n",)
    max_turns = 1

    def generate_tasks(self, split, n, seed):
        rng = random.Random(f"coin/{split}/{seed}")
        return [Task(f"coin/{split}/{seed}/{i}", {"side": rng.choice(["heads", "tails"])}) for i in range(n)]

    def reset(self, task, progress=None):
        self.side = task.data["side"]
        return f"The coin shows {self.side} {self.side} {self.side}. Say something:"

    def step(self, action):
        reward = 1.0 if self.side == "heads" else 0.0
        return StepResult("", reward, True, {"success": reward > 0})


# env.call_timeout_s=null: CoinEnv is a class from outside saorl, so by default every call would run in
# warm child processes (saorl.envs.hosted), each of which imports this module, torch included (~6 s of
# CPU per child, a few of them on CI's 2 cores); the hosting has its own tests (tests/envs/test_hosted.py,
# test_hosted_start.py), these are about the critic.
TINY = [f"env.type={__name__}:CoinEnv", "env.call_timeout_s=null", "model.policy=tiny-dense",
        "sft.enabled=false", "value_pretrain.rollouts=16", "value_pretrain.steps=10",
        "value_pretrain.batch_size=8", "rollout.max_new_tokens=6", "rollout.max_total_tokens=64",
        "rollout.engine.slots=16"]


def _cfg(tmp_path, *more):
    return load_config(None, [*TINY, f"run.out_dir={tmp_path}", *more])


@pytest.mark.slow
def test_cli_fits_a_critic_and_reports_the_scaling_curve(tmp_path, capsys):
    out = tmp_path / "critic"
    # seed 1: the 3 held-out rollouts mix heads and tails, so explained variance is informative
    rng = torch.get_rng_state()
    rc = main(["value-pretrain", *TINY, "seed=1", f"run.out_dir={tmp_path}", "--out", str(out),
               "--policy", "tiny-dense"])
    assert rc == 0
    assert torch.equal(torch.get_rng_state(), rng)  # the caller's RNG is untouched
    printed = capsys.readouterr().out
    assert "val EV" in printed and "critic written to" in printed

    data = json.loads((out / vp.METRICS_FILE).read_text())
    curve, final = data["curve"], data["final"]
    # 16 rollouts: 3 held out, 13 to fit on; fits on round(25%, 50%, 100% of 13) = 3, 6, 13
    assert [r["rollouts"] for r in curve] == [0, 3, 6, 13]
    assert [r["fraction"] for r in curve] == pytest.approx([0.0, 3 / 13, 6 / 13, 1.0])
    for r in curve:
        assert set(r) >= {"val_loss", "val_explained_var"}
        assert torch.isfinite(torch.tensor([r["val_loss"], r["val_explained_var"]])).all()
    assert final["value_pretrain/val_rollouts"] == 3 and final["value_pretrain/train_rollouts"] == 13
    assert final["value_pretrain/val_explained_var"] == curve[-1]["val_explained_var"]
    # held-out returns are 0 (tails) or 1 (heads), a function of the prompt: the fitted critic
    # predicts them (measured: EV 0.98-0.99 per fraction), the unfitted one (values ≈ 0) does not
    assert 0.0 < final["value_pretrain/return_mean"] < 1.0
    assert final["value_pretrain/val_loss"] < 0.1 * final["value_pretrain/val_loss_unfitted"]
    assert all(r["val_explained_var"] > 0.5 for r in curve[1:]) and curve[0]["val_explained_var"] < 0.5

    critic = load_critic(out)
    trunk0 = dict(load_policy("tiny-dense", seed=1).model.named_parameters())
    moved, frozen = set(), set()
    for name, p in critic.trunk.named_parameters():
        same = torch.equal(p, trunk0[name])
        if "mlp." in name:
            moved |= set() if same else {name}
        else:
            assert same, f"{name} is frozen under frozen attention but changed"
            frozen.add(name)
    assert moved and any("self_attn" in n for n in frozen) and "embed_tokens.weight" in frozen


@pytest.mark.slow
def test_without_the_curve_only_the_full_fit_runs_under_the_same_cache_key(tmp_path, capsys):
    out = tmp_path / "critic"
    rc = main(["value-pretrain", *TINY, "seed=1", "value_pretrain.curve=false", f"run.out_dir={tmp_path}",
               "--out", str(out), "--policy", "tiny-dense"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert ": 13 rollouts: val loss" in printed and ": 3 rollouts: val loss" not in printed
    curve = json.loads((out / vp.METRICS_FILE).read_text())["curve"]
    assert [r["rollouts"] for r in curve] == [0, 13]
    assert vp.value_pretrain_key(_cfg(tmp_path, "value_pretrain.curve=false"), "tiny-dense") == \
        vp.value_pretrain_key(_cfg(tmp_path), "tiny-dense")  # the kept critic is the same fit


def _fake_pretrain(calls):
    def fake(cfg, policy_spec, out_dir, log=print, shelf=None):
        calls.append(policy_spec)
        save_critic(Critic.from_policy(build_tiny("tiny-dense", seed=0)), out_dir)
        return {}
    return fake


def test_initial_critic_is_cached_by_key(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(vp, "run_value_pretrain", _fake_pretrain(calls))
    cfg = _cfg(tmp_path)
    first = vp.initial_critic(cfg, "tiny-dense", log=lambda _: None)
    second = vp.initial_critic(cfg, "tiny-dense", log=lambda _: None)
    assert first == second and calls == ["tiny-dense"]
    assert first == str(tmp_path / ".cache" / f"critic-{vp.value_pretrain_key(cfg, 'tiny-dense')}")
    load_critic(first)
    # anything that changes the result changes the key: settings, policy, preset's gamma
    other = vp.initial_critic(_cfg(tmp_path, "value_pretrain.rollouts=32"), "tiny-dense", log=lambda _: None)
    assert other != first and len(calls) == 2
    keys = {vp.value_pretrain_key(cfg, "tiny-dense"), vp.value_pretrain_key(cfg, "tiny-moe"),
            vp.value_pretrain_key(_cfg(tmp_path, "algo.gamma=0.9"), "tiny-dense"),
            vp.value_pretrain_key(_cfg(tmp_path, "rollout.temperature=0.5"), "tiny-dense"),
            vp.value_pretrain_key(_cfg(tmp_path, "env.observation_format=chat"), "tiny-dense"),
            vp.value_pretrain_key(_cfg(tmp_path, "algo.critic_train_layers=2"), "tiny-dense")}
    assert len(keys) == 6
    # settings that do not change the critic share the cache
    assert vp.value_pretrain_key(_cfg(tmp_path, "env.num_test_tasks=7", "value_pretrain.enabled=true"),
                                 "tiny-dense") == vp.value_pretrain_key(cfg, "tiny-dense")


@pytest.mark.parametrize("more", [["algo.name=grpo", "trainer.batch_size=8"], ["algo.name=reinforce_rm"],
                                  ["algo.name=ppo"], ["value_pretrain.enabled=false"],
                                  ["algo.value_pretrain=false"]])
def test_initial_critic_none_when_off(tmp_path, monkeypatch, more):
    calls = []
    monkeypatch.setattr(vp, "run_value_pretrain", _fake_pretrain(calls))
    assert vp.initial_critic(_cfg(tmp_path, *more), "tiny-dense") is None
    assert calls == []


def test_initial_critic_prefers_a_configured_critic(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(vp, "run_value_pretrain", _fake_pretrain(calls))
    assert vp.initial_critic(_cfg(tmp_path, "model.critic=/some/critic"), "tiny-dense") == "/some/critic"
    assert vp.initial_critic(_cfg(tmp_path, "algo.name=grpo", "trainer.batch_size=8",
                                  "model.critic=/some/critic"), "tiny-dense") is None
    assert calls == []


def _traj():
    # prompt 2, action 2, observation 2, action 1; reward 1 on the observation, 2 at the end
    mask = [0, 0, 1, 1, 0, 0, 1]
    rewards = [0, 0, 0, 0, 1.0, 0, 2.0]
    return Trajectory(list(range(2, 9)), mask, [-1.0 if m else 0.0 for m in mask], rewards,
                      [0 if m else -1 for m in mask], 2, task_id="t")


def test_chain_targets_follow_the_preset():
    b = collate([_traj()], pad_id=1)
    sao = load_config(None, ["algo.gamma=0.5"]).algo.preset
    returns, mask = vp.chain_targets(b, sao)
    assert mask.tolist() == [[0, 0, 1, 1, 0, 0, 1]]
    # action chain a=(2, 3, 6); reward 1 credited to position 3; R_6 = 2, R_3 = 1 + .5·2, R_2 = .5·2
    assert returns.tolist() == [[0, 0, 1.0, 2.0, 0, 0, 2.0]]
    vapo = load_config(None, ["algo.name=vapo", "algo.gamma=0.5", "trainer.batch_size=8"]).algo.preset
    returns, mask = vp.chain_targets(b, vapo)
    assert mask.tolist() == [[0, 0, 1, 1, 1, 1, 1]]
    # token chain through the observation: R_6 = 2, R_5 = 1, R_4 = 1 + .5, R_3 = .75, R_2 = .375
    assert returns.tolist() == [[0, 0, 0.375, 0.75, 1.5, 1.0, 2.0]]


def test_split_rollouts_holds_out_a_fifth():
    trajs = [_traj() for _ in range(16)]
    ids = {id(t): i for i, t in enumerate(trajs)}
    train, val = vp.split_rollouts(trajs, seed=3)
    assert len(val) == 3 and len(train) == 13
    assert {ids[id(t)] for t in train}.isdisjoint({ids[id(t)] for t in val})
    again, _ = vp.split_rollouts(trajs, seed=3)
    assert [ids[id(t)] for t in again] == [ids[id(t)] for t in train]
    assert [len(x) for x in vp.split_rollouts(trajs[:2], seed=0)] == [1, 1]
    with pytest.raises(ValueError, match="at least 2 rollouts"):
        vp.split_rollouts(trajs[:1], seed=0)


def test_cli_errors_exit_2(tmp_path, capsys):
    out = str(tmp_path / "c")
    assert main(["value-pretrain", "algo.name=grpo", "trainer.batch_size=8", "--out", out]) == 2
    assert "trains no critic" in capsys.readouterr().err
    assert main(["value-pretrain", "value_pretrain.rollouts=1", "--out", out]) == 2
    assert "value_pretrain.rollouts" in capsys.readouterr().err
    assert main(["value-pretrain", *TINY, "--policy", str(tmp_path / "nope"), "--out", out]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("frozen", [True, False])
def test_fit_critic_moves_only_what_the_preset_trains(frozen):
    preset = load_config(None, [f"algo.freeze_critic_attention={str(frozen).lower()}"]).algo.preset
    trajs = [_traj() for _ in range(4)]
    critic = Critic.from_policy(build_tiny("tiny-dense", seed=0))
    before = {n: p.detach().clone() for n, p in critic.named_parameters()}
    unfitted = vp.critic_metrics(critic, trajs, preset, pad_id=1, batch_size=2)
    fit = vp.fit_critic(critic, trajs, preset, steps=4, batch_size=3, lr=1e-2, grad_clip=1.0,
                        pad_id=1, seed=0)
    fitted = vp.critic_metrics(critic, trajs, preset, pad_id=1, batch_size=2)
    assert fitted["loss"] < unfitted["loss"] and math.isfinite(fit["critic/value_loss"])
    changed = {n for n, p in critic.named_parameters() if not torch.equal(p, before[n])}
    assert "value_head.weight" in changed and any(".mlp." in n for n in changed)
    attn = {n for n in before if "self_attn" in n or "embed_tokens" in n}
    assert (changed & attn == set()) if frozen else attn <= changed


def test_fit_critic_trains_only_the_top_layers_when_the_preset_says_so():
    preset = load_config(None, ["algo.critic_train_layers=1"]).algo.preset
    trajs = [_traj() for _ in range(4)]
    critic = Critic.from_policy(build_tiny("tiny-dense", seed=0))
    before = {n: p.detach().clone() for n, p in critic.named_parameters()}
    vp.fit_critic(critic, trajs, preset, steps=3, batch_size=3, lr=1e-2, grad_clip=1.0, pad_id=1, seed=0)
    changed = {n for n, p in critic.named_parameters() if not torch.equal(p, before[n])}
    assert "value_head.weight" in changed and "trunk.layers.3.mlp.up_proj.weight" in changed
    assert all(n.startswith(("value_head.", "trunk.layers.3.mlp.")) for n in changed)


def test_fit_critic_reports_progress_after_every_step():
    preset = load_config(None, []).algo.preset
    critic = Critic.from_policy(build_tiny("tiny-dense", seed=0))
    calls = []
    vp.fit_critic(critic, [_traj() for _ in range(4)], preset, steps=3, batch_size=2, lr=1e-3, grad_clip=1.0,
                  pad_id=1, seed=0, progress=lambda done, total: calls.append((done, total)))
    assert calls == [(1, 3), (2, 3), (3, 3)]


def test_critic_key_follows_the_env_version(tmp_path, monkeypatch):
    from saorl.envs.noisy_lookup import NoisyLookupEnv

    cfg = _cfg(tmp_path, "env.type=noisy_lookup")
    key2 = vp.value_pretrain_key(cfg, "tiny-dense")
    monkeypatch.setattr(NoisyLookupEnv, "version", 1)
    assert vp.value_pretrain_key(cfg, "tiny-dense") != key2


def test_fit_critic_micro_batches_accumulate_to_the_one_pass_step_and_roll_back_non_finite():
    """Packed or padded token-budget micro-batches take the one-pass step (within float rounding,
    scaled by Adam as in SFT's test); an infinite learning rate is skipped, every step."""
    preset = load_config(None, []).algo.preset
    trajs = [_traj() for _ in range(6)]
    states = {}
    for name, kw in {"one pass": dict(max_tokens_per_microbatch=10_000, packing=False),
                     "packed": dict(max_tokens_per_microbatch=24, packing=True),
                     "padded": dict(max_tokens_per_microbatch=24, packing=False)}.items():
        critic = Critic.from_policy(build_tiny("tiny-dense", seed=0))
        fit = vp.fit_critic(critic, trajs, preset, steps=3, batch_size=4, lr=1e-5, grad_clip=1.0,
                            pad_id=1, seed=0, **kw)
        states[name] = ({k: v.clone() for k, v in critic.state_dict().items()}, fit["critic/value_loss"])
    ref, ref_loss = states.pop("one pass")
    for name, (state, loss) in states.items():
        assert loss == pytest.approx(ref_loss, rel=1e-5), name
        for k, v in ref.items():
            torch.testing.assert_close(state[k], v, rtol=0, atol=1e-6, msg=f"{name}: {k}")
    critic = Critic.from_policy(build_tiny("tiny-dense", seed=0))
    before = {k: v.clone() for k, v in critic.state_dict().items()}
    fit = vp.fit_critic(critic, trajs, preset, steps=2, batch_size=4, lr=math.inf, grad_clip=1.0,
                        pad_id=1, seed=0)
    assert fit["critic/nonfinite_skips"] == 2
    assert all(torch.equal(v, before[k]) for k, v in critic.state_dict().items())


def test_rollouts_are_sampled_as_the_runs_local_engine_samples(tmp_path):
    """``rollout.engine.moe_top_k`` (and its ``dtype`` / ``router_noise``) change the RL sampler, so
    value pretraining samples with it too: the recorded log-probs are the top-1-routed model's,
    the trainer's policy is untouched, and the cache key tells the two apart."""
    from saorl.models.codec import run_tokenizer
    from saorl.models.logprobs import token_logprobs
    from saorl.models.routing import perturb_routing

    base = ["model.policy=tiny-moe"]
    cfg = _cfg(tmp_path, *base, "rollout.engine.moe_top_k=1")
    policy = load_policy("tiny-moe", seed=cfg.seed)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    sampler = vp.sampling_model(cfg, "tiny-moe", policy)
    assert sampler is not policy and vp.sampling_model(_cfg(tmp_path, *base), "tiny-moe", policy) is policy
    trajs = vp.sample_rollouts(cfg, sampler, run_tokenizer(cfg.model), 4)
    routed = load_policy("tiny-moe", seed=cfg.seed)
    perturb_routing(routed, top_k=1)
    for name, model, close in (("top-1", routed, True), ("trainer's", policy, False)):
        gaps = []
        for t in trajs:
            x = torch.tensor([t.token_ids])
            with torch.no_grad():
                mine = token_logprobs(model, x, torch.ones_like(x), temperature=cfg.rollout.temperature)[0]
            acts = torch.tensor(t.action_mask, dtype=torch.bool)
            gaps.append(float((torch.tensor(t.rollout_logprobs)[acts] - mine[acts]).abs().max()))
        assert (max(gaps) < 1e-4) is close, (name, gaps)
    assert all(torch.equal(v, before[k]) for k, v in policy.state_dict().items())
    keys = {vp.value_pretrain_key(_cfg(tmp_path, *base, *more), "tiny-moe")
            for more in ([], ["rollout.engine.moe_top_k=1"], ["rollout.engine.router_noise=0.5"],
                         ["rollout.engine.dtype=bfloat16"])}
    assert len(keys) == 4


def test_value_pretraining_hands_the_run_sampler_to_the_rollouts(tmp_path, monkeypatch):
    seen = []

    def stop(cfg, model, tokenizer, n, on_done=None):
        seen.append(getattr(model, "_saorl_routing", None))
        raise KeyboardInterrupt

    monkeypatch.setattr(vp, "sample_rollouts", stop)
    with pytest.raises(KeyboardInterrupt):
        vp.run_value_pretrain(_cfg(tmp_path, "model.policy=tiny-moe", "rollout.engine.moe_top_k=1"),
                              "tiny-moe", tmp_path / "critic", log=lambda _: None)
    assert seen[0] is not None and seen[0].top_k == 1


def test_activation_checkpointing_recomputes_the_critic_trunk_and_leaves_the_fit_unchanged():
    """``trainer.activation_checkpointing`` reaches value pretraining: the trunk's layers run again in
    each backward (counted by a pre-hook on a module inside the first layer), the fitted critic is
    the plain fit's, and the switch is off once the fit ends."""
    preset = load_config(None, []).algo.preset
    trajs = [_traj() for _ in range(6)]
    fits = {}
    for on in (False, True):
        critic = Critic.from_policy(build_tiny("tiny-dense", seed=0))
        calls = [0]
        critic.trunk.layers[0].mlp.register_forward_pre_hook(lambda *_, c=calls: c.__setitem__(0, c[0] + 1))
        fit = vp.fit_critic(critic, trajs, preset, steps=3, batch_size=4, lr=1e-4, grad_clip=1.0, pad_id=1,
                            seed=0, max_tokens_per_microbatch=10_000, packing=False,
                            activation_checkpointing=on)
        assert not critic.trunk.layers[0].gradient_checkpointing
        state = {k: v.clone() for k, v in critic.state_dict().items()}
        fits[on] = (state, fit["critic/value_loss"], calls[0])
    (plain, plain_loss, plain_calls), (ckpt, ckpt_loss, ckpt_calls) = fits[False], fits[True]
    assert ckpt_calls == 2 * plain_calls > 0
    assert ckpt_loss == pytest.approx(plain_loss, rel=1e-6)
    for k, v in plain.items():
        torch.testing.assert_close(ckpt[k], v, rtol=0, atol=1e-6, msg=k)
