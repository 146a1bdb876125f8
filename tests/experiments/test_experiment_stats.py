"""Confidence intervals of the experiment report against hand-computed cases and t-table values."""

import math

import pytest

from saorl.experiments.stats import mean_interval, paired_interval, t_cdf, t_quantile


@pytest.mark.parametrize("df, q", [(1, 12.7062), (2, 4.3027), (4, 2.7764), (9, 2.2622), (30, 2.0423)])
def test_t_quantile_matches_the_t_table(df, q):
    assert t_quantile(0.975, df) == pytest.approx(q, abs=1e-4)
    assert t_quantile(0.025, df) == pytest.approx(-q, abs=1e-4)
    assert t_cdf(q, df) == pytest.approx(0.975, abs=1e-5)


def test_t_cdf_of_one_degree_of_freedom_is_the_cauchy_cdf():
    for t in (-3.0, -0.5, 0.0, 0.7, 5.0):
        assert t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-12)


def test_mean_interval_by_hand():
    # 0.60, 0.66, 0.72: mean 0.66, sd 0.06, t_{0.975,2} = 4.302653 -> half 4.302653 * 0.06 / sqrt(3)
    iv = mean_interval([0.60, 0.66, 0.72])
    assert iv.n == 3 and iv.mean == pytest.approx(0.66)
    assert iv.half_width == pytest.approx(4.302653 * 0.06 / math.sqrt(3), rel=1e-6)
    assert iv.low == pytest.approx(0.66 - 0.149048, abs=1e-6)
    assert iv.fmt() == "0.660 [0.511, 0.809]"
    assert mean_interval([0.5]).half_width is None and mean_interval([0.5]).fmt() == "0.500 (n=1)"
    assert mean_interval([]) is None and mean_interval([None, float("nan")]) is None


def test_paired_interval_by_hand():
    # differences over the shared seeds 0, 1, 2: 0.10, 0.05, 0.12 (seed 3 only in one arm)
    arm = {0: 0.70, 1: 0.60, 2: 0.80, 3: 0.1}
    ref = {0: 0.60, 1: 0.55, 2: 0.68}
    iv = paired_interval(arm, ref)
    d = [0.10, 0.05, 0.12]
    mean = sum(d) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / 2)
    assert iv.n == 3 and iv.mean == pytest.approx(mean)
    assert iv.half_width == pytest.approx(4.302653 * sd / math.sqrt(3), rel=1e-6)
    assert iv.excludes_zero() is (iv.low > 0)
    assert iv.fmt(signed=True).startswith("+0.090 [")
    # pairing matters: the same numbers unpaired give a much wider interval
    assert mean_interval(list(arm.values())[:3]).half_width > 2.5 * iv.half_width
    assert paired_interval({0: 1.0}, {1: 1.0}) is None


def test_comparison_table_cells_are_the_intervals():
    from saorl.experiments.compare import comparison_table

    per_arm = {"ref": {0: {"final_acc": 0.60, "best_acc": 0.6, "final_reward": 0.5},
                       1: {"final_acc": 0.55, "best_acc": 0.6, "final_reward": 0.5},
                       2: {"final_acc": 0.68, "best_acc": 0.7, "final_reward": 0.5}},
               "arm": {0: {"final_acc": 0.70, "best_acc": 0.7, "final_reward": None},
                       1: {"final_acc": 0.60, "best_acc": 0.6, "final_reward": None},
                       2: {"final_acc": 0.80, "best_acc": 0.8, "final_reward": None}}}
    lines = comparison_table(per_arm, "ref").splitlines()
    assert lines[0].split(" | ")[2:4] == ["final acc", "final acc − ref"]
    ref_row, arm_row = (line.split(" | ") for line in lines[2:])
    assert ref_row[2] == mean_interval([0.60, 0.55, 0.68]).fmt() and ref_row[3] == "–"
    diff = paired_interval({0: 0.70, 1: 0.60, 2: 0.80}, {0: 0.60, 1: 0.55, 2: 0.68})
    assert arm_row[3] == diff.fmt(signed=True) + "*"  # +0.090 [+0.001, +0.179]: excludes 0
    assert arm_row[6].strip(" |") == "–"  # no reward in the arm: no interval, no difference


def test_signal_table_shows_only_logged_signals_and_spikes():
    from saorl.experiments.compare import signal_table, spike_ratio, zero_frac

    runs = [[{"policy/grad_norm": g, "policy/entropy": 0.5} for g in (0.0, 0.0, 0.0, 1.0, 2.0, 8.0)],
            [{"policy/grad_norm": g, "policy/entropy": 0.3} for g in (1.0, 1.0, 1.0)]]
    # the zero-gradient steps stay out of the median: 8 / median(1, 2, 8) = 4
    assert spike_ratio(runs[0]) == pytest.approx(4.0) and spike_ratio(runs[1]) == pytest.approx(1.0)
    assert zero_frac(runs[0]) == pytest.approx(0.5) and zero_frac(runs[1]) == 0.0
    table = signal_table({"a": runs})
    header = table.splitlines()[0]
    assert "grad-norm max/median" in header and "entropy first 10%" in header and "KL s0" not in header
    assert mean_interval([4.0, 1.0]).fmt(1) in table.splitlines()[2]


def test_token_weighted_kl_weights_steps_by_their_bucket_tokens():
    from saorl.experiments.compare import token_weighted

    rows = [{"k": 0.5, "n": 1.0}, {"k": 0.0, "n": 99.0}, {"k": 9.0, "n": 0.0}, {"step": 4}]
    # (0.5 * 1 + 0 * 99) / 100; a step without tokens in the bucket counts for nothing
    assert token_weighted("k", "n")(rows) == pytest.approx(0.005)
    assert token_weighted("k", "n")([{"step": 1}]) is None


def test_staleness0_tokens_per_step_count_the_steps_without_any():
    from saorl.experiments.compare import signal_values

    rows = [{"step": 1, "mismatch/tokens_s0": 60.0, "mismatch/kl_s0": 0.1}, {"step": 2}, {"step": 3}]
    v = signal_values(rows)
    assert v["s0 tokens/step"] == pytest.approx(20.0) and v["KL s0"] == pytest.approx(0.1)


def test_collapse_is_a_zero_reward_tail_reaching_the_end():
    from saorl.experiments.compare import COLLAPSE_MIN_STEPS, collapse_step, signal_table

    def run(rewards):
        return [{"step": 0, "eval/accuracy": 0.4}] + [{"step": i + 1, "reward/mean": r}
                                                       for i, r in enumerate(rewards)]

    n = COLLAPSE_MIN_STEPS
    collapsed = run([0.5, 0.0, 0.25] + [0.0] * n)  # zero from step 4 to the end (step 3 + n)
    assert collapse_step(collapsed) == 4
    assert collapse_step(run([0.5] + [0.0] * (n - 1))) is None  # one step short of a collapse
    assert collapse_step(run([0.0] * (2 * n) + [0.25])) is None  # it recovered at the last step
    assert collapse_step([{"step": 1}]) is None
    assert collapse_step(run([0.0] * (2 * n))) is None  # never rewarded: nothing collapsed
    table = signal_table({"a": [collapsed, run([0.5] * 30)]}).splitlines()
    header = [c.strip() for c in table[0].split("|")]
    row = [c.strip() for c in table[2].split("|")]
    assert row[header.index("collapsed")].startswith("0.50 ")  # one seed of two
    assert row[header.index("collapse step")] == "4 (n=1)"  # the collapsed seed's step alone
