"""Trackers: TensorBoard and W&B (offline, its run files read back) get every row, the ratio
histogram as a histogram; a missing tracker package is a clear error; the names match accelerate's."""

import glob
import math
import struct
import time

import pytest
from accelerate.tracking import LOGGER_TYPE_TO_CLASS
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from saorl.algo.losses import ratio_histogram_edges
from saorl.config import TRACKERS, ConfigError, load_config
from saorl.runtime import trackers as trackers_module
from saorl.runtime.recorder import RunRecorder
from saorl.runtime.trackers import (
    PACKAGES,
    TrackerFailed,
    Trackers,
    TrackerUnavailable,
    check_trackers,
    flat_config,
)

COUNTS = [0] * 24
COUNTS[3], COUNTS[11], COUNTS[12] = 1, 5, 7  # ratios around 1 (bins 11, 12), one far below


def read_wandb_records(path):
    """Records of a ``.wandb`` file: a 7-byte header, then LevelDB-log framed protobuf records."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    block, pos, buf, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (kind == 0 and n == 0):  # block trailer / padding
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
        buf = chunk if kind in (1, 2) else buf + chunk  # FULL, FIRST / MIDDLE, LAST
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
    return out


def finished_records(path, timeout_s=60.0):
    """The records once the file ends with its exit record: wandb's own service process finishes
    writing it after ``finish()`` returns."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = read_wandb_records(path)
        if records and records[-1].WhichOneof("record_type") == "exit":
            return records
        assert time.monotonic() < deadline, f"wandb never finished {path}"
        time.sleep(0.2)


def test_tracker_names_are_accelerates():
    assert set(TRACKERS) == set(LOGGER_TYPE_TO_CLASS) == set(PACKAGES)


def test_unknown_or_missing_trackers_are_clear_errors(monkeypatch):
    with pytest.raises(ConfigError, match=r"run\.report_to: unknown tracker 'tensorbord' \(did you mean"):
        load_config(None, ["run.report_to=[tensorbord]"])
    monkeypatch.setitem(PACKAGES, "wandb", ("saorl_no_such_module", "saorl[wandb]"))
    with pytest.raises(TrackerUnavailable, match=r"pip install 'saorl\[wandb\]'"):
        check_trackers(["tensorboard", "wandb"])
    check_trackers(["tensorboard"])


def test_report_to_as_trl_spells_it(tmp_path, monkeypatch):
    """A string (one tracker), ``none`` and ``all`` as transformers' ``TrainingArguments`` take them,
    from the command line and from YAML; ``all`` is resolved at load, so the saved config lists it."""
    import importlib.util

    from saorl.config import save_resolved

    assert load_config(None, ["run.report_to=wandb"]).run.report_to == ["wandb"]
    assert load_config(None, ["run.report_to=none"]).run.report_to == []
    assert load_config(None, ["run.report_to=[none]"]).run.report_to == []
    path = tmp_path / "cfg.yaml"
    path.write_text("run:\n  report_to: tensorboard\n")
    assert load_config(path).run.report_to == ["tensorboard"]
    installed = [n for n in TRACKERS if importlib.util.find_spec(PACKAGES[n][0]) is not None]
    cfg = load_config(None, ["run.report_to=all"])
    assert cfg.run.report_to == installed and "tensorboard" in installed  # a saorl dependency
    saved = save_resolved(cfg, tmp_path / "run")
    assert "report_to:\n  - tensorboard\n" in saved.read_text() and "all" not in saved.read_text().split()
    assert load_config(saved).run.report_to == installed
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # nothing installed
    assert load_config(None, ["run.report_to=all"]).run.report_to == []
    with pytest.raises(ConfigError, match=r"run\.report_to: null is ambiguous .* write none, all"):
        load_config(None, ["run.report_to=null"])
    with pytest.raises(ConfigError, match=r"run\.report_to: unknown tracker 'wandbb' \(did you mean wandb"):
        load_config(None, ["run.report_to=wandbb"])


def test_each_trackers_module_has_its_name():
    """``run.report_to: all`` finds a tracker's package by the tracker's name."""
    assert all(PACKAGES[name][0] == name for name in TRACKERS)


def test_flat_config():
    assert flat_config({"a": {"b": 1, "c": [1, 2]}, "d": None, "e": {}}) == \
        {"a.b": 1, "a.c": "[1, 2]", "d": "null", "e": "{}"}


