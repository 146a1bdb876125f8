"""``benchmarks/bench_prefix_store.py``: a run's rollout worker plays episodes; with the sessions
ended (as saorl runs) the engine's prefix store is empty between rounds, left open it keeps every
episode's last row."""

from __future__ import annotations

import pytest
from bench_scripts import load_benchmark

bps = load_benchmark("bench_prefix_store")


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("seed: 0\nmodel: {policy: tiny-dense}\nenv: {type: math_tool}\n")
    return str(path)


def test_ended_sessions_leave_the_store_empty_and_open_ones_fill_it(config):
    ended = bps.play(config, [], "ended", episodes=6, concurrency=3)
    left = bps.play(config, [], "open", episodes=6, concurrency=3)
    assert [r["episodes"] for r in ended] == [r["episodes"] for r in left] == [3, 6]
    assert all(r["sessions"] == r["tokens"] == r["store_mib"] == 0 for r in ended)
    assert [r["sessions"] for r in left] == [3, 6]  # every episode's last row, none taken again
    assert 0 < left[0]["tokens"] < left[1]["tokens"] and left[1]["store_mib"] > 0
    assert all(r["rss_mib"] > 100 and r["hwm_mib"] >= r["rss_mib"] for r in ended + left)


def test_bad_options_are_named(config, capsys):
    for bad in (["--arms", "closed"], ["--episodes", "0"]):
        with pytest.raises(SystemExit):
            bps.main([config, *bad])
        assert bad[0] in capsys.readouterr().err  # the error names the option
