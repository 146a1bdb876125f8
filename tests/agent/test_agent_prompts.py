"""Overlong prompts are decided at start-up (env.overlong_prompts): filtered with a count, or one
paragraph; a huge row is known to be over the budget from its bytes, without tokenising it."""

import json

import pytest

from saorl.config import load_config
from saorl.envs.registry import make_env_factory
from saorl.errors import StartupError
from saorl.models.codec import run_tokenizer
from saorl.runtime.parts import build_tasks
from saorl.stages.evaluate import eval_tasks


def _cfg(tmp_path, mode="filter", rows=None):
    rows = rows if rows is not None else (
        [{"id": f"r{i}", "prompt": f"What is {i}+1?", "answer": i + 1} for i in range(50)]
        + [{"id": "long", "prompt": "word " * 400, "answer": 1},  # over the budget by its tokens
           {"id": "huge", "prompt": "x" * 20_000_000, "answer": 1}])  # 20 MB: by its bytes
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_config(None, ["env.type=prompt_reward", f"env.tasks_file={path}", "env.num_test_tasks=4",
                              "env.num_train_tasks=100",
                              "env.options.reward_fn=saorl.envs.rewards:number_answer",
                              "env.call_timeout_s=null", f"env.overlong_prompts={mode}",
                              "rollout.max_total_tokens=128", "rollout.max_new_tokens=32"])


def test_overlong_prompts_are_left_out_at_start_with_one_line(tmp_path, capsys):
    cfg = _cfg(tmp_path)
    factory = make_env_factory(cfg.env.type, cfg.env.options)
    train, test = build_tasks(cfg, factory, run_tokenizer(cfg.model))
    ids = {t.id for t in train} | {t.id for t in test}
    assert "long" not in ids and "huge" not in ids and len(ids) == 50
    out = capsys.readouterr().out
    assert "prompts: 2 of" in out and "over 96 tokens" in out
    assert "left out (env.overlong_prompts=filter)" in out
    assert "huge (over by its size in bytes)" in out and "long (" in out


def test_overlong_prompts_stop_the_start_with_error(tmp_path):
    cfg = _cfg(tmp_path, mode="error")
    factory = make_env_factory(cfg.env.type, cfg.env.options)
    with pytest.raises(StartupError, match=r"2 of 4 test tasks have prompts over 96 tokens.*"
                                           r"env.overlong_prompts=filter"):
        build_tasks(cfg, factory, run_tokenizer(cfg.model))


def test_no_prompt_fitting_is_one_paragraph_and_eval_filters_alike(tmp_path):
    rows = [{"id": f"r{i}", "prompt": "word " * 300, "answer": 1} for i in range(6)]
    cfg = _cfg(tmp_path, rows=rows)
    factory = make_env_factory(cfg.env.type, cfg.env.options)
    with pytest.raises(StartupError, match="none is left to play"):
        build_tasks(cfg, factory, run_tokenizer(cfg.model))
    cfg = _cfg(tmp_path)
    tasks = eval_tasks(cfg, factory, "test", 4, run_tokenizer(cfg.model))
    assert "huge" not in {t.id for t in tasks}


def test_the_bytes_bound_is_used_only_where_it_holds():
    """A tokenizer that normalises text, or folds unknown characters into one token, may make a
    large text few tokens: its prompts are always tokenised."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from saorl.agent.prompts import bytes_bound_holds

    shipped = run_tokenizer(load_config(None, []).model)
    assert bytes_bound_holds(shipped)
    folding = Tokenizer(models.BPE(vocab={"a": 0, "<unk>": 1}, merges=[], unk_token="<unk>", fuse_unk=True))
    assert not bytes_bound_holds(PreTrainedTokenizerFast(tokenizer_object=folding))
    assert len(PreTrainedTokenizerFast(tokenizer_object=folding).encode("中" * 1000)) == 1
    normalising = Tokenizer(models.BPE(vocab={"a": 0}, merges=[], byte_fallback=True))
    normalising.normalizer = normalizers.NFKC()
    normalising.pre_tokenizer = pre_tokenizers.ByteLevel()
    assert not bytes_bound_holds(PreTrainedTokenizerFast(tokenizer_object=normalising))
