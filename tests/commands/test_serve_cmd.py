import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from saorl.cli import main
from saorl.models.tokenizer import ASSET_DIR

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
    (["--max-model-len", "1"], "--max-model-len must be >= 2"),
    (["--max-model-len", "99999"], "--max-model-len 99999 is past the model's max_position_embeddings"),
    (["--generation-config", "/nonexistent"], "'/nonexistent' is neither auto, vllm nor a directory"),
    (["--served-model-name", ""], "--served-model-name: every name must be non-empty"),
    (["--emulate", "http"], "--emulate must be one of vllm, sglang, got 'http'"),
    (["--model", "/etc"], "--model '/etc' holds no tokenizer (none of tokenizer.json"),
    (["--model", "/etc"], "set --tokenizer to the directory"),
    (["--model", "/etc/passwd"], "--model '/etc/passwd' is a file, not a model; --model takes a tiny"),
    (["--model", "/etc", "--tokenizer", str(ASSET_DIR)], "policy directory '/etc' has no config.json"),
])
def test_bad_options_exit_2_with_one_line(capsys, args, message):
    assert main(["serve", *args]) == 2
    assert message in capsys.readouterr().err


def test_a_run_directory_serves_its_final_policy_or_its_last_checkpoint_or_names_resume(tmp_path, capsys):
    import json

    import torch

    from saorl.commands.serve import resolve_model
    from saorl.config import load_config, save_resolved
    from saorl.models.serialize import save_safetensors_atomic
    from saorl.models.tiny import build_tiny

    run = tmp_path / "run"
    save_resolved(load_config(None, ["sft.enabled=false", "model.policy=tiny-dense"]), run)
    (run / "checkpoints").mkdir(parents=True)
    assert main(["serve", "--model", str(run)]) == 2
    err = capsys.readouterr().err
    assert "has no final policy (final/policy) and no checkpoint yet" in err and "\n" not in err.strip()
    assert f"saorl train --resume {run}" in err
    trained = build_tiny("tiny-dense", seed=5)  # a killed run's checkpoint at step 7
    ckpt = run / "checkpoints" / "step-00000007"
    save_safetensors_atomic(trained.state_dict(), ckpt / "policy.safetensors")
    (ckpt / "manifest.json").write_text(json.dumps({"step": 7}))
    (run / "checkpoints" / "latest").write_text("step-00000007")
    source, loader = resolve_model(str(run))
    assert source == "tiny-dense" and loader is not None
    err = capsys.readouterr().err
    assert f"using its last checkpoint, step 7 ({ckpt})" in err and f"saorl train --resume {run}" in err
    for p, q in zip(loader().parameters(), trained.parameters()):
        assert torch.equal(p, q)
    (run / "final" / "policy").mkdir(parents=True)
    (run / "final" / "policy" / "config.json").write_text("{}")
    assert resolve_model(str(run)) == (str(run / "final" / "policy"), None)
    assert resolve_model("tiny-moe") == ("tiny-moe", None)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "manifest.json").write_text("{}")
    with pytest.raises(ValueError, match="is a checkpoint directory"):
        resolve_model(str(tmp_path / "ckpt"))


def test_a_generation_config_default_the_engine_cannot_apply_is_refused(tmp_path, capsys):
    from saorl.models.serialize import export_policy
    from saorl.models.tiny import build_tiny
    from saorl.models.tokenizer import load_tokenizer

    model = export_policy(build_tiny("tiny-dense", seed=0), load_tokenizer(), tmp_path / "m")
    (model / "generation_config.json").write_text('{"repetition_penalty": 1.1, "temperature": 0.7}')
    assert main(["serve", "--model", str(model)]) == 2
    err = capsys.readouterr().err
    assert "generation_config.json sets repetition_penalty=1.1" in err and "--generation-config vllm" in err


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
    from saorl.engines.clients.routes import RouteLayout
    from saorl.engines.clients.sglang_client import SglangEngine

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
