"""``saorl bench pipeline``: asynchronous SAO vs a synchronous batch-barrier baseline, measured.

Two configurations of the *real* runtime (:class:`saorl.runtime.run.Run`, rollout worker
processes, the local engine), same tiny model (random init, no SFT, no value pretraining), same
env, same threads, each run for the same wall-clock budget (``trainer.max_wall_s``):

- **sync**: GRPO (group size ``group_size`` ≥ 2), ``runtime.mode=sync``: one batch of
  ``batch_size`` rollouts is dispatched with the current weights, the trainer waits for all of
  it (the barrier), trains, publishes, repeat;
- **async**: SAO (``algo.name=sao``): every slot refilled at once with the newest weights; the
  trainer takes the first ``batch_size`` trajectories to finish.

Runs are interleaved sync/async/sync/async over ``reps`` (the order alternates each rep) so
that drifting machine load hits both alike. Figures per run: see :mod:`saorl.bench.runs`.

Then, alone (nothing else of ours running), the pieces: the generation throughput of the
workload with no trainer (also measured before the runs; the faster counts) and the engine
profile (:func:`saorl.bench.profile.rollout_profile`), the decode-step curve, and one SAO
step profile on real trajectories. The **machine limit** of trained tokens / s combines the
generation stage (``G`` tok/s, measured with the workers' threads) and the training stage
(``T`` tok/s = tokens per step / (SAO step + weight publication + journal appends), with the
trainer's threads, at the async run's tokens per step):

- the stages have their own cores (trainer threads + workers × worker threads ≤ cores): a
  pipeline runs at its slowest stage, ``limit = min(G, T)``;
- they share cores: each token costs both stages' time, ``limit = 1 / (1/G + 1/T)``.

Everything measured goes to ``measurement.json`` (the inputs of the simulator validation
test), ``summary.md`` and ``timeline.png`` in ``--out``.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from saorl.bench import profile as prof
from saorl.bench.insitu import in_situ, step_busy
from saorl.bench.report import write_summary
from saorl.bench.runs import analyse, run_once
from saorl.bench.simcheck import predict
from saorl.bench.timeline import load_timeline, plot_timelines
from saorl.config import ConfigError, LocalEngineConfig, SaorlConfig, load_config
from saorl.data.jsonl import read_jsonl
from saorl.sim import DecodeCurve

SYNTHETIC = "saorl.envs.synthetic:SyntheticLengthEnv"


SPEC_FIELDS = {"runtime.trainer_threads": "trainer_threads", "runtime.worker_threads": "worker_threads",
               "trainer.batch_size": "batch_size", "rollout.engine.slots": "slots",
               "rollout.concurrent_episodes": "episodes", "algo.group_size": "group_size"}
"""Config keys whose overrides the spec follows (config key → spec field)."""


@dataclass
class BenchSpec:
    budget_s: float = 60.0
    """Wall-clock budget of each run (``trainer.max_wall_s``)."""
    reps: int = 2
    """Sync/async pairs, interleaved."""
    env: str = "synthetic"
    """``synthetic`` (long-tailed lengths) or ``math_tool``."""
    mean_turns: float = 4.0
    cv: float = 1.5
    max_turns: int = 32
    turn_tokens: int = 16
    """``rollout.max_new_tokens`` for the synthetic env (tokens per turn)."""
    slots: int = 16
    """Decode slots of the engine (``rollout.engine.slots``)."""
    episodes: int = 64
    """Episodes a worker holds (``rollout.concurrent_episodes``): more than ``slots`` keeps a
    backlog in the engine's queue, so a freed slot is refilled even while the trainer is busy
    (the trainer dispatches new rollouts only between its steps)."""
    batch_size: int = 16
    group_size: int = 4
    worker_threads: int = 1
    trainer_threads: int = 1
    sync_sao: bool = False
    """Also run SAO with the sync barrier (``sync_sao``): same algorithm as async, so the async /
    sync-SAO ratio isolates the schedule from the algorithms' different step costs."""
    profile_s: float = 10.0
    """Seconds of the generation-only measurement."""
    overrides: list[str] = field(default_factory=list)
    """Extra dotted config overrides, applied to both modes last."""

    def __post_init__(self) -> None:
        """An override of a setting the spec also holds (``runtime.trainer_threads=2``) sets the
        spec's too, so the stages measured alone and the summary use what the runs used."""
        for o in self.overrides:
            key, _, value = o.partition("=")
            name = SPEC_FIELDS.get(key.strip())
            if name is not None:
                with contextlib.suppress(ValueError):  # not an int: the config's load names it
                    setattr(self, name, int(value))

    @property
    def modes(self) -> tuple[str, ...]:
        """The modes a benchmark runs: sync and async, and ``sync_sao`` when asked for."""
        return ("sync", "async", "sync_sao") if self.sync_sao else ("sync", "async")

    @classmethod
    def quick(cls, **kw) -> BenchSpec:
        return cls(**{"budget_s": 20.0, "reps": 1, "profile_s": 4.0, **kw})


