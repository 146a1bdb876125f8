import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from saorl.cli import main

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("args, message", [
    (["--max-pending", "0"], "--max-pending must be >= 1"),
    (["--body-timeout", "0"], "--body-timeout must be > 0"),
    (["--weights-dir", "/nonexistent/dir"], "--weights-dir '/nonexistent/dir' is not a directory"),
    (["--chat-template", "/nonexistent.jinja"], "--chat-template '/nonexistent.jinja' is not a file"),
])
def test_bad_options_exit_2_with_one_line(capsys, args, message):
    assert main(["serve", *args]) == 2
    assert message in capsys.readouterr().err


def test_help_shows_defaults(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert "(default: 127.0.0.1)" in out and "(default: 512)" in out


@pytest.mark.slow
def test_serve_with_a_chat_template_answers_the_openai_client(tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "saorl.cli", "serve", "--port", "0",
                             "--chat-template", str(template)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("saorl serve: listening on http://127.0.0.1:"), line
        client = openai.OpenAI(base_url=line.split("listening on ")[1].strip() + "/v1", api_key="x")
        out = client.chat.completions.create(model="tiny-moe", max_tokens=4,
                                             messages=[{"role": "user", "content": "hello"}])
        assert out.choices[0].message.role == "assistant" and out.usage.completion_tokens >= 1
    finally:
        proc.terminate()
        proc.wait(timeout=20)
