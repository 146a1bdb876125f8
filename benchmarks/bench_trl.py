"""Async SAO (saorl) against TRL's synchronous ``GRPOTrainer``: same model, same workload, one run.

    pip install -c constraints-cpu.txt -e ".[bench-trl]"   # TRL: for this benchmark only
    python benchmarks/bench_trl.py --budget-s 60 --reps 2 --out /tmp/bench-trl
    python benchmarks/bench_trl.py --quick                  # 1 rep of 20 s per side
    python benchmarks/bench_trl.py --model smollm2-135m-instruct --max-new 64 --saorl-grpo

Workload (single turn): the prompt ``Write c:`` (c in ``a..e``); the completion is sampled at
temperature 1 until EOS or 256 tokens; reward = the fraction of the completion's characters equal
to c (saorl's ``synthetic`` env with one turn; the same function for TRL). Model: the tiny MoE
(random init, saorl's byte-level tokenizer) with its EOS logit raised so completions end by EOS
after ≈ ``--mean-len`` tokens on average (geometric-like lengths, CV ≈ 1); it is saved once and
both sides load the same files. ``--model`` names a real model instead (a directory, a ``.gguf``
file, or a short name such as ``smollm2-135m-instruct``, resolved as ``model.policy`` is): its
completions end where the model samples its EOS or at ``--max-new`` tokens, and a tokenizer with a
chat template formats the prompt as one user message on both sides (TRL's conversational prompts,
saorl's ``model.chat_template``). Every side trains at learning rate ``--lr`` = 1e-7: the steps do
all their work, but the weights barely move, so the length distribution — which a few steps at
1e-4 moved from a mean of 65 to 82–176 tokens in a measured run, since the raised EOS logit is
fragile — stays the workload both sides were given.

Sides, each for ``--budget-s`` seconds of wall clock, interleaved (the order alternates per rep):

- **trl-Nt**: ``GRPOTrainer`` with N torch threads, groups of 4, 16 completions per optimizer
  step generated right before it (sync), ``beta = 0`` (no reference model), one iteration per
  batch, no gradient checkpointing (not needed at this size); each of ``--trl-threads``
  (default 1 and every core) is run, and the ratio is taken against the faster, its best case (on
  a loaded machine two OpenMP threads can be 20× slower than one: a step measured 138 s against
  7 s);
- **saorl-async**: ``saorl train`` with ``algo.name=sao`` (critic, K = 2 value updates, DIS),
  ``runtime.mode=async``, batches of 16 trajectories, one rollout worker with one thread and the
  trainer with one (both cores);
- **saorl-sync-grpo** (``--saorl-grpo``): saorl's own sync GRPO, groups of 4, for reference.

Figure: trained completion tokens / s over the side's window (TRL: from the start of training to
the end of its last step; saorl: ``saorl.bench.runs.analyse``, from the first rollout to the end of
the last step). The 1-minute load average is printed and stored next to every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

CHARS = "abcde"


def load_average() -> float:
    return os.getloadavg()[0]


# ------------------------------------------------------------------------------------------ model
def calibrated_model(out_dir: Path, mean_len: float, seed: int = 0, cap: int = 256) -> Path:
    """The tiny MoE with its EOS row set to ``beta · u`` (``u`` the mean direction of the final hidden
    states), ``beta`` chosen so that the expected completion length (EOS or ``cap`` tokens), computed
    exactly over the model's own sampled paths (survival sums of the per-token EOS probability),
    is ``mean_len``; saved with the tokenizer."""
    from saorl.models.tiny import build_tiny
    from saorl.models.tokenizer import load_tokenizer

    tok = load_tokenizer()
    model = build_tiny("tiny-moe", seed=seed)
    eos = tok.eos_token_id
    with torch.no_grad():  # hidden states along the model's own samples (EOS not yet raised)
        prompts = torch.tensor([tok.encode(f"Write {c}:") for c in CHARS * 4])
        ids = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, top_k=0,
                             top_p=1.0, max_new_tokens=cap, min_new_tokens=cap, pad_token_id=tok.pad_token_id)
        hidden = model.model(input_ids=ids).last_hidden_state[:, prompts.shape[1] - 1:-1]  # [S, cap, H]
        logits = model.lm_head(hidden)
        u = hidden.mean((0, 1)) / hidden.mean((0, 1)).norm()
        proj = hidden @ u  # EOS's logit becomes beta * proj
        rest = torch.logsumexp(torch.cat([logits[..., :eos], logits[..., eos + 1:]], -1), -1)

        def expected_length(beta: float) -> float:
            p = torch.sigmoid(beta * proj - rest).double()  # [S, cap] hazard of stopping at each token
            survive = torch.cumprod(1 - p, dim=1)
            return float((1 + survive[:, :-1].sum(1)).mean())  # E[min(L, cap)] along each path

        lo, hi = 0.0, 200.0
        for _ in range(60):
            beta = (lo + hi) / 2
            lo, hi = (beta, hi) if expected_length(beta) > mean_len else (lo, beta)
        model.model.embed_tokens.weight[eos] = beta * u  # tied: the LM head's EOS row
    path = out_dir / "model"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def is_chat(tok) -> bool:
    """Whether saorl formats prompts with ``tok``'s chat template (then TRL gets them as messages)."""
    from saorl.models.codec import as_run_tokenizer

    return as_run_tokenizer(tok).applies_chat_template


