"""``mix`` (``env.mix``): tasks by weight, each played by its part, metrics and accuracy per part."""

from __future__ import annotations

import random

import pytest

from saorl.config import ConfigError, config_from_dict
from saorl.data.trajectory import Episode, Trajectory
from saorl.envs.base import Task
from saorl.envs.mix import MixEnv, _allocate
from saorl.envs.registry import env_factory_for
from saorl.stages.evaluate import group_metrics

PARTS = [{"type": "math_tool", "weight": 3.0, "options": {"family": "arith", "max_turns": 2}},
         {"type": "math_levels", "name": "levels", "weight": 1.0}]


def _mix():
    return env_factory_for(config_from_dict({"env": {"mix": PARTS}}).env)


def test_train_tasks_are_drawn_by_weight_and_are_each_parts_own():
    factory = _mix()
    tasks = factory().generate_tasks("train", 400, seed=0)
    assert tasks == factory().generate_tasks("train", 400, seed=0)
    by_part = [MixEnv.task_group(t) for t in tasks]
    assert 250 <= by_part.count("math_tool") <= 350
    assert by_part.count("levels") == 400 - by_part.count("math_tool")
    own = factory().parts["math_tool"]().generate_tasks("train", by_part.count("math_tool"), 0)
    mine = [t for t in tasks if t.id.startswith("math_tool/")]
    assert [t.id for t in mine] == [f"math_tool/{t.id}" for t in own]
    assert [t.data for t in mine] == [{"env": "math_tool", "task": t.data} for t in own]
    test = factory().generate_tasks("test", 40, seed=0)
    assert not {t.id for t in tasks} & {t.id for t in test}


def test_test_tasks_are_split_by_weight_and_interleaved():
    assert _allocate(8, [3, 1]) == [6, 2] and _allocate(2, [9, 1]) == [1, 1]
    assert _allocate(1, [1, 1, 1]) == [1, 0, 0]
    tasks = _mix()().generate_tasks("test", 8, seed=0)
    assert [MixEnv.task_group(t) for t in tasks][:4] == ["math_tool", "levels", "math_tool", "levels"]
    assert [MixEnv.task_group(t) for t in tasks].count("levels") == 2


def test_an_episode_is_its_parts_with_metrics_under_its_name():
    factory = _mix()
    task = next(t for t in factory().generate_tasks("train", 20, 0) if t.id.startswith("math_tool/"))
    env = factory()
    prompt = env.reset(task)
    inner = factory().parts["math_tool"]()
    assert prompt == inner.reset(Task(task.id[len("math_tool/"):], task.data["task"]))
    assert env.max_turns == 2 and env.stop_strings == inner.stop_strings
    answer = inner.demonstration(Task(task.id[len("math_tool/"):], task.data["task"]), random.Random(0))[-1]
    out = env.step(answer)
    assert out.done and out.reward > 0 and out.info["success"]
    metrics = out.info["metrics"]
    assert metrics["math_tool/success"] == 1.0 and metrics["math_tool/reward"] == out.reward


def test_with_tools_a_mix_keeps_the_tool_turn_limit_after_reset():
    factory = env_factory_for(config_from_dict({"env": {
        "mix": PARTS, "tools": ["tests.agent.tool_fns:add"], "tool_max_turns": 4}}).env)
    env = factory()
    assert env.toolbox is not None and env.max_turns == 4
    task = next(t for t in factory().generate_tasks("train", 20, 0) if t.id.startswith("math_tool/"))
    env.reset(task)  # its part's own max_turns is 2
    assert env.max_turns == 4


def test_per_part_accuracy_counts_failed_episodes():
    tasks = [Task(f"{p}/t{i}", {"env": p, "task": {}}) for i, p in enumerate(["a", "b", "a", "b"])]
    done = {i: Trajectory([1, 2], [0, 1], [0.0, -1.0], [0.0, r], [0, 0], 1, tasks[i].id,
                          episode=Episode(success=r > 0)) for i, r in ((0, 1.0), (1, 0.0), (2, 0.0))}
    out = group_metrics(tasks, done, {3}, MixEnv.task_group)
    assert out == {"eval/a/accuracy": 0.5, "eval/a/reward_mean": 0.5, "eval/a/episodes": 2.0,
                   "eval/b/accuracy": 0.0, "eval/b/reward_mean": 0.0, "eval/b/episodes": 2.0}


@pytest.mark.parametrize(("env", "message"), [
    ({"type": "math_tool", "mix": PARTS}, "env.mix plays several envs, so env.type cannot be 'math_tool'"),
    ({"mix": PARTS, "options": {"difficulty": 2}}, "leave env.options empty"),
    ({"mix": PARTS, "tasks_file": "x.jsonl"}, "a mix draws its tasks from each env's generator"),
    ({"type": "mix"}, "env.type mix needs env.mix"),
    ({"mix": [{"type": "math_tool", "weight": 0}]}, "weight"),
    ({"mix": [{"type": "math_tool", "name": "env"}]}, "'env' is taken by the env metrics"),
    ({"mix": [{"type": "math_tool", "name": "a/b"}]}, "must be letters, digits"),
])
def test_bad_mixes_fail_at_load(env, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict({"env": env})


def test_bad_parts_are_named_by_index():
    for parts, message in (
            ([{"type": "math_tool"}, {"type": "math_tool"}], r"env.mix\[1\] \(math_tool\): the name"),
            ([{"type": "prompt_reward"}], r"env.mix\[0\] \(prompt_reward\): a prompt_reward env"),
            ([{"type": "math_tool", "options": {"family": "x"}}], r"env.mix\[0\] \(math_tool\):")):
        with pytest.raises(ValueError, match=message):
            env_factory_for(config_from_dict({"env": {"mix": parts}}).env)


def test_a_bad_part_stops_the_start_naming_it():
    from saorl.errors import StartupError
    from saorl.stages.env_check import check_env

    cfg = config_from_dict({"env": {"mix": [{"type": "math_levels"}, {"type": "math_tool",
                                                                      "options": {"family": "x"}}]}})
    with pytest.raises(StartupError, match=r"^env\.mix: env\.mix\[1\] \(math_tool\): env 'math_tool': "):
        check_env(cfg)


def test_saorl_eval_prints_one_accuracy_row_per_part():
    from saorl.commands.eval import format_table

    metrics = {"eval/accuracy": 0.5, "eval/arith/accuracy": 1.0, "eval/hanoi/accuracy": 0.0,
               "eval/env/hanoi/turn_count": 3.0}
    rows = format_table({"value": metrics}).splitlines()
    assert rows[-2:] == [f"{'arith accuracy':<20}{'1.000':>10}", f"{'hanoi accuracy':<20}{'0.000':>10}"]
