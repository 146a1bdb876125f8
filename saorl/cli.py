"""The ``saorl`` command line.

Each subcommand is a module of :mod:`saorl.commands` with two functions: ``add_arguments(parser)``
and ``run(args) -> int``. This file only lists them, so adding a command is one line in
:data:`COMMANDS`, and only the module of the command being run is imported (``saorl --help`` imports
none). No command module imports torch or transformers at module level (``tests/test_cli.py``
checks, on the parser with every command): help, ``saorl config`` and ``saorl envs list`` start in
well under a second (``benchmarks/bench_cli_startup.py``).

Exit status (:func:`saorl.commands.common.exit_status`): 0 done; 2 a problem with the input, found
before anything ran (config, files, env, model, device), one paragraph with the fix; 3 a run that
started and failed (:class:`saorl.errors.RunFailure`); 1 anything else (a bug), one paragraph too;
130 interrupted. No Python traceback is printed unless ``--debug`` is given (anywhere on the line)
or ``SAORL_DEBUG=1`` is set.

A rank of a sharded trainer (``torchrun ... -m saorl.cli train ... trainer.shard=fsdp2``) ends with
:func:`os._exit` once its command has returned and its output is flushed, skipping the
interpreter's teardown: torch's C++ teardown after a gloo process group aborted the process
(``terminate called without an active exception``, SIGABRT) after a finished run in 4 of 86
two-rank runs on CPU, which torchrun reports as a failed job.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import sys

DESCRIPTION = ("saorl: RL post-training of LLM agents with SAO (single-rollout asynchronous optimization) "
               "and the baselines it is compared with")
# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("saorl.commands.train", "train a policy with SAO or a baseline (default: SAO on math_tool)"),
    "eval": ("saorl.commands.eval", "evaluate a model, run or checkpoint on a recipe's or env's test split"),
    "sft": ("saorl.commands.sft", "fine-tune a policy on an env's demonstrations; accuracy before/after"),
    "value-pretrain": ("saorl.commands.value_pretrain", "fit a critic on rollouts of a fixed policy"),
    "plot": ("saorl.commands.plot",
             "draw one run as a PNG: reward, held-out accuracy, KL, critic EV, staleness, throughput"),
    "serve": ("saorl.commands.serve", "serve the local engine over OpenAI-compatible HTTP"),
    "replay": ("saorl.commands.replay",
               "re-run the learner on a run's recorded batches from a checkpoint, under changed settings"),
    "check-server": ("saorl.commands.check_server",
                     "check vLLM / SGLang servers against a policy: log-probs, reloads, start-up refusals"),
    "envs": ("saorl.commands.envs", "list environments, sample tasks and demonstrations"),
    "config": ("saorl.commands.config", "print the resolved config (defaults, YAML and overrides)"),
    "cache": ("saorl.commands.cache",
              "check saorl's model cache (converted GGUF files and short model names)"),
    "simulate": ("saorl.commands.simulate",
                 "predict throughput, utilisation and staleness of sync vs async at any scale"),
    "bench": ("saorl.commands.bench", "measure async vs sync throughput, utilisation and staleness"),
    "experiment": ("saorl.commands.experiment",
                   "run a comparison of algorithms or ablations and write its table and plots"),
}


def build_parser(only: str | None = "") -> argparse.ArgumentParser:
    """The parser; each command's arguments are added by its module, for every command by default,
    or for the command named ``only`` alone (None: for none; the top-level help needs none)."""
    parser = argparse.ArgumentParser(prog="saorl", description=DESCRIPTION)
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    parser.add_argument("--debug", action="store_true",
                        help="print the Python traceback of a failure (also SAORL_DEBUG=1); "
                             "accepted anywhere on the command line")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(_module=module)
        if only == "" or only == name:
            importlib.import_module(module).add_arguments(p)
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse ``argv``; ``key=value`` overrides may also come after a command's options
    (``saorl experiment math --quick run.progress=false``), where argparse alone rejects them."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        if isinstance(getattr(args, "overrides", None), list) and all(
                "=" in x and not x.startswith("-") for x in extra):
            args.overrides = [*args.overrides, *extra]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit status. In a process that joined a sharded trainer's ranks it
    does not return: it exits with that status (module docstring)."""
    status = _main(argv)
    _end_sharded_rank(status)
    return status


def _end_sharded_rank(status: int) -> None:
    """In a process that joined a sharded trainer's ranks: flush and exit now (module docstring)."""
    group = sys.modules.get("saorl.runtime.learner.shard_group")
    if group is None or not group.joined():
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("SAORL_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    # transformers' weight loading / saving progress bars ("Loading weights", "Writing model shards")
    # print several times per run, here and in the rollout workers (which inherit the environment).
    # The switch is the Hub's, so its download bars go too (the start-up checks say when a Hub model
    # is fetched); HF_HUB_DISABLE_PROGRESS_BARS=0 brings them all back
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if not sys.stderr.isatty():
        # any other tqdm bar (the GGUF conversion's, through tqdm.auto) redraws itself with carriage
        # returns: one line of thousands of characters in a log file. tqdm reads TQDM_* when it is
        # first imported, which no command has done yet; TQDM_DISABLE=0 brings the bars back
        os.environ.setdefault("TQDM_DISABLE", "1")
    parser = build_parser(next((a for a in argv if not a.startswith("-")), None))
    args = parse(parser, argv)
    args.debug = debug  # for a command that starts saorl processes of its own (saorl experiment --jobs)
    if args.version:
        from saorl import __version__

        print(f"saorl {__version__}")
        return 0
    if not args.command:
        parser.print_help()
        return 2
    mod = importlib.import_module(args._module)
    try:
        return int(mod.run(args) or 0)
    except SystemExit as e:  # a command's one-paragraph failure (saorl.commands.common.fail)
        return e.code if isinstance(e.code, int) else 1
    except BrokenPipeError:  # `saorl envs list | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports it
    except (Exception, KeyboardInterrupt) as e:
        from saorl.commands.common import exit_status

        if debug:
            import traceback

            traceback.print_exc()
        status, message = exit_status(e, f"saorl {args.command}", debug)
        print(message, file=sys.stderr, flush=True)
        return status


if __name__ == "__main__":
    sys.exit(main())
