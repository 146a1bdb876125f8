"""benchmarks/bench_lora.py measures what it says: its counts and bytes against the model's own shapes."""

import pytest
from bench_scripts import load_benchmark
from torch import nn

from saorl.models.tiny import build_tiny


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_lora")


def _lora_params(model: nn.Module, rank: int) -> int:
    """rank × (in + out) over the linear modules the default targets name (all but lm_head)."""
    return sum(rank * (m.in_features + m.out_features) for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and not name.endswith("lm_head"))


def test_counts_optimizer_bytes_and_publication(bench):
    m = bench.measure("tiny-dense", steps=1, publishes=1, batch=2)
    model = build_tiny("tiny-dense", seed=0)
    params = sum(p.numel() for p in model.parameters())
    tensors = len(list(model.parameters()))
    assert m["full"]["params"] == m["full"]["model_params"] == params
    assert m["LoRA r8"]["params"] == _lora_params(model, 8) == 77_824
    assert m["LoRA r16"]["params"] == 2 * m["LoRA r8"]["params"]
    # AdamW: exp_avg and exp_avg_sq in float32 per parameter, one float32 step per tensor
    assert m["full"]["opt_bytes"] == 8 * params + 4 * tensors
    lora_tensors = 2 * sum(isinstance(x, nn.Linear) and not n.endswith("lm_head")
                           for n, x in model.named_modules())
    assert m["LoRA r8"]["opt_bytes"] == 8 * 77_824 + 4 * lora_tensors
    # a version: the float32 weights (the tied head stored too) vs the adapter's float32 tensors
    assert m["full"]["publish_bytes"] > 4 * params
    sizes = [m[v]["publish_bytes"] for v in ("LoRA r8", "LoRA r16", "full")]
    assert 4 * 77_824 < sizes[0] < sizes[1] < sizes[2]
    for v in m.values():
        assert v["step_s"] > 0 and v["publish_s"] > 0


def test_main_prints_one_row_per_policy(bench, capsys):
    assert bench.main(["--models", "tiny-moe", "--steps", "1", "--publishes", "1", "--batch", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| model (parameters) | policy |")
    assert [r.split("|")[2].strip() for r in rows[1:]] == ["full", "LoRA r8", "LoRA r16"]
    assert rows[1].split("|")[1].strip() == "tiny-moe (1.9M)"
    assert "(68× fewer)" in rows[2]  # 8,153,424 bytes of full weights vs the rank-8 adapter's


def test_unknown_model_is_refused(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--models", "tiny-big"])
    err = capsys.readouterr().err
    assert "--models: unknown tiny-big; choose from tiny-dense, tiny-moe, qwen3-h512" in err
