"""Decode throughput: LocalEngine (continuous batching) vs ``model.generate`` (static batches).

Same tiny-moe model, same prompts, same per-request response lengths, batch size 16, sampling at
temperature 1 (no top-k / top-p), EOS disabled on both sides so every request produces exactly
its assigned number of tokens. Two workloads, measured side by side in one run:

(a) equal lengths: every request generates ``--new-tokens`` tokens;
(b) long-tailed lengths: lognormal with coefficient of variation ≈ 1 (mean ``--new-tokens / 2``,
    clipped to ``[1, 8 × mean]``). ``generate`` runs the requests in batches of 16, in order,
    each batch to its longest request (the shorter rows' extra tokens are wasted work and are not
    counted); the engine refills a finished slot at once.

Throughput = requested (useful) tokens / wall time, including prefill; each side is timed
``--repeats`` times after one discarded warm-up round, interleaved in alternating order, and
the fastest run counts. Prints a Markdown table.

    python benchmarks/bench_engine.py            # 64 prompts × 128 new tokens
    python benchmarks/bench_engine.py --quick    # 32 prompts × 64 new tokens
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from saorl.engines import LocalEngine, SamplingParams
from saorl.models.tiny import build_tiny
from saorl.models.tokenizer import load_tokenizer


def lognormal_lengths(n: int, mean: float, cv: float, cap: int, gen: torch.Generator) -> list[int]:
    """``n`` lengths at the (i + 0.5) / n quantiles of a lognormal (stratified, so the sample's CV
    is close to ``cv`` even for small ``n``), rounded, clipped to ``[1, cap]``, shuffled."""
    sigma = math.sqrt(math.log(1 + cv**2))
    mu = math.log(mean) - sigma**2 / 2
    q = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    draws = torch.exp(mu + sigma * torch.special.ndtri(q))[torch.randperm(n, generator=gen)]
    return [int(min(cap, max(1, round(x)))) for x in draws.tolist()]


def run_generate(model, prompts: list[list[int]], lengths: list[int], batch: int) -> float:
    """Seconds for HF ``generate`` over static batches, each run to its longest request."""
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        ps, n = prompts[i : i + batch], max(lengths[i : i + batch])
        width = max(map(len, ps))
        ids = torch.tensor([[1] * (width - len(p)) + p for p in ps])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=n,
            min_new_tokens=n,
            pad_token_id=1,
            eos_token_id=0,
        )
        assert out.shape[1] == width + n
    return time.perf_counter() - t0


def run_engine(engine: LocalEngine, prompts: list[list[int]], lengths: list[int]) -> float:
    """Seconds for the engine to serve every request (all submitted at once)."""
    params = [SamplingParams(temperature=1.0, max_new_tokens=n, seed=i) for i, n in enumerate(lengths)]
    t0 = time.perf_counter()
    results = engine.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    assert [len(r.token_ids) for r in results] == lengths
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="32 prompts × 64 new tokens")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--repeats", type=int, default=2, help="interleaved repetitions; the fastest of each counts"
    )
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.new_tokens = 32, 64
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    model, tok = build_tiny("tiny-moe"), load_tokenizer()
    prompts = [
        torch.randint(2, 1024, (int(torch.randint(8, 33, (), generator=gen)),), generator=gen).tolist()
        for _ in range(args.prompts)
    ]
    mean = args.new_tokens / 2
    tails = lognormal_lengths(args.prompts, mean, 1.0, int(8 * mean), gen)
    workloads = {"(a) equal lengths": [args.new_tokens] * args.prompts, "(b) lognormal, CV≈1": tails}
    engine = LocalEngine(model, tok, max_batch_size=args.batch_size, stop_on_eos=False)
    tl = torch.tensor(tails, dtype=torch.float64)
    print(
        f"tiny-moe, batch {args.batch_size}, {args.prompts} prompts, {args.threads} threads, "
        f"best of {args.repeats}; lognormal lengths: mean {tl.mean():.1f}, "
        f"CV {tl.std() / tl.mean():.2f}, max {int(tl.max())}\n"
    )
    print("| workload | tokens | generate tok/s | LocalEngine tok/s | ratio | engine slot utilisation |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, lengths in workloads.items():
        t_gen, t_eng, steps, busy = math.inf, math.inf, 0, 0
        # one discarded warm-up round (first use of each shape is slow on CPU), then interleaved
        # rounds in alternating order, so drifting machine load hits both sides alike
        for rep in range(args.repeats + 1):
            for side in ("gen", "eng") if rep % 2 else ("eng", "gen"):
                if side == "gen":
                    with torch.inference_mode():
                        t = run_generate(model, prompts, lengths, args.batch_size)
                    t_gen = min(t_gen, t) if rep else t_gen
                    continue
                before = engine.stats()
                t = run_engine(engine, prompts, lengths)
                after = engine.stats()
                if rep:
                    t_eng = min(t_eng, t)
                    steps += after["decode_steps"] - before["decode_steps"]
                    busy += after["busy_slot_steps"] - before["busy_slot_steps"]
        util = busy / max(1, steps * args.batch_size)
        n = sum(lengths)
        print(f"| {name} | {n} | {n / t_gen:.0f} | {n / t_eng:.0f} | {t_gen / t_eng:.2f}× | {util:.2f} |")
    engine.close()


if __name__ == "__main__":
    main()
