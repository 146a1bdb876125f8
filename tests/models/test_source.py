"""The model source (saorl.models.source): every kind a spec can name, recognised by one table in
one order; bad specs are one message naming every accepted kind; a source is made local once per
process; what the old call sites decided (tiny or not, small or not, the tokenizer's source) holds."""

import json
import subprocess
import sys

import pytest

from saorl.models import source as src
from saorl.models.source import (
    KINDS,
    LOCAL_KINDS,
    TINY_KINDS,
    ModelSource,
    ModelSourceError,
    NotAModel,
    accepted,
    is_tiny,
    parse,
)

SMOLLM2 = {"hidden_size": 576, "num_hidden_layers": 30, "vocab_size": 49152}
TINY = {"hidden_size": 128, "num_hidden_layers": 4, "vocab_size": 512}


@pytest.fixture
def specs(tmp_path):
    """One spec of every kind (paths under ``tmp_path``)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SMOLLM2))
    small = tmp_path / "small"
    small.mkdir()
    (small / "config.json").write_text(json.dumps(TINY))
    critic = tmp_path / "critic"
    critic.mkdir()
    (critic / "critic.json").write_text("{}")
    gguf = tmp_path / "m.Q4.GGUF"
    gguf.write_bytes(b"GGUF")
    return {"tiny-moe": "tiny", "tiny-dense": "tiny", str(model): "directory", str(small): "directory",
            str(gguf): "gguf", "smollm2-135m-instruct": "registry", "Qwen/Qwen3-0.6B": "hub",
            "meta-llama/Llama-3.2-1B": "hub", str(critic): "critic"}


def test_every_kind_is_recognised(specs):
    for spec, kind in specs.items():
        kinds = LOCAL_KINDS if kind == "critic" else src.MODEL_KINDS
        s = parse(spec, kinds=kinds)
        assert (s.kind, s.spec, s.what, s.local) == (kind, spec, "model.policy", None), spec
    assert [k.name for k in KINDS] == ["tiny", "critic", "gguf", "directory", "registry", "hub"]
    assert parse(parse("tiny-moe")) == parse("tiny-moe")  # a source passes through


def test_an_existing_path_wins_over_a_name(tmp_path, monkeypatch):
    """A directory named like a short name or a Hub id is that directory (as resolve_source did)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2-135m-instruct").mkdir()
    (tmp_path / "Qwen" / "Qwen3-0.6B").mkdir(parents=True)
    assert parse("smollm2-135m-instruct").kind == "directory"
    assert parse("Qwen/Qwen3-0.6B").kind == "directory"
    assert parse("tiny-moe").kind == "tiny"  # a tiny kind is tried first, even beside a directory of its name


def test_a_critic_directory_is_a_critic_only_where_critics_are_taken(specs):
    critic = next(s for s, k in specs.items() if k == "critic")
    assert parse(critic, "model.critic", LOCAL_KINDS).kind == "critic"
    assert parse(critic).kind == "directory"  # as model.policy: a directory (that preflight then checks)


@pytest.mark.parametrize("spec, said", [
    ("", "model.policy is empty"),
    ("   ", "model.policy is empty"),
    ("/no/such/dir", "'/no/such/dir' does not exist (relative to"),
    ("./models/x/y", "does not exist"),
    ("/no/such/model.gguf", "the GGUF file does not exist"),
    ("models/model.gguf", "the GGUF file does not exist"),  # of the form org/name, still no Hub id
    ("smollm2-135m-instuct", "(did you mean smollm2-135m-instruct?)"),
    ("tiny-mo", "(did you mean tiny-moe?)"),
])
def test_a_bad_spec_is_one_message_naming_every_kind(spec, said):
    with pytest.raises(ModelSourceError) as err:
        parse(spec)
    msg = str(err.value)
    assert said in msg and "\n" not in msg
    assert msg.endswith(accepted())
    for part in ("a tiny built-in kind (tiny-moe, tiny-dense)", "a .gguf file", "a model directory",
                 "a short model name (smollm2-135m-instruct", "a Hugging Face Hub model id (org/name"):
        assert part in msg, part


