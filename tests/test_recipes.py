"""The real-model recipes under configs/recipes load and validate (no GPU, no download needed)."""

from pathlib import Path

import pytest

from saorl.config import load_config
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
    assert (cfg.algo.name, cfg.resolved_mode(), cfg.sft.enabled) == ("sao", "async", False)
    assert cfg.rollout.max_new_tokens < cfg.rollout.max_total_tokens
    env = make_env_factory(cfg.env.type, cfg.env.options)()  # imports and checks the reward function
    assert env.name == "prompt_reward"
