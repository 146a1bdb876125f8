"""Defaults sized by the model in hand (saorl.config.sizing): a small model keeps the tiny models'
learning rates and stage sizes, a pretrained one gets the rates and sizes measured on SmolLM2, a
value set by hand is never changed, and a saved config keeps what the run started with."""

import json

import pytest

from saorl.config import ConfigError, load_config
from saorl.config.loading import config_from_dict, config_to_dict
from saorl.config.sizing import SIZED, SMALL_PARAMS, estimated_params, is_small

SMOLLM2 = {"hidden_size": 576, "num_hidden_layers": 30, "vocab_size": 49152, "model_type": "llama"}
TINY_DIR = {"hidden_size": 128, "num_hidden_layers": 4, "vocab_size": 512, "model_type": "qwen3_moe"}


def _values(cfg) -> dict:
    return {k: getattr(getattr(cfg, k[0]), k[1]) for k in SIZED}


def _dir(tmp_path, name, config):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return str(d)


def test_the_tiny_kinds_keep_the_tiny_models_values():
    for kind in ("tiny-moe", "tiny-dense"):
        assert _values(load_config(None, [f"model.policy={kind}"])) == {k: v[0] for k, v in SIZED.items()}
    cfg = load_config(None, [])
    assert (cfg.trainer.policy_lr, cfg.trainer.critic_lr, cfg.sft.steps, cfg.value_pretrain.rollouts,
            cfg.run.eval_tasks) == (3e-5, 1e-3, 1000, 512, 128)


@pytest.mark.parametrize("policy", ["smollm2-135m-instruct", "Qwen/Qwen2.5-0.5B-Instruct", "/m/model.gguf"])
def test_a_pretrained_model_gets_the_rates_and_sizes_measured_on_smollm2(policy):
    cfg = load_config(None, [f"model.policy={policy}"])
    assert _values(cfg) == {k: v[1] for k, v in SIZED.items()}
    assert (cfg.trainer.policy_lr, cfg.trainer.critic_lr) == (1e-5, 5e-5)
    assert cfg.value_pretrain.curve is False and cfg.value_pretrain.rollouts == 32


def test_a_directory_is_sized_by_its_parameters(tmp_path):
    assert estimated_params(SMOLLM2) == 49152 * 576 + 30 * 12 * 576 * 576  # 147.7M: SmolLM2 has 134.5M
    assert estimated_params({"text_config": TINY_DIR}) == 512 * 128 + 4 * 12 * 128 * 128
    assert estimated_params({"model_type": "x"}) is None
    small, big = _dir(tmp_path, "sft-of-tiny", TINY_DIR), _dir(tmp_path, "smollm2", SMOLLM2)
    assert is_small(small) and not is_small(big)
    assert estimated_params(TINY_DIR) < SMALL_PARAMS < estimated_params(SMOLLM2)
    assert load_config(None, [f"model.policy={small}"]).trainer.policy_lr == 3e-5
    assert load_config(None, [f"model.policy={big}"]).trainer.policy_lr == 1e-5
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    assert not is_small(str(tmp_path / "broken"))  # unreadable: a pretrained model's safer rates
    assert estimated_params([1, 2]) is None and estimated_params({"text_config": {}, **TINY_DIR}) > 0
    (tmp_path / "broken" / "config.json").write_text("[1, 2]")
    assert not is_small(str(tmp_path / "broken"))


def test_a_value_set_by_hand_is_kept_and_a_saved_config_keeps_what_the_run_started_with():
    cfg = load_config(None, ["model.policy=smollm2-135m-instruct", "trainer.policy_lr=3e-5", "sft.steps=7",
                             "value_pretrain.curve=true"])
    assert (cfg.trainer.policy_lr, cfg.sft.steps, cfg.value_pretrain.curve) == (3e-5, 7, True)
    assert cfg.trainer.critic_lr == 5e-5  # the others still filled
    saved = config_to_dict(cfg)
    assert saved["trainer"]["critic_lr"] == 5e-5 and saved["run"]["eval_tasks"] == 64
    # the saved values are explicit: a resume trains with them whatever its policy now resolves to
    saved["model"]["policy"] = "tiny-moe"
    again = config_from_dict(saved)
    assert (again.trainer.policy_lr, again.trainer.critic_lr, again.run.eval_tasks) == (3e-5, 5e-5, 64)


def test_the_critics_rate_as_a_ratio_of_the_policys():
    cfg = load_config(None, ["model.policy=smollm2-135m-instruct", "trainer.critic_lr_ratio=5"])
    assert (cfg.trainer.policy_lr, cfg.trainer.critic_lr) == (1e-5, pytest.approx(5e-5))
    cfg = load_config(None, ["trainer.policy_lr=1e-6", "trainer.critic_lr_ratio=5"])
    assert cfg.trainer.critic_lr == pytest.approx(5e-6)
    data = config_to_dict(cfg)  # saved with the ratio alone: the rate follows the policy's on a reload
    assert data["trainer"]["critic_lr"] is None and data["trainer"]["critic_lr_ratio"] == 5
    assert config_from_dict(data).trainer.critic_lr == cfg.trainer.critic_lr
    data["trainer"]["policy_lr"] = 3e-6  # a resume or replay with another policy rate
    assert config_from_dict(data).trainer.critic_lr == pytest.approx(1.5e-5)
    with pytest.raises(ConfigError, match=r"trainer\.critic_lr_ratio: set with trainer\.critic_lr=0\.001"):
        load_config(None, ["trainer.critic_lr=1e-3", "trainer.critic_lr_ratio=5"])
