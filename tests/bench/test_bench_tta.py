"""``benchmarks/bench_tta.py``: the task's rewards by hand, the option checks, and the benchmark end to
end on the tiny model (saorl's two arms always; TRL's when TRL is installed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_scripts import load_benchmark

tta = load_benchmark("bench_tta")
task, tta_eval = tta.tta_task, tta.tta_eval
import tta_scoring  # noqa: E402  (benchmarks/ is on sys.path once bench_tta is loaded)


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
    (["--variant", "sao=grpo"], "--variant"), (["--variant", "top4=trl"], "--variant"),
    (["--variant", "Top4=sao"], "--variant"), (["--variant", "v=sao", "--variant", "v=grpo"], "--variant"),
    (["--arms", "sao,top4"], "--arms"), (["--set", "top4:algo.critic_train_layers=4"], "--set"),
    (["--report", "/nonexistent/never-made"], "results.json"),
    (["--task", "calc", "--format-reward", "0"], "--format-reward applies to --task arith"),
    (["--format-reward", "-1"], "--format-reward"), (["--eval-temperature", "-0.5"], "--eval-temperature"),
])
def test_bad_options_are_named(argv, match, capsys):
    assert tta.main([*argv, "--out", "/nonexistent/never-made"]) == 2
    assert match in capsys.readouterr().err


def test_format_reward_reaches_every_arm_alike():
    """``--format-reward W``: the bare-integer term's weight for saorl's env and TRL's reward_funcs;
    0 leaves the term out, so the reward is the accuracy."""
    import tta_setup

    def saorl_reward(s):
        cmd = tta.saorl_command("sao", s, 0, Path("/r"), [])
        return ([c for c in cmd if c.startswith("env.options.reward_fn=")],
                [c for c in cmd if c.startswith("env.options.reward_weights=")])

    common = dict(model="m", chat=True, task="arith", train_file="a", test_file="b", budget_s=1.0,
                  fractions=[1.0], lr=1e-5, batch=4, group=2, max_new=8, trl_threads=1)
    default = tta_setup.Setup(**common)
    both = "env.options.reward_fn=[tta_task:bare_integer, tta_task:last_integer_correct]"
    assert saorl_reward(default) == ([both], ["env.options.reward_weights=[0.5, 1.0]"])
    off = tta_setup.Setup(**common, format_reward=0.0)
    assert saorl_reward(off) == (["env.options.reward_fn=[tta_task:last_integer_correct]"],
                                 ["env.options.reward_weights=[1.0]"])
    quarter = tta_setup.Setup(**common, format_reward=0.25)
    assert saorl_reward(quarter)[1] == ["env.options.reward_weights=[0.25, 1.0]"]
    trl = task.trl_arm([], None, 8, format_reward=0.0)
    assert [f.__name__ for f in trl["reward_funcs"]] == ["last_integer_correct"]
    assert trl["reward_weights"] == [1.0]
    trl = task.trl_arm([], None, 8)
    assert [f.__name__ for f in trl["reward_funcs"]] == ["bare_integer", "last_integer_correct"]
    assert trl["reward_weights"] == [0.5, 1.0]


def _rows(acc: dict[str, list[list[float]]]) -> list[dict]:
    """Rows of arms x seeds x fractions (0.5, 1) from ``{arm: [[seed0 at 0.5, at 1], [seed1 ...], ...]}``."""
    return [{"arm": arm, "seed": seed, "fraction": f, "accuracy": a, "elapsed_s": 100.0 * f + seed,
             "steps": 1}
            for arm, seeds in acc.items() for seed, accs in enumerate(seeds)
            for f, a in zip((0.5, 1.0), accs)]


def test_paired_table_and_time_to_trl_by_hand():
    rows = _rows({"trl": [[0.1, 0.3], [0.2, 0.4], [0.0, 0.2]],
                  "sao": [[0.3, 0.4], [0.3, 0.5], [0.4, 0.3]],
                  "grpo": [[0.1, 0.2], [0.2, 0.2], [0.1, 0.1]]})
    assert tta_eval.pairs(["trl", "sao", "grpo"]) == [("sao", "trl"), ("grpo", "trl"), ("sao", "grpo")]
    assert tta_eval.pairs(["sao", "grpo"]) == [("sao", "grpo")]
    text = tta_eval.paired_table(rows, ["trl", "sao", "grpo"], [0.5, 1.0], 100.0)
    line = next(x for x in text.splitlines() if x.startswith("| sao − trl |"))
    # at 0.5: differences +0.2, +0.1, +0.4: mean 0.2333, sd 0.1528, t(0.975, 2) = 4.3027 -> half 0.3795
    assert "+0.233 [-0.146, +0.613] (+0.200, +0.100, +0.400)" in line
    # at 1: +0.1, +0.1, +0.1: no spread
    assert "+0.100 [+0.100, +0.100] (+0.100, +0.100, +0.100)" in line
    grpo = next(x for x in text.splitlines() if x.startswith("| sao − grpo |"))
    assert "(+0.200, +0.100, +0.300)" in grpo  # 0.5: 0.3-0.1, 0.3-0.2, 0.4-0.1
    said = tta_eval.time_to(rows, ["trl", "sao", "grpo"])
    # TRL's mean at the end: 0.3; sao's mean at 0.5 is 0.333 (reached at the mean elapsed 51 s); grpo's never
    assert "is 0.300" in said and "sao: 51 s (0.5 of the budget)" in said
    assert "grpo: not within the budget" in said and "trl: 101 s (1 of the budget)" in said
    assert tta_eval.time_to(rows, ["sao", "grpo"]) == ""


def test_variant_arms_and_report_rebuild(tmp_path: Path, monkeypatch):
    """A --variant runs as its base arm with its own overrides, rotated with the others; --report
    rebuilds the summary from results.json."""
    calls = []

    def fake_run(arm, s, seed, arm_dir, extra, base=None):
        calls.append((arm, seed, list(extra), base))
        return {"arm": arm, "seed": seed, "dir": str(arm_dir), "load_start": 0.5, "load_end": 0.7,
                "exit_s": 10.0, "returncode": 0,
                "snapshots": [{"fraction": 1.0, "elapsed_s": 10.0, "steps": 2, "weights": None, "load": 0.6}]}

    def fake_eval(s, out, runs, test, keep=False, resume=False):
        rows = [{"arm": r["arm"], "seed": r["seed"], "fraction": 1.0, "steps": 2, "elapsed_s": 10.0,
                 "accuracy": 0.25 if r["arm"] == "top4" else 0.5, "bare_frac": 0.0} for r in runs]
        return {"accuracy": 0.1, "bare_frac": 0.0, "generations": ""}, rows

    monkeypatch.setattr(tta, "run_arm", fake_run)
    monkeypatch.setattr(tta_scoring, "evaluate_all", fake_eval)
    out = tmp_path / "tta"
    assert tta.main(["--model", "tiny-dense", "--arms", "sao,top4,grpo", "--variant", "top4=sao",
                     "--set", "top4:algo.critic_train_layers=4", "--set", "sao:value_pretrain.steps=2",
                     "--seeds", "2", "--fractions", "1", "--train-n", "40", "--test-n", "4",
                     "--out", str(out)]) == 0
    top4, sao = ["algo.critic_train_layers=4"], ["value_pretrain.steps=2"]
    assert calls == [("sao", 0, sao, None), ("top4", 0, top4, "sao"), ("grpo", 0, [], None),
                     ("top4", 1, top4, "sao"), ("grpo", 1, [], None), ("sao", 1, sao, None)]
    summary = (out / "summary.md").read_text()
    assert "| top4 − grpo | -0.250 [-0.250, -0.250]" in summary
    assert "top4 (sao): algo.critic_train_layers=4" in summary
    setup = tta.Setup(**json.loads((out / "setup.json").read_text()))
    cmd = tta.saorl_command("sao", setup, 0, tmp_path / "r", top4)
    assert "algo.name=sao" in cmd and cmd[-3] == "algo.critic_train_layers=4"
    (out / "summary.md").unlink()
    (out / "tta.png").unlink()
    assert tta.main(["--report", str(out)]) == 0
    assert (out / "summary.md").read_text() == summary and (out / "tta.png").stat().st_size > 1000


def run_bench(tmp_path: Path, monkeypatch, arms: str, budget: float, extra: list[str]) -> tuple[Path, list]:
    """The benchmark with a spy on the evaluator; its out directory and the checkpoints evaluated."""
    evaluated = []
    real = tta_eval.evaluate

    def spy(ckpt, rows, chat, max_new, batch=32, **decoding):
        evaluated.append(Path(ckpt))
        assert decoding == {"temperature": 0.0, "seed": 0}  # the benchmark's own evaluation: greedy
        return real(ckpt, rows, chat, max_new, batch, **decoding)

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
    assert [r["fraction"] for r in rows] == [1.0, 0.5]  # the budget's end scored first
    assert rows[0]["checkpoint"] == str(out / "seed0" / "trl" / "ckpt-1")  # the final snapshot is kept
    assert rows[1]["checkpoint"] is None or rows[1]["steps"] == 0  # the other deleted (unless the base)
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


def test_a_model_directory_given_relative_is_passed_on_absolute(tmp_path: Path, monkeypatch):
    """The arms run in their own directories: ``--model runs/sft`` given from the repository's root
    reached TRL's child as a path it could not find."""
    from saorl.models.tiny import build_tiny
    from saorl.models.tokenizer import load_tokenizer

    build_tiny("tiny-dense").save_pretrained(tmp_path / "runs" / "sft")
    load_tokenizer().save_pretrained(tmp_path / "runs" / "sft")
    monkeypatch.chdir(tmp_path)
    path = tta.prepare_model("runs/sft", tmp_path / "out")
    assert path.is_absolute() and path == (tmp_path / "runs" / "sft").resolve()


