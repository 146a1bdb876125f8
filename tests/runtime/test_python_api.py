"""The Python API: ``saorl.training.train(cfg)`` from a script, with rollout worker processes, works
without an ``if __name__ == "__main__":`` guard (spawned workers never run the script again)."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    from saorl.config import load_config
    from saorl.training import train

    print("SCRIPT TOP LEVEL RAN", flush=True)
    cfg = load_config(None, ["sft.enabled=false", "value_pretrain.enabled=false", "trainer.steps=2",
                             "run.eval_tasks=2", "env.num_test_tasks=4", "run.progress=false",
                             "rollout.max_new_tokens=8", "rollout.max_total_tokens=64"])
    run_dir, metrics = train(cfg, RUN_DIR)
    print("DONE", metrics["step"], metrics["policy/version"])
''')


def test_a_script_without_a_main_guard_trains_with_worker_processes(tmp_path):
    script = tmp_path / "no_guard.py"
    script.write_text(SCRIPT.replace("RUN_DIR", repr(str(tmp_path / "run"))))
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("SCRIPT TOP LEVEL RAN") == 1  # the workers did not run it again
    assert "DONE 2 2" in res.stdout
    assert (tmp_path / "run" / "final" / "policy" / "config.json").is_file()
