"""``openai_agent``: a plain ``openai`` agent driving the episode's loopback endpoint, on the tiny
model's LocalEngine, with the real ``openai`` client (async and sync, streamed and not) over real
HTTP. What is recorded must be exactly what the engine sampled: the trainer's log-probs of the
recorded ids equal the engine's (staleness 0)."""

from __future__ import annotations

import asyncio
import json
import math

import openai
import pytest
import torch

from saorl.agent.loop import EpisodeError, EpisodeTimeout
from saorl.agent.openai_episode import play_agent_episode
from saorl.data.trajectory import Trajectory, training_rows
from saorl.engines.base import GenerationResult, SamplingParams
from saorl.envs.base import Task
from saorl.envs.openai_agent import OpenAIAgentEnv
from saorl.models.codec import RunTokenizer
from saorl.models.logprobs import token_logprobs
from saorl.models.tiny import build_tiny
from saorl.models.tokenizer import load_tokenizer
from saorl.runtime.journal import decode_entry, encode_entry

local = pytest.importorskip("saorl.engines.local")
pytestmark = pytest.mark.timeout(120)

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{{ eos_token }}\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SEEN: dict[str, object] = {}


@pytest.fixture(scope="module")
def tok():
    hf = load_tokenizer()
    hf.chat_template = CHATML
    return RunTokenizer(hf)


def _play(tok, agent, *, engine=None, timeout_s=30.0, task=None, max_total_tokens=192, sampling=None):
    """One episode of ``agent`` (a function of this module) on the tiny model; (trajectory, model)."""
    model = build_tiny("tiny-dense", seed=0)
    own = engine is None
    engine = engine or local.LocalEngine(model, tok, max_batch_size=4, version=0)
    env = OpenAIAgentEnv(agent=f"{__name__}:{agent.__name__}")
    env.call_timeout_s = timeout_s
    try:
        traj = asyncio.run(play_agent_episode(
            engine, env, task or Task("t0", {"question": "2+3="}), tok,
            sampling=sampling or SamplingParams(temperature=1.0, max_new_tokens=8, seed=1),
            max_total_tokens=max_total_tokens))
    finally:
        if own:
            engine.close()
    return traj, model


def _rows_exact(model, traj: Trajectory) -> int:
    """Every row's recorded log-probs equal the trainer's (saorl.models.logprobs) at its action
    tokens; returns the number of rows checked."""
    rows, _ = training_rows([traj], [0])
    for row in rows:
        ids = torch.tensor([row.token_ids])
        with torch.no_grad():
            lp = token_logprobs(model, ids, torch.ones_like(ids))[0]
        at = [t for t, m in enumerate(row.action_mask) if m]
        recorded = torch.tensor([row.rollout_logprobs[t] for t in at])
        torch.testing.assert_close(lp[at], recorded, atol=2e-3, rtol=0)
        assert set(row.versions[t] for t in at) == {0}
        assert row.rewards[at[-1]] == sum(row.rewards)  # the episode's reward on the row's last action token
    return len(rows)


