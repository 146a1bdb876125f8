"""collate: exact tensors on a hand-written pair, padding contents, JSONL round trip, errors."""

from __future__ import annotations

import pytest
import torch

from saorl.data.batch import Batch, BatchError, collate
from saorl.data.trajectory import Trajectory

PAD = 1


def _pair() -> list[Trajectory]:
    # a: prompt [5, 6], action 7, observation 8, action 9 (reward on the last action)
    a = Trajectory(token_ids=[5, 6, 7, 8, 9], action_mask=[0, 0, 1, 0, 1],
                   rollout_logprobs=[0.0, 0.0, -0.5, 0.0, -0.25], rewards=[0.0, 0.0, 0.0, 0.0, 1.0],
                   versions=[-1, -1, 3, -1, 4], prompt_len=2, task_id="a")
    # b: prompt [10], two actions; garbage logprob / version on its prompt token must not leak
    b = Trajectory(token_ids=[10, 11, 12], action_mask=[0, 1, 1], rollout_logprobs=[-7.0, -1.0, -2.0],
                   rewards=[0.0, 0.0, 0.5], versions=[9, 2, 2], prompt_len=1, task_id="b")
    return [a, b]


def test_collate_exact_values():
    batch = collate(_pair(), pad_id=PAD)
    assert batch.size == len(batch) == 2 and batch.seq_len == 5
    torch.testing.assert_close(batch.input_ids, torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, PAD, PAD]]))
    torch.testing.assert_close(batch.attention_mask, torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]))
    torch.testing.assert_close(batch.action_mask, torch.tensor([[0.0, 0, 1, 0, 1], [0, 1, 1, 0, 0]]))
    torch.testing.assert_close(batch.response_mask, torch.tensor([[0.0, 0, 1, 1, 1], [0, 1, 1, 0, 0]]))
    torch.testing.assert_close(batch.rollout_logprobs,
                               torch.tensor([[0.0, 0, -0.5, 0, -0.25], [0, -1.0, -2.0, 0, 0]]))
    torch.testing.assert_close(batch.rewards, torch.tensor([[0.0, 0, 0, 0, 1.0], [0, 0, 0.5, 0, 0]]))
    torch.testing.assert_close(batch.versions, torch.tensor([[-1, -1, 3, -1, 4], [-1, 2, 2, -1, -1]]))
    assert batch.input_ids.dtype == torch.int64 and batch.versions.dtype == torch.int64
    assert batch.action_mask.dtype == torch.float32 and batch.rollout_logprobs.dtype == torch.float32


def test_rows_follow_the_given_order():
    a, b = _pair()
    batch = collate([b, a, b, a, b], pad_id=0)
    assert batch.input_ids[1].tolist() == [5, 6, 7, 8, 9] and batch.input_ids[0, 3:].tolist() == [0, 0]


def test_masks_agree_with_a_naive_loop_on_random_trajectories():
    g = torch.Generator().manual_seed(0)
    trajs = []
    for i in range(6):
        n = int(torch.randint(2, 12, (1,), generator=g))
        p = int(torch.randint(1, n, (1,), generator=g))
        act = [0] * p + torch.randint(0, 2, (n - p,), generator=g).tolist()
        trajs.append(Trajectory(token_ids=torch.randint(2, 50, (n,), generator=g).tolist(), action_mask=act,
                                rollout_logprobs=[-0.1 * m for m in act], rewards=[0.0] * (n - 1) + [1.0],
                                versions=[i if m else -1 for m in act], prompt_len=p, task_id=str(i % 2)))
    batch = collate(trajs, pad_id=PAD)
    for b, tr in enumerate(trajs):
        for t in range(batch.seq_len):
            real = t < len(tr)
            assert batch.attention_mask[b, t] == int(real)
            assert batch.response_mask[b, t] == float(tr.prompt_len <= t < len(tr))
            assert batch.action_mask[b, t] == (tr.action_mask[t] if real else 0)
            assert batch.input_ids[b, t] == (tr.token_ids[t] if real else PAD)
            assert batch.rewards[b, t] == pytest.approx(tr.rewards[t] if real else 0.0)
    assert batch.rewards.sum().item() == pytest.approx(6.0)
    assert bool(((batch.versions >= 0) == batch.action_mask.bool()).all())


def test_jsonl_to_trajectory_to_collate(tmp_path):
    path = tmp_path / "trajs.jsonl"
    path.write_text("".join(t.to_json() + "\n" for t in _pair()))
    back = [Trajectory.from_json(line) for line in path.read_text().splitlines()]
    direct, via_file = collate(_pair(), PAD), collate(back, PAD)
    for name in ("input_ids", "attention_mask", "action_mask", "response_mask", "rollout_logprobs", "rewards",
                 "versions"):
        torch.testing.assert_close(getattr(via_file, name), getattr(direct, name), rtol=0, atol=0)


def test_to_moves_every_tensor_and_keeps_dtypes():
    batch = collate(_pair(), PAD)
    moved = batch.to("meta")
    assert isinstance(moved, Batch)
    for name in ("input_ids", "action_mask", "versions", "rewards"):
        assert getattr(moved, name).device.type == "meta"
        assert getattr(moved, name).dtype == getattr(batch, name).dtype
    assert batch.input_ids.device.type == "cpu"


def test_too_long_trajectory_raises_instead_of_truncating():
    with pytest.raises(BatchError, match=r"trajectory 0 \(task 'a'\) has 5 tokens, more than max_len=4"):
        collate(_pair(), PAD, max_len=4)
    assert collate(_pair(), PAD, max_len=5).seq_len == 5


@pytest.mark.parametrize(("trajs", "pad", "match"),
                         [([], 0, "empty"), (None, -1, "pad_id"), (None, 1.0, "pad_id")])
def test_bad_input(trajs, pad, match):
    with pytest.raises(BatchError, match=match):
        collate(_pair() if trajs is None else trajs, pad)
