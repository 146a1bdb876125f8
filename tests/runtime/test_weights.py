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