async def two_turns(task, client):
    """Sends the conversation back as received: non-streamed, then streamed."""
    msgs = [{"role": "user", "content": task["question"]}]
    first = await client.chat.completions.create(model="policy", messages=msgs, max_tokens=6)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "and twice that?"}]
    stream = await client.chat.completions.create(model="policy", messages=msgs, max_tokens=6, stream=True,
                                                  stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    SEEN["two_turns"] = (first, chunks)
    return {"reward": 0.75, "success": True, "metrics": {"turns": 2}}


def test_an_agent_sending_its_conversation_back_is_one_token_exact_trajectory(tok):
    engine = local.LocalEngine(build_tiny("tiny-dense", seed=0), tok, max_batch_size=4, version=0)
    try:
        traj, model = _play(tok, two_turns, engine=engine)
        stats = engine.stats()
    finally:
        engine.close()
    # the second call extended the first's KV row; the episode's end freed the row the second left
    assert stats["prefix_hits"] == 1 and stats["prefix_sessions_held"] == stats["prefix_tokens_held"] == 0
    first, chunks = SEEN["two_turns"]
    assert traj.segments == [] and traj.episode.env_metrics == {
        "turns": 2.0, "segments_per_episode": 1.0, "calls_per_episode": 2.0}
    (a1, b1), (a2, b2) = traj.episode.turn_spans
    assert traj.prompt_len == a1 and b1 < a2 and sum(traj.action_mask) == (b1 - a1) + (b2 - a2)
    assert traj.episode.success and traj.rewards[b2 - 1] == 0.75 and sum(traj.rewards) == 0.75
    # the reply the agent read is the text of exactly the ids under action_mask
    assert first.choices[0].message.content == tok.decode(traj.token_ids[a1:b1], skip_special_tokens=True)
    assert first.usage.completion_tokens == b1 - a1 and first.model == "policy"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == tok.decode(traj.token_ids[a2:b2], skip_special_tokens=True)
    assert chunks[-1].usage.completion_tokens == b2 - a2
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    # what lies between the turns is the template's own rendering: closing, user message, header
    between = tok.decode(traj.token_ids[b1:a2])
    assert "<|im_start|>user\nand twice that?" in between and between.endswith("<|im_start|>assistant\n")
    assert _rows_exact(model, traj) == 1


async def sync_client(task, client):
    """The synchronous ``openai.OpenAI`` client, streamed and not, from a thread."""
    def calls() -> list[str]:
        sync = openai.OpenAI(base_url=str(client.base_url), api_key="anything", max_retries=0)
        msgs = [{"role": "user", "content": task["question"]}]
        first = sync.chat.completions.create(model="policy", messages=msgs, max_tokens=5)
        a = first.choices[0].message.content
        msgs += [{"role": "assistant", "content": a}, {"role": "user", "content": "more"}]
        b = "".join(c.choices[0].delta.content or "" for c in sync.chat.completions.create(
            model="policy", messages=msgs, max_tokens=5, stream=True))
        return [a, b]

    SEEN["sync"] = await asyncio.to_thread(calls)
    return 1.0


def test_the_sync_client_streamed_and_not(tok):
    traj, model = _play(tok, sync_client)
    (a1, b1), (a2, b2) = traj.episode.turn_spans
    texts = [tok.decode(traj.token_ids[a:b], skip_special_tokens=True) for a, b in ((a1, b1), (a2, b2))]
    assert SEEN["sync"] == texts
    assert traj.episode.success and traj.segments == []
    assert _rows_exact(model, traj) == 1


async def rewrites_history(task, client):
    """Turn 2 changes the system message: the conversation the model saw is not extended."""
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": task["question"]}]
    first = await client.chat.completions.create(model="policy", messages=msgs, max_tokens=6)
    summary = [{"role": "system", "content": "Summary so far: " + first.choices[0].message.content},
               {"role": "user", "content": "go on"}]
    await client.chat.completions.create(model="policy", messages=summary, max_tokens=6)
    return 1.0


def test_a_rewritten_history_is_two_segments_each_ending_in_the_reward(tok):
    traj, model = _play(tok, rewrites_history)
    assert len(traj.segments) == 1 and traj.episode.env_metrics["segments_per_episode"] == 2.0
    seg = traj.segments[0]
    assert tok.decode(seg.token_ids[:seg.prompt_len]).startswith("<|im_start|>system\nBe brief.")
    assert tok.decode(traj.token_ids[:traj.prompt_len]).startswith("<|im_start|>system\nSummary so far: ")
    back = decode_entry(encode_entry(traj))  # the journal's round trip (and a resume's) keeps the segment
    assert back.segments == traj.segments and back.token_ids == traj.token_ids
    rows, gids = training_rows([back], [7])
    assert len(rows) == 2 and gids == [7, 7] and all(r.segments == [] for r in rows)
    assert [sum(r.rewards) for r in rows] == [1.0, 1.0]
    assert _rows_exact(model, traj) == 2
    # the learner trains on both rows: a step on the episode collates its two segments
    from saorl.algo.registry import get_preset
    from saorl.models.critic import Critic
    from saorl.runtime.learner.single import Learner, OptimConfig

    learner = Learner(model, Critic.from_policy(model), get_preset("sao"), OptimConfig(policy_lr=1e-3),
                      pad_id=0)
    seen = []
    share = learner._step_share
    learner._step_share = lambda trajs, gids: seen.append([len(t) for t in trajs]) or share(trajs, gids)
    before = [p.detach().clone() for p in model.parameters()]
    result = learner.step([traj])
    assert seen == [[len(seg.token_ids), len(traj.token_ids)]]
    assert math.isfinite(result["policy/loss"])
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


async def refused(task, client):
    msgs = [{"role": "user", "content": task["question"]}]
    errors = {}
    asks = (("n", {"n": 2}), ("logit_bias", {"logit_bias": {"5": 10}}), ("model", {"model": "gpt-4o"}),
            ("frequency_penalty", {"tools": [ADD_TOOL], "frequency_penalty": 0.5}))
    for name, extra in asks:
        try:
            await client.chat.completions.create(**{"model": "policy", "messages": msgs, **extra})
        except openai.BadRequestError as e:
            errors[name] = (e.status_code, e.body["message"], e.body["param"])
    SEEN["refused"] = errors
    await client.chat.completions.create(model="policy", messages=msgs, max_tokens=3)
    return 0.0


def test_what_training_cannot_honour_is_refused_with_a_400_and_not_recorded(tok):
    traj, _ = _play(tok, refused)
    errors = SEEN["refused"]
    assert set(errors) == {"n", "logit_bias", "model", "frequency_penalty"}
    assert all(e[0] == 400 for e in errors.values()) and errors["frequency_penalty"][2] == "frequency_penalty"
    assert "one rollout per call" in errors["n"][1] and errors["n"][2] == "n"
    assert "logit_bias" in errors["logit_bias"][1] and errors["logit_bias"][2] == "logit_bias"
    assert "serves 'policy'" in errors["model"][1] and "'gpt-4o'" in errors["model"][1]
    assert traj.episode.turns == 1 and traj.episode.env_metrics["calls_per_episode"] == 1.0


async def raises(task, client):
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}],
                                         max_tokens=2)
    raise KeyError("no such tool")


