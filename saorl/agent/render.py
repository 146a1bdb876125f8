"""Pretty-printing of one episode: prompt, actions and observations visually distinct.

Used by ``saorl eval --show N`` and ``saorl envs sample``. The text comes from decoding the
trajectory's own token ids span by span, each span in its context
(:meth:`saorl.models.codec.RunTokenizer.span_text`, so no space is added or lost at a boundary
and the parts join up to exactly what the trainer sees), plus ``episode.final_observation``, the
last env message, which the agent loop does not tokenize. Turns come from
``episode.turn_spans`` when present (the agent loop writes it), else from the runs of
``action_mask == 1``.

With ``color`` the parts are ANSI-coloured (prompt dim, actions green, observations yellow,
rewards magenta) and carry no markers; without it they are labelled ``[prompt]``, ``[act k]``,
``[obs k]`` and ``[reward k]``.
"""

from __future__ import annotations

from typing import Any

from saorl.data.trajectory import Trajectory
from saorl.models.codec import as_run_tokenizer

_ANSI = {"prompt": "\x1b[2m", "act": "\x1b[32m", "obs": "\x1b[33m", "reward": "\x1b[35m",
         "header": "\x1b[1m"}
_RESET = "\x1b[0m"


def _action_spans(traj: Trajectory) -> list[tuple[int, int]]:
    spans = traj.episode.turn_spans
    if spans:
        return [(int(a), int(b)) for a, b in spans]
    out: list[tuple[int, int]] = []
    start = None
    for t, m in enumerate([*traj.action_mask, 0]):
        if m and start is None:
            start = t
        elif not m and start is not None:
            out.append((start, t))
            start = None
    return out


def _part(kind: str, label: str, text: str, color: bool) -> str:
    text = text[:-1] if text.endswith("\n") else text  # blocks are joined by newlines
    return f"{_ANSI[kind]}{text}{_RESET}" if color else f"[{label}]\n{text}"


def _header(traj: Trajectory, turns: int) -> str:
    ep = traj.episode
    bits = [f"task {traj.task_id}"]
    if ep.env:  # played by the agent loop: its record is filled in
        bits.append(f"env {ep.env}")
    bits.append(f"turns {turns}")
    if ep.env:
        bits.append(f"success {ep.success}")
    bits.append(f"reward {traj.total_reward:g}")
    if traj.truncated:
        bits.append(f"truncated ({ep.truncation or '?'})")
    return " | ".join(bits)


def trajectory_parts(traj: Trajectory, tokenizer: Any) -> list[tuple[str, str, str]]:
    """The episode's parts in order, as ``(kind, label, text)``: kind ``prompt``, ``act``, ``obs``
    (each observation as the trajectory holds it: with ``chat`` observations, the closing of the
    assistant's turn, the message and the next assistant header) or ``reward`` (text empty)."""
    codec = as_run_tokenizer(tokenizer)

    def dec(a: int, b: int) -> str:
        return codec.span_text(traj.token_ids, a, b)

    spans = _action_spans(traj)
    parts = [("prompt", "prompt", dec(0, traj.prompt_len))]
    pos = traj.prompt_len
    for k, (a, b) in enumerate(spans, 1):
        if a > pos:  # context between turns: the previous turn's observation
            parts.append(("obs", f"obs {k - 1}", dec(pos, a)))
        parts.append(("act", f"act {k}", dec(a, b)))
        parts.append(("reward", f"reward {k}: {sum(traj.rewards[a:b]):g}", ""))
        pos = b
    if pos < len(traj.token_ids):
        parts.append(("obs", f"obs {len(spans)}", dec(pos, len(traj.token_ids))))
    final = traj.episode.final_observation
    if final:
        parts.append(("obs", f"obs {len(spans)} (final, not in tokens)", final))
    return parts


def render_trajectory(traj: Trajectory, tokenizer: Any, *, color: bool) -> str:
    """One episode as text: a header line, the prompt, then per turn action, reward, observation."""
    head = _header(traj, len(_action_spans(traj)))
    out = [f"{_ANSI['header']}{head}{_RESET}" if color else f"== {head} =="]
    for kind, label, text in trajectory_parts(traj, tokenizer):
        if kind == "reward":
            out.append(f"{_ANSI['reward']}[{label}]{_RESET}" if color else f"[{label}]")
        else:
            out.append(_part(kind, label, text, color))
    return "\n".join(out) + "\n"
