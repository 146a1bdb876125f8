"""The docs cannot drift from the code: generated reference, runnable examples, real CLI output.

- ``docs/config.md`` equals what ``docs/gen_config_reference.py`` generates from ``saorl.config``;
- the custom-env example in ``docs/envs.md`` is executed: resolved by ``module:Class``, played
  through the real agent loop (scripted engine and its own demonstration), and sampled by the CLI;
- the ``saorl envs sample`` transcripts in ``docs/envs.md`` match what the command prints now;
- the README's command list matches ``saorl.cli.COMMANDS`` and its links to ``docs/`` resolve.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import random
import re
import shlex
import sys
from pathlib import Path

import pytest

from saorl.agent.scripted import demonstration_trajectory
from saorl.cli import COMMANDS, main
from saorl.config import SaorlConfig
from saorl.envs.registry import make_env_factory, resolve_env
from saorl.models.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_config_reference", DOCS / "gen_config_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


# ------------------------------------------------------------------------------- config reference
def test_config_reference_is_up_to_date():
    gen = _load_generator()
    assert (DOCS / "config.md").read_text(encoding="utf-8") == gen.render(), (
        "docs/config.md is out of date: run `python docs/gen_config_reference.py`")


def test_every_config_field_is_in_the_reference_with_its_docstring():
    text = (DOCS / "config.md").read_text(encoding="utf-8")
    for section, info in SaorlConfig.model_fields.items():
        model = info.annotation
        is_section = isinstance(model, type) and hasattr(model, "model_fields")
        fields = model.model_fields if is_section else {section: info}
        for name, f in fields.items():
            assert f.description, f"{section}.{name} has no docstring"
            assert f"| `{name}` |" in text, f"{section}.{name} missing from docs/config.md"


def test_reference_types_and_bounds():
    gen = _load_generator()
    rows = "\n".join(gen.render_sections())
    assert "| `num_workers` | int ≥ 1 | `1` |" in rows
    assert "| `top_p` | float (0.0, 1.0] | `1.0` |" in rows
    assert "| `engine` | section (one per `kind`) | (below) |" in rows
    assert "### `rollout.engine` of kind `sglang`" in rows and '| `kind` | `"sglang"` | `sglang` |' in rows
    assert "| `critic` | string \\| null | `null` |" in rows


# ---------------------------------------------------------------------------- custom env example
@pytest.fixture
def reverse_env(tmp_path, monkeypatch):
    """The ``reverse_env.py`` block of docs/envs.md, importable as ``reverse_env``."""
    source = next(b for b in _blocks((DOCS / "envs.md").read_text(encoding="utf-8"), "python")
                  if b.startswith("# reverse_env.py"))
    (tmp_path / "reverse_env.py").write_text(source, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("reverse_env", None)
    yield resolve_env("reverse_env:ReverseEnv")
    sys.modules.pop("reverse_env", None)


def test_doc_env_resolves_and_validates_options(reverse_env):
    factory = make_env_factory("reverse_env:ReverseEnv", {"length": 4})
    assert isinstance(factory(), reverse_env)
    with pytest.raises(ValueError, match="length must be an int"):
        make_env_factory("reverse_env:ReverseEnv", {"length": 1})
    with pytest.raises(ValueError, match="unknown options"):
        make_env_factory("reverse_env:ReverseEnv", {"lenght": 4})


def test_doc_env_tasks_are_deterministic_and_splits_disjoint(reverse_env):
    env = reverse_env(length=4)
    train, again = env.generate_tasks("train", 20, 0), env.generate_tasks("train", 20, 0)
    test = env.generate_tasks("test", 20, 0)
    assert train == again
    assert not {t.id for t in train} & {t.id for t in test}
    assert all(len(t.data["word"]) == 4 for t in train)


def test_doc_env_demonstration_through_the_agent_loop(reverse_env):
    tok = load_tokenizer()
    env = reverse_env(length=4)
    task = env.generate_tasks("train", 1, 0)[0]
    traj = asyncio.run(demonstration_trajectory(reverse_env(length=4), task, tok, random.Random(0)))
    assert traj.episode.success and traj.total_reward == 1.0 and traj.episode.turns == 1
    actions = [t for t, m in zip(traj.token_ids, traj.action_mask) if m]
    assert tok.decode(actions).startswith(f"<answer>{task.data['word'][::-1]}</answer>")
    # the reward sits on the last action token
    assert traj.rewards[max(i for i, m in enumerate(traj.action_mask) if m)] == 1.0


def test_doc_env_driving_snippet_runs_as_documented(reverse_env, capsys):
    snippet = next(b for b in _blocks((DOCS / "envs.md").read_text(encoding="utf-8"), "python")
                   if "ScriptedEngine(" in b)
    exec(compile(snippet, "docs/envs.md", "exec"), {"__name__": "doc_snippet"})
    documented = re.search(r"# (.+)$", snippet.strip().splitlines()[-1]).group(1).strip()
    assert capsys.readouterr().out.strip() == documented == "2 1.0 True"


def test_doc_env_sample_command(reverse_env, capsys):
    assert main(["envs", "sample", "reverse_env:ReverseEnv", "--n", "2", "--option", "length=4",
                 "--no-color"]) == 0
    out = capsys.readouterr().out
    assert out.count("PROMPT| Reverse the word ") == 2 and "reward 1  success True" in out


# --------------------------------------------------------------------------- transcripts, README
@pytest.mark.parametrize("env", ["math_tool", "math_levels", "code_repair", "noisy_lookup", "style_shift"])
def test_envs_md_samples_match_the_command(env, capsys):
    text = (DOCS / "envs.md").read_text(encoding="utf-8")
    command = f"$ saorl envs sample {env} --n 1 --no-color\n"
    block = next(b for b in _blocks(text, "text") if b.startswith(command))
    assert main(["envs", "sample", env, "--n", "1", "--no-color"]) == 0
    assert capsys.readouterr().out.strip() == block[len(command):].strip()


@pytest.mark.parametrize("env", ["reasoning_gym", "textarena"])
def test_envs_md_community_samples_match_the_command(env, capsys):
    """The community envs' transcripts (their packages: the envs extra), commands with options."""
    if os.environ.get("SAORL_REQUIRE_ENVS") != "1":  # CI: a missing package fails below
        pytest.importorskip(env)
    text = (DOCS / "envs.md").read_text(encoding="utf-8")
    block = next(b for b in _blocks(text, "text") if b.startswith(f"$ saorl envs sample {env} "))
    command, _, transcript = block.partition("\n=== ")
    args = shlex.split(command[len("$ saorl "):].replace("\\\n", " "))
    assert main(args) == 0
    assert capsys.readouterr().out.strip() == ("=== " + transcript).strip()


