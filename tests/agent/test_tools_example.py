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


def _play(demo: list[str], answer: int) -> float:
    """A demonstration's reward, played as the env plays it: a call's result comes back, the last
    action is the final reply."""
    sys.path.insert(0, str(EXAMPLE))
    try:
        import calculator
    finally:
        sys.path.remove(str(EXAMPLE))
    if demo[0].startswith("<tool_call>"):
        call = json.loads(demo[0].removeprefix("<tool_call>").removesuffix("</tool_call>"))
        assert call["name"] == "multiply" and set(call["arguments"]) == {"a", "b"}
    return calculator.correct_answer(None, [[{"role": "assistant", "content": demo[-1]}]], [answer])[0]


def test_make_data_writes_a_share_of_failing_demonstrations_and_only_right_test_rows(tmp_path):
    run = [sys.executable, str(EXAMPLE / "make_data.py"), str(tmp_path / "d"), "--train", "400",
           "--test", "20"]
    subprocess.run([*run, "--demo-error-rate", "0.5"], check=True, capture_output=True, timeout=60)
    train = [json.loads(line) for line in (tmp_path / "d" / "train.jsonl").read_text().splitlines()]
    test = [json.loads(line) for line in (tmp_path / "d" / "test.jsonl").read_text().splitlines()]
    assert {r["id"] for r in train}.isdisjoint(r["id"] for r in test)
    assert all(_play(r["demo"], r["answer"]) == 1.0 and len(r["demo"]) == 2 for r in test)
    rewards = [_play(r["demo"], r["answer"]) for r in train]
    failing = rewards.count(0.0) / len(rewards)
    assert 0.4 < failing < 0.6 and set(rewards) == {0.0, 1.0}
    kinds = {"call" if r["demo"][0].startswith("<tool_call>") else "guess"
             for r, w in zip(train, rewards) if not w}
    assert kinds == {"call", "guess"}  # both mistakes made: a wrong call (or copy), and no call at all
    # the same seed, the same rows; no failing demonstrations at 0
    subprocess.run([*run, "--demo-error-rate", "0"], check=True, capture_output=True, timeout=60)
    again = [json.loads(line) for line in (tmp_path / "d" / "train.jsonl").read_text().splitlines()]
    assert [r["id"] for r in again] == [r["id"] for r in train]
    assert all(_play(r["demo"], r["answer"]) == 1.0 for r in again)
    bad = subprocess.run([*run, "--demo-error-rate", "1.5"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--demo-error-rate must be in [0, 1]" in bad.stderr


class _Completions:
    """The part of ``openai.AsyncOpenAI`` the agent uses, answering from a script."""

    def __init__(self, replies: list[tuple[str | None, list[tuple[str, str]]]]) -> None:
        self.replies, self.seen = list(replies), []

    async def create(self, **kwargs):
        from types import SimpleNamespace as NS

        self.seen.append(kwargs)
        content, calls = self.replies.pop(0)
        tool_calls = [NS(id=f"c{i}", function=NS(name=n, arguments=a))
                      for i, (n, a) in enumerate(calls)] or None
        return NS(choices=[NS(message=NS(content=content, tool_calls=tool_calls))])


def test_the_calculator_agent_runs_its_calls_and_scores_the_final_reply():
    import asyncio
    from types import SimpleNamespace as NS

    sys.path.insert(0, str(EXAMPLE))
    try:
        import calculator_agent as ca
    finally:
        sys.path.remove(str(EXAMPLE))
    assert [t["function"]["name"] for t in ca.TOOLS] == ["add", "multiply"]
    assert ca.run_call("multiply", '{"a": 12, "b": 345}') == "4140"
    assert ca.run_call("divide", "{}").startswith("error: no tool named 'divide'")
    assert ca.run_call("add", "[1, 2]").startswith("error: arguments must be an object")
    assert ca.run_call("add", '{"a": 1').startswith("error:")
    assert ca.run_call("add", '{"a": 1, "c": 2}').startswith("error:")  # a wrong argument name
    task = {"prompt": [{"role": "user", "content": "Compute 12*345."}], "answer": 4140}
    script = _Completions([(None, [("multiply", '{"a": 12, "b": 345}'), ("nope", "{}")]), ("4140.0", [])])
    out = asyncio.run(ca.agent(task, NS(chat=NS(completions=script))))
    assert out == {"reward": 1.0, "success": True, "metrics": {"tool_calls": 2.0, "tool_errors": 1.0}}
    tool_msgs = [m for m in script.seen[1]["messages"] if isinstance(m, dict) and m["role"] == "tool"]
    assert tool_msgs[0]["content"] == "4140" and script.seen[1]["tools"] == ca.TOOLS
    # a model that never stops calling: no final reply, no reward
    loop = _Completions([(None, [("add", '{"a": 1, "b": 2}')])] * ca.MAX_TURNS)
    out = asyncio.run(ca.agent(task, NS(chat=NS(completions=loop))))
    assert out["reward"] == 0.0 and out["metrics"]["tool_calls"] == ca.MAX_TURNS


def test_the_agent_recipe_is_the_tools_recipe_as_an_openai_agent():
    tools = load_config(ROOT / "configs" / "recipes" / "smollm2_135m_tools.yaml")
    agent = load_config(ROOT / "configs" / "recipes" / "smollm2_135m_tools_agent.yaml")
    assert agent.env.type == "openai_agent" and agent.env.options["agent"] == "calculator_agent:agent"
    for key in ("tasks_file", "test_tasks_file", "prepare", "num_test_tasks"):
        assert getattr(agent.env, key) == getattr(tools.env, key)
    assert not agent.sft.enabled
    for section in ("rollout", "algo"):
        assert getattr(agent, section) == getattr(tools, section)
    t, a = tools.trainer, agent.trainer
    assert (t.policy_lr, t.critic_lr, t.batch_size) == (a.policy_lr, a.critic_lr, a.batch_size)


def test_plot_recipes_draws_a_panel_per_group_and_refuses_a_group_without_runs(tmp_path):
    for group, accs in (("tools", (0.25, 0.75)), ("agent", (0.5, 1.0))):
        run = tmp_path / group / "s0"
        run.mkdir(parents=True)
        rows = [{"step": 0, "eval/accuracy": accs[0]},
                {"step": 1, "reward/mean": 0.0, "time/elapsed_s": 30.0},
                {"step": 2, "reward/mean": 1.0, "eval/accuracy": accs[1], "time/elapsed_s": 90.0}]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = subprocess.run([sys.executable, str(EXAMPLE / "plot_recipes.py"), str(tmp_path / "p.png"),
                          str(tmp_path / "tools"), str(tmp_path / "agent")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "tools s0 step 0: 0.250 step 2: 0.750" in out.stdout
    assert "agent s0 step 0: 0.500 step 2: 1.000" in out.stdout
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    by_time = subprocess.run([sys.executable, str(EXAMPLE / "plot_recipes.py"), str(tmp_path / "m.png"),
                              str(tmp_path / "tools"), "--minutes"],
                             capture_output=True, text=True, timeout=120)
    assert by_time.returncode == 0, by_time.stderr
    assert "tools s0 min 0.0: 0.250 min 1.5: 0.750" in by_time.stdout  # time/elapsed_s of the evaluations
    (tmp_path / "empty").mkdir()
    bad = subprocess.run([sys.executable, str(EXAMPLE / "plot_recipes.py"), str(tmp_path / "q.png"),
                          str(tmp_path / "empty")], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "no run directories" in bad.stderr and not (tmp_path / "q.png").exists()


def test_plot_recipes_draws_a_panel_per_mix_part_from_its_own_metrics(tmp_path):
    run = tmp_path / "mix" / "s0"
    run.mkdir(parents=True)
    rows = [{"step": 0, "eval/accuracy": 0.5, "eval/arith/accuracy": 0.25, "eval/guess/accuracy": 0.75},
            {"step": 1, "reward/mean": 0.5, "env/arith/reward": 0.125, "env/guess/reward": 1.0},
            {"step": 2, "eval/accuracy": 0.6, "eval/arith/accuracy": 0.375, "eval/guess/accuracy": 0.8125}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = subprocess.run([sys.executable, str(EXAMPLE / "plot_recipes.py"), str(tmp_path / "p.png"),
                          str(tmp_path / "mix"), "--parts", "arith", "guess"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "mix: arith s0 step 0: 0.250 step 2: 0.375" in out.stdout
    assert "mix: guess s0 step 0: 0.750 step 2: 0.812" in out.stdout
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    bad = subprocess.run([sys.executable, str(EXAMPLE / "plot_recipes.py"), str(tmp_path / "q.png"),
                          str(tmp_path / "mix"), "--parts", "lake"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "eval/lake/accuracy" in bad.stderr and not (tmp_path / "q.png").exists()