def common_overrides(spec: BenchSpec) -> list[str]:
    big = 10**9
    out = ["model.policy=tiny-moe", "sft.enabled=false", "value_pretrain.enabled=false", "seed=0",
           f"run.eval_every={big}", "run.eval_tasks=1", f"run.checkpoint_every={big}",
           f"run.samples_every={big}", "run.progress=false", "env.num_test_tasks=1",
           "env.num_train_tasks=4000", "rollout.num_workers=1", f"rollout.engine.slots={spec.slots}",
           f"rollout.concurrent_episodes={spec.episodes}", f"runtime.worker_threads={spec.worker_threads}",
           f"runtime.trainer_threads={spec.trainer_threads}", f"trainer.steps={big}",
           f"trainer.max_wall_s={spec.budget_s}", f"trainer.batch_size={spec.batch_size}"]
    if spec.env == "synthetic":
        total = 16 + spec.max_turns * (spec.turn_tokens + 1)
        out += [f"env.type={SYNTHETIC}", f"env.options={{mean_turns: {spec.mean_turns}, cv: {spec.cv}, "
                f"max_turns: {spec.max_turns}}}", f"rollout.max_new_tokens={spec.turn_tokens}",
                f"rollout.max_total_tokens={total}"]
    elif spec.env == "math_tool":
        out += ["env.type=math_tool"]
    else:
        raise ValueError(f"--env must be 'synthetic' or 'math_tool', got {spec.env!r}")
    return out


MODES = {"sync": "GRPO, batch barrier", "async": "SAO, asynchronous", "sync_sao": "SAO, batch barrier"}


def mode_config(spec: BenchSpec, mode: str, out_dir: Path) -> SaorlConfig:
    if mode == "sync":
        algo = ["algo.name=grpo", f"algo.group_size={spec.group_size}", "runtime.mode=sync"]
    elif mode == "async":
        algo = ["algo.name=sao", "runtime.mode=async"]
    elif mode == "sync_sao":
        algo = ["algo.name=sao", "runtime.mode=sync"]
    else:
        raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
    return load_config(None, [*common_overrides(spec), *algo, f"run.out_dir={out_dir}", f"run.name={mode}",
                              *spec.overrides])


