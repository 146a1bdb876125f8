"""benchmarks/bench_lora_critic.py measures what it says: its rollouts' return is the marker's
class, and its parameter counts are the critics' own."""

import pytest
from bench_scripts import load_benchmark

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_lora_critic")


def test_the_return_is_the_class_of_the_marker_in_the_prompt(bench):
    trajs = bench.rollouts(20, seed=3)
    for t in trajs:
        prompt = t.token_ids[: t.prompt_len]
        markers = [m for m in bench.MARKERS if m in prompt]
        assert len(markers) == 1 and t.total_reward == float(markers[0] == bench.MARKERS[0])
        assert not set(t.token_ids[t.prompt_len:]) & set(bench.MARKERS)  # only the prompt tells
    assert 0 < sum(t.total_reward for t in trajs) < len(trajs)


def test_counts_and_a_fit_that_moves_the_held_out_loss(bench):
    m = bench.measure("tiny-dense", {"default": (None, 1e-3), "LoRA r4": (4, 1e-3)}, rollouts_n=10,
                      steps=2, batch=4)
    default, lora = bench.critic_of("tiny-dense", None), bench.critic_of("tiny-dense", 4)
    default.set_frozen_attention(True)
    assert m["default"]["params"] == sum(p.numel() for p in default.trainable_parameters())
    assert m["LoRA r4"]["params"] == sum(p.numel() for p in lora.trainable_parameters())
    assert m["LoRA r4"]["params"] < m["default"]["params"] < m["default"]["all_params"]
    for r in m.values():
        assert r["step_s"] > 0 and r["loss"] != r["loss0"]
