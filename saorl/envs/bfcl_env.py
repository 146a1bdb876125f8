"""``bfcl``: BFCL v4 multi-turn (``multi_turn_base``), played against BFCL's own backends and checker.

The Berkeley Function Calling Leaderboard's multi-turn tasks (``bfcl-eval`` 2026.3.23, installed
``pip install --no-deps bfcl-eval==2026.3.23``: :mod:`saorl.envs.bfcl_data` says what of it is used).
A task is one BFCL entry: a few user requests in order, stateful backends (file system, trading bot,
travel booking, vehicle control, messages, posts, tickets, math) made from the entry's
``initial_config``, and a possible answer (the calls of each request).

**An episode.** The prompt is a system message describing the task's functions (the docs of its
``involved_classes``, as JSON schemas: :func:`saorl.envs.tool_prompt.tools_system_prompt`, style
``tool_prompt``, calls asked in ``tool_format``) and the first request as the user's message. Each
model reply is parsed for calls (:func:`saorl.envs.tool_calls.parse_tool_calls`):

- a reply with calls: each call runs, in order, on this episode's backends, and the results come
  back as the next message (role ``user``, each result in ``<tool_response>`` tags, as Qwen's
  template writes tool results); the model replies again;
- a reply without a call ends the request: the next request is the next user message; after the
  last one the episode ends and is scored;
- a request whose replies still call tools after ``steps_per_turn`` (20: BFCL's
  ``MAXIMUM_STEP_LIMIT``) steps ends the episode unsuccessful, as BFCL force-quits it.

**Calls are never model text run as code.** BFCL executes a call by ``eval`` of a call string. saorl
builds that string itself from the parsed JSON: the name must be one of the task's functions, each
argument name one of that function's parameters (identifiers by construction), each value a JSON
value written with ``repr`` (strings quoted and escaped, numbers, booleans, None, lists, dicts;
non-finite numbers refused, and the few MathAPI arguments that would stall the process past a
bound, :data:`COSTLY`). A call that fails this (an unknown function, an unexpected argument) is not
run: its result is an ``error:`` line the model reads, counted in ``tool_errors``, as is a
malformed call (bad JSON, no name) and a call the backend answers with an error (``Error during
execution: ...``: a missing argument, a value of the wrong type, as BFCL leaves types to the
backends). None of them ends the episode.
(BFCL itself ends a request at a reply it cannot decode; here the model gets to read why.)

**Success** is BFCL's own ``multi_turn_checker`` on the calls the episode ran (each request's
steps, as BFCL's inference records them), against the possible answer: after each request the
backends' state must equal the ground truth's and the ground truth's results must all be among the
model's. Reward 1.0 on success, else 0.0, given with the last reply. ``info["error_type"]`` is the
checker's (``multi_turn:instance_state_mismatch``, ...); metrics: ``tool_calls``, ``tool_errors``,
``requests`` (user requests the model finished), ``force_quit``.

BFCL's executor keeps the backends of a run in its module's globals under names made from a model
name and the task id: each episode uses a model name of its own (``saorl_<uuid>``) and removes its
entries when it ends or is dropped, so concurrent episodes of one task never share a backend.

**Splits**: of the 200 tasks, the 40 whose ``sha256("bfcl/<id>")`` sort first are the test split,
the other 160 train (:func:`saorl.envs.bfcl_data.split_ids`). A split's tasks come in a seeded
order; asking for more train tasks than 160 repeats them (epochs, each reshuffled); asking for
more test tasks than 40 gives the 40.
"""

from __future__ import annotations

import json
import keyword
import math
import random
import uuid
import weakref
from typing import Any, ClassVar, Literal

from saorl.envs import bfcl_data
from saorl.envs.base import Env, Progress, Prompt, Split, StepResult, Task
from saorl.envs.tool_calls import HERMES_CLOSE, HERMES_OPEN, parse_tool_calls
from saorl.envs.tool_prompt import tools_system_prompt

INSTRUCTION = ("You are an assistant that fulfils the user's requests by calling the functions below, "
               "which act on the user's system. Make the calls a request needs, read their results, and "
               "when the request is done (or cannot be done with these functions) reply to the user "
               "without a call; the next request follows.")


COSTLY: dict[tuple[str, str], int] = {("power", "exponent"): 1000, ("square_root", "precision"): 1000,
                                      ("logarithm", "precision"): 1000}
"""MathAPI arguments refused above these magnitudes: ``power``'s ``base ** exponent`` and the
precision ``square_root`` and ``logarithm`` set (Decimal's context, mpmath's global ``mp.dps``) would
stall the worker that plays the episode (the possible answers use precision 2 to 10)."""


def _forget(key: str) -> None:
    """Drop BFCL's executor's backends of the episode keyed ``key`` (module docstring)."""
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils

    space = vars(multi_turn_utils)
    for name in [n for n in list(space) if n.startswith(f"{key}_")]:
        space.pop(name, None)


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    return True


