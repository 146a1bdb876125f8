"""A shared prefix (a system message every trajectory opens with, held once per packed row) gives
the padded one-pass update: losses, metrics, every optimizer step's gradients and the weights after,
for SAO (critic K=2, frozen attention), GRPO and VAPO; and the rows really are shorter.

The reference and the tolerance are those of ``test_learner_packing`` (Adam's eps = 1e-4 there).
"""

import dataclasses
import random

import pytest
import torch
from test_learner_packing import _ragged, _run

from saorl.algo.registry import get_preset
from saorl.data.trajectory import Trajectory
from saorl.models.critic import Critic
from saorl.models.tiny import build_tiny
from saorl.runtime.learner.single import Learner, OptimConfig

SYSTEM = 40


def _with_system(trajs: list[Trajectory], seed: int) -> list[Trajectory]:
    """Each trajectory behind the same ``SYSTEM`` prompt tokens (its own prompt after them)."""
    rng = random.Random(seed)
    system = [rng.randint(2, 1000) for _ in range(SYSTEM)]
    return [dataclasses.replace(t, token_ids=system + t.token_ids, action_mask=[0] * SYSTEM + t.action_mask,
                                rollout_logprobs=[0.0] * SYSTEM + t.rollout_logprobs,
                                rewards=[0.0] * SYSTEM + t.rewards, versions=[-1] * SYSTEM + t.versions,
                                prompt_len=SYSTEM + t.prompt_len) for t in trajs]


CASES = [("sao", "tiny-moe", 1), ("grpo", "tiny-dense", 4), ("vapo", "tiny-dense", 1)]


@pytest.mark.parametrize(("name", "kind", "group"), CASES)
def test_a_shared_prefix_update_equals_the_padded_one_pass_update(name, kind, group):
    trajs = _with_system(_ragged(8, seed=len(name) + 1, group_size=group), seed=3)
    gids = [i // group for i in range(len(trajs))]
    ref_m, ref_g, ref_w = _run(name, kind, trajs, gids, packing=False, max_tokens_per_microbatch=10**6)
    plain_m, _, _ = _run(name, kind, trajs, gids, packing=True, max_tokens_per_microbatch=160,
                         shared_prefix=False)
    m, g, w = _run(name, kind, trajs, gids, packing=True, max_tokens_per_microbatch=160)
    rows = m["throughput/microbatches"]
    actions = sum(t.num_action_tokens for t in trajs)
    assert rows >= 2
    # every packed row holds the prefix once (this batch shares its 40 tokens and more only by chance)
    assert m["throughput/positions_per_action_token"] * actions <= \
        sum(len(t) for t in trajs) - (len(trajs) - rows) * SYSTEM + 1e-6
    assert m["throughput/positions_per_action_token"] < 0.8 * plain_m["throughput/positions_per_action_token"]
    for key, v in ref_m.items():
        if not key.startswith("throughput/"):
            assert m[key] == pytest.approx(v, abs=1e-5, rel=1e-5), key
    assert len(g["policy"]) == 1 and len(g["critic"]) == get_preset(name).critic_updates
    for key in g:
        for ref_step, step in zip(ref_g[key], g[key]):
            for a, b in zip(ref_step, step):
                torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    assert any(float(gr.abs().max()) > 1e-4 for gr in g["policy"][0])  # not vacuous
    for n, ref in ref_w.items():
        torch.testing.assert_close(w[n], ref, atol=1e-5, rtol=1e-5, msg=n)


def test_the_learner_shares_only_where_the_attention_reads_it():
    preset = get_preset("sao")
    on = Learner(build_tiny("tiny-dense"), Critic.from_policy(build_tiny("tiny-dense")), preset,
                 OptimConfig(), pad_id=1)
    assert on.shared_prefix
    assert not Learner(build_tiny("tiny-dense"), Critic.from_policy(build_tiny("tiny-dense")), preset,
                       OptimConfig(), pad_id=1, shared_prefix=False).shared_prefix
    assert not Learner(build_tiny("tiny-dense"), Critic.from_policy(build_tiny("tiny-dense")), preset,
                       OptimConfig(), pad_id=1, packing=False).shared_prefix
    eager = build_tiny("tiny-dense")
    eager.set_attn_implementation("eager")  # saorl leaves eager alone: it would not read the layout
    assert not Learner(eager, None, get_preset("grpo"), OptimConfig(), pad_id=1).shared_prefix


def test_the_critics_top_layers_read_the_shared_row_too():
    """``algo.critic_train_layers``: the frozen lower blocks' output, computed once on the shared row,
    feeds the trained top blocks: the same values, losses and weights as without sharing."""
    trajs = _with_system(_ragged(6, seed=9), seed=4)
    out = {}
    for share in (False, True):
        policy = build_tiny("tiny-dense", seed=0)
        lrn = Learner(policy, Critic.from_policy(policy, seed=0),
                      get_preset("sao").with_overrides(critic_train_layers=2),
                      OptimConfig(policy_lr=1e-3, critic_lr=1e-3), pad_id=1, max_tokens_per_microbatch=160,
                      shared_prefix=share)
        m = lrn.step(trajs)
        out[share] = m, {n: p.detach().clone() for n, p in lrn.critic.named_parameters()}
    (m0, w0), (m1, w1) = out[False], out[True]
    assert m1["throughput/positions_per_action_token"] < 0.8 * m0["throughput/positions_per_action_token"]
    for key in ("critic/value_loss", "critic/value_loss_after", "policy/loss"):
        assert m1[key] == pytest.approx(m0[key], abs=1e-5, rel=1e-5), key
    for n, w in w0.items():
        torch.testing.assert_close(w1[n], w, atol=1e-5, rtol=1e-5, msg=n)


def test_routing_replay_rows_are_never_shared():
    moe = build_tiny("tiny-moe", seed=0)
    preset = get_preset("grpo").with_overrides(routing_replay=True)
    assert not Learner(moe, None, preset, OptimConfig(), pad_id=1).shared_prefix


def _windowed_models():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig, MistralForCausalLM

    small = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)
    gemma = Gemma3ForCausalLM(Gemma3TextConfig(**small, head_dim=32, sliding_window=16,
                                               layer_types=["sliding_attention", "full_attention"]))
    mistral = MistralForCausalLM(MistralConfig(**small, sliding_window=16))  # every layer windowed
    plain = MistralForCausalLM(MistralConfig(**small, sliding_window=None))
    for m in (gemma, mistral, plain):
        m.config._attn_implementation = "sdpa"
    return gemma, mistral, plain


def test_models_with_sliding_window_layers_train_without_sharing():
    """A windowed layer takes the stock ``sdpa`` path, which cannot read a shared-prefix row: such a
    model packs its rows whole (the step runs, on rows as long as without sharing)."""
    gemma, mistral, plain = _windowed_models()
    preset = get_preset("sao")
    assert not Learner(mistral, None, get_preset("grpo"), OptimConfig(), pad_id=1).shared_prefix
    assert Learner(plain, None, get_preset("grpo"), OptimConfig(), pad_id=1).shared_prefix
    lrn = Learner(gemma, Critic.from_policy(gemma, seed=0), preset, OptimConfig(), pad_id=1)
    assert not lrn.shared_prefix
    m = lrn.step(_with_system(_ragged(4, seed=2), seed=1))  # 40 shared tokens: would be shared
    assert m["throughput/positions_per_action_token"] > 0 and torch.isfinite(torch.tensor(m["policy/loss"]))
