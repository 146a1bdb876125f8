"""What one critic step costs on a real model: frozen attention (the SAO default), all weights, or
a LoRA adapter in the trunk (``model.lora.critic``: the trunk frozen whole, the adapter and the
value head trained).

    python benchmarks/bench_real_critic.py MODEL_DIR frozen     # then: ... all, ... lora

One process per design, so its peak RSS is its own. The critic is copied from the policy
(:meth:`saorl.models.critic.Critic.from_policy`), the policy dropped, and ``--steps`` AdamW steps
of a value loss on random ids of ``--batch`` × ``--tokens`` are timed, one thread by default
(``--threads``). Prints the trainable parameters, each step's seconds and the peak RSS.
Measured on SmolLM2-135M-Instruct in docs/real-model.md.
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from saorl.models.critic import Critic
from saorl.models.loading import load_policy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("design", choices=["frozen", "all", "lora"])
    p.add_argument("--rank", type=int, default=8, help="the LoRA rank (design lora)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    policy = load_policy(args.model)
    vocab = policy.config.vocab_size
    critic = Critic.from_policy(policy, seed=0)
    del policy
    if args.design == "lora":
        from saorl.config.sections import LORA_TARGETS
        from saorl.models.lora import attach_critic_lora

        attach_critic_lora(critic, rank=args.rank, alpha=2.0 * args.rank, dropout=0.0,
                           targets=list(LORA_TARGETS), optional=tuple(LORA_TARGETS))
    else:
        critic.set_frozen_attention(args.design == "frozen")
    params = critic.trainable_parameters()
    trainable, total = sum(p.numel() for p in params), sum(p.numel() for p in critic.parameters())
    opt = torch.optim.AdamW(params, lr=1e-5)
    ids = torch.randint(0, vocab, (args.batch, args.tokens))
    mask = torch.ones_like(ids)
    critic.train()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        (critic(ids, mask).float() ** 2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{args.design}: trainable {trainable / 1e6:.1f}M of {total / 1e6:.1f}M; step of {args.batch}x"
          f"{args.tokens} tokens: {' '.join(f'{x:.1f}' for x in times)} s; peak RSS {peak:.0f} MiB")


if __name__ == "__main__":
    main()
