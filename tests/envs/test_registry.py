import importlib.util
import json

import pytest

from saorl.envs import BUILTIN_ENVS, Env, load_tasks, make_env_factory, resolve_env
from saorl.envs.math_tool import MathToolEnv
from saorl.envs.registry import EnvResolveError, MissingExtra
from saorl.envs.style_shift import StyleShiftEnv


def test_builtin_names_and_paths_resolve():
    assert set(BUILTIN_ENVS) == {"math_tool", "math_levels", "noisy_lookup", "code_repair", "style_shift",
                                 "synthetic", "prompt_reward", "openai_agent", "reasoning_gym", "textarena",
                                 "openenv", "bfcl", "mix"}
    assert resolve_env("math_tool") is MathToolEnv
    assert resolve_env("style_shift") is StyleShiftEnv
    assert resolve_env("saorl.envs.style_shift:StyleShiftEnv") is StyleShiftEnv
    for name in BUILTIN_ENVS:
        try:
            assert resolve_env(name).name == name
        except MissingExtra:  # a community env without its package (tests/envs/test_extras.py)
            pass


def test_code_repair_resolves_when_present():
    if importlib.util.find_spec("saorl.envs.code_repair") is None:
        pytest.skip("code_repair not written yet")
    cls = resolve_env("code_repair")
    assert issubclass(cls, Env) and cls.name == "code_repair"


@pytest.mark.parametrize("type_str, message", [
    ("mathtool", "not a built-in (bfcl, code_repair, math_levels, math_tool, mix, noisy_lookup, "
                 "openai_agent, openenv, prompt_reward, reasoning_gym, style_shift, synthetic, textarena)"),
    ("no_such_module_xyz:Foo", "no module named 'no_such_module_xyz'"),
    ("saorl.envs.base:Nope", "has no attribute 'Nope'"),
    ("saorl.envs.base:Task", "not a subclass of saorl.envs.base.Env"),
    ("", "non-empty string"),
])
def test_resolve_errors_are_clear(type_str, message):
    with pytest.raises(EnvResolveError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_env(type_str)


def test_factory_builds_fresh_configured_envs():
    factory = make_env_factory("math_tool", {"family": "countdown", "difficulty": 2})
    a, b = factory(), factory()
    assert a is not b and isinstance(a, MathToolEnv)
    assert (a.family, a.difficulty) == ("countdown", 2)
    assert make_env_factory("style_shift")().switch_every == 100


def test_factory_rejects_bad_options_by_name():
    with pytest.raises(ValueError, match="bogus"):
        make_env_factory("math_tool", {"bogus": 1})
    with pytest.raises(ValueError, match="difficulty"):
        make_env_factory("math_tool", {"difficulty": 7})
    with pytest.raises(ValueError, match="schedule"):
        make_env_factory("style_shift", {"schedule": ["loud"]})


def test_load_tasks_from_generator():
    env = MathToolEnv()
    assert load_tasks(env, "test", 5, 1) == env.generate_tasks("test", 5, 1)
    with pytest.raises(ValueError, match="split"):
        load_tasks(env, "valid", 5, 1)
    with pytest.raises(ValueError, match="n must be"):
        load_tasks(env, "train", None, 1)


def test_load_tasks_from_jsonl(tmp_path):
    pytest.importorskip("saorl.data.tasks")
    tasks = MathToolEnv().generate_tasks("test", 4, 0)
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps({"id": t.id, "data": t.data}) + "\n" for t in tasks))
    got = load_tasks(MathToolEnv(), "test", 3, 0, tasks_file=path)
    assert [t.id for t in got] == [t.id for t in tasks[:3]]
    assert got[0].data == tasks[0].data
    assert len(load_tasks(MathToolEnv(), "test", None, 0, tasks_file=str(path))) == 4


def test_factory_sets_the_runs_observation_format_on_every_env():
    plain = make_env_factory("math_tool")
    assert plain.observation == ("text", "tool") and plain().observation_format == "text"
    chat = make_env_factory("math_tool", observation_format="chat", observation_role="user")
    env = chat()
    assert chat.observation == ("chat", "user")
    assert (env.observation_format, env.observation_role) == ("chat", "user")
    assert MathToolEnv.observation_format == "text"  # the class is untouched
    with pytest.raises(EnvResolveError, match=r"observation_role must be one of \['tool', 'user'\], "
                                              r"got 'bot'"):
        make_env_factory("math_tool", observation_role="bot")
