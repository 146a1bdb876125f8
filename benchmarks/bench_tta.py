"""Time to accuracy: held-out accuracy against wall clock, TRL's GRPOTrainer against saorl SAO and GRPO.

    pip install -c constraints-cpu.txt -e ".[bench-trl]"      # TRL, for the trl arm only
    python benchmarks/bench_tta.py --budget-s 600 --seeds 3 --out runs/measure/tta   # SmolLM2-135M-Instruct
    python benchmarks/bench_tta.py --model tiny-dense --budget-s 30 --seeds 1 --test-n 8 --out runs/tta-tiny

Arms, on the same model, data, reward functions, learning rate (``--lr``), completions per
optimizer step (``--batch``) and completion cap (``--max-new``):

- **trl**: TRL's ``GRPOTrainer`` in a child process: ``--batch`` completions a step in groups of
  ``--group`` generated right before it (sync), at ``--trl-threads`` torch threads
  (``bench_trl.grpo_config``: no reference model, one iteration per batch, float32);
- **sao**: ``saorl train`` with ``algo.name=sao runtime.mode=async``: its defaults (critic, value
  pretraining included), batches of ``--batch`` trajectories;
- **grpo**: ``saorl train`` with ``algo.name=grpo algo.group_size=--group runtime.mode=sync``.

Both saorl arms: ``sft.enabled=false`` (TRL has no warm start), ``run.eval_tasks=0`` and
``run.estimate=false`` (the run's own evaluations and start-up estimate would cost it wall clock
the evaluator here replaces), no checkpoints by steps or time. ``--set ARM:key=value`` adds an
override to a saorl arm (a lever to measure); ``--variant NAME=BASE`` adds an arm NAME that runs
as the saorl arm BASE with its own ``--set NAME:key=value`` overrides, so a lever runs beside the
defaults in the same interleaved seeds (``--variant sao_top4=sao --set
sao_top4:algo.critic_train_layers=4 --arms trl,sao,sao_top4,grpo``).

Task (``--task arith``, :mod:`tta_task`): two-digit ``+``/``-`` and one-digit ``*`` problems as a
chat user message (the text for a model without a chat template); reward 0.5 × (the reply is a
bare integer) + 1.0 × (its last integer is correct), the same two functions for every arm
(saorl's ``prompt_reward`` env and TRL's ``reward_funcs``); accuracy = the last integer is
correct; ``--train-n`` train and ``--test-n`` held-out problems, disjoint. ``--task calc``
(:mod:`tta_calc`): a product the model works out with a calculator it calls as a tool, up to three
turns (TRL: ``tools=[add, multiply]``; saorl: ``env.tools``; the same tokens in every arm), from a
model that learned the call format (``--model``: an SFT model; docs/performance.md).

Clock: each arm is a child process given ``--budget-s`` of wall clock from the moment it is
started (model loading, value pretraining and worker start-up count). At each fraction f of
``--fractions`` the newest weights the arm has produced by ``f × budget`` are snapshotted: for
saorl, by this process, the version ``RUN/weights/latest.json`` names then (hard-linked; the
policy version = policy updates); for TRL, by a thread in the child that takes the lock its
callback holds across each optimizer step, copies the weights and saves them
(``save_pretrained``). At the budget the arm is stopped (saorl: two SIGTERMs; TRL exits after its
last snapshot; anything left is killed). Seeds are interleaved, the arms' order rotated per
seed; the 1-minute load average is recorded at each arm's start and end and at each snapshot.

Then one evaluator (:mod:`tta_eval`; calc's plays the turns itself: :func:`tta_calc.evaluate`),
independent of both trainers, scores the base model and
every snapshot the same way: greedy decoding with transformers on the held-out problems
(``--eval-temperature T``: one episode a problem sampled at T, seeded alike for every model, for a
task where greedy sits at its ceiling), the snapshots at the budget's end first. Output
in ``--out``: ``results.jsonl`` (a row per arm, seed and fraction: accuracy, elapsed_s, steps,
load, the checkpoint and its generations), ``results.json``, ``summary.md`` (the table) and
``tta.png`` (held-out accuracy against wall clock, one line per arm). The summary pairs the arms by
seed (every arm against TRL, the others against saorl's GRPO: the mean difference at each fraction
with its 95% t-interval) and says when each arm's mean first reaches TRL's accuracy at the budget's
end. ``--report OUT`` rebuilds ``summary.md`` and ``tta.png`` from ``OUT/results.json`` (of an
evaluation cut short: from the rows it wrote, marked partial); ``OUT/arms.json``, written as each
arm ends, lets ``--evaluate OUT [--eval-temperature T]`` run the evaluation again.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))  # the sibling modules (benchmarks/ is not a package)

import bench_trl  # noqa: E402
import tta_calc  # noqa: E402
import tta_eval  # noqa: E402, F401  (the tests reach the evaluator through this module)
import tta_task  # noqa: E402, F401
from tta_scoring import evaluate_again, evaluate_and_report, rebuild_report  # noqa: E402
from tta_setup import TASKS, Setup, task_options  # noqa: E402

ARMS = ("trl", "sao", "grpo")
ROOT = BENCH.parent


def load_average() -> float:
    return bench_trl.load_average()


def child_env() -> dict[str, str]:
    """The children import saorl from this checkout and ``tta_task`` (the reward functions) from here."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(BENCH), str(ROOT), str(tta_calc.TOOLS_DIR),
                                                    env.get("PYTHONPATH")) if p)
    return env


