"""``algo.lam_policy: adaptive``: the length-adaptive λ_policy spelled in the config, for any preset
with GAE; a number switches a preset's adaptive rule off; both spellings at once are refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from saorl.algo.gae import length_adaptive_lambda
from saorl.algo.registry import get_preset
from saorl.config import ConfigError, load_config, save_resolved


def _resolve(*overrides: str):
    return load_config(None, list(overrides)).algo.resolve()


def test_adaptive_on_sao_is_the_paper_preset_under_another_name():
    p = _resolve("algo.name=sao", "algo.lam_policy=adaptive")
    assert p.vapo_alpha == 1.5
    paper = get_preset("sao_paper")
    assert dataclasses.replace(p, name="sao_paper") == paper


def test_adaptive_takes_this_sections_alpha_then_the_presets():
    assert _resolve("algo.name=sao", "algo.lam_policy=adaptive", "algo.vapo_alpha=3.0").vapo_alpha == 3.0
    # vapo has its own α (0.05): adaptive keeps it rather than the paper's 1.5
    vapo = _resolve("algo.name=vapo", "algo.lam_policy=adaptive", "trainer.batch_size=8")
    assert vapo.vapo_alpha == 0.05


def test_a_number_switches_a_presets_adaptive_rule_off():
    p = _resolve("algo.name=sao_paper", "algo.lam_policy=0.9")
    assert (p.lam_policy, p.vapo_alpha) == (0.9, None)
    # and a plain preset keeps its number as before
    q = _resolve("algo.name=sao", "algo.lam_policy=1.0")
    assert (q.lam_policy, q.vapo_alpha) == (1.0, None)


def test_a_number_and_an_alpha_together_are_refused_in_one_paragraph():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["algo.lam_policy=0.9", "algo.vapo_alpha=2.0"])
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.count("algo.lam_policy") >= 1 and "algo.vapo_alpha" in msg and "adaptive" in msg


def test_adaptive_without_gae_is_refused():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["algo.name=grpo", "algo.lam_policy=adaptive", "trainer.batch_size=8"])
    assert "algo.lam_policy" in str(info.value) and "'grpo'" in str(info.value)


@pytest.mark.parametrize("bad", ["adaptve", "1.5", "-0.1"])
def test_a_bad_lam_policy_names_the_field(bad):
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"algo.lam_policy={bad}"])
    assert "algo.lam_policy" in str(info.value)


def test_the_saved_config_reloads_to_the_same_rule(tmp_path):
    cfg = load_config(None, ["algo.lam_policy=adaptive"])
    path = save_resolved(cfg, tmp_path)
    assert "lam_policy: adaptive" in path.read_text()
    again = load_config(path)
    assert again.algo.resolve() == cfg.algo.resolve()


def test_the_rule_gives_the_hand_computed_lambdas():
    # rows with 2 and 4 action tokens (observation tokens do not count): 1 - 1/(1.5 l)
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 0, 1, 1, 1]], dtype=torch.bool)
    lam = length_adaptive_lambda(mask, _resolve("algo.lam_policy=adaptive").vapo_alpha)
    assert torch.allclose(lam, torch.tensor([1 - 1 / 3.0, 1 - 1 / 6.0]))


def test_the_printed_preset_says_adaptive(capsys):
    from saorl.cli import main as cli_main

    assert cli_main(["config", "algo.name=sao_paper", "--algo"]) == 0
    out = capsys.readouterr().out
    assert "#   lam_policy: adaptive" in out and "#   vapo_alpha: 1.5" in out
    assert cli_main(["config", "--algo"]) == 0
    assert "#   lam_policy: 0.95" in capsys.readouterr().out
