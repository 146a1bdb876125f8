"""Content-decided splits: disjoint by construction, deterministic, a clear error when too small."""

import random

import pytest

from saorl.data.task import Task
from saorl.envs.splits import content_hash, distinct_tasks, split_of
from saorl.errors import StartupError


def _draw_from(space: int):
    def draw(rng: random.Random):
        x = rng.randrange(space)
        return content_hash("t", x), lambda digest: Task(f"t/{x}", {"x": x})
    return draw


def test_splits_are_disjoint_distinct_and_follow_the_digest():
    train = distinct_tasks("train", 200, random.Random(0), _draw_from(10_000), 0.2, "tasks")
    test = distinct_tasks("test", 50, random.Random(0), _draw_from(10_000), 0.2, "tasks")
    assert len({t.id for t in train}) == 200 and len({t.id for t in test}) == 50
    assert not {t.id for t in train} & {t.id for t in test}
    assert all(split_of(content_hash("t", t.data["x"]), 0.2) == "test" for t in test)
    again = distinct_tasks("train", 200, random.Random(0), _draw_from(10_000), 0.2, "tasks")
    assert [t.id for t in again] == [t.id for t in train]


def test_a_content_space_too_small_is_named():
    # 30 contents in all: about 6 of them are test, never 20 distinct ones
    with pytest.raises(StartupError, match=r"could only find (\d+) distinct test widgets; asked for 20") as e:
        distinct_tasks("test", 20, random.Random(0), _draw_from(30), 0.2, "widgets")
    found = int(e.value.args[0].split()[3])  # a user error (exit 2), naming the setting and its bound
    assert 0 < found < 20 and f"set env.num_test_tasks to at most {found}" in str(e.value)
    with pytest.raises(ValueError, match="split must be 'train' or 'test'"):
        distinct_tasks("valid", 1, random.Random(0), _draw_from(30), 0.2, "widgets")
