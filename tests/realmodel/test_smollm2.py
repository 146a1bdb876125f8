"""SmolLM2-135M-Instruct through saorl's paths: ``saorl eval``, ``saorl serve`` answering the
``openai`` client, a 2-step SAO run whose ``final/policy`` plain transformers loads, tied
embeddings intact."""

import json
import os
import subprocess
import sys

import openai
import torch
from realmodel import NAME, REPO, saorl
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

QUESTION = [{"role": "user", "content": "What is 2+3? Answer with the number."}]


def _greedy(model_dir, messages, n: int) -> str:
    """Plain transformers: the chat template, then ``n`` greedy tokens (stopping at eos)."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=n, do_sample=False)
    return tok.decode(out[0][ids["input_ids"].shape[1]:], skip_special_tokens=True)


def test_saorl_eval_runs_the_real_model(smollm2, tmp_path):
    out = saorl("eval", NAME, "--tasks", "2", "--json", "rollout.max_new_tokens=16",
                "env.options.max_turns=2", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = json.loads(out.stdout)
    assert metrics["eval/episodes"] == 2 and 0.0 <= metrics["eval/accuracy"] <= 1.0
    assert metrics["eval/action_tokens_mean"] > 0


def test_saorl_serve_answers_the_openai_client_as_transformers_does(smollm2, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "saorl.cli", "serve", "--model", NAME, "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=tmp_path,
                            env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("saorl serve: listening on http://127.0.0.1:"), line
        client = openai.OpenAI(base_url=line.split("listening on ")[1].strip() + "/v1", api_key="x",
                               timeout=600)
        reply = client.chat.completions.create(model=NAME, max_tokens=12, temperature=0, messages=QUESTION)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    msg = reply.choices[0].message
    assert msg.role == "assistant" and "5" in msg.content
    assert msg.content == _greedy(smollm2, QUESTION, 12)  # the same tokens plain transformers picks


def test_two_sao_steps_train_the_real_model_and_final_policy_loads_in_transformers(smollm2, tmp_path):
    out = saorl("train", f"model.policy={NAME}", "sft.enabled=false", "value_pretrain.enabled=false",
                "trainer.steps=2", "trainer.batch_size=2", "trainer.policy_lr=1e-6", "trainer.critic_lr=5e-6",
                "rollout.concurrent_episodes=2", "rollout.engine.slots=2", "rollout.max_new_tokens=16",
                "env.options.max_turns=2",
                "run.eval_at_start=false", "run.eval_tasks=2", "run.report_to=[]", "run.progress=false",
                "run.out_dir=runs", "run.name=smollm2", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    # a real model: the start-up estimate, timed here, of every phase the run has
    assert "start-up estimate, from a " in out.stdout, out.stdout[-3000:]
    phases = json.loads((run / "estimate.json").read_text())["phases"]
    assert [p["phase"] for p in phases] == ["evaluation", "sao"] and phases[1]["each"] > 0
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 2
    final = run / "final" / "policy"
    assert json.loads((final / "config.json").read_text())["tie_word_embeddings"] is True
    with safe_open(final / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in set(f.keys())  # tied: the embedding only, as in the source
    trained = AutoModelForCausalLM.from_pretrained(str(final))
    base = AutoModelForCausalLM.from_pretrained(str(smollm2))
    assert trained.lm_head.weight.data_ptr() == trained.model.embed_tokens.weight.data_ptr()
    base_sd = base.state_dict()
    change = max((v - base_sd[k]).abs().max().item() for k, v in trained.state_dict().items())
    assert 0 < change < 1e-3  # trained, at a pretrained model's learning rate: moved, not broken
    text = _greedy(final, QUESTION, 12)
    assert "5" in text, text
