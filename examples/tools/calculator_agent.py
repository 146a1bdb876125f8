"""The calculator task of ``calculator.py`` as a plain ``openai`` agent: its own loop, its own tools.

The same problems (``make_data.py``'s rows), the same ``add`` / ``multiply`` functions offered with
the schemas TRL would make of them (transformers' ``get_json_schema``), the same reward
(``correct_answer``); but here the program owns the loop, as an agent written against any OpenAI
server does: ask, run the calls it gets, send the results back as ``tool`` messages, until the
model answers without a call. Nothing in it knows about saorl; ``env.type: openai_agent`` trains it
as it is (configs/recipes/smollm2_135m_tools_agent.yaml, docs/agents.md).

    PYTHONPATH=examples/tools saorl train configs/recipes/smollm2_135m_tools_agent.yaml
"""

from __future__ import annotations

import json

import openai
from calculator import add, correct_answer, multiply
from transformers.utils import get_json_schema

FUNCTIONS = {f.__name__: f for f in (add, multiply)}
TOOLS = [get_json_schema(f) for f in FUNCTIONS.values()]
MAX_TURNS = 3  # model replies per episode, as the env.tools recipe's env.tool_max_turns


def run_call(name: str, arguments: str) -> str:
    """One tool call's result as the text the model reads back (an error as text, never a raise)."""
    fn = FUNCTIONS.get(name)
    if fn is None:
        return f"error: no tool named {name!r}; the tools are {', '.join(FUNCTIONS)}"
    try:
        args = json.loads(arguments)
        if not isinstance(args, dict):
            return f"error: arguments must be an object, got {arguments}"
        return str(fn(**args))
    except (json.JSONDecodeError, TypeError) as e:
        return f"error: {e}"


async def agent(task: dict, client: openai.AsyncOpenAI) -> dict:
    messages: list = list(task["prompt"])
    calls = errors = 0
    message = None
    for _ in range(MAX_TURNS):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                     max_tokens=48)
        message = reply.choices[0].message
        if not message.tool_calls:
            break
        messages.append(message)
        for call in message.tool_calls:
            result = run_call(call.function.name, call.function.arguments)
            calls, errors = calls + 1, errors + result.startswith("error:")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    final = "" if message is None or message.tool_calls else (message.content or "")
    reward = correct_answer(None, [[{"role": "assistant", "content": final}]], [task["answer"]])[0]
    return {"reward": reward, "success": reward == 1.0,
            "metrics": {"tool_calls": float(calls), "tool_errors": float(errors)}}
