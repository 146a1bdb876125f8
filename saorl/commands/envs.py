"""``saorl envs``: list the environments, show sample tasks and play demonstrations through them.

    saorl envs list
    saorl envs sample math_tool --n 3 --split test --seed 0 --option family=countdown
    saorl envs sample textarena --n 1 --option game=TowerOfHanoi-v0
    saorl envs sample math_tool --n 1 --observation-format chat --tokenizer DIR

``sample`` prints each task's prompt and a demonstration episode played through the env (the
env computes the observations and the reward), with token counts from the shipped tokenizer (or
``--tokenizer``); an env without demonstrations (a TextArena game, an OpenEnv server) shows its
prompt and what it answers to an empty action. ``list`` says which community envs' packages (the
``envs`` extra) are installed. With ``chat`` observations (``--observation-format chat``, or the env's own
default) the demonstration is played through the agent loop with that tokenizer's chat template
instead, and each part is printed as the model sees it: the prompt as the template renders it,
and each observation as the closing of the assistant's turn, the observation's message and the
next assistant header. Actions and observations are coloured on a terminal and marked
``ACT |`` / ``OBS |`` otherwise.
"""

from __future__ import annotations

import argparse
import importlib
import random
import sys
from typing import Any

import yaml

from saorl.data.tasks import load_tasks
from saorl.envs.base import Progress, prompt_text
from saorl.envs.demo import play_demonstration, token_counts
from saorl.envs.extras import EXTRAS, installed
from saorl.envs.registry import BUILTIN_ENVS, EnvResolveError, MissingExtra, make_env_factory, resolve_env