def load_average() -> float:
    """The 1-minute load average (NaN where the OS does not report one)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def machine_load() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "uptime unavailable"


def run_pairs(spec: BenchSpec, out: Path, log=print) -> list[dict]:
    """The interleaved runs; one record per run: mode, rep, stats, run dir."""
    records = []
    modes = spec.modes
    for rep in range(spec.reps):
        for mode in modes if rep % 2 == 0 else modes[::-1]:
            cfg = mode_config(spec, mode, out / "runs")
            run_dir = out / "runs" / f"{mode}-{rep}"
            log(f"[bench] rep {rep + 1}/{spec.reps}: {mode} for {spec.budget_s:.0f}s ({machine_load()})")
            load_start = load_average()
            run_once(cfg, run_dir)
            load_end = load_average()
            slots = cfg.rollout.num_workers * cfg.rollout.local_engine.slots
            stats = analyse(run_dir, slots)
            log(f"[bench]   {stats.tokens_per_s:.0f} trained tok/s, idle {stats.trainer_idle_frac:.2f}, "
                f"slot util {stats.slot_util:.2f}, staleness mean {stats.staleness_mean:.2f}, "
                f"{stats.positions_per_action_token:.2f} positions / action token; load average "
                f"{load_start:.1f} -> {load_end:.1f}")
            records.append({"mode": mode, "rep": rep, "run_dir": str(run_dir), "load_start": load_start,
                            "load_end": load_end, **stats.as_dict()})
    return records


def ratios(records: list[dict], baseline: str = "sync") -> list[float]:
    """async / ``baseline`` trained tokens/s of each rep that has both."""
    by = {(r["mode"], r["rep"]): r["tokens_per_s"] for r in records}
    return [by[("async", k)] / by[(baseline, k)] for k in sorted({r["rep"] for r in records})
            if by.get((baseline, k)) and ("async", k) in by]


def generation_alone(spec: BenchSpec, out: Path, log=print) -> dict:
    """The workload through one engine with no trainer (worker threads): profile and tok/s."""
    torch.set_num_threads(spec.worker_threads)
    log(f"[bench] generation alone for {spec.profile_s:.0f}s (engine profile)")
    return prof.rollout_profile(mode_config(spec, "async", out / "runs"), spec.profile_s,
                                warmup_s=min(3.0, spec.profile_s / 2))


def combined_limit(g: float, t: float, separate: bool) -> float:
    """Trained tokens/s the machine allows: the slower stage when the stages have their own cores
    (``min(G, T)``), else every token costs both (``1 / (1/G + 1/T)``)."""
    return min(g, t) if separate else 1 / (1 / g + 1 / t)


def measure_pieces(spec: BenchSpec, out: Path, async_tokens_per_step: float, log=print,
                   gen_before: float | None = None) -> dict:
    """Profiles and stage throughputs, each measured alone with the threads its stage has in a run.

    Generation alone is measured here and, when ``gen_before`` is given, also before the runs;
    the machine's limit uses the faster of the two (a load spike only ever slows a measurement).
    """
    cfg_async = mode_config(spec, "async", out / "runs")
    cfg_sync = mode_config(spec, "sync", out / "runs")
    gen = generation_alone(spec, out, log)
    torch.set_num_threads(spec.worker_threads)
    curve = prof.decode_curve(cfg_async, tuple(sorted({1, 2, 4, 8, spec.slots})))
    trajs = gen.pop("trajectories")
    while len(trajs) < 4 * spec.batch_size:  # enough distinct batches for the fits
        trajs = trajs + trajs
    torch.set_num_threads(spec.trainer_threads)
    log("[bench] trainer step profiles (SAO, GRPO)")
    learn = prof.learner_profile(cfg_async, trajs)
    half = max(spec.group_size, spec.batch_size // 2)
    sao_fit = prof.train_cost_fit(cfg_async, trajs, (half, spec.batch_size))
    grpo_fit = prof.train_cost_fit(cfg_sync, trajs, (half, spec.batch_size))
    rows = {r["piece"]: r["ms_per_step"] / 1000 for r in learn["rows"]}
    overhead = rows.get("weight publication (state dict -> file)", 0.0) + rows.get("journal append (fsync)",
                                                                                      0.0)
    n = async_tokens_per_step or learn["tokens_per_step"]
    train_tps = n / (sao_fit[0] + sao_fit[1] * n + overhead)
    log("[bench] both stages at once (contention)")
    both = prof.contention(cfg_async, trajs, spec.profile_s, spec.worker_threads, spec.trainer_threads)
    both["train_slowdown"] = learn["tokens_per_s"] / both["train_tokens_per_s"]
    both["generation_slowdown"] = gen["tokens_per_s"] / both["generation_tokens_per_s"]
    G = max(gen["tokens_per_s"], gen_before or 0.0)
    threads = spec.trainer_threads + spec.worker_threads
    separate = threads <= (os.cpu_count() or 1)
    limit = combined_limit(G, train_tps, separate)
    return {"generation": gen, "decode_curve": curve, "learner": learn, "sao_fit": sao_fit,
            "grpo_fit": grpo_fit, "step_overhead_s": overhead, "train_tokens_per_s": train_tps,
            "contention": both,
            "limit": {"tokens_per_s": limit, "formula": "min(G, T)" if separate else "1/(1/G + 1/T)",
                      "G": G, "G_after": gen["tokens_per_s"], "G_before": gen_before, "T": train_tps,
                      "threads": threads, "cores": os.cpu_count()}}


def train_alone_on_run_batches(records: list[dict]) -> float | None:
    """SAO training throughput alone on the runs' own batches: trained action tokens over the
    trainer's busy seconds (step, publication, journal, logging) in the ``sync_sao`` runs, where
    nothing generates while the trainer trains (the barrier). None without ``sync_sao`` runs.

    The fit on the generation-alone sample underestimates a real step: that sample is cut off
    after a few seconds, so it under-represents long rollouts, and a batch pads to its longest.
    """
    steps = [s for r in records if r["mode"] == "sync_sao" for s in step_busy(Path(r["run_dir"]))]
    busy = sum(b for _, b in steps)
    return sum(n for n, _ in steps) / busy if steps and busy > 0 else None


def use_run_batches_for_limit(records: list[dict], pieces: dict) -> None:
    """Replace the machine limit's ``T`` with :func:`train_alone_on_run_batches` when there are
    ``sync_sao`` runs (the fit's value is kept as ``T_fit``)."""
    t_runs = train_alone_on_run_batches(records)
    lim = pieces["limit"]
    lim["T_fit"] = lim["T"]
    lim["T_source"] = "fit on the generation-alone sample"
    if t_runs is None:
        return
    lim["T"], lim["T_source"] = t_runs, "sync_sao runs (trainer alone on the runs' batches)"
    lim["tokens_per_s"] = combined_limit(lim["G"], t_runs, lim["formula"] == "min(G, T)")


def targets(records: list[dict], pieces: dict) -> list[dict]:
    asyn = [r for r in records if r["mode"] == "async"]
    rs = ratios(records)

    def mean(key: str) -> float:
        return statistics.fmean(r[key] for r in asyn)

    limit = pieces["limit"]["tokens_per_s"]
    rows = [("async / sync trained tokens/s", statistics.fmean(rs) if rs else float("nan"), ">= 2", 2.0,
             True),
            ("trainer idle, async", mean("trainer_idle_frac"), "<= 0.10", 0.10, False),
            ("decode-slot utilisation, async", mean("slot_util"), ">= 0.90", 0.90, True),
            ("async tokens/s / machine limit", mean("tokens_per_s") / limit, ">= 0.80", 0.80, True),
            ("positions per action token, async", mean("positions_per_action_token"), "<= 1.30", 1.30, False),
            ("prefill share of generation", pieces["generation"]["prefill_share"], "<= 0.15", 0.15, False)]
    return [{"target": name, "measured": v, "goal": goal,
             "pass": bool(v >= thr if ge else v <= thr)} for name, v, goal, thr, ge in rows]


def sim_inputs(spec: BenchSpec, records: list[dict], pieces: dict, log=print) -> dict:
    """What the simulator needs to predict this run (saved as ``measurement.json``)."""
    lengths = [r["tokens"] for rec in records if rec["mode"] == "sync"
               for r in read_jsonl(Path(rec["run_dir"]) / "rollouts.jsonl") if not r.get("unfinished")]
    gen = pieces["generation"]
    # the engine also prefills every turn's context; fold that into an effective step time
    scale = gen["pure_decode_tokens_per_s"] / gen["tokens_per_s"] if gen["tokens_per_s"] else 1.0
    return {"slots": spec.slots, "engines": 1, "batch_size": spec.batch_size, "group_size": spec.group_size,
            "decode_curve": [[b, s] for b, s in pieces["decode_curve"]], "prefill_scale": scale,
            "lengths": lengths, "train_sao": list(pieces["sao_fit"]), "train_grpo": list(pieces["grpo_fit"]),
            # one factor in the simulator for both stages: the larger slowdown (the bottleneck's, here)
            "contention": max(1.0, pieces["contention"]["train_slowdown"],
                              pieces["contention"]["generation_slowdown"]),
            "publish_s": pieces["step_overhead_s"],
            # the synthetic env fixes a task's length: a GRPO group's members share it
            "group_lengths": "shared" if spec.env == "synthetic" else "independent",
            "in_situ": in_situ_factors(spec, records, pieces, scale, log),
            "duration_s": statistics.fmean(r["window_s"] for r in records),
            "measured_ratio": statistics.fmean(ratios(records)), "measured_ratios": ratios(records),
            "measured_tokens_per_s": {
                m: statistics.fmean(r["tokens_per_s"] for r in records if r["mode"] == m)
                for m in ("sync", "async")}}


def in_situ_factors(spec: BenchSpec, records: list[dict], pieces: dict, prefill_scale: float,
                    log=print) -> dict:
    """Per mode, how much slower each stage ran in that mode's runs than alone (mean over reps)."""
    curve = DecodeCurve.measured(pieces["decode_curve"])
    fits = {"sync": pieces["grpo_fit"], "async": pieces["sao_fit"]}
    out = {}
    for mode, fit in fits.items():
        per_rep = []
        for r in records:
            if r["mode"] != mode:
                continue
            try:
                per_rep.append(in_situ(Path(r["run_dir"]), fit, pieces["step_overhead_s"], curve,
                                       prefill_scale, spec.slots))
            except ValueError as e:  # too short a run (fewer than two steps): left out, not fatal
                log(f"[bench] no in-run stage speeds for {r['run_dir']}: {e}")
        if per_rep:
            out[mode] = {k: statistics.fmean(f[k] for f in per_rep) for k in per_rep[0]}
    return out


def check_spec(spec: BenchSpec) -> None:
    """Load every mode's config before anything runs or is written: a bad override fails here
    (:class:`~saorl.config.ConfigError`), and so does a rollout engine other than the local one,
    since the stages measured alone (generation, the decode curve, slot use) are the local
    engine's, and the summary would set a server's runs against them."""
    for mode in spec.modes:
        engine = mode_config(spec, mode, Path("runs")).rollout.engine
        if not isinstance(engine, LocalEngineConfig):
            raise ConfigError(
                f"rollout.engine={engine.kind}: saorl bench pipeline measures the local engine (its "
                "generation alone, decode curve and slots); benchmarks/bench_pipeline_vllm.py runs "
                "both modes against a vLLM server beside the local engine")


def bench(spec: BenchSpec, out: Path, command: str = "", log=print) -> dict:
    """The whole benchmark; returns everything ``summary.md`` shows."""
    check_spec(spec)
    out.mkdir(parents=True, exist_ok=True)
    t0, load_before = time.monotonic(), machine_load()
    gen_before = generation_alone(spec, out, log)["tokens_per_s"]
    records = run_pairs(spec, out, log)
    return finish(spec, out, records, command=command, load_before=load_before, t0=t0, log=log,
                  gen_before=gen_before)


def finish(spec: BenchSpec, out: Path, records: list[dict], *, command: str, load_before: str, t0: float,
           log=print, gen_before: float | None = None) -> dict:
    """Measure the pieces and write every output, given the runs' records (see :func:`run_pairs`)."""
    per_step = statistics.fmean(r["trained_tokens"] / r["steps"] for r in records if r["mode"] == "async")
    pieces = measure_pieces(spec, out, per_step, log, gen_before)
    use_run_batches_for_limit(records, pieces)
    result = {"spec": asdict(spec), "command": command, "load_before": load_before,
              "load_after": machine_load(), "elapsed_s": time.monotonic() - t0, "records": records,
              "ratios": ratios(records), "ratios_sync_sao": ratios(records, "sync_sao"),
              "pieces": pieces, "targets": targets(records, pieces)}
    result["sim_inputs"] = sim_inputs(spec, records, pieces, log)
    result["sim_prediction"] = predict(result["sim_inputs"])
    if {"sync", "async"} <= set(result["sim_inputs"]["in_situ"]):
        result["sim_prediction_in_situ"] = predict(result["sim_inputs"], in_situ=True)
    (out / "measurement.json").write_text(json.dumps(result["sim_inputs"], indent=1) + "\n", encoding="utf-8")
    first = {r["mode"]: r for r in reversed(records) if r["rep"] == 0}
    panels = [(f"{m}: {MODES[m]} ({first[m]['tokens_per_s']:.0f} trained tok/s)",
               load_timeline(Path(first[m]["run_dir"]))) for m in MODES if m in first]
    plot_timelines(panels, out / "timeline.png", max_seconds=min(spec.budget_s, 40.0), slots=spec.slots)
    (out / "results.json").write_text(json.dumps(result, indent=1, default=str) + "\n", encoding="utf-8")
    write_summary(result, out / "summary.md")
    return result
