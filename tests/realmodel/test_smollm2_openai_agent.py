"""``openai_agent`` on SmolLM2-135M-Instruct: a plain ``openai`` agent's calls through the episode's
endpoint, its own chat template (eos ``<|im_end|>``), and the token exactness of the recorded ids:
the trainer's log-probs of every row equal the engine's at staleness 0."""

import asyncio
import time

import torch

from saorl.agent.openai_episode import play_agent_episode
from saorl.data.trajectory import training_rows
from saorl.engines.base import SamplingParams
from saorl.engines.local import LocalEngine
from saorl.envs.base import Task
from saorl.envs.openai_agent import OpenAIAgentEnv
from saorl.models.codec import TokenizerSpec
from saorl.models.loading import load_policy
from saorl.models.logprobs import token_logprobs


async def keeps_then_rewrites(task, client):
    """Two calls on one conversation sent back as received, then a third on a rewritten one."""
    msgs = [{"role": "user", "content": task["question"]}]
    for follow_up in ("Are you sure?", None):
        reply = await client.chat.completions.create(model="policy", messages=msgs, max_tokens=8)
        msgs.append({"role": "assistant", "content": reply.choices[0].message.content})
        if follow_up:
            msgs.append({"role": "user", "content": follow_up})
    summary = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say 5."}]
    await client.chat.completions.create(model="policy", messages=summary, max_tokens=6, stream=True)
    return 1.0


def test_openai_agent_on_smollm2_is_token_exact(smollm2):
    t0 = time.monotonic()
    tok = TokenizerSpec(str(smollm2)).load()
    model = load_policy(str(smollm2), seed=0, device="cpu", dtype="float32")
    engine = LocalEngine(model, tok, max_batch_size=2, version=0, pack_weights=False)
    env = OpenAIAgentEnv(agent=f"{__name__}:keeps_then_rewrites")
    env.call_timeout_s = 300
    try:
        traj = asyncio.run(play_agent_episode(
            engine, env, Task("t0", {"question": "What is 2+3?"}), tok,
            sampling=SamplingParams(temperature=1.0, max_new_tokens=8, seed=3), max_total_tokens=256))
    finally:
        engine.close()
    rows, _ = training_rows([traj], [0])
    # the first conversation joins (2 calls, one row), the rewritten one is a segment of its own
    assert traj.episode.env_metrics["calls_per_episode"] == 3.0
    assert traj.episode.env_metrics["segments_per_episode"] == 2.0 and len(rows) == 2
    assert [sum(1 for a, b in zip(r.action_mask, r.action_mask[1:]) if b > a) for r in rows] == [2, 1]
    for row in rows:
        ids = torch.tensor([row.token_ids])
        with torch.no_grad():
            lp = token_logprobs(model, ids, torch.ones_like(ids))[0]
        at = [t for t, m in enumerate(row.action_mask) if m]
        recorded = torch.tensor([row.rollout_logprobs[t] for t in at])
        torch.testing.assert_close(lp[at], recorded, atol=2e-3, rtol=0)
        assert row.rewards[at[-1]] == 1.0
    print(f"\n[realmodel] openai_agent on SmolLM2: {time.monotonic() - t0:.1f}s", flush=True)
