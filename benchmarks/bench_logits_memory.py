"""Peak memory and time of one scoring pass (forward + backward of the token log-probs) of a real
model, with the vocabulary projection in chunks or whole (saorl.models.logprobs).

    python benchmarks/bench_logits_memory.py plain MODEL_DIR 400
    python benchmarks/bench_logits_memory.py chunked MODEL_DIR 400

Each run is its own process (peak RSS is per process); the batch is 8 random rows of N tokens.
"""
import resource
import sys
import time

import torch
from transformers import AutoModelForCausalLM

import saorl.models.logprobs as lp


def main(mode: str, model_dir: str, n: int) -> None:
    torch.set_num_threads(1)
    lp.CHUNK_ABOVE_BYTES = 10**15 if mode == "plain" else 0
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (8, n))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    lp.token_logprobs(model, ids, torch.ones_like(ids)).sum().backward()
    dt = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"{mode}: 8x{n} positions fwd+bwd {dt:.1f} s, peak RSS {peak / 1024:.0f} MB "
          f"(+{(peak - base) / 1024:.0f} MB over the loaded model)")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
