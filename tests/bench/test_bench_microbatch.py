"""``benchmarks/bench_microbatch.py``: each setting in its own process, on the tiny model; bad options
named."""

from __future__ import annotations

import pytest
from bench_scripts import load_benchmark

mb = load_benchmark("bench_microbatch")


def test_each_cap_is_measured_in_its_own_process(capsys):
    assert mb.main(["tiny-dense", "--caps", "64,32", "--batch", "4", "--tokens", "32",
                    "--action-frac", "0.5", "--critic-layers", "1"]) == 0
    out = capsys.readouterr().out
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines()
            if line.startswith("| ") and "s |" in line]
    assert [(int(r[0]), r[1]) for r in rows] == [(64, "on"), (32, "on")]
    assert float(rows[0][4]) == 1.0 and float(rows[0][5]) == 1.0  # the first against itself
    for r in rows:
        assert float(r[2].removesuffix(" s")) > 0 and float(r[3].removesuffix(" MiB").replace(",", "")) > 100
    assert "critic_train_layers 1" in out


def test_a_child_reports_its_step_and_peak():
    args = mb.argparse.Namespace(model="tiny-dense", cap=32, batch=2, tokens=16, action_frac=0.5,
                                 critic_layers=None, steps=2, threads=1, shared_prompt=0, share="on")
    got = mb.child(args)
    assert got["cap"] == 32 and got["share"] == "on" and got["step_s"] > 0 and got["peak_mib"] > 100


def test_both_runs_each_budget_without_then_with_the_shared_prefix(capsys):
    assert mb.main(["tiny-dense", "--caps", "4096", "--batch", "4", "--tokens", "40", "--action-frac", "0.25",
                    "--shared-prompt", "24", "--shared-prefix", "both"]) == 0
    out = capsys.readouterr().out
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines()
            if line.startswith("| ") and "s |" in line]
    assert [r[1] for r in rows] == ["off", "on"] and "the first 24 the same in all" in out


@pytest.mark.parametrize("argv", [["--caps", "0,4"], ["--caps", "a,b"], ["--batch", "0"], ["--tokens", "1"],
                                  ["--shared-prompt", "-1"], ["--shared-prefix", "maybe"]])
def test_bad_options_are_named(argv):
    with pytest.raises(SystemExit) as info:
        mb.main(["tiny-dense", *argv])
    assert info.value.code == 2
