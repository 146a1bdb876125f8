"""A model with sliding-window layers (Gemma 3's 5 local : 1 global) in the local engine: its cache
keeps every key in full-attention layers and the model's mask applies the window, so what the
engine samples and scores is what a plain forward of the whole sequence gives, with the window
binding (4 tokens here), across continuous batching and prefix reuse between turns."""

import asyncio

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from saorl.engines import LocalEngine, SamplingParams
from saorl.models.tokenizer import load_tokenizer

WINDOW = 4
PROMPTS = [[5, 6, 7], list(range(40, 61)), [9], list(range(100, 108)), [300, 301, 302, 303, 304]]
OBS = [[11] * 12, [12] * 20, [15] * 16, [17] * 12, [18] * 30]  # more than FEED_MAX_TOKENS: prefilled
TURNS, NEW = 3, [6, 3, 9, 5, 12]


def tiny_gemma3(seed: int = 0) -> Gemma3ForCausalLM:
    cfg = Gemma3TextConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=WINDOW,
                           layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                           max_position_embeddings=512, tie_word_embeddings=True)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Gemma3ForCausalLM(cfg)
    return model.eval()


def _episodes(engine):
    """Every prompt as a 3-turn episode, turn by turn: each turn's requests all at once, so the
    sessions' next turns (stored rows extended by 13 to 31 new tokens) are admitted together."""
    ctxs = [list(p) for p in PROMPTS]
    turns = [[] for _ in PROMPTS]

    async def one(i, t):
        sp = SamplingParams(temperature=1.0, max_new_tokens=NEW[(i + t) % len(NEW)], seed=100 * i + t,
                            session=f"ep{i}")
        r = await engine.agenerate(list(ctxs[i]), sp)
        turns[i].append((len(ctxs[i]), r.token_ids, r.logprobs))
        ctxs[i] += r.token_ids + OBS[(i + t) % len(OBS)]

    async def run():
        for t in range(TURNS):
            await asyncio.gather(*(one(i, t) for i in range(len(PROMPTS))))

    asyncio.run(run())
    return list(zip(ctxs, turns))


def _teacher_forced(model, ctx, start, tokens):
    with torch.no_grad():
        logits = model(torch.tensor([ctx])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [float(lp[start - 1 + j, tok]) for j, tok in enumerate(tokens)]


def _worst(model, grouped=True):
    engine = LocalEngine(model, load_tokenizer(), max_batch_size=len(PROMPTS), stop_on_eos=False)
    if not grouped:
        engine._window = None  # as a model without a window: one left-padded prefill forward
    try:
        got = _episodes(engine)
        stats = engine.stats()
    finally:
        engine.close()
    assert stats["prefix_hits"] == len(PROMPTS) * (TURNS - 1)
    assert all(len(ctx) > 3 * WINDOW for ctx, _ in got)  # the window binds
    errors = [abs(a - b) for ctx, turns in got for start, toks, lps in turns
              for a, b in zip(lps, _teacher_forced(model, ctx, start, toks))]
    return max(errors), stats, got


def test_sliding_window_layers_sample_and_score_as_a_plain_forward():
    model = tiny_gemma3()
    worst, stats, got = _worst(model)
    assert worst < 1e-4
    # the sessions' later turns extend their prefixes by different counts: a forward per count
    assert stats["prefill_batches"] > TURNS
    ungrouped, stats, _ = _worst(model, grouped=False)
    assert stats["prefill_batches"] == TURNS and ungrouped > 1e-3  # what grouping avoids
    wide = tiny_gemma3()
    wide.config.sliding_window = 10**4  # the same weights, no window
    ctx, ((start, toks, lps), *_) = got[1]
    assert max(abs(a - b) for a, b in zip(lps, _teacher_forced(wide, ctx, start, toks))) > 1e-3
