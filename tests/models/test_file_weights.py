"""FileWeights: a safetensors file's tensors read one at a time, bit for bit what load_file reads,
a damaged file refused before any tensor is applied, and an update applied from it holding one
tensor at a time (measured in this process's RSS)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from saorl.models.hf_format import FileWeights
from saorl.models.tiny import build_tiny
from saorl.runtime.memory import reset_peak, status_mib


def test_the_tensors_are_load_file_s_bit_for_bit(tmp_path):
    state = {k: v.contiguous() for k, v in build_tiny("tiny-dense", seed=0).state_dict().items()
             if k != "lm_head.weight"}
    state["half"] = torch.randn(3, 5).to(torch.bfloat16)
    state["ids"] = torch.arange(7)
    state["scalar"] = torch.tensor(2.5)
    path = tmp_path / "w.safetensors"
    save_file(state, path)
    lazy, eager = FileWeights(path), load_file(str(path))
    assert set(lazy) == set(eager) and len(lazy) == len(eager)
    for k, v in eager.items():
        assert lazy.shape(k) == tuple(v.shape)
        got = lazy[k]
        assert got.dtype == v.dtype and torch.equal(got, v), k
    with pytest.raises(KeyError):
        lazy["nope"]


@pytest.mark.parametrize("damage", ["cut", "garbage", "empty"])
def test_a_damaged_file_is_refused_when_opened(tmp_path, damage):
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.randn(64, 64), "b": torch.randn(8)}, path)
    data = path.read_bytes()
    path.write_bytes({"cut": data[:-100], "garbage": b"\x07" * 500, "empty": b""}[damage])
    with pytest.raises(ValueError, match="not readable as safetensors"):
        FileWeights(path)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_an_update_applied_from_it_holds_a_tensor_at_a_time(tmp_path):
    path = tmp_path / "big.safetensors"
    n = 8 * 2**20  # 8 tensors of 32 MiB: 256 MiB in all
    save_file({f"w{i}": torch.full((n,), float(i)) for i in range(8)}, path)
    own = {f"w{i}": torch.zeros(n) for i in range(8)}

    def peak_while_applying(weights_of) -> float:
        if not reset_peak():
            pytest.skip("this kernel refuses /proc/self/clear_refs")
        before = status_mib("self")
        weights = weights_of(path)
        for k, t in weights.items():  # what LocalEngine._apply_update does
            own[k].copy_(t)
        del weights, t
        return status_mib("self", "VmHWM") - before

    lazy = peak_while_applying(FileWeights)
    assert all(torch.equal(own[f"w{i}"], torch.full((n,), float(i))) for i in range(8))
    eager = peak_while_applying(lambda p: load_file(str(p)))
    assert lazy < 100 and eager > 200, (lazy, eager)
