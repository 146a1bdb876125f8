"""``saorl value-pretrain [CONFIG] [key=value ...] --out DIR [--policy SPEC]``.

Fits a critic on rollouts of a fixed policy (by default the policy RL would start from: the SFT
warm start when ``sft.enabled``, else ``model.policy``) and prints the scaling curve: held-out
value loss and explained variance after fitting on 25%, 50% and 100% of the rollouts. The
directory it writes can be given to a run as ``model.critic=DIR``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from saorl.commands.common import config_or_exit, fail, split_config_args
from saorl.config import ConfigError, load_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("args", nargs="*", metavar="CONFIG_OR_OVERRIDE",
                   help="an optional YAML config, then dotted overrides such as value_pretrain.rollouts=64")
    p.add_argument("--out", type=Path, required=True, help="directory to write the critic into")
    p.add_argument("--policy", metavar="SPEC",
                   help="policy to roll out: a tiny kind or an HF model directory "
                        "(default: the run's initial policy, i.e. the SFT warm start when sft.enabled)")


def run(args: argparse.Namespace) -> int:
    from saorl.stages.preflight import check_run
    from saorl.stages.sft import warm_start
    from saorl.stages.value_pretrain import run_value_pretrain

    cfg = config_or_exit("saorl value-pretrain", list(args.args))
    if args.policy is not None:  # sized by the policy rolled out (saorl.config.sizing), not the config's
        path, overrides = split_config_args("saorl value-pretrain", list(args.args))
        try:
            sized = load_config(path, overrides, policy=args.policy)
        except ConfigError as e:
            fail(str(e))
        cfg = sized.model_copy(update={"model": cfg.model})  # the run's model settings (its tokenizer) kept
    if not cfg.algo.preset.use_critic:
        fail(f"saorl value-pretrain: algorithm {cfg.algo.name!r} trains no critic")
    check_run(cfg, demonstrations=cfg.sft.enabled and args.policy is None)  # SFT runs only without --policy
    policy = args.policy if args.policy is not None else warm_start(cfg)
    try:
        final = run_value_pretrain(cfg, policy, args.out)
    except (FileNotFoundError, NotADirectoryError, ValueError) as e:
        fail(f"saorl value-pretrain: {e}")
    print(f"critic written to {args.out} (use it with model.critic={args.out}); "
          f"held-out explained variance {final['value_pretrain/val_explained_var']:.3f}")
    return 0