def prompt_ids(tok, char: str) -> list[int]:
    """The prompt's ids: saorl's own formatting for a chat model, the plain text's ids otherwise."""
    from saorl.models.codec import as_run_tokenizer

    text = f"Write {char}:"
    return as_run_tokenizer(tok).prompt_ids(text) if is_chat(tok) else tok.encode(text)


def completion_stats(path: Path, max_new: int = 256, n: int = 64) -> tuple[float, float]:
    """Mean and CV of completion lengths sampled from the model (what both sides will see)."""
    from saorl.engines import LocalEngine, SamplingParams
    from saorl.models.loading import load_policy
    from saorl.models.tokenizer import load_tokenizer

    tok = load_tokenizer(str(path))
    with LocalEngine(load_policy(str(path)), tok, max_batch_size=16) as eng:
        res = eng.generate([prompt_ids(tok, CHARS[i % 5]) for i in range(n)],
                           SamplingParams(temperature=1.0, max_new_tokens=max_new))  # a seed per request
    lengths = [len(r.token_ids) for r in res]
    mean = statistics.fmean(lengths)
    return mean, statistics.pstdev(lengths) / mean


# ------------------------------------------------------------------------------------------ trl
def char_reward(completions: list, char: list[str], **_) -> list[float]:
    """saorl's synthetic env with one turn: the fraction of the completion equal to the target char.
    A conversational completion (TRL: a list of messages) is scored on its content."""
    texts = [c if isinstance(c, str) else "".join(m.get("content") or "" for m in c) for c in completions]
    return [c.count(t) / len(c) if c else 0.0 for c, t in zip(texts, char)]


def grpo_config(out: Path, *, batch: int, group: int, max_new: int, lr: float, seed: int = 0, **more):
    """TRL's ``GRPOConfig`` as the benchmarks here run it: ``batch`` completions per optimizer step in
    groups of ``group``, generated right before it (sync), at temperature 1, one iteration per batch,
    ``beta = 0`` (no reference model), CPU in float32, a log row every step, nothing saved or tracked;
    ``more`` adds or overrides fields (``bench_tta.py``: ``reward_weights``)."""
    from trl import GRPOConfig

    return GRPOConfig(**{"output_dir": str(out), "per_device_train_batch_size": batch,
                         "num_generations": group,
                         "steps_per_generation": 1, "max_completion_length": max_new, "temperature": 1.0,
                         "learning_rate": lr, "beta": 0.0, "num_iterations": 1, "logging_steps": 1,
                         "save_strategy": "no", "report_to": "none", "use_cpu": True, "bf16": False,
                         "max_steps": 10**6, "seed": seed, "disable_tqdm": True,
                         "gradient_checkpointing": False, **more})


