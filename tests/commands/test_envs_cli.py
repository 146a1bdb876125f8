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
