"""How often a real vLLM server's top-p set differs from the trainer's by float round-off alone.

Starts a vLLM 0.32.0 CPU server (the real-engine tests' helper, ``tests/vllm/server.py``: the
vLLM environment is made on first use) on the tiny dense policy, sends ``--requests`` requests of
the weight check's prompt (32 new tokens, temperature 0.9, top-p 0.95, one seed each), and
compares each sampled token's log-prob with the trainer's
(:func:`saorl.models.logprobs.token_logprobs` under the same temperature and top-p). Prints the
positions over 1e-5 with their nucleus edge, and a Markdown table: positions, positions off, the
largest gap with and without the positions :func:`saorl.models.truncation.edge_rows` leaves out.

    python benchmarks/bench_vllm_topp_edges.py                 # 2500 requests, ~6 min here
    python benchmarks/bench_vllm_topp_edges.py --requests 300
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parents[1] / "tests"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2500)
    ap.add_argument("--temperature", type=float, default=0.9)
    ap.add_argument("--top-p", type=float, default=0.95)
    args = ap.parse_args()
    sys.path[:0] = [str(TESTS / "vllm"), str(TESTS / "runtime")]
    from server import VllmServer, ensure_venv

    from saorl.engines.base import SamplingParams
    from saorl.engines.clients.vllm_client import VllmEngine
    from saorl.models.logprobs import token_logprobs
    from saorl.models.serialize import export_policy, quiet_progress
    from saorl.models.tiny import build_tiny
    from saorl.models.tokenizer import load_tokenizer
    from saorl.models.truncation import edge_rows

    tok, model = load_tokenizer(), build_tiny("tiny-dense", seed=0).eval()
    t, p = args.temperature, args.top_p
    with tempfile.TemporaryDirectory() as tmp:
        with quiet_progress():
            model_dir = export_policy(model, tok, Path(tmp) / "model")
        server = VllmServer(ensure_venv(), model_dir, Path(tmp) / "vllm.log").start()
        try:
            prompt = list(tok.encode("The weight check compares the server with the trainer:"))
            engine = VllmEngine([server.url], model="policy")
            params = SamplingParams(max_new_tokens=32, temperature=t, top_p=p)
            results = []
            for start in range(0, args.requests, 250):  # 250 in flight at a time
                results += engine.generate([prompt] * min(250, args.requests - start), params)
            engine.close()
        finally:
            server.stop()
    positions = off = 0
    worst = worst_kept = 0.0
    for res in results:
        ids = torch.tensor([prompt + res.token_ids])
        with torch.no_grad():
            mine = token_logprobs(model, ids, torch.ones_like(ids), temperature=t, top_p=p)[0, len(prompt):]
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / t
        gaps = (torch.tensor(res.logprobs) - mine).abs()
        edge = edge_rows(logits, 0, p)
        positions += len(gaps)
        worst, worst_kept = max(worst, float(gaps.max())), max(worst_kept, float(gaps[~edge].max()))
        for i in torch.nonzero(gaps > 1e-5).flatten().tolist():
            off += 1
            probs = torch.softmax(logits[i], -1).sort(descending=True).values
            before = torch.cumsum(probs, 0) - probs
            kept = int((before < p).sum())
            print(f"gap {float(gaps[i]):.3g}: the trainer keeps {kept} tokens, mass before the last kept "
                  f"{float(before[kept - 1]):.9f}, before the first dropped {float(before[kept]):.9f} "
                  f"(top_p {p}); left out as an edge: {bool(edge[i])}")
    print("\n| requests | positions | positions off by > 1e-5 | largest gap | largest gap, edges left out |")
    print("|---|---|---|---|---|")
    print(f"| {len(results)} | {positions} | {off} | {worst:.3g} | {worst_kept:.3g} |")


if __name__ == "__main__":
    main()