def call_string(name: str, arguments: dict[str, Any],
                schema: dict[str, Any] | None) -> tuple[str | None, str]:
    """``(BFCL's call string, "")`` for a call that may run, else ``(None, why not)``: the name is a
    function of the task (``schema`` not None), every argument name one of its parameters, every
    value finite JSON; the string is ``name(key=repr(value), ...)``, which BFCL's executor evaluates.
    Types and missing arguments are the backend's to judge, as in BFCL (its possible answers pass
    ``"ticket_001"`` for an integer id): it answers ``Error during execution: ...``."""
    if schema is None or not name.isidentifier():
        return None, f"unknown function {name!r}"
    props = (schema["function"].get("parameters") or {}).get("properties") or {}
    for key, value in arguments.items():
        if key not in props or not key.isidentifier() or keyword.iskeyword(key):
            return None, (f"bad arguments for {name}: unexpected argument {key!r} (it takes: "
                          f"{', '.join(props) or 'none'})")
        if not _finite(value):
            return None, f"bad arguments for {name}: argument {key!r} holds a non-finite number"
        limit = COSTLY.get((name, key))
        if limit is not None and isinstance(value, (int, float)) and abs(value) > limit:
            return None, f"bad arguments for {name}: {key} above {limit} in magnitude is refused"
    return f"{name}({', '.join(f'{k}={v!r}' for k, v in arguments.items())})", ""


def format_calls(calls: list[tuple[str, dict[str, Any]]], fmt: str) -> str:
    """Calls written as a model asked for ``fmt`` writes them (for the demonstration)."""
    if fmt == "hermes":
        return "\n".join(f"{HERMES_OPEN}{json.dumps({'name': n, 'arguments': a})}{HERMES_CLOSE}"
                         for n, a in calls)
    key = "parameters" if fmt == "llama3" else "arguments"
    return ("; " if fmt == "llama3" else "\n").join(json.dumps({"name": n, key: a}) for n, a in calls)


