import json

import torch

from saorl.runtime.weights import FileWeightSync


def test_publish_poll_and_prune(tmp_path):
    sync = FileWeightSync(tmp_path, keep=2)
    assert sync.latest() is None and sync.load() is None
    for v in range(4):
        sync.publish({"w": torch.full((3,), float(v)), "b": torch.zeros(2)}, v)
    assert sync.latest() == (3, str(tmp_path / "v00000003.safetensors"))
    version, sd = sync.load()
    assert version == 3 and torch.equal(sd["w"], torch.full((3,), 3.0))
    assert sorted(p.name for p in tmp_path.glob("v*.safetensors")) == ["v00000002.safetensors",
                                                                       "v00000003.safetensors"]
    assert sync.load(version=0) is None  # pruned: the caller polls again
    # a stray temp file (a publisher killed mid-write) is never what the pointer names
    (tmp_path / "v00000009.safetensors.tmp").write_bytes(b"garbage")
    assert sync.load()[0] == 3


def test_second_reader_sees_publisher(tmp_path):
    writer, reader = FileWeightSync(tmp_path), FileWeightSync(tmp_path)
    writer.publish({"w": torch.ones(2)}, 7)
    assert reader.latest()[0] == 7
    assert torch.equal(reader.load()[1]["w"], torch.ones(2))


def test_checkpoint_named_versions_are_directories_in_buckets(tmp_path):
    from transformers import Qwen3Config

    from saorl.models.hf_format import INDEX

    sync = FileWeightSync(tmp_path, keep=2)
    sync.publish({"w": torch.zeros(2)}, 0)  # a file version, then directories: pruned together
    config = Qwen3Config(vocab_size=8, hidden_size=4, num_hidden_layers=1, num_attention_heads=1)
    for v in (1, 2):
        buckets = iter([{"a.weight": torch.full((2, 2), float(v))}, {"b.weight": torch.ones(3) * v}])
        sync.publish_checkpoint(buckets, v, config)
    assert sync.latest() == (2, str(tmp_path / "v00000002"))
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "latest.json", "v00000001", "v00000002"]
    index = json.loads((tmp_path / "v00000002" / INDEX).read_text())
    assert index["weight_map"] == {"a.weight": "model-00001-of-00002.safetensors",
                                   "b.weight": "model-00002-of-00002.safetensors"}
    assert index["metadata"]["total_size"] == 4 * 4 + 3 * 4
    assert json.loads((tmp_path / "v00000002" / "config.json").read_text())["model_type"] == "qwen3"
    version, tensors = sync.load()
    assert version == 2 and torch.equal(tensors["b.weight"], torch.full((3,), 2.0))
    assert sync.load(version=1)[1]["a.weight"].sum() == 4.0
