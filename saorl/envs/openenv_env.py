"""``openenv``: an OpenEnv environment server, played over its WebSocket session protocol.

OpenEnv (``openenv-core``, the ``envs`` extra) serves an environment's ``reset()`` / ``step()``
over HTTP and WebSocket (the app of ``openenv.core.env_server.create_app``). saorl speaks its
WebSocket session protocol as OpenEnv's own ``EnvClient`` does (``/ws``; ``{"type": "reset" |
"step" | "close", "data": …}`` out, ``{"type": "observation", "data": {"observation", "reward",
"done"}}`` or ``{"type": "error", …}`` back), with ``websockets`` directly: importing
``openenv.core`` loads gradio and fastmcp (13 s measured on an idle core, 35 s on this loaded
machine), which a rollout worker need not pay. One session per episode, so each episode has its
own environment instance on the server (the server's ``max_concurrent_envs`` must allow as many
as ``rollout.concurrent_episodes``).

- ``env.options.url``: a server already running; or ``env.options.module``: the server's app as
  uvicorn names it (``my_env.server.app:app``), which saorl starts on loopback for the run and
  stops after it (:mod:`saorl.envs.openenv_server`).
- A task is a seed (``openenv-<seed>``; train and test seeds never overlap), passed to the
  environment's ``reset`` as ``seed`` (with ``reset_args``; the server drops the arguments its
  ``reset`` does not take). The split is by seed, not content (a start is seen only through a
  session): an environment whose start ignores the seed, or has few, shares starts across splits.
- The model's text is the action: the action's field ``action_field`` (default: the one required
  text field of the server's action schema, ``GET /schema``) holds it. The observation the server
  returns is the next turn's text: its ``observation_field`` (default: the observation's one text
  field; the observation as JSON when it has several), on lines of its own after the action (an
  empty text adds nothing); the first one (reset's) is the prompt. The server's ``reward`` (None:
  0) is the step's reward and its ``done`` ends the episode; ``info["success"]``: the episode's
  total reward ≥ ``success_threshold`` (1.0). At ``max_turns`` (8) the episode stops unsuccessful.
- A server that cannot be reached, dies, stays silent past ``timeout_s`` (30 s) per message, answers
  an error or something that is not an OpenEnv result fails the episode with one message naming the
  server, the call and the task (:class:`OpenEnvServerError`): a training rollout is tried again
  like any failed one, and a rollout that fails 4 times stops the run (exit status 3), as does a
  failed evaluation episode (evaluations retry nothing). Nothing is lost: the run directory keeps
  what was done to the last checkpoint.
"""

from __future__ import annotations

import json
import math
import random
import urllib.error
import urllib.request
from typing import Any, ClassVar

from saorl.envs.base import Env, Progress, Prompt, Split, StepResult, Task
from saorl.envs.openenv_server import OpenEnvServerError, local_url
from saorl.envs.splits import content_hash, distinct_tasks

TEST_FRACTION = 0.5


def _schema_action_field(url: str, timeout_s: float) -> str:
    """The one required text field of the server's action schema (``GET /schema``)."""
    try:
        with urllib.request.urlopen(f"{url}/schema", timeout=timeout_s) as r:
            schema = json.loads(r.read())["action"]
    except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError) as e:
        raise OpenEnvServerError(f"OpenEnv server at {url}: cannot read its action schema from {url}/schema "
                                 f"({type(e).__name__}: {e}); is it an OpenEnv server? (or set "
                                 "env.options.action_field)") from None
    props = schema.get("properties", {})
    text = [k for k in schema.get("required", []) if props.get(k, {}).get("type") == "string"]
    if len(text) != 1:
        raise OpenEnvServerError(f"OpenEnv server at {url}: its action has fields {sorted(props)}, of which "
                                 f"{len(text)} are required text; set env.options.action_field to the one "
                                 "that takes the model's text")
    return text[0]


