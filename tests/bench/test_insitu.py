"""In-run stage speeds (saorl.bench.insitu) on hand-built run logs and against a naive integral."""

from __future__ import annotations

import json
import random

import pytest

from saorl.bench.insitu import decode_scale, decoding_share, in_situ, step_busy, train_scale
from saorl.sim import DecodeCurve


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def test_decoding_share_hand_cases():
    # slots 1: in [1, 2] two rollouts share the one slot, each decodes half the time
    assert decoding_share([(0.0, 2.0), (1.0, 3.0)], 1) == [pytest.approx((1.5, 1.0))] * 2
    # slots 2: both always decode; the batch is 1, 2, 1 over the three seconds
    assert decoding_share([(0.0, 2.0), (1.0, 3.0)], 2) == [pytest.approx((2.0, 1.5))] * 2
    # touching intervals: the one ending and the one starting at t=1 never overlap in time
    assert decoding_share([(0.0, 1.0), (1.0, 2.0)], 1) == [pytest.approx((1.0, 1.0))] * 2
    assert decoding_share([], 4) == []


def test_decoding_share_matches_a_naive_integral():
    rng = random.Random(0)
    spans = [(s, s + rng.expovariate(0.5)) for s in (rng.uniform(0, 20) for _ in range(40))]
    slots, dt = 5, 1e-3
    for (s, e), (dec, batch) in zip(spans, decoding_share(spans, slots), strict=True):
        t, d_sum, b_sum = s + dt / 2, 0.0, 0.0
        while t < e:
            n = sum(1 for a, b in spans if a <= t < b)
            share = min(1.0, slots / n)
            d_sum += share * dt
            b_sum += min(n, slots) * share * dt
            t += dt
        assert dec == pytest.approx(d_sum, abs=5e-3)
        assert batch == pytest.approx(b_sum / d_sum, rel=5e-3)


def test_train_scale_from_a_hand_built_run(tmp_path):
    _write(tmp_path / "metrics.jsonl", [
        {"step": 1, "time/elapsed_s": 1.0, "time/wait_s": 0.1},
        {"step": 2, "time/elapsed_s": 3.0, "time/wait_s": 0.5},  # busy 2.0 - 0.5 = 1.5
        {"step": 3, "time/elapsed_s": 4.0, "time/wait_s": 0.0},  # busy 1.0
        {"step": 3, "eval/accuracy": 0.5},  # rows without timings are ignored
    ])
    _write(tmp_path / "trained.jsonl", [{"step": 1, "action_tokens": [7]},
                                        {"step": 2, "action_tokens": [100, 100]},
                                        {"step": 3, "action_tokens": [50]}])
    assert step_busy(tmp_path) == [(200, pytest.approx(1.5)), (50, pytest.approx(1.0))]
    # isolated model a + b·n + publish: 0.1 + 2.0 + 0.2 and 0.1 + 0.5 + 0.2
    assert train_scale(tmp_path, 0.1, 0.01, 0.2) == pytest.approx(2.5 / 3.1)


def test_decode_scale_from_a_hand_built_run(tmp_path):
    _write(tmp_path / "rollouts.jsonl", [
        {"rid": 0, "t_start": 0.0, "t_end": 0.4, "tokens": 10},
        {"rid": 1, "t_start": 1.0, "t_end": 1.2, "tokens": 10},
        {"rid": 2, "t_submit": 1.5, "unfinished": True},  # never finished: not counted
    ])
    curve = DecodeCurve.measured([(1, 0.01), (4, 0.01)])
    # model per rollout: 10 tokens × 0.01 s × prefill 2 = 0.2 s; measured 0.4 + 0.2
    assert decode_scale(tmp_path, curve, 2.0, slots=4) == pytest.approx(0.6 / 0.4)
    _write(tmp_path / "metrics.jsonl", [{"step": 1, "time/elapsed_s": 1.0, "time/wait_s": 0.0},
                                        {"step": 2, "time/elapsed_s": 2.0, "time/wait_s": 0.0}])
    _write(tmp_path / "trained.jsonl", [{"step": 2, "action_tokens": [10]}])
    got = in_situ(tmp_path, (0.5, 0.05), 0.0, curve, 2.0, 4)
    assert got == {"train_scale": pytest.approx(1.0), "decode_scale": pytest.approx(1.5)}


