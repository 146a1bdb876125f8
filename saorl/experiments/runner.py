"""Run every arm × seed of an experiment, one after another, resumably.

Layout of the output directory ``OUT`` (default ``runs/experiments/<name>``, ``<name>-quick``
with ``--quick``)::

    OUT/spec.yaml                   the spec as run (with the selection and overrides)
    OUT/<arm>/seed-<s>/             a normal run directory (metrics.jsonl, eval.jsonl, ...)
    OUT/<arm>/seed-<s>/done.json    written when that run finished its budget: skipped next time
    OUT/.cache/                     the SFT warm starts and value-pretrained critics

Every arm of one seed starts from the same SFT model: the warm start is cached by its settings
(``saorl.stages.sft``; one that ``saorl train`` with the same settings cached in its
``run.out_dir/.cache``, ``runs/.cache`` by default, is linked in rather than trained again),
arms may not change them (``spec.LOCKED_PREFIXES``), and the runner checks that the SFT keys of
all arms of a seed agree before it trains anything.

A run counts as finished when it did all ``trainer.steps`` or used its wall-clock budget. A run
that stopped early (Ctrl-C) is not marked: the experiment stops there, and the next invocation
resumes it from its last checkpoint (with the wall-clock budget it had left; without one, from
step 0 with its journal), or starts it again if it had not written its config yet.

A run that stopped between two evaluations (wall-clock budget, or steps not a multiple of
``run.eval_every``) gets one more evaluation of its final policy, appended to its ``eval.jsonl``
(same tasks, temperature and sampling seed as the trainer's), so its final accuracy is the end.

The step-0 evaluation (the starting policy) is the same for every arm of a seed: the same SFT
policy on the same test tasks with the same sampling seed. Only the first arm of a seed to run
does it; the later ones run with ``run.eval_at_start = False`` and get that row copied to the top
of their ``eval.jsonl``, with ``source`` naming the arm it came from.

The start arm (``spec.start_arm``, e.g. ``sft``) trains nothing: its ``eval.jsonl`` is the step-0
evaluation of a trained arm of the same seed (the same policy on the same tasks with the same
sampling seed), or, when no arm was trained, an evaluation of the cached SFT policy done here.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from saorl.config import SaorlConfig
from saorl.data.jsonl import read_jsonl
from saorl.experiments.spec import ExperimentSpec, SpecError, arm_config
from saorl.run_paths import RunPaths

DONE_FILE = "done.json"


class ExperimentInterrupted(RuntimeError):
    """A run stopped before its budget (Ctrl-C, dead workers): the experiment stops, resumable."""


@dataclass
class RunResult:
    arm: str
    seed: int
    run_dir: str
    status: str
    """``trained``, ``skipped`` (finished earlier) or ``start`` (the start arm's evaluation)."""
    steps: int
    wall_s: float


@dataclass
class Selection:
    arms: list[str]
    seeds: list[int]
    quick: bool = False
    extra: list[str] = ()
    """Command-line overrides, applied last to every arm."""


def run_dir_for(out: Path, arm: str, seed: int) -> Path:
    return out / arm / f"seed-{seed}"


def is_finished(run_dir: Path) -> bool:
    return (run_dir / DONE_FILE).is_file()


class ExperimentRunner:
    def __init__(self, spec: ExperimentSpec, spec_path: Path | None, out: Path, selection: Selection,
                 log: Callable[[str], None] = print) -> None:
        self.spec, self.spec_path, self.out, self.sel, self.log = spec, spec_path, out, selection, log
        self.train_cache = Path("runs", ".cache").absolute()  # set per config by config()

    def config(self, arm: str, seed: int) -> SaorlConfig:
        """The arm's run config, with the caches under ``OUT/.cache``. ``OUT`` is made absolute, as
        ``train`` makes every path (:func:`~saorl.config.absolute_paths`): the value-pretraining
        cache is keyed by the SFT model's path, so the critic pretrained here before a run is the
        one the run finds, not a second one under a differently spelled key."""
        cfg = arm_config(self.spec, self.spec_path, arm, seed, quick=self.sel.quick,
                         extra=list(self.sel.extra))
        self.train_cache = Path(cfg.run.out_dir) / ".cache"  # where `saorl train` of these settings caches
        cfg.run.out_dir = str(self.out.absolute())
        cfg.run.name = f"{arm}-seed{seed}"
        return cfg

    def check_same_start(self) -> None:
        """Every trained arm of a seed must share one SFT warm start (same cache key)."""
        from saorl.stages.sft import sft_key

        for seed in self.sel.seeds:
            keys = {arm: sft_key(self.config(arm, seed)) for arm in self.trained_arms()}
            if len(set(keys.values())) > 1:
                raise SpecError(f"experiment {self.spec.name!r}, seed {seed}: arms would start from "
                                f"different SFT models (keys {keys}); arms must not change sft/env/model")

    def trained_arms(self) -> list[str]:
        return [a for a in self.sel.arms if a != self.spec.start_arm]

    def run(self) -> list[RunResult]:
        self.out.mkdir(parents=True, exist_ok=True)
        self.save_spec()
        self.check_same_start()
        results = []
        for seed in self.sel.seeds:
            for arm in self.trained_arms():
                results.append(self.run_one(arm, seed))
            if self.spec.start_arm and self.spec.start_arm in self.sel.arms:
                results.append(self.run_start_arm(seed))
        return results

    def save_spec(self) -> None:
        """The experiment's spec and this selection, as ``spec.yaml`` in the output folder."""
        data = self.spec.model_dump() | {"selection": {**asdict(self.sel), "extra": list(self.sel.extra)}}
        (self.out / "spec.yaml").write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")

    # ------------------------------------------------------------------------- trained arms
    def prepare(self, arm: str, seed: int) -> SaorlConfig:
        """The run's config, its SFT warm start and value-pretrained critic made (both cached, so
        ``train`` reuses them)."""
        from saorl.stages.sft import reuse_cached_sft, warm_start
        from saorl.stages.value_pretrain import initial_critic

        cfg = self.config(arm, seed)
        reuse_cached_sft(cfg, self.train_cache, self.log)  # the same SFT from `saorl train`: not again
        initial_critic(cfg, warm_start(cfg, self.log), self.log)
        return cfg

    def run_one(self, arm: str, seed: int) -> RunResult:
        from saorl.training import train

        run_dir = run_dir_for(self.out, arm, seed)
        if is_finished(run_dir):
            done = json.loads((run_dir / DONE_FILE).read_text())
            self.log(f"[{arm} seed {seed}] finished earlier ({done['steps']} steps): skipped")
            return RunResult(arm, seed, str(run_dir), "skipped", done["steps"], done["wall_s"])
        cfg = self.prepare(arm, seed)
        start_row = self._start_row(seed, exclude=arm) if cfg.run.eval_tasks else None
        if start_row is not None:  # the same policy, tasks and sampling seed: evaluated once per seed
            cfg.run.eval_at_start = False
        # a run that wrote its config resumes (from its checkpoint, or from step 0 with its journal;
        # a damaged checkpoint is reported there, never answered by deleting the run)
        paths = RunPaths(run_dir)
        resume = paths.config.is_file()
        if resume:
            spent = _last(read_jsonl(paths.metrics), "time/elapsed_s") or 0.0
            if cfg.trainer.max_wall_s is not None:
                cfg.trainer.max_wall_s = max(1.0, cfg.trainer.max_wall_s - spent)
            self.log(f"[{arm} seed {seed}] resuming {run_dir}")
        elif run_dir.exists():
            shutil.rmtree(run_dir)  # began but wrote nothing of a run: start it again
        self.log(f"[{arm} seed {seed}] training: {cfg.algo.name}, {cfg.resolved_mode()}, "
                 f"{cfg.trainer.steps} steps, max {cfg.trainer.max_wall_s or 'unlimited'} s -> {run_dir}")
        t0 = time.monotonic()
        train(cfg, run_dir, resume=resume)
        took = time.monotonic() - t0
        rows = read_jsonl(paths.metrics)
        steps = int(_last(rows, "step") or 0)
        budget = cfg.trainer.max_wall_s
        if steps < cfg.trainer.steps and (budget is None or took < budget):
            raise ExperimentInterrupted(f"[{arm} seed {seed}] stopped after {steps} of {cfg.trainer.steps} "
                                        f"steps ({took:.0f}s); run the same command again to resume")
        wall = float(_last(rows, "time/elapsed_s") or took)
        if start_row is not None:
            _prepend_start(paths.eval, start_row)
        self._final_eval(cfg, run_dir, steps)
        (run_dir / DONE_FILE).write_text(json.dumps({"arm": arm, "seed": seed, "steps": steps,
                                                     "wall_s": wall, "algo": cfg.algo.name}) + "\n")
        return RunResult(arm, seed, str(run_dir), "trained", steps, wall)

    def _final_eval(self, cfg: SaorlConfig, run_dir: Path, steps: int) -> None:
        """Evaluate the final policy when the run stopped between two evaluations (the wall-clock
        budget, or steps not a multiple of ``run.eval_every``), so "final accuracy" is the end."""
        paths = RunPaths(run_dir)
        evals = read_jsonl(paths.eval)
        final = paths.final_policy
        if steps == 0 or any(r.get("step") == steps for r in evals) or not final.is_dir():
            return
        from saorl.models.codec import run_tokenizer
        from saorl.models.loading import load_policy
        from saorl.stages.evaluate import evaluate_config

        self.log(f"[{cfg.run.name}] evaluating the final policy (step {steps})")
        policy = load_policy(str(final), dtype=cfg.model.dtype, device=cfg.model.device,
                             seed=cfg.seed).eval()
        metrics, _ = evaluate_config(cfg, policy, run_tokenizer(cfg.model))
        row = {"step": steps, "policy/version": None, **metrics, "source": "saorl experiment (final)"}
        with open(paths.eval, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")

    # ---------------------------------------------------------------------------- start arm
    def run_start_arm(self, seed: int) -> RunResult:
        arm = self.spec.start_arm
        assert arm is not None
        run_dir = run_dir_for(self.out, arm, seed)
        if is_finished(run_dir):
            return RunResult(arm, seed, str(run_dir), "skipped", 0, 0.0)
        row = self._start_row(seed)
        if row is not None:
            self.log(f"[{arm} seed {seed}] the starting policy: {row['source']}")
        else:
            row = self._evaluate_start(seed)
        run_dir.mkdir(parents=True, exist_ok=True)
        RunPaths(run_dir).eval.write_text(json.dumps(row) + "\n", encoding="utf-8")
        (run_dir / DONE_FILE).write_text(json.dumps({"arm": arm, "seed": seed, "steps": 0, "wall_s": 0.0,
                                                     "algo": None}) + "\n")
        return RunResult(arm, seed, str(run_dir), "start", 0, 0.0)

    def _start_row(self, seed: int, exclude: str | None = None) -> dict | None:
        """The step-0 evaluation of a finished trained arm of ``seed`` (other than ``exclude``) that
        ran it itself, with ``source`` naming that arm; None if there is none yet."""
        for other in self.spec.arms:
            run_dir = run_dir_for(self.out, other, seed)
            if other == exclude or not is_finished(run_dir):
                continue
            row = next((r for r in read_jsonl(RunPaths(run_dir).eval)
                        if r.get("step") == 0 and "source" not in r), None)
            if row is not None:
                return dict(row, source=f"step-0 evaluation of arm {other!r} (same policy, tasks and seed)")
        return None

    def _evaluate_start(self, seed: int) -> dict:
        """Evaluate the SFT start as a run's step-0 evaluation would (same tasks, temperature, seed)."""
        from saorl.models.codec import run_tokenizer
        from saorl.models.loading import load_policy
        from saorl.stages.evaluate import evaluate_config
        from saorl.stages.sft import reuse_cached_sft, warm_start

        cfg = self.config(next(iter(self.spec.arms)), seed)
        reuse_cached_sft(cfg, self.train_cache, self.log)
        spec = warm_start(cfg, self.log)
        self.log(f"[{self.spec.start_arm} seed {seed}] evaluating the starting policy {spec}")
        policy = load_policy(spec, dtype=cfg.model.dtype, device=cfg.model.device, seed=cfg.seed).eval()
        tokenizer = run_tokenizer(cfg.model)  # as the trainer's evaluation loads it
        metrics, _ = evaluate_config(cfg, policy, tokenizer)
        return {"step": 0, "policy/version": 0, **metrics}


def _prepend_start(path: Path, row: dict) -> None:
    """Put the copied step-0 row first in ``eval.jsonl`` (unless it has a step-0 row already)."""
    rows = read_jsonl(path)
    if any(r.get("step") == 0 for r in rows):
        return
    text = "".join(json.dumps(r) + "\n" for r in [row, *rows])
    path.write_text(text, encoding="utf-8")


def _last(rows: list[dict], key: str):
    for row in reversed(rows):
        if row.get(key) is not None:
            return row[key]
    return None
