"""Prompts against the token budget, decided once at start-up: never a run that dies mid-training
on one long row.

A trajectory holds at most ``rollout.max_total_tokens`` tokens, prompt included, and a turn may
sample ``rollout.max_new_tokens``; a prompt longer than their difference leaves its first turn
less than a full one (the agent loop caps a turn at the tokens left; only a prompt of
``max_total_tokens`` or more cannot be played at all), so the budget is their difference, as
verl's ``max_prompt_length`` and TRL's are. :func:`screen_prompts` renders every task's prompt
(the env's ``reset``, then the run's tokenizer: chat template, special tokens) and counts the
tokens; ``env.overlong_prompts`` says what happens to a task over the budget:

- ``filter`` (the default, verl's ``filter_overlong_prompts``) leaves it out with a one-line count;
- ``error`` stops with one paragraph naming the first ones;
- ``truncate`` keeps it, cut to the budget keeping its end (:mod:`saorl.agent.prompt_cut`: which
  side, and why), with a one-line count; a prompt whose uncuttable part (the template's own
  tokens, its system messages) is alone over the budget is left out, and the line says so. The
  tasks carry the budget (:attr:`~saorl.data.task.Task.prompt_limit`), and the agent loop makes
  the cut in each episode on the prompt ``reset`` renders then (an env whose prompt moves with
  training is cut as it stands), so the ids are exactly the cut prompt's rendering.

A prompt far over the budget is known to be over it from its size in bytes, without tokenising
it (:mod:`saorl.agent.prompt_size`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from saorl.agent.prompt_cut import can_cut
from saorl.agent.prompt_size import bytes_bound_holds, bytes_per_token, prompt_bytes
from saorl.agent.tool_turns import with_tools
from saorl.config import SaorlConfig
from saorl.data.task import Task
from saorl.envs.base import Env, Progress

__all__ = ["Screened", "bytes_bound_holds", "describe_overlong", "fitting_tasks", "screen_prompts"]


@dataclass
class Screened:
    kept: list[Task]
    """The tasks to play, in their order: those that fit, and (``cut``) those cut to fit."""
    overlong: list[tuple[Task, int | None]]
    """The tasks over the budget, each with its prompt's tokens (None: over it by its bytes alone)."""
    uncuttable: list[Task] = field(default_factory=list)
    """(``cut``) The overlong tasks that cannot be cut to fit, left out of ``kept``."""


def screen_prompts(tasks: Sequence[Task], env_factory: Callable[[], Env], tokenizer, budget: int, *,
                   cut: bool = False) -> Screened:
    """``tasks`` split into those whose prompt fits ``budget`` tokens and those over it (module
    docstring); ``cut``: an overlong one that can be cut to fit is kept too. ``tokenizer`` is the
    run's (:class:`~saorl.models.codec.RunTokenizer`)."""
    from saorl.errors import StartupError

    per_token = bytes_per_token(tokenizer)
    env = env_factory()
    out = Screened([], [])
    for task in tasks:
        try:
            prompt = env.reset(task, Progress())
        except Exception as e:
            raise StartupError(f"task {task.id!r}: the env's reset, which renders its prompt, failed: "
                               f"{type(e).__name__}: {e}") from None
        n = None
        codec, prompt = with_tools(env, tokenizer, prompt)  # the tools' schemas count too
        if per_token is None or prompt_bytes(prompt) <= budget * per_token:
            n = len(codec.prompt_ids(prompt))
            if n <= budget:
                out.kept.append(task)
                continue
        out.overlong.append((task, n))
        if cut and can_cut(codec, prompt, budget):
            out.kept.append(task)
        elif cut:
            out.uncuttable.append(task)
    return out


def describe_overlong(screened: Screened, total: int, what: str, budget_text: str) -> str:
    """``3 of 5000 training tasks have prompts over 336 tokens (...): t1 (512 tokens), ...``."""
    shown = ", ".join(f"{t.id} ({n} tokens)" if n is not None else f"{t.id} (over by its size in bytes)"
                      for t, n in screened.overlong[:3])
    more = f" and {len(screened.overlong) - 3} more" if len(screened.overlong) > 3 else ""
    return (f"{len(screened.overlong)} of {total} {what} have prompts over {budget_text}: "
            f"{shown}{more}")


def fitting_for_run(cfg: SaorlConfig, tasks: list[Task], env_factory: Callable[[], Env], tokenizer,
                    what: str) -> list[Task]:
    """:func:`fitting_tasks` under a run's settings: its token budget (``rollout``) and
    ``env.overlong_prompts`` (the training tasks, test tasks and value-pretraining tasks alike)."""
    r = cfg.rollout
    return fitting_tasks(tasks, env_factory, tokenizer, max_total_tokens=r.max_total_tokens,
                         max_new_tokens=r.max_new_tokens, mode=cfg.env.overlong_prompts, what=what)


def fitting_tasks(tasks: list[Task], env_factory: Callable[[], Env], tokenizer, *, max_total_tokens: int,
                  max_new_tokens: int, mode: str, what: str,
                  log: Callable[[str], None] = print) -> list[Task]:
    """``tasks`` under ``env.overlong_prompts`` = ``mode`` (module docstring): those to play, with
    a line through ``log`` for the ones left out or cut; :class:`~saorl.errors.StartupError` for
    ``error``, or when no task is left at all. Under ``truncate`` every task returned carries the
    budget as its ``prompt_limit``."""
    from saorl.errors import StartupError

    budget = max_total_tokens - max_new_tokens
    screened = screen_prompts(tasks, env_factory, tokenizer, budget, cut=mode == "truncate")
    kept = [replace(t, prompt_limit=budget) for t in screened.kept] if mode == "truncate" else screened.kept
    if not screened.overlong:
        return kept
    budget_text = (f"{budget} tokens (rollout.max_total_tokens {max_total_tokens} − rollout.max_new_tokens "
                   f"{max_new_tokens})")
    text = describe_overlong(screened, len(tasks), what, budget_text)
    if mode == "error":
        raise StartupError(f"{text}. Raise rollout.max_total_tokens, shorten those prompts, or set "
                           "env.overlong_prompts=filter to leave them out (or truncate to cut them)")
    if not kept:
        why = (" (none can be cut to fit: the chat template and system messages alone are over)"
               if mode == "truncate" else "")
        raise StartupError(f"{text}: none is left to play{why}. Raise rollout.max_total_tokens or shorten "
                           "the prompts")
    if mode == "truncate":
        cut = len(screened.overlong) - len(screened.uncuttable)
        left = ""
        if screened.uncuttable:
            names = ", ".join(t.id for t in screened.uncuttable[:3])
            left = (f"; {len(screened.uncuttable)} cannot be cut to fit (the chat template and system "
                    f"messages alone are over), left out: {names}")
        log(f"prompts: {text}; {cut} cut to fit, keeping their end (env.overlong_prompts=truncate){left}")
    else:
        log(f"prompts: {text}; left out (env.overlong_prompts=filter)")
    return kept
