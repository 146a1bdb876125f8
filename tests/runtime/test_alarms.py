"""Live alarms (saorl.runtime.alarms) on hand-made metric streams: each kind fires once, at the step
trouble starts, with the figure, on the end-of-run summary's thresholds; and once more only after
the run was healthy again."""

import math

from saorl.runtime.alarms import RunAlarms
from saorl.runtime.run_signals import COLLAPSE_MIN_STEPS, CRITIC_BAD_STEPS, DRIFT_KL, WINDOW


def _stream(rows):
    alarms = RunAlarms(hint_lr="trainer.policy_lr=0.01")
    return [a for step, row in enumerate(rows, 1) for a in alarms.observe({"step": step, **row})]


HEALTHY = {"mismatch/kl": 0.001, "policy/dis_kept_frac": 0.99, "rollout/action_tokens_mean": 40.0,
           "reward/mean": 0.5, "reward/std": 0.5, "critic/explained_var": 0.3}


def test_a_drift_burst_fires_once_at_its_first_step_with_the_figure():
    rows = [HEALTHY, HEALTHY | {"mismatch/kl": 28.7}, HEALTHY | {"mismatch/kl": 30.1},
            HEALTHY | {"mismatch/kl": 0.01}, HEALTHY | {"mismatch/kl": 9.0}]
    got = _stream(rows)
    assert [(a.kind, a.step, a.value) for a in got] == [("drift burst", 2, 28.7)]
    assert got[0].text.startswith("alarm at step 2: drift burst: mismatch/kl 28.7 > 0.05")
    assert "trainer.policy_lr=0.01" in got[0].text and "\n" not in got[0].text


def test_a_drift_burst_fires_again_only_after_a_healthy_window():
    burst = HEALTHY | {"mismatch/kl": 2 * DRIFT_KL}
    rows = [burst, *[HEALTHY] * WINDOW, burst, *[HEALTHY] * (WINDOW - 1), burst]
    assert [a.step for a in _stream(rows)] == [1, WINDOW + 2]


def test_most_tokens_masked_by_dis_is_a_drift_burst_too():
    got = _stream([HEALTHY, HEALTHY | {"policy/dis_kept_frac": 0.2}])
    assert [(a.kind, a.key, a.step, a.value) for a in got] == [
        ("drift burst", "policy/dis_kept_frac", 2, 0.2)]


def test_an_action_length_collapse_fires_against_the_median_of_the_steps_before():
    lengths = [40, 38, 44, 41, 3, 2, 2]
    got = _stream([HEALTHY | {"rollout/action_tokens_mean": float(n)} for n in lengths])
    assert [(a.kind, a.step, a.value) for a in got] == [("action-length collapse", 5, 3.0)]
    assert "< 0.25 × 40.5" in got[0].text
    assert _stream([HEALTHY | {"rollout/action_tokens_mean": 2.0}] * 3) == []  # too early to tell


def test_zero_reward_on_every_trajectory_for_n_steps_after_rewarded_ones():
    zero = HEALTHY | {"reward/mean": 0.0, "reward/std": 0.0}
    got = _stream([HEALTHY] * 3 + [zero] * (COLLAPSE_MIN_STEPS + 5))
    assert [(a.kind, a.step) for a in got] == [("zero reward", 3 + COLLAPSE_MIN_STEPS)]
    assert f"last {COLLAPSE_MIN_STEPS} steps rewarded 0 (after rewarded steps" in got[0].text
    never = _stream([zero] * COLLAPSE_MIN_STEPS)
    assert [a.step for a in never] == [COLLAPSE_MIN_STEPS] and "since the start" in never[0].text
    assert _stream([zero] * (COLLAPSE_MIN_STEPS - 1)) == []
    # a mean of 0 over rewards of both signs is not "0 on every trajectory"
    assert _stream([HEALTHY | {"reward/mean": 0.0, "reward/std": 1.0}] * (COLLAPSE_MIN_STEPS + 1)) == []


def test_a_critic_whose_explained_variance_stays_at_or_below_zero():
    bad = HEALTHY | {"critic/explained_var": -0.4}
    rows = [HEALTHY, *[bad] * (CRITIC_BAD_STEPS + 3)]
    got = _stream(rows)
    assert [(a.kind, a.step, a.value) for a in got] == [("critic not learning", 1 + CRITIC_BAD_STEPS, -0.4)]
    # no critic (GRPO: NaN) or returns with no variance (0 by definition): never an alarm
    assert _stream([HEALTHY | {"critic/explained_var": math.nan}] * 30) == []
    assert _stream([HEALTHY | {"critic/explained_var": 0.0}] * 30) == []
    # one good step breaks the stretch
    rows = [*[bad] * (CRITIC_BAD_STEPS - 1), HEALTHY, *[bad] * (CRITIC_BAD_STEPS - 1)]
    assert _stream(rows) == []


