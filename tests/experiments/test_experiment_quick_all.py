"""``saorl experiment code|ablation|online|stability --quick`` end to end (math: test_experiment_e2e),
with the same even smaller settings: every quick arm trains its steps from one SFT start, and the
report has one row per arm and the plots its spec asks for (online: the switch columns too)."""

from __future__ import annotations

import json

import pytest

from saorl.cli import main
from saorl.experiments.spec import find_spec, load_spec, selected_arms
from tests.experiments.test_experiment_e2e import TINY

ONLINE = ["trainer.steps=6", "env.options.switch_every=2"]  # switches at 2 and 4 inside 6 steps


def _pngs(spec) -> set[str]:
    from saorl.experiments.report import PLOTS

    out = set()
    for name in spec.plots:
        if name == "switches":
            out.add("reward_switches_vs_steps.png")
        elif name in PLOTS:
            out |= {f"{name}_vs_steps.png", f"{name}_vs_wall.png"}
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["code", "ablation", "online", "stability"])
def test_quick_experiment_end_to_end(name, tmp_path, capsys):
    spec = load_spec(find_spec(name))
    extra = TINY + (ONLINE if name == "online" else [])
    out = tmp_path / name
    assert main(["experiment", name, *extra, "--quick", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"experiment {name}:" in printed and "this run: may take up to" in printed
    arms = selected_arms(spec, True, None)
    steps = 6 if name == "online" else 3
    for arm in arms:
        done = json.loads((out / arm / "seed-0" / "done.json").read_text())
        assert done["steps"] == (0 if arm == spec.start_arm else steps), arm
    trained = [a for a in arms if a != spec.start_arm]
    # one SFT model for every arm: one warm start in the cache, one step-0 accuracy
    assert len(list((out / ".cache").glob("sft-*"))) == 1
    starts = {json.loads((out / a / "seed-0" / "eval.jsonl").read_text().splitlines()[0])["eval/accuracy"]
              for a in arms}
    assert len(starts) == 1
    report = (out / "report.md").read_text()
    rows = [line.split("|") for line in report.splitlines() if line.startswith("| ")]
    assert [r[1].strip() for r in rows] == ["arm", *arms]
    header = [c.strip() for c in rows[0]]
    if name == "online":
        assert "recover@2" in header and "recover@4" in header
    written = {p.name for p in (out / "plots").glob("*.png")}
    wanted = _pngs(spec)
    if not any(json.loads(line).get("critic/value_loss") is not None
               for a in trained for line in (out / a / "seed-0" / "metrics.jsonl").read_text().splitlines()):
        wanted -= {"value_loss_vs_steps.png", "value_loss_vs_wall.png"}  # no arm has a critic
    assert wanted <= written, wanted - written
    for png in wanted:
        assert (out / "plots" / png).stat().st_size > 1000
        assert f"(plots/{png})" in report