_STYLES = {"PROMPT": "bold", "ACT": "green", "OBS": "cyan", "INFO": "yellow"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="envs_command", metavar="ACTION")
    sub.add_parser("list", help="list the built-in environments")
    p = sub.add_parser("sample", help="print sample tasks and a demonstration episode for each")
    p.add_argument("env", help="built-in name (see 'saorl envs list') or 'module.path:ClassName'")
    p.add_argument("--n", type=int, default=3, help="number of tasks (default 3)")
    p.add_argument("--split", choices=("train", "test"), default="train")
    p.add_argument("--seed", type=int, default=0, help="task and demonstration seed (default 0)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="env option, repeatable; VALUE is parsed as YAML (2, true, [a, b])")
    p.add_argument("--tasks-file", default=None, help="read tasks from a JSONL file instead")
    p.add_argument("--progress-step", type=int, default=0,
                   help="trainer step passed to reset (matters for style_shift)")
    p.add_argument("--observation-format", choices=("text", "chat"), default=None,
                   help="how observations join the trajectory (env.observation_format; default: the env's)")
    p.add_argument("--observation-role", choices=("tool", "user"), default=None,
                   help="the role of an observation's message with chat (default: the env's, tool)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="tokenizer directory or Hub id for the token counts and the chat template "
                        "(default: the shipped tokenizer, which has no chat template)")
    p.add_argument("--no-color", action="store_true", help="plain markers even on a terminal")


def parse_options(pairs: list[str]) -> dict[str, Any]:
    """``["family=countdown", "difficulty=2"]`` -> ``{"family": "countdown", "difficulty": 2}``."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--option must look like KEY=VALUE, got {pair!r}")
        try:
            options[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError:
            options[key.strip()] = value
    return options


class _Printer:
    def __init__(self, color: bool) -> None:
        self.console = None
        if color:
            from rich.console import Console

            self.console = Console(highlight=False)

    def line(self, kind: str, text: str) -> None:
        body = text[:-1] if text.endswith("\n") else text
        lines = body.split("\n") or [""]
        if self.console is None:
            for ln in lines:
                print(f"{kind:<6}| {ln}")
            return
        from rich.text import Text

        for ln in lines:
            text = Text()
            text.append(f"{kind:<6}| ", style="dim")
            text.append(ln, style=_STYLES.get(kind, ""))
            self.console.print(text)

    def plain(self, text: str) -> None:
        if self.console is None:
            print(text)
        else:
            from rich.text import Text

            self.console.print(Text(text, style="bold magenta"))


def _run_list() -> int:
    for name, target in BUILTIN_ENVS.items():
        extra = EXTRAS.get(name)
        status = "" if extra is None else f"  [{extra.package}: " + \
            ("installed]" if installed(extra.module) else f"not installed: {extra.install_line}]")
        try:
            cls = resolve_env(name)
        except MissingExtra:
            cls = None
        except EnvResolveError as e:
            print(f"{name:<13} {target}  (unavailable: {e})")
            continue
        module = importlib.import_module(target.partition(":")[0])
        summary = (module.__doc__ or "").strip().splitlines()[0] if module.__doc__ else ""
        summary = summary.replace("``", "")  # the docstring's markup, not for a terminal
        stop = "" if cls is None else f"  stop={list(cls.stop_strings)}"
        print(f"{name:<13} {target}{stop}{status}\n{'':<13} {summary}")
    return 0


def _run_sample(args: argparse.Namespace) -> int:
    from saorl.models.codec import TokenizerSpec

    factory = make_env_factory(args.env, parse_options(args.option),
                               observation_format=args.observation_format,
                               observation_role=args.observation_role)
    tasks = load_tasks(factory(), args.split, args.n, args.seed, args.tasks_file)
    tokenizer = TokenizerSpec(args.tokenizer).load()
    out = _Printer(color=sys.stdout.isatty() and not args.no_color)
    rng = random.Random(args.seed)
    progress = Progress(trainer_step=args.progress_step, episode=args.progress_step)
    fmt, role = factory.observation
    if fmt == "chat":
        from saorl.models.chat_turns import check_chat_turns

        check_chat_turns(tokenizer, role)
    for task in tasks:
        env = factory()
        out.plain(f"=== {task.id} ({args.split}) ===")
        if fmt == "chat":
            _sample_chat(env, task, tokenizer, rng, out)
            continue
        try:
            ep = play_demonstration(env, task, rng, progress)
        except NotImplementedError as e:
            _sample_empty_action(env, task, progress, out, str(e))
            continue
        out.line("PROMPT", prompt_text(ep.prompt))
        for action, obs in ep.turns:
            out.line("ACT", action)
            if obs:
                out.line("OBS", obs)
        c = token_counts(ep, tokenizer)
        status = "" if ep.done else "  (demonstration ended before the episode did)"
        extra = {k: v for k, v in ep.info.items() if k != "success" and isinstance(v, (str, int, float))}
        if extra:
            out.line("INFO", "  ".join(f"{k}={v}" for k, v in extra.items()))
        out.line("INFO", f"reward {ep.reward:g}  success {ep.success}  tokens: prompt {c['prompt']}, "
                         f"actions {c['actions']} (max {c['max_action']}), observations "
                         f"{c['observations']}, total {c['total']}{status}")
    return 0


def _sample_empty_action(env, task, progress: Progress, out: _Printer, why: str) -> None:
    """An env without demonstrations (a game of a community package): its prompt, and what it
    answers to an empty action, as the env gives it."""
    out.line("PROMPT", prompt_text(env.reset(task, progress)))
    out.line("INFO", f"no demonstration ({why}); an empty action instead:")
    result = env.step("")
    out.line("ACT", "")
    if result.observation:
        out.line("OBS", result.observation)
    extra = {k: v for k, v in result.info.items() if isinstance(v, (str, int, float))}
    out.line("INFO", f"reward {result.reward:g}  done {result.done}"
                     + "".join(f"  {k}={v}" for k, v in extra.items()))
    close = getattr(env, "close", None)
    if callable(close):
        close()


def _sample_chat(env, task, tokenizer, rng: random.Random, out: _Printer) -> None:
    """A demonstration through the agent loop, each part printed as the model sees it."""
    import asyncio

    from saorl.agent.loop import EpisodeError
    from saorl.agent.render import trajectory_parts
    from saorl.agent.scripted import demonstration_trajectory

    try:
        traj = asyncio.run(demonstration_trajectory(env, task, tokenizer, rng))
    except NotImplementedError as e:
        out.line("INFO", f"no demonstration: {e}")
        return
    except EpisodeError as e:
        raise ValueError(str(e)) from None
    kinds = {"prompt": "PROMPT", "act": "ACT", "obs": "OBS", "reward": "INFO"}
    for kind, label, text in trajectory_parts(traj, tokenizer):
        out.line(kinds[kind], label if kind == "reward" else text)
    n_act = sum(traj.action_mask)
    out.line("INFO", f"success {traj.episode.success}  tokens: prompt {traj.prompt_len}, actions {n_act}, "
                     f"observations {len(traj) - traj.prompt_len - n_act}, total {len(traj)} "
                     "(observations as chat turns)")


def run(args: argparse.Namespace) -> int:
    command = getattr(args, "envs_command", None)
    if command == "list":
        return _run_list()
    if command == "sample":
        try:
            return _run_sample(args)
        except (ValueError, TypeError, OSError) as e:
            print(f"saorl envs sample: {e}", file=sys.stderr)
            return 2
    print("usage: saorl envs {list,sample} ...  (see saorl envs --help)", file=sys.stderr)
    return 2
