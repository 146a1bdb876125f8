"""The report on fabricated run files: table cells against hand-computed numbers, recovery steps
on a hand-made reward curve, PNGs on disk."""

import json
import math

import pytest

from saorl.experiments.report import (
    dedupe_metrics,
    fmt_spread,
    load_arms,
    markdown_table,
    recovery_steps,
    run_summary,
    smooth,
    table_rows,
    write_report,
)
from saorl.experiments.runner import run_dir_for


def _write(run_dir, metrics, evals):
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    (run_dir / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))


def _fake_run(out, arm, seed, accs, rewards, *, critic=True, dt=2.0):
    """Evals at steps 0, 5, 10, ... with ``accs``; one metrics row per step with ``rewards``."""
    metrics = [{"step": i + 1, "reward/mean": r, "time/elapsed_s": dt * (i + 1),
                "critic/value_loss": 0.5 / (i + 1) if critic else None, "policy/dis_kept_frac": 0.9,
                "rollout/staleness_mean": 1.5, "policy/entropy": 1.0} for i, r in enumerate(rewards)]
    evals = [{"step": 5 * k, "eval/accuracy": a, "eval/reward_mean": a} for k, a in enumerate(accs)]
    _write(run_dir_for(out, arm, seed), metrics, evals)


def test_fmt_spread_by_hand():
    # mean 0.5, sample sd sqrt(((0.4-.5)^2 + 0 + (0.6-.5)^2) / 2) = 0.1
    assert fmt_spread([0.4, 0.5, 0.6]) == "0.500 ± 0.100 (0.400–0.600, n=3)"
    assert fmt_spread([0.25]) == "0.250"
    assert fmt_spread([None, math.nan]) == "–"
    assert fmt_spread([10.0, 20.0], digits=0) == "15 ± 7 (10–20, n=2)"


def test_table_rows_by_hand(tmp_path):
    # arm sao: seed 0 accs 0.2 -> 0.5 (best 0.6), seed 1 accs 0.2 -> 0.7; 10 steps each
    _fake_run(tmp_path, "sao", 0, [0.2, 0.6, 0.5], [0.0] * 9 + [0.4])
    _fake_run(tmp_path, "sao", 1, [0.2, 0.3, 0.7], [0.1] * 9 + [0.8])
    _fake_run(tmp_path, "grpo", 0, [0.2, 0.1], [0.3] * 5, critic=False)
    sft = run_dir_for(tmp_path, "sft", 0)
    _write(sft, [], [{"step": 0, "eval/accuracy": 0.2}])
    arms = load_arms(tmp_path, ["sao", "grpo", "sft", "missing"], [0, 1])
    rows = {r[0]: r for r in table_rows(arms)}
    assert set(rows) == {"sao", "grpo", "sft"}  # an arm without runs has no row
    sao = rows["sao"]
    assert sao[1] == "2"
    assert sao[2] == "0.200 ± 0.000 (0.200–0.200, n=2)"  # start
    assert sao[3] == "0.600 ± 0.141 (0.500–0.700, n=2)"  # final: 0.5, 0.7; sd = 0.1414
    assert sao[4] == "0.650 ± 0.071 (0.600–0.700, n=2)"  # best: 0.6, 0.7
    # final reward = last 10% of 10 steps = the last step: 0.4 and 0.8
    assert sao[5] == "0.600 ± 0.283 (0.400–0.800, n=2)"
    # critic loss 0.5/1 ... 0.5/10 in both seeds: its population sd, by a naive loop
    losses = [0.5 / (i + 1) for i in range(10)]
    mean = sum(losses) / 10
    sd = (sum((x - mean) ** 2 for x in losses) / 10) ** 0.5
    assert sao[6] == f"{sd:.3f} ± 0.000 ({sd:.3f}–{sd:.3f}, n=2)"
    assert sao[7] == "10 ± 0 (10–10, n=2)" and sao[8] == "20 ± 0 (20–20, n=2)"
    assert rows["grpo"][2:] == ["0.200", "0.100", "0.200", "0.300", "–", "5", "10"]
    assert rows["sft"][2:5] == ["0.200", "0.200", "0.200"] and rows["sft"][7] == "0"
    md = markdown_table(arms)
    assert md.splitlines()[0].startswith("| arm | seeds | start acc | final acc")
    assert len(md.splitlines()) == 2 + 3


def test_resumed_run_dedupes_steps_and_keeps_the_clock_going():
    rows = [{"step": 1, "time/elapsed_s": 1.0, "reward/mean": 0.1},
            {"step": 2, "time/elapsed_s": 2.0, "reward/mean": 0.2},
            {"step": 3, "time/elapsed_s": 3.0, "reward/mean": 0.3},  # lost: resumed from step 2
            {"step": 3, "time/elapsed_s": 0.5, "reward/mean": 0.35},
            {"step": 4, "time/elapsed_s": 1.5, "reward/mean": 0.4}]
    out = dedupe_metrics(rows)
    assert [r["step"] for r in out] == [1, 2, 3, 4]
    assert [r["reward/mean"] for r in out] == [0.1, 0.2, 0.35, 0.4]
    assert [r["wall_s"] for r in out] == [1.0, 2.0, 2.5, 3.5]


def test_final_reward_window_and_summary():
    from saorl.experiments.report import RunData, final_reward

    rows = [{"step": i + 1, "reward/mean": float(i)} for i in range(20)]
    assert final_reward(rows) == pytest.approx((18 + 19) / 2)  # 10% of 20 steps = 2
    s = run_summary(RunData(0, [], [{"step": 0, "eval/accuracy": 0.3}]))
    assert s["start_acc"] == s["final_acc"] == s["best_acc"] == 0.3 and s["final_reward"] is None


