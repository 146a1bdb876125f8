"""The non-finite guard (saorl.runtime.learner.nonfinite): the trial changes nothing, a guarded
step equals a plain one bit for bit, a step that would go non-finite is refused, and the guard
holds one chunk's copy, not the model's."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from saorl.models.tiny import build_tiny
from saorl.runtime.learner.nonfinite import CHUNK_BYTES, chunks, trial_step
from saorl.runtime.memory import reset_peak, status_mib

MIB = 2**20


def _model_and_opt(seed: int = 0):
    model = build_tiny("tiny-dense", seed=seed)
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() > 1]
    rest = [p for p in params if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=1e-3)
    return model, params, opt


def _grads(model, params, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=g)
    for p in params:
        p.grad = None
    model(input_ids=ids).logits.float().log_softmax(-1)[..., 3].sum().backward()


def _state(params, opt) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in params]
    for p in params:
        out += [v.clone() for v in opt.state.get(p, {}).values() if torch.is_tensor(v)]
    return out


@pytest.mark.parametrize("limit", [CHUNK_BYTES, 4096])
def test_a_guarded_step_equals_a_plain_one_bit_for_bit_and_the_trial_changes_nothing(limit):
    plain_model, plain_params, plain_opt = _model_and_opt()
    model, params, opt = _model_and_opt()
    assert len(chunks(params, opt, CHUNK_BYTES)) == 1  # the tiny model: one chunk by default
    for step in range(2):  # the first creates the AdamW state, the later ones read it
        _grads(plain_model, plain_params, step)
        _grads(model, params, step)
        before = [p.detach().clone() for p in params]
        state = _state(params, opt)
        finite, (moved, total) = trial_step(params, opt, limit)
        assert finite
        after_trial = _state(params, opt)
        assert len(after_trial) == len(state) and all(torch.equal(a, b) for a, b in zip(after_trial, state))
        assert all(p.grad is not None for p in params)  # kept for the real step
        plain_opt.step()
        opt.step()
        for a, b in zip(params, plain_params):
            assert torch.equal(a, b)
        for a, b in zip(_state(params, opt), _state(plain_params, plain_opt)):
            assert torch.equal(a, b)
        want_moved = sum(float(((p.detach() - b) ** 2).sum()) for p, b in zip(params, before))
        want_total = sum(float((b ** 2).sum()) for b in before)
        assert math.isclose(moved, want_moved, rel_tol=1e-5) and math.isclose(total, want_total, rel_tol=1e-6)
    if limit == 4096:
        assert len(chunks(params, opt, limit)) > 5  # many chunks were tried, one at a time


def test_a_step_that_would_go_non_finite_is_refused_and_nothing_moves():
    model, params, opt = _model_and_opt()
    _grads(model, params, 0)
    opt.step()  # state exists
    _grads(model, params, 1)
    state = _state(params, opt)
    for g in opt.param_groups:
        g["lr"] = math.inf
    finite, sums = trial_step(params, opt, 4096)
    assert not finite and sums == [0.0, 0.0]
    assert all(torch.equal(a, b) for a, b in zip(_state(params, opt), state))
    fresh_model, fresh_params, fresh_opt = _model_and_opt()
    for g in fresh_opt.param_groups:
        g["lr"] = math.inf
    _grads(fresh_model, fresh_params, 0)
    assert not trial_step(fresh_params, fresh_opt)[0]
    assert not fresh_opt.state  # the state a first step created is dropped again


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_the_guard_holds_one_chunk_not_a_copy_of_the_model_and_its_moments():
    torch.manual_seed(0)
    layers = [torch.nn.Linear(1024, 1024, bias=False) for _ in range(8)]  # 32 MiB, 96 with AdamW's moments
    params = [layer.weight for layer in layers]
    opt = torch.optim.AdamW(params, lr=1e-3)
    for _ in range(2):  # the first creates the moments, the second copies them too
        for p in params:
            p.grad = torch.randn_like(p)
        if not reset_peak():
            pytest.skip("this kernel refuses /proc/self/clear_refs")
        before = status_mib("self")
        assert trial_step(params, opt, limit=4 * MIB)[0]  # a chunk: one layer, 12 MiB with its moments
        grew = status_mib("self", "VmHWM") - before
        assert grew < 30, f"the trial's peak grew by {grew:.0f} MiB"
        opt.step()
    assert len(chunks(params, opt, 4 * MIB)) == 8
