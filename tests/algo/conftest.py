"""Random ragged agent batches for the algo tests: prompt, interleaved action / observation
segments, padding on either side, and the odd row with no action token at all."""

import pytest
import torch


def make_ragged_batch(seed: int, batch: int = 6, length: int = 24, dtype=torch.float64):
    """Returns dict(rewards, values, action_mask, response_mask), all [B, T].

    Rewards are non-zero at random positions of every kind (prompt, action, observation, padding);
    values are random everywhere. Row 0 has no action token when ``batch > 3``.
    """
    g = torch.Generator().manual_seed(seed)
    action = torch.zeros(batch, length, dtype=torch.long)
    response = torch.zeros(batch, length, dtype=torch.long)
    for b in range(batch):
        if b == 0 and batch > 3:
            continue  # a row with no action (all prompt)
        left_pad = int(torch.randint(0, 4, (1,), generator=g)) if b % 2 else 0
        t = left_pad + int(torch.randint(1, 4, (1,), generator=g))  # prompt
        while t < length - 1 and torch.rand(1, generator=g).item() < 0.9:
            n_act = int(torch.randint(1, 5, (1,), generator=g))
            action[b, t : t + n_act] = 1
            response[b, t : t + n_act] = 1
            t += n_act
            n_obs = int(torch.randint(0, 4, (1,), generator=g))
            response[b, t : t + n_obs] = 1
            t += n_obs
    rewards = torch.randn(batch, length, generator=g, dtype=dtype)
    rewards = rewards * (torch.rand(batch, length, generator=g) < 0.3)
    values = torch.randn(batch, length, generator=g, dtype=dtype)
    return {"rewards": rewards, "values": values, "action_mask": action[:, :length],
            "response_mask": response[:, :length]}


@pytest.fixture
def ragged_batch():
    return make_ragged_batch