def test_recovery_steps_hand_made_curve():
    # steps 1..30; switches at 10 and 20. Before 10: reward 1.0. After 10: two stale high steps
    # (11, 12), then 0 for 13..15, then 1.0 from 16 on. Target = 0.8.
    # Smoothed (trailing 5, post-switch only): t=11:1, 12:1, 13:.667 (fell), 14:.5, 15:.4, 16:.4,
    # 17:.4, 18:.6, 19:.8 -> recovered at 19: 9 steps.
    # After 20: pre = mean(11..20 after the switch at 10, window (10, 20]) =
    #   (1+1+0+0+0+1+1+1+1+1)/10 = 0.7, target 0.56; rewards 0.9 after 20: never fall -> 0.
    steps = list(range(1, 31))
    rewards = [1.0] * 10 + [1.0, 1.0, 0.0, 0.0, 0.0] + [1.0] * 5 + [0.9] * 10
    assert recovery_steps(steps, rewards, [10, 20]) == [9, 0]
    # never recovers before the end:
    assert recovery_steps(steps, [1.0] * 10 + [0.0] * 20, [10]) == [None]
    # a naive loop check of the smoothing on the first switch
    post = rewards[10:20]
    levels = [sum(post[max(0, j - 4): j + 1]) / len(post[max(0, j - 4): j + 1]) for j in range(10)]
    assert levels[8] >= 0.8 > levels[7]


def test_smooth_is_a_trailing_mean():
    ys = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert smooth(ys, 2) == [1.0, 1.5, 2.5, 3.5, 4.5]
    assert smooth(ys, 1) == ys


def test_write_report_makes_table_and_pngs(tmp_path):
    _fake_run(tmp_path, "sao", 0, [0.2, 0.6, 0.5], [1.0] * 10 + [0.0] * 3 + [1.0] * 7)
    _fake_run(tmp_path, "sao", 1, [0.2, 0.4, 0.6], [1.0] * 10 + [0.0] * 5 + [1.0] * 5)
    _fake_run(tmp_path, "reinforce_rm", 0, [0.2, 0.3, 0.3], [0.5] * 20, critic=False)
    _write(run_dir_for(tmp_path, "sft", 0), [], [{"step": 0, "eval/accuracy": 0.2}])
    arms = load_arms(tmp_path, ["sao", "reinforce_rm", "sft"], [0, 1])
    wanted = ["accuracy", "reward", "value_loss", "dis_kept_frac", "staleness", "entropy", "switches"]
    path = write_report(tmp_path, "t", "a test", arms, wanted, start_arm="sft", switches=[0, 10])
    text = path.read_text()
    assert "| arm | seeds |" in text and "recover@10" in text
    for name in ("accuracy_vs_steps", "accuracy_vs_wall", "reward_vs_steps", "reward_vs_wall",
                 "value_loss_vs_steps", "dis_kept_frac_vs_wall", "staleness_vs_steps", "entropy_vs_steps",
                 "reward_switches_vs_steps"):
        png = tmp_path / "plots" / f"{name}.png"
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert f"plots/{name}.png" in text
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [r["final_acc"] for r in summary["sao"]] == [0.5, 0.6]
    # recovery: sao seed 0 falls at 11..13 and is back by step 16/17; reinforce_rm is flat (0 steps)
    row = next(line for line in text.splitlines() if line.startswith("| reinforce_rm"))
    assert row.rstrip(" |").endswith("0")
    # stability at equal steps (all ran 20): reward AUC, collapses as a count with its exact interval
    stab = text.split("## Stability at equal trainer steps (the first 20,")[1].split("\n\n")[1].splitlines()
    assert "reward AUC − sao" in stab[0] and "Fisher p vs sao" in stab[0]
    sao, rm = (next(line for line in stab if line.startswith(f"| {a} |")) for a in ("sao", "reinforce_rm"))
    assert "| 0.800 [" in sao and "0/2 [0.00, 0.84]" in sao  # (17/20 + 15/20) / 2; never collapsed
    assert "| 0.550 [" in sao  # acc@20: the evaluations of step 10 (0.5 and 0.6)
    # accuracy at every evaluation all runs share (steps 5 and 10), before the last step's
    assert stab[0].index("acc@5 − sao") < stab[0].index("acc@10 − sao") < stab[0].index("acc@20 − sao")
    cells = dict(zip(stab[0].split(" | "), sao.split(" | ")))
    assert cells["acc@5"].startswith("0.500 [") and cells["acc@10"].startswith("0.550 [")  # (0.6+0.4)/2
    assert "| 0.500 (n=1) |" in rm and "0/1 [0.00, 0.97]" in rm and rm.endswith("| 1.00 |")


def test_finished_only_leaves_out_runs_cut_short(tmp_path):
    _fake_run(tmp_path, "sao", 0, [0.2, 0.6], [0.1] * 10)
    _fake_run(tmp_path, "sao", 1, [0.2], [0.1] * 3)  # still running: no done.json
    (run_dir_for(tmp_path, "sao", 0) / "done.json").write_text('{"steps": 10}\n')
    assert [r.seed for r in load_arms(tmp_path, ["sao"], [0, 1])[0].runs] == [0, 1]
    left: list[str] = []
    arms = load_arms(tmp_path, ["sao"], [0, 1], finished_only=True, left_out=left)
    assert [r.seed for r in arms[0].runs] == [0] and left == ["sao/seed-1"]
