"""The ``saorl`` command line itself: start-up imports, help text."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from saorl.cli import build_parser
from saorl.models.tiny import TINY_KINDS

HEAVY = ("torch", "transformers", "matplotlib")


def _imported_after(code: str) -> dict[str, bool]:
    """Which of HEAVY a fresh interpreter has imported after running ``code``."""
    probe = f"import sys\n{code}\nprint(*[m in sys.modules for m in {HEAVY!r}])"
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return dict(zip(HEAVY, (x == "True" for x in r.stdout.split()[-len(HEAVY):])))


@pytest.mark.parametrize("code", [
    "import saorl.cli; saorl.cli.build_parser()",
    "from saorl.cli import main; main(['config'])",
    "from saorl.cli import main; main(['envs', 'list'])",
    "from saorl.cli import main; main(['--version'])",
    "from saorl.cli import main\ntry:\n    main(['train', '--help'])\nexcept SystemExit:\n    pass",
])
def test_help_config_and_env_list_import_no_tensor_library(code):
    # every command module is imported to build the parser: none may pull torch in at import time
    assert _imported_after(code) == dict.fromkeys(HEAVY, False)


def test_top_level_help_imports_no_command_module():
    probe = ("import sys\nfrom saorl.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n"
             "    pass\nprint(sorted(m for m in sys.modules if m.startswith('saorl.commands.')),\n"
             "      'pydantic' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "COMMAND" in r.stdout and r.stdout.splitlines()[-1] == "[] False", r.stdout


def test_only_the_command_being_run_is_set_up():
    parser = build_parser("envs")
    args = parser.parse_args(["envs", "list"])
    assert args.envs_command == "list"
    with pytest.raises(SystemExit):  # train's arguments were never added
        build_parser(None).parse_args(["train", "--resume", "x"])
    assert build_parser().parse_args(["train", "--resume", "x"]).resume.name == "x"


def _subparsers(parser: argparse.ArgumentParser, prefix: str = "saorl"):
    yield prefix, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subparsers(sub, f"{prefix} {name}")


def test_help_text_has_no_rst_markup():
    for name, parser in _subparsers(build_parser()):
        text = parser.format_help()
        assert "``" not in text and ":class:" not in text and ":func:" not in text, (name, text)


def test_serve_help_shows_the_default_of_every_option_that_takes_a_value():
    parser = next(p for name, p in _subparsers(build_parser()) if name == "saorl serve")
    for action in parser._actions:
        if action.option_strings and action.nargs != 0:
            assert action.help and "%(default)" in parser._get_formatter()._get_help_string(action), action
    text = " ".join(parser.format_help().split())
    assert "(default: 8000)" in text and "(default: cpu)" in text
    assert all(kind in text for kind in TINY_KINDS)


def test_no_progress_bar_reaches_a_log_file():
    """stderr not a terminal (a log file, a pipe): a tqdm bar (the GGUF conversion's) prints nothing."""
    probe = ("import contextlib, io, os\nfrom saorl.cli import main\n"
             "with contextlib.redirect_stdout(io.StringIO()):\n    main(['config'])\n"
             "from tqdm.auto import tqdm\nlist(tqdm(range(3), desc='Converting GGUF tensors'))\n"
             "print(os.environ['TQDM_DISABLE'])")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TQDM_")}
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "1" and "Converting GGUF tensors" not in res.stderr, res.stderr
