"""``summary.md`` of ``saorl bench pipeline``: runs, async/sync ratio, targets, machine limit, profiles."""

from __future__ import annotations

import statistics
from pathlib import Path

RUN_COLUMNS = ["mode", "rep", "window s", "steps", "trained tok/s", "traj/s", "trainer idle", "slot util",
               "engine step util", "staleness mean", "p50", "p90", "max", "positions / action tok",
               "load 1 min"]


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    align = ["---"] + ["---:"] * (len(header) - 1)
    return ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |",
            *("| " + " | ".join(r) + " |" for r in rows)]


def run_rows(records: list[dict]) -> list[list[str]]:
    return [[r["mode"], str(r["rep"] + 1), f"{r['window_s']:.1f}", str(r["steps"]),
             f"{r['tokens_per_s']:.0f}",
             f"{r['trajectories_per_s']:.2f}", f"{r['trainer_idle_frac']:.2f}", f"{r['slot_util']:.2f}",
             f"{r['engine_step_util']:.2f}", f"{r['staleness_mean']:.2f}", f"{r['staleness_p50']:.1f}",
             f"{r['staleness_p90']:.1f}", str(r["staleness_max"]),
             f"{r.get('positions_per_action_token', float('nan')):.2f}",
             f"{r.get('load_start', float('nan')):.1f} → {r.get('load_end', float('nan')):.1f}"]
            for r in records]


def ratio_line(rs: list[float], what: str = "async/sync") -> str:
    if not rs:
        return f"{what} trained tokens/s: no complete pair"
    sd = statistics.stdev(rs) if len(rs) > 1 else 0.0
    each = ", ".join(f"{x:.2f}×" for x in rs)
    return (f"{what} trained tokens/s: **{statistics.fmean(rs):.2f}× ± {sd:.2f}** (mean ± sd over "
            f"{len(rs)} rep{'s' if len(rs) > 1 else ''}; min–max {min(rs):.2f}–{max(rs):.2f}; each: {each})")


def profile_lines(pieces: dict) -> list[str]:
    learn, gen = pieces["learner"], pieces["generation"]
    lines = [f"One SAO step (K critic updates + one policy update) on {learn['tokens_per_step']:.0f} action "
             f"tokens: {1000 * learn['step_s']:.0f} ms ({learn['tokens_per_s']:.0f} tok/s); "
             f"{learn.get('positions_per_action_token', float('nan')):.2f} positions per action token; "
             "shares are of `learner.step`.", ""]
    lines += _table(["piece", "ms / step", "share", "calls / step"],
                    [[r["piece"], f"{r['ms_per_step']:.1f}", f"{100 * r['share']:.1f}%", f"{r['calls']:.1f}"]
                     for r in learn["rows"]])
    lines += ["", f"Engine, generation alone ({gen['wall_s']:.1f} s, {gen['slots']} slots, mean batch "
              f"{gen['mean_batch']:.1f}): {gen['tokens_per_s']:.0f} action tok/s; decode steps alone "
              f"{gen['pure_decode_tokens_per_s']:.0f} tok/s. Shares are of wall time; `(total)` rows "
              "include the rows above them."]
    if "prefill_share" in gen:
        lines += ["", f"Prefill share of generation: **{100 * gen['prefill_share']:.1f}%** (prefill forwards "
                  "and the decode rows that fed session turns' new tokens); "
                  f"{gen['prefill_tokens']:.0f} prompt tokens run through the model for "
                  f"{gen['tokens']:.0f} sampled; {gen['prefix_hits']} of {gen['requests']} requests "
                  f"extended their session's cached prefix ({gen['prefix_tokens_reused']:.0f} tokens not "
                  "recomputed)."]
    lines += [""]
    lines += _table(["piece", "seconds", "share", "calls"],
                    [[r["piece"], f"{r['ms_per_step'] / 1000:.2f}", f"{100 * r['share']:.1f}%",
                      f"{r['calls']:.0f}"] for r in gen["rows"]])
    curve = ", ".join(f"b={b}: {1000 * s:.1f} ms" for b, s in pieces["decode_curve"])
    lines += ["", f"Decode step vs batch (forward + sampling + bookkeeping, median): {curve}."]
    return lines


