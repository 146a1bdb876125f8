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
