"""Config tree: defaults, YAML presets, dotted overrides, one-paragraph errors, the CLI, round trip."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from saorl.algo.registry import get_preset
from saorl.cli import main as cli_main
from saorl.config import (
    ConfigError,
    SaorlConfig,
    apply_overrides,
    config_to_dict,
    load_config,
    parse_override,
    save_resolved,
)
from saorl.config.engines import LocalEngineConfig

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _error(path: Path | None, overrides: list[str] = ()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    msg = str(info.value)
    assert "\n" not in msg, f"not one paragraph: {msg!r}"
    return msg


# ----------------------------------------------------------------------------- defaults and presets
def test_defaults_match_the_brief():
    cfg = load_config(None)
    assert cfg == SaorlConfig()
    assert (cfg.seed, cfg.run.name, cfg.run.eval_every, cfg.model.policy, cfg.model.device) == (
        0, "sao-math_tool", 25, "tiny-moe", "cpu")
    assert (cfg.env.type, cfg.rollout.max_new_tokens, cfg.rollout.max_total_tokens) == ("math_tool", 48, 384)
    assert (cfg.trainer.batch_size, cfg.trainer.policy_lr, cfg.runtime.mode) == (4, 3e-5, "auto")
    assert cfg.resolved_mode() == "async"
    assert cfg.algo.preset == get_preset("sao")


def test_every_field_is_documented():
    def walk(model: type[BaseModel], prefix: str):
        for name, info in model.model_fields.items():
            assert info.description and info.description.strip(), f"{prefix}{name} has no docstring"
            if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
                yield from walk(info.annotation, f"{prefix}{name}.")
            yield prefix + name

    assert len(list(walk(SaorlConfig, ""))) > 50


def test_main_preset_equals_embedded_defaults():
    assert load_config(CONFIGS / "sao_math_tool.yaml") == load_config(None)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_preset_file_loads_and_builds_its_env(path):
    from saorl.envs.registry import make_env_factory

    cfg = load_config(path)
    preset = cfg.algo.preset
    assert cfg.trainer.batch_size % preset.group_size == 0
    assert cfg.algo.name.split("_")[0] in path.stem  # sao_paper: a sao_* file
    make_env_factory(cfg.env.type, cfg.env.options)()  # options accepted by the env class


def test_group_presets_run_sync_and_sao_on_code_uses_the_code_band():
    assert load_config(CONFIGS / "grpo_math_tool.yaml").resolved_mode() == "sync"
    code = load_config(CONFIGS / "sao_code_repair.yaml").algo.preset
    assert (code.eps_low, code.eps_high, code.critic_updates) == (0.8, 3.0, 2)


# ----------------------------------------------------------------------------- overrides
@pytest.mark.parametrize(
    ("item", "value"),
    [("a.b=1", 1), ("a=1.5", 1.5), ("a=true", True), ("a=null", None), ("a=", None), ("a=[1, x]", [1, "x"]),
     ("a={k: 2}", {"k": 2}), ("a='3'", "3"), ("a=hello world", "hello world"), ("a=x=y", "x=y")],
)
def test_parse_override_uses_yaml_rules(item, value):
    assert parse_override(item)[1] == value
    assert parse_override(item)[0] == item.partition("=")[0].split(".")


def test_apply_overrides_nested_null_and_lists_without_mutating_input():
    base = {"model": {"critic": "dir"}, "env": {"type": "style_shift"}}
    out = apply_overrides(base, ["model.critic=null", "env.options.schedule=[plain, shout]",
                                 "env.options.switch_every=7", "algo.eps_high=3.0"])
    assert out == {"model": {"critic": None}, "algo": {"eps_high": 3.0},
                   "env": {"type": "style_shift",
                           "options": {"schedule": ["plain", "shout"], "switch_every": 7}}}
    assert base == {"model": {"critic": "dir"}, "env": {"type": "style_shift"}}


def test_overrides_reach_the_model_and_the_resolved_preset():
    cfg = load_config(CONFIGS / "sao_math_tool.yaml",
                      ["algo.eps_high=3.0", "trainer.policy_lr=1e-3", "env.options.difficulty=2",
                       "model.critic=null", "runtime.mode=sync", "seed=7"])
    assert cfg.trainer.policy_lr == pytest.approx(1e-3)  # YAML 1.1 reads 1e-3 as a string; still a float here
    assert cfg.env.options == {"difficulty": 2} and cfg.seed == 7 and cfg.resolved_mode() == "sync"
    preset = cfg.algo.preset
    assert preset.eps_high == 3.0
    assert preset.with_overrides(eps_high=5.0) == get_preset("sao")


@pytest.mark.parametrize(
    ("override", "expected"),
    [("algo.eps_hihg=3", "algo.eps_hihg: unknown field (did you mean eps_high?)"),
     ("traner.steps=3", "traner: unknown field (did you mean trainer?)"),
     ("seed.x=1", "seed is a value, not a section"),
     ("trainer", "expected 'section.field=value'")],
)
def test_bad_override_paths_fail_naming_the_override(override, expected):
    msg = _error(None, [override])
    assert expected in msg and override in msg


# ----------------------------------------------------------------------------- errors at load
@pytest.mark.parametrize(
    ("text", "expected"),
    [("algo:\n  eps_hihg: 3.0\n", "algo.eps_hihg: unknown field (did you mean eps_high?)"),
     ("trainer:\n  policy_lr: -1.0\n", "trainer.policy_lr: Input should be greater than 0 (got -1.0)"),
     ("algo:\n  eps_low: 1.0\n", "algo.eps_low: Input should be less than 1 (got 1.0)"),
     ("trainer:\n  steps: many\n", "trainer.steps: Input should be a valid integer"),
     ("rollout:\n  top_p: 0\n", "rollout.top_p: Input should be greater than 0"),
     ("algo:\n  lam_policy: 1.5\n",
      "algo.lam_policy: must be in [0, 1] (or {adaptive: {alpha: α}}), got 1.5"),
     ("algo:\n  lam_policy: {adaptive: {alpha: 0}}\n",
      "algo.lam_policy.adaptive.alpha: Input should be greater than 0"),
     ("algo:\n  critic_updates: 0\n", "algo.critic_updates: algorithm 'sao': must be >= 1 when use_critic"),
     ("algo:\n  eps_high: .inf\n", "algo.eps_high: Input should be a finite number (got inf)"),
     ("algo:\n  name: grop\n", "algo.name: unknown algorithm 'grop' (did you mean grpo?)"),
     ("algo:\n  name: grpo\n", "trainer.batch_size: 4 is not a multiple of the group size (8"),
     ("algo:\n  name: grpo\n  group_size: 1\ntrainer:\n  batch_size: 8\n",
      "algo.group_size: algorithm 'grpo'"),
     ("rollout:\n  engine: http\n", "rollout.engine.urls: required when kind is 'http'"),
     ("rollout:\n  engine: vllm\n", "rollout.engine.urls: required when kind is 'vllm'"),
     ("rollout:\n  engine: {kind: sglang, urls: [gpu1:8000]}\n",
      "rollout.engine.urls: each URL must look like http://host:port, got ['gpu1:8000']"),
     ("rollout:\n  engine: tgi\n",
      "rollout.engine.kind: unknown engine kind 'tgi'; the kinds are local, http, vllm, sglang"),
     ("rollout:\n  engine: {kind: vllm, urls: ['http://a:1'], weight_update_timeout_s: 0}\n",
      "rollout.engine.weight_update_timeout_s: Input should be greater"),
     ("env:\n  type: mathtool\n", "env.type: unknown env 'mathtool'"),
     ("run:\n  name: a/b\n", "run.name: must be a non-empty name"),
     ("model:\n  dtype: float64\n", "model.dtype: Input should be 'float32', 'bfloat16' or 'float16'"),
     ("model:\n  dtype: float16\n", "model.dtype: float16 needs model.device=cuda or mps"),
     ("runtime: 3\n", "runtime: Input should be a valid dictionary"),
     ("seeed: 1\n", "seeed: unknown field (did you mean seed?)")],
)
def test_bad_values_fail_at_load_naming_file_and_field(tmp_path, text, expected):
    path = _write(tmp_path, text)
    msg = _error(path)
    assert msg.startswith(f"config error in {path}: ")
    assert expected in msg


@pytest.mark.parametrize("engine", ["local", "http", "vllm", "sglang"])
@pytest.mark.parametrize("shard", ["none", "fsdp2"])
def test_routing_replay_is_allowed_with_every_engine_and_either_trainer(engine, shard):
    urls = [] if engine == "local" else ["rollout.engine.urls=[http://127.0.0.1:8000]"]
    cfg = load_config(None, [f"rollout.engine={engine}", *urls, "algo.routing_replay=true",
                             f"trainer.shard={shard}"])
    assert cfg.algo.preset.routing_replay and cfg.rollout.engine.kind == engine
    assert cfg.trainer.shard == shard


def test_several_errors_are_joined_into_one_paragraph(tmp_path):
    msg = _error(_write(tmp_path, "trainer:\n  policy_lr: 0\n  critic_lr: -2\n"))
    assert "trainer.policy_lr:" in msg and "trainer.critic_lr:" in msg and "; " in msg


@pytest.mark.parametrize(
    ("text", "expected"),
    [("trainer:\n  steps: 3\n   bad: [\n", "YAML syntax error at line 3"),
     ("trainer:\n  steps: 3\ntrainer:\n  steps: 4\n", "duplicate key 'trainer' (first on line 1)"),
     ("- a\n- b\n", "the top level must be a mapping of sections, got list")],
)
def test_yaml_problems_name_the_line(tmp_path, text, expected):
    msg = _error(_write(tmp_path, text))
    assert expected in msg and str(tmp_path) in msg


def test_missing_file_and_empty_file(tmp_path):
    assert "file not found" in _error(tmp_path / "nope.yaml")
    assert load_config(_write(tmp_path, "# only a comment\n")) == SaorlConfig()


# ----------------------------------------------------------------------------- CLI
def test_cli_prints_loadable_yaml(tmp_path, capsys):
    rc = cli_main(["config", str(CONFIGS / "grpo_math_tool.yaml"), "algo.eps_high=0.28", "seed=3"])
    out = capsys.readouterr().out
    assert rc == 0
    data = yaml.safe_load(out)
    assert data["algo"]["name"] == "grpo" and data["algo"]["eps_high"] == 0.28 and data["seed"] == 3
    assert load_config(_write(tmp_path, out)) == load_config(CONFIGS / "grpo_math_tool.yaml",
                                                             ["algo.eps_high=0.28", "seed=3"])


def test_cli_overrides_without_a_file_and_resolved_algo(capsys):
    assert cli_main(["config", "algo.eps_high=3.0", "--algo"]) == 0
    out = capsys.readouterr().out
    assert yaml.safe_load(out)["algo"]["eps_high"] == 3.0
    assert "#   eps_high: 3.0" in out and "#   critic_updates: 2" in out


def test_cli_bad_config_returns_2_with_one_paragraph(tmp_path, capsys):
    path = _write(tmp_path, "trainer:\n  policy_lr: -1.0\n")
    assert cli_main(["config", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert err == f"config error in {path}: trainer.policy_lr: Input should be greater than 0 (got -1.0)"


# ----------------------------------------------------------------------------- round trip
def test_save_resolved_round_trips(tmp_path):
    cfg = load_config(CONFIGS / "sao_style_shift.yaml",
                      ["algo.eps_high=3.0", "env.options.schedule=[plain, shout]", "trainer.max_wall_s=60"])
    path = save_resolved(cfg, tmp_path / "run")
    assert path == tmp_path / "run" / "config.yaml"
    again = load_config(path)
    assert again == cfg and config_to_dict(again) == config_to_dict(cfg)
    algo = yaml.safe_load((tmp_path / "run" / "algo_resolved.yaml").read_text())
    assert algo == cfg.algo.preset.model_dump(mode="json")
    assert algo["eps_high"] == 3.0 and algo["name"] == "sao"
    assert not list((tmp_path / "run").glob("*.tmp"))


def test_overrides_after_a_commands_options_are_accepted():
    from saorl.cli import build_parser, parse

    parser = build_parser()
    args = parse(parser, ["experiment", "math", "a.b=1", "--quick", "run.progress=false", "--seeds", "1"])
    assert args.quick and args.seeds == 1 and args.overrides == ["a.b=1", "run.progress=false"]
    with pytest.raises(SystemExit):  # anything else left over is still an error
        parse(parser, ["experiment", "math", "--quick", "--no-such-flag"])
    with pytest.raises(SystemExit):
        parse(parser, ["experiment", "math", "--quick", "stray"])


def test_absolute_paths_cover_env_dataset(tmp_path, monkeypatch):
    from saorl.config import absolute_paths

    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["env.dataset.path=data/gsm8k", "env.dataset.test_split=null"])
    out = absolute_paths(cfg)
    assert out.env.dataset.path == str(tmp_path / "data" / "gsm8k") and out.env.dataset.test_split is None
    assert cfg.env.dataset.path == "data/gsm8k"  # a copy: the original is unchanged
    assert absolute_paths(load_config(None, [])).env.dataset is None


@pytest.mark.parametrize("item, field", [
    ("trainer.policy_lr=.inf", "trainer.policy_lr"), ("trainer.critic_lr=.nan", "trainer.critic_lr"),
    ("trainer.grad_clip=.inf", "trainer.grad_clip"), ("run.eval_temperature=.nan", "run.eval_temperature"),
    ("rollout.top_p=.nan", "rollout.top_p"), ("trainer.max_wall_s=.inf", "trainer.max_wall_s"),
])
def test_non_finite_floats_fail_at_load(item, field):
    msg = _error(None, [item])
    assert f"{field}: Input should be a finite number" in msg


def test_a_huge_but_finite_learning_rate_loads_and_the_skip_limit_is_a_setting():
    cfg = load_config(None, ["trainer.policy_lr=1e6", "trainer.max_nonfinite_skips=5"])
    assert cfg.trainer.policy_lr == 1e6 and cfg.trainer.max_nonfinite_skips == 5
    assert "trainer.max_nonfinite_skips" in _error(None, ["trainer.max_nonfinite_skips=0"])


def test_a_renamed_field_is_named_in_overrides_and_dropped_from_saved_run_configs(tmp_path):
    """``rollout.logprob_probe_tol`` became ``rollout.engine.verify_tol`` (a max gap, not a mean): an
    override says so; every run directory written before holds it (0.1), and must still load for
    --resume and saorl eval; a value the user changed is dropped with a warning."""
    import warnings

    with pytest.raises(ConfigError, match=r"logprob_probe_tol: now spelled rollout.engine.verify_tol"):
        load_config(None, ["rollout.logprob_probe_tol=0.2"])
    old = tmp_path / "config.yaml"
    old.write_text("rollout:\n  logprob_probe_tol: 0.1\n  temperature: 0.8\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the old default: dropped without a word
        cfg = load_config(old)
    assert cfg.rollout.temperature == 0.8 and cfg.rollout.engine == LocalEngineConfig()
    old.write_text("rollout:\n  logprob_probe_tol: 0.3\n")
    with pytest.warns(UserWarning, match=r"probe_tol=0.3 is ignored: now spelled rollout.engine.verify_tol"):
        load_config(old)