class OpenEnvEnv(Env):
    name: ClassVar[str] = "openenv"
    requires: ClassVar[tuple[str, ...]] = ("openenv",)

    def __init__(self, url: str | None = None, module: str | None = None, action_field: str | None = None,
                 observation_field: str | None = None, reset_args: dict[str, Any] | None = None,
                 max_turns: int = 8, success_threshold: float = 1.0, timeout_s: float = 30.0,
                 start_timeout_s: float = 60.0, stop: list[str] | None = None, **options: Any) -> None:
        """Options: ``url`` or ``module`` (one of them), ``action_field``, ``observation_field``,
        ``reset_args`` (more arguments of ``reset``), ``max_turns`` (8), ``success_threshold``
        (1.0), ``timeout_s`` (30: per message), ``start_timeout_s`` (60: a ``module`` server's
        start), ``stop`` (strings that end a turn; default none)."""
        super().__init__(**options)
        if (url is None) == (module is None):
            raise ValueError("give exactly one of url (a running OpenEnv server, http://host:port) and "
                             "module (its app, 'package.module:app', which saorl starts on 127.0.0.1)")
        if url is not None and (not isinstance(url, str) or not url.startswith(("http://", "https://"))):
            raise ValueError(f"url must be http://host:port or https://..., got {url!r}")
        if module is not None and (not isinstance(module, str) or ":" not in module):
            raise ValueError(f"module must name the server's app as 'package.module:app', got {module!r}")
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns must be a positive integer, got {max_turns!r}")
        for key, value in (("timeout_s", timeout_s), ("start_timeout_s", start_timeout_s)):
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{key} must be a positive number of seconds, got {value!r}")
        if stop is not None and (isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop)):
            raise ValueError(f"stop must be a list of non-empty strings, got {stop!r}")
        self.url, self.module = (url.rstrip("/") if url else None), module
        self.action_field, self.observation_field = action_field, observation_field
        self.reset_args = dict(reset_args or {})
        self.max_turns, self.success_threshold = max_turns, float(success_threshold)
        self.timeout_s, self.start_timeout_s = float(timeout_s), float(start_timeout_s)
        self.stop_strings = tuple(stop or ())  # type: ignore[misc]  # per instance: an option here
        self._client: Any = None
        self._url = self._where = ""
        self._total, self._playing, self._turns = 0.0, False, 0

    def generate_tasks(self, split: Split, n: int, seed: int) -> list[Task]:
        def draw(rng: random.Random):
            s = rng.randrange(2**31)
            return content_hash("openenv", s), lambda d: Task(f"openenv-{s}", {"seed": s})

        return distinct_tasks(split, n, random.Random(seed), draw, TEST_FRACTION, "OpenEnv seeds")

    def _server(self) -> str:
        return self.url if self.url is not None else local_url(self.module, self.start_timeout_s)

    def _call(self, kind: str, data: dict[str, Any]) -> dict[str, Any]:
        """Send one message of the session and return the ``data`` of its observation answer."""
        try:
            if self._client is None:
                from websockets.sync.client import connect

                ws_url = "ws" + self._url[len("http"):] + "/ws"
                # entered as websockets asks; it lives as long as the episode and close() ends it
                self._client = connect(ws_url, open_timeout=self.timeout_s, max_size=100 * 2**20, proxy=None,
                                       close_timeout=min(self.timeout_s, 2.0)).__enter__()
            self._client.send(json.dumps({"type": kind, "data": data}))
            raw = self._client.recv(timeout=self.timeout_s)
        except TimeoutError:
            self.close()
            raise OpenEnvServerError(f"OpenEnv server at {self._where}: {kind} got no answer within "
                                     f"{self.timeout_s:g} s (env.options.timeout_s)") from None
        except Exception as e:
            self.close()
            raise OpenEnvServerError(f"OpenEnv server at {self._where}: {kind} failed: {type(e).__name__}: "
                                     f"{e}") from None
        try:
            message = json.loads(raw)
        except ValueError:
            message = None
        if isinstance(message, dict) and message.get("type") == "error":
            self.close()
            error = message.get("data") or {}
            raise OpenEnvServerError(f"OpenEnv server at {self._where}: {kind} answered an error: "
                                     f"{error.get('message', error)!s:.300} ({error.get('code', 'no code')})")
        if not isinstance(message, dict) or not isinstance(message.get("data"), dict):
            self.close()
            raise OpenEnvServerError(f"OpenEnv server at {self._where}: {kind} returned garbage: "
                                     f"{str(raw)!r:.120} is not an OpenEnv observation message")
        return message["data"]

    def reset(self, task: Task, progress: Progress | None = None) -> Prompt:
        self.close()
        if not isinstance(task.data.get("seed"), int):
            raise ValueError(f"task {task.id!r} has no integer seed (data: {task.data})")
        self._url = self._server()
        self._where = f"{self._url} (task {task.id!r})"
        if self.action_field is None:
            self.action_field = _schema_action_field(self._url, self.timeout_s)
        self._total, self._playing, self._turns = 0.0, True, 0
        result = self._call("reset", {**self.reset_args, "seed": task.data["seed"]})
        observation, _, _ = self._check(result, "reset")
        return observation

    def step(self, action: str) -> StepResult:
        if not self._playing:
            raise RuntimeError("OpenEnvEnv.step called before reset (or after the episode ended)")
        result = self._call("step", {self.action_field: action})
        observation, reward, done = self._check(result, "step")
        self._total, self._turns = self._total + reward, self._turns + 1
        observation = f"\n{observation}\n" if observation else ""  # on lines of its own; none: nothing
        if not done:
            if self._turns >= self.max_turns:  # the episode stops here: free the server's environment now
                self.close()
            return StepResult(observation, reward, False)
        self.close()
        success = self._total >= self.success_threshold
        return StepResult(observation, reward, True, {"success": success})

    def _check(self, result: dict[str, Any], what: str) -> tuple[str, float, bool]:
        """The observation's text, the reward and done of a result; garbage is an error naming it."""
        obs, reward, done = result.get("observation"), result.get("reward"), result.get("done", False)
        bad = None
        if not isinstance(obs, dict):
            bad = f"its observation is {type(obs).__name__} {obs!r:.80}, not an object"
        elif reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))
                                     or not math.isfinite(reward)):
            bad = f"its reward is {reward!r:.80}, not a finite number"
        elif not isinstance(done, bool):
            bad = f"its done is {done!r:.80}, not true or false"
        if bad:
            self.close()
            raise OpenEnvServerError(f"OpenEnv server at {self._where}: {what} returned garbage: {bad}")
        return self._text(obs, what), float(reward or 0.0), done

    def _text(self, obs: dict[str, Any], what: str) -> str:
        if self.observation_field is not None:
            if self.observation_field not in obs:
                self.close()
                raise OpenEnvServerError(f"OpenEnv server at {self._where}: {what}'s observation has no "
                                         f"field {self.observation_field!r} (fields: {sorted(obs)}); fix "
                                         "env.options.observation_field")
            return str(obs[self.observation_field])
        texts = [k for k, v in obs.items() if isinstance(v, str)]
        return obs[texts[0]] if len(texts) == 1 else json.dumps(obs, sort_keys=True)

    def close(self) -> None:
        """End the episode's session (the server frees its environment)."""
        client, self._client, self._playing = self._client, None, False
        if client is not None:
            try:
                client.send(json.dumps({"type": "close"}))
                client.recv(timeout=0.5)  # the server closes the session first (a clean close on its side)
            except Exception:
                pass  # closed (as asked), gone, or slow: close from here
            try:
                client.close()
            except Exception:
                pass  # the server may be gone already: nothing more to free

    def __del__(self) -> None:
        """An episode left unfinished: drop the connection without waiting (this may run on an event
        loop's thread); the server frees the session when its socket closes."""
        client, self._client = getattr(self, "_client", None), None
        if client is not None:
            try:
                client.socket.close()
            except Exception:
                pass
