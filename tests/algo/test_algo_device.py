"""The algo functions give the same numbers on CUDA as on CPU (skipped without a GPU)."""

import pytest
import torch

from saorl.algo import (
    dis_policy_loss,
    grpo_advantages,
    length_adaptive_lambda,
    ppo_clip_loss,
    skip_observation_gae,
    value_loss,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_gae_and_losses_match_cpu_on_cuda(ragged_batch):
    d = ragged_batch(3)
    lam = length_adaptive_lambda(d["action_mask"], 0.5)
    cpu = skip_observation_gae(d["rewards"], d["values"], d["action_mask"], 0.99, lam)
    on_gpu = [d[k].cuda() for k in ("rewards", "values", "action_mask")]
    cuda = skip_observation_gae(*on_gpu, 0.99, lam.cuda())
    for a, b in zip(cpu, cuda):
        torch.testing.assert_close(a, b.cpu())
    adv, mask = cpu[0], d["action_mask"]
    logprobs = (d["values"] * 0.3 - 1).requires_grad_(True)
    rollout = torch.full_like(logprobs, -1.0)
    for fn in (dis_policy_loss, ppo_clip_loss):
        loss, m = fn(logprobs, rollout, adv, mask, 0.2, 0.28)
        lp_cuda = logprobs.detach().cuda().requires_grad_(True)
        loss_c, m_c = fn(lp_cuda, rollout.cuda(), adv.cuda(), mask.cuda(), 0.2, 0.28)
        torch.testing.assert_close(loss, loss_c.cpu())
        assert m == pytest.approx(m_c)
        (g,) = torch.autograd.grad(loss, logprobs)
        (g_c,) = torch.autograd.grad(loss_c, lp_cuda)
        torch.testing.assert_close(g, g_c.cpu())
    vl, _ = value_loss(d["values"], cpu[1], mask)
    vl_c, _ = value_loss(d["values"].cuda(), cpu[1].cuda(), mask.cuda())
    torch.testing.assert_close(vl, vl_c.cpu())
    scores, groups = torch.randn(6), torch.tensor([0, 0, 1, 1, 1, 2])
    torch.testing.assert_close(grpo_advantages(scores, groups, mask),
                               grpo_advantages(scores.cuda(), groups.cuda(), mask.cuda()).cpu())