def run_trl(path: Path, budget_s: float, threads: int, out: Path, lr: float, max_new: int = 256) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    from saorl.models.loading import load_policy
    from saorl.models.tokenizer import load_tokenizer

    torch.set_num_threads(threads)
    tok = load_tokenizer(str(path))
    tok.padding_side = "left"
    chat = is_chat(tok)

    def prompt(c: str):
        return [{"role": "user", "content": f"Write {c}:"}] if chat else f"Write {c}:"

    data = Dataset.from_list([{"prompt": prompt(c), "char": c} for c in CHARS * 2000])
    steps: list[dict] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            self.t0 = time.time()

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                steps.append({"t": time.time(), "mean_length": logs["completions/mean_length"]})

        def on_step_end(self, args, state, control, **kw):
            if time.time() - self.t0 >= budget_s:
                control.should_training_stop = True

    cfg = grpo_config(out / "trl", batch=16, group=4, max_new=max_new, lr=lr)
    clock = Clock()
    trainer = GRPOTrainer(model=load_policy(str(path)), reward_funcs=char_reward, args=cfg,
                          train_dataset=data, processing_class=tok, callbacks=[clock])
    trainer.train()
    window = steps[-1]["t"] - clock.t0 if steps else float("nan")
    tokens = sum(16 * s["mean_length"] for s in steps)
    mean = tokens / (16 * len(steps)) if steps else float("nan")
    return {"steps": len(steps), "window_s": window, "trained_tokens": tokens,
            "tokens_per_s": tokens / window,
            "mean_length": mean}


# ---------------------------------------------------------------------------------------- saorl
def run_saorl(path: Path, budget_s: float, mode: str, out: Path, lr: float, max_new: int = 256,
              trainer_threads: int = 1) -> dict:
    from saorl.bench.pipeline import BenchSpec, common_overrides
    from saorl.bench.runs import analyse, run_once
    from saorl.config import load_config

    algo = (["algo.name=sao", "runtime.mode=async"] if mode == "saorl-async"
            else ["algo.name=grpo", "algo.group_size=4", "runtime.mode=sync"])
    spec = BenchSpec(budget_s=budget_s, batch_size=16, trainer_threads=trainer_threads)
    cfg = load_config(None, [*common_overrides(spec), f"model.policy={path}", f"model.tokenizer={path}",
                             "env.options={mean_turns: 1, cv: 0, max_turns: 1}",
                             f"rollout.max_new_tokens={max_new}",
                             f"rollout.max_total_tokens={max_new + 128}", f"trainer.policy_lr={lr}",
                             f"trainer.critic_lr={lr}", *algo, f"run.out_dir={out}", f"run.name={mode}"])
    run_dir = out / mode
    run_once(cfg, run_dir)
    stats = analyse(run_dir, cfg.rollout.local_engine.slots)
    return {"steps": stats.steps, "window_s": stats.window_s, "trained_tokens": stats.trained_tokens,
            "tokens_per_s": stats.tokens_per_s,
            "mean_length": stats.trained_tokens / max(stats.trained_trajectories, 1)}


