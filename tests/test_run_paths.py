"""RunPaths: the one place that names what is inside a run directory."""

import ast
import dataclasses
from pathlib import Path

import pytest

from saorl.run_paths import RunPaths

SAORL = Path(__file__).resolve().parent.parent / "saorl"
NAMES = {"config.yaml", "algo_resolved.yaml", "metrics.jsonl", "trained.jsonl", "eval.jsonl", "errors.log",
         "stability.json", "checkpoints", "journal", "run.png"}


def test_each_name_of_the_run_directory():
    p = RunPaths("runs/r1")
    assert p.root == Path("runs/r1")
    got = {k: getattr(p, k) for k in ("config", "algo_resolved", "metrics", "trained", "eval", "errors",
                                      "stability", "samples", "checkpoints", "journal", "weights", "final",
                                      "final_policy", "final_critic", "final_adapter", "replays", "lock",
                                      "plot")}
    root = Path("runs/r1")
    assert got == {"config": root / "config.yaml", "algo_resolved": root / "algo_resolved.yaml",
                   "metrics": root / "metrics.jsonl", "trained": root / "trained.jsonl",
                   "eval": root / "eval.jsonl", "errors": root / "errors.log",
                   "stability": root / "stability.json", "samples": root / "samples",
                   "checkpoints": root / "checkpoints", "journal": root / "journal",
                   "weights": root / "weights", "final": root / "final",
                   "final_policy": root / "final" / "policy", "final_critic": root / "final" / "critic",
                   "final_adapter": root / "final" / "adapter", "replays": root / "replays",
                   "lock": root / ".lock", "plot": root / "run.png"}
    assert p.write_dirs == (root, root / "checkpoints", root / "weights", root / "final", root / "journal")


def test_frozen_and_equal_by_root(tmp_path):
    p = RunPaths(str(tmp_path))
    assert p == RunPaths(tmp_path) and hash(p) == hash(RunPaths(tmp_path)) and p != RunPaths(tmp_path / "x")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.root = tmp_path / "other"


def test_no_other_module_spells_a_run_directory_name():
    """The names live in saorl/run_paths.py only: a string literal elsewhere would drift from it."""
    found = []
    for path in SAORL.rglob("*.py"):
        if path.name == "run_paths.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value in NAMES:
                found.append(f"{path.relative_to(SAORL)}:{node.lineno} {node.value!r}")
    assert not found, found
