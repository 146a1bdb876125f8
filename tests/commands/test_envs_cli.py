from saorl.cli import main
from saorl.commands.envs import parse_options


def test_parse_options_reads_yaml_values():
    got = parse_options(["family=countdown", "difficulty=2", "hint=true", "schedule=[sweet, classical]"])
    assert got == {"family": "countdown", "difficulty": 2, "hint": True, "schedule": ["sweet", "classical"]}


def test_list_names_every_builtin(capsys):
    assert main(["envs", "list"]) == 0
    out = capsys.readouterr().out
    for name in ("math_tool", "code_repair", "style_shift"):
        assert name in out


def test_sample_plays_demonstrations_with_token_counts(capsys):
    args = ["envs", "sample", "style_shift", "--n", "2", "--split", "test", "--seed", "3",
            "--option", "demo_error_rate=0", "--progress-step", "250"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.count("PROMPT| ") == 2 and out.count("ACT   | ") == 2
    assert out.count("tokens: prompt ") == 2 and "style=classical" in out
    assert "(test)" in out


def test_sample_reports_bad_input(capsys):
    assert main(["envs", "sample", "math_tool", "--option", "family=algebra"]) == 2
    assert "family must be one of" in capsys.readouterr().err
    assert main(["envs", "sample", "nope"]) == 2
    assert "unknown env 'nope'" in capsys.readouterr().err
    assert main(["envs", "sample", "math_tool", "--option", "difficulty"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err


def test_sample_shows_a_conversation_and_the_rewards_of_a_jsonl_without_ids(tmp_path, capsys):
    import json

    chat = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "2+3?"}]
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"prompt": chat, "answer": 5, "solution": "5"}) + "\n")
    args = ["envs", "sample", "prompt_reward", "--tasks-file", str(path), "--n", "1", "--no-color",
            "--option", "reward_fn=saorl.envs.rewards:number_answer", "--option", "demo_column=solution"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "PROMPT| system: Answer with a number.\n" in out and "user: 2+3?" in out
    assert "reward 1  success True" in out


def test_sample_shows_observations_as_chat_turns(tmp_path, capsys):
    from saorl.models.tokenizer import load_tokenizer

    hf = load_tokenizer()
    hf.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{{ eos_token }}\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    hf.save_pretrained(str(tmp_path))
    args = ["envs", "sample", "math_tool", "--n", "1", "--no-color", "--observation-format", "chat",
            "--observation-role", "user", "--tokenizer", str(tmp_path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "PROMPT| <|im_start|>user\n" in out and "OBS   | <|endoftext|>\nOBS   | <|im_start|>user\n" in out
    assert "OBS   | <|im_start|>assistant\nACT   | <answer>" in out and "(observations as chat turns)" in out
    assert main(args[:-2]) == 2  # the shipped tokenizer has no chat template
    err = capsys.readouterr().err
    assert err.startswith("saorl envs sample: env.observation_format=chat renders observations through the "
                          "chat template, and the run's tokenizer (the shipped one) has none.")
