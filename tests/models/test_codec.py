"""The run's tokenizer: prompt format, exact continuations and spans, for both tokenizer families."""

import itertools
import random

import pytest
from model_families import bpe_tokenizer, qwen3_dir, sp_tokenizer

from saorl.config import ModelConfig
from saorl.models.codec import (
    RunTokenizer,
    TokenizerSpec,
    as_run_tokenizer,
    check_vocab,
    prompt_format_key,
    run_tokenizer,
    tokenizer_source,
    without_prefix_space,
)
from saorl.models.loading import load_policy
from saorl.models.tokenizer import load_tokenizer

FAMILIES = {"bpe": bpe_tokenizer, "sp": sp_tokenizer, "sp-metaspace": lambda: sp_tokenizer(metaspace=True)}
TEXTS = ["<out>5</out>", " then", "  two spaces", "\nnext line", "café → naïve", "x", "</answer>", " 42 é"]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    return request.param, RunTokenizer(FAMILIES[request.param]())


def test_prompt_chat_template_and_bos():
    bpe = RunTokenizer(bpe_tokenizer())
    assert bpe.text(bpe.prompt_ids("Add 1 and 2.")) == \
        "<|im_start|>user\nAdd 1 and 2.<|im_end|>\n<|im_start|>assistant\n"
    raw = RunTokenizer(bpe.hf, TokenizerSpec(None, chat_template=False))
    assert raw.prompt_ids("Add 1 and 2.") == bpe.hf.encode("Add 1 and 2.", add_special_tokens=False)
    sp = RunTokenizer(sp_tokenizer())
    assert not sp.applies_chat_template  # it has none
    ids = sp.prompt_ids("Add 1 and 2.")
    assert ids[0] == sp.bos_token_id and ids[1:] == sp.hf.encode("Add 1 and 2.", add_special_tokens=False)
    assert sp.eos_token_id not in ids


def test_chat_template_kwargs_reach_the_template():
    hf = bpe_tokenizer()
    hf.chat_template = "{{ messages[0].content }}{% if shout %}!{% endif %}"
    shout = RunTokenizer(hf, TokenizerSpec(None, True, {"shout": True}))
    assert shout.text(shout.prompt_ids("hi")) == "hi!"
    assert RunTokenizer(hf).text(RunTokenizer(hf).prompt_ids("hi")) == "hi"
    hf.chat_template = "{{ raise_exception('only system') }}"
    with pytest.raises(ValueError, match=r"model\.chat_template=false"):
        RunTokenizer(hf).prompt_ids("hi")


def test_a_conversation_goes_through_the_chat_template_as_it_is():
    """TRL's conversational prompts: the messages, system message included, then the generation prompt."""
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add 1 and 2."}]
    bpe = RunTokenizer(bpe_tokenizer())
    assert bpe.text(bpe.prompt_ids(chat)) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
                                              "Add 1 and 2.<|im_end|>\n<|im_start|>assistant\n")
    assert bpe.prompt_ids(chat[1:]) == bpe.prompt_ids("Add 1 and 2.")  # one user message: as the text
    with pytest.raises(ValueError, match=r"a conversation .* model\.chat_template is false: set "
                                         r"model\.chat_template=true"):
        RunTokenizer(bpe.hf, TokenizerSpec(None, chat_template=False)).prompt_ids(chat)
    with pytest.raises(ValueError, match=r"a conversation .* has none\. Use a model whose tokenizer has "
                                         r"one .* set model\.tokenizer to a tokenizer directory"):
        RunTokenizer(sp_tokenizer()).prompt_ids(chat)
    hf = bpe_tokenizer()
    hf.chat_template = ("{% if messages[0].role == 'system' %}{{ raise_exception('System role not "
                        "supported') }}{% endif %}{{ messages[0].content }}")
    with pytest.raises(ValueError, match=r"on a conversation of roles \['system', 'user'\]: .*System role"):
        RunTokenizer(hf).prompt_ids(chat)


def test_continuations_append_exactly(family):
    name, tok = family
    rng = random.Random(0)
    for _ in range(40):  # contexts: a prompt, then pieces appended as continuations or sampled ids
        ids = tok.prompt_ids("Add 12 and 30.")
        expected = tok.text(ids)
        for _ in range(4):
            text = rng.choice(TEXTS)
            ids += tok.continuation_ids(ids, text)
            expected += text
            assert tok.text(ids) == expected, (name, text)
            action = tok.hf.encode(rng.choice(TEXTS), add_special_tokens=False)  # "sampled" ids
            expected += tok.span_text(ids + action, len(ids), len(ids) + len(action))
            ids += action
            assert tok.text(ids) == expected, name


