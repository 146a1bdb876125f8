import json

import torch

from saorl.runtime.weights.files import FilePublisher, FileSource, WeightNames


def test_publish_poll_and_prune(tmp_path):
    sync, source = FilePublisher(tmp_path, keep=2), FileSource(tmp_path)
    assert source.latest() is None and source.load() is None
    for v in range(4):
        sync.publish([{"w": torch.full((3,), float(v)), "b": torch.zeros(2)}], v)
    assert source.latest() == (3, str(tmp_path / "v00000003.safetensors"))
    version, sd = source.load()
    assert version == 3 and torch.equal(sd["w"], torch.full((3,), 3.0))
    assert sorted(p.name for p in tmp_path.glob("v*.safetensors")) == ["v00000002.safetensors",
                                                                       "v00000003.safetensors"]
    assert source.load(version=0) is None  # pruned: the caller polls again
    # a stray temp file (a publisher killed mid-write) is never what the pointer names
    (tmp_path / "v00000009.safetensors.tmp").write_bytes(b"garbage")
    assert source.load()[0] == 3


def test_second_reader_sees_publisher(tmp_path):
    writer, reader = FilePublisher(tmp_path), FileSource(tmp_path)
    writer.publish([{"w": torch.ones(2)}], 7)
    assert reader.latest()[0] == 7
    assert torch.equal(reader.load()[1]["w"], torch.ones(2))


def test_checkpoint_named_versions_are_directories_in_buckets(tmp_path):
    from transformers import Qwen3Config

    from saorl.models.hf_format import INDEX

    sync, source = FilePublisher(tmp_path, keep=2), FileSource(tmp_path)
    sync.publish([{"w": torch.zeros(2)}], 0)  # a file version, then directories: pruned together
    config = Qwen3Config(vocab_size=8, hidden_size=4, num_hidden_layers=1, num_attention_heads=1)
    for v in (1, 2):
        buckets = iter([{"a.weight": torch.full((2, 2), float(v))}, {"b.weight": torch.ones(3) * v}])
        sync.publish(buckets, v, WeightNames.checkpoint(config))
    assert source.latest() == (2, str(tmp_path / "v00000002"))
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "latest.json", "v00000001", "v00000002"]
    index = json.loads((tmp_path / "v00000002" / INDEX).read_text())
    assert index["weight_map"] == {"a.weight": "model-00001-of-00002.safetensors",
                                   "b.weight": "model-00002-of-00002.safetensors"}
    assert index["metadata"]["total_size"] == 4 * 4 + 3 * 4
    assert json.loads((tmp_path / "v00000002" / "config.json").read_text())["model_type"] == "qwen3"
    version, tensors = source.load()
    assert version == 2 and torch.equal(tensors["b.weight"], torch.full((3,), 2.0))
    assert source.load(version=1)[1]["a.weight"].sum() == 4.0


def test_model_names_merge_the_buckets_into_one_file_and_the_newest_version_is_on_record(tmp_path):
    sync, source = FilePublisher(tmp_path), FileSource(tmp_path)
    assert sync.published_version() is None
    sync.publish(iter([{"a": torch.ones(2)}, {"b": torch.zeros(3)}]), 4)
    assert source.latest() == (4, str(tmp_path / "v00000004.safetensors"))
    assert sorted(source.load()[1]) == ["a", "b"]
    assert sync.published_version() == 4
    # a resumed trainer's publisher reads the version an earlier process published
    assert FilePublisher(tmp_path).published_version() == 4


def test_a_lower_version_published_last_stays_loadable(tmp_path):
    # the reproduction of a resume from an older checkpoint: 11, 12, 13 on disk, then 10
    sync, source = FilePublisher(tmp_path, keep=3), FileSource(tmp_path)
    for v in (11, 12, 13, 10):
        sync.publish([{"w": torch.full((2,), float(v))}], v)
    assert source.latest() == (10, str(tmp_path / "v00000010.safetensors"))
    version, sd = source.load()
    assert version == 10 and torch.equal(sd["w"], torch.full((2,), 10.0))
    # pruned by publication order: the oldest publication (11) went, not the lowest number (10)
    assert sorted(p.name for p in tmp_path.glob("v*.safetensors")) == [
        "v00000010.safetensors", "v00000012.safetensors", "v00000013.safetensors"]


def test_files_of_an_earlier_process_go_first_and_the_pointer_file_never(tmp_path):
    old = FilePublisher(tmp_path, keep=2)
    for v in (20, 21):
        old.publish([{"w": torch.zeros(1)}], v)
    # a resumed trainer: it publishes 5 and 6
    new, source = FilePublisher(tmp_path, keep=2), FileSource(tmp_path)
    new.publish([{"w": torch.ones(1)}], 5)
    assert source.load()[0] == 5
    new.publish([{"w": torch.ones(1)}], 6)
    assert sorted(p.name for p in tmp_path.glob("v*.safetensors")) == ["v00000005.safetensors",
                                                                       "v00000006.safetensors"]
    assert source.load()[0] == 6


def test_adapters_are_versioned_directories_pruned_like_full_weights(tmp_path):
    sync, source = FilePublisher(tmp_path, keep=2), FileSource(tmp_path)
    config = {"r": 1, "lora_alpha": 2.0, "peft_type": "LORA"}
    for v in (1, 2, 3):
        a = {"base_model.model.layer.lora_A.weight": torch.full((1, 2), float(v)),
             "base_model.model.layer.lora_B.weight": torch.zeros(2, 1)}
        sync.publish([a], v, WeightNames.adapter(config))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.json", "v00000002-adapter",
                                                          "v00000003-adapter"]
    assert json.loads((tmp_path / "latest.json").read_text()) == {"version": 3, "file": "v00000003-adapter"}
    version, path = source.latest()
    assert (version, path) == (3, str(tmp_path / "v00000003-adapter"))
    saved = json.loads((tmp_path / "v00000003-adapter" / "adapter_config.json").read_text())
    assert saved == config
    v, tensors = source.load()
    assert v == 3 and torch.equal(tensors["base_model.model.layer.lora_A.weight"], torch.full((1, 2), 3.0))
    assert torch.equal(source.load(2)[1]["base_model.model.layer.lora_A.weight"], torch.full((1, 2), 2.0))
    assert not list(tmp_path.glob("*.tmp*"))  # written atomically: no temporary left behind
