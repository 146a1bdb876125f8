"""saorl.atomic: a file or directory is replaced whole or not at all, and no temporary is left."""

import json

import pytest

from saorl.atomic import atomic_dir, atomic_file, write_json, write_text


def test_a_file_is_replaced_whole_and_an_exception_leaves_the_old_one(tmp_path):
    path = tmp_path / "sub" / "config.yaml"
    write_text(path, "a: 1\n")
    assert path.read_text() == "a: 1\n"
    with pytest.raises(RuntimeError), atomic_file(path) as tmp:
        tmp.write_text("half-writ")
        raise RuntimeError("killed midway")
    assert path.read_text() == "a: 1\n"
    assert sorted(p.name for p in path.parent.iterdir()) == ["config.yaml"]  # no temporary left
    write_json(path, {"b": 2}, indent=1)
    assert json.loads(path.read_text()) == {"b": 2}
    assert sorted(p.name for p in path.parent.iterdir()) == ["config.yaml"]


def test_a_directory_is_replaced_whole_and_an_exception_leaves_the_old_one(tmp_path):
    out = tmp_path / "final"
    with atomic_dir(out) as tmp:
        (tmp / "x.txt").write_text("1")
    with pytest.raises(ValueError), atomic_dir(out) as tmp:
        (tmp / "x.txt").write_text("2")
        raise ValueError("no")
    assert (out / "x.txt").read_text() == "1"
    with atomic_dir(out) as tmp:
        (tmp / "y.txt").write_text("3")
    assert sorted(p.name for p in out.iterdir()) == ["y.txt"]  # the old directory is gone whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_an_atomic_directory_is_readable_as_a_plain_mkdir_would_be(tmp_path):
    import os
    import stat

    from saorl.atomic import atomic_dir

    old = os.umask(0o022)
    try:
        with atomic_dir(tmp_path / "model") as tmp:
            (tmp / "sub").mkdir(mode=0o700)
            (tmp / "sub" / "weights.safetensors").write_bytes(b"x")
            os.chmod(tmp / "sub" / "weights.safetensors", 0o600)
            (tmp / "run.sh").write_text("")
            os.chmod(tmp / "run.sh", 0o700)
    finally:
        os.umask(old)
    made = [tmp_path / "model", *(tmp_path / "model").rglob("*")]
    mode = {p.name: stat.S_IMODE(p.stat().st_mode) for p in made}
    assert mode == {"model": 0o755, "sub": 0o755, "weights.safetensors": 0o644, "run.sh": 0o755}


def test_an_atomic_file_is_readable_as_a_plain_open_would_leave_it(tmp_path):
    import os
    import stat

    import torch
    from safetensors.torch import save_file

    from saorl.atomic import atomic_file

    old = os.umask(0o022)
    try:
        with atomic_file(tmp_path / "w.safetensors") as tmp:
            save_file({"x": torch.zeros(2)}, str(tmp))  # safetensors itself writes 0600
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "w.safetensors").stat().st_mode) == 0o644