def test_plain_encoding_inserts_a_space_for_sentencepiece_only(family):
    name, tok = family
    ctx = tok.prompt_ids("Add 12 and 30.")
    plain = tok.hf.encode("<out>5</out>", add_special_tokens=False)
    joined = tok.text(ctx + plain)
    if name == "bpe":
        assert joined == tok.text(ctx) + "<out>5</out>"
        assert without_prefix_space(tok.hf.backend_tokenizer) is None
    else:  # the bug the continuation encoding fixes: "...30. <out>5</out>"
        assert joined == tok.text(ctx) + " <out>5</out>"
        assert without_prefix_space(tok.hf.backend_tokenizer) is not None


def test_spans_join_up_to_the_whole_text(family):
    name, tok = family
    rng = random.Random(1)
    for _ in range(30):
        pieces = [tok.hf.encode(rng.choice(TEXTS), add_special_tokens=False) for _ in range(5)]
        ids = [i for p in pieces for i in p]
        cuts = [0]
        for p in pieces:
            cuts.append(cuts[-1] + len(p))
        spans = [tok.span_text(ids, a, b) for a, b in itertools.pairwise(cuts)]
        assert "".join(spans) == tok.text(ids)
        if name != "bpe" and any(tok.hf.convert_ids_to_tokens(p[0]).startswith("▁") for p in pieces[1:]):
            # decoding each span alone drops the leading space of a later span
            assert "".join(tok.text(p) for p in pieces) != tok.text(ids)


def test_as_run_tokenizer_wraps_once_and_delegates():
    hf = sp_tokenizer()
    a, b = as_run_tokenizer(hf), as_run_tokenizer(hf)
    assert a is b and as_run_tokenizer(a) is a
    assert a.eos_token_id == hf.eos_token_id and len(a) == len(hf)
    assert a("hi")["input_ids"] == hf("hi")["input_ids"]
    assert hf.pad_token_id is None and a.pad_token_id == hf.eos_token_id  # padding is masked anyway


def test_run_tokenizer_defaults_to_the_policys_own(tmp_path):
    qwen = qwen3_dir(tmp_path / "qwen")
    own = run_tokenizer(ModelConfig(policy=str(qwen)))
    assert own.spec.source == str(qwen) and len(own) == len(bpe_tokenizer())
    assert own.applies_chat_template
    assert run_tokenizer(ModelConfig(policy="tiny-moe")).spec.source is None
    assert len(run_tokenizer(ModelConfig(policy="tiny-moe"))) == len(load_tokenizer())
    assert tokenizer_source(str(qwen), "other") == "other"
    assert not run_tokenizer(ModelConfig(policy=str(qwen), chat_template=False)).applies_chat_template
    # an explicit tokenizer with the policy's vocabulary is fine; another vocabulary is an error
    assert len(run_tokenizer(ModelConfig(policy=str(qwen), tokenizer=str(qwen)))) == len(own)
    other = tmp_path / "sp"
    sp_tokenizer().save_pretrained(str(other))
    with pytest.raises(ValueError, match="different vocabulary"):
        run_tokenizer(ModelConfig(policy=str(qwen), tokenizer=str(other)))


def test_a_policy_directory_without_a_tokenizer_says_so(tmp_path):
    qwen = qwen3_dir(tmp_path / "qwen")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (qwen / f).unlink()
    with pytest.raises(FileNotFoundError, match="holds no tokenizer"):
        run_tokenizer(ModelConfig(policy=str(qwen)))


def test_check_vocab_refuses_a_tokenizer_that_does_not_fit(tmp_path):
    qwen = qwen3_dir(tmp_path / "qwen")
    policy = load_policy(str(qwen))
    check_vocab(run_tokenizer(ModelConfig(policy=str(qwen))), policy)  # its own: fits
    with pytest.raises(ValueError, match=r"does not fit the policy .* embedding of 360 rows"):
        check_vocab(load_tokenizer(), policy)  # the shipped 1,024-token tokenizer


def test_prompt_format_key_is_empty_for_the_defaults():
    assert prompt_format_key(ModelConfig()) == {}
    assert prompt_format_key(ModelConfig(chat_template=False)) == {"prompt_format": {"chat_template": False}}
    key = prompt_format_key(ModelConfig(chat_template_kwargs={"enable_thinking": False}))
    assert key == {"prompt_format": {"chat_template_kwargs": {"enable_thinking": False}}}
