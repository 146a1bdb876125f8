"""``saorl bench step``: the FLOP count against a hand-counted model, the matmul peak, and the
command on a tiny model (its tables, its JSON, its refusals)."""

import json
import types

import torch
from torch import nn

from saorl.bench.step import matmul_peak, step_flops
from saorl.cli import main


class _Toy(nn.Module):
    def __init__(self, tied: bool):
        super().__init__()
        self.embed = nn.Embedding(10, 4)  # 40
        self.layer = nn.Linear(4, 4)  # 20
        self.config = types.SimpleNamespace(vocab_size=10, hidden_size=4, num_hidden_layers=1,
                                            tie_word_embeddings=tied)


def test_flops_are_counted_as_the_docstring_says():
    critic = nn.Linear(2, 4)  # 12 parameters, 8 of them trainable below
    critic.bias.requires_grad_(False)
    f = step_flops(_Toy(tied=True), critic, batch=2, tokens=3, k=2)
    # 6 positions; layers 60 - 40 = 20; head 40; attention 2 * 1 layer * 3 tokens * 4 hidden = 24
    assert f["policy"] == 3 * 6 * (2 * (20 + 40) + 24)
    critic_fwd = 6 * (2 * 20 + 24)
    assert f["critic"] == 2 * (critic_fwd + 6 * (2 * 20 + 2 * 24 + 2 * 8)) + critic_fwd
    assert f["vocab"] == 3 * 6 * 2 * 40
    untied = _Toy(tied=False)
    untied.head = nn.Linear(4, 10, bias=False)  # its own 40
    assert step_flops(untied, critic, batch=2, tokens=3, k=2) == f


def test_the_matmul_peak_is_a_rate():
    peak = matmul_peak(torch.float32, n=256, reps=2)
    assert peak is not None and 1e8 < peak < 1e14


def test_the_command_on_a_tiny_model(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["bench", "step", "tiny-dense", "--batch", "2", "--tokens", "32", "--steps", "1",
                 "--threads", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| SAO step (policy + critic, K = 2) |" in text and "| policy AdamW |" in text
    r = json.loads(out.read_text())
    assert r["batch"] == 2 and r["tokens"] == 32 and r["step_s"] > 0
    assert 0 < r["fraction"]["step"] < 2 and r["peaks"]["float32"] > 0
    assert {"policy forward", "policy backward + optimizer", "critic forward (grad)"} <= set(r["split"])
    assert abs(r["ratio"]["min"] - 1) < 0.05 and abs(r["ratio"]["max"] - 1) < 0.05  # own log-probs
    phases = [row["phase"] for row in r["memory"]["phases"]]  # peak RSS per phase
    assert phases == ["model, critic and learner built", "warm-up step", "timed steps",
                      "optimizer and vocabulary timed alone"]
    assert r["peak_rss_mib"] == max(row["trainer_mib"] for row in r["memory"]["phases"]) > 100
    assert "| timed steps |" in text and "peak: trainer" in text
    assert main(["bench", "step", "tiny-dense", "--tokens", "1"]) == 2
    assert main(["bench", "step", "tiny-dense", "--batch", "0"]) == 2
    assert "must be >= 1" in capsys.readouterr().err


def test_an_moe_counts_the_experts_a_token_passes_through():
    toy = _Toy(tied=True)
    toy.experts = nn.ModuleList(nn.Linear(4, 4, bias=False) for _ in range(4))  # 4 × 16: 64
    toy.config.num_experts, toy.config.num_experts_per_tok = 4, 1
    critic = nn.Linear(2, 4)
    critic.bias.requires_grad_(False)
    f = step_flops(toy, critic, batch=2, tokens=3, k=2)
    # 124 parameters: 40 embedding, 84 in layers of which 48 are experts no token passes through
    assert f["policy"] == 3 * 6 * (2 * (84 - 48 + 40) + 24)
    toy.config.num_attention_heads, toy.config.head_dim = 2, 4  # attention 8 wide, not 4
    assert step_flops(toy, critic, batch=2, tokens=3, k=2)["policy"] == 3 * 6 * (2 * (36 + 40) + 48)
