"""Tool calls parsed out of a model's text, per format, and the schemas of typed functions."""

from __future__ import annotations

from typing import Literal

import pytest

from saorl.envs.tool_calls import (
    TOOL_CALL_FORMATS,
    ToolCall,
    ToolSchemaError,
    argument_errors,
    function_schema,
    parse_tool_calls,
    tool_stop_strings,
)


def test_hermes_one_call_and_the_text_around_it():
    turn = parse_tool_calls('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'
                            '</tool_call>', "hermes")
    assert turn.calls == [ToolCall("add", {"a": 2, "b": 3}, "call_0")]
    assert turn.content == "Let me add." and turn.errors == []


def test_hermes_several_calls_nested_json_and_markup_inside_strings():
    text = ('<tool_call>{"name": "f", "arguments": {"q": {"deep": [1, {"x": "}"}]}}}</tool_call>'
            '<tool_call>{"name": "echo", "arguments": {"s": "a </tool_call> b <tool_call> {"}, "id": "c9"}'
            '</tool_call> done')
    turn = parse_tool_calls(text, "hermes")
    assert turn.calls == [ToolCall("f", {"q": {"deep": [1, {"x": "}"}]}}, "call_0"),
                          ToolCall("echo", {"s": "a </tool_call> b <tool_call> {"}, "c9")]
    assert turn.content == "done" and turn.errors == []


def test_hermes_arguments_as_a_json_string_and_an_unclosed_last_block():
    turn = parse_tool_calls('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}', "hermes")
    assert turn.calls == [ToolCall("add", {"a": 1}, "call_0")] and turn.errors == []


def test_hermes_malformed_calls_are_error_lines_and_the_good_ones_stay():
    text = ('<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>'      # bad JSON
            '<tool_call>{"arguments": {"a": 1}}</tool_call>'                      # no name
            '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>'         # args not an object
            '<tool_call>{"name": "add", "arguments": {}} trailing</tool_call>'    # junk after the object
            '<tool_call>{"name": "ok", "arguments": {}}</tool_call>')
    turn = parse_tool_calls(text, "hermes")
    assert turn.calls == [ToolCall("ok", {}, "call_0")]
    assert len(turn.errors) == 4
    assert "not JSON" in turn.errors[0]
    assert "trailing" in turn.errors[1]
    assert "no function name" in turn.errors[2]
    assert "must be a JSON object, got list" in turn.errors[3]


def test_no_call_is_all_content():
    for fmt in TOOL_CALL_FORMATS:
        turn = parse_tool_calls("  The answer is {5}.  ", fmt)
        assert turn.calls == [] and turn.errors == [] and turn.content == "The answer is {5}."


def test_llama3_python_tag_parameters_and_semicolons():
    text = ('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
            '{"name": "multiply", "parameters": {"a": 3, "b": {"n": "{;}"}}}')
    turn = parse_tool_calls(text, "llama3")
    assert turn.calls == [ToolCall("add", {"a": 1, "b": 2}, "call_0"),
                          ToolCall("multiply", {"a": 3, "b": {"n": "{;}"}}, "call_1")]
    assert turn.content == "" and turn.errors == []


def test_json_fallback_finds_calls_in_prose_and_flags_a_broken_one():
    turn = parse_tool_calls('I will call {"name": "add", "arguments": {"a": 1, "b": 2}} now; '
                            'a dict {"a": 1} is text.', "json")
    assert turn.calls == [ToolCall("add", {"a": 1, "b": 2}, "call_0")]
    assert turn.content == 'I will call  now; a dict {"a": 1} is text.'
    broken = parse_tool_calls('ok {"name": "add", "arguments": {"a": 1', "json")
    assert broken.calls == [] and len(broken.errors) == 1 and "does not parse" in broken.errors[0]
    assert broken.content == "ok"