# ----------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=60.0)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="1 rep of 20 s per side")
    ap.add_argument("--mean-len", type=float, default=50.0,
                    help="target mean completion length of the calibrated tiny model")
    ap.add_argument("--model", default=None,
                    help="a real model for both sides (directory, .gguf or short name such as "
                         "smollm2-135m-instruct) instead of the calibrated tiny one")
    ap.add_argument("--max-new", type=int, default=256, help="completion cap in tokens (both sides)")
    ap.add_argument("--lr", type=float, default=1e-7,
                    help="learning rate of every side (tiny by default: the workload stays put, see above)")
    ap.add_argument("--trl-threads", default=f"1,{os.cpu_count() or 1}",
                    help="comma-separated torch thread counts for TRL, each run (default 1 and every core)")
    ap.add_argument("--saorl-grpo", action="store_true", help="also run saorl's sync GRPO")
    ap.add_argument("--saorl-trainer-threads", type=int, default=1,
                    help="torch threads of saorl's trainer (its rollout worker has one)")
    ap.add_argument("--out", default="bench-trl")
    args = ap.parse_args(argv)
    if args.quick:
        args.budget_s, args.reps = 20.0, 1
    try:
        trl_threads = sorted({int(x) for x in str(args.trl_threads).split(",")})
    except ValueError:
        trl_threads = [0]
    if (args.budget_s <= 0 or args.reps < 1 or args.mean_len < 2 or args.max_new < 1 or min(trl_threads) < 1
            or args.saorl_trainer_threads < 1):
        print("bench_trl: need --budget-s > 0, --reps >= 1, --mean-len >= 2, --max-new >= 1, "
              "--saorl-trainer-threads >= 1 and "
              f"--trl-threads a comma-separated list of thread counts >= 1, got {args.trl_threads!r}",
              file=sys.stderr)
        return 2
    try:
        import trl  # noqa: F401
    except ImportError:
        print("bench_trl: TRL is not installed; pip install -e '.[bench-trl]' (an optional dependency of "
              "this benchmark only)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.model:
        from saorl.models.loading import policy_source

        path = Path(policy_source(args.model))
    else:
        path = calibrated_model(out, args.mean_len)
    mean, cv = completion_stats(path, args.max_new)
    print(f"[bench-trl] model {path}: completion length mean {mean:.1f}, CV {cv:.2f} "
          f"(load {load_average():.1f})", flush=True)
    sides = [f"trl-{n}t" for n in trl_threads] + ["saorl-async"]
    sides += ["saorl-sync-grpo"] if args.saorl_grpo else []
    records = []
    for rep in range(args.reps):
        for side in sides if rep % 2 == 0 else sides[::-1]:
            load0 = load_average()
            print(f"[bench-trl] rep {rep + 1}: {side} for {args.budget_s:.0f}s (load {load0:.1f})",
                  flush=True)
            rep_out = out / f"rep{rep}"
            if side.startswith("trl-"):
                r = run_trl(path, args.budget_s, int(side[4:-1]), rep_out, args.lr, args.max_new)
            else:
                r = run_saorl(path, args.budget_s, side, rep_out, args.lr, args.max_new,
                              args.saorl_trainer_threads)
            r |= {"side": side, "rep": rep, "load_start": load0, "load_end": load_average()}
            print(f"[bench-trl]   {r['tokens_per_s']:.0f} trained tok/s, {r['steps']} steps, mean length "
                  f"{r['mean_length']:.1f}", flush=True)
            records.append(r)
    by = {(r["side"], r["rep"]): r["tokens_per_s"] for r in records}
    ratios = [by[("saorl-async", k)] / max(by[(f"trl-{n}t", k)] for n in trl_threads)
              for k in range(args.reps)]
    lines = [f"# saorl async SAO vs TRL GRPOTrainer (sync), {os.cpu_count()} cores, model {path.name}, "
             f"completion length mean {mean:.1f} CV {cv:.2f} (cap {args.max_new}), saorl trainer threads "
             f"{args.saorl_trainer_threads}", "",
             "| side | rep | window s | steps | trained tok/s | mean length | load 1 min |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['side']} | {r['rep'] + 1} | {r['window_s']:.1f} | {r['steps']} | "
              f"{r['tokens_per_s']:.0f} | {r['mean_length']:.1f} | {r['load_start']:.1f} → "
              f"{r['load_end']:.1f} |" for r in records]
    lines += ["", f"saorl async SAO / TRL GRPO (its faster thread count) trained tokens/s: "
              f"**{statistics.fmean(ratios):.2f}×** (each rep: {', '.join(f'{x:.2f}×' for x in ratios)})"]
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text, encoding="utf-8")
    (out / "results.json").write_text(json.dumps({"records": records, "ratios": ratios, "mean_length": mean,
                                                  "cv": cv, "args": vars(args)}, indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
