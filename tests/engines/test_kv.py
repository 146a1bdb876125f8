import pytest
import torch
from transformers import DynamicCache

from saorl.engines import kv


def make(batch, length, fill, layers=2):
    c = DynamicCache()
    for i in range(layers):
        k = torch.full((batch, 2, length, 3), float(fill + i))
        c.update(k, -k, i)
    return c


def test_merge_left_pads_both_sides_then_select_and_trim():
    a, b = make(2, 3, 1), make(1, 5, 7)
    mask_a = torch.tensor([[1, 1, 1], [0, 1, 1]])
    mask_b = torch.tensor([[0, 1, 1, 1, 1]])
    c, mask = kv.merge(a, mask_a, b, mask_b)
    assert mask.tolist() == [[0, 0, 1, 1, 1], [0, 0, 0, 1, 1], [0, 1, 1, 1, 1]]
    for i, layer in enumerate(c.layers):
        assert layer.keys.shape == (3, 2, 5, 3)
        assert torch.all(layer.keys[:2, :, :2] == 0) and torch.all(layer.keys[:2, :, 2:] == 1 + i)
        assert torch.all(layer.keys[2] == 7 + i) and torch.all(layer.values[2] == -(7 + i))
    mask = kv.select_rows(c, mask, torch.tensor([0, 1]))
    mask = kv.trim(c, mask)
    assert mask.tolist() == [[1, 1, 1], [0, 1, 1]]
    assert c.layers[0].keys.shape == (2, 2, 3, 3) and torch.all(c.layers[1].keys == 2)
    assert c.get_seq_length() == 3


def test_zero_padding_removes_nan_in_padding_only():
    c = make(2, 3, 1)
    c.layers[0].keys[1, :, 0] = float("nan")
    kv.zero_padding(c, torch.tensor([[1, 1, 1], [0, 1, 1]]))
    assert not torch.isnan(c.layers[0].keys).any()
    assert torch.all(c.layers[0].keys[1, :, 0] == 0) and torch.all(c.layers[0].keys[0] == 1)


def test_layers_other_than_full_or_sliding_attention_are_refused_and_sliding_ones_get_full_layers():
    from types import SimpleNamespace

    from transformers.cache_utils import DynamicLayer

    def config(types, window=None):
        text = SimpleNamespace(layer_types=types, sliding_window=window, num_hidden_layers=len(types))
        text.get_text_config = lambda decoder=True: text
        return text

    with pytest.raises(ValueError, match=r"sliding-window-attention layers only; .* \['linear_attention'\]"):
        kv.check_supported(config(["full_attention", "linear_attention"]))
    hybrid = config(["sliding_attention", "full_attention"], window=512)
    kv.check_supported(hybrid)
    assert kv.sliding_window(hybrid) == 512 and kv.sliding_window(config(["full_attention"], 512)) is None
    cache = kv.new_cache(hybrid)
    assert [type(layer) for layer in cache.layers] == [DynamicLayer, DynamicLayer]
