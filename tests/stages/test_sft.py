"""Supervised fine-tuning: loss on action tokens only, and it learns the demonstrations."""

import math
import random

import pytest
import torch

from saorl.data.tasks import load_tasks
from saorl.data.trajectory import Trajectory
from saorl.envs.registry import make_env_factory
from saorl.models.logprobs import token_logprobs
from saorl.models.tiny import build_tiny
from saorl.models.tokenizer import load_tokenizer
from saorl.stages.sft import demonstrations, sft


def _demo(prompt, action, obs, action2):
    ids = prompt + action + obs + action2
    mask = [0] * len(prompt) + [1] * len(action) + [0] * len(obs) + [1] * len(action2)
    zeros = [0.0] * len(ids)
    return Trajectory(ids, mask, zeros, zeros, [0 if m else -1 for m in mask], len(prompt))


def test_sft_loss_is_the_nll_of_action_tokens_only():
    rng = random.Random(0)
    def noise(n):
        return [rng.randint(2, 999) for _ in range(n)]

    demos = [_demo(noise(5), [7, 8, 9], noise(3), [10, 11]) for _ in range(8)]
    policy = build_tiny("tiny-dense", seed=0)
    m = sft(policy, demos, pad_id=1, steps=40, batch_size=8, lr=3e-3, seed=0, warmup_steps=2)
    # the fixed action tokens are learnt; the random prompt/observation tokens are not targets
    from saorl.data.batch import collate

    b = collate(demos, 1)
    with torch.no_grad():
        lp = token_logprobs(policy, b.input_ids, b.attention_mask)
    act = lp[b.action_mask.bool()]
    ctx = lp[(b.attention_mask.bool() & ~b.action_mask.bool())][1:]
    assert act.mean() > -0.5, "action tokens should be near-certain after SFT"
    assert ctx.mean() < -3.0, "context tokens must not be trained on"
    assert m["sft/loss"] < 0.5


def test_demonstrations_are_deterministic_and_token_exact():
    tok = load_tokenizer()
    factory = make_env_factory("math_tool", {"demo_error_rate": 0.0})
    tasks = load_tasks(factory(), "train", 6, seed=3)
    a = demonstrations(factory, tasks, tok, seed=1)
    b = demonstrations(factory, tasks, tok, seed=1)
    assert [t.token_ids for t in a] == [t.token_ids for t in b]
    assert all(t.episode.success for t in a)
    for t in a:
        acts = tok.decode([i for i, m in zip(t.token_ids, t.action_mask) if m])
        assert "<answer>" in acts and "<tool>" in acts


def test_sft_seed_decouples_the_warm_start_from_the_run_seed():
    from saorl.config import load_config
    from saorl.stages.sft import sft_key, sft_seed

    run0, run1 = load_config(None, ["seed=0"]), load_config(None, ["seed=1"])
    assert sft_key(run0) != sft_key(run1)  # by default each run seed has its own SFT model
    fixed0, fixed1 = load_config(None, ["seed=0", "sft.seed=0"]), load_config(None, ["seed=1", "sft.seed=0"])
    assert sft_seed(fixed1) == 0 and fixed1.seed == 1
    assert sft_key(fixed0) == sft_key(fixed1) == sft_key(run0)  # sft.seed=0 is the seed-0 warm start
    assert sft_key(load_config(None, ["seed=1", "sft.seed=1"])) == sft_key(run1)
    assert sft_key(load_config(None, ["seed=0", "sft.seed=0", "sft.steps=7"])) != sft_key(fixed0)
    # demonstrations played with observations as chat turns are other trajectories: another key
    chat = sft_key(load_config(None, ["seed=0", "env.observation_format=chat"]))
    assert chat != sft_key(run0)
    user = load_config(None, ["seed=0", "env.observation_format=chat", "env.observation_role=user"])
    assert sft_key(user) != chat



def test_an_option_written_at_its_default_keys_the_same_warm_start():
    """``env.options.max_turns=4`` (math_tool's default) is the run without it: the same cached SFT
    model; another value, or the same number as another type, is another key."""
    from saorl.config import load_config
    from saorl.stages.sft import sft_key

    def key(*over):
        return sft_key(load_config(None, ["env.type=math_tool", "sft.seed=0", *over]))

    plain = key()
    assert key("env.options.max_turns=4") == plain
    assert key("env.options.max_turns=4", "env.options.hint=false", "env.options.system=null") == plain
    assert key("env.options.max_turns=3") != plain
    assert key("env.options.demo_error_rate=0.25") != plain
    assert key("env.options.tool_timeout_s=5") != plain  # an int where the default is a float: not assumed

