"""examples/tools: TRL's ``tools=[add, multiply]`` as ``env.tools`` trains with ``saorl train`` and
a config of a few lines (the tiny model, 2 steps), and the tool counts are logged per step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from saorl.config import load_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tools"


def test_the_recipe_and_the_tiny_config_load():
    cfg = load_config(ROOT / "configs" / "recipes" / "smollm2_135m_tools.yaml")
    assert cfg.env.tools == ["calculator:add", "calculator:multiply"] and cfg.env.tool_stop
    assert cfg.model.policy == "smollm2-135m-instruct" and cfg.env.observation_role == "tool"
    assert cfg.sft.enabled and cfg.env.options["demo_column"] == "demo"  # it never calls a tool as it is
    tiny = load_config(EXAMPLE / "tools_tiny.yaml")
    assert tiny.env.tools == cfg.env.tools and tiny.env.options["reward_fn"] == "calculator:correct_answer"


@pytest.mark.slow
def test_the_tiny_config_trains_two_steps(tmp_path):
    path = os.pathsep.join([str(ROOT), str(EXAMPLE), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    subprocess.run([sys.executable, str(EXAMPLE / "make_data.py"), "data/tools", "--tiny-tokenizer",
                    "--train", "40", "--test", "4"], cwd=tmp_path, env=env, check=True, capture_output=True,
                   timeout=120)
    out = subprocess.run([sys.executable, "-m", "saorl.cli", "train", str(EXAMPLE / "tools_tiny.yaml"),
                          "trainer.steps=2", "trainer.batch_size=2", "value_pretrain.enabled=false",
                          "run.eval_tasks=1", "rollout.max_new_tokens=8", "run.progress=false",
                          "--run-dir", "run"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("step", 0) > 0 and "env/tool_calls" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:  # the episode's counts, batch means
        assert r["env/tool_calls"] >= r["env/tool_errors"] >= 0.0
        assert 0.0 <= r["env/reward/correct_answer"] <= 1.0


def test_every_env_key_on_docs_agents_is_a_config_field():
    import re

    from saorl.config.sections import EnvConfig

    page = (ROOT / "docs" / "agents.md").read_text(encoding="utf-8")
    prose = re.sub(r"^```.*?^```", "", page, flags=re.S | re.M)
    keys = {m for span in re.findall(r"`([^`\n]+)`", prose) for m in re.findall(r"\benv\.([a-z_]+)", span)}
    assert {"tools", "tool_format", "tool_prompt", "tool_stop", "tool_max_turns"} <= keys
    assert not sorted(k for k in keys if k not in EnvConfig.model_fields)
    for path in ("examples/tools/tools_tiny.yaml", "examples/tools/calculator.py",
                 "examples/tools/make_data.py", "configs/recipes/smollm2_135m_tools.yaml",
                 "examples/tools/first_replies.py"):
        assert path in page and (ROOT / path).exists()
