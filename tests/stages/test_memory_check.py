"""The start-up memory check: the estimate's parts from the model's parameter count, what each
setting changes, the paragraph when the machine is short, and a refusal only past its whole memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from saorl.config import load_config
from saorl.config.sections import LORA_TARGETS
from saorl.errors import StartupError
from saorl.models.loading import meta_policy
from saorl.models.tiny import build_tiny
from saorl.stages.memory_check import (
    BASE_MIB,
    MIB,
    SLACK,
    check_memory,
    estimate_memory,
    meminfo,
    size,
)


def _cfg(*overrides: str):
    return load_config(None, ["model.policy=tiny-dense", "trainer.batch_size=4",
                              "rollout.max_total_tokens=64", *overrides])


def test_the_parts_are_the_parameter_count_times_bytes():
    cfg = _cfg()
    n = sum(p.numel() for p in meta_policy("tiny-dense").parameters())
    est = estimate_memory(cfg)
    assert est.trainer["base"] == BASE_MIB
    assert est.trainer["policy"] == pytest.approx(n * 4 / MIB)
    assert est.trainer["policy AdamW moments"] == pytest.approx(2 * n * 4 / MIB)
    assert est.trainer["policy gradients"] == pytest.approx(n * 4 / MIB)
    critic = est.trainer["critic AdamW moments and gradients"]
    assert 0 < critic < 3 * est.trainer["critic"]  # frozen attention: the MLP projections train
    # the worker packs its linear weights in place (rollout.engine.pack_in_place): the model keeps
    # the rest, the tied vocabulary projection included
    model = meta_policy("tiny-dense")
    linear = sum(m.weight.numel() for m in model.modules() if type(m) is torch.nn.Linear)
    released = linear - model.get_output_embeddings().weight.numel()
    assert est.workers == 1 and est.worker["engine's model"] == pytest.approx((n - released) * 4 / MIB)
    assert est.worker["packed copy"] == pytest.approx(linear * 4 / MIB)
    beside = estimate_memory(_cfg("rollout.engine.pack_in_place=false"))
    assert beside.worker["engine's model"] == pytest.approx(n * 4 / MIB)
    assert beside.worker["packed copy"] == est.worker["packed copy"]
    assert est.trainer_mib == pytest.approx(SLACK * sum(est.trainer.values()))
    assert est.total_mib == pytest.approx(est.trainer_mib + est.worker_mib)


def test_each_setting_changes_the_part_it_should():
    base = estimate_memory(_cfg())
    lora = estimate_memory(_cfg("model.lora.rank=8"))
    assert lora.trainer["policy AdamW moments"] == 0 == lora.trainer["policy gradients"]
    # a LoRA worker keeps the base of the adapted weights: the attention and MLP projections by default
    key = "the adapted weights' base (LoRA)"
    assert key not in base.worker
    adapted = sum(m.weight.numel() for n, m in build_tiny("tiny-dense").named_modules()
                  if isinstance(m, torch.nn.Linear) and n.split(".")[-1] in LORA_TARGETS)
    assert lora.worker[key] == pytest.approx(adapted * 4 / MIB)
    q_only = estimate_memory(_cfg("model.lora.rank=8", "model.lora.target_modules=[q_proj]"))
    assert 0 < q_only.worker[key] < lora.worker[key]
    grpo = estimate_memory(_cfg("algo.name=grpo", "trainer.batch_size=8"))
    assert "critic" not in grpo.trainer and grpo.trainer["policy"] == base.trainer["policy"]
    ckpt = estimate_memory(_cfg("trainer.activation_checkpointing=true"))
    assert ckpt.trainer["a pass's activations"] < base.trainer["a pass's activations"]
    unpacked = estimate_memory(_cfg("rollout.engine.pack_weights=false"))
    assert "packed copy" not in unpacked.worker
    assert estimate_memory(_cfg("rollout.num_workers=3")).total_mib == pytest.approx(
        base.trainer_mib + 3 * base.worker_mib)
    inproc = estimate_memory(_cfg("runtime.backend=inprocess"))
    assert inproc.workers == 0 and inproc.trainer["engine: engine's model"] == base.worker["engine's model"]
    assert estimate_memory(_cfg("model.device=cuda")) is None  # a GPU's memory is not estimated


def test_enough_memory_is_silent_and_too_little_is_one_paragraph():
    cfg = _cfg()
    est = estimate_memory(cfg)
    said: list[str] = []
    plenty = {"MemAvailable": est.total_mib + 100, "MemTotal": 10 * est.total_mib}
    assert check_memory(cfg, said.append, plenty) is not None and said == []
    short = {"MemAvailable": est.total_mib / 2, "MemTotal": 10 * est.total_mib}
    check_memory(cfg, said.append, short)
    assert len(said) == 1 and "\n" not in said[0]
    text = said[0]
    assert f"need {size(est.total_mib)} at its peak" in text
    assert f"{size(short['MemAvailable'])} available" in text
    assert "trainer.activation_checkpointing=true" in text and "rollout.engine.pack_weights=false" in text
    assert "model.lora.rank=8" in text
    assert "trainer.max_tokens_per_microbatch" not in text  # 4 x 64 tokens: already a small pass
    said.clear()
    check_memory(_cfg("run.memory_check=skip"), said.append, short)
    assert said == []


def test_the_start_stops_only_past_the_whole_memory_unless_told_to_warn():
    cfg = _cfg()
    est = estimate_memory(cfg)
    tiny = {"MemAvailable": est.total_mib / 4, "MemTotal": est.total_mib / 2}
    with pytest.raises(StartupError, match=r"cannot fit.*run\.memory_check=warn"):
        check_memory(cfg, print, tiny)
    said: list[str] = []
    check_memory(_cfg("run.memory_check=warn"), said.append, tiny)
    assert len(said) == 1 and "cannot fit" not in said[0]


def test_sizes_read_in_gb_from_a_gib_up():
    assert (size(5632), size(300.4)) == ("5.5 GB", "300 MiB")


def test_meminfo_reads_kib_lines_as_mib(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       24680448 kB\nMemAvailable:    2048000 kB\nHugePages_Total:       0\n")
    assert meminfo(f) == {"MemTotal": 24680448 / 1024, "MemAvailable": 2000.0}
    assert meminfo(tmp_path / "none") == {}


def test_a_bad_mode_fails_at_load():
    with pytest.raises(Exception, match="memory_check"):
        _cfg("run.memory_check=maybe")


SMOLLM2 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
           "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True,
           "max_position_embeddings": 8192, "rms_norm_eps": 1e-5}
"""SmolLM2-135M-Instruct's sizes (its config.json), so the estimate is built without its weights."""


