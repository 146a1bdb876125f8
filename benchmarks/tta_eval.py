"""The evaluator and the report of ``bench_tta.py``: one code path for every arm's checkpoints.

:func:`evaluate` loads a checkpoint directory with transformers alone (``AutoModelForCausalLM``,
``AutoTokenizer``: neither trainer's loader), formats each held-out question as the trainers were
given it (the chat template with the generation prompt for a chat model, the text otherwise),
decodes greedily (``max_new`` tokens at most, left-padded batches) and scores each reply with
:func:`tta_task.is_correct`. It returns the generations; :func:`accuracy` is recomputed from them.

:func:`report` turns the rows (one per arm, seed and fraction of the budget) into the table
(arm × fraction: mean held-out accuracy over seeds, and each seed's), ``results.json`` and
``tta.png`` (held-out accuracy against wall clock, one line per arm, from the base model's
accuracy at 0 s).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch
import tta_task


def sampling(temperature: float, seed: int) -> dict:
    """``generate``'s decoding arguments: greedy at ``temperature`` 0, else sampling from the whole
    distribution (a checkpoint's own ``generation_config`` top-k / top-p overridden); torch is seeded
    with ``seed`` here, once per evaluation, so a sampled evaluation repeats."""
    if temperature <= 0:
        return {"do_sample": False}
    torch.manual_seed(seed)
    return {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}


def _prompt_ids(tok, question: str, chat: bool) -> list[int]:
    if chat:
        ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                      tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return tok.encode(question)


def evaluate(ckpt: Path, rows: list[dict], chat: bool, max_new: int, batch: int = 32,
             temperature: float = 0.0, seed: int = 0) -> list[dict]:
    """Greedy replies of the model in ``ckpt`` to ``rows`` (``{"question", "answer"}``), scored:
    ``{"question", "answer", "reply", "correct", "bare"}`` per row, in order. ``temperature`` > 0:
    sampled from the whole distribution instead (no top-k or top-p), torch seeded with ``seed``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    decoding = sampling(temperature, seed)
    out = []
    for i in range(0, len(rows), batch):
        part = rows[i:i + batch]
        prompts = [_prompt_ids(tok, r["question"], chat) for r in part]
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.no_grad():
            # use_cache: a checkpoint TRL saved says false (its training config), which would recompute
            # every prefix at each token (the same replies, many times slower)
            gen = model.generate(input_ids=ids, attention_mask=mask, **decoding,
                                 max_new_tokens=max_new,
                                 pad_token_id=pad, eos_token_id=tok.eos_token_id, use_cache=True)
        for r, seq in zip(part, gen[:, width:]):
            reply = tok.decode(seq, skip_special_tokens=True)
            out.append({"question": r["question"], "answer": r["answer"], "reply": reply,
                        "correct": tta_task.is_correct(reply, r["answer"]),
                        "bare": tta_task.is_bare_integer(reply)})
    return out


def accuracy(generations: list[dict]) -> float:
    """The fraction of replies whose last integer is the answer (recomputed from the replies)."""
    return statistics.fmean(tta_task.is_correct(g["reply"], g["answer"]) for g in generations)


# ------------------------------------------------------------------------------------------ report
def _cell(rows: list[dict]) -> str:
    if not rows:
        return "–"
    accs = [r["accuracy"] for r in sorted(rows, key=lambda r: r["seed"])]
    steps = "/".join(str(r["steps"]) for r in sorted(rows, key=lambda r: r["seed"]))
    each = ", ".join(f"{a:.3f}" for a in accs)
    return f"**{statistics.fmean(accs):.3f}** ({each}; steps {steps})"


def table(rows: list[dict], arms: list[str], fractions: list[float], budget_s: float) -> str:
    """Markdown: one line per arm, one column per fraction of the budget."""
    head = "| arm | " + " | ".join(f"{f * budget_s:.0f} s ({f:g})" for f in fractions) + " |"
    lines = [head, "|---|" + "---:|" * len(fractions)]
    for arm in arms:
        cells = [_cell([r for r in rows if r["arm"] == arm and r["fraction"] == f]) for f in fractions]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def per_seed(rows: list[dict], arm: str, fraction: float) -> dict[int, float]:
    return {r["seed"]: r["accuracy"] for r in rows if r["arm"] == arm and r["fraction"] == fraction}


def pairs(arms: list[str]) -> list[tuple[str, str]]:
    """The comparisons a report makes: every arm against TRL, and every other arm against saorl's GRPO."""
    refs = [ref for ref in ("trl", "grpo") if ref in arms]
    return [(a, ref) for ref in refs for a in arms if a != ref and not (ref == "grpo" and a == "trl")]


def paired_table(rows: list[dict], arms: list[str], fractions: list[float], budget_s: float) -> str:
    """Markdown: per comparison and fraction, the mean per-seed difference with its 95% t-interval
    (paired by seed: the same held-out problems, the same seed's data order) and each seed's."""
    from saorl.experiments.stats import paired_interval

    head = "| arm − reference | " + " | ".join(f"{f * budget_s:.0f} s" for f in fractions) + " |"
    lines = [head, "|---|" + "---:|" * len(fractions)]
    for a, ref in pairs(arms):
        cells = []
        for f in fractions:
            mine, theirs = per_seed(rows, a, f), per_seed(rows, ref, f)
            iv = paired_interval(mine, theirs)
            each = ", ".join(f"{mine[k] - theirs[k]:+.3f}" for k in sorted(mine) if k in theirs)
            cells.append("–" if iv is None else f"{iv.fmt(signed=True)} ({each})")
        lines.append(f"| {a} − {ref} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def time_to(rows: list[dict], arms: list[str], ref: str = "trl") -> str:
    """When each arm's mean held-out accuracy first reaches ``ref``'s at the budget's end (the issue's
    "TRL's accuracy at 10 minutes in half the wall clock"), from the snapshots; "" without ``ref``."""
    if ref not in arms or not any(r["arm"] == ref for r in rows):
        return ""
    last = max(r["fraction"] for r in rows if r["arm"] == ref)
    target = statistics.fmean(per_seed(rows, ref, last).values())
    parts = []
    for arm in arms:
        reached = "not within the budget"
        for f in sorted({r["fraction"] for r in rows if r["arm"] == arm}):
            mine = [r for r in rows if r["arm"] == arm and r["fraction"] == f]
            if statistics.fmean(r["accuracy"] for r in mine) >= target:
                reached = f"{statistics.fmean(r['elapsed_s'] for r in mine):.0f} s ({f:g} of the budget)"
                break
        parts.append(f"{arm}: {reached}")
    return (f"{ref}'s mean held-out accuracy at the budget's end is {target:.3f}; the first snapshot at "
            "which each arm's mean reaches it: " + "; ".join(parts) + ".")


def plot(rows: list[dict], arms: list[str], base: float, path: Path, title: str = "") -> Path:
    """Held-out accuracy (mean over seeds) against the mean elapsed wall clock of each fraction; each
    seed's points faint behind the means."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for arm in arms:
        mine = [r for r in rows if r["arm"] == arm]
        fracs = sorted({r["fraction"] for r in mine})
        xs = [0.0] + [statistics.fmean(r["elapsed_s"] for r in mine if r["fraction"] == f) for f in fracs]
        ys = [base] + [statistics.fmean(r["accuracy"] for r in mine if r["fraction"] == f) for f in fracs]
        (line,) = ax.plot(xs, ys, marker="o", label=arm)
        ax.scatter([r["elapsed_s"] for r in mine], [r["accuracy"] for r in mine], s=12, alpha=0.35,
                   color=line.get_color())
    ax.set_xlabel("wall clock since the arm's process started (s)")
    ax.set_ylabel("held-out accuracy")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def decoding(meta: dict) -> str:
    """How the evaluator decoded, in words (a report from before ``eval_temperature`` was greedy)."""
    t = meta.get("eval_temperature") or 0.0
    return "greedy" if t <= 0 else f"sampled at temperature {t:g}, one episode a problem"


def report(out: Path, rows: list[dict], arms_run: list[dict], base: dict, meta: dict) -> str:
    """``summary.md``, ``results.json`` and ``tta.png`` in ``out``; returns the summary's text."""
    arms = list(dict.fromkeys(r["arm"] for r in arms_run))
    fractions = sorted({r["fraction"] for r in rows})
    lines = [f"# Time to accuracy: {', '.join(arms)} ({meta['model']}, {meta['cores']} cores)", "",
             f"Held-out accuracy ({decoding(meta)}, {meta['test_n']} problems; "
             f"base model {base['accuracy']:.3f}) "
             f"at fractions of a {meta['budget_s']:.0f} s budget per arm (process start to the snapshot), "
             "mean over seeds (each seed; policy updates by then):", "",
             table(rows, arms, fractions, meta["budget_s"]), ""]
    if meta.get("partial"):
        lines[2:2] = [f"**Partial: the evaluation was cut short ({meta['partial']}).**", ""]
    if len({r["seed"] for r in rows}) > 1 and pairs(arms):
        lines += ["Paired by seed: the mean difference in held-out accuracy, its 95% t-interval over "
                  "seeds and each seed's difference:", "",
                  paired_table(rows, arms, fractions, meta["budget_s"]), ""]
    if time_to(rows, arms) and not meta.get("partial"):  # partial: earlier snapshots may be unscored
        lines += [time_to(rows, arms), ""]
    if meta.get("overrides"):
        lines += ["Overrides: " + "; ".join(f"{arm} ({(meta.get('variants') or {}).get(arm, arm)}): "
                                            + " ".join(o) for arm, o in meta["overrides"].items()), ""]
    lines += ["| arm | seed | load 1 min start → end | exited after s | exit status |",
             "|---|---:|---|---:|---:|"]
    lines += [f"| {a['arm']} | {a['seed']} | {a['load_start']:.1f} → {a['load_end']:.1f} | "
              f"{a['exit_s']:.1f} | {a['returncode']} |" for a in arms_run]
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text, encoding="utf-8")
    if not meta.get("partial"):  # a partial report leaves results.json to the finished evaluation
        (out / "results.json").write_text(json.dumps({"meta": meta, "base": base, "arms": arms_run,
                                                      "rows": rows}, indent=1) + "\n", encoding="utf-8")
    seeds = len({r["seed"] for r in rows})
    plot(rows, arms, base["accuracy"], out / "tta.png",
         f"{meta['model']}: {meta['budget_s']:.0f} s per arm, {seeds} seed(s), "
         f"{meta['test_n']} held-out problems ({decoding(meta).split(',')[0]})")
    return text
