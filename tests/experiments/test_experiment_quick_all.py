"""``saorl experiment code|stability|mismatch|levels|shift|noisy_obs|claims|real|real_game --quick`` end to
end (math:
test_experiment_e2e), with the same even smaller settings: every quick arm trains its steps from one
SFT start; the report has one row per arm in its table and in its comparisons (with the reference
arm named) and the plots its spec asks for (shift: the switch columns too); the metrics the
report's signals rely on are in every run's metrics.jsonl."""

from __future__ import annotations

import json

import pytest

from saorl.cli import main
from saorl.data.jsonl import read_jsonl
from saorl.experiments.spec import find_spec, load_spec, selected_arms
from tests.experiments.test_experiment_e2e import TINY

ONLINE = ["trainer.steps=6", "env.options.switch_every=2"]  # switches at 2 and 4 inside 6 steps
# Two steps, not TINY's three: evaluations at steps 0 and 2 (TINY's run.eval_every=2), a checkpoint
# at step 2, every metric below logged from step 1 on; a third step checks nothing more here and
# cost ~5 s an arm.
OFFLINE = ["trainer.steps=2"]
SWITCHING = ("shift",)
NEEDS = {  # experiment -> metrics its report relies on, in every trained arm's metrics.jsonl
    "mismatch": ["mismatch/kl", "mismatch/outside_band_frac", "rollout/staleness_mean", "policy/entropy",
                 "adv/first_token_std", "adv/return_std", "policy/grad_norm"],
    "levels": ["adv/first_token_std", "adv/return_std", "policy/entropy"],
    "shift": ["env/matched_preferred", "reward/mean"],
    "noisy_obs": ["adv/first_token_std", "adv/return_std", "critic/explained_var"],
    "claims": ["mismatch/kl", "adv/first_token_std", "adv/return_std", "policy/entropy"],
    "real": ["env/rewarded_wrong", "rollout/staleness_mean", "reward/mean"],
    "real_game": ["rollout/staleness_mean", "reward/mean"],
}
SUBSET = {  # CI time: arms that differ only in a resolved knob (checked in test_experiment_spec) stay out
    # grpo_async: grpo_dis's asynchronous GRPO group of 4 with PPO's clip instead of the band; real's
    # subset trains it
    "code": ["grpo_dis", "vapo", "sao", "sft"],
    "levels": ["sao", "grpo", "full_critic", "sft"],
    "noisy_obs": ["skip_obs", "plain_gae", "vapo_lambda", "sft"],
    "mismatch": ["grpo_uncorrected", "grpo_rollout", "grpo_dis", "sao", "sft"],
    "claims": ["sao", "grpo_uncorrected", "vapo", "sft"],  # vapo: asynchronous with a group of 4 only here
    "shift": ["sao", "reinforce_rm_m09", "reinforce_rm_m099", "sao_before_update"],
    "real": ["sao", "grpo", "grpo_async", "sao_paper_warmup_lr", "sft"],  # the others: test_experiment_spec
    "real_game": ["sao", "grpo_dis_async", "sft"],
}
ARM_NEEDS = {  # arm -> further metrics that arm must log
    "grpo_dis": ["policy/dis_kept_frac"], "sao": ["policy/dis_kept_frac", "critic/explained_var"],
    "grpo_rollout": ["policy/clip_frac"], "grpo_uncorrected": ["policy/clip_frac"],
    "vapo": ["policy/clip_frac", "critic/explained_var"],
}


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
@pytest.mark.parametrize("name", ["code", "stability", "mismatch", "levels", "shift", "noisy_obs", "claims",
                                  "real", "real_game"])
def test_quick_experiment_end_to_end(name, tmp_path, capsys):
    spec = load_spec(find_spec(name))
    extra = TINY + (ONLINE if name in SWITCHING else OFFLINE)
    out = tmp_path / name
    subset = ["--arms", ",".join(SUBSET[name])] if name in SUBSET else []
    assert main(["experiment", name, *extra, "--quick", "--out", str(out), *subset]) == 0
    printed = capsys.readouterr().out
    assert f"experiment {name}:" in printed and "this run: may take up to" in printed
    arms = selected_arms(spec, True, SUBSET.get(name))
    steps = 6 if name in SWITCHING else 2
    for arm in arms:
        done = json.loads((out / arm / "seed-0" / "done.json").read_text())
        assert done["steps"] == (0 if arm == spec.start_arm else steps), arm
    trained = [a for a in arms if a != spec.start_arm]
    # one SFT model for every arm: one warm start in the cache, one step-0 accuracy
    assert len(list((out / ".cache").glob("sft-*"))) == 1
    starts = {json.loads((out / a / "seed-0" / "eval.jsonl").read_text().splitlines()[0])["eval/accuracy"]
              for a in arms}
    assert len(starts) == 1
    # the start was evaluated once, by the first trained arm; the others carry its row
    firsts = [read_jsonl(out / a / "seed-0" / "eval.jsonl")[0] for a in trained]
    assert "source" not in firsts[0] and all(trained[0] in f["source"] for f in firsts[1:])
    report = (out / "report.md").read_text()
    table = report.split("## Comparisons")[0]
    rows = [line.split("|") for line in table.splitlines() if line.startswith("| ")]
    assert [r[1].strip() for r in rows] == ["arm", *arms]
    header = [c.strip() for c in rows[0]]
    if name in SWITCHING:
        assert "recover@2" in header and "recover@4" in header
    # the comparisons and signals tables: one row per trained arm, differences from the reference
    ref = spec.reference_arm(arms)
    assert f"final acc − {ref}" in report
    comparisons, _, verdicts = report.split("## Comparisons", 1)[1].partition("## Verdicts")
    compared = [r.split("|")[1].strip() for r in comparisons.splitlines() if r.startswith("| ")]
    assert compared == ["arm", *trained] * 3  # comparisons, signals, then stability at equal steps
    assert f"reward AUC − {ref}" in report and f"Fisher p vs {ref}" in report
    if spec.verdicts:  # outcomes at equal steps and at each wall-clock mark, then the per-arm table
        outcomes = {r.split("|")[1].strip() for r in verdicts.split("## Per arm")[0].splitlines()
                    if r.startswith("| ")}
        marks = {f"acc@{m:g}s" for m in spec.wall_marks(quick=True)}
        assert outcomes == {"outcome", f"acc@{steps}", *marks, "reward AUC"}
        per_arm = {r.split("|")[1].strip(): r for r in verdicts.split("## Per arm")[1].splitlines()
                   if r.startswith("| ")}
        assert set(per_arm) == {"arm", *trained}
        if "env/rewarded_wrong" in NEEDS[name]:  # a share in training and held-out, for every arm
            assert all(per_arm[a].count("(of 4)") == 1 for a in trained)
    for arm in trained:
        rows = read_jsonl(out / arm / "seed-0" / "metrics.jsonl")
        logged = {k for r in rows if r.get("step", 0) > 0 for k in r}
        missing = set(NEEDS.get(name, []) + ARM_NEEDS.get(arm, [])) - logged
        assert not missing, (arm, missing)
    written = {p.name for p in (out / "plots").glob("*.png")}
    wanted = _pngs(spec)
    if not any(json.loads(line).get("critic/value_loss") is not None
               for a in trained for line in (out / a / "seed-0" / "metrics.jsonl").read_text().splitlines()):
        wanted -= {"value_loss_vs_steps.png", "value_loss_vs_wall.png"}  # no arm has a critic
    assert wanted <= written, wanted - written
    for png in wanted:
        assert (out / "plots" / png).stat().st_size > 1000
        assert f"(plots/{png})" in report
