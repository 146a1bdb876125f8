"""``openenv`` against openenv-core's own server (``create_app`` of an environment written to its
interface, :mod:`openenv_guess`), and against servers that die, hang or answer garbage."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest

from saorl.envs.openenv_server import _SERVERS, OpenEnvServerError, stop_all
from saorl.envs.registry import make_env_factory

from .community import need
from .episodes import play

need("openenv")
uvicorn = need("uvicorn")


def _serve(app):
    """``app`` served by uvicorn in a thread of this process; returns (url, server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", server


@pytest.fixture(scope="module")
def guess_url():
    from .openenv_guess import app

    url, server = _serve(app)
    yield url
    server.should_exit = True


def _search(env, task):
    """Binary search over 1..8 by the game's hints; the results of each guess."""
    low, high, results = 1, 8, []
    env.reset(task)
    while True:
        guess = (low + high) // 2
        results.append(env.step(f"{guess}"))
        hint = results[-1].observation.strip()
        if results[-1].done:
            return results
        low, high = (guess + 1, high) if hint == "higher" else (low, guess - 1)


def test_an_episode_over_openenvs_own_server(guess_url):
    factory = make_env_factory("openenv", {"url": guess_url})
    env = factory()
    train, test = env.generate_tasks("train", 8, seed=0), env.generate_tasks("test", 8, seed=0)
    assert not {t.id for t in train} & {t.id for t in test}
    assert factory().generate_tasks("train", 8, 0) == train
    assert env.reset(train[0]).startswith("Guess my number from 1 to 8 in 4 tries.")
    results = _search(factory(), train[0])
    assert results[-1].observation == "\ncorrect\n" and results[-1].reward == 1.0
    assert results[-1].info == {"success": True} and all(r.reward == 0.0 for r in results[:-1])
    assert [r.observation for r in _search(factory(), train[0])] == [r.observation for r in results]
    secrets = {len(_search(factory(), t)) for t in train}
    assert len(secrets) > 1  # the seed sets the secret
    lost = play(factory(), train[0], ["nine", "0", "0", "0"])
    assert lost[0].observation == "\nnot a number\n" and lost[-1].done and not lost[-1].info["success"]
    assert env.action_field == "guess"  # read from the server's action schema


@pytest.mark.parametrize(("app", "message"), [
    ("garbage_app", r"step returned garbage: '<html>502 Bad Gateway</html>' is not an OpenEnv observation"),
    ("error_app", r"reset answered an error: the game broke \(EXECUTION_ERROR\)"),
    ("silent_app", r"reset got no answer within 1 s \(env.options.timeout_s\)"),
])
def test_a_server_that_misbehaves_is_one_clear_error(app, message):
    from . import openenv_fakes

    url, server = _serve(getattr(openenv_fakes, app))
    try:
        env = make_env_factory("openenv", {"url": url, "timeout_s": 1})()
        task = env.generate_tasks("train", 1, seed=0)[0]
        where = rf"OpenEnv server at {url} \(task '{task.id}'\): "
        with pytest.raises(OpenEnvServerError, match=where + message):
            env.reset(task)
            env.step("1")
    finally:
        server.should_exit = True


def test_a_server_saorl_starts_is_stopped_and_one_that_dies_fails_the_episode():
    module = "tests.envs.openenv_fakes:count_app"
    factory = make_env_factory("openenv", {"module": module, "start_timeout_s": 60})
    env = factory()
    task = env.generate_tasks("train", 1, seed=0)[0]
    results = play(env, task, ["a", "b", "c"])
    assert [r.observation for r in results] == ["\ncount 1\n", "\ncount 2\n", "\ncount 3\n"]
    assert [r.reward for r in results] == [0.0, 0.0, 1.0] and results[-1].info == {"success": True}
    server = _SERVERS[module]
    assert server.url.startswith("http://127.0.0.1:")
    env = factory()
    env.reset(task)
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait()
    where = rf"OpenEnv server at {server.url} \(task '{task.id}'\)"
    with pytest.raises(OpenEnvServerError, match=where + ": step failed: ConnectionClosed"):
        env.step("a")
    assert play(factory(), task, ["a"])[0].observation == "\ncount 1\n"  # the next episode starts it again
    again = _SERVERS[module]
    assert again is not server and again.alive()
    stop_all()
    assert not again.alive() and not _SERVERS


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match=r"give exactly one of url .* and module"):
        make_env_factory("openenv", {})
    with pytest.raises(ValueError, match=r"module must name the server's app as 'package\.module:app'"):
        make_env_factory("openenv", {"module": "my_env.server.app"})


def test_envs_sample_shows_the_servers_answer_to_an_empty_action(guess_url, capsys):
    from saorl.cli import main

    assert main(["envs", "sample", "openenv", "--option", f"url={guess_url}", "--n", "1", "--no-color"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "PROMPT| Guess my number from 1 to 8 in 4 tries. Answer with the number only."
    assert "OBS   | not a number" in out and out[-1] == "INFO  | reward 0  done False"


def test_sessions_close_at_the_last_turn_and_del_drops_one_without_waiting(guess_url):
    env = make_env_factory("openenv", {"url": guess_url, "max_turns": 2})()
    task = env.generate_tasks("train", 1, seed=0)[0]
    results = play(env, task, ["nine", "nine"])
    assert not results[-1].done and env._client is None  # max_turns reached: the session is closed
    env.reset(task)
    client, waited = env._client, []
    client.recv = client.send = lambda *a, **k: waited.append(a)
    env.__del__()
    assert waited == [] and env._client is None and client.socket.fileno() == -1
