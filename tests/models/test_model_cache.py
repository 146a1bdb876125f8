"""saorl's model cache cannot lie (saorl.models.cache_manifest, cache_dir, gguf_convert), on the
tiny Llama written as GGUF: a GGUF missing tensors is refused; every entry has a manifest; a
damaged entry (truncated weights, a deleted tokenizer, a garbage config, a flipped 4 KB block) is
named, removed and converted again; pre-manifest entries; leftovers of killed conversions; a
waiting process says for whom; a cache that is a file, read-only or full is named as such; an
empty, truncated or malformed GGUF is named; ``saorl cache verify``."""

import errno
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from gguf_files import tiny_llama, write_gguf

from saorl.cli import main
from saorl.models import cache_dir, cache_manifest, gguf_convert, gguf_source, source
from saorl.models.cache_dir import CacheUnusable, EntryLock, ModelSourceError
from saorl.models.cache_manifest import MANIFEST, MARKER, sha256_file
from saorl.models.gguf_source import RegistryModel
from saorl.models.source import resolve_source


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "saorl-cache"
    monkeypatch.setenv("SAORL_CACHE", str(root))
    monkeypatch.setattr(cache_manifest, "_VERIFIED", set())  # a fresh process
    return root


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_gguf(tiny_llama(seed=5), tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tiny_gguf):
    """A pristine entry of the tiny GGUF (copied for each test that damages one)."""
    root = tmp_path_factory.mktemp("pristine")
    old = os.environ.get("SAORL_CACHE")
    os.environ["SAORL_CACHE"] = str(root)
    try:
        return resolve_source(str(tiny_gguf))
    finally:
        os.environ.pop("SAORL_CACHE") if old is None else os.environ.__setitem__("SAORL_CACHE", old)


def _copy_into(cache: Path, entry: Path) -> Path:
    import shutil

    shutil.copytree(entry.parent, cache / "models", symlinks=True)
    return cache / "models" / entry.name


def _hidden(cache: Path) -> list[str]:
    return sorted(p.name for p in (cache / "models").iterdir() if p.name.startswith(".") and not
                  p.name.endswith(".lock") and p.name != ".hashes")


def test_a_gguf_missing_a_layer_is_refused_naming_its_tensors(cache, tmp_path):
    path = write_gguf(tiny_llama(seed=5), tmp_path / "no-layer-1.gguf", drop="blk.1.")
    with pytest.raises(ModelSourceError) as err:
        resolve_source(str(path), "model.policy")
    msg = str(err.value)
    assert "\n" not in msg and f"model.policy={path}: the GGUF file no-layer-1.gguf lacks 9 of the" in msg
    assert "tensors of LlamaForCausalLM: model.layers.1.{" in msg and "mlp.down_proj.weight" in msg
    assert "newly initialized" in msg and "model.layers.0" not in msg
    assert not any((cache / "models").glob("gguf-*")) and _hidden(cache) == []


def test_every_entry_carries_a_manifest_of_its_files_written_last(converted, tiny_gguf):
    from saorl import __version__

    manifest = json.loads((converted / MANIFEST).read_text())
    on_disk = sorted(p.name for p in converted.iterdir() if p.name != MANIFEST)
    assert sorted(manifest["files"]) == on_disk and MARKER in on_disk and "model.safetensors" in on_disk
    for name, want in manifest["files"].items():
        assert want == {"bytes": (converted / name).stat().st_size, "sha256": sha256_file(converted / name)}
    assert manifest["saorl"] == __version__
    assert manifest["source"] == {"source": str(tiny_gguf.resolve()), "gguf_sha256": sha256_file(tiny_gguf)}
    assert (converted / MANIFEST).stat().st_mtime_ns >= max(p.stat().st_mtime_ns for p in converted.iterdir())


