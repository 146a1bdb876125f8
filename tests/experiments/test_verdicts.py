"""The report's verdicts on hand-made run directories: accuracy at equal steps and at equal wall
clock with paired intervals checked against a hand computation, the verdict rule, staleness,
collapses and the rewarded-but-wrong shares pooled over seeds."""

import json
import math

import pytest

from saorl.experiments.report import load_arms, write_report
from saorl.experiments.runner import run_dir_for
from saorl.experiments.stats import Interval
from saorl.experiments.verdicts import accuracy_at_wall, arm_section, gamed_share, verdict, verdict_section

T975_4 = 2.7764451052  # Student's t, 0.975 quantile, 4 degrees of freedom (tables)
STEPS = 24
SAO_MID, SAO_END = [0.4, 0.5, 0.5, 0.4, 0.45], [0.5, 0.6, 0.7, 0.6, 0.55]
GRPO_MID, GRPO_END = [0.3, 0.35, 0.4, 0.3, 0.45], [0.5, 0.6, 0.65, 0.6, 0.6]


def _run(out, arm, seed, *, dt, accs, rewards, stale, gamed, held, episodes):
    """Evaluations at steps 0, 12 and 24 (accuracies ``accs``), one metrics row per step ``dt``
    seconds apart; the final evaluation's rewarded-but-wrong share ``held`` of ``episodes``."""
    d = run_dir_for(out, arm, seed)
    d.mkdir(parents=True)
    metrics = [{"step": i + 1, "time/elapsed_s": dt * (i + 1), "reward/mean": rewards[i],
                "rollout/staleness_mean": stale, "env/rewarded_wrong": gamed} for i in range(STEPS)]
    evals = [{"step": 0, "eval/accuracy": 0.2}, {"step": 12, "eval/accuracy": accs[0]},
             {"step": 24, "eval/accuracy": accs[1], "eval/env/rewarded_wrong": held,
              "eval/episodes": episodes}]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    (d / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))


@pytest.fixture
def arms(tmp_path):
    # sao steps every 10 s (step 24 at 240 s); grpo every 20 s (step 12 at 240 s); grpo seed 4
    # is rewarded on its first 3 steps, then never again: 21 zero steps to the end, a collapse
    for s in range(5):
        _run(tmp_path, "sao", s, dt=10.0, accs=(SAO_MID[s], SAO_END[s]), rewards=[0.5] * STEPS,
             stale=[1.0, 2.0, 3.0, 2.0, 2.0][s], gamed=0.25, held=0.6 if s == 4 else 0.1,
             episodes=64 if s == 4 else 128)
        rewards = [0.5] * 3 + [0.0] * 21 if s == 4 else [0.5] * STEPS
        _run(tmp_path, "grpo", s, dt=20.0, accs=(GRPO_MID[s], GRPO_END[s]), rewards=rewards,
             stale=0.0, gamed=0.5, held=0.0, episodes=128)
    return tmp_path, load_arms(tmp_path, ["sao", "grpo"], range(5))


def _rows(section):
    lines = "\n".join(section).splitlines()
    return [[c.strip() for c in line.split("|")[1:-1]] for line in lines if line.startswith("| ")][1:]


def test_accuracy_at_wall_clock_is_the_policy_the_run_had_by_then(arms):
    _, (sao, grpo) = arms
    run = grpo.runs[0]
    assert [accuracy_at_wall(run.evals, m) for m in (0, 239.9, 240, 479, 480, 1e9)] == \
        [0.2, 0.2, GRPO_MID[0], GRPO_MID[0], GRPO_END[0], GRPO_END[0]]
    assert accuracy_at_wall(sao.runs[0].evals, 240) == SAO_END[0]  # sao reached step 24 by then


