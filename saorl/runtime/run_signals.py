"""A run's continuous stability signals, from its ``metrics.jsonl`` and ``eval.jsonl``.

Computed over a run's first ``steps`` trainer steps (None: all of them), so that arms of an
experiment are compared at **equal trainer steps** (:mod:`saorl.experiments.stability`):

- ``drift bursts``: the share of steps whose ``mismatch/kl`` — KL(rollout ‖ trainer) on the
  trained tokens, engine mismatch plus the policy's drift since they were sampled — is above
  :data:`DRIFT_KL` (the drift-burst index);
- ``max 10-step KL``: the largest mean ``mismatch/kl`` over :data:`WINDOW` consecutive steps;
- ``reward AUC``: the area under the training-reward curve per step (the mean ``reward/mean``
  over the steps): a run that learns early and stays up scores high, one that tips over loses
  the rest of its area;
- ``acc@S``: test accuracy at the evaluation of step S (the last one at or before it);
- ``update rel``: the mean relative parameter movement of the policy per step,
  ``‖θ_after − θ_before‖ / ‖θ_before‖`` (``policy/update_rel``, logged by the learner);
- ``collapsed``: whether the run ended collapsed (:func:`collapse_step`).

Every ``saorl train`` run writes them to ``RUN/stability.json`` at its end
(:func:`write_run_stability`) and prints them on one line (:func:`summary_line`). The same
thresholds raise the live alarms of a run in progress (:mod:`saorl.runtime.alarms`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

DRIFT_KL = 0.05
"""The KL(rollout ‖ trainer) above which a step counts as a drift burst."""
WINDOW = 10
"""Steps of the rolling mean behind ``max 10-step KL``."""
DIS_KEPT_MIN = 0.5
"""The DIS kept fraction (``policy/dis_kept_frac``) below which a step counts as a drift burst
too: most sampled tokens' ratio to the trainer left the trust band, so most are masked out."""
LENGTH_COLLAPSE_FRAC = 0.25
"""A step whose mean action length is below this fraction of the median over the run's steps
before it counts as an action-length collapse (the policy learned to stop at once)."""
CUT_SHORT_FRAC = 0.25
"""The share of a held-out evaluation's episodes ended by a limit, not by the env
(``eval/truncated_frac``), above which the held-out-episodes-cut-short alarm fires."""
CRITIC_BAD_STEPS = WINDOW
"""Steps in a row of ``critic/explained_var`` ≤ 0 that count as a critic that does not learn."""


def _steps(metrics: Sequence[dict], steps: int | None) -> list[dict]:
    return [r for r in metrics if r.get("step", 0) > 0 and (steps is None or r["step"] <= steps)]


def _vals(rows: Sequence[dict], key: str) -> list[float]:
    return [float(r[key]) for r in rows if r.get(key) is not None and math.isfinite(float(r[key]))]


def drift_bursts(rows: Sequence[dict], threshold: float = DRIFT_KL) -> float | None:
    kl = _vals(rows, "mismatch/kl")
    return sum(v > threshold for v in kl) / len(kl) if kl else None


def max_window_mean(rows: Sequence[dict], key: str = "mismatch/kl", window: int = WINDOW) -> float | None:
    """The largest mean of ``key`` over ``window`` consecutive values (all of them if fewer)."""
    vals = _vals(rows, key)
    if not vals:
        return None
    w = min(window, len(vals))
    return max(statistics.fmean(vals[i:i + w]) for i in range(len(vals) - w + 1))


def reward_auc(rows: Sequence[dict]) -> float | None:
    vals = _vals(rows, "reward/mean")
    return statistics.fmean(vals) if vals else None


def accuracy_at(evals: Sequence[dict], step: int) -> float | None:
    """``eval/accuracy`` of the last evaluation at or before ``step``."""
    got = [(int(r["step"]), float(r["eval/accuracy"])) for r in evals
           if r.get("eval/accuracy") is not None and int(r.get("step", 0)) <= step]
    return max(got)[1] if got else None