def test_envs_md_chat_turns_sample_matches_the_command(tmp_path, capsys):
    """The worked chat-turns example: its tokenizer snippet, run, then the command it quotes."""
    text = (DOCS / "envs.md").read_text(encoding="utf-8")
    snippet = next(b for b in _blocks(text, "python") if b.startswith("# a tokenizer with a tool-role"))
    exec(compile(snippet.replace('"DIR"', repr(str(tmp_path))), "docs/envs.md", "exec"), {})
    command = "$ saorl envs sample math_tool --n 1 --observation-format chat --tokenizer DIR --no-color\n"
    block = next(b for b in _blocks(text, "text") if b.startswith(command))
    args = command[2:].split()[1:]
    assert main([a if a != "DIR" else str(tmp_path) for a in args]) == 0
    assert capsys.readouterr().out.strip() == block[len(command):].strip()


def test_readme_lists_exactly_the_cli_commands_and_links_resolve():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Command line", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `saorl ([a-z-]+)", section, re.M))
    assert listed == set(COMMANDS), f"README lists {sorted(listed)}, the CLI has {sorted(COMMANDS)}"
    for link in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / link).exists(), f"README links to missing {link}"


QUICK_START = [  # CI runs the second verbatim: the README shows exactly these
    "python3 -m venv .venv && . .venv/bin/activate && pip install -c constraints-cpu.txt -e . && saorl train",
    "python3 -m venv .venv && . .venv/bin/activate && pip install -c constraints-cpu.txt "
    '-e ".[dev,ray,envs]" && ruff check . && pytest -n 2',
]