class BfclEnv(Env):
    name = "bfcl"
    requires: ClassVar[tuple[str, ...]] = (bfcl_data.MODULE,)
    observation_format = "chat"
    observation_role = "user"
    max_turns = 64

    def __init__(self, category: str = "multi_turn_base",
                 tool_format: Literal["hermes", "json", "llama3"] = "hermes",
                 tool_prompt: Literal["json", "list"] = "json", steps_per_turn: int = 20,
                 prompt: Literal["chat", "text"] = "chat", **options: Any) -> None:
        """Options: ``category`` (``multi_turn_base``), ``tool_format`` (the call format asked for
        and parsed: ``hermes``, ``json``, ``llama3``), ``tool_prompt`` (``json``: the schemas as JSON
        lines; ``list``: a line per function), ``steps_per_turn`` (20), ``prompt`` (``chat``: system
        + user messages, observations as chat turns; ``text``: one text prompt and text
        observations, for a tokenizer without a chat template)."""
        super().__init__(**options)
        if category not in bfcl_data.CATEGORIES:
            raise ValueError(f"category {category!r} is not played (yet): env.options.category must be "
                             f"{list(bfcl_data.CATEGORIES)}")
        if tool_format not in ("hermes", "json", "llama3"):
            raise ValueError(f"tool_format must be hermes, json or llama3, got {tool_format!r}")
        if tool_prompt not in ("json", "list"):
            raise ValueError(f"tool_prompt must be json or list, got {tool_prompt!r}")
        if not isinstance(steps_per_turn, int) or isinstance(steps_per_turn, bool) or steps_per_turn < 1:
            raise ValueError(f"steps_per_turn must be an integer >= 1, got {steps_per_turn!r}")
        if prompt not in ("chat", "text"):
            raise ValueError(f"prompt must be chat or text, got {prompt!r}")
        self.category, self.tool_format, self.tool_prompt = category, tool_format, tool_prompt
        self.steps_per_turn, self.prompt = steps_per_turn, prompt
        self.observation_format = prompt
        bfcl_data.entries(category)  # the data load here, so a broken install fails at config time
        self._entry: dict[str, Any] | None = None

    def generate_tasks(self, split: Split, n: int, seed: int) -> list[Task]:
        ids = bfcl_data.split_ids(self.category)[split]
        rng, out = random.Random(seed), []
        while len(out) < n and (split == "train" or not out):
            order = list(ids)
            rng.shuffle(order)
            out += order
        return [Task(i, {"category": self.category, "id": i}) for i in out[:n]]

    def _schemas(self, entry: dict[str, Any]) -> list[dict[str, Any]]:
        return [bfcl_data.tool_schema(doc) for doc in entry["function"]]

    def reset(self, task: Task, progress: Progress | None = None) -> Prompt:
        entry = bfcl_data.entries(self.category).get(str(task.data.get("id", task.id)))
        if entry is None:
            raise ValueError(f"task {task.id!r} is not a BFCL {self.category} task")
        if self.toolbox is not None:
            raise ValueError("env bfcl offers each task's own functions: leave env.tools empty")
        if self.observation_format == "chat" and self.observation_role != "user":
            raise ValueError("env bfcl sends the next request as a user message: env.observation_role "
                             f"must be user, got {self.observation_role!r}")
        self._entry, self._turn, self._steps = entry, 0, 0
        self._schema = {s["function"]["name"]: s for s in self._schemas(entry)}
        self._decoded: list[list[list[str]]] = [[]]  # per request, per step: the call strings run
        self.calls = self.errors = 0
        self._key = f"saorl_{uuid.uuid4().hex}"
        self._finalizer = weakref.finalize(self, _forget, self._key)
        self.max_turns = len(entry["question"]) * (self.steps_per_turn + 2)
        tools = tools_system_prompt(list(self._schema.values()), self.tool_prompt, self.tool_format)
        system = f"{INSTRUCTION}\n\n{tools}"
        request = self._request(0)
        if self.prompt == "text":
            return f"{system}\n\n{request}"
        return [{"role": "system", "content": system}, {"role": "user", "content": request}]

    def _request(self, k: int) -> str:
        assert self._entry is not None
        return "\n\n".join(m["content"] for m in self._entry["question"][k])

    def _run(self, name: str, arguments: dict[str, Any]) -> tuple[str, str | None]:
        """``(result text, the call string run)``; an error text and None when it did not run."""
        from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils import execute_multi_turn_func_call

        assert self._entry is not None
        call, why = call_string(name, arguments, self._schema.get(name))
        if call is None:
            known = f"; the functions are: {', '.join(self._schema)}" if why.startswith("unknown") else ""
            return f"error: {why}{known}", None
        entry = self._entry
        results, _ = execute_multi_turn_func_call([call], entry["initial_config"], entry["involved_classes"],
                                                  self._key, entry["id"])
        return results[0], call

    def step(self, action: str) -> StepResult:
        if self._entry is None:
            raise RuntimeError("BfclEnv.step called before reset (or after the episode ended)")
        parsed = parse_tool_calls(action, self.tool_format)
        if parsed.calls or parsed.errors:
            return self._calls(parsed.calls, parsed.errors)
        self._turn, self._steps = self._turn + 1, 0
        if self._turn < len(self._entry["question"]):
            self._decoded.append([])
            request = self._request(self._turn)
            text = request if self.observation_format == "chat" else f"\n\n{request}\n\n"
            return StepResult(text, 0.0, False)
        return self._end(force_quit=False)

    def _calls(self, calls: list, errors: list[str]) -> StepResult:
        texts, ran = [], []
        for call in calls:
            text, string = self._run(call.name, call.arguments)
            texts.append(text)
            if string is not None:
                ran.append(string)
            self.errors += string is None or text.startswith("Error during execution")
        texts += [f"error: malformed tool call: {e}" for e in errors]
        self.calls += len(calls) + len(errors)
        self.errors += len(errors)
        if ran:
            self._decoded[-1].append(ran)
        self._steps += 1
        if self._steps > self.steps_per_turn:
            return self._end(force_quit=True)
        body = "\n".join(f"<tool_response>\n{t}\n</tool_response>" for t in texts)
        return StepResult(body if self.observation_format == "chat" else f"\n{body}\n", 0.0, False)

    def _end(self, force_quit: bool) -> StepResult:
        from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker

        entry, self._entry = self._entry, None
        assert entry is not None
        if force_quit:
            result = {"valid": False, "error_type": "multi_turn:force_terminated"}
        else:
            try:
                result = multi_turn_checker(self._decoded, entry["ground_truth"], entry, self.category,
                                            self._key)
            except Exception as e:  # the checker's own asserts; never the policy's win
                result = {"valid": False, "error_type": f"checker raised {type(e).__name__}: {e}"}
        self._finalizer()
        success = bool(result.get("valid"))
        metrics = {"tool_calls": float(self.calls), "tool_errors": float(self.errors),
                   "requests": float(self._turn), "force_quit": float(force_quit)}
        info = {"success": success, "error_type": str(result.get("error_type", "")), "metrics": metrics}
        return StepResult("", 1.0 if success else 0.0, True, info)

    def demonstration(self, task: Task, rng: random.Random) -> list[str]:
        """The possible answer: each request's calls in one reply, then a reply without a call."""
        entry = bfcl_data.entries(self.category)[str(task.data.get("id", task.id))]
        actions = []
        for calls in entry["ground_truth"]:
            parsed = [bfcl_data.ground_truth_arguments(c, entry["involved_classes"]) for c in calls]
            if parsed:
                actions.append(format_calls(parsed, self.tool_format))
            actions.append("Done.")
        return actions
