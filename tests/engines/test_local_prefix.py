"""Prefix reuse across turns: a session's next turn prefills only its new tokens, token-exactly."""

import asyncio
import math

import pytest
import torch

from saorl.agent.loop import run_episodes
from saorl.engines import LocalEngine, SamplingParams
from saorl.engines.prefix import ENDED_KEPT, Prefix, PrefixStore
from saorl.envs.synthetic import SyntheticLengthEnv
from saorl.models.tiny import build_tiny

PROMPTS = [[5, 6, 7], list(range(40, 61)), [9], list(range(100, 108)), [300, 301, 302, 303, 304]]
OBS = [[11], [12, 13, 14], [15, 16], [17] * 12, [18]]  # 12: longer than FEED_MAX_TOKENS
TURNS, NEW = 4, [6, 3, 9, 5, 12]


def _episodes(engine, sessions=True):
    """Every prompt as a 4-turn episode, all at once: each turn's context = the previous context +
    its sampled tokens + an observation. Returns per episode the final context and every turn's
    (start, tokens, logprobs, versions). With 3 slots for 5 episodes, turns are admitted into
    running batches: fed by decode steps, or prefilled together with other sessions' rows."""

    async def one(i):
        ctx, turns = list(PROMPTS[i]), []
        for t in range(TURNS):
            sp = SamplingParams(temperature=1.0, max_new_tokens=NEW[(i + t) % len(NEW)], seed=100 * i + t,
                                session=f"ep{i}" if sessions else None)
            r = await engine.agenerate(list(ctx), sp)
            turns.append((len(ctx), r.token_ids, r.logprobs, r.versions))
            ctx += r.token_ids + OBS[(i + t) % len(OBS)]
        return ctx, turns

    async def run():
        return await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))

    return asyncio.run(run())