def test_an_env_version_bump_rebuilds_the_cached_warm_start(monkeypatch):
    """A change to an env's prompts (its ``version``) must not reuse an SFT model trained on the old
    ones; version 1 adds nothing to the key, so caches built before versions existed stay valid."""
    import hashlib
    import json

    from saorl.config import load_config
    from saorl.envs.noisy_lookup import NoisyLookupEnv
    from saorl.models.codec import prompt_format_key
    from saorl.stages import sft

    cfg = load_config(None, ["env.type=noisy_lookup", "sft.seed=0"])
    assert NoisyLookupEnv.version == 2
    key2 = sft.sft_key(cfg)
    monkeypatch.setattr(NoisyLookupEnv, "version", 1)
    key1 = sft.sft_key(cfg)
    assert key1 != key2
    ident = {"policy": cfg.model.policy, "tokenizer": cfg.model.tokenizer, "dtype": cfg.model.dtype,
             "env": cfg.env.model_dump(exclude_defaults=True), "seed": 0,
             "sft": cfg.sft.model_dump(exclude={"enabled", "seed"}), "format": 1,
             **prompt_format_key(cfg.model)}
    assert key1 == hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _varied_demos(n: int = 12) -> list[Trajectory]:
    rng = random.Random(1)
    def noise(k):
        return [rng.randint(2, 999) for _ in range(k)]

    return [_demo(noise(rng.randint(3, 9)), [7, 8, 9], noise(rng.randint(1, 6)),
                  [10, 11][: rng.randint(1, 2)]) for _ in range(n)]


def test_sft_micro_batches_and_packing_accumulate_to_the_one_pass_step():
    """Cut into token-budget micro-batches (packed or padded), SFT takes the step one padded pass
    over the whole minibatch takes: the token mean over every action token of the minibatch.

    Losses within 1e-5 relative; weights within 1e-6 after 5 Adam steps at lr 1e-5. Adam moves an
    element by about lr · g / (|g| + eps), which turns the float rounding of another summation
    order into a weight difference that scales with the learning rate (measured: 2.2e-7 at lr
    1e-5, 2.2e-5 at 1e-3), as in the sharded learner's equality test."""
    demos = _varied_demos()
    runs = {}
    for name, kw in {"one pass": dict(max_tokens_per_microbatch=10_000, packing=False),
                     "packed, 3+ passes": dict(max_tokens_per_microbatch=40, packing=True),
                     "padded, 3+ passes": dict(max_tokens_per_microbatch=40, packing=False)}.items():
        policy = build_tiny("tiny-dense", seed=0)
        losses = []
        sft(policy, demos, pad_id=1, steps=5, batch_size=8, lr=1e-5, seed=0, warmup_steps=1,
            on_step=lambda _, m, losses=losses: losses.append(m["sft/loss"]), **kw)
        runs[name] = (policy.state_dict(), losses)
    ref_state, ref_losses = runs.pop("one pass")
    for name, (state, losses) in runs.items():
        assert losses == pytest.approx(ref_losses, rel=1e-5), name
        for k, v in ref_state.items():
            torch.testing.assert_close(state[k], v, rtol=0, atol=1e-6, msg=f"{name}: {k}")


def test_an_sft_step_with_non_finite_weights_is_rolled_back():
    demos = _varied_demos()
    policy = build_tiny("tiny-dense", seed=0)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    m = sft(policy, demos, pad_id=1, steps=2, batch_size=4, lr=math.inf, seed=0, warmup_steps=1)
    assert m["sft/nonfinite_skips"] == 2  # an infinite learning rate makes every update non-finite
    for k, v in policy.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_demonstrations_report_their_progress():
    tok = load_tokenizer()
    factory = make_env_factory("math_tool", {"demo_error_rate": 0.0})
    tasks = load_tasks(factory(), "train", 5, seed=3)
    seen = []
    demonstrations(factory, tasks, tok, seed=1, on_done=lambda done, total: seen.append((done, total)))
    assert seen == [(i, 5) for i in range(1, 6)]


def _layer_calls(model) -> list[int]:
    """A counter of the calls into the first decoder layer's MLP (a module the layer calls, so a
    recompute inside the checkpointed layer counts too; a pre-hook, as the recompute stops early,
    once it has what the backward needs)."""
    calls = [0]
    model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_activation_checkpointing_recomputes_layers_in_sft_and_leaves_the_step_unchanged():
    """``trainer.activation_checkpointing`` reaches SFT: each decoder layer runs again in the backward
    pass (two forward calls a micro-batch, not one), the losses and weights are the plain run's, and
    the switch is off again afterwards (the warm start goes on the shelf as loaded)."""
    demos = _varied_demos()
    runs = {}
    for on in (False, True):
        policy = build_tiny("tiny-dense", seed=0)
        calls, during, losses = _layer_calls(policy), [], []

        def on_step(_, m, policy=policy, losses=losses, during=during):
            losses.append(m["sft/loss"])
            during.append(policy.model.layers[0].gradient_checkpointing)

        sft(policy, demos, pad_id=1, steps=3, batch_size=8, lr=1e-4, seed=0, warmup_steps=1,
            max_tokens_per_microbatch=10_000, packing=False, on_step=on_step, activation_checkpointing=on)
        assert during == [on] * 3
        assert not policy.model.layers[0].gradient_checkpointing
        runs[on] = (policy.state_dict(), losses, calls[0])
    (plain, plain_losses, plain_calls), (ckpt, ckpt_losses, ckpt_calls) = runs[False], runs[True]
    assert plain_calls == 3 and ckpt_calls == 6  # one pass a step; recomputed in each backward
    assert ckpt_losses == pytest.approx(plain_losses, rel=1e-6)
    for k, v in plain.items():
        torch.testing.assert_close(ckpt[k], v, rtol=0, atol=1e-6, msg=k)