def test_readme_is_a_front_page():
    """Two screens: what saorl is, the Quick start's two commands, what to expect, the commands,
    links. The rest lives in docs/ (docs/guide.md, docs/fault-tolerance.md)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 90
    assert _blocks(readme, "bash") == [c + "\n" for c in QUICK_START]
    expect = next(p for p in readme.split("\n\n") if p.startswith("Expect "))  # what to expect
    assert all(word in expect for word in (" min ", "accuracy", "step 200", "runs")), expect
    _expect_matches_the_guide(expect)
    for page in ("guide.md", "fault-tolerance.md"):
        assert f"](docs/{page})" in readme
    guide = (DOCS / "guide.md").read_text(encoding="utf-8")
    for moved in ("## What a run produces", "## From Python", "## Configuration", "## Algorithms",
                  "## Environments", "## Scaling out"):
        assert moved in guide


def _expect_matches_the_guide(expect: str) -> None:
    """The README's accuracy range at step 200 holds every measured run at the default lr in
    docs/guide.md's table (rounded to two places), and its step-0 accuracy is theirs."""
    guide = (DOCS / "guide.md").read_text(encoding="utf-8")
    found = re.search(r"to (0\.\d+)[-–](0\.\d+) at step 200", expect)
    assert found, f"the README's what-to-expect gives no 'to LO-HI at step 200': {expect}"
    lo, hi = map(float, found.groups())
    start = float(re.search(r"from (0\.\d+) at step 0", expect).group(1))
    rows = [r for r in guide.splitlines() if re.match(r"\| \d+ \| (\*\*)?3e-5", r)]
    assert len(rows) >= 5, "guide.md's table of Quick start runs at the default lr"
    for row in rows:
        accs = [float(a) for a in re.findall(r"0\.\d{3}", row.split("|")[3])]
        assert accs[0] == start and lo - 0.005 <= accs[-1] <= hi + 0.005, (row, lo, hi)


def test_envs_md_quotes_the_example_reward_module_verbatim():
    text = (DOCS / "envs.md").read_text(encoding="utf-8")
    header = "# examples/prompt_reward/my_rewards.py\n"
    block = next(b for b in _blocks(text, "python") if b.startswith(header))
    source = ROOT / "examples" / "prompt_reward" / "my_rewards.py"
    assert block[len(header):] == source.read_text(encoding="utf-8")


# ------------------------------------------------------------------------------------ scaling
def test_scaling_md_train_commands_load_as_configs():
    """Every ``saorl train`` / ``torchrun ... saorl.cli train`` command in docs/scaling.md names a
    config that exists and overrides that validate (what a user pastes fails at load, not later)."""
    from saorl.config import load_config

    text = (DOCS / "scaling.md").read_text(encoding="utf-8")
    commands = [line for block in _blocks(text, "bash") for line in block.replace("\\\n", " ").splitlines()]
    checked = 0
    for line in commands:
        m = re.search(r"saorl(?:\.cli)? train (.*)", line)
        if m is None or "--resume" in line:
            continue
        args = [a for a in re.sub(r"--run-dir \S+", "", m.group(1)).split() if not a.startswith("-")]
        path = ROOT / args[0] if args and args[0].endswith(".yaml") else None
        overrides = args[1:] if path else args
        assert path is None or path.is_file(), line
        load_config(path, overrides)
        checked += 1
    assert checked >= 4