def prepare_model(name: str, out: Path) -> Path:
    """A tiny kind built and saved (with saorl's tokenizer) under ``out``; anything else resolved as
    ``model.policy`` resolves it (a directory, a ``.gguf``, a short name)."""
    from saorl.models.source import TINY_KINDS

    if name in TINY_KINDS:
        from saorl.models.tiny import build_tiny
        from saorl.models.tokenizer import load_tokenizer

        path = out / "model"
        build_tiny(name).save_pretrained(path)
        load_tokenizer().save_pretrained(path)
        return path
    from saorl.models.loading import policy_source

    path = Path(policy_source(name))  # absolute: the arms run in their own directories
    return path.resolve() if path.exists() else path


# ------------------------------------------------------------------------------------ saorl arms
def saorl_command(arm: str, s: Setup, seed: int, run_dir: Path, extra: list[str]) -> list[str]:
    """``saorl train`` for the arm ``arm`` (``sao`` or ``grpo``: a variant passes its base's name)."""
    big = 10**9
    algo = (["algo.name=sao", "runtime.mode=async"] if arm == "sao"
            else ["algo.name=grpo", f"algo.group_size={s.group}", "runtime.mode=sync"])
    return [sys.executable, "-c", "import sys; from saorl.cli import main; sys.exit(main(sys.argv[1:]))",
            "train", f"model.policy={s.model}", f"model.tokenizer={s.model}", "env.type=prompt_reward",
            f"env.tasks_file={s.train_file}", f"env.test_tasks_file={s.test_file}",
            *TASKS[s.task].saorl_overrides(s.max_new, **task_options(s)),
            "sft.enabled=false", f"seed={seed}", f"trainer.policy_lr={s.lr}", f"trainer.batch_size={s.batch}",
            "run.eval_tasks=0", "run.estimate=false", "run.progress=false", f"trainer.steps={big}",
            f"trainer.max_wall_s={s.budget_s}", f"run.checkpoint_every={big}", "run.checkpoint_every_s=null",
            *algo, *extra, "--run-dir", str(run_dir)]


def saorl_snapshot(run_dir: Path, arm_dir: Path, fraction: float, t0: float) -> dict:
    """The newest published policy version, hard-linked into ``arm_dir`` (none yet: the base model)."""
    row = {"fraction": fraction, "elapsed_s": time.time() - t0, "steps": 0, "weights": None,
           "load": load_average()}
    try:
        latest = json.loads((run_dir / "weights" / "latest.json").read_text())
    except FileNotFoundError:
        return row
    src = run_dir / "weights" / latest["file"]
    if not src.is_file():
        raise RuntimeError(f"{src}: a published version that is not one file (a sharded or LoRA run); "
                           "bench_tta.py snapshots the single-process trainer's full weights only")
    dst = arm_dir / f"snap-{fraction:g}.safetensors"
    try:
        os.link(src, dst)
    except OSError:  # another file system: a copy (the version stays on disk for several steps)
        shutil.copyfile(src, dst)
    return row | {"steps": int(latest["version"]), "weights": dst.name}