def _teacher_forced(model, ctx, start, tokens):
    with torch.no_grad():
        logits = model(torch.tensor([ctx])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [float(lp[start - 1 + j, tok]) for j, tok in enumerate(tokens)]


def test_multi_turn_reuse_is_token_exact():
    model = build_tiny("tiny-moe", seed=0)
    reuse = LocalEngine(model, _tok(), max_batch_size=3, stop_on_eos=False)
    full = LocalEngine(build_tiny("tiny-moe", seed=0), _tok(), max_batch_size=3, stop_on_eos=False,
                       prefix_cache_tokens=0)
    try:
        got, ref = _episodes(reuse), _episodes(full)
        s_reuse, s_full = reuse.stats(), full.stats()
    finally:
        reuse.close()
        full.close()
    for (ctx, turns), (ref_ctx, ref_turns) in zip(got, ref):
        assert ctx == ref_ctx  # same seeds, same distributions: the same tokens
        for (start, toks, lps, _), (_, _, ref_lps, _) in zip(turns, ref_turns):
            assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < 1e-4
            assert max(abs(a - b) for a, b in zip(lps, _teacher_forced(model, ctx, start, toks))) < 1e-4
    later = len(PROMPTS) * (TURNS - 1)
    assert s_reuse["prefix_hits"] == later and s_full["prefix_hits"] == 0
    # a later turn prefills its last sampled token (never fed to the model) and the observation
    new_tokens = sum(len(p) for p in PROMPTS) + sum(1 + len(OBS[(i + t) % len(OBS)])
                                                    for i in range(len(PROMPTS)) for t in range(TURNS - 1))
    assert s_reuse["prefill_tokens"] == new_tokens
    # short extensions are fed by decode steps, the 13-token ones and the long first prompt prefilled
    assert 0 < s_reuse["fed_tokens"] < new_tokens - len(PROMPTS[1])
    assert s_full["prefill_tokens"] == sum(start for _, turns in got for start, *_ in turns)
    assert s_reuse["prefix_tokens_reused"] + s_reuse["prefill_tokens"] == s_full["prefill_tokens"]


def test_weight_update_between_turns_recomputes_the_context(tmp_path):
    from safetensors.torch import save_file

    model_b = build_tiny("tiny-moe", seed=1)
    path = tmp_path / "b.safetensors"
    save_file({k: v.contiguous() for k, v in model_b.state_dict().items() if k != "lm_head.weight"}, path)
    eng = LocalEngine(build_tiny("tiny-moe", seed=0), _tok(), max_batch_size=2, stop_on_eos=False,
                      prefix_after_update="recompute")
    ctx = [5, 6, 7, 8]
    try:
        def turn(seed):
            r = eng.generate([list(ctx)], SamplingParams(max_new_tokens=5, seed=seed, session="s"))[0]
            start = len(ctx)
            ctx.extend([*r.token_ids, 20, 21])
            return start, r

        turn(0)
        eng.update_weights(str(path), version=1)
        start, r = turn(1)  # the stored row was computed by version 0: a full prefill with version 1
        assert eng.stats()["prefix_hits"] == 0 and r.versions == [1] * 5
        ref = _teacher_forced(model_b, ctx, start, r.token_ids)
        assert max(abs(a - b) for a, b in zip(r.logprobs, ref)) < 1e-4
        start, r = turn(2)  # computed by version 1 throughout: reused
        assert eng.stats()["prefix_hits"] == 1
        ref = _teacher_forced(model_b, ctx, start, r.token_ids)
        assert max(abs(a - b) for a, b in zip(r.logprobs, ref)) < 1e-4
    finally:
        eng.close()


def test_keep_mode_continues_on_the_older_weights_kv(tmp_path):
    """``prefix_after_update="keep"``: the turn after an update reuses the row computed by the old
    weights; its log-probs are those of the new weights on top of that older context."""
    from safetensors.torch import save_file
    from transformers import DynamicCache

    model_a, model_b = build_tiny("tiny-moe", seed=0), build_tiny("tiny-moe", seed=1)
    path = tmp_path / "b.safetensors"
    save_file({k: v.contiguous() for k, v in model_b.state_dict().items() if k != "lm_head.weight"}, path)
    eng = LocalEngine(build_tiny("tiny-moe", seed=0), _tok(), max_batch_size=2, stop_on_eos=False,
                      prefix_after_update="keep")
    try:
        first = eng.generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=5, seed=0, session="s"))[0]
        eng.update_weights(str(path), version=1)
        ctx = [5, 6, 7, 8, *first.token_ids, 20, 21]
        r = eng.generate([ctx], SamplingParams(max_new_tokens=6, seed=1, session="s"))[0]
        assert eng.stats()["prefix_hits"] == 1 and r.versions == [1] * 6
    finally:
        eng.close()
    kept = 4 + len(first.token_ids) - 1  # the row: the prompt and every sampled token but the last
    full = ctx + r.token_ids
    with torch.no_grad():
        cache = DynamicCache(config=model_a.config)
        model_a(input_ids=torch.tensor([full[:kept]]), cache=cache, use_cache=True)
        logits = model_b(input_ids=torch.tensor([full[kept:]]), cache=cache, use_cache=True,
                         position_ids=torch.arange(kept, len(full))[None]).logits[0]
    lp = torch.log_softmax(logits.float(), -1)
    ref = [float(lp[len(ctx) - 1 - kept + j, t]) for j, t in enumerate(r.token_ids)]
    assert max(abs(a - b) for a, b in zip(r.logprobs, ref)) < 1e-4
    recomputed = _teacher_forced(model_b, full, len(ctx), r.token_ids)
    assert max(abs(a - b) for a, b in zip(r.logprobs, recomputed)) > 1e-3  # it really is the old context


def test_a_prompt_that_does_not_extend_the_session_is_prefilled_in_full():
    model = build_tiny("tiny-dense", seed=0)
    eng = LocalEngine(model, _tok(), max_batch_size=2, stop_on_eos=False)
    try:
        first = eng.generate([[5, 6, 7]], SamplingParams(temperature=0, max_new_tokens=4, session="s"))[0]
        edited = [5, 9, 7, *first.token_ids, 11]  # an earlier token changed
        r = eng.generate([edited], SamplingParams(temperature=0, max_new_tokens=6, session="s"))[0]
        assert eng.stats()["prefix_hits"] == 0
        ref = _teacher_forced(model, edited + r.token_ids, len(edited), r.token_ids)
        assert max(abs(a - b) for a, b in zip(r.logprobs, ref)) < 1e-4
        with pytest.raises(ValueError, match="session"):
            eng.generate([[5]], SamplingParams(session=3))
    finally:
        eng.close()


