"""MoE routing perturbation, recording and replay on the tiny Qwen3-MoE."""

from __future__ import annotations

import copy

import pytest
import torch

from saorl.models.routing import num_moe_layers, perturb_routing, record_routes, replay_routes
from saorl.models.tiny import build_tiny


@pytest.fixture(scope="module")
def ids():
    g = torch.Generator().manual_seed(0)
    return torch.randint(2, 1000, (3, 17), generator=g)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _routes(record, batch, seq):
    """One forward's recorded routes as ``[B, T, L, k]``."""
    return torch.stack([layer[-1] for layer in record], dim=1).reshape(batch, seq, len(record), -1)


def test_the_explicit_router_is_the_models_own(ids):
    plain = build_tiny("tiny-moe", seed=1)
    explicit = copy.deepcopy(plain)
    with record_routes(explicit) as rec:
        out = _logits(explicit, ids)
    torch.testing.assert_close(out, _logits(plain, ids), rtol=0, atol=0)
    assert len(rec) == num_moe_layers(plain) == 4 and rec[0][-1].shape == (3 * 17, 2)


@pytest.mark.parametrize("perturbation", [{"top_k": 3}, {"top_k": 1}, {"noise_std": 1.0},
                                          {"top_k": 3, "noise_std": 0.5}])
def test_replaying_the_engines_routes_reproduces_its_forward(ids, perturbation):
    trainer = build_tiny("tiny-moe", seed=2)
    engine = copy.deepcopy(trainer)
    perturb_routing(engine, seed=7, **perturbation)
    with record_routes(engine) as rec:
        engine_out = _logits(engine, ids)
    routes = _routes(rec, *ids.shape)
    k = perturbation.get("top_k", 2)
    assert routes.shape == (3, 17, 4, k)
    plain_out = _logits(trainer, ids)
    assert (plain_out - engine_out).abs().max() > 1e-3  # the perturbation does change the forward
    with replay_routes(trainer, routes):
        replayed = _logits(trainer, ids)
    torch.testing.assert_close(replayed, engine_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_logits(trainer, ids), plain_out, rtol=0, atol=0)  # replay ends with the block


def test_unrecorded_positions_route_as_usual_and_gradients_reach_the_router(ids):
    model = build_tiny("tiny-moe", seed=3)
    with record_routes(model) as rec:
        base = _logits(model, ids)
    routes = torch.full_like(_routes(rec, *ids.shape), -1)
    with replay_routes(model, routes):
        out = model(input_ids=ids).logits
    torch.testing.assert_close(out.detach(), base, rtol=0, atol=0)
    out.sum().backward()
    gate = model.model.layers[0].mlp.gate.weight
    assert gate.grad is not None and gate.grad.abs().sum() > 0


def test_bad_use_is_a_clear_error(ids):
    with pytest.raises(ValueError, match="no top-k MoE routers"):
        perturb_routing(build_tiny("tiny-dense", seed=0), top_k=2)
    model = build_tiny("tiny-moe", seed=0)
    with pytest.raises(ValueError, match="more than the model's 8 experts"):
        perturb_routing(model, top_k=9)
    with (pytest.raises(ValueError, match=r"routes must be \[B, T, layers=4, k\]"),
          replay_routes(model, torch.zeros(3, 17, 2, 2, dtype=torch.long))):
        pass
    with pytest.raises(ValueError, match="replayed routes cover 6 positions"), \
            replay_routes(model, torch.zeros(1, 6, 4, 2, dtype=torch.long)):
        _logits(model, ids)
