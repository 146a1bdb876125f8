"""Replay: the learner re-run on a run's exact recorded batches, from one of its checkpoints.

A run directory holds everything a trainer step consumed: the checkpoint (weights, both optimizer
states, the learner's counters, the RNG), the journal and the checkpoint's pending trajectories
(every trajectory trained after it, byte for byte), and ``trained.jsonl`` (which rollout ids each
step trained on, in order). :func:`replay` rebuilds the learner from the checkpoint and takes the
recorded steps again, each on exactly the batch the run took, under the settings of ``cfg`` —
the run's own, or changed (``trainer.policy_lr``, ``algo.*``, ...). With unchanged settings it
reproduces the run's logged losses and KL (the learner step is deterministic given its batch,
weights and optimizer state); with changed ones it shows what those settings would have done on
the same data — the question a collapse asks ("would a smaller learning rate have avoided it?"),
answered without sampling noise.

What a replay does not redo: sampling. The trajectories are those the run sampled, under the
run's weights; a changed setting changes the learner's path only, so the further a replay goes,
the more its policy differs from the one that sampled the data (the staleness and KL it logs are
measured against the recorded samplers).

**Probes**: a probe is a context text and a continuation text; after each replayed step the
policy's probability of the continuation's tokens given the context's (the product over its
tokens, at temperature 1 without truncation) is reported as ``probe/<i>`` — which decision is
tipping, step by step.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from saorl.config import SaorlConfig
from saorl.data.jsonl import read_jsonl
from saorl.data.trajectory import Trajectory
from saorl.errors import StartupError
from saorl.models.codec import check_vocab, run_tokenizer
from saorl.models.loading import load_policy, train_dtype
from saorl.runtime.checkpoint import SHARDS, checkpoint_dirs, load_checkpoint, verify
from saorl.runtime.journal import Journal, decode_entry
from saorl.runtime.parts import build_critic, build_learner, trainer_threads

DEFAULT_KEYS = ("policy/loss", "mismatch/kl", "policy/entropy", "policy/grad_norm", "critic/value_loss",
                "advantage/std")
"""The metrics a replay shows side by side with the run's, unless told others."""


class ReplayError(StartupError):
    """A replay that cannot start: no such checkpoint, a recorded trajectory missing, ..."""


@dataclass
class Recorded:
    """What the run recorded after a checkpoint: per step, its rollout ids and its logged metrics;
    per rollout id, its trajectory."""

    batches: dict[int, list[int]]
    metrics: dict[int, dict[str, Any]]
    trajectories: dict[int, Trajectory] = field(repr=False)


def checkpoint_steps(run_dir: Path) -> list[int]:
    """The steps of the run's kept checkpoints, oldest first."""
    return [int(d.name.split("-")[1]) for d in checkpoint_dirs(run_dir / "checkpoints")]


def _last_per_step(rows: list[dict]) -> dict[int, dict]:
    """Rows keyed by step; a resumed run redoes steps, and the later row is the one whose update
    the run kept."""
    out: dict[int, dict] = {}
    for row in rows:
        if isinstance(row, dict) and "step" in row:
            out[int(row["step"])] = row
    return out


def recorded(run_dir: Path, ckpt: Path, manifest: dict) -> Recorded:
    """The batches, metrics and trajectories of the steps after checkpoint ``ckpt``."""
    step0 = int(manifest["step"])
    batches = {s: [int(r) for r in row["rids"]] for s, row in _last_per_step(
        read_jsonl(run_dir / "trained.jsonl")).items() if s > step0 and "rids" in row}
    logged = _last_per_step(read_jsonl(run_dir / "metrics.jsonl"))
    metrics = {s: row for s, row in logged.items() if s > step0}
    pending = (ckpt / "pending.jsonl").read_text(encoding="utf-8").splitlines()
    trajs = dict(decode_entry(line) for line in pending)
    trajs.update(Journal(run_dir / "journal").read_from(int(manifest["journal_segment"])))
    return Recorded(batches, metrics, trajs)