def test_a_healthy_run_and_the_step_0_evaluation_raise_nothing():
    assert _stream([HEALTHY] * 50) == []
    assert RunAlarms().observe({"step": 0, "mismatch/kl": 99.0}) == []


def test_a_real_run_with_a_huge_learning_rate_prints_the_drift_alarm_when_it_happens(tmp_path, capsys):
    """The issue's case on the tiny model: async, trainer.policy_lr far too large; the alarm line is
    on the console between the step lines (not only in the end-of-run summary) and in alarms.jsonl."""
    import json

    from runtime_helpers import BASE

    from saorl.cli import main

    run_dir = tmp_path / "run"
    assert main(["train", *BASE, "runtime.backend=inprocess", "runtime.mode=async", "run.eval_tasks=0",
                 "trainer.steps=3", "trainer.policy_lr=0.5", "--run-dir", str(run_dir)]) == 0
    out = capsys.readouterr()
    lines = (out.out + out.err).splitlines()
    alarm = [i for i, line in enumerate(lines) if line.startswith("alarm at step")]
    assert len(alarm) == 1, lines  # one line, once, though the drift lasts
    assert "drift burst: mismatch/kl" in lines[alarm[0]] and "trainer.policy_lr=0.5" in lines[alarm[0]]
    summary = next(i for i, line in enumerate(lines) if line.startswith("stability over"))
    assert alarm[0] < summary  # while it runs, before the summary
    (row,) = [json.loads(line) for line in (run_dir / "alarms.jsonl").read_text().splitlines()]
    assert row["alarm"] == "drift burst" and row["value"] > 1.0
    assert lines[alarm[0]].startswith(f"alarm at step {row['step']}: ")


def test_held_out_episodes_cut_short_are_checked_from_the_evaluation_before_training():
    alarms = RunAlarms()
    start = alarms.observe({"step": 0, "eval/accuracy": 0.2, "eval/truncated_frac": 0.31})
    assert [(a.kind, a.step, a.key, a.value) for a in start] == [
        ("held-out episodes cut short", 0, "eval/truncated_frac", 0.31)]
    assert "31% of the held-out episodes" in start[0].text
    # still cut at the next evaluation: no second line; steps without an evaluation say nothing
    assert alarms.observe({"step": 1, **HEALTHY}) == []
    assert alarms.observe({"step": 10, **HEALTHY, "eval/truncated_frac": 0.53}) == []
    assert alarms.observe({"step": 20, **HEALTHY, "eval/truncated_frac": 0.1}) == []
    again = alarms.observe({"step": 30, **HEALTHY, "eval/truncated_frac": 0.4})
    assert [(a.kind, a.step) for a in again] == [("held-out episodes cut short", 30)]
    # a step-0 row raises none of the training alarms, whatever it holds; a threshold's share does not fire
    assert RunAlarms().observe({"step": 0, "mismatch/kl": 99.0, "reward/mean": 0.0, "reward/std": 0.0}) == []
    assert RunAlarms().observe({"step": 5, **HEALTHY, "eval/truncated_frac": 0.25}) == []
    assert "eval/truncated_frac 0.31 > 0.25" in start[0].text and "rollout.max_total_tokens" in start[0].text


def test_a_real_run_whose_replies_are_cut_says_so_at_the_evaluation_before_training(tmp_path, capsys):
    """Replies cut at 2 tokens: the step-0 evaluation's alarm is on the console before step 1's line
    and in alarms.jsonl, once, though the later evaluation is cut as well."""
    import json

    from runtime_helpers import BASE

    from saorl.cli import main

    run_dir = tmp_path / "run"
    assert main(["train", *BASE, "runtime.backend=inprocess", "rollout.max_new_tokens=2",
                 "run.eval_tasks=4", "run.eval_every=1", "trainer.steps=2", "--run-dir", str(run_dir)]) == 0
    out = capsys.readouterr()
    lines = (out.out + out.err).splitlines()
    alarm = [i for i, line in enumerate(lines) if line.startswith("alarm at step")]
    assert len(alarm) == 1, lines
    assert lines[alarm[0]].startswith(
        "alarm at step 0: held-out episodes cut short: eval/truncated_frac 1.00")
    first_step = next(i for i, line in enumerate(lines) if line.startswith("step 1 "))
    assert alarm[0] < first_step
    (row,) = [json.loads(line) for line in (run_dir / "alarms.jsonl").read_text().splitlines()]
    assert (row["step"], row["alarm"], row["value"]) == (0, "held-out episodes cut short", 1.0)
