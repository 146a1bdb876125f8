"""``rollout.engine``: one typed section per kind, its knobs checked per kind, and the flat
spellings of before loading into it (CLI overrides, YAML files, saved run configs)."""

from __future__ import annotations

import warnings

import pytest
import yaml

from saorl.config import ConfigError, config_to_dict, load_config
from saorl.config.engines import (
    FLAT_SPELLINGS,
    HttpEngineConfig,
    LocalEngineConfig,
    SglangEngineConfig,
    VllmEngineConfig,
)

URL = "http://127.0.0.1:8000"


def _quiet(path=None, overrides=()):
    """The config, failing the test on any warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return load_config(path, list(overrides))


def _error(overrides) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(None, list(overrides))
    return str(e.value)


def test_each_kind_is_its_own_section_with_its_own_knobs():
    assert _quiet().rollout.engine == LocalEngineConfig()
    local = _quiet(overrides=["rollout.engine={kind: local, slots: 4, dtype: bfloat16, moe_top_k: 3}"])
    assert local.rollout.engine == LocalEngineConfig(slots=4, dtype="bfloat16", moe_top_k=3)
    vllm = _quiet(overrides=[f"rollout.engine={{kind: vllm, urls: [{URL}], model: policy, verify_every: 1}}"])
    assert vllm.rollout.engine == VllmEngineConfig(urls=[URL], model="policy", verify_every=1)
    sglang = _quiet(overrides=["rollout.engine=sglang", f"rollout.engine.urls=[{URL}]",
                               "rollout.engine.pause_mode=retract"])
    assert sglang.rollout.engine == SglangEngineConfig(urls=[URL], pause_mode="retract")
    # the trainer's own episodes (evaluations, value pretraining) use the local engine's defaults
    assert sglang.rollout.local_engine == LocalEngineConfig() and local.rollout.local_engine.slots == 4


def test_a_bare_kind_is_that_kind_with_its_defaults_and_drops_the_old_kinds_knobs(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("rollout:\n  engine: {kind: local, slots: 8, prefix_cache_tokens: 0}\n")
    cfg = _quiet(path, ["rollout.engine=http", f"rollout.engine.urls=[{URL}]"])
    assert cfg.rollout.engine == HttpEngineConfig(urls=[URL])
    assert _quiet(path, ["rollout.engine.slots=2"]).rollout.engine == LocalEngineConfig(slots=2,
                                                                                        prefix_cache_tokens=0)
    path.write_text("rollout:\n  engine: {slots: 8}\n")  # no kind: the local engine's section
    assert _quiet(path).rollout.engine == LocalEngineConfig(slots=8)


def test_a_knob_of_another_kind_is_an_error_naming_the_field_and_both_kinds():
    msg = _error([f"rollout.engine={{kind: vllm, urls: [{URL}], slots: 8}}"])
    assert ("rollout.engine.slots: not a knob of engine kind 'vllm', whose knobs are urls, routing, "
            "weight_update_timeout_s, verify_every, verify_tol, model; slots is a knob of kind local") in msg
    # switching the kind of a section that holds the old kind's knobs: the way out is named
    assert "give the kind alone, e.g. rollout.engine=vllm" in _error(
        ["rollout.engine.slots=8", "rollout.engine.kind=vllm", f"rollout.engine.urls=[{URL}]"])
    assert "rollout.engine.pause_mode: not a knob of engine kind 'vllm'" in _error(
        [f"rollout.engine={{kind: vllm, urls: [{URL}], pause_mode: abort}}"])
    assert "rollout.engine.model: not a knob of engine kind 'sglang'" in _error(
        [f"rollout.engine={{kind: sglang, urls: [{URL}], model: policy}}"])
    assert "rollout.engine.slot: unknown field (did you mean slots?)" in _error(["rollout.engine.slot=8"])
    assert ("rollout.engine.kind: unknown engine kind 'tgi'; the kinds are local, http, vllm, sglang"
            in _error(["rollout.engine=tgi"]))
    assert "rollout.engine.urls: required when kind is 'sglang'" in _error(["rollout.engine=sglang"])


# Each flat spelling of before, and the same setting as now spelled; the kind first where it matters.
PAIRS = [
    (["rollout.engine_slots=4"], ["rollout.engine.slots=4"]),
    (["rollout.prefix_cache_tokens=0"], ["rollout.engine.prefix_cache_tokens=0"]),
    (["rollout.prefix_after_update=recompute"], ["rollout.engine.prefix_after_update=recompute"]),
    (["rollout.dtype=bfloat16"], ["rollout.engine.dtype=bfloat16"]),
    (["rollout.moe_top_k=3", "rollout.router_noise=0.5"],
     ["rollout.engine.moe_top_k=3", "rollout.engine.router_noise=0.5"]),
    (["rollout.engine=http", f"rollout.http_url={URL}"],
     ["rollout.engine=http", f"rollout.engine.urls=[{URL}]"]),
    (["rollout.engine=http", f"rollout.engine_urls=[{URL}]", "rollout.engine_model=m"],
     [f"rollout.engine={{kind: http, urls: [{URL}], model: m}}"]),
    (["rollout.engine=vllm", f"rollout.engine_urls=[{URL}]", "rollout.engine_routing=round_robin",
      "rollout.engine_model=policy", "rollout.verify_every=1", "rollout.verify_tol=0.5",
      "rollout.weight_update_timeout_s=30"],
     [f"rollout.engine={{kind: vllm, urls: [{URL}], routing: round_robin, model: policy, verify_every: 1, "
      "verify_tol: 0.5, weight_update_timeout_s: 30}"]),
    # the flat knob before the kind, as a base config's overrides and then the run's put them
    ([f"rollout.engine_urls=[{URL}]", "rollout.sglang_pause_mode=in_place", "rollout.engine=sglang"],
     ["rollout.engine=sglang", f"rollout.engine.urls=[{URL}]", "rollout.engine.pause_mode=in_place"]),
]


@pytest.mark.parametrize(("old", "new"), PAIRS)
def test_each_flat_spelling_of_before_loads_to_the_same_config(old, new):
    assert config_to_dict(_quiet(overrides=old)) == config_to_dict(_quiet(overrides=new))


def test_every_flat_spelling_is_covered():
    assert {k.split("=")[0].removeprefix("rollout.") for old, _ in PAIRS for k in old} - {"engine"} \
        == set(FLAT_SPELLINGS)


def test_a_flat_yaml_file_and_a_saved_run_config_of_before_load_without_a_word(tmp_path):
    """A run directory written before holds every flat field (at its default unless set): --resume
    and saorl eval must load it as it was, silently."""
    old = {"num_workers": 1, "concurrent_episodes": 16, "engine_slots": 16, "prefix_cache_tokens": 65536,
           "prefix_after_update": "keep", "temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 48,
           "max_total_tokens": 384, "engine": "vllm", "http_url": None, "engine_urls": [URL],
           "engine_routing": "least_loaded", "engine_model": "policy", "sglang_pause_mode": "abort",
           "weight_update_timeout_s": 600.0, "verify_every": 1, "verify_tol": None, "dtype": None,
           "moe_top_k": None, "router_noise": 0.0}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"rollout": old}))
    assert _quiet(path).rollout.engine == VllmEngineConfig(urls=[URL], model="policy", verify_every=1)
    path.write_text(yaml.safe_dump({"rollout": old | {"engine": "local", "engine_urls": [],
                                                      "engine_model": None, "verify_every": 5,
                                                      "engine_slots": 8}}))
    assert _quiet(path).rollout.engine == LocalEngineConfig(slots=8)


def test_a_flat_knob_of_a_kind_not_in_use_is_dropped_with_a_warning_and_one_given_twice_fails():
    # before, the servers ignored the local engine's knobs (and the local engine the servers')
    ignored = (r"rollout.engine_slots=8 is ignored: rollout.engine is 'vllm', and its knobs are urls, .*"
               r"now spelled rollout.engine.slots, a knob of kind local")
    with pytest.warns(UserWarning, match=ignored):
        cfg = load_config(None, ["rollout.engine_slots=8", "rollout.engine=vllm",
                                 f"rollout.engine_urls=[{URL}]"])
    assert cfg.rollout.engine == VllmEngineConfig(urls=[URL])
    with pytest.warns(UserWarning, match=r"rollout.engine_model='m' is ignored: rollout.engine is 'local'"):
        assert load_config(None, ["rollout.engine_model=m"]).rollout.engine == LocalEngineConfig()
    msg = _error(["rollout.engine_slots=8", "rollout.engine.slots=9"])
    assert ("rollout.engine_slots: now spelled rollout.engine.slots, which is set too: "
            "rollout.engine.slots=9 and rollout.engine_slots=8; keep one") in msg


def test_the_saved_config_holds_the_section_and_loads_back(tmp_path):
    from saorl.config import save_resolved

    cfg = _quiet(overrides=[f"rollout.engine={{kind: sglang, urls: [{URL}], pause_mode: retract}}"])
    path = save_resolved(cfg, tmp_path)
    assert yaml.safe_load(path.read_text())["rollout"]["engine"] == {
        "kind": "sglang", "urls": [URL], "routing": "least_loaded", "weight_update_timeout_s": 600.0,
        "verify_every": 5, "verify_tol": None, "pause_mode": "retract"}
    assert _quiet(path) == cfg