def _probe(policy: torch.nn.Module, tokenizer, context: str, continuation: str) -> float:
    """The policy's probability of ``continuation``'s tokens after ``context``'s."""
    ctx = tokenizer.encode(context, add_special_tokens=False)
    cont = tokenizer.encode(continuation, add_special_tokens=False)
    if not cont:
        raise ReplayError(f"probe continuation {continuation!r} encodes to no token")
    ids = torch.tensor([ctx + cont], device=next(policy.parameters()).device)
    with torch.no_grad():
        logits = policy(ids).logits[0, len(ctx) - 1: -1].float()
    lp = torch.log_softmax(logits, dim=-1).gather(1, ids[0, len(ctx):, None]).sum()
    return math.exp(float(lp))


def replay(cfg: SaorlConfig, run_dir: Path, from_step: int, *, steps: int | None = None,
           probes: list[tuple[str, str]] = (), on_step: Callable[[dict], None] | None = None) -> list[dict]:
    """Replay the steps after checkpoint ``from_step`` of ``run_dir`` under ``cfg`` (module
    docstring); ``steps``: at most this many (None: every recorded one). Returns one row per
    step, ``{"step", "original": {...}, "replay": {...}, "probes": [...]}`` (the metrics' full
    dicts; ``original`` empty where the run logged no row), each passed to ``on_step`` too."""
    ckpt = run_dir / "checkpoints" / f"step-{from_step:08d}"
    kept = checkpoint_steps(run_dir)
    if not ckpt.is_dir():
        raise ReplayError(f"{run_dir} has no checkpoint of step {from_step}; kept checkpoints: "
                          f"{', '.join(map(str, kept)) or 'none'} (run.keep_checkpoints keeps the newest)")
    if (ckpt / SHARDS).is_dir():
        raise ReplayError(f"checkpoint {ckpt} holds a sharded trainer's shards; replay loads the "
                          "single-process layout (write checkpoints with trainer.shard_checkpoint=full to "
                          "replay them)")
    journal = Journal(run_dir / "journal")
    manifest = verify(ckpt, journal)
    data = recorded(run_dir, ckpt, manifest)
    todo = sorted(data.batches)[: steps if steps is not None else None]
    if not todo:
        raise ReplayError(f"{run_dir}/trained.jsonl records no step after {from_step}")
    torch.set_num_threads(trainer_threads(cfg))  # the run's: another count rounds matmuls otherwise
    tokenizer = run_tokenizer(cfg.model)
    policy = load_policy(cfg.model.policy, dtype=train_dtype(cfg.model.dtype), device=cfg.model.device,
                         seed=cfg.seed)
    check_vocab(tokenizer, policy)
    critic = build_critic(cfg, policy, cfg.algo.resolve(), None)
    learner = build_learner(cfg, policy, critic, tokenizer.pad_token_id)
    try:
        load_checkpoint(ckpt, learner, manifest)
    except RuntimeError as e:  # another architecture's state dict
        first = str(e).splitlines()[0]
        raise ReplayError(f"checkpoint {ckpt} does not fit the models of this config ({first})") from None
    group = cfg.algo.resolve().group_size
    rows = []
    for step in todo:
        missing = [r for r in data.batches[step] if r not in data.trajectories]
        if missing:
            raise ReplayError(f"step {step} trained on rollouts {missing[:5]} that neither the journal nor "
                              f"the checkpoint's pending trajectories hold (replayed {len(rows)} steps)")
        batch = [data.trajectories[r] for r in data.batches[step]]
        result = learner.step(batch, [r // group for r in data.batches[step]])
        row = {"step": step, "original": data.metrics.get(step, {}), "replay": dict(result),
               "probes": [_probe(learner.policy, tokenizer, c, t) for c, t in probes]}
        rows.append(row)
        if on_step is not None:
            on_step(row)
    return rows


def write_rows(out_dir: Path, rows: list[dict], cfg_yaml: str) -> Path:
    """The replay's rows (``replay.jsonl``) and settings (``config.yaml``) into ``out_dir``."""
    from saorl.atomic import write_text

    out_dir.mkdir(parents=True, exist_ok=True)
    write_text(out_dir / "config.yaml", cfg_yaml)
    write_text(out_dir / "replay.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    return out_dir
