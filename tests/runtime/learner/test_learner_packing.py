"""Packed micro-batches with gradient accumulation give the padded one-pass update (within 1e-5).

Reference: ``packing=False`` with a budget larger than the batch — one right-padded ``[B, T]``
pass, the layout before packing. Compared on random ragged multi-turn batches: the losses and
metrics, the gradients each optimizer step sees (captured by a step pre-hook: policy, and the
critic's K steps), and the weights after the step.

Adam's first step moves each weight by lr · g / (|g| + eps): for a gradient near 0 that is close
to ± lr whichever side of 0 the summation order puts it (a 1e-8 difference in g can move a weight
by 2e-3). So the weights are compared with eps = 1e-4, where the update is Lipschitz in g
(|Δw| ≤ lr · |Δg| / eps); the gradients themselves are compared directly.
"""

import random

import pytest
import torch

from saorl.algo.registry import get_preset
from saorl.data.trajectory import Episode, Trajectory
from saorl.models.critic import Critic
from saorl.models.tiny import build_tiny
from saorl.runtime.learner.single import Learner, OptimConfig

PAD = 1


def _ragged(n, seed, group_size=1):
    """Multi-turn trajectories of very different lengths; GRPO group members share a prompt."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        g = random.Random(seed * 1000 + i // group_size)
        prompt = [g.randint(2, 1000) for _ in range(g.randint(2, 8))]
        ids, mask = list(prompt), [0] * len(prompt)
        for turn in range(rng.randint(1, 4)):
            if turn:
                obs = rng.randint(1, 5)
                ids += [rng.randint(2, 1000) for _ in range(obs)]
                mask += [0] * obs
            act = rng.randint(1, 20)
            ids += [rng.randint(2, 1000) for _ in range(act)]
            mask += [1] * act
        # rollout log-probs around the tiny model's (~ -6.9): some ratios leave the DIS band
        lp = [rng.uniform(-8.5, -6.0) if m else 0.0 for m in mask]
        rewards = [0.0] * len(ids)
        rewards[max(j for j, m in enumerate(mask) if m)] = rng.choice([0.0, 0.5, 1.0])
        if rng.random() < 0.5:
            rewards[len(prompt) + 1] += rng.uniform(-0.5, 0.5)
        out.append(Trajectory(ids, mask, lp, rewards, [0 if m else -1 for m in mask], len(prompt),
                              task_id=f"t{i // group_size}", episode=Episode(success=rewards[-1] > 0.4)))
    return out


def _run(name, kind, trajs, gids, **learner_kw):
    preset = get_preset(name)
    policy = build_tiny(kind, seed=0)
    critic = Critic.from_policy(policy) if preset.use_critic else None
    lrn = Learner(policy, critic, preset, OptimConfig(policy_lr=1e-3, critic_lr=1e-3, grad_clip=1e6),
                  pad_id=PAD, temperature=0.9, **learner_kw)
    grads = {"policy": [], "critic": []}
    for key, opt in (("policy", lrn.policy_opt), ("critic", lrn.critic_opt)):
        if opt is not None:
            for group in opt.param_groups:
                group["eps"] = 1e-4
            params = [p for g in opt.param_groups for p in g["params"]]
            real = [p.data_ptr() for p in params]

            def record(o, a, k, key=key, params=params, real=real):
                # the step on the weights themselves: the non-finite guard's trial steps land on copies
                if [p.data_ptr() for p in params] == real:
                    grads[key].append([p.grad.clone() for p in params])

            opt.register_step_pre_hook(record)
    metrics = lrn.step(trajs, gids)
    weights = {n: p.detach().clone() for n, p in lrn.policy.named_parameters()}
    if critic is not None:
        weights |= {f"critic.{n}": p.detach().clone() for n, p in critic.named_parameters()}
    return metrics, grads, weights


CASES = [("sao", "tiny-moe", 1), ("grpo", "tiny-dense", 4), ("vapo", "tiny-dense", 4), ("ppo", "tiny-moe", 1)]


@pytest.mark.parametrize(("name", "kind", "group"), CASES)
def test_packed_update_equals_padded_update(name, kind, group):
    trajs = _ragged(8, seed=len(name), group_size=group)
    gids = [i // group for i in range(len(trajs))]
    ref_m, ref_g, ref_w = _run(name, kind, trajs, gids, packing=False, max_tokens_per_microbatch=10**6)
    m, g, w = _run(name, kind, trajs, gids, packing=True, max_tokens_per_microbatch=96)
    assert m["throughput/microbatches"] >= 3 and ref_m["throughput/microbatches"] == 1
    assert m["throughput/positions_per_action_token"] < ref_m["throughput/positions_per_action_token"]
    assert m["throughput/positions_per_action_token"] == pytest.approx(
        sum(len(t) for t in trajs) / sum(t.num_action_tokens for t in trajs))
    for key, v in ref_m.items():
        if key.startswith("throughput/"):
            continue
        assert m[key] == pytest.approx(v, abs=1e-5, rel=1e-5), key
    assert 0 < m["policy/dis_kept_frac" if name == "sao" else "policy/ratio_mean"] < 2
    assert len(g["policy"]) == 1 and len(g["critic"]) == get_preset(name).critic_updates
    for key in g:
        for ref_step, step in zip(ref_g[key], g[key]):
            for a, b in zip(ref_step, step):
                torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    assert any(float(gr.abs().max()) > 1e-4 for gr in g["policy"][0])  # the comparison is not vacuous
    for n, ref in ref_w.items():
        torch.testing.assert_close(w[n], ref, atol=1e-5, rtol=1e-5, msg=n)


def test_padded_microbatches_equal_one_pass():
    trajs = _ragged(6, seed=11)
    gids = list(range(6))
    one_pass = dict(packing=False, max_tokens_per_microbatch=10**6)
    ref_m, ref_g, ref_w = _run("sao", "tiny-dense", trajs, gids, **one_pass)
    m, g, w = _run("sao", "tiny-dense", trajs, gids, packing=False, max_tokens_per_microbatch=80)
    assert m["throughput/microbatches"] >= 2
    assert m["policy/loss"] == pytest.approx(ref_m["policy/loss"], abs=1e-5)
    for a, b in zip(ref_g["policy"][0], g["policy"][0]):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    for n, ref in ref_w.items():
        torch.testing.assert_close(w[n], ref, atol=1e-5, rtol=1e-5, msg=n)