# ------------------------------------------------------------------------------------ one arm run
def stop(proc: subprocess.Popen, grace_s: float = 60.0) -> None:
    """Two SIGTERMs (saorl: the second stops at once), then the whole process group killed."""
    for _ in range(2):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            time.sleep(1.0)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def run_arm(arm: str, s: Setup, seed: int, arm_dir: Path, extra: list[str], base: str | None = None) -> dict:
    """One arm for the budget; its snapshot rows (``snapshots.jsonl``) and what the run was. ``base``:
    the saorl arm a variant runs as (``sao`` or ``grpo``), with its own overrides ``extra``."""
    arm_dir.mkdir(parents=True)
    run_dir = arm_dir / "run"
    load0, t0 = load_average(), time.time()
    if arm == "trl":
        cmd = [sys.executable, str(Path(__file__).resolve()), "--trl-child", str(arm_dir), "--child-seed",
               str(seed), "--child-t0", repr(t0)]
    else:
        cmd = saorl_command(base or arm, s, seed, run_dir, extra)
    with open(arm_dir / "log.txt", "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env(), cwd=arm_dir,
                                start_new_session=True)
    try:
        if arm == "trl":  # the child snapshots and exits; give its last save time to finish
            try:
                proc.wait(timeout=max(0.0, t0 + s.budget_s - time.time()) + 120.0)
            except subprocess.TimeoutExpired:
                pass
        else:
            with open(arm_dir / "snapshots.jsonl", "w", encoding="utf-8") as fh:
                for f in s.fractions:
                    while time.time() < t0 + f * s.budget_s and proc.poll() is None:
                        time.sleep(0.1)
                    if proc.poll() not in (None, 0):
                        break
                    fh.write(json.dumps(saorl_snapshot(run_dir, arm_dir, f, t0)) + "\n")
    finally:
        stop(proc)
    exit_s, load1 = time.time() - t0, load_average()
    from saorl.bench.runs import model_files

    for path in model_files(run_dir):  # published versions, checkpoint, final/: the snapshots are links
        shutil.rmtree(path, ignore_errors=True)
    path = arm_dir / "snapshots.jsonl"
    snaps = [json.loads(line) for line in open(path, encoding="utf-8")] if path.exists() else []
    if len(snaps) != len(s.fractions):
        tail = (arm_dir / "log.txt").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"arm {arm} (seed {seed}) wrote {len(snaps)} of {len(s.fractions)} snapshots "
                           f"(exit status {proc.returncode}); the end of {arm_dir / 'log.txt'}:\n{tail}")
    return {"arm": arm, "seed": seed, "dir": str(arm_dir), "load_start": load0, "load_end": load1,
            "exit_s": exit_s, "returncode": proc.returncode, "snapshots": snaps}


