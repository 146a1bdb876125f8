"""A plain ``openai`` agent with one tool, a calculator: trained as it is with ``env.type: openai_agent``.

Nothing in it knows about saorl. It gets a task (a row of the tasks file) and an
``openai.AsyncOpenAI`` client, runs its own loop (ask, run the tool calls, send the results back,
until the model answers) and returns the reward. Under ``saorl train`` the client's base URL is an
endpoint of the episode served by the run's policy; anywhere else it could be any OpenAI server.

    python examples/openai_agent/make_tasks.py data/calc
    PYTHONPATH=examples/openai_agent saorl train examples/openai_agent/train.yaml \\
        env.tasks_file=data/calc/train.jsonl env.test_tasks_file=data/calc/test.jsonl
"""

from __future__ import annotations

import ast
import json
import operator

import openai

SYSTEM = "Use the calculator tool when it helps, then answer with the number alone."
TOOLS = [{"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression of integers with + - * and parentheses.",
    "parameters": {"type": "object", "properties": {
        "expression": {"type": "string", "description": "the expression, e.g. 17*(3+4)"}},
        "required": ["expression"]}}}]
MAX_TURNS = 3
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.USub: operator.neg}


def calculator(expression: str) -> str:
    """The value of ``expression`` (integers, + - *, parentheses), or an error message."""
    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError("only integers, + - * and parentheses")

    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, RecursionError) as e:
        return f"error: {e}"


async def agent(task: dict, client: openai.AsyncOpenAI) -> dict:
    messages: list = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["question"]}]
    tool_calls = 0
    for _ in range(MAX_TURNS):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                     max_tokens=48)
        message = reply.choices[0].message
        if not message.tool_calls:
            break
        messages.append(message)
        for call in message.tool_calls:
            tool_calls += 1
            try:
                result = calculator(**json.loads(call.function.arguments))
            except (TypeError, json.JSONDecodeError) as e:
                result = f"error: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    answer = (message.content or "").strip()
    correct = answer == str(task["answer"])
    return {"reward": float(correct), "success": correct, "metrics": {"tool_calls": float(tool_calls)}}
