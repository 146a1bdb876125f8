"""``saorl eval``: policy dirs, run dirs, checkpoints and tiny kinds; the table, episodes, errors."""

import json
import time

import pytest
import torch

from saorl.cli import main
from saorl.commands.eval import TargetError, resolve_target
from saorl.config import load_config, save_resolved
from saorl.data.tasks import load_tasks
from saorl.envs.registry import make_env_factory
from saorl.models.codec import run_tokenizer
from saorl.models.serialize import export_policy, save_safetensors_atomic
from saorl.models.tiny import build_tiny
from saorl.models.tokenizer import load_tokenizer
from saorl.stages.evaluate import eval_tasks

# math_tool, short turns: a few seconds per evaluation of 4 tasks on the tiny model
FAST = ["env.num_test_tasks=4", "env.options.max_turns=2", "rollout.max_new_tokens=6",
        "rollout.max_total_tokens=96"]


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return export_policy(build_tiny("tiny-dense", seed=0), load_tokenizer(),
                         tmp_path_factory.mktemp("export") / "policy")


def _fake_run(tmp_path, policy_dir=None, **settings):
    run = tmp_path / "run"
    cfg = load_config(None, ["sft.enabled=false", "model.policy=tiny-dense", f"run.out_dir={tmp_path}",
                             *FAST, *(f"{k}={v}" for k, v in settings.items())])
    save_resolved(cfg, run)
    if policy_dir is not None:
        export_policy(build_tiny("tiny-dense", seed=0), load_tokenizer(), run / "final" / "policy")
    return run


def test_eval_policy_dir_prints_table_and_an_episode(policy_dir, capsys):
    rc = main(["eval", str(policy_dir), *FAST, "--tasks", "4", "--show", "1", "--no-color"])
    out = capsys.readouterr().out
    assert rc == 0
    assert f"policy  {policy_dir}" in out and "math_tool, test split, 4 episodes, temperature 1" in out
    rows = {line[:20].strip(): line[20:].strip() for line in out.splitlines() if line[:20].strip()}
    assert rows["episodes"] == "4"
    assert 0.0 <= float(rows["accuracy"]) <= 1.0 and 1.0 <= float(rows["turns mean"]) <= 2.0
    assert float(rows["action tokens mean"]) > 0
    # one episode shown, the model's actions and the env's observations marked apart
    assert out.count("== task math_tool/") == 1
    assert "[prompt]" in out and "[act 1]" in out and "[reward 1:" in out and "[obs " in out
    assert "\x1b[" not in out


