"""The wheel ships the YAML presets: ``saorl train sao_math_tool`` and ``saorl experiment math`` work
from an installed package in any directory, not only from a source checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from saorl.config import PRESET_DIR, find_config, load_config, preset_names

ROOT = Path(__file__).resolve().parents[1]


def test_presets_resolve_by_name_and_by_checkout_path_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no configs/ here
    assert find_config("sao_code_repair") == PRESET_DIR / "sao_code_repair.yaml"
    assert find_config("sao_code_repair.yaml") == PRESET_DIR / "sao_code_repair.yaml"
    assert find_config("configs/sao_code_repair.yaml") == PRESET_DIR / "sao_code_repair.yaml"
    assert load_config("sao_code_repair").env.type == "code_repair"
    (tmp_path / "sao_code_repair.yaml").write_text("seed: 7\n")  # a file of that name here wins
    assert load_config("sao_code_repair.yaml").seed == 7
    assert set(preset_names()) == {p.stem for p in (ROOT / "configs").glob("*.yaml")}
    with pytest.raises(Exception, match=r"presets: grpo_dis_math_tool, grpo_math_tool"):
        find_config("sao_math_tol")


@pytest.mark.slow
def test_the_wheel_ships_the_presets_and_finds_them_when_installed(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "saorl", src / "saorl", symlinks=True, ignore=ignore)  # saorl/configs: a link
    shutil.copytree(ROOT / "configs", src / "configs", ignore=ignore)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(src),
                    "-w", str(tmp_path / "dist")], check=True, capture_output=True, timeout=300)
    wheel = next((tmp_path / "dist").glob("saorl-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for preset in (ROOT / "configs").rglob("*.yaml"):
        assert f"saorl/{preset.relative_to(ROOT).as_posix()}" in names
    assert "saorl/engines/vllm_plugin/saorl_vllm.py" in names  # loaded by vLLM servers, not imported
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                    str(wheel)], check=True, capture_output=True, timeout=300)
    probe = ("import saorl, saorl.config as c\n"
             "from saorl.experiments.spec import find_spec, load_spec, resolve_base\n"
             "spec = find_spec('math')\n"
             "base = resolve_base(load_spec(spec), spec)\n"
             "from saorl.commands.check_server import PLUGIN_DIR\n"
             "assert (PLUGIN_DIR / 'saorl_vllm.py').is_file(), PLUGIN_DIR\n"
             "print(saorl.__file__, spec, base, c.load_config('sao_math_tool').run.name)")
    work = tmp_path / "work"
    work.mkdir()
    r = subprocess.run([sys.executable, "-c", probe], cwd=work, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(site)})
    assert r.returncode == 0, r.stderr
    module, spec, base, name = r.stdout.split()
    assert module.startswith(str(site)) and spec.startswith(str(site)) and base.startswith(str(site))
    assert spec.endswith("saorl/configs/experiments/math.yaml")
    assert base.endswith("saorl/configs/sao_math_tool.yaml")
    assert name == "sao-math_tool"
