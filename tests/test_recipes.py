"""The real-model recipes under configs/recipes load and validate (no GPU, no download needed)."""

from pathlib import Path

import pytest

from saorl.config import load_config
from saorl.envs.base import Task
from saorl.envs.registry import BUILTIN_ENVS, make_env_factory

RECIPES = Path(__file__).resolve().parents[1] / "configs" / "recipes"


@pytest.mark.skipif("prompt_reward" not in BUILTIN_ENVS,
                    reason="needs the prompt_reward env and env.dataset (the dataset-and-reward path)")
def test_qwen3_gsm8k_recipe_loads_and_validates():
    cfg = load_config(RECIPES / "qwen3_0.6b_gsm8k.yaml")
    m = cfg.model
    assert (m.policy, m.device, m.dtype, m.chat_template) == ("Qwen/Qwen3-0.6B", "cuda", "float32", True)
    assert m.chat_template_kwargs == {"enable_thinking": False}
    assert cfg.env.type == "prompt_reward" and cfg.env.dataset.path == "data/gsm8k"
    assert cfg.env.options["reward_fn"] == "saorl.envs.rewards:number_answer"
    assert (cfg.algo.name, cfg.resolved_mode(), cfg.sft.enabled) == ("sao_paper", "async", False)
    t = cfg.trainer  # the paper's rates (critic 5x the policy) and critic warm-up
    assert (t.policy_lr, t.critic_lr, t.critic_warmup_steps) == (1e-6, pytest.approx(5e-6), 10)
    assert cfg.rollout.max_new_tokens < cfg.rollout.max_total_tokens
    env = make_env_factory(cfg.env.type, cfg.env.options)()  # imports and checks the reward function
    assert env.name == "prompt_reward"


def test_smollm2_sums_recipe_loads_its_data_and_fits_the_pretrained_limits(tmp_path, monkeypatch):
    """The TRL-style recipe: the data script's splits are disjoint, every prompt states the format,
    and the recipe's sizes are the measured ones (rates under the pretrained limits, a short value
    pretraining without the curve, replies of up to 24 tokens)."""
    import json
    import subprocess
    import sys

    from saorl.stages.preflight import PRETRAINED_LR_LIMITS

    root = RECIPES.parents[1]
    out = tmp_path / "data" / "smollm2_sums"
    subprocess.run([sys.executable, str(root / "examples/smollm2/make_data.py"), str(out)], check=True)
    rows = {name: [json.loads(line) for line in (out / f"{name}.jsonl").read_text().splitlines()]
            for name in ("train", "test")}
    assert (len(rows["train"]), len(rows["test"])) == (176, 64)
    questions = {name: {r["prompt"][0]["content"] for r in split} for name, split in rows.items()}
    assert not questions["train"] & questions["test"]
    assert all(q.endswith("Answer with just the number.") for q in questions["test"])
    monkeypatch.chdir(tmp_path)
    cfg = load_config(RECIPES / "smollm2_135m_sums.yaml")
    assert cfg.env.type == "prompt_reward"
    assert cfg.env.options["reward_fn"] == "saorl.envs.rewards:number_answer"
    assert cfg.trainer.policy_lr <= PRETRAINED_LR_LIMITS["policy_lr"]
    assert cfg.trainer.critic_lr <= PRETRAINED_LR_LIMITS["critic_lr"]
    assert (cfg.value_pretrain.curve, cfg.sft.enabled, cfg.rollout.max_new_tokens) == (False, False, 24)
    env = make_env_factory(cfg.env.type, cfg.env.options)()
    row = rows["test"][0]
    assert env.reset(Task("t", row)) == row["prompt"]
    assert env.step(f"The sum is {row['answer']}.").reward == 1.0


def test_smollm2_math_tool_recipe_states_the_protocol_in_a_system_message():
    from saorl.stages.preflight import PRETRAINED_LR_LIMITS

    cfg = load_config(RECIPES / "smollm2_135m_math_tool.yaml")
    assert cfg.env.type == "math_tool"
    assert (cfg.env.observation_format, cfg.env.observation_role) == ("chat", "user")
    assert cfg.trainer.policy_lr <= PRETRAINED_LR_LIMITS["policy_lr"]
    assert cfg.trainer.critic_lr <= PRETRAINED_LR_LIMITS["critic_lr"]
    env = make_env_factory(cfg.env.type, cfg.env.options)()
    task = env.generate_tasks("test", 1, 0)[0]
    system, user = env.reset(task)
    assert system["role"] == "system" and "<tool>" in system["content"] and "<answer>" in system["content"]
    assert user == {"role": "user", "content": f"Compute {task.data['expr']}."}
    assert env.step(f"<answer>{task.data['answer']}</answer>").reward == 1.0


