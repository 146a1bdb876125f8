"""``saorl bench step``: one SAO trainer step of a real model against this machine's matmul peak.

What it measures, in one process, with the trainer's threads:

1. **The matmul peak**: the best of a few ``n × n`` by ``n × n`` products (``n`` 1024 by default)
   in float32, and in bfloat16 where the device computes it, as FLOP/s (``2·n³`` a product).
2. **The SAO step** of :class:`~saorl.runtime.learner.single.Learner` on the model (the critic a
   copy of it, attention frozen, K = 2) on ``batch`` synthetic trajectories of ``tokens`` tokens,
   the last ``action_frac`` of each the action (log-probs recorded as the policy's own, so every
   DIS ratio is 1 and every token trains); one warm-up step, then ``steps`` timed ones. The
   learner's own timings split each step (policy forward, policy backward, critic passes,
   advantages, collate), and an AdamW step of the policy and of the critic is timed alone, so the
   backward is separated from the optimizer.
3. **The vocabulary projection and log-softmax** of the policy's forward + backward, timed alone
   on the step's positions (the part a 49k-token vocabulary adds).

FLOPs are counted, not measured: a forward pass costs ``2·N`` a position (``N`` the parameters the
pass multiplies by: the layers, the active experts of an MoE, plus the vocabulary projection for
the policy) plus the causal attention's ``2·layers·T·width`` (``T`` the trajectory's tokens,
``width`` query heads × head dim); a policy backward twice the forward (input and weight
gradients); a critic backward the input gradients (``2·layers`` a position, and twice the
attention's forward) plus the weight gradients of its trainable parameters (``2·trainable``). Achieved FLOP/s
is the step's FLOPs over its seconds; its fraction of the float32 peak says how far the step is
from what this machine's matmuls do. Peak memory: the process's peak RSS per phase (loading the
model and building the critic and learner, the warm-up step, the timed steps, the optimizer and
vocabulary timings: :mod:`saorl.runtime.memory`), and CUDA's peak allocation on a GPU.

The DIS ratios of the first step compare the learner's scoring with the float32 log-probs the
same weights recorded: numerics alone (the learner's packed attention against a padded pass, or
bfloat16 autocast against float32); those of the last step include the updates since.
"""

from __future__ import annotations

import contextlib
import random
import time
from dataclasses import dataclass

import torch

from saorl.algo.registry import get_preset
from saorl.data.trajectory import Episode, Trajectory
from saorl.models.critic import Critic
from saorl.models.loading import load_policy, sync_device
from saorl.models.logprobs import chunked_logprobs, decoder_and_head, scored_logprobs, token_logprobs
from saorl.runtime.learner.single import Learner, OptimConfig
from saorl.runtime.memory import MemoryWatch, format_memory


@dataclass(frozen=True)
class StepSpec:
    model: str
    batch: int = 8
    tokens: int = 128
    action_frac: float = 0.5
    steps: int = 2
    threads: int | None = None
    device: str = "cpu"
    matmul_n: int = 1024
    autocast: bool = False
    """Run the steps under bfloat16 autocast (the weights, optimizer and rollout log-probs stay
    float32): its time, and the DIS ratio's spread it causes against float32 log-probs."""


def matmul_peak(dtype: torch.dtype, device: str = "cpu", n: int = 1024, reps: int = 5) -> float | None:
    """FLOP/s of the best of ``reps`` ``n × n`` products in ``dtype`` (None: not computed there)."""
    try:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        torch.mm(a, b)  # the first call sets the kernel up
    except (RuntimeError, TypeError):
        return None
    best = float("inf")
    for _ in range(reps):
        sync_device(device)
        t = time.perf_counter()
        torch.mm(a, b)
        sync_device(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def trajectories(policy, batch: int, tokens: int, action_frac: float, seed: int = 0,
                 shared: int = 0) -> list[Trajectory]:
    """``batch`` random trajectories of ``tokens`` tokens, the last ``action_frac`` the action,
    their rollout log-probs the policy's own (every DIS ratio 1), reward 1 on every other one;
    the first ``shared`` tokens (at most the prompt) the same in all (a system message)."""
    rng = random.Random(seed)
    vocab = policy.config.vocab_size
    prompt = max(1, min(tokens - 1, round(tokens * (1 - action_frac))))
    system = [rng.randrange(2, vocab) for _ in range(min(shared, prompt))]
    out = []
    for i in range(batch):
        ids = system + [rng.randrange(2, vocab) for _ in range(tokens - len(system))]
        mask = [0] * prompt + [1] * (tokens - prompt)
        x = torch.tensor([ids], device=policy.device)
        with torch.no_grad():
            lp = token_logprobs(policy, x, torch.ones_like(x))
        rewards = [0.0] * tokens
        rewards[-1] = float(i % 2 == 0)
        out.append(Trajectory(ids, mask, [float(x) if m else 0.0 for x, m in zip(lp[0].tolist(), mask)],
                              rewards, [0 if m else -1 for m in mask], prompt, task_id=f"bench-{i}",
                              episode=Episode(success=rewards[-1] > 0)))
    return out


def params(module: torch.nn.Module, trainable: bool = False) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable)


