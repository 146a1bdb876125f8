"""What the token budget of one model pass (``trainer.max_tokens_per_microbatch``) does to an SAO
step's peak memory and time.

    python benchmarks/bench_microbatch.py MODEL --caps 4096,1024,512 --batch 16 --tokens 380

Each setting runs in a fresh process (so each peak is its own): the model loaded, ``--batch``
synthetic trajectories of ``--tokens`` tokens, the last ``--action-frac`` of each the action (as
``saorl bench step`` makes them: :func:`saorl.bench.step.trajectories`), a learner of the ``sao``
preset (``--critic-layers``: its ``critic_train_layers``) with that budget, and ``--steps`` steps;
the best step's seconds and the process's peak RSS (the kernel's high-water mark, so the step's
activations, gradients and AdamW moments are in it) are printed as a markdown table, each setting
against the first. The batch of a multi-turn task whose prompts are long (the calculator of
``bench_tta.py --task calc``: 16 trajectories of about 380 tokens, a tenth of them the action) is
the case this was written for: the whole batch fits one or two passes at the default 4096.

``--shared-prompt N`` makes the first N prompt tokens the same in every trajectory (that task's
tools system message is 299 tokens) and ``--shared-prefix both`` runs each budget without, then
with, ``trainer.shared_prefix`` (the common prefix held once per packed row):

    python benchmarks/bench_microbatch.py MODEL --caps 4096 --shared-prompt 299 --shared-prefix both
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def child(args: argparse.Namespace) -> dict:
    import resource

    import torch

    from saorl.algo.registry import get_preset
    from saorl.bench.step import trajectories
    from saorl.models.critic import Critic
    from saorl.models.loading import load_policy
    from saorl.runtime.learner.single import Learner, OptimConfig

    torch.set_num_threads(args.threads)
    policy = load_policy(args.model)
    trajs = trajectories(policy, args.batch, args.tokens, args.action_frac, shared=args.shared_prompt)
    preset = get_preset("sao").with_overrides(critic_train_layers=args.critic_layers)
    critic = Critic.from_policy(policy, seed=0)
    learner = Learner(policy, critic, preset, OptimConfig(policy_lr=1e-6, critic_lr=5e-6),
                      pad_id=policy.config.pad_token_id or 0, max_tokens_per_microbatch=args.cap,
                      shared_prefix=args.share == "on")
    best = None
    for _ in range(args.steps):
        t = time.perf_counter()
        learner.step(trajs)
        wall = time.perf_counter() - t
        best = wall if best is None else min(best, wall)
    return {"cap": args.cap, "share": args.share, "step_s": best,
            "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--caps", default="4096,1024,512", help="comma-separated token budgets of a pass")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--tokens", type=int, default=380)
    p.add_argument("--action-frac", type=float, default=0.1)
    p.add_argument("--critic-layers", type=int, default=None,
                   help="critic_train_layers (default: every block)")
    p.add_argument("--steps", type=int, default=1, help="steps per setting (the best counts)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--shared-prompt", type=int, default=0,
                   help="the first N prompt tokens the same in every trajectory (a system message)")
    p.add_argument("--shared-prefix", default="on", choices=["on", "off", "both"],
                   help="trainer.shared_prefix for each budget (both: off, then on)")
    p.add_argument("--cap", type=int, help=argparse.SUPPRESS)  # a child's one setting
    p.add_argument("--share", default="on", choices=["on", "off"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.cap is not None:
        print(json.dumps(child(args)), flush=True)
        return 0
    try:
        caps = [int(c) for c in args.caps.split(",") if c.strip()]
    except ValueError:
        p.error(f"--caps: comma-separated integers, got {args.caps!r}")
    if not caps or min(caps) < 1 or args.batch < 1 or args.tokens < 2 or args.steps < 1 \
            or args.shared_prompt < 0:
        p.error("--caps, --batch, --steps must be >= 1, --tokens >= 2 and --shared-prompt >= 0")
    shares = ["off", "on"] if args.shared_prefix == "both" else [args.shared_prefix]
    rows = []
    for cap, share in ((c, s) for c in caps for s in shares):
        cmd = [sys.executable, __file__, args.model, "--cap", str(cap), "--batch", str(args.batch),
               "--tokens", str(args.tokens), "--action-frac", str(args.action_frac), "--steps",
               str(args.steps), "--threads", str(args.threads), "--shared-prompt", str(args.shared_prompt),
               "--share", share]
        if args.critic_layers is not None:
            cmd += ["--critic-layers", str(args.critic_layers)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stderr[-2000:], file=sys.stderr)
            return 1
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"cap {cap}, shared prefix {share}: step {rows[-1]['step_s']:.1f} s, "
              f"peak {rows[-1]['peak_mib']:.0f} MiB", flush=True)
    first = rows[0]
    print(f"\n{args.model}: {args.batch} × {args.tokens} tokens ({args.action_frac:.0%} action, the first "
          f"{args.shared_prompt} the same in all), sao, critic_train_layers {args.critic_layers}, "
          f"{args.threads} thread(s), best of {args.steps}\n")
    print("| max_tokens_per_microbatch | shared prefix | SAO step | peak RSS | step / first | peak / first |")
    print("|---:|:-:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['cap']} | {r['share']} | {r['step_s']:.2f} s | {r['peak_mib']:,.0f} MiB | "
              f"{r['step_s'] / first['step_s']:.2f} | {r['peak_mib'] / first['peak_mib']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