def test_sampled_evaluation_and_evaluate_again(tmp_path: Path, monkeypatch, capsys):
    """``--eval-temperature`` reaches the evaluator (the same seed for every model) and the report
    says how it decoded; ``arms.json`` is written as arms finish, so ``--evaluate OUT`` scores them
    again at another temperature; a snapshot whose model is gone is named, not skipped."""
    decodings = []

    def fake_run(arm, s, seed, arm_dir, extra, base=None):
        arm_dir.mkdir(parents=True, exist_ok=True)
        recorded = json.loads((arm_dir.parents[1] / "arms.json").read_text())["runs"] if seed else []
        assert len(recorded) == seed  # the arms before this one are on disk already
        return {"arm": arm, "seed": seed, "dir": str(arm_dir), "load_start": 0.5, "load_end": 0.7,
                "exit_s": 10.0, "returncode": 0,
                "snapshots": [{"fraction": 1.0, "elapsed_s": 10.0, "steps": 0, "weights": None, "load": 0.6}]}

    models = []

    def fake_evaluate(ckpt, rows, chat, max_new, batch=32, temperature=0.0, seed=0):
        decodings.append((temperature, seed))
        models.append(Path(ckpt))
        right = temperature > 0  # sampled: every reply right; greedy: none
        return [{"question": r["question"], "answer": r["answer"], "reply": str(r["answer"] if right else 0),
                 "correct": right, "bare": True} for r in rows]

    monkeypatch.setattr(tta, "run_arm", fake_run)
    monkeypatch.setattr(tta_eval, "evaluate", fake_evaluate)
    out = tmp_path / "tta"
    common = ["--model", "tiny-dense", "--arms", "sao", "--fractions", "1", "--train-n", "40",
              "--test-n", "4"]
    assert tta.main([*common, "--seeds", "2", "--eval-temperature", "1", "--out", str(out)]) == 0
    assert decodings == [(1.0, 0)] * 3  # the base model, then each seed's snapshot, seeded alike
    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["eval_temperature"] == 1.0 and {r["accuracy"] for r in results["rows"]} == {1.0}
    assert "sampled at temperature 1, one episode a problem" in (out / "summary.md").read_text()
    assert len(json.loads((out / "arms.json").read_text())["runs"]) == 2

    decodings.clear()
    assert tta.main(["--evaluate", str(out), "--eval-temperature", "0"]) == 0
    assert decodings == [(0.0, 0)] * 3
    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["eval_temperature"] == 0.0 and {r["accuracy"] for r in results["rows"]} == {0.0}
    assert "Held-out accuracy (greedy, 4 problems" in (out / "summary.md").read_text()
    decodings.clear()
    models.clear()
    assert tta.main(["--evaluate", str(out)]) == 0  # no temperature given: the one it started with
    assert decodings == [(1.0, 0)] * 3
    model_dir = Path(json.loads((out / "arms.json").read_text())["meta"]["model_dir"])
    assert models == [model_dir] * 3 and (model_dir / "config.json").is_file()  # not the name as given
    # an evaluation cut short after one snapshot goes on where it stopped, at the same temperature
    first = (out / "results.jsonl").read_text().splitlines()[0]
    (out / "results.jsonl").write_text(first + "\n")
    decodings.clear()
    assert tta.main(["--evaluate", str(out)]) == 0
    assert decodings == [(1.0, 0)]  # the other seed's snapshot alone: the base and the first kept
    assert len(json.loads((out / "results.json").read_text())["rows"]) == 2

    # an evaluation cut short: --report rebuilds the summary from the rows it wrote, and says so
    (out / "results.json").unlink()
    first = (out / "results.jsonl").read_text().splitlines()[0]
    (out / "results.jsonl").write_text(first + "\n")
    assert tta.main(["--report", str(out)]) == 0
    summary = (out / "summary.md").read_text()
    assert "Partial: the evaluation was cut short (1 of 2 snapshots scored)" in summary
    assert "sampled at temperature 1" in summary  # the decoding of the evaluation the rows are from
    assert "| sao | **1.000** (1.000; steps 0) |" in summary and not (out / "results.json").exists()
    (out / "results.jsonl").write_text("")
    capsys.readouterr()
    assert tta.main(["--report", str(out)]) == 2
    assert "holds no scored snapshot yet" in capsys.readouterr().err

    recorded = json.loads((out / "arms.json").read_text())
    recorded["runs"][1]["snapshots"][0]["weights"] = "weights-v3.safetensors"  # never converted, gone
    (out / "arms.json").write_text(json.dumps(recorded))
    capsys.readouterr()
    assert tta.main(["--evaluate", str(out)]) == 2
    assert "the models of sao seed 1 at 1 are gone" in capsys.readouterr().err
    assert tta.main(["--evaluate", str(tmp_path / "nothing")]) == 2
    assert "arms.json does not exist" in capsys.readouterr().err
    assert tta.main([*common, "--eval-temperature", "-1", "--out", str(out)]) == 2
    assert "--eval-temperature must be in [0, 10]" in capsys.readouterr().err
