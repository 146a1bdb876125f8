"""The local engine's oneDNN-packed linear layers: equal to ``nn.Linear`` up to float32 rounding,
repacked after every weight update, active only inside the engine's own forwards."""

import threading

import pytest
import torch

from saorl.engines import LocalEngine, SamplingParams
from saorl.engines.packed import PackedLinears, packing_available
from saorl.models.tiny import build_tiny
from tests.engines.conftest import PROMPTS

pytestmark = pytest.mark.skipif(not packing_available(build_tiny("tiny-dense")),
                                reason="this torch build packs no linear weights (no oneDNN)")
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=12, seed=3)


def logits(model, ids):
    with torch.inference_mode():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("kind", ["tiny-dense", "tiny-moe"])
def test_packed_forward_equals_linear_and_leaves_the_model_as_it_was(kind):
    model = build_tiny(kind, seed=1).eval()
    ids = torch.randint(2, 1000, (3, 17), generator=torch.Generator().manual_seed(0))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plain = logits(model, ids)
    packed = PackedLinears(model)
    assert len(packed.layers) == sum(type(m) is torch.nn.Linear for m in model.modules()) > 0
    assert torch.equal(logits(model, ids), plain)  # outside the block: the layers' own forward
    with packed.active():
        inside = logits(model, ids)
    torch.testing.assert_close(inside, plain, rtol=1e-4, atol=1e-4)
    assert torch.equal(logits(model, ids), plain)
    packed.remove()
    assert all("forward" not in vars(m) for m in packed.layers)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_only_the_thread_inside_the_block_uses_the_packed_copies():
    """Another thread (a scorer, a trainer) on the same model sees plain layers while the engine's
    thread is inside ``active()``; gradients flow there as through any ``nn.Linear``."""
    model = build_tiny("tiny-dense", seed=1)
    ids = torch.randint(2, 1000, (2, 9), generator=torch.Generator().manual_seed(0))
    plain = logits(model, ids)
    packed = PackedLinears(model)
    seen = {}
    inside, done = threading.Event(), threading.Event()

    def engine_thread():
        with packed.active():
            inside.set()
            done.wait(10)

    t = threading.Thread(target=engine_thread)
    t.start()
    inside.wait(10)
    seen["logits"] = logits(model, ids)
    loss = model(input_ids=ids).logits.square().mean()
    loss.backward()
    done.set()
    t.join()
    assert torch.equal(seen["logits"], plain)
    assert all(m.weight.grad is not None and m.weight.grad.abs().sum() > 0 for m in packed.layers)


def test_a_linear_with_bias_on_3d_input():
    layer = torch.nn.Linear(24, 40, bias=True)
    model = torch.nn.Sequential(layer)
    x = torch.randn(2, 5, 24)
    packed = PackedLinears(model)
    with torch.inference_mode(), packed.active():
        out = model(x)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, layer.weight, layer.bias).detach(),
                               rtol=1e-5, atol=1e-5)


def test_a_layer_whose_forward_was_replaced_is_left_alone():
    model = build_tiny("tiny-dense", seed=1)
    first = next(m for m in model.modules() if type(m) is torch.nn.Linear)
    first.forward = lambda x: torch.nn.Linear.forward(first, x)
    packed = PackedLinears(model)
    assert first not in packed.layers and len(packed.layers) > 0
    packed.remove()
    assert "forward" in vars(first)


def test_the_packed_copies_are_the_weights_at_packing_time():
    model = build_tiny("tiny-dense", seed=1).eval()
    ids = torch.randint(2, 1000, (2, 9), generator=torch.Generator().manual_seed(0))
    packed = PackedLinears(model)
    with torch.no_grad():
        for m in packed.layers:
            m.weight.mul_(1.5)
    changed = logits(model, ids)
    with packed.active():
        stale = logits(model, ids)
    assert (stale - changed).abs().max() > 1e-2  # still the old weights: the engine must repack
    packed.repack()
    with packed.active():
        torch.testing.assert_close(logits(model, ids), changed, rtol=1e-4, atol=1e-4)
    packed.remove()


@pytest.mark.parametrize("kind", ["tiny-dense", "tiny-moe"])
def test_engine_packed_samples_as_the_plain_engine(kind, tok):
    prompts = [tok.encode(s) for s in PROMPTS]
    out = {}
    for pack in (True, False):
        model = build_tiny(kind, seed=0)
        with LocalEngine(model, tok, max_batch_size=4, pack_weights=pack) as eng:
            assert (eng._packed is not None) == pack
            out[pack] = eng.generate(prompts, SAMPLED)
        assert all("forward" not in vars(m) for m in model.modules())  # close() gave the layers back
    for a, b in zip(out[True], out[False], strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-4)


def test_engine_repacks_after_a_weight_update(tok):
    """After an update the packed engine samples from the new weights: its log-probs match a plain
    engine built on them, and differ from its own before the update."""
    prompts = [tok.encode(s) for s in PROMPTS]
    new = build_tiny("tiny-dense", seed=7).state_dict()
    sampled = SamplingParams(temperature=1.0, max_new_tokens=8, seed=5)
    with LocalEngine(build_tiny("tiny-dense", seed=0), tok, max_batch_size=4) as eng:
        old = eng.generate(prompts, sampled)
        eng.update_weights(new, version=1)
        after = eng.generate(prompts, sampled)
    ref_model = build_tiny("tiny-dense", seed=0)
    ref_model.load_state_dict(new)
    with LocalEngine(ref_model, tok, max_batch_size=4, pack_weights=False) as ref_eng:
        ref = ref_eng.generate(prompts, sampled)
    for a, r in zip(after, ref, strict=True):
        assert a.token_ids == r.token_ids and a.versions == [1] * len(a.token_ids)
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(r.logprobs), rtol=0, atol=1e-4)
    assert any(a.token_ids != o.token_ids for a, o in zip(after, old, strict=True))


def test_no_packing_for_weights_it_cannot_pack(tok):
    model = build_tiny("tiny-dense", seed=0).to(torch.bfloat16)
    assert not packing_available(model)
    with LocalEngine(model, tok, max_batch_size=2) as eng:
        assert eng._packed is None
        res = eng.generate([tok.encode("a")], SamplingParams(temperature=0.0, max_new_tokens=4))
    assert len(res[0].token_ids) == 4
