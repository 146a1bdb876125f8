"""Prompts against the token budget, decided once at start-up: never a run that dies mid-training
on one long row, never a prompt re-tokenised on every attempt.

A trajectory holds at most ``rollout.max_total_tokens`` tokens, prompt included, and a turn may
sample ``rollout.max_new_tokens``; a prompt longer than their difference leaves its first turn
less than a full one (the agent loop caps a turn at the tokens left; only a prompt of
``max_total_tokens`` or more cannot be played at all), so the budget is their difference, as
verl's ``max_prompt_length`` and TRL's are. :func:`screen_prompts` renders every task's prompt
(the env's ``reset``, then the run's tokenizer: chat template, special tokens) and counts the
tokens; ``env.overlong_prompts`` says what happens to a task over the budget: ``filter`` (the
default, verl's ``filter_overlong_prompts``) leaves it out with a one-line count, ``error`` stops
with one paragraph naming the first ones. A prompt so large that even the longest token of the
vocabulary could not fit it in the budget is known to be over it from its size in bytes, without
tokenising it (a 20 MB row costs nothing) — where that bound holds: a tokenizer with no
normalizer that spells every byte (byte-level BPE, or byte fallback), as the shipped one, Llama's
and Mistral's do; one that normalises text or folds unknown characters into one token is
tokenised whatever the size.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from saorl.data.task import Task
from saorl.envs.base import Env, Progress


@dataclass
class Screened:
    kept: list[Task]
    overlong: list[tuple[Task, int | None]]
    """The tasks over the budget, each with its prompt's tokens (None: over it by its bytes alone)."""


def max_token_bytes(tokenizer) -> int:
    """The most bytes one token of ``tokenizer``'s vocabulary stands for (its longest entry, in
    UTF-8: an upper bound for byte-level and SentencePiece vocabularies, whose entries spell each
    byte with at least one byte)."""
    hf = getattr(tokenizer, "hf", tokenizer)
    vocab = hf.get_vocab()
    return max((len(t.encode("utf-8")) for t in vocab), default=1)


def bytes_bound_holds(tokenizer) -> bool:
    """Whether a prompt's UTF-8 size over :func:`max_token_bytes` is a lower bound of its tokens
    (module docstring): no normalizer, and every byte spelt (byte-level or byte fallback)."""
    hf = getattr(tokenizer, "hf", tokenizer)
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        return False
    spec = json.loads(backend.to_str())
    if spec.get("normalizer") is not None:
        return False
    return bool((spec.get("model") or {}).get("byte_fallback")) or '"ByteLevel"' in json.dumps(
        spec.get("pre_tokenizer"))


def _prompt_bytes(prompt) -> int:
    if isinstance(prompt, str):
        return len(prompt.encode("utf-8"))
    return sum(len(str(m.get("content", "")).encode("utf-8")) for m in prompt if isinstance(m, dict))


def screen_prompts(tasks: Sequence[Task], env_factory: Callable[[], Env], tokenizer, budget: int) -> Screened:
    """``tasks`` split into those whose prompt fits ``budget`` tokens and those over it (module
    docstring); ``tokenizer`` is the run's (:class:`~saorl.models.codec.RunTokenizer`)."""
    from saorl.errors import StartupError

    per_token = max_token_bytes(tokenizer) if bytes_bound_holds(tokenizer) else None
    env = env_factory()
    kept: list[Task] = []
    overlong: list[tuple[Task, int | None]] = []
    for task in tasks:
        try:
            prompt = env.reset(task, Progress())
        except Exception as e:
            raise StartupError(f"task {task.id!r}: the env's reset, which renders its prompt, failed: "
                               f"{type(e).__name__}: {e}") from None
        if per_token is not None and _prompt_bytes(prompt) > budget * per_token:
            overlong.append((task, None))
            continue
        n = len(tokenizer.prompt_ids(prompt))
        if n > budget:
            overlong.append((task, n))
        else:
            kept.append(task)
    return Screened(kept, overlong)


def describe_overlong(screened: Screened, total: int, what: str, budget_text: str) -> str:
    """``3 of 5000 training tasks have prompts over 336 tokens (...): t1 (512 tokens), ...``."""
    shown = ", ".join(f"{t.id} ({n} tokens)" if n is not None else f"{t.id} (over by its size in bytes)"
                      for t, n in screened.overlong[:3])
    more = f" and {len(screened.overlong) - 3} more" if len(screened.overlong) > 3 else ""
    return (f"{len(screened.overlong)} of {total} {what} have prompts over {budget_text}: "
            f"{shown}{more}")


def fitting_tasks(tasks: list[Task], env_factory: Callable[[], Env], tokenizer, *, max_total_tokens: int,
                  max_new_tokens: int, mode: str, what: str,
                  log: Callable[[str], None] = print) -> list[Task]:
    """``tasks`` under ``env.overlong_prompts`` = ``mode`` (module docstring): those that fit, with
    a line through ``log`` for the ones left out; :class:`~saorl.errors.StartupError` for
    ``error``, or when no task fits at all."""
    from saorl.errors import StartupError

    budget = max_total_tokens - max_new_tokens
    screened = screen_prompts(tasks, env_factory, tokenizer, budget)
    if not screened.overlong:
        return list(tasks)
    budget_text = (f"{budget} tokens (rollout.max_total_tokens {max_total_tokens} − rollout.max_new_tokens "
                   f"{max_new_tokens})")
    text = describe_overlong(screened, len(tasks), what, budget_text)
    if mode == "error":
        raise StartupError(f"{text}. Raise rollout.max_total_tokens, shorten those prompts, or set "
                           "env.overlong_prompts=filter to leave them out")
    if not screened.kept:
        raise StartupError(f"{text}: none is left to play. Raise rollout.max_total_tokens or shorten the "
                           "prompts")
    log(f"prompts: {text}; left out (env.overlong_prompts=filter)")
    return screened.kept
