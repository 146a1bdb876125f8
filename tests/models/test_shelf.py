"""PolicyShelf: a policy in memory handed from one start-up phase to the next (saorl.models.shelf)."""

from __future__ import annotations

import pytest
import torch

from saorl.models.loading import load_policy
from saorl.models.packed import use_varlen_attention
from saorl.models.serialize import export_policy
from saorl.models.shelf import PolicyShelf
from saorl.models.tokenizer import load_tokenizer


def test_borrow_loads_once_and_keeps_it_take_removes_it():
    shelf = PolicyShelf()
    first = shelf.borrow("tiny-dense", seed=1)
    assert shelf.borrow("tiny-dense", seed=1) is first and shelf.loads == 1
    assert shelf.take("tiny-dense", seed=1) is first and len(shelf) == 0
    again = shelf.take("tiny-dense", seed=1)  # nothing held now: a load of its own
    assert again is not first and shelf.loads == 2


@pytest.mark.parametrize("other", [dict(seed=2), dict(dtype="bfloat16")])
def test_another_seed_or_dtype_is_another_model(other):
    shelf = PolicyShelf()
    held = shelf.borrow("tiny-dense", seed=1)
    model = shelf.take("tiny-dense", **{"seed": 1, **other})
    assert model is not held and shelf.loads == 2 and len(shelf) == 1
    if "dtype" in other:
        assert next(model.parameters()).dtype == torch.bfloat16


def test_a_trained_policy_put_back_is_what_its_export_loads(tmp_path):
    """SFT's hand-over: the trained model put on the shelf as its export directory equals a load of
    that directory (weights, attention implementation, mode, gradients) and is no load at all."""
    model = load_policy("tiny-moe", seed=3)
    attention = model.config._attn_implementation
    use_varlen_attention(model)
    model.train()
    model(input_ids=torch.randint(0, 300, (2, 12))).logits.sum().backward()
    torch.optim.AdamW(model.parameters(), lr=1e-2).step()
    out = export_policy(model, load_tokenizer(), tmp_path / "sft")
    shelf = PolicyShelf()
    shelf.put(str(out), model, attn_implementation=attention)
    held = shelf.take(str(out))
    loaded = load_policy(str(out))
    assert held is model and shelf.loads == 0
    assert not held.training and all(p.grad is None and p.requires_grad for p in held.parameters())
    assert held.config._attn_implementation == loaded.config._attn_implementation == attention
    assert held.name_or_path == loaded.name_or_path
    a, b = held.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids = torch.randint(0, 300, (1, 16))
    with torch.no_grad():
        assert torch.equal(held(input_ids=ids).logits, loaded(input_ids=ids).logits)


def test_a_bad_spec_fails_as_a_load_does():
    with pytest.raises(Exception, match="policy"):
        PolicyShelf().take("/no/such/model/dir")