async def hangs(task, client):
    SEEN["hangs_url"] = str(client.base_url)
    await asyncio.sleep(3600)


async def blocks(task, client):
    import time

    time.sleep(3)  # blocks its own loop, never the worker's


async def waits(task, client):
    await asyncio.sleep(3600)


async def one_call(task, client):
    SEEN.setdefault("urls", []).append(str(client.base_url))
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
    return 1.0


def test_episodes_played_each_in_its_own_loop_leave_no_server_behind(tok):
    """Each asyncio.run's proxy stops listening with its last episode: no entry, no open port."""
    import socket
    from urllib.parse import urlparse

    from saorl.agent.openai_proxy import _PROXIES

    SEEN["urls"] = []
    for i in range(4):
        _play(tok, one_call, engine=_Scripted(tok, ["hi"]), task=Task(f"t{i}", {}))
    assert len(SEEN["urls"]) == 4 and not _PROXIES
    for url in SEEN["urls"]:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", urlparse(url).port), timeout=2).close()

    async def many() -> set[int]:  # one loop, episodes one after the other and side by side
        trajs = [await play_agent_episode(_Scripted(tok, ["a"]), _env(one_call, 30), Task("s", {}), tok,
                                          sampling=SamplingParams(max_new_tokens=4), max_total_tokens=64)]
        trajs += await asyncio.gather(*(play_agent_episode(
            _Scripted(tok, ["b"]), _env(one_call, 30), Task(f"c{i}", {}), tok,
            sampling=SamplingParams(max_new_tokens=4), max_total_tokens=64) for i in range(3)))
        assert all(t.episode.turns == 1 for t in trajs) and not _PROXIES
        return {urlparse(u).port for u in SEEN["urls"][4:]}

    ports = asyncio.run(many())
    assert len(ports) == 2  # the three side by side shared one server


async def leaks(task, client):
    """Leaves a task behind that would call after the episode."""
    async def later():
        try:
            await asyncio.sleep(5)
            await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
            SEEN["leaked"] = "called"
        except asyncio.CancelledError:
            SEEN["leaked"] = "cancelled"
            raise

    SEEN["leak"] = asyncio.ensure_future(later())
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}],
                                         max_tokens=2)
    return 1.0


def test_a_task_the_agent_leaves_behind_is_cancelled_with_its_episode(tok):
    traj, _ = _play(tok, leaks)
    assert SEEN["leaked"] == "cancelled" and traj.episode.turns == 1


