"""``saorl sft [CONFIG] [key=value ...] --out DIR [--tasks N]``.

Supervised fine-tuning of ``model.policy`` on the env's demonstrations (loss on action tokens
only; :func:`saorl.stages.sft.run_sft`, the very SFT a run's warm start does), exported to
``DIR`` as an HF policy directory with ``DIR/sft_metrics.json``. Then both the un-fine-tuned policy
and the result are evaluated on the first ``N`` test tasks and the accuracy before and after is
printed; the two evaluations are added to ``sft_metrics.json`` as ``before/eval/*`` and
``after/eval/*``. ``DIR`` can be given to a run as ``model.policy=DIR`` (with ``sft.enabled=false``)
or to ``saorl eval``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from saorl.commands.common import config_or_exit, fail


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("args", nargs="*", metavar="CONFIG_OR_OVERRIDE",
                   help="an optional YAML config, then dotted overrides such as sft.steps=100 "
                        "env.options.demo_error_rate=0.2")
    p.add_argument("--out", type=Path, required=True, help="directory to write the fine-tuned policy into")
    p.add_argument("--tasks", type=int, metavar="N",
                   help="test tasks for the before/after evaluation (default: run.eval_tasks)")


def run(args: argparse.Namespace) -> int:
    from saorl.commands.eval import format_table
    from saorl.models.codec import run_tokenizer
    from saorl.models.loading import load_policy
    from saorl.runtime.recorder import CountProgress
    from saorl.stages.evaluate import evaluate_config
    from saorl.stages.preflight import check_run
    from saorl.stages.sft import run_sft, sft_seed

    if args.tasks is not None and args.tasks < 1:
        fail(f"saorl sft: --tasks must be >= 1, got {args.tasks}")
    cfg = config_or_exit("saorl sft", list(args.args))
    check_run(cfg, demonstrations=True)
    m = cfg.model
    try:
        tokenizer = run_tokenizer(m)
        before_policy = load_policy(m.policy, dtype=m.dtype, device=m.device, seed=sft_seed(cfg))
    except (FileNotFoundError, NotADirectoryError, ValueError) as e:
        fail(f"saorl sft: {e}")
    with CountProgress("eval before SFT", enabled=cfg.run.progress) as count:
        before, _ = evaluate_config(cfg, before_policy, tokenizer, n=args.tasks, on_done=count)
    del before_policy
    metrics = run_sft(cfg, args.out)
    after_policy = load_policy(str(args.out), dtype=m.dtype, device=m.device)
    with CountProgress("eval after SFT", enabled=cfg.run.progress) as count:
        after, _ = evaluate_config(cfg, after_policy, tokenizer, n=args.tasks, on_done=count)
    metrics |= {f"before/{k}": v for k, v in before.items()} | {f"after/{k}": v for k, v in after.items()}
    (args.out / "sft_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    temp = cfg.run.eval_temperature
    print(f"policy  {m.policy} -> {args.out} ({cfg.sft.steps} SFT steps on {int(metrics['sft/demos'])} "
          f"demonstrations, final loss {metrics['sft/loss']:.4f})")
    print(f"env     {cfg.env.type}, test split, {int(after.get('eval/episodes', 0))} episodes, "
          f"{'greedy' if temp == 0 else f'temperature {temp:g}'}")
    print(format_table({"before": before, "after": after}))
    return 0
