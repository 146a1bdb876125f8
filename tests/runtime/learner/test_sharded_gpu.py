"""The sharded learner on CUDA: NCCL, bfloat16, activation checkpointing (skipped without a GPU).

The same comparison as ``test_sharded.py`` over NCCL with as many ranks as there are GPUs (at
most 2; one GPU still runs the NCCL path), on the dense cases (two of them in several
micro-batches per rank): the tiny MoE's ``grouped_mm``
experts need bfloat16 on CUDA. Then one bfloat16 SAO step with activation checkpointing on the
tiny MoE, in one process.
"""

from __future__ import annotations

import math

import pytest
import torch
from shard_helpers import OPTIM, PAD, launch, models, trajectories
from test_sharded import check_step

from saorl.algo.registry import get_preset
from saorl.models.loading import checkpoint_activations
from saorl.runtime.learner.single import Learner

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA device (NCCL ranks, bfloat16 on the GPU)")]


def test_nccl_sharded_step_equals_single_process_step(tmp_path):
    names = ["dense_sao", "dense_grpo", "dense_rm", "mb_dense_sao_padded", "mb_dense_grpo_packed"]
    launch(tmp_path, world=min(2, torch.cuda.device_count()), device="cuda", names=names)
    torch.backends.cuda.matmul.allow_tf32 = False
    for name in names:
        check_step(tmp_path, name, device="cuda")


def test_bf16_step_with_activation_checkpointing_on_gpu():
    policy, critic = models("tiny-moe", "sao")
    trajs, gids = trajectories(policy, 4, 1)
    policy, critic = policy.to("cuda", torch.bfloat16), critic.to("cuda")
    critic.trunk.to(torch.bfloat16)
    checkpoint_activations(policy, critic.trunk)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    learner = Learner(policy, critic, get_preset("sao"), OPTIM, pad_id=PAD, device="cuda")
    metrics = learner.step(trajs, gids)
    assert math.isfinite(metrics["policy/loss"]) and math.isfinite(metrics["critic/value_loss"])
    assert metrics["policy/version"] == 1
    assert any(not torch.equal(v, before[k]) for k, v in policy.state_dict().items())