def test_empty_logs_are_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"metrics\.jsonl"):
        train_scale(tmp_path, 0.1, 0.01, 0.0)
    with pytest.raises(ValueError, match=r"rollouts\.jsonl"):
        decode_scale(tmp_path, DecodeCurve.linear(0.01, 0.0), 1.0, 4)


def test_rollouts_cut_off_by_the_end_still_hold_slots(tmp_path):
    # slots 1: B finished in [0, 2]; C was dispatched at 1 and is still queued or running at the
    # end: it takes half of the one slot in [1, 2], so B decoded 1.5 s, not 2 s
    assert decoding_share([(0.0, 2.0)], 1, [(1.0, 2.0)]) == [pytest.approx((1.5, 1.0))]
    _write(tmp_path / "rollouts.jsonl", [{"rid": 0, "t_start": 0.0, "t_end": 2.0, "tokens": 10},
                                         {"rid": 1, "t_submit": 1.0, "unfinished": True}])
    curve = DecodeCurve.measured([(1, 0.1), (2, 0.1)])
    assert decode_scale(tmp_path, curve, 1.0, slots=1) == pytest.approx(1.5 / 1.0)


def test_bad_intervals_are_rejected_or_skipped(tmp_path):
    with pytest.raises(ValueError, match="ends before it starts"):
        decoding_share([(0.0, 2.0), (3.0, 1.0)], 1)
    assert decoding_share([(1.0, 1.0)], 4) == [(0.0, 1.0)]  # zero length: nothing decoded
    _write(tmp_path / "rollouts.jsonl", [{"rid": 0, "t_start": 0.0, "t_end": 1.0, "tokens": 10},
                                         {"rid": 1, "t_start": 5.0, "t_end": 5.0, "tokens": 10}])
    curve = DecodeCurve.measured([(1, 0.1), (2, 0.1)])
    assert decode_scale(tmp_path, curve, 1.0, slots=4) == pytest.approx(1.0)  # the empty one skipped


def test_machine_limit_uses_the_trainer_alone_on_the_runs_batches(tmp_path):
    from saorl.bench.pipeline import train_alone_on_run_batches, use_run_batches_for_limit

    run = tmp_path / "sync_sao-0"
    run.mkdir()
    _write(run / "metrics.jsonl",
           [{"step": s, "time/elapsed_s": 3.0 * s, "time/wait_s": 1.0} for s in (1, 2, 3)])
    _write(run / "trained.jsonl", [{"step": s, "action_tokens": [100, 300]} for s in (1, 2, 3)])
    records = [{"mode": "sync_sao", "run_dir": str(run)}, {"mode": "async", "run_dir": "unused"}]
    # steps 2 and 3: 400 tokens each in 3 - 1 = 2 busy seconds
    assert train_alone_on_run_batches(records) == pytest.approx(200.0)
    pieces = {"limit": {"G": 1000.0, "T": 900.0, "formula": "min(G, T)", "tokens_per_s": 900.0}}
    use_run_batches_for_limit(records, pieces)
    assert pieces["limit"]["tokens_per_s"] == pytest.approx(200.0) and pieces["limit"]["T_fit"] == 900.0
    pieces = {"limit": {"G": 1000.0, "T": 900.0, "formula": "min(G, T)", "tokens_per_s": 900.0}}
    use_run_batches_for_limit(records[1:], pieces)  # no sync_sao runs: the fit stays
    assert pieces["limit"]["T"] == 900.0 and pieces["limit"]["T_source"].startswith("fit")