def test_an_agent_that_raises_or_hangs_fails_its_rollout_and_late_calls_get_410(tok):
    with pytest.raises(EpisodeError, match=r"openai agent '.*:raises' on task 't0' raised: KeyError"):
        _play(tok, raises)
    import time

    t0 = time.monotonic()
    own_time = r"ran past its deadline of 0.5s of its own time \(env.call_timeout_s; the 0.0s its calls "
    with pytest.raises(EpisodeTimeout, match=own_time):
        _play(tok, hangs, timeout_s=0.5)
    with pytest.raises(EpisodeTimeout):
        _play(tok, blocks, timeout_s=0.5)
    assert time.monotonic() - t0 < 10
    # the hung agent's endpoint, called after its episode ended, while another episode of the loop
    # keeps the server listening: 410; once the loop's last episode has ended, the connection is refused

    async def late() -> openai.APIStatusError:
        from saorl.agent.openai_proxy import _PROXIES

        engine = _Scripted(tok, ["hi"])
        keeper = asyncio.ensure_future(play_agent_episode(
            engine, _env(waits, 30), Task("t2", {}), tok, sampling=SamplingParams(max_new_tokens=4),
            max_total_tokens=64))
        traj_task = asyncio.ensure_future(play_agent_episode(
            engine, _env(hangs, 0.3), Task("t1", {}), tok, sampling=SamplingParams(max_new_tokens=4),
            max_total_tokens=64))
        with pytest.raises(EpisodeTimeout):
            await traj_task
        client = openai.AsyncOpenAI(base_url=SEEN["hangs_url"], api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as info:
            await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
        stranger = openai.AsyncOpenAI(base_url=SEEN["hangs_url"].replace("/ep/", "/ep/0"), api_key="x",
                                      max_retries=0)
        with pytest.raises(openai.NotFoundError, match="no episode with this token"):
            await stranger.models.list()
        keeper.cancel()
        with pytest.raises(asyncio.CancelledError):
            await keeper
        assert asyncio.get_running_loop() not in _PROXIES
        with pytest.raises(openai.APIConnectionError):
            await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
        return info.value

    err = asyncio.run(late())
    assert err.status_code == 410 and "episode has ended" in err.body["message"]


def _env(agent, timeout_s):
    env = OpenAIAgentEnv(agent=f"{__name__}:{agent.__name__}")
    env.call_timeout_s = timeout_s
    return env


class _Scripted:
    """An engine that answers each call with the next text (+ eos), log-prob -0.5 per token."""
    version = 0

    def __init__(self, tok, texts):
        self.tok, self.texts, self.prompts = tok, list(texts), []

    async def agenerate(self, prompt_ids, params):
        self.prompts.append(list(prompt_ids))
        ids = [*self.tok.ids(self.texts.pop(0)), self.tok.eos_token_id]
        return GenerationResult(ids, [-0.5] * len(ids), "stop", [0] * len(ids), self.tok.eos_token_id)


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


ADD_TOOL = {"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"]}}}


async def tool_agent(task, client):
    """A plain tool loop: call, run the tools, send their results back, until an answer."""
    msgs = [{"role": "user", "content": "What is 2+3?"}]
    while True:
        r = await client.chat.completions.create(model="policy", messages=msgs, tools=[ADD_TOOL])
        msg = r.choices[0].message
        SEEN.setdefault("tool_replies", []).append(r.choices[0])
        if not msg.tool_calls:
            return float(msg.content.strip() == "5")
        msgs.append(msg.model_dump(exclude_none=True))
        for call in msg.tool_calls:
            out = add(**json.loads(call.function.arguments))
            msgs.append({"role": "tool", "tool_call_id": call.id, "content": str(out)})


TOOLS_TEMPLATE = (  # a template that takes tools, as Qwen's: the schemas and the calls are its own
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}{{ eos_token }}\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}\n"
    "</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("template, system", [
    (CHATML, "<|im_start|>system\n# Tools"),  # no tools in the template: the system-prompt block
    (TOOLS_TEMPLATE, '<|im_start|>system\n{"type": "function", "function": {"name": "add"'),
])
def test_a_tool_calling_agent_gets_tool_calls_and_its_turns_join(template, system):
    hf = load_tokenizer()
    hf.chat_template = template
    tok = RunTokenizer(hf)
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    engine = _Scripted(tok, [call, "5"])
    SEEN.pop("tool_replies", None)
    traj, _ = _play(tok, tool_agent, engine=engine, max_total_tokens=512)
    first, second = SEEN["tool_replies"]
    assert first.finish_reason == "tool_calls" and first.message.content is None
    (call,) = first.message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
    assert second.message.content == "5" and traj.episode.final_reward == 1.0
    # the tools were rendered by the template, or into the system message when it does not take them;
    # the model's call went back as it wrote it: one segment, the tool's result an observation
    first_prompt = tok.decode(engine.prompts[0])
    assert first_prompt.startswith(system) and first_prompt.count('"name": "add"') == 1
    assert traj.segments == [] and traj.episode.turns == 2
    (_, b1), (a2, _) = traj.episode.turn_spans
    assert "<|im_start|>tool\n5" in tok.decode(traj.token_ids[b1:a2])


