"""The agent loop with the real LocalEngine and the tiny model, on a tiny env of our own.

The check that ties ids, masks and logprobs together: a teacher-forced forward pass of the
same model over ``traj.token_ids`` gives, at every action position, the logprob the engine
recorded at sampling time (temperature 1, no top-k/p). A single shifted or re-tokenized id
would break it.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from saorl.agent import render_trajectory, run_episodes
from saorl.engines.base import SamplingParams
from saorl.envs.base import Env, StepResult, Task
from saorl.models.tiny import build_tiny

local = pytest.importorskip("saorl.engines.local",
                            reason="saorl.engines.local (LocalEngine) is not importable")


class EchoCountEnv(Env):
    """Prompt 'count N:'; each turn answers how many characters the action had; done after 2 turns."""

    name = "echo_count"
    stop_strings = ("e",)  # common in random text, so some turns end on a stop string
    max_turns = 3

    def generate_tasks(self, split, n, seed):
        return [Task(f"{split}-{i}", {"n": i}) for i in range(n)]

    def reset(self, task, progress=None):
        self.turn = 0
        return f"count {task.data['n']}:"

    def step(self, action):
        self.turn += 1
        return StepResult(f"\n[{len(action)} chars]\n", reward=float(len(action) % 3 == 0),
                          done=self.turn >= 2, info={"success": self.turn >= 2})


class Recording:
    """Passes requests to the engine and records (prompt, result)."""

    def __init__(self, engine):
        self.engine = engine
        self.calls = []

    @property
    def version(self):
        return self.engine.version

    async def agenerate(self, prompt_ids, params):
        res = await self.engine.agenerate(prompt_ids, params)
        self.calls.append((list(prompt_ids), res))
        return res


@pytest.mark.slow  # ~3-4 s on a shared 2-core machine
@pytest.mark.timeout(120)
def test_episodes_with_local_engine_are_token_exact(tok):
    model = build_tiny("tiny-dense", seed=0)
    engine = local.LocalEngine(model, tok, max_batch_size=4, version=3)
    rec = Recording(engine)
    try:
        tasks = EchoCountEnv().generate_tasks("test", 4, 0)
        sp = SamplingParams(temperature=1.0, max_new_tokens=8, seed=1)
        trajs = asyncio.run(run_episodes(rec, EchoCountEnv, tasks, tok, concurrency=4, sampling=sp,
                                         max_total_tokens=48))
    finally:
        engine.close()
    assert [t.task_id for t in trajs] == [t.id for t in tasks]
    by_prompt = {tuple(p): r for p, r in rec.calls}
    reasons = {r for t in trajs for r in t.episode.finish_reasons}
    assert reasons <= {"stop", "length"}
    for traj in trajs:
        traj.validate()
        assert len(traj) <= 48 and traj.episode.turns >= 1
        assert traj.truncated == (traj.episode.turns < 2)
        # rebuild each request's prompt from the trajectory: the engine saw exactly these ids
        # and returned exactly the ids that sit under action_mask
        for a, b in traj.episode.turn_spans:
            res = by_prompt[tuple(traj.token_ids[:a])]
            assert traj.token_ids[a:b] == res.token_ids
            assert traj.rollout_logprobs[a:b] == res.logprobs
            assert set(traj.versions[a:b]) == {3}
        assert sum(traj.action_mask) == sum(b - a for a, b in traj.episode.turn_spans)
        with torch.no_grad():
            logits = model(torch.tensor([traj.token_ids])).logits[0].float()
        lp = torch.log_softmax(logits, -1)
        at = [t for t, m in enumerate(traj.action_mask) if m]
        teacher = lp[[t - 1 for t in at], [traj.token_ids[t] for t in at]]
        recorded = torch.tensor([traj.rollout_logprobs[t] for t in at])
        torch.testing.assert_close(teacher, recorded, atol=2e-3, rtol=0)
        head = render_trajectory(traj, tok, color=False).splitlines()[0]
        assert head.startswith(f"== task {traj.task_id} | env echo_count")


class ChatEchoCountEnv(EchoCountEnv):
    """EchoCountEnv whose own default is observations as chat turns."""

    observation_format = "chat"


@pytest.mark.slow  # ~3 s on a shared 2-core machine
@pytest.mark.timeout(120)
def test_chat_observations_with_local_engine_are_token_exact():
    from saorl.models.codec import RunTokenizer
    from saorl.models.tokenizer import load_tokenizer

    hf = load_tokenizer()
    hf.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{{ eos_token }}\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = RunTokenizer(hf)
    model = build_tiny("tiny-dense", seed=0)
    engine = local.LocalEngine(model, tok, max_batch_size=4, version=3)
    try:
        tasks = ChatEchoCountEnv().generate_tasks("test", 4, 0)
        sp = SamplingParams(temperature=1.0, max_new_tokens=8, seed=1)
        trajs = asyncio.run(run_episodes(engine, ChatEchoCountEnv, tasks, tok, concurrency=4, sampling=sp,
                                         max_total_tokens=160))
    finally:
        engine.close()
    assert any(t.episode.turns == 2 for t in trajs)
    for traj in trajs:
        traj.validate()
        (a1, b1), *rest = traj.episode.turn_spans
        if rest:  # the context between the turns: closing, the tool message, the next header
            eos = traj.token_ids[b1 - 1] == tok.eos_token_id
            action = tok.span_text(traj.token_ids, a1, b1 - eos)
            closing = "\n" if eos else "<|endoftext|>\n"  # a sampled eos is the closing's own
            assert tok.span_text(traj.token_ids, b1, rest[0][0]) == (
                f"{closing}<|im_start|>tool\n\n[{len(action)} chars]\n<|endoftext|>\n<|im_start|>assistant\n")
            assert set(traj.action_mask[b1:rest[0][0]]) == {0}
        with torch.no_grad():
            logits = model(torch.tensor([traj.token_ids])).logits[0].float()
        lp = torch.log_softmax(logits, -1)
        at = [t for t, m in enumerate(traj.action_mask) if m]
        teacher = lp[[t - 1 for t in at], [traj.token_ids[t] for t in at]]
        torch.testing.assert_close(teacher, torch.tensor([traj.rollout_logprobs[t] for t in at]),
                                   atol=2e-3, rtol=0)