def test_eval_json_defaults_to_the_runs_test_set(policy_dir, capsys):
    rc = main(["eval", str(policy_dir), *FAST, "--json", "--show", "1"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0
    # min(run.eval_tasks = 64, env.num_test_tasks = 4) episodes, as a run's evaluation
    assert data["split"] == "test" and data["eval/episodes"] == 4.0
    assert data["temperature"] == 1.0  # run.eval_temperature, as in training runs
    assert data["policy"] == str(policy_dir) and len(data["samples"]) == 1
    assert data["samples"][0].startswith("== task math_tool/")


@pytest.mark.parametrize("make, why", [
    (lambda p: p / "missing", "does not exist (relative to"),
    (lambda p: (p / "file.txt").write_text("x") and p / "file.txt", "is a file"),
    (lambda p: p, "is not a run directory (no config.yaml)"),
])
def test_bad_target_is_one_clear_line(tmp_path, capsys, make, why):
    rc = main(["eval", str(make(tmp_path))])
    err = capsys.readouterr().err
    assert rc == 2 and why in err and err.count("\n") == 1 and err.startswith("saorl eval: ")
    if "relative to" in why or "is a file" in why:  # the one message of the model source's kinds
        assert "a tiny built-in kind (tiny-moe, tiny-dense)" in err and "a .gguf file" in err
        assert "a short model name (smollm2-135m-instruct" in err and "a run directory" in err


def test_bad_override_and_bad_tasks(policy_dir, capsys):
    assert main(["eval", str(policy_dir), "rollout.temprature=1"]) == 2
    assert "did you mean temperature" in capsys.readouterr().err
    assert main(["eval", str(policy_dir), "notanoverride"]) == 2
    assert "expected key=value" in capsys.readouterr().err


def test_eval_run_dir_uses_its_config_and_final_policy(tmp_path, policy_dir, capsys):
    run = _fake_run(tmp_path, policy_dir, **{"run.eval_tasks": 3})
    rc = main(["eval", str(run)])
    out = capsys.readouterr().out
    assert rc == 0
    assert f"{run / 'final' / 'policy'} (final policy)" in out
    assert ", 3 episodes" in out  # run.eval_tasks of the run's config; FAST settings came from it too


def test_run_dir_without_final_policy_loads_the_latest_checkpoint(tmp_path, capsys):
    run = _fake_run(tmp_path)
    with pytest.raises(TargetError, match=r"no final policy .* and no checkpoint yet.*saorl train --resume"):
        resolve_target(str(run), [])
    model = build_tiny("tiny-dense", seed=5)  # weights differ from the run's initial tiny-dense (seed 0)
    ckpt = run / "checkpoints" / "step-00000007"
    save_safetensors_atomic(model.state_dict(), ckpt / "policy.safetensors")
    (ckpt / "manifest.json").write_text(json.dumps({"step": 7}))
    (run / "checkpoints" / "latest").write_text("step-00000007")
    for target in (run, ckpt):
        t = resolve_target(str(target), ["seed=0"])
        assert "checkpoint" in t.description and str(ckpt) in t.description
        err = capsys.readouterr().err  # the run directory: which step, and how to continue the run
        assert (f"using its last checkpoint, step 7 ({ckpt})" in err) == (target == run), err
        assert (f"saorl train --resume {run} continues the run" in err) == (target == run)
        loaded = t.load()
        for (name, p), q in zip(loaded.named_parameters(), model.parameters()):
            assert torch.equal(p, q), name


def test_a_config_file_gives_the_env_and_settings_and_model_the_policy(tmp_path, policy_dir, capsys):
    """saorl eval CONFIG.yaml [MODEL]: the config's env, test split and settings; MODEL any target
    (a run brings its model section), by default the config's own model.policy."""
    config = tmp_path / "recipe.yaml"
    config.write_text("model:\n  policy: tiny-moe\nenv:\n  num_test_tasks: 4\n  options: {max_turns: 2}\n"
                      "rollout:\n  max_new_tokens: 6\n  max_total_tokens: 96\nrun:\n  eval_tasks: 3\n"
                      "  eval_temperature: 0.0\n")
    own = resolve_target(str(config), ["seed=3"])
    assert own.cfg.model.policy == "tiny-moe" and f"model.policy of {config}" in own.description
    assert torch.equal(next(own.load().parameters()), next(build_tiny("tiny-moe", seed=3).parameters()))
    other = resolve_target(str(config), [], model=str(policy_dir))
    assert other.cfg.model.policy == str(policy_dir) and other.cfg.run.eval_tasks == 3
    run = _fake_run(tmp_path, policy_dir, **{"run.eval_tasks": 2, "model.chat_template": "false"})
    from_run = resolve_target(str(config), [], model=str(run))
    assert from_run.cfg.model == load_config(run / "config.yaml").model and from_run.cfg.run.eval_tasks == 3
    assert "(final policy)" in from_run.description
    overridden = resolve_target(str(config), ["model.dtype=bfloat16", "run.eval_tasks=2"], model=str(run))
    assert overridden.cfg.model.dtype == "bfloat16" and overridden.cfg.run.eval_tasks == 2
    assert overridden.cfg.model.chat_template == load_config(run / "config.yaml").model.chat_template
    assert main(["eval", str(config), str(policy_dir), "env.options.max_turns=1"]) == 0
    out = capsys.readouterr().out
    assert f"policy  {policy_dir}" in out
    assert "math_tool, test split, 3 episodes, greedy (run.eval_temperature)" in out


def test_tiny_kind_target():
    t = resolve_target("tiny-moe", ["seed=3"])
    assert t.cfg.model.policy == "tiny-moe"
    assert run_tokenizer(t.cfg.model).spec.source is None  # the shipped tokenizer
    assert "freshly initialised" in t.description
    p0 = next(t.load().parameters())
    assert torch.equal(p0, next(build_tiny("tiny-moe", seed=3).parameters()))


def test_eval_tasks_splits():
    cfg = load_config(None, FAST)
    factory = make_env_factory(cfg.env.type, cfg.env.options)
    test = eval_tasks(cfg, factory, "test", 3)
    assert [t.id for t in test] == [t.id for t in load_tasks(factory(), "test", 4, 0)[:3]]
    train = eval_tasks(cfg, factory, "train", 2)
    assert len(train) == 2 and not {t.id for t in train} & {t.id for t in test}
    assert len(eval_tasks(cfg, factory, "test", 6)) == 6  # more than env.num_test_tasks when asked


def test_eval_counts_an_episode_whose_reward_function_hangs_as_failed(policy_dir, tmp_path, monkeypatch,
                                                                      capsys):
    (tmp_path / "stuck_rewards.py").write_text(
        "import time\n\ndef stuck(prompt, completion, **row):\n"
        "    if row['n'] % 2:\n        time.sleep(10**9)\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # the children that run the reward function get it too
    rows = [{"id": f"q{i}", "prompt": f"Say {i}: ", "n": i} for i in range(8)]
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    t0 = time.monotonic()
    rc = main(["eval", str(policy_dir), "env.type=prompt_reward", "env.options.reward_fn=stuck_rewards:stuck",
               f"env.tasks_file={tmp_path / 'tasks.jsonl'}", "env.num_test_tasks=4", "env.call_timeout_s=1",
               "rollout.max_new_tokens=4", "rollout.max_total_tokens=32", "--tasks", "4"])
    out, err = capsys.readouterr()
    assert rc == 0 and time.monotonic() - t0 < 60
    table = {line[:20].strip(): line[20:].strip() for line in out.splitlines() if line[:20].strip()}
    assert table["episodes"] == "4" and table["failed (timed out)"] == "2" and table["accuracy"] == "0.500"
    assert "2 of 4 evaluation episodes failed (counted as unsuccessful)" in err
    assert "reward function 'stuck_rewards:stuck' on task 'q5'" in err
    assert "did not return within 1 s (env.call_timeout_s)" in err


def test_a_reward_function_that_raises_is_a_run_failure_in_eval_and_train(tmp_path, capsys, monkeypatch):
    """A user's reward function failing is not a bug in saorl: exit status 3 in `saorl eval` and in
    a run's step-0 evaluation, as when it fails a training rollout too often."""
    import json

    (tmp_path / "bad_rewards.py").write_text("def broken(prompt, completion, **row):\n"
                                           "    raise KeyError('no column named solution')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    tasks = tmp_path / "t.jsonl"
    tasks.write_text("".join(json.dumps({"prompt": f"What is {i}+1?", "answer": i + 1}) + "\n"
                             for i in range(12)))
    common = ["env.type=prompt_reward", f"env.tasks_file={tasks}", "env.options.reward_fn=bad_rewards:broken",
              "env.num_test_tasks=4", "env.call_timeout_s=null", "sft.enabled=false",
              "value_pretrain.enabled=false", "run.progress=false", "rollout.max_new_tokens=8",
              "rollout.max_total_tokens=64"]
    assert main(["eval", "tiny-dense", *common, "--tasks", "2"]) == 3
    err = capsys.readouterr().err
    assert "bad_rewards:broken" in err and "KeyError" in err and "bug in saorl" not in err
    assert main(["train", *common, "run.eval_tasks=2", "--run-dir", str(tmp_path / "run")]) == 3
    err = capsys.readouterr().err
    assert "bad_rewards:broken" in err and "bug in saorl" not in err


def test_eval_checks_chat_observations_before_it_plays(policy_dir, capsys):
    """The policy directory's tokenizer (the shipped one) has no chat template: one paragraph, exit 2."""
    assert main(["eval", str(policy_dir), *FAST, "--tasks", "2", "env.observation_format=chat"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("saorl eval: env.observation_format=chat renders observations through the chat "
                          "template, and the run's tokenizer") and "has none" in err


def test_eval_checks_conversation_prompts_before_it_plays(policy_dir, tmp_path, capsys):
    """A base model (no chat template) on TRL-style conversational rows: one paragraph naming the row
    and the fix, exit 2, before any episode (not an unexpected error in the middle of the evaluation)."""
    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    for path, q in ((train, "2+2?"), (test, "1+1?")):
        path.write_text(json.dumps({"prompt": [{"role": "user", "content": q}], "answer": 2}) + "\n")
    assert main(["eval", str(policy_dir), "--tasks", "1", "env.type=prompt_reward",
                 "rollout.max_new_tokens=6", "env.options.reward_fn=saorl.envs.rewards:number_answer",
                 f"env.tasks_file={train}",
                 f"env.test_tasks_file={test}", "env.num_test_tasks=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"saorl eval: {train}: row 1 (task id 'row-")
    assert "the prompt is a conversation" in err
    assert "has none" in err and "bug in saorl" not in err
