"""``saorl experiment --report``: the report's header names each setting once, or per arm where the
arms differ (an lr grid must not read as one arm's lr)."""

from saorl.cli import main


def _header(tmp_path, capsys, *args) -> str:
    assert main(["experiment", *args, "--report", "--out", str(tmp_path)]) == 0
    return next(line for line in capsys.readouterr().out.splitlines() if line.startswith("Mode: "))


def test_a_setting_the_arms_differ_in_is_shown_per_arm(tmp_path, capsys):
    header = _header(tmp_path, capsys, "lr_staleness", "--arms", "sao_lr1e4_c16,sao_lr3e5_c16")
    assert "policy lr by arm (sao_lr1e4_c16 0.0001, sao_lr3e5_c16 3e-05)" in header
    assert "batch 4;" in header and "budget 100 steps" in header  # shared: one value


def test_a_setting_the_arms_share_is_shown_once(tmp_path, capsys):
    header = _header(tmp_path, capsys, "lr_staleness", "--arms", "sao_lr1e4_c16,sao_lr1e4_c64")
    assert "policy lr 0.0001;" in header and "by arm" not in header


def test_quick_says_its_accuracies_mean_nothing_and_how_to_get_ones_that_do(tmp_path, capsys):
    out = tmp_path / "math"
    out.mkdir()
    assert main(["experiment", "math", "--quick", "--report", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert ("--quick is a smoke test of the pipeline, not a result: its SFT warm start (100 steps x 16 "
            "on 200 demonstrations) is too weak") in printed
    assert "saorl experiment math --quick sft.steps=1000 sft.batch_size=32 sft.num_demos=2000 (" in printed
    assert "its accuracies are not meaningful" in printed  # the report's note says it too
    assert main(["experiment", "math", "--quick", "--report", "--out", str(out), "sft.steps=1000",
                 "sft.batch_size=32", "sft.num_demos=2000"]) == 0
    assert "smoke test" not in capsys.readouterr().out  # the full warm start: numbers that mean something


def test_quick_reuses_the_warm_start_saorl_train_cached_with_the_same_settings(tmp_path, monkeypatch):
    import os

    from saorl.config import load_config
    from saorl.experiments.runner import ExperimentRunner, Selection
    from saorl.experiments.spec import find_spec, load_spec
    from saorl.stages.sft import cached_sft_dir, reuse_cached_sft

    monkeypatch.chdir(tmp_path)
    full = ["sft.steps=1000", "sft.batch_size=32", "sft.num_demos=2000"]
    trained = cached_sft_dir(load_config(None, ["run.out_dir=" + str(tmp_path / "runs")]))  # `saorl train`'s
    (trained / "sub").mkdir(parents=True)
    (trained / "config.json").write_text("{}")
    (trained / "sub" / "model.safetensors").write_bytes(b"weights")
    spec_path = find_spec("math")
    spec = load_spec(spec_path)
    runner = ExperimentRunner(spec, spec_path, tmp_path / "exp", Selection(["sao"], [0], True, full))
    cfg = runner.config("sao", 0)
    assert runner.train_cache == tmp_path / "runs" / ".cache"
    logged = []
    assert reuse_cached_sft(cfg, runner.train_cache, logged.append)
    here = cached_sft_dir(cfg)
    assert here == tmp_path / "exp" / ".cache" / trained.name  # the same key: the same settings
    assert os.path.samefile(here / "sub" / "model.safetensors", trained / "sub" / "model.safetensors")
    assert logged == [f"sft: reusing the warm start with the same settings from {trained}"]
    assert not reuse_cached_sft(cfg, runner.train_cache, logged.append)  # there already
    quick = ExperimentRunner(spec, spec_path, tmp_path / "q", Selection(["sao"], [0], True, []))
    assert not reuse_cached_sft(quick.config("sao", 0), quick.train_cache)  # other settings: trained anew