def active_expert_share(model: torch.nn.Module) -> tuple[int, float]:
    """``(parameters of the MoE experts, the share of them a token passes through)``: top-k of
    the experts (``num_experts_per_tok / num_experts``); ``(0, 1.0)`` for a dense model."""
    cfg = model.config
    n, k = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None), \
        getattr(cfg, "num_experts_per_tok", None)
    if not n or not k:
        return 0, 1.0
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in f".{name}.")
    return experts, k / n


def step_flops(policy, critic: Critic, batch: int, tokens: int, k: int) -> dict[str, float]:
    """FLOPs of one SAO step (see the module docstring): the policy's pass, the critic's K passes
    with gradients and its forward without. An MoE model counts the experts a token passes
    through (top-k of them), not all."""
    cfg = policy.config
    positions = batch * tokens
    embed = cfg.vocab_size * cfg.hidden_size
    head = embed  # the vocabulary projection, tied or not, multiplies by vocab × hidden
    experts, share = active_expert_share(policy)
    layers = params(policy) - embed - (0 if cfg.tie_word_embeddings else head) - experts * (1 - share)
    width = (getattr(cfg, "num_attention_heads", None) or 0) * (getattr(cfg, "head_dim", None) or 0)
    width = width or cfg.hidden_size  # query heads × head_dim (Qwen3-0.6B: 2048 at hidden 1024)
    attention = 2 * cfg.num_hidden_layers * tokens * width  # a position: QKᵀ and AV over T/2 on average
    policy_fwd = positions * (2 * (layers + head) + attention)  # its backward: twice that
    critic_fwd = positions * (2 * layers + attention)
    trained_experts = sum(p.numel() for name, p in critic.named_parameters()
                          if p.requires_grad and ".experts." in f".{name}.")
    critic_train = params(critic, trainable=True) - trained_experts * (1 - share)
    # the critic's backward: input gradients through the layers, the attention's (twice its
    # forward: scores have no weights), and weight gradients of what it trains
    critic_pass = critic_fwd + positions * (2 * layers + 2 * attention + 2 * critic_train)
    return {"policy": 3 * policy_fwd, "critic": k * critic_pass + critic_fwd,
            "vocab": 3 * positions * 2 * head}


def _time_vocab(policy, batch: int, tokens: int) -> float:
    """Seconds of the vocabulary projection + log-softmax (with entropy), forward + backward, on
    ``batch × tokens`` positions, the way the learner scores them."""
    parts = decoder_and_head(policy)
    if parts is None:
        return float("nan")
    _, head = parts
    vocab = policy.config.vocab_size
    hidden = torch.randn(1, batch * (tokens - 1), policy.config.hidden_size, device=policy.device,
                         dtype=head.weight.dtype, requires_grad=True)
    targets = torch.randint(0, vocab, hidden.shape[:2], device=policy.device)
    best = float("inf")
    for _ in range(2):
        sync_device(policy.device.type)
        t = time.perf_counter()
        if targets.numel() * vocab * 4 > 256 * 2**20:
            picked, ent = chunked_logprobs(hidden, targets, head, vocab, 1.0, 0, 1.0, True)
        else:
            picked, ent = scored_logprobs(head(hidden), targets, 1.0, 0, 1.0, True)
        (picked.sum() + ent.sum()).backward()
        sync_device(policy.device.type)
        best = min(best, time.perf_counter() - t)
        hidden.grad = None
        head.weight.grad = None
    return best


