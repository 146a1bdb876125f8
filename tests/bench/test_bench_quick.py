"""``saorl bench pipeline --quick`` end to end: real runs, summary.md, timeline.png, measurement.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from saorl.bench.report import RUN_COLUMNS
from saorl.bench.runs import model_files
from saorl.cli import main


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_quick_benchmark_writes_summary_and_timeline(tmp_path: Path, capsys):
    out = tmp_path / "bench"
    # --budget-s 10: each of the two runs trains for 10 s, not --quick's 20 (what is asserted needs a
    # step of each, which comes within a few seconds)
    assert main(["bench", "pipeline", "--quick", "--budget-s", "10", "--out", str(out)]) == 0
    summary = (out / "summary.md").read_text()
    assert "| " + " | ".join(RUN_COLUMNS) + " |" in summary
    for needle in ("| sync | 1 |", "| async | 1 |", "async/sync trained tokens/s", "## Targets",
                   "trainer idle, async", "decode-slot utilisation, async", "machine limit", "## Profiles",
                   "critic forward (grad)", "policy backward + optimizer", "weight publication",
                   "decode forward", "sampling", "kv merge/select/trim", "Prefill share of generation",
                   "positions per action token, async", "load 1 min"):
        assert needle in summary, needle
    assert summary.count("PASS") + summary.count("MISS") == 6
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    m = json.loads((out / "measurement.json").read_text())
    assert m["slots"] == 16 and len(m["decode_curve"]) >= 3 and m["lengths"] and m["train_sao"][1] >= 0
    result = json.loads((out / "results.json").read_text())
    for r in result["records"]:
        assert r["steps"] >= 1 and r["tokens_per_s"] > 0 and 0 <= r["slot_util"] <= 1.0 + 1e-9
        assert 1.0 <= r["positions_per_action_token"] < 2.0  # packed: prompt + observations, no padding
        assert r["load_start"] >= 0 and r["load_end"] >= 0
        if r["mode"] == "sync":
            assert r["staleness_max"] == 0  # the barrier trains on current-version samples only
        run_dir = Path(r["run_dir"])  # the logs stay, the model files are gone
        assert (run_dir / "metrics.jsonl").stat().st_size > 0 and (run_dir / "rollouts.jsonl").exists()
        assert not [p for p in model_files(run_dir) if p.exists()]
    assert "saorl bench pipeline" in capsys.readouterr().out


def _bench_cli(argv: list[str]) -> int:
    import argparse

    from saorl.commands import bench as cli

    parser = argparse.ArgumentParser(prog="saorl bench")
    cli.add_arguments(parser)
    return cli.run(parser.parse_args(argv))


def test_bad_arguments_are_rejected(tmp_path: Path, capsys):
    assert _bench_cli(["pipeline", "--budget-s", "0", "--out", str(tmp_path)]) == 2
    assert "--budget-s" in capsys.readouterr().err
    assert _bench_cli(["pipeline", "--reps", "0", "--out", str(tmp_path)]) == 2
    assert "--reps" in capsys.readouterr().err
    assert _bench_cli(["pipeline", "--out", str(tmp_path), "nonsense"]) == 2
    assert "section.field=value" in capsys.readouterr().err
    assert _bench_cli([]) == 2
    assert _bench_cli(["pipeline", "--out", str(tmp_path / "b"), "trainer.no_such_field=1"]) == 2
    assert "no_such_field" in capsys.readouterr().err
    # a server's runs would be set against the local engine's stages alone: refused, naming the tool
    assert _bench_cli(["pipeline", "--out", str(tmp_path / "b"), "rollout.engine=vllm",
                       "rollout.engine.urls=[http://127.0.0.1:9]"]) == 2
    err = capsys.readouterr().err
    assert "rollout.engine=vllm" in err and "benchmarks/bench_pipeline_vllm.py" in err
    assert not any(tmp_path.iterdir())  # nothing ran, nothing written


def test_mode_configs():
    from saorl.bench.pipeline import BenchSpec, mode_config

    spec = BenchSpec(budget_s=30)
    s, a = mode_config(spec, "sync", Path("/tmp/x")), mode_config(spec, "async", Path("/tmp/x"))
    assert (s.algo.name, s.algo.preset.group_size, s.runtime.mode) == ("grpo", 4, "sync")
    assert (a.algo.name, a.runtime.mode) == ("sao", "async")
    for c in (s, a):
        assert c.trainer.max_wall_s == 30 and not c.sft.enabled and c.model.policy == "tiny-moe"
        assert c.env.options["cv"] == 1.5 and c.rollout.engine.slots == 16
    with pytest.raises(ValueError, match="mode"):
        mode_config(spec, "fast", Path("/tmp/x"))
    with pytest.raises(ValueError, match="env"):
        mode_config(BenchSpec(env="chess"), "sync", Path("/tmp/x"))


def test_overrides_of_the_specs_settings_set_the_spec_too():
    """The stages measured alone (their threads) and the summary's header use what the runs used."""
    from saorl.bench.pipeline import BenchSpec, mode_config

    spec = BenchSpec(overrides=["runtime.trainer_threads=2", "trainer.batch_size=8",
                                "rollout.engine.slots=x"])
    assert (spec.trainer_threads, spec.batch_size, spec.worker_threads, spec.slots) == (2, 8, 1, 16)
    assert BenchSpec.quick(overrides=["runtime.worker_threads=2"]).worker_threads == 2
    cfg = mode_config(BenchSpec(overrides=["runtime.trainer_threads=2", "trainer.batch_size=8"]), "async",
                      Path("/tmp/x"))
    assert (cfg.runtime.trainer_threads, cfg.trainer.batch_size) == (2, 8)
