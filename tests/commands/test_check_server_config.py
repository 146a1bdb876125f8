"""Which servers ``saorl check-server`` checks: the kind and URLs from the flags or the config, with
the config's knobs of that kind (no server is contacted here)."""

import pytest

from saorl.commands.check_server import _servers_config
from saorl.config.engines import SglangEngineConfig, VllmEngineConfig

A, B = "http://127.0.0.1:8000", "http://127.0.0.1:8001"


@pytest.mark.parametrize("model", ["rollout.engine.model=policy", "rollout.engine_model=policy"])
def test_urls_on_the_command_line_check_vllm_servers_with_the_knobs_given(model):
    """The default config's engine is local: the servers are vLLM's, and a knob of vLLM's section
    given as now spelled or as before reaches them."""
    cfg = _servers_config(None, ["model.policy=tiny-dense", model], [A], None)
    assert cfg.rollout.engine == VllmEngineConfig(urls=[A], model="policy")
    assert cfg.model.policy == "tiny-dense"
    assert _servers_config(None, [], [A, B], "sglang").rollout.engine == SglangEngineConfig(urls=[A, B])


def test_the_configs_servers_and_their_knobs_are_kept_and_urls_given_replace_theirs(tmp_path):
    path = tmp_path / "run.yaml"
    section = f"{{kind: sglang, urls: ['{A}'], pause_mode: retract, verify_tol: 0.5}}"
    path.write_text(f"rollout:\n  engine: {section}\n")
    kept = SglangEngineConfig(urls=[A], pause_mode="retract", verify_tol=0.5)
    assert _servers_config(str(path), [], None, None).rollout.engine == kept
    assert _servers_config(str(path), [], [B], None).rollout.engine == kept.model_copy(update={"urls": [B]})
    # another kind asked for: the knobs both kinds have come along
    as_vllm = _servers_config(str(path), [], None, "vllm").rollout.engine
    assert as_vllm == VllmEngineConfig(urls=[A], verify_tol=0.5)


def test_no_server_to_check_is_one_paragraph(capsys):
    with pytest.raises(SystemExit) as e:
        _servers_config(None, [], None, None)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "no server to check: give --url http://HOST:PORT or rollout.engine.urls=" in err


@pytest.mark.parametrize("kind", ["local", "http", "vlm"])
def test_a_kind_not_updated_in_place_is_refused_naming_the_ones_that_are(capsys, kind):
    with pytest.raises(SystemExit) as e:
        _servers_config(None, [], [A], kind)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"--engine must be one of vllm, sglang (servers the trainer updates in place), got {kind!r}" in err