def stability_values(metrics: Sequence[dict], evals: Sequence[dict] = (), *, steps: int | None = None,
                     at: Sequence[int] = ()) -> dict[str, float | None]:
    """The module docstring's signals of one run over its first ``steps`` steps (None: all),
    with ``acc@S`` for each S in ``at``."""
    rows = _steps(metrics, steps)
    moved = _vals(rows, "policy/update_rel")
    out = {"steps": float(rows[-1]["step"]) if rows else 0.0, "drift bursts": drift_bursts(rows),
           "max 10-step KL": max_window_mean(rows), "reward AUC": reward_auc(rows),
           "update rel": statistics.fmean(moved) if moved else None}
    for s in at:
        out[f"acc@{s}"] = accuracy_at(evals, s)
    rewarded = any(r.get("reward/mean") is not None for r in rows)
    out["collapsed"] = (1.0 if collapse_step(rows) is not None else 0.0) if rewarded else None
    return out


COLLAPSE_MIN_STEPS = 20
"""The shortest zero-reward tail counted as a collapse (a healthy run at 40% success has a 4-rollout
batch with no success at about 1 step in 8: twenty in a row is not chance)."""


def collapse_step(metrics: list[dict], key: str = "reward/mean") -> int | None:
    """The first step of the run's final stretch of steps whose ``key`` is exactly 0, if that
    stretch is at least :data:`COLLAPSE_MIN_STEPS` steps long, reaches the last step and follows
    a rewarded step: the run ended collapsed (no rollout rewarded any more, so a group or critic
    baseline has nothing to learn from: an absorbing state). None for a run that did not end so,
    and for one never rewarded at all (a start that cannot solve the task did not collapse)."""
    rows = [r for r in metrics if r.get("step", 0) > 0 and r.get(key) is not None]
    start, n = zero_tail(rows, key)
    return start if COLLAPSE_MIN_STEPS <= n < len(rows) else None


def zero_tail(rows: Sequence[dict], key: str = "reward/mean") -> tuple[int | None, int]:
    """(first step, length) of the final stretch of ``rows`` whose ``key`` is exactly 0."""
    start, n = None, 0
    for r in reversed(rows):
        if float(r[key]) != 0.0:
            break
        start, n = int(r["step"]), n + 1
    return start, n


def write_run_stability(run_dir) -> dict[str, float | None]:
    """The run's signals (all its steps; ``acc@S`` at each evaluated step) into
    ``RUN/stability.json``; returns them."""
    from saorl.atomic import write_json
    from saorl.data.jsonl import read_jsonl
    from saorl.run_paths import RunPaths
    from saorl.runtime.recorder import effective_rows

    paths = RunPaths(run_dir)
    metrics = effective_rows(read_jsonl(paths.metrics))
    evals = read_jsonl(paths.eval) if paths.eval.is_file() else []
    evals = list({int(r.get("step", 0)): r for r in evals}.values())  # a step redone after a resume: its last
    values = stability_values(metrics, evals, at=sorted({int(r["step"]) for r in evals if r.get("step")}))
    write_json(paths.stability, {"drift_kl": DRIFT_KL, "window": WINDOW, **values})
    return values


def summary_line(values: Mapping[str, float | None]) -> str:
    """One line of a run's signals for the console."""
    def f(key: str, fmt: str) -> str:
        v = values.get(key)
        return "–" if v is None else format(v, fmt)

    return (f"stability over {f('steps', '.0f')} steps: drift bursts (KL > {DRIFT_KL:g}) "
            f"{f('drift bursts', '.1%')}, max {WINDOW}-step KL {f('max 10-step KL', '.4f')}, "
            f"reward AUC {f('reward AUC', '.3f')}, "
            f"update rel {f('update rel', '.2e')} (stability.json)")
