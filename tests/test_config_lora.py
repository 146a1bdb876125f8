"""The ``model.lora`` section: off by default, its rules, and what LoRA refuses at load (before
torch), each as one paragraph naming the field and the fix."""

from __future__ import annotations

import importlib.util

import pytest

from saorl.config import ConfigError, load_config
from saorl.config.sections import LORA_TARGETS

needs_peft = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="model.lora needs peft")


def _error(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    msg = str(info.value)
    assert "\n" not in msg, f"not one paragraph: {msg!r}"
    return msg


@needs_peft
def test_lora_is_off_by_default_and_rank_turns_it_on():
    off = load_config(None, [])
    assert off.model.lora.rank is None and not off.model.lora.enabled
    on = load_config(None, ["model.lora.rank=8", "model.lora.target_modules=[q_proj, v_proj, q_proj]"])
    assert on.model.lora.enabled and on.model.lora.alpha == 16.0 and on.model.lora.dropout == 0.0
    assert on.model.lora.target_modules == ["q_proj", "v_proj"]
    assert load_config(None, ["model.lora.rank=4"]).model.lora.target_modules == list(LORA_TARGETS)


@needs_peft
@pytest.mark.parametrize(("override", "expected"), [
    ("model.lora.rank=0", "model.lora.rank: Input should be greater than or equal to 1"),
    ("model.lora.alpha=0", "model.lora.alpha: Input should be greater than 0"),
    ("model.lora.dropout=1.0", "model.lora.dropout: Input should be less than 1"),
    ("model.lora.target_modules=[]", "model.lora.target_modules: must name at least one module"),
    ("model.lora.target_modules=[self_attn.q_proj]", "each entry is a module's name (its last component"),
    ("model.lora.ranks=8", "model.lora.ranks: unknown field (did you mean rank?)"),
])
def test_bad_lora_values_fail_at_load(override, expected):
    assert expected in _error([override])


@needs_peft
@pytest.mark.parametrize(("overrides", "expected"), [
    (["trainer.shard=fsdp2"], "the sharded trainer (trainer.shard=fsdp2) does not shard or publish adapters"),
    (["rollout.engine=http", "rollout.engine.urls=[http://127.0.0.1:8000]"], "rollout.engine=http servers"),
])
def test_what_lora_does_not_reach_yet_is_refused_naming_the_fix(overrides, expected):
    msg = _error(["model.lora.rank=8", *overrides])
    assert "model.lora.rank: " in msg and expected in msg
    load_config(None, overrides)  # without LoRA the same settings load


@needs_peft
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_lora_loads_with_vllm_and_sglang_servers(engine):
    cfg = load_config(None, ["model.lora.rank=8", f"rollout.engine={engine}",
                             "rollout.engine.urls=[http://127.0.0.1:8000]"])
    assert cfg.model.lora.rank == 8 and cfg.rollout.engine.kind == engine


@needs_peft
def test_a_lora_critic_needs_the_rank_and_loads_with_it():
    msg = _error(["model.lora.critic=true"])
    assert "model.lora.critic: a LoRA critic takes its adapter's settings from model.lora: set " \
           "model.lora.rank too" in msg
    assert load_config(None, ["model.lora.rank=8", "model.lora.critic=true"]).model.lora.critic


@needs_peft
@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="runtime.backend=ray needs ray")
def test_ray_object_store_weights_are_refused_with_lora():
    msg = _error(["model.lora.rank=8", "runtime.backend=ray", "ray.weights=object_store"])
    assert "ray.weights=object_store carries full weights only: set ray.weights=shared_fs" in msg


def test_without_peft_installed_the_config_says_how_to_install_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "peft" else real(name, *a))
    msg = _error(["model.lora.rank=8"])
    assert "LoRA needs the peft package: pip install 'saorl[lora]'" in msg


@needs_peft
def test_an_unknown_target_stops_the_start_naming_the_modules_the_policy_has():
    from saorl.errors import StartupError
    from saorl.stages.preflight import check_models

    cfg = load_config(None, ["model.lora.rank=8", "model.lora.target_modules=[q_proj, w_in]",
                             "model.policy=tiny-dense"])
    with pytest.raises(StartupError) as e:
        check_models(cfg.model, use_critic=True)
    assert str(e.value) == ("model.lora.target_modules: w_in names no nn.Linear module of the policy "
                            "(Qwen3ForCausalLM), whose linear modules are named down_proj, gate_proj, "
                            "k_proj, lm_head, o_proj, q_proj, up_proj, v_proj; list some of those")
    check_models(load_config(None, ["model.lora.rank=8"]).model, use_critic=True)  # defaults fit tiny-moe
