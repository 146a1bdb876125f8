"""The real-model sides of ``benchmarks/bench_trl.py`` and ``benchmarks/bench_pipeline_vllm.py``:
their reward on TRL's conversational completions, their tables' ratios, their argument checks.
(The runs themselves are measurements, in docs/performance.md.)"""

from __future__ import annotations

import pytest
from bench_scripts import load_benchmark


@pytest.fixture(scope="module")
def trl_bench():
    return load_benchmark("bench_trl")


@pytest.fixture(scope="module")
def vllm_bench():
    return load_benchmark("bench_pipeline_vllm")


def test_char_reward_scores_plain_and_conversational_completions_alike(trl_bench):
    plain = trl_bench.char_reward(["aab", "", "ccc"], char=["a", "b", "c"])
    def msg(text):
        return {"role": "assistant", "content": text}

    chat = trl_bench.char_reward([[msg("aab")], [msg("")], [msg("cc"), msg("c")]], char=["a", "b", "c"])
    assert plain == chat == [pytest.approx(2 / 3), 0.0, 1.0]


def test_prompt_ids_use_the_chat_template_only_for_a_chat_model(trl_bench):
    class Tok:
        chat_template = None

        def encode(self, text, add_special_tokens=True):
            return [ord(c) for c in text]

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            assert add_generation_prompt and not tokenize
            return f"<{messages[0]['role']}>{messages[0]['content']}<assistant>"

    class ChatTok(Tok):
        chat_template = "{{ messages }}"

    assert not trl_bench.is_chat(Tok()) and trl_bench.is_chat(ChatTok())
    assert trl_bench.prompt_ids(Tok(), "c") == [ord(c) for c in "Write c:"]
    assert trl_bench.prompt_ids(ChatTok(), "c") == [ord(c) for c in "<user>Write c:<assistant>"]


@pytest.mark.parametrize("argv", [["--max-new", "0"], ["--budget-s", "0"], ["--trl-threads", "x"],
                                  ["--saorl-trainer-threads", "0"]])
def test_trl_bench_rejects_bad_arguments(trl_bench, argv, capsys, tmp_path):
    assert trl_bench.main([*argv, "--out", str(tmp_path / "o")]) == 2
    assert "bench_trl: need" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def _rec(engine, mode, tps, idle=0.0):
    return {"engine": engine, "mode": mode, "steps": 3, "window_s": 100.0, "tokens_per_s": tps,
            "trainer_idle_frac": idle, "staleness_mean": 1.5, "staleness_max": 4, "load_start": 1.0,
            "load_end": 1.2}


def test_vllm_bench_table_gives_each_engines_ratio(vllm_bench):
    text = vllm_bench.table([_rec("local", "sync", 30.0), _rec("vllm", "sync", 20.0),
                             _rec("vllm", "async", 25.0), _rec("local", "async", 15.0)])
    assert "- local: async SAO / sync GRPO trained tokens/s = **0.50×**" in text
    assert "- vllm: async SAO / sync GRPO trained tokens/s = **1.25×**" in text
    assert "- async SAO, vllm / local engine = 1.67×" in text
    assert "| vllm | async | 3 | 100 | 25.0 | 0.00 | 1.50 / 4 | 1.0 → 1.2 |" in text
    only_local = vllm_bench.table([_rec("local", "sync", 30.0), _rec("local", "async", 15.0)])
    assert "vllm" not in only_local


def test_vllm_bench_engine_overrides(vllm_bench):
    assert vllm_bench.engine_overrides("local", None) == []
    assert vllm_bench.engine_overrides("vllm", "http://127.0.0.1:9") == [
        "rollout.engine=vllm", "rollout.engine.urls=[http://127.0.0.1:9]", "rollout.engine.model=policy"]


@pytest.mark.parametrize("argv", [["--engines", "sglang"], ["--engines", ""], ["--budget-s", "-1"],
                                  ["--batch-size", "0"]])
def test_vllm_bench_rejects_bad_arguments(vllm_bench, argv, capsys, tmp_path):
    assert vllm_bench.main([*argv, "--out", str(tmp_path / "o")]) == 2
    assert "bench_pipeline_vllm: need" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