def _time_optimizer(opt: torch.optim.Optimizer, params_: list[torch.nn.Parameter]) -> float:
    """Seconds of one step of ``opt`` with a zero learning rate (the weights stay)."""
    for p in params_:
        p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
    t = time.perf_counter()
    opt.step()
    dt = time.perf_counter() - t
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr
    opt.zero_grad(set_to_none=True)
    return dt


def bench_step(spec: StepSpec, log=print) -> dict:
    """Run the benchmark of ``spec``; its results as a dict (:func:`format_step` prints them)."""
    if spec.threads:
        torch.set_num_threads(spec.threads)
    peaks = {str(d).removeprefix("torch."): matmul_peak(d, spec.device, spec.matmul_n)
             for d in (torch.float32, torch.bfloat16)}
    log(f"matmul peak ({spec.matmul_n}^3, {torch.get_num_threads()} threads): "
        + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" if v else f"{k} not computed" for k, v in peaks.items()))
    memory = MemoryWatch(interval_s=0.25).start("model, critic and learner built")
    try:
        return _bench(spec, peaks, memory, log)
    finally:
        memory.stop()


def _bench(spec: StepSpec, peaks: dict, memory: MemoryWatch, log) -> dict:
    policy = load_policy(spec.model, device=spec.device)
    critic = Critic.from_policy(policy, seed=0)
    preset = get_preset("sao")
    learner = Learner(policy, critic, preset, OptimConfig(policy_lr=1e-6, critic_lr=5e-6),
                      pad_id=policy.config.pad_token_id or 0, device=spec.device)
    trajs = trajectories(policy, spec.batch, spec.tokens, spec.action_frac)
    log(f"step: {spec.batch} trajectories of {spec.tokens} tokens, warm-up then {spec.steps} timed")
    cast = (torch.autocast(torch.device(spec.device).type, dtype=torch.bfloat16) if spec.autocast
            else contextlib.nullcontext())
    memory.enter("warm-up step")
    with cast:
        first = learner.step(trajs)  # warm-up (kernels, optimizer moments), on the recording weights
    memory.enter("timed steps")
    walls, splits = [], []
    for _ in range(spec.steps):
        learner.timings.reset()
        sync_device(spec.device)
        t = time.perf_counter()
        with cast:
            metrics = learner.step(trajs)
        sync_device(spec.device)
        walls.append(time.perf_counter() - t)
        splits.append(dict(learner.timings.seconds))
    wall = min(walls)
    split = splits[walls.index(wall)]
    memory.enter("optimizer and vocabulary timed alone")
    opt_policy = _time_optimizer(learner.policy_opt, learner.policy_params)
    opt_critic = _time_optimizer(learner.critic_opt, learner.critic_params)
    vocab_s = _time_vocab(policy, spec.batch, spec.tokens)
    flops = step_flops(policy, critic, spec.batch, spec.tokens, preset.critic_updates)
    peak = peaks["float32"]
    policy_s = split.get("policy forward", 0.0) + split.get("policy backward + optimizer", 0.0)
    critic_s = sum(v for k, v in split.items() if k.startswith("critic"))
    mem = memory.stop()
    out = {
        "model": spec.model, "params": params(policy), "critic_trainable": params(critic, trainable=True),
        "batch": spec.batch, "tokens": spec.tokens, "threads": torch.get_num_threads(), "peaks": peaks,
        "step_s": wall, "step_s_all": walls, "split": split, "optimizer_s": {"policy": opt_policy,
                                                                            "critic": opt_critic},
        "vocab_s": vocab_s, "flops": flops, "positions_per_s": spec.batch * spec.tokens / wall,
        "action_tokens_per_s": sum(sum(t.action_mask) for t in trajs) / wall,
        "policy_s": policy_s, "critic_s": critic_s, "autocast": spec.autocast,
        "peak_rss_mib": mem["peak"].get("trainer_mib"), "memory": mem,
        "ratio_first": {k: first.get(f"policy/ratio_{k}") for k in ("min", "max")},
        "mismatch_kl_first": first.get("mismatch/kl"),
        "ratio": {k: metrics.get(f"policy/ratio_{k}") for k in ("min", "max")},
        "mismatch_kl": metrics.get("mismatch/kl"),
        "cuda_peak_mib": (torch.cuda.max_memory_allocated() / 2**20
                          if str(spec.device).startswith("cuda") else None),
    }
    out["fraction"] = {
        "step": (flops["policy"] + flops["critic"]) / wall / peak if peak else None,
        "policy": flops["policy"] / policy_s / peak if peak and policy_s else None,
        "critic": flops["critic"] / critic_s / peak if peak and critic_s else None,
    }
    return out


def format_step(r: dict) -> str:
    """The benchmark's tables, as markdown."""
    g = 1e9
    fr = r["fraction"]
    peaks = ", ".join(f"{k} {v / g:.1f}" if v else f"{k} –" for k, v in r["peaks"].items())
    lines = [f"model {r['model']}: {r['params'] / 1e6:.1f}M parameters (critic trains "
             f"{r['critic_trainable'] / 1e6:.1f}M); {r['batch']} × {r['tokens']} tokens; "
             f"{r['threads']} threads; matmul peak GFLOP/s: {peaks}", "",
             "| part | seconds | GFLOP | GFLOP/s | of the float32 peak |", "|---|---:|---:|---:|---:|"]

    def row(name, secs, flops, frac):
        rate = flops / secs / g if secs and flops else None
        lines.append(f"| {name} | {secs:.2f} | {flops / g:.1f} | {rate:.1f} | {frac:.2f} |" if rate else
                     f"| {name} | {secs:.2f} | – | – | – |")

    f = r["flops"]
    row("SAO step (policy + critic, K = 2)", r["step_s"], f["policy"] + f["critic"], fr["step"] or 0)
    row("policy forward + backward + AdamW", r["policy_s"], f["policy"], fr["policy"] or 0)
    row("critic: 2 passes + forward + 2 AdamW", r["critic_s"], f["critic"], fr["critic"] or 0)
    peak = r["peaks"]["float32"] or float("nan")
    row("vocabulary projection + log-softmax (fwd+bwd)", r["vocab_s"], f["vocab"],
        f["vocab"] / r["vocab_s"] / peak)
    lines += ["", "| split of the step | seconds | share |", "|---|---:|---:|"]
    split = dict(r["split"])
    opt = r["optimizer_s"]
    if "policy backward + optimizer" in split:
        split["policy backward"] = split.pop("policy backward + optimizer") - opt["policy"]
        split["policy AdamW"] = opt["policy"]
    if "critic backward + optimizer" in split:
        split["critic backward"] = split.pop("critic backward + optimizer") - 2 * opt["critic"]
        split["critic AdamW (2 steps)"] = 2 * opt["critic"]
    for k, v in sorted(split.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {k} | {v:.2f} | {v / r['step_s']:.0%} |")
    rf = r["ratio_first"]
    lines += ["", f"{'bfloat16 autocast' if r['autocast'] else 'float32'} scoring against float32 rollout "
              f"log-probs: DIS ratios {rf['min']:.4f} to {rf['max']:.4f}, mismatch/kl "
              f"{r['mismatch_kl_first']:.2e} on the first step (the weights that recorded them: numerics "
              f"alone); {r['ratio']['min']:.4f} to {r['ratio']['max']:.4f}, {r['mismatch_kl']:.2e} on the "
              "last (updates since)"]
    lines += ["", f"trained positions/s {r['positions_per_s']:.0f}, action tokens/s "
              f"{r['action_tokens_per_s']:.0f}; step {r['step_s']:.2f} s (best of "
              f"{', '.join(f'{x:.2f}' for x in r['step_s_all'])})"
              + (f"; peak RSS {r['peak_rss_mib']:.0f} MiB" if r["peak_rss_mib"] else "")
              + (f", CUDA peak {r['cuda_peak_mib']:.0f} MiB" if r["cuda_peak_mib"] else "")]
    if r.get("memory"):
        lines += ["", format_memory(r["memory"])]
    return "\n".join(lines)