def test_verdicts_at_equal_steps_and_equal_wall_clock_by_hand(arms):
    _, trained = arms
    rows = {(r[0], r[1]): r for r in _rows(verdict_section(trained, "sao", [240.0]))}
    assert set(rows) == {("acc@24", "grpo"), ("acc@4min", "grpo"), ("reward AUC", "grpo")}
    # at 4 minutes: grpo's step-12 accuracies against sao's step-24 ones
    diffs = [g - s for g, s in zip(GRPO_MID, SAO_END)]  # -0.2 -0.25 -0.3 -0.3 -0.1
    mean = sum(diffs) / 5  # -0.23
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 4)  # sqrt(0.028 / 4)
    hw = T975_4 * sd / math.sqrt(5)  # 0.1039
    assert rows[("acc@4min", "grpo")][4] == f"{mean:+.3f} [{mean - hw:+.3f}, {mean + hw:+.3f}]*"
    assert rows[("acc@4min", "grpo")][4] == "-0.230 [-0.334, -0.126]*"
    assert rows[("acc@4min", "grpo")][5] == "reference ahead"
    # at equal steps (24): differences 0, 0, -0.05, 0, +0.05: mean 0, sd sqrt(0.005 / 4)
    hw24 = T975_4 * math.sqrt(0.005 / 4) / math.sqrt(5)
    assert rows[("acc@24", "grpo")][4] == f"+0.000 [{-hw24:+.3f}, {hw24:+.3f}]"
    assert rows[("acc@24", "grpo")][5] == f"not resolved ±{hw24:.3f}" == "not resolved ±0.044"
    own = T975_4 * math.sqrt(0.022 / 4) / math.sqrt(5)  # sao's own: squared deviations sum to 0.022
    assert rows[("acc@24", "grpo")][3] == f"0.590 [{0.59 - own:.3f}, {0.59 + own:.3f}]"
    assert rows[("acc@24", "grpo")][3] == "0.590 [0.498, 0.682]"
    # reward AUC: sao 0.5 on every seed; grpo seed 4 0.5 * 3 / 24
    assert rows[("reward AUC", "grpo")][2].startswith(f"{(4 * 0.5 + 0.0625) / 5:.3f} [")


def test_verdict_rule_needs_five_seeds_and_an_interval_off_zero():
    assert verdict(Interval(0.1, 0.05, 5)) == "arm ahead"
    assert verdict(Interval(-0.1, 0.05, 8)) == "reference ahead"
    assert verdict(Interval(0.1, 0.2, 5)) == "not resolved ±0.200"
    assert verdict(Interval(0.3, 0.05, 3)) == "no verdict (3 seeds < 5)"
    assert verdict(Interval(0.3, None, 1)) == "no verdict (1 seed < 5)"
    assert verdict(None) == "–"


def test_per_arm_staleness_collapses_and_rewarded_but_wrong(arms):
    _, (sao, grpo) = arms
    # held-out, pooled: sao (0.1 * 4 * 128 + 0.6 * 64) / 576
    assert gamed_share(sao.runs) == pytest.approx((0.25, (51.2 + 38.4) / 576, 576))
    assert gamed_share(grpo.runs) == pytest.approx((0.5, 0.0, 640))
    rows = {r[0]: r for r in _rows(arm_section([sao, grpo]))}
    assert rows["sao"][1:] == ["5", "2.000 [1.122, 2.878]", "0/5", "0.250", "0.156 (of 576)"]
    assert rows["grpo"][2:] == ["0.000 [0.000, 0.000]", "1/5", "0.500", "0.000 (of 640)"]
    hw = T975_4 * math.sqrt(2 / 4) / math.sqrt(5)  # staleness 1, 2, 3, 2, 2: squared deviations 2
    assert rows["sao"][2] == f"2.000 [{2 - hw:.3f}, {2 + hw:.3f}]"


def test_the_report_has_the_sections_only_when_asked(arms):
    out, trained = arms
    plain = write_report(out, "t", "", trained, [], reference="sao").read_text()
    assert "## Verdicts" not in plain and "## Per arm" not in plain
    report = write_report(out, "t", "", trained, [], reference="sao", verdicts=True,
                          wall_marks=[240.0, 600.0]).read_text()
    assert "## Verdicts against `sao`, at equal trainer steps (24) and at equal wall clock" in report
    # after 4 minutes every grpo run and no sao run was still training (sao ended at 240 s)
    assert "4min (5/10 runs still training), 10min (0/10 runs still training)" in report
    assert "| acc@10min | grpo |" in report and "| rewarded but wrong (train) |" in report