# ----------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct",
                    help="a tiny kind (tiny-dense, tiny-moe), a directory, a .gguf or a short name")
    ap.add_argument("--task", choices=list(TASKS), default="arith",
                    help="arith: single-turn arithmetic; calc: a calculator called as a tool, several turns "
                         "(needs --model with the call format learned: docs/performance.md)")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1, interleaved")
    ap.add_argument("--budget-s", type=float, default=600.0, help="wall clock per arm, process start to stop")
    ap.add_argument("--fractions", default="0.25,0.5,0.75,1", help="snapshot times, fractions of the budget")
    ap.add_argument("--train-n", type=int, default=4000)
    ap.add_argument("--test-n", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-5, help="the policy's learning rate, every arm")
    ap.add_argument("--batch", type=int, default=16, help="completions per optimizer step, every arm")
    ap.add_argument("--group", type=int, default=8, help="group size of trl and grpo")
    ap.add_argument("--max-new", type=int, default=None,
                    help="completion cap in tokens (calc: a turn's), every arm and the evaluator; "
                         "default 24 (arith), 48 (calc)")
    ap.add_argument("--trl-threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--format-reward", type=float, default=None, metavar="W",
                    help="--task arith: the weight of the bare-integer reward term, every arm (default "
                         "0.5; 0 leaves it out: the reward is the accuracy, no format loophole)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=BASE",
                    help="a further arm NAME run as the saorl arm BASE (sao or grpo) with its own --set "
                         "overrides, for a lever measured beside the defaults; repeatable, name it in --arms")
    ap.add_argument("--set", action="append", default=[], metavar="ARM:KEY=VALUE",
                    help="an extra override for the saorl arm ARM (sao, grpo or a --variant); repeatable")
    ap.add_argument("--report", type=Path, metavar="OUT",
                    help="only rebuild OUT's summary.md and tta.png from its results.json")
    ap.add_argument("--eval-temperature", type=float, default=None, metavar="T",
                    help="the evaluator's decoding: 0 greedy (default); > 0 sampled at T, one episode a "
                         "problem, seeded alike for every model (where greedy sits at its ceiling)")
    ap.add_argument("--evaluate", type=Path, metavar="OUT",
                    help="only the evaluation and report of OUT's arms (OUT/arms.json): an evaluation cut "
                         "short goes on where it stopped; another --eval-temperature scores all again "
                         "(the earlier fractions' models are kept only with --keep-checkpoints)")
    ap.add_argument("--keep-checkpoints", action="store_true",
                    help="keep every snapshot's model (default: only those at the budget's end)")
    ap.add_argument("--out", type=Path, default=Path("bench-tta"))
    ap.add_argument("--trl-child", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--child-seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--child-t0", type=float, default=0.0, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def check_variants(items: list[str]) -> dict[str, str]:
    """``--variant NAME=BASE`` items as ``{name: base}``, or ValueError naming the bad one."""
    variants: dict[str, str] = {}
    for item in items:
        name, _, base = item.partition("=")
        if (not re.fullmatch(r"[a-z][a-z0-9_]*", name) or name in ARMS or name in variants
                or base not in ("sao", "grpo")):
            raise ValueError("--variant: NAME=BASE with a new lower-case NAME and BASE sao or grpo, "
                             f"got {item!r}")
        variants[name] = base
    return variants


def check_args(args: argparse.Namespace
               ) -> tuple[list[str], list[float], dict[str, list[str]], dict[str, str]]:
    """The arms, fractions, per-arm overrides and variants, or ValueError naming the bad option."""
    variants = check_variants(args.variant)
    names = (*ARMS, *variants)
    arms = [a for a in args.arms.split(",") if a]
    if not arms or any(a not in names for a in arms) or len(set(arms)) != len(arms):
        raise ValueError(f"--arms: distinct names of {', '.join(names)}, got {args.arms!r}")
    try:
        fractions = sorted(float(f) for f in args.fractions.split(","))
    except ValueError:
        fractions = []
    if not fractions or not all(0 < f <= 1 for f in fractions) or len(set(fractions)) != len(fractions):
        raise ValueError(f"--fractions: distinct numbers in (0, 1], got {args.fractions!r}")
    if args.max_new is None:
        args.max_new = TASKS[args.task].MAX_NEW
    if args.budget_s <= 0 or args.seeds < 1 or args.max_new < 1 or args.trl_threads < 1 or args.lr <= 0:
        raise ValueError("need --budget-s > 0, --seeds >= 1, --max-new >= 1, --trl-threads >= 1 and --lr > 0")
    if args.format_reward is not None and (args.task != "arith" or not 0 <= args.format_reward <= 10):
        raise ValueError(f"--format-reward applies to --task arith, in [0, 10], got {args.format_reward:g} "
                         f"with --task {args.task}")
    if args.eval_temperature is None:
        args.eval_temperature = 0.0
    if not 0 <= args.eval_temperature <= 10:
        raise ValueError(f"--eval-temperature must be in [0, 10] (0: greedy), got {args.eval_temperature:g}")
    if args.batch < 1 or args.group < 1 or args.batch % args.group:
        raise ValueError(f"--batch ({args.batch}) must be a positive multiple of --group ({args.group})")
    extra: dict[str, list[str]] = {name: [] for name in ("sao", "grpo", *variants)}
    for item in args.set:
        arm, _, override = item.partition(":")
        if arm not in extra or "=" not in override:
            raise ValueError(f"--set: ARM:KEY=VALUE with ARM one of {', '.join(extra)}, got {item!r}")
        extra[arm].append(override)
    return arms, fractions, extra, variants


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.trl_child is not None:
        import tta_trl

        s = Setup(**json.loads((args.trl_child.parent.parent / "setup.json").read_text()))
        return tta_trl.trl_child(s, TASKS[s.task], args.trl_child, args.child_seed, args.child_t0)
    if args.report is not None:
        try:
            print(rebuild_report(args.report))
        except ValueError as e:
            print(f"bench_tta: --report: {e}", file=sys.stderr)
            return 2
        return 0
    if args.evaluate is not None:
        try:
            temperature = args.eval_temperature
            if temperature is not None and not 0 <= temperature <= 10:
                raise ValueError(f"--eval-temperature must be in [0, 10] (0: greedy), got {temperature:g}")
            print(evaluate_again(args.evaluate.resolve(), temperature, args.keep_checkpoints))
        except ValueError as e:
            print(f"bench_tta: --evaluate: {e}", file=sys.stderr)
            return 2
        return 0
    try:
        arms, fractions, extra, variants = check_args(args)
    except ValueError as e:
        print(f"bench_tta: {e}", file=sys.stderr)
        return 2
    if "trl" in arms:
        try:
            import trl  # noqa: F401
        except ImportError:
            print("bench_tta: TRL is not installed, so the trl arm is skipped (pip install -c "
                  "constraints-cpu.txt -e '.[bench-trl]' to run it)", file=sys.stderr)
            arms.remove("trl")
        if not arms:
            return 2
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    from saorl.models.tokenizer import load_tokenizer

    model = prepare_model(args.model, out)
    chat = bench_trl.is_chat(load_tokenizer(str(model)))
    task = TASKS[args.task]
    train, test = task.problems(args.train_n, args.test_n)
    try:
        files = [str(task.write_tasks(rows, out / f"{name}.jsonl", chat)) for name, rows in
                 (("train", train), ("test", test))]
    except ValueError as e:
        print(f"bench_tta: --task {args.task}: {e}", file=sys.stderr)
        return 2
    s = Setup(model=str(model), chat=chat, task=args.task, train_file=files[0], test_file=files[1],
              budget_s=args.budget_s,
              fractions=fractions, lr=args.lr, batch=args.batch, group=args.group, max_new=args.max_new,
              trl_threads=args.trl_threads, format_reward=args.format_reward,
              eval_temperature=args.eval_temperature)
    (out / "setup.json").write_text(json.dumps(asdict(s), indent=1) + "\n", encoding="utf-8")
    meta = {**asdict(s), "model": args.model, "model_dir": s.model, "cores": os.cpu_count(),
            "variants": variants, "overrides": {arm: extra[arm] for arm in arms if extra.get(arm)},
            "test_n": len(test), "train_n": len(train), "argv": sys.argv if argv is None else argv}
    runs = []
    for seed in range(args.seeds):
        order = arms[seed % len(arms):] + arms[:seed % len(arms)]
        for arm in order:
            print(f"[bench-tta] seed {seed}: {arm} for {s.budget_s:.0f}s (load {load_average():.1f})",
                  flush=True)
            run = run_arm(arm, s, seed, out / f"seed{seed}" / arm, extra.get(arm, []), variants.get(arm))
            print("[bench-tta]   snapshots at " + ", ".join(f"{r['elapsed_s']:.0f}s ({r['steps']} steps)"
                                                      for r in run["snapshots"]), flush=True)
            runs.append(run)
            (out / "arms.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1) + "\n",
                                           encoding="utf-8")
    print(evaluate_and_report(out, s, meta, runs, test, args.keep_checkpoints))
    return 0




if __name__ == "__main__":
    sys.exit(main())