def test_every_recipe_makes_its_own_data_from_a_fresh_clone(tmp_path, monkeypatch):
    """`saorl train RECIPE` alone: a recipe that reads task files names the command that makes them
    (env.prepare), and the sums recipe's makes them, run from a clone's root."""
    import shutil

    from saorl.stages.env_check import missing_task_files, prepare_tasks

    for recipe in sorted(RECIPES.glob("*.yaml")):
        env = load_config(recipe).env
        if env.tasks_file or env.dataset is not None:
            assert env.prepare, f"{recipe.name} reads task files but does not say how to make them"
    shutil.copytree(RECIPES.parents[1] / "examples" / "smollm2", tmp_path / "examples" / "smollm2")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(RECIPES / "smollm2_135m_sums.yaml")
    assert [k for k, _ in missing_task_files(cfg)] == ["env.tasks_file", "env.test_tasks_file"]
    said = []
    prepare_tasks(cfg, log=said.append)
    assert missing_task_files(cfg) == []
    assert said[-1] == "wrote 176 train and 64 test rows to data/smollm2_sums"


def test_smollm2_mix_recipe_plays_the_two_community_recipes_tasks_half_and_half():
    """The mixed recipe's parts are the reasoning-gym and TextArena recipes' envs (same options), its
    held-out tasks half of each, and each part's demonstration wins its own task."""
    import random

    from tests.envs.community import need
    from tests.envs.episodes import play

    need("reasoning_gym")
    need("textarena")
    cfg = load_config(RECIPES / "smollm2_135m_mix.yaml")
    assert cfg.env.type == "mix" and [m.name for m in cfg.env.mix] == ["arith", "guess"]
    for part, alone in zip(cfg.env.mix, ("smollm2_135m_reasoning_gym.yaml", "smollm2_135m_textarena.yaml")):
        solo = load_config(RECIPES / alone).env
        assert (part.type, part.options) == (solo.type, solo.options), alone
    assert (cfg.env.observation_format, cfg.env.observation_role) == ("chat", "user")
    assert (cfg.run.eval_temperature, cfg.run.eval_tasks, cfg.env.num_test_tasks) == (0.0, 128, 128)
    env = make_env_factory(cfg.env.type, cfg.env.env_options)()
    test = env.generate_tasks("test", cfg.env.num_test_tasks, cfg.seed)
    assert [t.id.split("/")[0] for t in test[:4]] == ["arith", "guess", "arith", "guess"]
    assert sum(t.id.startswith("arith/") for t in test) == 64
    for task in test[:2]:
        out = play(env, task, env.demonstration(task, random.Random(0)))[-1]
        assert out.done and out.info["metrics"][f"{task.id.split('/')[0]}/success"] == 1.0


def test_smollm2_openenv_recipe_serves_the_textarena_recipes_game_from_its_warm_start():
    """The OpenEnv recipe plays the TextArena recipe's game (its server module is in the checkout and
    serves that game by default), starts from the directory the header's `saorl sft` command writes,
    and keeps the TextArena recipe's turn limit, stop strings and chat turns."""
    import re

    cfg = load_config(RECIPES / "smollm2_135m_openenv.yaml")
    solo = load_config(RECIPES / "smollm2_135m_textarena.yaml")
    opts = cfg.env.options
    assert cfg.env.type == "openenv" and not cfg.sft.enabled
    module, _, attr = opts["module"].partition(":")
    server = RECIPES.parents[1] / (module.replace(".", "/") + ".py")
    assert attr == "app" and server.is_file()
    assert f'"{solo.env.options["game"]}"' in server.read_text()
    for key in ("max_turns", "stop", "success_threshold"):
        assert opts[key] == solo.env.options[key], key
    assert (cfg.env.observation_format, cfg.env.observation_role) == ("chat", "user")
    header = (RECIPES / "smollm2_135m_openenv.yaml").read_text()
    made = re.search(r"saorl sft --out (\S+) (\S+)", header)
    assert made and made.group(1) == cfg.model.policy
    assert made.group(2) == "configs/recipes/smollm2_135m_textarena.yaml"
