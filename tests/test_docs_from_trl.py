"""docs/from-trl.md cannot drift: its files are quoted verbatim, every saorl key it names is a
config field (or an option of ``prompt_reward``), its commands load, its verl adapter scores a
verl parquet row, and its example trains (2 steps here) on the data ``make_data.py`` writes."""

from __future__ import annotations

import asyncio
import inspect
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from saorl.config import SaorlConfig, load_config
from saorl.data.jsonl import read_jsonl
from saorl.envs.prompt_reward import PromptRewardEnv

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGE = (DOCS / "from-trl.md").read_text(encoding="utf-8")
EXAMPLE = ROOT / "examples" / "from_trl"
SECTIONS = tuple(SaorlConfig.model_fields)


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def _field(path: list[str]) -> bool:
    """Whether ``path`` names a field of the config tree (``env.options.X``: an option of prompt_reward)."""
    models: list[type[BaseModel]] = [SaorlConfig]  # several: a section per kind (rollout.engine)
    for i, name in enumerate(path):
        model = next((m for m in models if name in m.model_fields), None)
        if model is None:
            return False
        if path[:i + 1] == ["env", "options"]:
            options = inspect.signature(PromptRewardEnv.__init__).parameters
            return len(path) == i + 2 and path[-1] in options and path[-1] != "options"
        args = typing.get_args(model.model_fields[name].annotation) or (model.model_fields[name].annotation,)
        models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        if not models:
            return i == len(path) - 1
    return True


def _named_keys() -> set[str]:
    """Dotted saorl keys in backticks: in the prose, and in the saorl (right-hand) column of the
    tables, whose left-hand column holds TRL's and verl's names."""
    keys = set()
    for line in PAGE.splitlines():
        text = line.split("|")[2] if line.startswith("|") and line.count("|") >= 3 else line
        for span in re.findall(r"`([^`]+)`", text):
            for m in re.finditer(r"(?<![\w.])([a-z_]+(?:\.[a-z_]+)+)", span):
                if m.group(1).split(".")[0] in SECTIONS:
                    keys.add(m.group(1))
    return keys


def test_every_saorl_key_on_the_page_is_a_config_field():
    keys = _named_keys()
    assert len(keys) > 40 and {"env.overlong_prompts", "env.options.reward_weights", "algo.eps_high"} <= keys
    unknown = sorted(k for k in keys if not _field(k.split(".")))
    assert not unknown, f"docs/from-trl.md names keys that are not config fields: {unknown}"


def test_the_page_quotes_the_example_files_verbatim():
    header = "# examples/from_trl/trl_rewards.py\n"
    block = next(b for b in _blocks(PAGE, "python") if b.startswith(header))
    assert block[len(header):] == (EXAMPLE / "trl_rewards.py").read_text(encoding="utf-8")
    yaml_file = (EXAMPLE / "trl_style.yaml").read_text(encoding="utf-8")
    config = "".join(line + "\n" for line in yaml_file.splitlines() if not line.startswith("#"))
    assert config in _blocks(PAGE, "yaml")
    adapter = next(b for b in _blocks(PAGE, "python") if b.startswith("def verl_score"))
    assert adapter in (EXAMPLE / "verl_reward.py").read_text(encoding="utf-8")
    assert "MEASURED_OUTPUT" not in PAGE


def test_the_pages_commands_load():
    commands = [line for b in _blocks(PAGE, "bash") for line in b.replace("\\\n", " ").splitlines()]
    checked = 0
    for line in commands:
        m = re.search(r"saorl train (\S+\.yaml)(.*)", line)
        if m:
            load_config(ROOT / m.group(1), m.group(2).split())
            checked += 1
    assert checked == 3


def test_the_verl_adapter_scores_a_verl_parquet_row(tmp_path, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from saorl.agent.loop import run_episode
    from saorl.agent.scripted import ScriptedEngine
    from saorl.data.tasks import read_tasks
    from saorl.engines.base import SamplingParams
    from saorl.models.codec import RunTokenizer
    from saorl.models.tokenizer import load_tokenizer

    row = {"data_source": "one_digit_sums",
           "prompt": [{"role": "system", "content": "Reply with the number only."},
                      {"role": "user", "content": "What is 14+1?"}],
           "ability": "math", "reward_model": {"style": "rule", "ground_truth": "15"},
           "extra_info": {"split": "train", "index": 0}}
    pq.write_table(pa.Table.from_pylist([row]), tmp_path / "verl.parquet")
    (task,) = read_tasks(tmp_path / "verl.parquet")
    monkeypatch.syspath_prepend(str(EXAMPLE))
    env = PromptRewardEnv(reward_fn="verl_reward:verl_score")
    hf = load_tokenizer()
    hf.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = RunTokenizer(hf)
    for reply, reward in (("15", 1.0), ("16", 0.0)):
        traj = asyncio.run(run_episode(ScriptedEngine(tok, [reply]), env, task, tok,
                                       sampling=SamplingParams(max_new_tokens=8), max_total_tokens=128))
        assert traj.episode.final_reward == reward


def test_the_example_trains_on_make_datas_files(tmp_path):
    """The page's two commands, from a directory laid out as the repository (2 steps instead of 40)."""
    pytest.importorskip("pyarrow")
    path = os.pathsep.join([str(ROOT), str(EXAMPLE), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    subprocess.run([sys.executable, str(EXAMPLE / "make_data.py"), "data/from_trl"], cwd=tmp_path, env=env,
                   check=True, capture_output=True, timeout=120)
    assert sum(1 for _ in open(tmp_path / "data/from_trl/train.jsonl")) == 150
    out = subprocess.run([sys.executable, "-m", "saorl.cli", "train", str(EXAMPLE / "trl_style.yaml"),
                          "trainer.steps=2", "value_pretrain.enabled=false", "run.eval_tasks=2",
                          "run.progress=false", "--run-dir", "run"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "step" in r]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert 0.0 <= r["env/reward/format_reward"] <= 1.0
        assert 0.0 <= r["env/reward/correctness_reward"] <= 1.0
