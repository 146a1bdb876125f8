"""``benchmarks/bench_tta.py``: the task's rewards by hand, the option checks, and the benchmark end to
end on the tiny model (saorl's two arms always; TRL's when TRL is installed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_scripts import load_benchmark

tta = load_benchmark("bench_tta")
task, tta_eval = tta.tta_task, tta.tta_eval


def test_problems_are_disjoint_and_answered_right():
    train, test = task.problems(3000, 128, seed=1)
    assert len(train) == 3000 and len(test) == 128
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    for row in train[:200] + test:
        a, op, b = row["question"].removeprefix("What is ").split("?")[0].split()
        assert row["answer"] == eval(f"{a}{op}{b}")
        if op == "*":
            assert 1 <= int(a) <= 9 and 1 <= int(b) <= 9
        else:
            assert 10 <= int(a) <= 99 and 10 <= int(b) <= 99
    assert task.problems(3000, 128, seed=1) == (train, test)
    with pytest.raises(ValueError, match="train \\+ test"):
        task.problems(20000, 128)


@pytest.mark.parametrize(("reply", "answer", "bare", "correct"), [
    ("42", 42, 1.0, 1.0), (" -7\n", -7, 1.0, 1.0), ("41", 42, 1.0, 0.0),
    ("The answer is 42.", 42, 0.0, 1.0), ("42 or maybe 43", 42, 0.0, 0.0), ("", 0, 0.0, 0.0),
    ("4 2", 42, 0.0, 0.0),
])
def test_rewards_by_hand(reply, answer, bare, correct):
    chat = [{"role": "assistant", "content": reply}]
    for completion in (reply, chat):  # TRL's text and conversational forms
        assert task.bare_integer([completion]) == [bare]
        assert task.last_integer_correct([completion], answer=[answer]) == [correct]
    assert task.reward(reply, answer) == 0.5 * bare + 1.0 * correct
    assert tta_eval.accuracy([{"reply": reply, "answer": answer}]) == correct


@pytest.mark.parametrize(("argv", "match"), [
    (["--arms", "trl,ppo"], "--arms"), (["--arms", "sao,sao"], "--arms"),
    (["--fractions", "0.5,1.5"], "--fractions"),
    (["--fractions", "x"], "--fractions"), (["--batch", "12"], "multiple of --group"),
    (["--set", "trl:seed=1"], "--set"), (["--set", "sao:seed"], "--set"), (["--budget-s", "0"], "--budget-s"),
])
def test_bad_options_are_named(argv, match, capsys):
    assert tta.main([*argv, "--out", "/nonexistent/never-made"]) == 2
    assert match in capsys.readouterr().err


def run_bench(tmp_path: Path, monkeypatch, arms: str, budget: float, extra: list[str]) -> tuple[Path, list]:
    """The benchmark with a spy on the evaluator; its out directory and the checkpoints evaluated."""
    evaluated = []
    real = tta_eval.evaluate

    def spy(ckpt, rows, chat, max_new, batch=32):
        evaluated.append(Path(ckpt))
        return real(ckpt, rows, chat, max_new, batch)

    monkeypatch.setattr(tta_eval, "evaluate", spy)
    out = tmp_path / "tta"
    argv = ["--model", "tiny-dense", "--arms", arms, "--seeds", "1", "--budget-s", str(budget),
            "--test-n", "8", "--train-n", "400", "--fractions", "0.5,1", "--out", str(out),
            # small steps (4 completions of at most 8 tokens), so that each arm makes some on a loaded machine
            "--batch", "4", "--group", "2", "--max-new", "8", *extra]
    assert tta.main(argv) == 0
    return out, evaluated


def check_rows(out: Path, evaluated: list[Path], arms: list[str], budget: float) -> list[dict]:
    """What every arm's rows must hold, whatever the trainer."""
    from transformers import AutoModelForCausalLM

    rows = [json.loads(line) for line in open(out / "results.jsonl")]
    assert sorted((r["arm"], r["fraction"]) for r in rows) == sorted((a, f) for a in arms for f in (0.5, 1.0))
    results = json.loads((out / "results.json").read_text())
    assert results["rows"] == rows and len(results["arms"]) == len(arms)
    base = Path(results["meta"]["model_dir"])
    assert evaluated[0] == base  # the base model first, then every snapshot of every arm, the same way
    assert len(evaluated) == 1 + len(rows)
    assert [Path(r["generations"]).stem for r in rows] == [f"{r['arm']}-s0-f{r['fraction']:g}" for r in rows]
    for r, ckpt in zip(rows, evaluated[1:]):
        # a snapshot before the arm's first update is the base model itself
        snapshot = out / "seed0" / r["arm"] / f"ckpt-{r['fraction']:g}"
        assert ckpt == snapshot or (ckpt == base and r["steps"] == 0)
        gens = [json.loads(line) for line in open(r["generations"])]
        assert len(gens) == 8 and r["accuracy"] == tta_eval.accuracy(gens)
        assert 0.0 <= r["accuracy"] <= 1.0
        assert all(g["correct"] == task.is_correct(g["reply"], g["answer"]) for g in gens)
        # the snapshot is taken at its time, not before (TRL's thread: after its imports)
        assert r["elapsed_s"] >= r["fraction"] * budget - 0.05
        assert r["elapsed_s"] <= r["fraction"] * budget + 15.0
        assert r["load"] >= 0
        if r["checkpoint"] is None:  # deleted once scored (no --keep-checkpoints): not the final one
            assert r["fraction"] < 1 and not ckpt.exists()
        else:
            assert Path(r["checkpoint"]) == ckpt
            model = AutoModelForCausalLM.from_pretrained(r["checkpoint"])  # loadable by transformers
            assert model.config.num_hidden_layers == 4
    for arm in arms:
        mine = sorted((r for r in rows if r["arm"] == arm), key=lambda r: r["fraction"])
        assert mine[0]["steps"] <= mine[1]["steps"]
    summary = (out / "summary.md").read_text()
    for arm in arms:
        assert f"| {arm} | **" in summary and f"| {arm} | 0 |" in summary
    assert (out / "tta.png").stat().st_size > 1000
    return rows


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_saorl_arms_end_to_end(tmp_path: Path, monkeypatch):
    # value pretraining cut to a few rollouts so the async arm also trains inside 30 s (its default
    # sizing takes ~45 s on the tiny model); the override is the --set path a lever is measured by
    out, evaluated = run_bench(tmp_path, monkeypatch, "sao,grpo", 30.0,
                               ["--set", "sao:value_pretrain.rollouts=16",
                                "--set", "sao:value_pretrain.steps=2", "--keep-checkpoints"])
    rows = check_rows(out, evaluated, ["sao", "grpo"], 30.0)
    final = {r["arm"]: r for r in rows if r["fraction"] == 1.0}
    assert final["grpo"]["steps"] > 0 and final["sao"]["steps"] > 0  # both trained before the budget
    sao_cmd = (out / "seed0" / "sao" / "run" / "config.yaml").read_text()
    assert "rollouts: 16" in sao_cmd  # the --set override reached the sao arm only
    assert "rollouts: 16" not in (out / "seed0" / "grpo" / "run" / "config.yaml").read_text()
    assert all(r["checkpoint"] for r in rows)  # --keep-checkpoints
    assert not (out / "seed0" / "grpo" / "run" / "weights").exists()  # the run's model files went


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trl_arm_end_to_end(tmp_path: Path, monkeypatch):
    pytest.importorskip("trl")
    out, evaluated = run_bench(tmp_path, monkeypatch, "trl", 40.0, [])  # TRL's imports alone take ~10 s
    rows = check_rows(out, evaluated, ["trl"], 40.0)
    assert rows[1]["checkpoint"] == str(out / "seed0" / "trl" / "ckpt-1")  # the final snapshot is kept
    assert rows[0]["checkpoint"] is None or rows[0]["steps"] == 0  # the other deleted (unless the base)
    assert rows[-1]["steps"] > 0  # TRL made optimizer steps inside the budget
    assert json.loads((out / "results.json").read_text())["arms"][0]["returncode"] == 0  # it exited itself


def test_trl_arm_is_skipped_without_trl(tmp_path: Path, monkeypatch, capsys):
    import builtins

    real_import = builtins.__import__

    def no_trl(name, *a, **kw):
        if name == "trl" or name.startswith("trl."):
            raise ImportError("no trl here")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_trl)
    assert tta.main(["--arms", "trl", "--out", str(tmp_path / "o")]) == 2
    assert "TRL is not installed, so the trl arm is skipped" in capsys.readouterr().err
