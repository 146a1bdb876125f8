"""Publishing a LoRA policy's adapter vs its full weights, on the tiny models (or a model directory).

For each policy: the bytes one published version takes in ``RUN/weights`` and the median time to
publish it (:class:`saorl.runtime.weights.files.FilePublisher`: written atomically, then
``latest.json``) and to load it into a local engine (``LocalEngine.update_weights``: the full
state dict copied in, or base + adapter merged), ``--repeats`` times each after one warm-up,
full and adapter in turn (the disk's writeback of one slows the other's fsync otherwise).
The adapter is the default one of ``model.lora`` (rank ``--rank``, alpha 16, the attention and
MLP projections the policy has). Prints a Markdown table.

    python benchmarks/bench_lora_publish.py                       # tiny-dense and tiny-moe, rank 8
    python benchmarks/bench_lora_publish.py --policy DIR --rank 16 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from saorl.config.sections import LORA_TARGETS
from saorl.engines.local import LocalEngine
from saorl.models.loading import load_policy
from saorl.models.lora import adapter_config, adapter_state, attach_lora
from saorl.models.tokenizer import load_tokenizer
from saorl.runtime.weights.files import FilePublisher, FileSource, WeightNames


def _size(path: Path) -> int:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files)


def _interleaved(fns: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Median seconds of each of ``fns``, run in turn (so the disk's writeback hits them alike)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(repeats + 1):  # round 0: warm-up
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if i:
                times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def measure(spec: str, rank: int, repeats: int) -> dict[str, float]:
    tok = load_tokenizer()
    full_state = {k: v.detach() for k, v in load_policy(spec).state_dict().items()}
    lora = attach_lora(load_policy(spec), rank=rank, alpha=16.0, dropout=0.0, targets=list(LORA_TARGETS),
                       optional=LORA_TARGETS)
    with torch.no_grad():  # a trained-looking adapter (B is zero at init)
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.02)
    tensors, config = adapter_state(lora), adapter_config(lora)
    out: dict[str, float] = {"params_full": sum(v.numel() for v in full_state.values()),
                             "params_adapter": sum(v.numel() for v in tensors.values())}
    engine = LocalEngine(load_policy(spec), tok, max_batch_size=1)
    try:
        with tempfile.TemporaryDirectory() as d:
            full, adapter = FilePublisher(Path(d) / "full"), FilePublisher(Path(d) / "adapter")
            version = [0]

            def publish(kind: str) -> None:
                version[0] += 1
                if kind == "full":
                    full.publish([full_state], version[0])
                else:
                    adapter.publish([tensors], version[0], WeightNames.adapter(config))

            took = _interleaved({k: (lambda k=k: publish(k)) for k in ("full", "adapter")}, repeats)
            sources = {"full": FileSource(full.dir).latest(), "adapter": FileSource(adapter.dir).latest()}
            loads = _interleaved({k: (lambda s=s: engine.update_weights(s[1], s[0]))
                                  for k, s in sources.items()}, repeats)
            for k, (_, source) in sources.items():
                out[f"bytes_{k}"] = _size(Path(source))
                out[f"publish_s_{k}"], out[f"load_s_{k}"] = took[k], loads[k]
    finally:
        engine.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policy", action="append", help="tiny kind or model directory (repeatable)")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(1)
    print("| policy | tensor elements per version (full / adapter) | bytes per version (full / adapter) "
          "| publish, median (full / adapter) | engine load, median (full / adapter) |")
    print("|---|---|---|---|---|")
    for spec in args.policy or ["tiny-dense", "tiny-moe"]:
        m = measure(spec, args.rank, args.repeats)
        print(f"| {spec} (rank {args.rank}) | {m['params_full']:,} / {m['params_adapter']:,} | "
              f"{m['bytes_full']:,} / {m['bytes_adapter']:,} ({m['bytes_full'] / m['bytes_adapter']:.0f}×) | "
              f"{m['publish_s_full'] * 1e3:.1f} ms / {m['publish_s_adapter'] * 1e3:.1f} ms | "
              f"{m['load_s_full'] * 1e3:.1f} ms / {m['load_s_adapter'] * 1e3:.1f} ms |")


if __name__ == "__main__":
    main()