def summary_markdown(result: dict) -> str:
    spec, lim = result["spec"], result["pieces"]["limit"]
    lines = ["# saorl bench pipeline", "",
             f"Command: `{result['command']}`", "",
             f"Load before: `{result['load_before']}`; after: `{result['load_after']}`; "
             f"{lim['cores']} cores; trainer threads {spec['trainer_threads']}, worker threads "
             f"{spec['worker_threads']}; {spec['reps']} × (sync, async), {spec['budget_s']:.0f} s each, "
             f"env {spec['env']}; whole benchmark {result['elapsed_s']:.0f} s.", "",
             "## Runs", ""]
    lines += _table(RUN_COLUMNS, run_rows(result["records"]))
    lines += ["", ratio_line(result["ratios"])]
    if result.get("ratios_sync_sao"):
        lines += ["", ratio_line(result["ratios_sync_sao"], "async/sync_sao (same algorithm)")]
    sim, insitu = result.get("sim_prediction"), result.get("sim_prediction_in_situ")
    if sim:
        lines += ["", "The simulator (`saorl.sim`, fed this run's measurements, `measurement.json`) "
                  "predicts, from the stages measured alone with one contention factor: "
                  f"sync {sim['sync_tokens_per_s']:.0f} tok/s, async {sim['async_tokens_per_s']:.0f} tok/s, "
                  f"{sim['ratio']:.2f}×."]
    if insitu:
        f = result["sim_inputs"]["in_situ"]
        speeds = "; ".join(f"{m}: trainer ×{v['train_scale']:.2f}, engine ×{v['decode_scale']:.2f}"
                           for m, v in f.items())
        lines += ["", f"From the stage speeds seen inside the runs (time per step and per token over the "
                  f"isolated measurement — {speeds}): sync {insitu['sync_tokens_per_s']:.0f} tok/s, async "
                  f"{insitu['async_tokens_per_s']:.0f} tok/s, **{insitu['ratio']:.2f}×**."]
    lines += ["", "## Targets", ""]
    lines += _table(["target", "measured", "goal", "result"],
                    [[t["target"], f"{t['measured']:.2f}", t["goal"], "PASS" if t["pass"] else "MISS"]
                     for t in result["targets"]])
    before = f"{lim['G_before']:.0f}" if lim.get("G_before") else "-"
    fit = lim.get("T_fit")
    fit_note = f"; the fit said {fit:.0f}" if fit is not None and fit != lim["T"] else ""
    lines += ["", f"Machine limit: generation alone G = {lim['G']:.0f} tok/s (before the runs {before}, "
              "after "
              f"{lim.get('G_after', lim['G']):.0f}; the faster counts), training alone T = "
              f"{lim['T']:.0f} tok/s (SAO step + publication + journal; from the "
              f"{lim.get('T_source', 'fit on the generation-alone sample')}"
              f"{fit_note}); "
              f"{lim['threads']} threads on {lim['cores']} cores → limit = {lim['formula']} = "
              f"**{lim['tokens_per_s']:.0f} tok/s**.", ""]
    c = result["pieces"]["contention"]
    lines += [f"Both stages at once (generation in a worker process, SAO steps back to back here): "
              f"generation {c['generation_tokens_per_s']:.0f} tok/s (×{1 / c['generation_slowdown']:.2f} of "
              f"alone), training {c['train_tokens_per_s']:.0f} tok/s (×{1 / c['train_slowdown']:.2f} "
              "of alone).",
              "", "## Profiles", ""]
    lines += profile_lines(result["pieces"])
    return "\n".join(lines) + "\n"


def write_summary(result: dict, path: Path) -> str:
    text = summary_markdown(result)
    path.write_text(text, encoding="utf-8")
    return text
