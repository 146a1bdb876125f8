"""benchmarks/lr_staleness_map.py: the map's cells from fabricated run directories (hand-computed values)."""

import json
from pathlib import Path

import pytest
import yaml
from bench_scripts import load_benchmark


@pytest.fixture(scope="module")
def lr_map():
    return load_benchmark("lr_staleness_map")


def _run(out: Path, arm: str, seed: int, *, algo: str, lr: float, flight: int, kl: list[float],
         stale: float, accs: dict[int, float], done: bool = True) -> None:
    d = out / arm / f"seed-{seed}"
    d.mkdir(parents=True)
    cfg = {"algo": {"name": algo}, "trainer": {"policy_lr": lr},
           "rollout": {"concurrent_episodes": flight, "num_workers": 1}}
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    rows = [{"step": i + 1, "mismatch/kl": k, "reward/mean": 0.5, "rollout/staleness_mean": stale,
             "policy/update_rel": 1e-3, "time/elapsed_s": float(i)} for i, k in enumerate(kl)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "eval.jsonl").write_text("".join(json.dumps({"step": s, "eval/accuracy": a}) + "\n"
                                          for s, a in accs.items()))
    if done:
        (d / "done.json").write_text(json.dumps({"steps": len(kl)}))


def test_cells_at_equal_steps_and_per_arm(lr_map, tmp_path):
    # a: 20 steps, 2 of the first 10 above 0.05; b: 10 steps; so S = 10 for every cell
    _run(tmp_path, "a", 0, algo="sao", lr=1e-4, flight=64, kl=[0.1, 0.2] + [0.01] * 18, stale=16.0,
         accs={0: 0.4, 5: 0.5, 10: 0.6, 20: 0.9})
    _run(tmp_path, "a", 1, algo="sao", lr=1e-4, flight=64, kl=[0.0] * 10, stale=18.0,
         accs={0: 0.4, 5: 0.3, 10: 0.4})
    _run(tmp_path, "b", 0, algo="sao", lr=1e-4, flight=64, kl=[0.0] * 10, stale=2.0,
         accs={0: 0.4, 5: 0.1, 10: 0.2})
    _run(tmp_path, "c", 0, algo="sao", lr=1e-5, flight=16, kl=[0.0] * 10, stale=4.0, accs={10: 0.5},
         done=False)  # not finished: left out
    steps, at, table = lr_map.cells(lr_map.load_runs(tmp_path))
    assert steps == 10 and at == [5, 10]
    a = table[("sao", 64, 1e-4, "a")]  # the same settings as b, but its own cell
    assert a["drift bursts"] == [0.2, 0.0] and a["staleness"] == [16.0, 18.0]
    assert a["acc@10"] == [0.6, 0.4] and a["acc@5"] == [0.5, 0.3]
    assert a["max 10-step KL"] == [pytest.approx((0.1 + 0.2 + 8 * 0.01) / 10), 0.0]
    assert set(table) == {("sao", 64, 1e-4, "a"), ("sao", 64, 1e-4, "b")}
    text = lr_map.markdown(steps, at, table)
    row = next(line for line in text.splitlines() if line.startswith("| a |"))
    assert "| 17.0 (16.0–18.0) |" in row and "| 0.500 (0.400–0.600) |" in row  # staleness, acc@10
    png = tmp_path / "map.png"
    lr_map.plot(steps, table, png, skip=("b",))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_finished_run_says_so(lr_map, tmp_path):
    with pytest.raises(SystemExit, match="no finished runs"):
        lr_map.load_runs(tmp_path)
