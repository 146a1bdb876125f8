"""run_requests with calls past env.call_timeout_s: counted for evaluation, a RunFailure otherwise,
and a stop that gives up (real hosted children; a fake engine, so seconds, not minutes)."""

import sys

import pytest
from test_schedule import FastEngine

from saorl.data.task import Task
from saorl.engines.base import SamplingParams
from saorl.envs.registry import make_env_factory
from saorl.errors import RunFailure
from saorl.models.tokenizer import load_tokenizer
from saorl.runtime.backends.inprocess import InProcessBackend, RolloutTimeout, Stopped, run_requests
from saorl.runtime.backends.messages import RolloutRequest

TASKS = [Task(f"t{i}", {"prompt": f"Q{i}:", "q": i}) for i in range(4)]


@pytest.fixture
def factory(tmp_path, monkeypatch):
    (tmp_path / "odd_rewards.py").write_text(
        "import time\n\ndef odd_hangs(prompt, completion, q, **row):\n"
        "    if q % 2:\n        time.sleep(10**9)\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("odd_rewards", None)
    with make_env_factory("prompt_reward", {"reward_fn": "odd_rewards:odd_hangs"}, call_timeout_s=1.0) as f:
        yield f


def _backend(factory) -> InProcessBackend:
    return InProcessBackend(FastEngine(), factory, load_tokenizer(),
                            sampling=SamplingParams(max_new_tokens=4), max_total_tokens=64, concurrency=4)


def _requests() -> list[RolloutRequest]:
    return [RolloutRequest(i, t) for i, t in enumerate(TASKS)]


def test_timed_out_rollouts_are_counted_when_asked_and_the_rest_finish(factory):
    timeouts: dict[int, str] = {}
    done = run_requests(_backend(factory), _requests(), timeouts=timeouts)
    assert sorted(done) == [0, 2] and all(done[i].total_reward == 1.0 for i in (0, 2))
    assert sorted(timeouts) == [1, 3]
    assert timeouts[1].startswith("EpisodeTimeout: reward function 'odd_rewards:odd_hangs' on task 't1'")
    assert "did not return within 1 s (env.call_timeout_s)" in timeouts[3]


def test_a_timed_out_rollout_where_nothing_retries_it_is_a_run_failure(factory):
    with pytest.raises(RolloutTimeout, match=r"on task 't[13]'.*within 1 s") as info:
        run_requests(_backend(factory), _requests())
    assert isinstance(info.value, RunFailure)  # exit status 3, not "a bug in saorl"


def test_a_stop_gives_up_without_waiting_for_the_calls_in_flight(factory):
    with pytest.raises(Stopped):
        run_requests(_backend(factory), _requests(), should_stop=lambda: True)
