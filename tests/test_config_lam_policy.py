"""``algo.lam_policy``: one typed value, a number or ``{adaptive: {alpha: α}}``, from the YAML to
the estimator. The spellings configs and saved runs have (``adaptive``, ``vapo_alpha: α``) load into
it; a number switches a preset's adaptive rule off; a number and an α at once are refused."""

from __future__ import annotations

import pytest
import torch
import yaml

from saorl.algo.gae import length_adaptive_lambda
from saorl.algo.registry import AdaptiveLambda, get_preset
from saorl.config import ConfigError, config_to_yaml, load_config, save_resolved


def _resolve(*overrides: str):
    return load_config(None, list(overrides)).algo.preset


def test_adaptive_on_sao_is_the_paper_preset_under_another_name():
    p = _resolve("algo.name=sao", "algo.lam_policy=adaptive")
    assert p.lam_policy == AdaptiveLambda(alpha=1.5)
    assert p.with_overrides(name="sao_paper") == get_preset("sao_paper")


def test_adaptive_takes_this_sections_alpha_then_the_presets():
    both = _resolve("algo.name=sao", "algo.lam_policy=adaptive", "algo.vapo_alpha=3.0")
    assert both.lam_policy == AdaptiveLambda(alpha=3.0)
    assert _resolve("algo.name=sao", "algo.vapo_alpha=3.0").lam_policy == AdaptiveLambda(alpha=3.0)
    assert _resolve("algo.lam_policy={adaptive: {alpha: 2.5}}").lam_policy == AdaptiveLambda(alpha=2.5)
    # vapo has its own α (0.05): adaptive keeps it rather than the paper's 1.5
    vapo = _resolve("algo.name=vapo", "algo.lam_policy=adaptive", "trainer.batch_size=8")
    assert vapo.lam_policy == AdaptiveLambda(alpha=0.05)


def test_a_number_switches_a_presets_adaptive_rule_off():
    assert _resolve("algo.name=sao_paper", "algo.lam_policy=0.9").lam_policy == 0.9
    # and a plain preset keeps its number as before
    assert _resolve("algo.name=sao", "algo.lam_policy=1.0").lam_policy == 1.0


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


def test_the_saved_config_writes_the_rule_once_and_reloads_to_it(tmp_path):
    cfg = load_config(None, ["algo.lam_policy=adaptive"])
    path = save_resolved(cfg, tmp_path)
    text = path.read_text()
    assert "lam_policy:\n    adaptive:\n      alpha: 1.5\n" in text and "vapo_alpha" not in text
    assert load_config(path).algo.preset == cfg.algo.preset
    resolved = (tmp_path / "algo_resolved.yaml").read_text()
    assert "lam_policy:\n  adaptive:\n    alpha: 1.5\n" in resolved and "vapo_alpha" not in resolved


# the algo section's λ fields in a config.yaml as saorl wrote it before lam_policy was one typed value
OLD_SAVED = {  # (name, lam_policy, vapo_alpha) -> the run's λ_policy
    "sao_adaptive": (("sao", "adaptive", None), AdaptiveLambda(alpha=1.5)),
    "sao_alpha": (("sao", "adaptive", 3.0), AdaptiveLambda(alpha=3.0)),
    "paper": (("sao_paper", None, None), AdaptiveLambda(alpha=1.5)),
    "noisy_obs": (("sao", None, 0.05), AdaptiveLambda(alpha=0.05)),
    "number": (("sao_paper", 0.9, None), 0.9),
    "plain": (("sao", None, None), 0.95),
}


@pytest.mark.parametrize("case", sorted(OLD_SAVED))
def test_an_old_saved_config_still_loads_to_its_rule(tmp_path, case):
    algo, lam = OLD_SAVED[case]
    data = yaml.safe_load(config_to_yaml(load_config(None, [])))
    # every field, vapo_alpha among them, as a run's config.yaml held them
    data["algo"].update(zip(("name", "lam_policy", "vapo_alpha"), algo))
    old = tmp_path / "config.yaml"
    old.write_text(yaml.safe_dump(data, sort_keys=False))
    cfg = load_config(old)
    assert cfg.algo.preset.lam_policy == lam
    again = tmp_path / "again.yaml"  # what a resume saves of it loads back to the same preset
    again.write_text(config_to_yaml(cfg))
    assert "vapo_alpha" not in again.read_text()
    assert load_config(again).algo.preset == cfg.algo.preset


def test_the_rule_gives_the_hand_computed_lambdas():
    # rows with 2 and 4 action tokens (observation tokens do not count): 1 - 1/(1.5 l)
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 0, 1, 1, 1]], dtype=torch.bool)
    lam = length_adaptive_lambda(mask, _resolve("algo.lam_policy=adaptive").lam_policy.alpha)
    assert torch.allclose(lam, torch.tensor([1 - 1 / 3.0, 1 - 1 / 6.0]))


def test_the_printed_preset_says_adaptive(capsys):
    from saorl.cli import main as cli_main

    assert cli_main(["config", "algo.name=sao_paper", "--algo"]) == 0
    out = capsys.readouterr().out
    assert "#   lam_policy:\n#     adaptive:\n#       alpha: 1.5\n" in out and "vapo_alpha" not in out
    assert cli_main(["config", "--algo"]) == 0
    assert "#   lam_policy: 0.95" in capsys.readouterr().out
