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

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from saorl.config import SaorlConfig, load_config
from saorl.data.jsonl import read_jsonl
from saorl.data.trajectory import Trajectory
from saorl.errors import StartupError
from saorl.models.codec import check_vocab, run_tokenizer
from saorl.models.loading import load_policy, train_dtype
from saorl.run_paths import RunPaths
from saorl.runtime.checkpoint import checkpoint_dirs, load_checkpoint, verify
from saorl.runtime.journal import Journal, decode_entry
from saorl.runtime.learner.state_files import SHARDS
from saorl.runtime.parts import build_critic, build_learner, lora_policy
from saorl.runtime.recorder import effective_rows

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
    resume_versions: dict[int, int] = field(default_factory=dict)
    """Step a resume continued from → the policy version it continued with."""


def checkpoint_steps(run_dir: Path) -> list[int]:
    """The steps of the run's kept checkpoints, oldest first."""
    return [int(d.name.split("-")[1]) for d in checkpoint_dirs(RunPaths(run_dir).checkpoints)]


def _resume_versions(rows: list[dict]) -> dict[int, int]:
    """Per resume that stands, the step it resumed from → the policy version it continued with
    (above the checkpoint's when versions were published after it: ``Run`` continues above them)."""
    out: dict[int, int] = {}
    for row in rows:
        if isinstance(row, dict) and "resume" in row:
            k = int(row["resume"]["from_step"])
            out = {s: v for s, v in out.items() if s < k}
            if "version" in row["resume"]:
                out[k] = int(row["resume"]["version"])
    return out


def recorded(run_dir: Path, ckpt: Path, manifest: dict) -> Recorded:
    """The batches, metrics and trajectories of the steps after checkpoint ``ckpt``, as the run
    stands (a resume's marker drops the rows of the steps it redid)."""
    step0, paths = int(manifest["step"]), RunPaths(run_dir)
    trained = read_jsonl(paths.trained)
    batches = {int(r["step"]): [int(x) for x in r["rids"]] for r in effective_rows(trained)
               if int(r["step"]) > step0 and "rids" in r}
    metrics = {int(r["step"]): r for r in effective_rows(read_jsonl(paths.metrics))
               if int(r["step"]) > step0}
    pending = (ckpt / "pending.jsonl").read_text(encoding="utf-8").splitlines()
    trajs = {t.episode.rid: t for t in map(decode_entry, pending)}
    journalled = Journal(paths.journal).read_from(int(manifest["journal_segment"]))
    trajs.update((t.episode.rid, t) for t in journalled)
    versions = {s: v for s, v in _resume_versions(trained).items() if s >= step0}
    return Recorded(batches, metrics, trajs, versions)


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
           probes: list[tuple[str, str]] = (), on_step: Callable[[dict], None] | None = None,
           base_policy: str | None = None) -> list[dict]:
    """Replay the steps after checkpoint ``from_step`` of ``run_dir`` under ``cfg`` (module
    docstring); ``steps``: at most this many (None: every recorded one). ``base_policy``: the
    run's starting policy (its SFT warm start), which a LoRA run's adapter checkpoints sit on
    (None: ``model.policy``). Returns one row per
    step, ``{"step", "original": {...}, "replay": {...}, "probes": [...]}`` (the metrics' full
    dicts; ``original`` empty where the run logged no row), each passed to ``on_step`` too."""
    paths = RunPaths(run_dir)
    ckpt = paths.checkpoints / f"step-{from_step:08d}"
    kept = checkpoint_steps(run_dir)
    if not ckpt.is_dir():
        raise ReplayError(f"{run_dir} has no checkpoint of step {from_step}; kept checkpoints: "
                          f"{', '.join(map(str, kept)) or 'none'} (run.keep_checkpoints keeps the newest)")
    if (ckpt / SHARDS).is_dir():
        raise ReplayError(f"checkpoint {ckpt} holds a sharded trainer's shards; replay loads the "
                          "single-process layout (write checkpoints with trainer.shard_checkpoint=full to "
                          "replay them)")
    journal = Journal(paths.journal)
    manifest = verify(ckpt, journal)
    data = recorded(run_dir, ckpt, manifest)
    own = load_config(paths.config).algo.preset.group_size
    preset = cfg.algo.preset
    group = preset.group_size
    if group != own:
        raise ReplayError(f"the run sampled groups of {own} rollouts per prompt and its batches are "
                          f"those groups; a replay cannot regroup them into {group} (algo.group_size / "
                          "algo.name with another group size)")
    cfg = cfg.model_copy(deep=True)
    cfg.trainer.shard = "none"  # one process: a sharded run's full checkpoint loads here as well
    todo = sorted(data.batches)[: steps if steps is not None else None]
    if not todo:
        raise ReplayError(f"{run_dir}/trained.jsonl records no step after {from_step}")
    torch.set_num_threads(cfg.trainer_threads())  # the run's: another count rounds matmuls otherwise
    tokenizer = run_tokenizer(cfg.model)
    spec = base_policy or cfg.model.policy
    policy = load_policy(spec, dtype=train_dtype(cfg.model.dtype), device=cfg.model.device, seed=cfg.seed)
    check_vocab(tokenizer, policy)
    critic = build_critic(cfg, policy, preset, None)
    policy = lora_policy(cfg, policy, spec)
    learner = build_learner(cfg, preset, policy, critic, tokenizer.pad_token_id)
    try:
        load_checkpoint(ckpt, learner, manifest)
    except RuntimeError as e:  # another architecture's state dict
        first = str(e).splitlines()[0]
        raise ReplayError(f"checkpoint {ckpt} does not fit the models of this config ({first})") from None
    rows = []
    for step in todo:
        missing = [r for r in data.batches[step] if r not in data.trajectories]
        if missing:
            raise ReplayError(f"step {step} trained on rollouts {missing[:5]} that neither the journal nor "
                              f"the checkpoint's pending trajectories hold (replayed {len(rows)} steps, "
                              "whose rows are written)")
        if step - 1 in data.resume_versions:  # the run resumed here and continued at this version
            learner.version = data.resume_versions[step - 1]
        batch = [data.trajectories[r] for r in data.batches[step]]
        # the group each rollout was sampled in, as the run's feed recorded it (older journals: from its id)
        groups = [t.episode.group if t.episode.group >= 0 else r // group
                  for r, t in zip(data.batches[step], batch, strict=True)]
        result = learner.step(batch, groups)
        row = {"step": step, "original": data.metrics.get(step, {}), "replay": dict(result),
               "probes": [_probe(learner.policy, tokenizer, c, t) for c, t in probes]}
        rows.append(row)
        if on_step is not None:
            on_step(row)
    return rows