def _truncate(entry):
    with open(entry / "model.safetensors", "r+b") as f:
        f.truncate((entry / "model.safetensors").stat().st_size // 2)
    return "model.safetensors is"


def _delete_tokenizer(entry):
    (entry / "tokenizer.json").unlink()
    return "tokenizer.json is missing"


def _garbage_config(entry):
    size = (entry / "config.json").stat().st_size
    (entry / "config.json").write_bytes(b"\x00garbage" * (size // 8) + b"x" * (size % 8))  # same size
    return "config.json has SHA-256"


def _flip_block(entry):
    f = entry / "model.safetensors"
    data = bytearray(f.read_bytes())
    at = len(data) // 2
    data[at:at + 4096] = bytes(b ^ 0xFF for b in data[at:at + 4096])
    f.write_bytes(bytes(data))
    return "model.safetensors has SHA-256"


@pytest.mark.parametrize("damage", [_truncate, _delete_tokenizer, _garbage_config, _flip_block])
def test_a_damaged_entry_is_named_removed_and_converted_again(cache, converted, tiny_gguf, damage, capsys):
    entry = _copy_into(cache, converted)
    said = damage(entry)
    out = resolve_source(str(tiny_gguf), "model.policy")
    assert out == entry
    err = capsys.readouterr().err
    assert f"the cached model {entry} is not usable: {said}" in err
    assert f"Removing it and converting it again from the file {tiny_gguf}" in err and "converted in" in err
    for name, want in json.loads((converted / MANIFEST).read_text())["files"].items():
        if name != MARKER:  # it records the conversion's time
            assert sha256_file(entry / name) == want["sha256"], name
    assert _hidden(cache) == []


def test_sizes_are_checked_on_every_use_hashes_once_per_process(cache, converted, tiny_gguf, monkeypatch):
    entry = _copy_into(cache, converted)
    hashed = []
    real = cache_manifest.sha256_file
    monkeypatch.setattr(cache_manifest, "sha256_file", lambda p: hashed.append(p.name) or real(p))
    assert resolve_source(str(tiny_gguf)) == entry
    assert "model.safetensors" in hashed
    hashed.clear()
    monkeypatch.setattr(gguf_source, "convert_gguf", lambda *a, **k: pytest.fail("converted again"))
    assert resolve_source(str(tiny_gguf)) == entry and hashed == []  # this process checked it already
    (entry / "tokenizer.json").unlink()  # sizes are checked every time: found, and converted again
    with pytest.raises(pytest.fail.Exception, match="converted again"):
        resolve_source(str(tiny_gguf))


def test_pre_manifest_entries_a_gguf_files_is_converted_again_a_short_names_is_loaded_once(
        cache, converted, tiny_gguf, monkeypatch, capsys):
    entry = _copy_into(cache, converted)
    (entry / MANIFEST).unlink()  # as saorl 0.1.0 left it
    assert resolve_source(str(tiny_gguf)) == entry
    err = capsys.readouterr().err
    assert "converted before saorl kept manifests" in err and "converted in" in err
    assert (entry / MANIFEST).is_file()
    sha = "ab" * 32
    monkeypatch.setitem(source.REGISTRY_MODELS, "tiny-test", RegistryModel(
        package="saorl-tiny-gguf", version="0.0.1", wheel_sha256=sha, member="t/tiny.gguf", about="tiny"))
    legacy = cache / "models" / f"tiny-test-{sha[:16]}"
    os.rename(entry, legacy)
    (legacy / MANIFEST).unlink()
    monkeypatch.setattr(gguf_source.subprocess, "run", lambda *a, **k: pytest.fail("downloaded again"))
    assert resolve_source("tiny-test") == legacy
    assert "loads whole; it now has a manifest" in capsys.readouterr().err
    assert cache_manifest.entry_problem(legacy, deep=True) is None
    os.rename(legacy, entry)  # and one that does not load whole is removed and fetched again
    shutil_copy = cache / "legacy-bad"
    os.rename(entry, shutil_copy)
    (shutil_copy / MANIFEST).unlink()
    (shutil_copy / "tokenizer.json").write_text("{not json")
    os.rename(shutil_copy, legacy)
    with pytest.raises(pytest.fail.Exception, match="downloaded again"):
        resolve_source("tiny-test")
    assert "the tokenizer files do not load" in capsys.readouterr().err and not legacy.exists()


def test_leftovers_of_killed_conversions_go_a_live_conversions_stay(cache, tiny_gguf, monkeypatch):
    models = cache / "models"
    models.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    left = [f".gguf-{'0' * 64}.tmp-{dead}-abc", f".smollm2-135m-instruct-bcc81830d10ce7d9.download-{dead}-x",
            ".gguf-old.tmp-k2j3h4"]  # the last: saorl 0.1.0's, no pid, its entry's lock free
    for name in left:
        (models / name).mkdir()
        (models / name / "model.safetensors").write_bytes(b"\0" * 1000)
    live = models / f".gguf-live.tmp-{os.getpid()}-q"
    live.mkdir()
    with EntryLock(models / "gguf-live", "another conversion"):  # holds the lock of gguf-live
        resolve_source(str(tiny_gguf))
    assert _hidden(cache) == [live.name]


def test_a_temp_whose_entry_lock_is_held_stays_though_its_pid_looks_dead(cache):
    """Over NFS or from another container a live writer's pid looks dead here: its lock decides."""
    models = cache / "models"
    models.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    held, free = models / f".gguf-held.tmp-{dead}-a", models / f".gguf-free.tmp-{dead}-b"
    for d in (held, free):
        d.mkdir()
    locked, done = threading.Event(), threading.Event()

    def writer():  # another open file description: its flock is another holder's
        with EntryLock(models / "gguf-held", "a writer elsewhere"):
            locked.set()
            done.wait(5)

    t = threading.Thread(target=writer)
    t.start()
    locked.wait(5)
    try:
        assert cache_dir.remove_leftovers() == [free.name]
    finally:
        done.set()
        t.join()
    assert held.is_dir() and not free.exists()


def test_an_entry_without_weights_gets_no_manifest(cache, tiny_gguf, tmp_path, monkeypatch):
    entry = tmp_path / "entry"
    entry.mkdir()
    (entry / "config.json").write_text("{}")
    (entry / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match=r"has no \*\.safetensors weights"):
        cache_manifest.write_manifest(entry, {})
    assert not (entry / MANIFEST).exists()

    class NoWeights:  # a save that writes the config only
        def __init__(self, model):
            self.model = model

        def save_pretrained(self, d):
            self.model.config.save_pretrained(d)

    monkeypatch.setattr(gguf_convert, "_plain", NoWeights)
    with pytest.raises(ModelSourceError, match=r"not give a whole model: .* has no \*\.safetensors weights"):
        resolve_source(str(tiny_gguf), "model.policy")
    assert not any((cache / "models").glob("gguf-*")) and _hidden(cache) == []


def test_a_process_waiting_for_another_conversion_says_for_whom(cache, tiny_gguf, monkeypatch, capsys):
    monkeypatch.setattr(cache_dir, "WAIT_SAY_EVERY_S", 0.3)
    out = cache / "models" / f"gguf-{sha256_file(tiny_gguf)}"
    held = threading.Event()

    def hold():
        with EntryLock(out, "the other"):
            held.set()
            time.sleep(1.0)

    t = threading.Thread(target=hold)
    t.start()
    held.wait()
    assert resolve_source(str(tiny_gguf), "model.policy") == out
    t.join()
    err = capsys.readouterr().err
    assert f"model.policy={tiny_gguf}: waiting for process {os.getpid()}, which is writing {out.name}" in err
    assert "s so far)" in err


def _train(capsys, *extra) -> tuple[int, str]:
    status = main(["train", *extra])
    return status, " ".join(capsys.readouterr().err.split())


def test_a_cache_that_is_a_file_is_named_before_anything_starts(tmp_path, tiny_gguf, monkeypatch, capsys):
    bad = tmp_path / "cache-file"
    bad.write_text("not a directory")
    monkeypatch.setenv("SAORL_CACHE", str(bad))
    status, err = _train(capsys, "--run-dir", str(tmp_path / "run"), f"model.policy={tiny_gguf}",
                         "trainer.steps=1")
    assert status == 2 and f"saorl's model cache {bad} (SAORL_CACHE={bad})" in err
    assert f"{bad} is a file, not a directory" in err and "MB free there" in err
    assert "run directory" not in err and not (tmp_path / "run").exists()


def test_a_read_only_cache_is_named(cache, tiny_gguf, monkeypatch):
    real_open = os.open

    def read_only(path, *a, **k):
        if ".write-probe-" in str(path):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr(cache_dir.os, "open", read_only)
    with pytest.raises(CacheUnusable) as err:
        resolve_source(str(tiny_gguf), "model.policy")
    msg = str(err.value)
    assert "it cannot be written: it is on a read-only file system" in msg and f"SAORL_CACHE={cache}" in msg


def test_a_cache_without_room_is_named_before_the_conversion_and_when_it_fills(cache, tiny_gguf, monkeypatch):
    from safetensors import SafetensorError

    usage = cache_dir.shutil.disk_usage
    monkeypatch.setattr(cache_dir.shutil, "disk_usage", lambda p: usage(p)._replace(free=10**6 + 1))
    with pytest.raises(CacheUnusable, match=r"not enough room: the converted model needs about \d+ MB"):
        resolve_source(str(tiny_gguf))
    monkeypatch.undo()
    monkeypatch.setenv("SAORL_CACHE", str(cache))

    def full(*a, **k):
        raise SafetensorError('Error while serializing: I/O error: No space left on device (os error 28)')

    monkeypatch.setattr(gguf_convert, "_plain", lambda m: type("M", (), {"save_pretrained": full})())
    with pytest.raises(CacheUnusable, match=r"the disk is full \(nothing half-written was kept\)"):
        resolve_source(str(tiny_gguf))
    assert not any((cache / "models").glob("gguf-*")) and _hidden(cache) == []


def test_an_empty_or_truncated_gguf_is_named_as_such(cache, tiny_gguf, tmp_path):
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelSourceError, match=r"the GGUF file .*empty\.gguf is empty \(0 bytes\)"):
        resolve_source(str(empty))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[: tiny_gguf.stat().st_size // 2])
    with pytest.raises(ModelSourceError, match=r"the GGUF file cut\.gguf is truncated"):
        resolve_source(str(cut))
    other = tmp_path / "other.gguf"
    other.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(ModelSourceError, match=r"is not a GGUF file \(it starts with b'PK"):
        resolve_source(str(other))


def test_malformed_tokenizer_metadata_is_named_a_panic_included(cache, tmp_path, tiny_gguf, monkeypatch):
    bad = write_gguf(tiny_llama(seed=5), tmp_path / "bad-merges.gguf", merges=["zzzq qqqz", "a b"])
    with pytest.raises(ModelSourceError) as err:
        resolve_source(str(bad), "model.policy")
    msg = str(err.value)
    assert "\n" not in msg and "the tokenizer metadata of the GGUF file bad-merges.gguf" in msg
    assert "is malformed" in msg and "out of vocabulary" in msg

    class PanicException(BaseException):  # pyo3's, as tokenizers raises it
        pass

    def panic(*a, **k):
        raise PanicException("called `Option::unwrap()` on a `None` value")

    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", panic)
    with pytest.raises(ModelSourceError, match=r"is malformed.*PanicException: called `Option::unwrap"):
        resolve_source(str(tiny_gguf))
    assert not any((cache / "models").glob("gguf-*")) and _hidden(cache) == []


def test_saorl_cache_verify_names_and_removes_a_damaged_entry(cache, converted, capsys):
    entry = _copy_into(cache, converted)
    assert main(["cache", "verify"]) == 0
    out = capsys.readouterr().out
    assert f"SAORL_CACHE={cache}): 1 entry" in out and f"ok       {entry.name}" in out
    _flip_block(entry)
    assert main(["cache", "verify", "--keep"]) == 2 and entry.exists()
    assert main(["cache", "verify"]) == 2
    out = capsys.readouterr().out
    assert f"DAMAGED  {entry.name}" in out and "model.safetensors has SHA-256" in out
    assert "Removed; the next run given the GGUF file with this SHA-256" in out and not entry.exists()


def test_saorl_cache_verify_says_a_pre_manifest_gguf_entry_is_converted_again(cache, converted, capsys):
    entry = _copy_into(cache, converted)
    (entry / MANIFEST).unlink()  # as saorl 0.1.0 left it: its next use converts it again
    assert main(["cache", "verify"]) == 0 and entry.exists()
    out = " ".join(capsys.readouterr().out.split())
    assert f"OLD {entry.name}" in out and "first use gives it one" not in out
    assert "the next run given the GGUF file with this SHA-256 (model.policy=PATH.gguf) converts it" in out


def test_a_pre_manifest_short_name_entry_in_a_read_only_cache_is_still_used(cache, converted, monkeypatch):
    sha = "cd" * 32
    monkeypatch.setitem(source.REGISTRY_MODELS, "tiny-test", RegistryModel(
        package="saorl-tiny-gguf", version="0.0.1", wheel_sha256=sha, member="t/tiny.gguf", about="tiny"))
    entry = _copy_into(cache, converted)
    legacy = cache / "models" / f"tiny-test-{sha[:16]}"
    os.rename(entry, legacy)
    (legacy / MANIFEST).unlink()

    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(cache_dir, "open", read_only, raising=False)  # the lock file cannot be made
    monkeypatch.setattr(gguf_source, "write_manifest", read_only)
    monkeypatch.setattr(gguf_source.subprocess, "run", lambda *a, **k: pytest.fail("downloaded again"))
    assert resolve_source("tiny-test") == legacy and not (legacy / MANIFEST).exists()