def test_a_file_that_is_no_model_and_kinds_not_taken(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("x")
    with pytest.raises(NotAModel, match=r"is a file, not a model") as err:
        parse(str(f))
    assert isinstance(err.value, NotADirectoryError) and isinstance(err.value, FileNotFoundError)
    with pytest.raises(ModelSourceError, match=r"model\.tokenizer 'tiny-moe' .*takes a critic saorl wrote"):
        parse("tiny-moe", "model.tokenizer", LOCAL_KINDS)  # a tiny kind has no directory
    assert accepted(("hub",)) == "a Hugging Face Hub model id (org/name, e.g. Qwen/Qwen3-0.6B)"


def test_small_is_the_tables_column(specs, tmp_path):
    small = {spec: parse(spec, kinds=(*LOCAL_KINDS, "tiny")).small() for spec in specs}
    assert {s for s, v in small.items() if v} == {"tiny-moe", "tiny-dense", str(tmp_path / "small")}


def test_resolve_makes_the_local_directory_once_per_process(tmp_path, monkeypatch):
    from saorl.models import hub

    calls = []

    def snapshot(repo_id, what):
        calls.append((repo_id, what))
        out = tmp_path / "snap" / repo_id
        out.mkdir(parents=True, exist_ok=True)
        return out

    monkeypatch.setattr(hub, "snapshot", snapshot)
    monkeypatch.setattr(src, "_RESOLVED", {})
    first = parse("org/model").resolve()
    assert first.local == tmp_path / "snap" / "org" / "model" and first.resolved
    assert parse("org/model").resolve() == first and first.resolve() is first
    assert parse("org/model").load_spec == str(first.local)
    assert calls == [("org/model", "model.policy")]
    assert src.resolve_source("org/model") == first.local and len(calls) == 2  # fresh, as it always was
    (tmp_path / "snap" / "org" / "model").rmdir()  # gone (a cache cleared): made again
    assert parse("org/model").resolve().local == first.local and len(calls) == 3
    tiny = parse("tiny-dense").resolve()
    assert tiny.local is None and tiny.resolved and tiny.load_spec == "tiny-dense"


def test_the_old_call_sites_decide_as_before(specs, tmp_path):
    """Tiny or not (loading, codec, estimate, preflight, serve, eval), small or not (sizing), the
    tokenizer's source (codec): the same answers as the hand-written checks gave."""
    from saorl.config.sizing import is_small
    from saorl.models.codec import tokenizer_source

    for spec, kind in specs.items():
        assert is_tiny(spec) == (spec in ("tiny-moe", "tiny-dense")) == is_tiny(ModelSource(kind, spec))
        assert tokenizer_source(spec, None) == (None if kind == "tiny" else spec)
        assert tokenizer_source(spec, "tok") == "tok"
        old_small = spec in TINY_KINDS or (tmp_path / "small").as_posix() == spec
        assert is_small(spec) == old_small, spec
    assert not is_small("/m/model.gguf") and not is_small("no such thing")  # preflight names those


def test_parse_and_config_loading_import_no_torch():
    code = ("import sys; import saorl.config, saorl.config.sizing; from saorl.models.source import parse; "
            "parse('tiny-moe'); parse('Qwen/Qwen3-0.6B'); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_gguf_file_rewritten_in_place_is_resolved_again(tmp_path, monkeypatch):
    made = []

    def gguf_dir(spec, path, what):
        made.append(path.read_bytes())
        out = tmp_path / f"entry-{len(made)}"
        out.mkdir()
        return out

    monkeypatch.setattr(src, "_RESOLVED", {})
    monkeypatch.setattr(src, "_ROWS", {**src._ROWS, "gguf": src.dataclasses.replace(src._ROWS["gguf"],
                                                                                    local=gguf_dir)})
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF one")
    assert parse(str(f)).resolve().local == parse(str(f)).resolve().local == tmp_path / "entry-1"
    f.write_bytes(b"GGUF two, longer")
    assert parse(str(f)).resolve().local == tmp_path / "entry-2"
    assert made == [b"GGUF one", b"GGUF two, longer"]