def test_the_estimate_is_near_what_the_sums_recipe_measured(tmp_path):
    # docs/performance.md, "Memory": peak RSS of the recipe's RL steps on this project's machine
    # (trainer.steps=2, after the guard, the shelf and the per-tensor updates): trainer 4,794 MiB,
    # rollout worker 2,144 MiB, the run in all 6,767 MiB
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    recipe = Path(__file__).resolve().parents[2] / "configs" / "recipes" / "smollm2_135m_sums.yaml"
    # (measured before rollout.engine.pack_in_place, so with it off)
    cfg = load_config(recipe, [f"model.policy={tmp_path}", "rollout.engine.pack_in_place=false"])
    est = estimate_memory(cfg)
    assert est.trainer["policy"] == pytest.approx(134_515_008 * 4 / MIB)  # its parameters, float32
    assert 0.9 * 4794 <= est.trainer_mib <= 1.25 * 4794
    assert 0.75 * 2144 <= est.worker_mib <= 1.1 * 2144
    assert 0.9 * 6767 <= est.total_mib <= 1.2 * 6767
    # and with it on (docs/performance.md, "Packing in place"): the worker 1,375 / 1,399 MiB in RL
    # steps, the run in all 6,242 / 6,093 MiB
    on = estimate_memory(load_config(recipe, [f"model.policy={tmp_path}"]))
    assert 0.75 * 1399 <= on.worker_mib <= 1.1 * 1375
    assert 0.9 * 6242 <= on.total_mib <= 1.2 * 6093
