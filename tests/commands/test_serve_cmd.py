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
    (["--header-timeout", "nan"], "--header-timeout must be > 0"),
    (["--max-json-depth", "0"], "--max-json-depth must be >= 1"),
    (["--weights-dir", "/nonexistent/dir"], "--weights-dir '/nonexistent/dir' is not a directory"),
    (["--chat-template", "/nonexistent.jinja"], "--chat-template '/nonexistent.jinja' is not a file"),
    (["--moe-top-k", "0"], "--moe-top-k must be >= 1"),
    (["--router-noise", "-1"], "--router-noise must be >= 0"),
    (["--moe-top-k", "9"], "top_k=9 is more than the model's 8 experts"),
    (["--model", "tiny-dense", "--enable-return-routed-experts"], "record_routes needs an MoE model"),
    (["--model", "tiny-dense", "--router-noise", "0.5"], "has no top-k MoE routers"),
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


@pytest.mark.slow
def test_serve_returns_the_routes_of_its_perturbed_routing_to_the_sglang_client(tmp_path):
    from saorl.engines import SamplingParams
    from saorl.engines.routes import RouteLayout
    from saorl.engines.sglang_client import SglangEngine

    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "saorl.cli", "serve", "--port", "0", "--emulate", "sglang",
                             "--enable-return-routed-experts", "--moe-top-k", "3", "--no-stop-on-eos"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("saorl serve: listening on http://127.0.0.1:"), line
        client = SglangEngine(line.split("listening on ")[1].strip(), return_routes=True,
                              route_layout=RouteLayout(4, 8))
        res = client.generate([[5, 6, 7]], SamplingParams(max_new_tokens=5, seed=0))[0]
        client.close()
        # 3 prompt + 5 sampled - 1 positions fed; 4 MoE layers x the server's 3 experts each
        assert len(res.routes) == 7 and {len(r) for r in res.routes} == {12}
    finally:
        proc.terminate()
        proc.wait(timeout=20)
