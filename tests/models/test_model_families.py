"""Their own model: Qwen3 (byte-level BPE, chat template) and Llama (SentencePiece-style, BOS)
random-init models from a directory play token-exact multi-turn episodes and train.

Exactness: ``decode(traj.token_ids)`` is the decoded prompt followed by, turn by turn, exactly the
action text the env received and exactly the observation it answered, with no space inserted at a
boundary; the rendering shows the same texts.
"""

import asyncio

import pytest
import torch
from model_families import OBSERVATIONS, TurnsEnv, llama_dir, qwen3_dir

from saorl.agent.loop import run_episodes
from saorl.agent.render import render_trajectory
from saorl.algo.registry import get_preset
from saorl.config import ModelConfig, load_config
from saorl.engines.base import SamplingParams
from saorl.engines.local import LocalEngine
from saorl.models.codec import check_vocab, run_tokenizer
from saorl.models.critic import Critic
from saorl.models.loading import load_policy
from saorl.runtime.learner.single import Learner, OptimConfig

BUILDERS = {"qwen3": qwen3_dir, "llama": llama_dir}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def family(request, tmp_path_factory):
    path = BUILDERS[request.param](tmp_path_factory.mktemp(request.param) / "policy")
    return request.param, path


def _episodes(path, n=6):
    tok = run_tokenizer(ModelConfig(policy=str(path)))
    policy = load_policy(str(path))
    check_vocab(tok, policy)
    engine = LocalEngine(policy, tok, max_batch_size=4)
    TurnsEnv.seen.clear()
    tasks = TurnsEnv().generate_tasks("train", n, 0)
    try:
        trajs = asyncio.run(run_episodes(engine, TurnsEnv, tasks, tok, concurrency=3,
                                         sampling=SamplingParams(temperature=1.0, max_new_tokens=8, seed=0),
                                         max_total_tokens=200))
    finally:
        engine.close()
    return tok, policy, trajs


def test_episodes_decode_to_prompt_actions_and_observations_exactly(family):
    name, path = family
    tok, _, trajs = _episodes(path)
    assert len(trajs) == 6 and all(t.episode.turns == 4 for t in trajs)
    seen = {tuple(a) for a in TurnsEnv.seen}
    for t in trajs:
        prompt = tok.text(t.token_ids[:t.prompt_len])
        if name == "qwen3":  # the chat template, then the assistant's turn
            assert prompt.startswith("<|im_start|>user\nAdd ") and prompt.endswith("<|im_start|>assistant\n")
        else:  # the tokenizer's BOS, then the prompt
            assert t.token_ids[0] == tok.bos_token_id and prompt.startswith("<s> Add ")
        spans = t.episode.turn_spans
        actions = []
        for a, b in spans:
            end = b - 1 if t.token_ids[b - 1] == tok.eos_token_id else b
            actions.append(tok.span_text(t.token_ids, a, end))
        assert tuple(actions) in seen  # the env got exactly these texts
        expected = prompt
        for k, (a, b) in enumerate(spans):
            expected += tok.span_text(t.token_ids, a, b)
            if k < len(OBSERVATIONS):
                expected += OBSERVATIONS[k]
                nxt = spans[k + 1][0]
                assert tok.span_text(t.token_ids, b, nxt) == OBSERVATIONS[k]
        assert tok.text(t.token_ids) == expected
        shown = render_trajectory(t, tok, color=False)
        assert "[obs 2]\n then keep going" in shown and "café → naïve" in shown


def test_a_training_step_runs_and_changes_the_policy(family):
    name, path = family
    tok, policy, trajs = _episodes(path, n=4)
    preset = get_preset("sao")
    critic = Critic.from_policy(policy)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    learner = Learner(policy, critic, preset, OptimConfig(policy_lr=1e-2, critic_lr=1e-2),
                      pad_id=tok.pad_token_id)
    m = learner.step(trajs)
    assert learner.version == 1 and torch.isfinite(torch.tensor(m["policy/loss"]))
    changed = [k for k, v in policy.state_dict().items() if not torch.equal(v, before[k])]
    assert len(changed) > len(before) // 2, (name, changed)


@pytest.mark.slow
def test_train_with_the_policys_own_tokenizer_end_to_end(family, tmp_path):
    """SFT warm start, value pretraining, the run, its evaluations and the export all use the
    policy directory's tokenizer (its vocabulary is not the shipped one's)."""
    name, path = family
    cfg = load_config(None, [
        f"model.policy={path}", "env.type=model_families:TurnsEnv", "env.num_train_tasks=16",
        "env.call_timeout_s=null",  # in-process: hosted, its calls start a pool of child processes
        "env.num_test_tasks=2", "sft.steps=2", "sft.num_demos=4", "sft.batch_size=2",
        "value_pretrain.rollouts=4", "value_pretrain.steps=2", "value_pretrain.batch_size=2",
        "runtime.backend=inprocess", "rollout.num_workers=1", "rollout.concurrent_episodes=4",
        "rollout.engine.slots=4", "rollout.max_new_tokens=6", "rollout.max_total_tokens=160",
        "trainer.batch_size=2", "trainer.steps=2", "run.eval_every=2", "run.eval_tasks=2",
        "run.samples_every=1", "run.progress=false", f"run.out_dir={tmp_path / 'runs'}",
    ])
    from saorl.training import train

    run_dir, final = train(cfg, tmp_path / "run")
    assert final["step"] == 2
    exported = run_tokenizer(ModelConfig(policy=str(run_dir / "final" / "policy")))
    assert exported.hf.get_vocab() == run_tokenizer(ModelConfig(policy=str(path))).hf.get_vocab()
    sample = (run_dir / "samples" / "step-00000001.txt").read_text()
    assert " then keep going" in sample and "then  keep" not in sample
    if name == "qwen3":
        assert "<|im_start|>assistant" in sample
