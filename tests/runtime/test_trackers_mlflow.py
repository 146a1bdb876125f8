"""MLflow for real (``pip install 'saorl[mlflow]'``): a run with ``run.report_to=[mlflow]`` logs into
a SQLite store in its run directory out of the box, and its metrics read back with MLflow's own
client; ``MLFLOW_TRACKING_URI`` (or ``run.tracker_options.mlflow.tracking_uri``) sends it elsewhere.
Skipped where mlflow (or the SQLAlchemy it needs for SQLite) is not installed: the dev extra
brings both."""

import pytest

pytest.importorskip("mlflow", reason="mlflow is not installed (pip install -e '.[mlflow]', or '.[dev]')")
pytest.importorskip("sqlalchemy", reason="SQLAlchemy is not installed (pip install -e '.[mlflow]')")

from mlflow.tracking import MlflowClient

from saorl.config import load_config
from saorl.data.jsonl import read_jsonl
from saorl.runtime.trackers import Trackers
from saorl.training import train


def _history(uri, metric):
    client = MlflowClient(tracking_uri=uri)
    (exp,) = [e for e in client.search_experiments() if e.name == "saorl-test"]
    (run,) = client.search_runs([exp.experiment_id])
    return run, {m.step: m.value for m in client.get_metric_history(run.info.run_id, metric)}


def test_a_run_logs_to_mlflow_in_its_run_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)  # MLflow's own default would write ./mlflow.db here
    cfg = load_config(None, ["sft.enabled=false", "value_pretrain.enabled=false", "model.policy=tiny-moe",
                             "runtime.backend=inprocess", "env.num_train_tasks=20", "env.num_test_tasks=4",
                             "run.eval_tasks=2", "run.progress=false", "trainer.steps=2",
                             "trainer.batch_size=2",
                             "rollout.max_new_tokens=12", "rollout.max_total_tokens=80",
                             "run.report_to=[mlflow]", "run.tracker_project=saorl-test"])
    run_dir, _ = train(cfg, tmp_path / "run")
    assert (run_dir / "mlflow" / "mlflow.db").is_file() and not (tmp_path / "mlflow.db").exists()
    rows = {r["step"]: r for r in read_jsonl(run_dir / "metrics.jsonl") if "step" in r}
    run, reward = _history(f"sqlite:///{run_dir / 'mlflow' / 'mlflow.db'}", "reward/mean")
    assert run.info.run_name == run_dir.name and run.data.params["trainer.steps"] == "2"
    assert reward == {1: pytest.approx(rows[1]["reward/mean"]), 2: pytest.approx(rows[2]["reward/mean"])}
    _, acc = _history(f"sqlite:///{run_dir / 'mlflow' / 'mlflow.db'}", "eval/accuracy")
    assert acc[0] == pytest.approx(rows[0]["eval/accuracy"])  # the step-0 evaluation


def test_mlflow_tracking_uri_is_respected(tmp_path, monkeypatch):
    elsewhere = f"sqlite:///{tmp_path / 'elsewhere.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", elsewhere)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    t = Trackers(["mlflow"], run_dir, project="saorl-test", config={"a": {"b": 1}})
    t.log({"reward/mean": 0.5, "step": 3}, step=3)
    t.close()
    assert not (run_dir / "mlflow").exists()
    assert _history(elsewhere, "reward/mean")[1] == {3: 0.5}
