"""The pipeline simulator against hand-computed timelines, and its CLI."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from saorl.cli import main
from saorl.commands import simulate as sim_cli_module
from saorl.sim import (
    DecodeCurve,
    LengthDist,
    SimInputError,
    SimParams,
    compare,
    load_decode_curve,
    load_lengths,
    simulate,
)


def tiny(**kw) -> SimParams:
    """1 engine × 1 slot, 0.1 s per step, 10-token trajectories (1 s each), free trainer."""
    base = dict(engines=1, slots=1, decode=DecodeCurve.linear(0.1, 0.0), lengths=LengthDist("constant", 10),
                train_a=0.0, train_b=0.0, publish_s=0.0, batch_size=1)
    return SimParams(**{**base, **kw})


# ------------------------------------------------------------------------- exact timelines
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_one_slot_constant_length_exact_throughput(mode):
    r = simulate(tiny(), mode, 100.0, seed=0)
    assert r.steps == 100 and r.trained_trajectories == 100
    assert r.trajectories_per_s == pytest.approx(1.0) and r.tokens_per_s == pytest.approx(10.0)
    assert r.slot_util == pytest.approx(1.0)
    assert r.staleness_max == 0 and r.dropped == 0


def test_sync_trains_while_engine_idles():
    # cycle: 1 s rollout, 0.5 s training (engine idle) -> steps end at 1.5 k; 66 fit in 100 s.
    r = simulate(tiny(train_a=0.5), "sync", 100.0, seed=0)
    assert r.steps == 66
    assert r.slot_util == pytest.approx(67 / 100)  # 67th rollout decodes over [99, 100]
    assert r.trainer_idle_frac == pytest.approx(67 / 100)


def test_async_overlaps_training_and_is_one_step_stale():
    # rollouts end at 1, 2, ..., 100; training [k, k + 0.5]; the slot is refilled at k with the
    # weights of step k - 1, so every trajectory but the first is trained one version late.
    r = simulate(tiny(train_a=0.5), "async", 100.0, seed=0)
    assert r.steps == 99 and r.trained_trajectories == 99
    assert r.slot_util == pytest.approx(1.0)
    assert r.trainer_idle_frac == pytest.approx((1 + 99 * 0.5) / 100)
    assert r.staleness_hist == [1, 98]
    assert r.staleness_mean == pytest.approx(98 / 99)


def test_sync_barrier_idle_with_one_straggler():
    # 2 slots, lengths alternate 10 and 30 tokens at 0.1 s/step: the short one finishes at 1 s,
    # its slot idles 2 s until the straggler ends at 3 s, then 1 s of training: 4 s per step.
    p = tiny(slots=2, batch_size=2, train_a=1.0, lengths=LengthDist("empirical", values=(10, 30), cycle=True))
    r = simulate(p, "sync", 40.0, seed=0)
    assert r.steps == 10 and r.trained_tokens == 10 * 40
    assert r.slot_util == pytest.approx((1 + 3) / (2 * 4))  # busy 4 of 8 slot-seconds per step
    assert r.trainer_idle_frac == pytest.approx(3 / 4)
    a = simulate(p, "async", 40.0, seed=0)
    assert a.slot_util == pytest.approx(1.0)
    assert a.tokens_per_s > r.tokens_per_s


def test_multi_turn_env_latency_holds_the_slot_without_decoding():
    # two 5-token turns (0.5 s each) with 0.5 s of env in between: 1.5 s per trajectory.
    r = simulate(tiny(turns=2, env_latency_s=0.5), "async", 15.0, seed=0)
    assert r.trained_trajectories == 10
    assert r.slot_util == pytest.approx(1.0 / 1.5)


def test_decode_step_depends_on_busy_slots():
    # 4 slots busy: 0.1 + 0.05·4 = 0.3 s per step -> 4 trajectories every 3 s.
    p = tiny(slots=4, batch_size=4, decode=DecodeCurve.linear(0.1, 0.05))
    for mode in ("sync", "async"):
        r = simulate(p, mode, 30.5, seed=0)  # 30.5: step ends are 3·k s up to float rounding
        assert r.trained_trajectories == 40, mode


def test_shared_resources_contention():
    # async, contention 2: training (1 s alone) and decoding (1 s alone) overlap and both take 2 s,
    # so a step ends every 2 s — no better than sync, which never overlaps them (1 s + 1 s).
    p = tiny(train_a=1.0, shared_resources=True, contention=2.0)
    a, s = simulate(p, "async", 101.0, seed=0), simulate(p, "sync", 101.0, seed=0)
    assert s.steps == 50
    assert a.steps in (49, 50)
    separate = simulate(tiny(train_a=1.0), "async", 101.0, seed=0)
    assert separate.steps == 100


def naive_one_engine(p: SimParams, duration: float, seed: int) -> tuple[int, float]:
    """Step-by-step decode loop of one async engine with a free trainer: finished count and
    busy slot-seconds by ``duration``. Joins happen at step ends, where the fluid model is exact."""
    draw = p.lengths.sampler(np.random.default_rng(seed))
    left = [draw() for _ in range(p.slots)]
    t = busy = 0.0
    finished = 0
    while True:
        dt = p.decode(len(left))
        if t + dt > duration:
            return finished, busy + len(left) * (duration - t)
        t, busy = t + dt, busy + len(left) * dt
        left = [n - 1 for n in left]
        k = sum(1 for n in left if n == 0)
        finished += k
        left = [n for n in left if n > 0] + [draw() for _ in range(k)]


def test_fluid_engine_matches_a_naive_step_loop():
    p = tiny(slots=5, decode=DecodeCurve.linear(0.01, 0.002), lengths=LengthDist("lognormal", 20, 1.5))
    finished, busy = naive_one_engine(p, 123.4567, seed=7)
    r = simulate(p, "async", 123.4567, seed=7)
    assert r.finished_trajectories == finished > 1000
    assert r.trained_trajectories == finished
    assert r.slot_util == pytest.approx(busy / (5 * 123.4567), rel=1e-9)


def test_sync_cycle_matches_a_naive_barrier_loop():
    # one engine, B = 6 of 8 slots: each cycle decodes until the longest ends (b shrinking as
    # trajectories finish), then trains a + b·tokens and publishes, engine idle.
    p = tiny(slots=8, batch_size=6, decode=DecodeCurve.linear(0.01, 0.002), train_a=0.3, train_b=0.001,
             publish_s=0.1, lengths=LengthDist("lognormal", 30, 1.0))
    draw = p.lengths.sampler(np.random.default_rng(5))
    t, steps, tokens = 0.0, 0, 0
    while True:
        lens = [draw() for _ in range(6)]
        roll = sum(p.decode(sum(1 for n in lens if n >= k)) for k in range(1, max(lens) + 1))
        if t + roll + p.train_time(sum(lens)) > 200.0:
            break
        t += roll + p.train_time(sum(lens)) + p.publish_s
        steps, tokens = steps + 1, tokens + sum(lens)
    r = simulate(p, "sync", 200.0, seed=5)
    assert (r.steps, r.trained_tokens) == (steps, tokens) and steps > 20


@pytest.mark.parametrize("seed", range(6))
def test_invariants_on_random_configurations(seed):
    g = np.random.default_rng(seed)
    G = int(g.choice([1, 2, 4]))
    p = SimParams(engines=int(g.integers(1, 4)), slots=int(g.integers(1, 9)), group_size=G,
                  batch_size=G * int(g.integers(1, 5)),
                  lengths=LengthDist("lognormal", 50, float(g.uniform(0, 2))),
                  decode=DecodeCurve.linear(0.01, 0.001), train_a=float(g.uniform(0, 2)), train_b=1e-3,
                  publish_s=float(g.uniform(0, 0.5)), turns=int(g.integers(1, 3)), env_latency_s=0.2,
                  max_staleness=None if seed % 2 else 2, shared_resources=bool(seed % 3 == 0))
    for mode in ("sync", "async"):
        r = simulate(p, mode, 200.0, seed)
        assert 0.0 <= r.slot_util <= 1.0 + 1e-9 and 0.0 <= r.trainer_idle_frac <= 1.0 + 1e-9
        assert r.trained_trajectories + r.dropped <= r.finished_trajectories
        assert sum(r.staleness_hist) == r.trained_trajectories > 0
        if r.dropped == 0:  # drops may shrink a batch; otherwise every batch is full
            assert r.trained_trajectories == r.steps * p.batch_size
        assert r.trained_tokens >= r.trained_trajectories
        if mode == "sync":
            assert r.staleness_max == 0 and r.dropped == 0
        elif p.max_staleness is not None:
            assert r.staleness_max <= p.max_staleness


# ----------------------------------------------------------------------- qualitative laws
def test_async_staleness_zero_with_free_trainer_and_grows_when_slow():
    # A free trainer publishes before the freed slot is refilled: nothing is ever stale when
    # trajectories finish one at a time per batch (1 slot) or all together (constant lengths).
    p = tiny(slots=4, batch_size=4)
    assert simulate(p, "async", 50.0, seed=0).staleness_max == 0
    q = tiny(lengths=LengthDist("lognormal", 10, 1.0))
    assert simulate(q, "async", 200.0, seed=0).staleness_max == 0
    # 8 slots make 8 trajectories/s; a trainer taking a s per step keeps up while a < 0.125 s,
    # and staleness grows as it slows; past that the queue (and staleness) grows without bound.
    runs = [simulate(tiny(slots=8, lengths=LengthDist("lognormal", 10, 1.0), train_a=a), "async", 300.0, 0)
            for a in (0.0, 0.06, 0.11, 0.2)]
    means = [r.staleness_mean for r in runs]
    assert means == sorted(means) and len(set(means)) == 4
    assert runs[0].staleness_mean < 8 < runs[3].staleness_mean / 10


def test_async_beats_sync_on_long_tails_and_ties_on_constant_lengths():
    shape = dict(engines=2, slots=8, batch_size=16, decode=DecodeCurve.linear(0.01, 0.001))
    tail = compare(tiny(lengths=LengthDist("lognormal", 100, 2.0), **shape), 500.0, seed=1)
    assert tail["ratio_tokens_per_s"] > 1.3
    assert tail["async"].slot_util > tail["sync"].slot_util
    const = compare(tiny(lengths=LengthDist("constant", 100), **shape), 500.0, seed=1)
    assert const["ratio_tokens_per_s"] == pytest.approx(1.0, rel=0.02)


def test_max_staleness_drops_are_counted():
    p = tiny(slots=8, lengths=LengthDist("lognormal", 10, 1.0), train_a=1.0)
    free = simulate(p, "async", 200.0, seed=0)
    assert free.dropped == 0 and free.staleness_max > 1
    capped = simulate(SimParams(**{**p.__dict__, "max_staleness": 1}), "async", 200.0, seed=0)
    assert capped.dropped > 0 and capped.dropped_tokens > 0
    assert capped.staleness_max <= 1
    assert capped.trained_trajectories + capped.dropped <= capped.finished_trajectories


def test_groups_are_trained_whole():
    p = tiny(slots=6, group_size=3, batch_size=6, lengths=LengthDist("lognormal", 10, 1.0), train_a=0.3)
    for mode in ("sync", "async"):
        r = simulate(p, mode, 100.0, seed=0)
        assert r.trained_trajectories % 3 == 0 and r.trained_trajectories == 6 * r.steps


def test_deterministic_under_seed():
    p = SimParams(engines=2, slots=8, batch_size=16)
    a = simulate(p, "async", 600.0, seed=3).as_dict()
    assert a == simulate(p, "async", 600.0, seed=3).as_dict()
    assert a != simulate(p, "async", 600.0, seed=4).as_dict()


def test_scaled_params():
    q = SimParams(engines=8, batch_size=512, train_b=8e-5).scaled(64)
    assert q.engines == 64 and q.batch_size == 4096 and q.train_b == pytest.approx(1e-5)
    assert SimParams(engines=8, batch_size=8, group_size=4).scaled(1).batch_size == 4  # ≥ one group


def test_bad_inputs_name_the_problem():
    with pytest.raises(SimInputError, match="multiple of group_size"):
        SimParams(batch_size=10, group_size=4)
    with pytest.raises(SimInputError, match="lognormal:MEAN:CV"):
        LengthDist.parse("gamma:3")
    with pytest.raises(SimInputError, match="mode"):
        simulate(tiny(), "both", 10.0, 0)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------- loaders
def test_lognormal_draws_match_mean_and_cv():
    draw = LengthDist("lognormal", 2000, 1.0, max_len=10**9).sampler(np.random.default_rng(0))
    x = np.array([draw() for _ in range(40000)], dtype=float)
    assert x.mean() == pytest.approx(2000, rel=0.03)
    assert x.std() / x.mean() == pytest.approx(1.0, rel=0.08)


def test_load_lengths_from_run_samples_metrics_and_lists(tmp_path):
    run = tmp_path / "run"
    (run / "samples").mkdir(parents=True)
    rows = [{"step": 1, "action_mask": [0, 1, 1, 0, 1]}, {"step": 1, "action_mask": [1] * 7}]
    (run / "samples" / "samples.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "rollout/action_tokens_mean": 41.6}) + "\n")
    assert load_lengths(run) == [3, 7]  # samples preferred over per-batch means
    with pytest.warns(UserWarning, match="per-batch mean"):
        assert load_lengths(run / "metrics.jsonl") == [42]
    (tmp_path / "l.json").write_text("[12, 30.0, 7]")
    assert load_lengths(tmp_path / "l.json") == [12, 30, 7]
    (tmp_path / "l.txt").write_text("5, 6\n7 8\n")
    assert load_lengths(tmp_path / "l.txt") == [5, 6, 7, 8]
    with pytest.raises(SimInputError, match="does not exist"):
        load_lengths(tmp_path / "nope.txt")


def test_measured_decode_curve_interpolates_and_extrapolates(tmp_path):
    f = tmp_path / "curve.json"
    f.write_text(json.dumps({"points": [[8, 0.02], [1, 0.01]]}))
    c = load_decode_curve(f)
    assert c(1) == pytest.approx(0.01) and c(4.5) == pytest.approx(0.015)
    assert c(15) == pytest.approx(0.03)  # slope 0.01 / 7 per slot past the last point
    f.write_text(json.dumps({"batch": [1, 2], "seconds": [0.5]}))
    with pytest.raises(SimInputError, match="differ in length"):
        load_decode_curve(f)


# ------------------------------------------------------------------------------------ CLI
def sim_cli(argv: list[str]) -> int:
    """``saorl simulate ARGV`` without importing the other commands (torch)."""
    parser = argparse.ArgumentParser()
    sim_cli_module.add_arguments(parser)
    return sim_cli_module.run(parser.parse_args(argv))


def test_cli_prints_tables_and_writes_plot(tmp_path, capsys):
    png = tmp_path / "scaling.png"
    rc = sim_cli(["--engines", "2", "--slots", "4", "--batch-size", "8",
                  "--length", "lognormal:200:1", "--duration", "300", "--scale", "1,2,4", "--plot", str(png)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "| sync |" in out and "| async |" in out and "async / sync trained tokens/s" in out
    assert "| 4 | 16 |" in out  # 4 engines, batch scaled 8 -> 16
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_saorl_simulate_json_and_bad_spec(tmp_path, capsys):
    curve = tmp_path / "c.json"
    curve.write_text("[[1, 0.01], [4, 0.02]]")
    assert main(["simulate", "--engines", "1", "--slots", "4", "--batch-size", "4", "--duration", "200",
                 "--length", "constant:50", "--decode-curve-from", str(curve), "--train-time", "0:0",
                 "--publish", "0", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ratio_tokens_per_s"] == pytest.approx(1.0, rel=0.05)
    assert data["sync"]["steps"] > 0
    assert main(["simulate", "--train-time", "fast"]) == 2
    assert "--train-time" in capsys.readouterr().err


def test_shared_group_lengths_give_each_group_one_length():
    from saorl.sim import DecodeCurve, LengthDist, SimParams, simulate

    base = dict(engines=1, slots=8, decode=DecodeCurve.linear(0.01, 0.0), train_a=0.0, train_b=0.0,
                publish_s=0.0, group_size=4, batch_size=4,
                lengths=LengthDist("empirical", values=(1, 100), max_len=1000))
    shared = simulate(SimParams(**base, group_lengths="shared"), "sync", 200.0, seed=3)
    indep = simulate(SimParams(**base), "sync", 200.0, seed=3)
    # shared: every step is 4 × 1 or 4 × 100 tokens; about half the groups end after one token
    long_steps, rest = divmod(shared.trained_tokens - 4 * shared.steps, 396)
    assert rest == 0 and 0.3 < long_steps / shared.steps < 0.7
    assert shared.steps > 1.5 * indep.steps  # independent: almost every group waits for a 100
    with pytest.raises(SimInputError, match="group_lengths"):
        SimParams(**base, group_lengths="per-task")