@pytest.mark.parametrize("fmt", TOOL_CALL_FORMATS)
@pytest.mark.parametrize("body, why", [
    ('{"name": "f", "arguments": ' + "[" * 100_000 + "}", "nested too deep"),
    ('{"name": "f", "arguments": "' + "[" * 100_000 + '"}', "nested too deep"),  # inside string arguments
    ('{"name": "f", "arguments": {"x": ' + "9" * 5000 + "}}", "digits"),       # past int's digit limit
])
def test_hostile_json_is_an_error_line_not_an_exception(fmt, body, why):
    text = f"<tool_call>{body}</tool_call>" if fmt == "hermes" else body
    turn = parse_tool_calls(text, fmt)
    assert turn.calls == [] and len(turn.errors) == 1 and why in turn.errors[0]
    bare = parse_tool_calls("<tool_call>" + "[" * 100_000 + "</tool_call>", "hermes")
    assert bare.calls == [] and "nested too deep" in bare.errors[0]


@pytest.mark.parametrize("fmt", ["json", "llama3"])
@pytest.mark.parametrize("text", ['{"a": ' * 100_000, '"' + "{" * 100_000, '{"a": "' + "{" * 100_000])
def test_a_huge_reply_of_broken_json_is_read_in_bounded_time(fmt, text):
    import time

    t0 = time.perf_counter()
    turn = parse_tool_calls(text + ' {"name": "f", "arguments": {}}', fmt)
    assert time.perf_counter() - t0 < 1.0  # each '{' retried: seconds without the scan budget
    assert turn.calls == [] and "not searched for calls" in turn.errors[-1]


def test_unknown_format_and_stop_strings():
    with pytest.raises(ValueError, match="unknown tool call format 'xml'"):
        parse_tool_calls("x", "xml")
    assert tool_stop_strings("hermes") == ("</tool_call>",)
    assert tool_stop_strings("json") == () and tool_stop_strings("llama3") == ()


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def pick(mode: Literal["fast", "slow"], scale: float = 1.0) -> str:
    """Pick a mode.

    Args:
        mode: How to run.
        scale: A factor.
    """
    return mode


def no_hints(a, b):
    """Add.

    Args:
        a: x
        b: y
    """


def no_doc(a: int) -> int:
    return a


def test_schema_of_typed_documented_functions_is_trls():
    schema = function_schema(add)
    assert schema["type"] == "function"
    fn = schema["function"]
    assert fn["name"] == "add" and fn["description"] == "Add two integers."
    assert fn["parameters"] == {"type": "object", "required": ["a", "b"], "properties": {
        "a": {"type": "integer", "description": "The first number."},
        "b": {"type": "integer", "description": "The second number."}}}
    p = function_schema(pick)["function"]["parameters"]
    assert p["required"] == ["mode"] and p["properties"]["mode"]["enum"] == ["fast", "slow"]


@pytest.mark.parametrize("fn, why", [(no_hints, "no_hints"), (no_doc, "no docstring"),
                                     (int, "not a function")])
def test_bad_functions_are_refused_naming_them(fn, why):
    with pytest.raises(ToolSchemaError) as e:
        function_schema(fn)
    msg = str(e.value)
    assert why in msg and ("type hint" in msg or "a tool is a Python function" in msg)
    if fn is not int:
        assert f"test_tool_calls:{fn.__name__}" in msg


def test_argument_errors_against_the_schema():
    schema = function_schema(pick)
    assert argument_errors(schema, {"mode": "fast"}) == []
    errors = argument_errors(schema, {"mode": "warp", "scale": "big", "x": 1})
    assert errors == ["argument 'mode' must be string in ['fast', 'slow'], got \"warp\"",
                      "argument 'scale' must be number, got \"big\"",
                      "unexpected argument 'x' (it takes: mode, scale)"]
    assert argument_errors(function_schema(add), {"a": True}) == [
        "missing required argument 'b'", "argument 'a' must be integer, got true"]
