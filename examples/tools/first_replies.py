"""How many first replies of a ``saorl eval --json --show N`` make a well-formed tool call.

Reads the episodes ``saorl eval`` shows (its ``samples``, rendered with ``[act k]`` / ``[obs k]``
labels), parses each episode's first reply in the run's call format (``--format``, default
``hermes``: what saorl asks a model for whose chat template takes no tools) and prints the share of
them with at least one call and no malformed one, next to the evaluation's accuracy.

    saorl eval smollm2-135m-instruct --tasks 32 --temperature 0 --show 32 --json ... > eval.json
    python examples/tools/first_replies.py eval.json
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from saorl.envs.tool_calls import TOOL_CALL_FORMATS, parse_tool_calls

REPLY = re.compile(r"\[act 1\]\n(.*?)\n\[(?:reward|obs) 1", re.S)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("eval_json", type=Path)
    p.add_argument("--format", default="hermes", choices=TOOL_CALL_FORMATS)
    args = p.parse_args()
    report = json.loads(args.eval_json.read_text())
    replies = [m.group(1) for s in report["samples"] if (m := REPLY.search(s))]
    good = sum(1 for r in replies if (t := parse_tool_calls(r, args.format)).calls and not t.errors)
    called = sum(1 for r in replies if "tool_call" in r or '"name"' in r)
    share = good / max(1, len(replies))
    calls, errors = report["eval/env/tool_calls"], report["eval/env/tool_errors"]
    print(f"{len(replies)} first replies: {good} make a well-formed call ({share:.3f}), {called} try one; "
          f"accuracy {report['eval/accuracy']:.3f}, tool calls per episode {calls:.2f}, tool errors per "
          f"episode {errors:.2f}")


if __name__ == "__main__":
    main()