def test_agent_loop_episodes_reuse_prefixes_and_match_full_prefill():
    env = lambda: SyntheticLengthEnv(mean_turns=3, cv=0.5, max_turns=5)  # noqa: E731
    tasks = env().generate_tasks("train", 6, seed=0)
    out, stats = [], []
    for budget in (65536, 0):
        eng = LocalEngine(build_tiny("tiny-moe", seed=0), _tok(), max_batch_size=4, stop_on_eos=False,
                          prefix_cache_tokens=budget)
        try:
            out.append(asyncio.run(run_episodes(eng, env, tasks, _tok(), concurrency=4,
                                                sampling=SamplingParams(max_new_tokens=8, seed=3),
                                                max_total_tokens=200)))
            stats.append(eng.stats())
        finally:
            eng.close()
    turns = sum(t.episode.turns for t in out[0])
    assert turns > len(tasks) and stats[1]["prefix_hits"] == 0
    assert stats[0]["prefix_sessions_held"] == stats[0]["prefix_tokens_held"] == 0  # every episode ended
    assert stats[0]["prefix_hits"] == turns - len(tasks)  # every turn after the first
    assert stats[0]["prefill_tokens"] < stats[1]["prefill_tokens"] / 2
    for a, b in zip(*out):
        assert a.token_ids == b.token_ids and a.action_mask == b.action_mask
        assert all(math.isclose(x, y, abs_tol=1e-4) for x, y in zip(a.rollout_logprobs, b.rollout_logprobs))


def test_an_ended_session_frees_its_row_and_its_next_request_is_prefilled_in_full():
    eng = LocalEngine(build_tiny("tiny-dense", seed=0), _tok(), max_batch_size=2, stop_on_eos=False)
    try:
        sp = SamplingParams(max_new_tokens=4, seed=0, session="ep")
        first = eng.generate([[5, 6, 7]], sp)[0]
        kept = eng.stats()
        assert kept["prefix_sessions_held"] == 1 and kept["prefix_tokens_held"] == 3 + 4 - 1
        eng.end_session("ep")
        eng.end_session("ep")  # twice, and a session never seen: nothing to drop, no error
        eng.end_session("other")
        assert eng.stats()["prefix_sessions_held"] == eng.stats()["prefix_tokens_held"] == 0
        eng.generate([[5, 6, 7, *first.token_ids, 9]], sp)
        after = eng.stats()
        assert after["prefix_hits"] == 0 and after["prefill_tokens"] == 3 + (3 + 4 + 1)
    finally:
        eng.close()


def test_prefix_store_lru_budget_version_and_match():
    kv = [(torch.zeros(2, 1, 4), torch.zeros(2, 1, 4))]
    store = PrefixStore(10)
    store.keep("a", Prefix([1, 2, 3, 4], kv, 0))
    store.keep("b", Prefix([5, 6, 7], kv, 0))
    assert store.held == 7 and len(store) == 2
    store.keep("c", Prefix([8, 9, 10, 11], kv, 0))  # over budget: the oldest (a) goes
    assert store.held == 7 and store.take("a", [1, 2, 3, 4, 5], 0) is None
    assert store.take("b", [5, 6, 7], 0) is None  # must strictly extend
    assert store.held == 4 and store.take("b", [5, 6, 7, 8], 0) is None  # taken (and dropped) above
    assert store.take("c", [8, 9, 10, 11, 12], 1) is None  # another weights version
    store.keep("d", Prefix([1, 2], kv, 0))
    assert store.take("d", [1, 2, 3], 0).tokens == [1, 2] and store.held == 0
    assert not store.wants("e", 11) and not store.wants(None, 3) and store.wants("e", 10)
    assert not PrefixStore(0).wants("e", 1)
    store.keep("f", Prefix([1, 2, 3], kv, 0))
    assert store.drop("f") and not store.drop("f") and store.held == 0 and len(store) == 0
    store.keep("f", Prefix([1, 2, 3], kv, 0))  # a request still running when its episode ended
    assert store.held == 0 and len(store) == 0
    for i in range(ENDED_KEPT):  # the ended sessions remembered are bounded: the oldest is forgotten
        store.drop(f"old{i}")
    store.keep("f", Prefix([1, 2, 3], kv, 0))
    assert store.held == 3
    with pytest.raises(ValueError, match="prefix_cache_tokens"):
        PrefixStore(-1)


def _tok():
    from saorl.models.tokenizer import load_tokenizer

    return load_tokenizer()