def test_tensorboard_and_wandb_offline_get_every_row_and_the_histogram(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "sao-run"
    run_dir.mkdir()
    cfg = load_config(None, ["run.report_to=[tensorboard, wandb]",
                             "run.tracker_options={wandb: {mode: offline}}"])
    t = Trackers(cfg.run.report_to, run_dir, project="saorl-test", options=cfg.run.tracker_options,
                 config={"trainer": {"steps": 7}})
    rec = RunRecorder(run_dir, None, progress=False, trackers=t)
    rec.log_step({"step": 0, "policy/version": 0, "eval/accuracy": 0.25})  # the step-0 evaluation
    rec.log_step({"step": 1, "reward/mean": 0.5, "policy/ratio_hist": COUNTS, "critic/value_loss": math.nan})
    rec.close()

    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"histograms": 0, "scalars": 0}).Reload()
    assert [(e.step, e.value) for e in acc.Scalars("eval/accuracy")] == [(0, 0.25)]
    assert [e.step for e in acc.Scalars("reward/mean")] == [1]
    assert "critic/value_loss" not in acc.Tags()["scalars"]  # not finite: JSONL null only
    (hist,) = acc.Histograms("policy/ratio_hist")
    assert hist.step == 1 and hist.histogram_value.num == 13
    assert list(hist.histogram_value.bucket) == COUNTS
    edges = [math.log10(float(e)) for e in ratio_histogram_edges()]
    assert list(hist.histogram_value.bucket_limit) == pytest.approx(edges[1:])

    (wandb_file,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    records = finished_records(wandb_file)
    history = [{(i.key or "/".join(i.nested_key)): i.value_json for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert history[0]["_step"] == "0" and history[0]["eval/accuracy"] == "0.25"
    assert history[1]["_step"] == "1" and history[1]["policy/ratio_hist/_type"] == '"histogram"'
    assert history[1]["policy/ratio_hist/values"] == str(COUNTS).replace(" ", "")
    config = {i.key: i.value_json for r in records if r.WhichOneof("record_type") == "config"
              for i in r.config.update}
    assert config["trainer.steps"] == "7"
    runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert runs[0].display_name == "sao-run" and runs[0].project == "saorl-test"


def test_a_tracker_that_fails_to_start_closes_the_others(tmp_path, monkeypatch):
    closed, real_build = [], trackers_module._build

    class Boom(RuntimeError):
        pass

    def build(name, run_dir, project, options):
        if name == "wandb":
            raise Boom("no")
        tracker = real_build(name, run_dir, project, options)
        tracker.finish = lambda: closed.append(name)
        return tracker

    monkeypatch.setattr(trackers_module, "_build", build)
    with pytest.raises(TrackerFailed, match=r"^run\.report_to: the 'wandb' tracker failed to start: Boom: "
                                            r"no\. Check run\.tracker_options\.wandb .* kept: it holds what "
                                            r"tensorboard wrote\.$") as info:
        Trackers(["tensorboard", "wandb"], tmp_path)
    assert closed == ["tensorboard"] and info.value.started == ["tensorboard"]
    assert isinstance(info.value.__cause__, Boom)


def test_a_failed_start_keeps_the_files_a_tracker_wrote(tmp_path, monkeypatch):
    """The trackers start last; when one fails after another wrote, the run directory stays with
    those files (a W&B offline run, TensorBoard's events) instead of being removed with the start."""
    from saorl.training import train

    real_build = trackers_module._build

    def build(name, run_dir, project, options):
        if name == "wandb":
            raise RuntimeError("wandb.init: the service cannot start")
        return real_build(name, run_dir, project, options)

    monkeypatch.setattr(trackers_module, "_build", build)
    cfg = load_config(None, ["sft.enabled=false", "value_pretrain.enabled=false", "model.policy=tiny-moe",
                             "runtime.backend=inprocess", "env.num_train_tasks=20", "env.num_test_tasks=4",
                             "run.progress=false", "run.report_to=[tensorboard, wandb]"])
    run_dir = tmp_path / "run"
    with pytest.raises(TrackerFailed, match=r"'wandb' tracker failed to start: RuntimeError: wandb\.init"):
        train(cfg, run_dir)
    assert (run_dir / "tb").is_dir() and list((run_dir / "tb").glob("events.out.tfevents.*"))
    (hparams,) = (run_dir / "tb").glob("*/hparams.yml")  # the config TensorBoard stored
    assert "trainer.steps: 200" in hparams.read_text()
    # a start that fails before the trackers start (here: no tracker can be built) leaves nothing
    monkeypatch.setattr(trackers_module, "_build", lambda *a: (_ for _ in ()).throw(RuntimeError("x")))
    with pytest.raises(TrackerFailed) as info:
        train(cfg, tmp_path / "other")
    assert info.value.started == [] and not (tmp_path / "other").exists()
