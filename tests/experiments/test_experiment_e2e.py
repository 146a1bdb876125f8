"""``saorl experiment math --quick`` end to end, with even smaller settings: the runs, the table,
the plots; a second invocation skips the finished runs; the start arm's row equals an evaluation
of the SFT start done directly."""

import json

import pytest

from saorl.cli import main

# sft.steps=4: what these tests check of the warm start is that every arm starts from one cached SFT
# model (its step-0 accuracy, its one cache entry), not what it learned; at 20 steps the SFT was a
# third of each quick experiment (code: 55 s of 174 s on a loaded 2-core machine).
TINY = ["sft.steps=4", "sft.num_demos=32", "sft.batch_size=8", "value_pretrain.rollouts=4",
        "value_pretrain.steps=2", "value_pretrain.batch_size=2", "run.eval_tasks=4", "env.num_test_tasks=4",
        "env.num_train_tasks=64", "trainer.steps=3", "run.eval_every=2", "run.checkpoint_every=2",
        "rollout.max_new_tokens=24", "rollout.concurrent_episodes=8", "rollout.engine.slots=8",
        "run.progress=false"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_math_quick_end_to_end(tmp_path, capsys):
    out = tmp_path / "math"
    argv = ["experiment", "math", *TINY, "--quick", "--out", str(out), "--arms", "sao,sft"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "full version: may take up to 5 arms x 2 seeds x 600 s = 1h40m" in printed
    assert "this run: may take up to 1 arms x 1 seeds x 60 s" in printed
    for arm in ("sao", "sft"):
        run = out / arm / "seed-0"
        assert json.loads((run / "done.json").read_text())["steps"] == (0 if arm == "sft" else 3)
    evals = [json.loads(x) for x in (out / "sao" / "seed-0" / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2, 3]
    report = (out / "report.md").read_text()
    table, comparisons = report.split("## Comparisons", 1)
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert [r.split("|")[1].strip() for r in rows] == ["arm", "sao", "sft"]
    # comparisons and signals: the trained arm only (the reference is itself: no difference)
    compared = [r.split("|")[1].strip() for r in comparisons.splitlines() if r.startswith("| ")]
    assert compared == ["arm", "sao"] * 3  # comparisons, signals, stability at equal trainer steps
    assert "final acc − sao" in comparisons
    assert "## Stability at equal trainer steps (the first 3," in comparisons and "acc@3" in comparisons
    for png in ("accuracy_vs_steps", "accuracy_vs_wall", "reward_vs_steps", "value_loss_vs_steps",
                "dis_kept_frac_vs_steps", "staleness_vs_wall"):
        assert (out / "plots" / f"{png}.png").stat().st_size > 1000
    # every arm started from the same SFT model: one warm start in the cache, same step-0 accuracy
    assert len(list((out / ".cache").glob("sft-*"))) == 1
    start = {a: json.loads((out / a / "seed-0" / "eval.jsonl").read_text().splitlines()[0])["eval/accuracy"]
             for a in ("sao", "sft")}
    assert start["sao"] == start["sft"]

    # resumable: a second invocation trains nothing and rewrites the same table
    assert main(argv) == 0
    again = capsys.readouterr().out
    assert "training:" not in again
    assert "[sao seed 0] finished earlier (3 steps): skipped" in again
    assert [r for r in again.split("## Comparisons")[0].splitlines() if r.startswith("| ")] == rows

    # the start arm alone (evaluate the SFT start before training anything): no trained arm selected
    assert main(["experiment", "math", *TINY, "--quick", "--out", str(out), "--arms", "sft"]) == 0
    alone = capsys.readouterr().out.split("## Comparisons")[0]
    assert [r.split("|")[1].strip() for r in alone.splitlines() if r.startswith("| ")] == ["arm", "sft"]

    # the start arm's row is what evaluating the SFT start directly gives
    from saorl.experiments.runner import ExperimentRunner, Selection
    from saorl.experiments.spec import find_spec, load_spec

    spec = load_spec(find_spec("math"))
    runner = ExperimentRunner(spec, find_spec("math"), out, Selection(["sft"], [0], True, TINY))
    direct = runner._evaluate_start(0)
    row = json.loads((out / "sft" / "seed-0" / "eval.jsonl").read_text())
    assert direct["eval/accuracy"] == row["eval/accuracy"]
    assert direct["eval/episodes"] == row["eval/episodes"] == 4
    assert direct["eval/action_tokens_mean"] == pytest.approx(row["eval/action_tokens_mean"])
