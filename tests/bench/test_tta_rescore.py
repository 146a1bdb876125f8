"""``benchmarks/tta_rescore.py``: a finished benchmark's kept models scored again, sampled, on the tiny
model; the evaluator's sampling is seeded and greedy stays greedy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_scripts import load_benchmark

rescore = load_benchmark("tta_rescore")


def _finished_run(tmp_path: Path) -> Path:
    from saorl.models.tiny import build_tiny
    from saorl.models.tokenizer import load_tokenizer

    model = tmp_path / "model"
    build_tiny("tiny-dense").save_pretrained(model)
    load_tokenizer().save_pretrained(model)
    out = tmp_path / "out"
    out.mkdir()
    rows = [{"arm": arm, "seed": seed, "fraction": f, "steps": 3, "accuracy": 0.0,
             "checkpoint": str(model) if f == 1.0 else None}
            for arm in ("trl", "sao", "grpo") for seed in (0, 1) for f in (0.5, 1.0)]
    meta = {"task": "arith", "train_n": 20, "test_n": 6, "model_dir": str(model), "chat": False, "max_new": 4}
    (out / "results.json").write_text(json.dumps({"rows": rows, "meta": meta, "arms": [], "base": {}}))
    return out


def test_the_kept_models_are_scored_sampled_and_paired(tmp_path: Path, capsys):
    out = _finished_run(tmp_path)
    assert rescore.main([str(out), "--temperature", "1", "--samples", "2"]) == 0
    got = [json.loads(line) for line in (out / "rescore-t1.jsonl").read_text().splitlines()]
    assert [(r["arm"], r["seed"]) for r in got] == [("base", None)] + [
        (a, s) for a in ("trl", "sao", "grpo") for s in (0, 1)]  # the budget's end only
    # one model everywhere and the samples seeded alike: every row scores the same episodes
    assert len({json.dumps(r["per_problem"]) for r in got}) == 1
    assert all(len(r["per_problem"]) == 6 for r in got)
    assert all(v in (0.0, 0.5, 1.0) for r in got for v in r["per_problem"])
    table = (out / "rescore-t1.md").read_text()
    assert "| sao − trl | +0.000" in table and "| sao − grpo |" in table


def test_sampling_is_seeded_and_greedy_stays_greedy():
    tta_eval = rescore.tta_eval
    assert tta_eval.sampling(0.0, 3) == {"do_sample": False}
    import torch

    args = tta_eval.sampling(1.0, 7)
    assert args == {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    first = torch.rand(3)
    tta_eval.sampling(1.0, 7)
    assert torch.equal(torch.rand(3), first)


@pytest.mark.parametrize("argv, says", [(["--temperature", "0"], "greedy"), (["--samples", "0"], "samples"),
                                        ([], "does not exist")])
def test_bad_input_is_named(tmp_path: Path, argv, says, capsys):
    with pytest.raises(SystemExit) as info:
        rescore.main([str(tmp_path / "nothing"), *argv])
    assert info.value.code == 2 and says in capsys.readouterr().err