def test_the_agent_runs_on_a_vllm_server_engine_too(tok):
    """The rollout engine a client of an (emulated) vLLM server over loopback: the same episode."""
    from saorl.config.engines import VllmEngineConfig
    from saorl.engines.kinds import ClientOptions, server_kind
    from saorl.engines.serve.server import serve_in_thread

    model = build_tiny("tiny-dense", seed=0)
    served = local.LocalEngine(model, tok, max_batch_size=4, version=0)
    srv, url = serve_in_thread(served, tokenizer=tok, emulate="vllm", logprobs_mode="processed_logprobs")
    client = server_kind("vllm").client(VllmEngineConfig(urls=[url]), ClientOptions())
    try:
        traj, _ = _play(tok, two_turns, engine=client)
    finally:
        client.close()
        srv.shutdown()
        served.close()
    assert traj.segments == [] and traj.episode.turns == 2
    assert _rows_exact(model, traj) == 1


def test_the_env_knows_the_tool_call_formats_and_refuses_bad_options():
    from saorl.envs.openai_agent import TOOL_FORMATS
    from saorl.envs.tool_calls import TOOL_CALL_FORMATS

    assert TOOL_FORMATS == TOOL_CALL_FORMATS
    with pytest.raises(ValueError, match=r"tool_format must be one of \[.hermes., .llama3., .json.\], got"):
        OpenAIAgentEnv(agent=f"{__name__}:two_turns", tool_format="qwen")
    with pytest.raises(ValueError, match="agent is required"):
        OpenAIAgentEnv()


async def tool_agent_500(task, client):
    try:
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "2+3?"}],
                                             tools=[ADD_TOOL])
    except openai.InternalServerError as e:
        SEEN["500"] = e.body["message"]
    return 1.0


def test_a_reply_that_fails_to_parse_is_a_500_not_a_dropped_connection(tok, monkeypatch):
    """A failure reading the model's reply (its tool calls) answers the agent with a 500 JSON error,
    records nothing, and fails the episode with it."""
    from saorl.agent.openai_tools import ToolRendering
    from saorl.engines.base import EngineError

    def parse(self, text):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(ToolRendering, "parse", parse)
    SEEN.pop("500", None)
    engine = _Scripted(tok, ['<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'])
    with pytest.raises(EngineError, match="maximum recursion depth"):
        _play(tok, tool_agent_500, engine=engine, max_total_tokens=512)
    assert "saorl failed on this call: RecursionError" in SEEN["500"]


class _Slow(_Scripted):
    """A scripted engine that takes ``delay`` seconds a call, as a loaded CPU's does."""

    def __init__(self, tok, texts, delay):
        super().__init__(tok, texts)
        self.delay = delay

    async def agenerate(self, prompt_ids, params):
        await asyncio.sleep(self.delay)
        return await super().agenerate(prompt_ids, params)


async def three_calls_then_thinks(task, client):
    """Three calls in a row, two of them in parallel, then ``think`` seconds of its own."""
    msgs = [{"role": "user", "content": "x"}]
    await client.chat.completions.create(model="policy", messages=msgs, max_tokens=2)
    await asyncio.gather(*(client.chat.completions.create(model="policy", messages=msgs, max_tokens=2)
                           for _ in range(2)))
    await asyncio.sleep(task["think"])
    return 1.0


def test_the_deadline_counts_the_agent_s_own_time_not_the_time_its_calls_wait_on_the_model(tok):
    """A slow engine (0.6 s a call, 1.2 s of waiting in all: the two parallel calls overlap) does not
    time out an agent whose deadline is 0.8 s and whose own time is ~0.1 s; the same agent taking
    1.0 s of its own is timed out, and the error names the seconds it waited."""
    import time

    def play(think: float):
        return asyncio.run(play_agent_episode(
            _Slow(tok, ["a", "b", "c"], 0.6), _env(three_calls_then_thinks, 0.8), Task("t", {"think": think}),
            tok, sampling=SamplingParams(max_new_tokens=4), max_total_tokens=64))

    t0 = time.monotonic()
    traj = play(0.1)
    assert time.monotonic() - t0 > 1.2 and traj.episode.gen_seconds >= 1.8  # 3 calls of 0.6 s, summed
    assert traj.episode.gen_seconds + traj.episode.env_seconds >= 1.2
    waited = r"deadline of 0.8s of its own time .*the 1\.[2-9]s its calls waited"
    with pytest.raises(EpisodeTimeout, match=waited):
        play(1.0)
