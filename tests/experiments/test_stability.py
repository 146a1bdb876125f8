"""Stability signals and the exact tests behind the collapse counts, against hand-computed values."""

import math

import pytest

from saorl.experiments.stability import (
    accuracy_at,
    clopper_pearson,
    fisher_exact,
    max_window_mean,
    stability_table,
    stability_values,
)


def _rows(kl, reward, moved=None):
    return [{"step": i + 1, "mismatch/kl": k, "reward/mean": r,
             **({"policy/update_rel": moved[i]} if moved else {})}
            for i, (k, r) in enumerate(zip(kl, reward))]


def test_fisher_exact_matches_hand_computed_tables():
    # 4 of 6 against 2 of 6: hypergeometric over x = 0..6 with 6 hits in 12; the tables at most as
    # likely as x=4 (p=225/924) are x = 0, 1, 2, 4, 5, 6: 1 - 400/924 = 524/924 = 0.567
    assert math.isclose(fisher_exact(4, 6, 2, 6), 524 / 924, rel_tol=1e-12)
    assert fisher_exact(3, 3, 3, 3) == 1.0
    assert math.isclose(fisher_exact(5, 5, 0, 5), 2 / 252, rel_tol=1e-12)  # only the two extremes


def test_clopper_pearson_matches_closed_forms():
    lo, hi = clopper_pearson(0, 3)
    assert lo == 0.0 and math.isclose(hi, 1 - 0.025 ** (1 / 3), rel_tol=1e-9)  # 0.708
    lo, hi = clopper_pearson(3, 3)
    assert hi == 1.0 and math.isclose(lo, 0.025 ** (1 / 3), rel_tol=1e-9)
    lo, hi = clopper_pearson(2, 6)
    assert 0.04 < lo < 0.05 and 0.77 < hi < 0.78  # the tabled 0.0433, 0.7772
    with pytest.raises(ValueError, match="k <= n"):
        clopper_pearson(4, 3)


def test_signals_of_one_run_over_its_first_steps():
    kl = [0.01, 0.2, 0.01, 0.3, 0.01, 0.01] + [0.9] * 4
    reward = [0.2, 0.4, 0.6, 0.4, 0.2, 0.2] + [0.0] * 4
    rows = _rows(kl, reward, moved=[1e-3] * 10)
    got = stability_values(rows, steps=6)
    assert got["steps"] == 6 and got["drift bursts"] == 2 / 6
    assert math.isclose(got["reward AUC"], 2.0 / 6) and math.isclose(got["update rel"], 1e-3)
    assert math.isclose(got["max 10-step KL"], sum(kl[:6]) / 6)  # fewer steps than the window
    assert math.isclose(max_window_mean(_rows(kl, reward), window=3), 0.9)
    assert stability_values(rows)["drift bursts"] == 6 / 10


def test_accuracy_at_takes_the_last_evaluation_at_or_before():
    evals = [{"step": 0, "eval/accuracy": 0.4}, {"step": 50, "eval/accuracy": 0.6},
             {"step": 100, "eval/accuracy": 0.5}]
    assert [accuracy_at(evals, s) for s in (0, 49, 50, 99, 1000)] == [0.4, 0.4, 0.6, 0.6, 0.5]
    assert stability_values([], evals, at=(75,))["acc@75"] == 0.6


def test_table_pairs_by_seed_and_counts_collapses_exactly():
    per_arm = {"sao": {0: {"reward AUC": 0.5, "collapsed": 1.0}, 1: {"reward AUC": 0.7, "collapsed": 0.0}},
               "grpo": {0: {"reward AUC": 0.4, "collapsed": 1.0}, 1: {"reward AUC": 0.5, "collapsed": 1.0}}}
    table = stability_table(per_arm, "sao")
    header, _, sao, grpo = table.splitlines()
    assert "reward AUC − sao" in header and "drift bursts" not in header  # no arm logged it
    assert "1/2 [0.01, 0.99]" in sao and sao.endswith("| – |")
    # grpo − sao per seed: -0.1, -0.2 → mean -0.150, t(0.975, 1) = 12.706, sd 0.0707 / sqrt(2) = 0.05
    assert "-0.150 [-0.785, +0.485]" in grpo and "2/2 [0.16, 1.00]" in grpo
    assert grpo.endswith(f"| {fisher_exact(2, 2, 1, 2):.2f} |")
