"""The TRL arm of ``bench_tta.py``, in a process of its own: TRL's ``GRPOTrainer`` on the task's rows,
reward functions and tools, and the snapshots of its weights at fractions of the budget."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import bench_trl
from tta_setup import task_options


class TrlSnapshots:
    """The TRL child's snapshots: :meth:`run` (a thread, started before TRL is even imported) sleeps
    until each fraction of the budget, takes the lock the callback holds across every optimizer step
    and copies the weights, then saves them (the base model, unsaved, while training has not begun);
    after the last fraction it exits the process."""

    def __init__(self, s: Any, arm_dir: Path, t0: float) -> None:
        self.s, self.arm_dir, self.t0 = s, arm_dir, t0
        self.lock, self.updates, self.model, self.tok = threading.Lock(), 0, None, None

    def run(self) -> None:
        for f in self.s.fractions:
            time.sleep(max(0.0, self.t0 + f * self.s.budget_s - time.time()))
            with self.lock:  # a copy in memory (tied tensors stay tied); written after the lock
                row = {"fraction": f, "elapsed_s": time.time() - self.t0, "steps": self.updates,
                       "weights": None, "load": bench_trl.load_average()}
                state = None if self.model is None else self._copy()
            if state is not None:
                tmp, dst = self.arm_dir / f".ckpt-{f:g}", self.arm_dir / f"ckpt-{f:g}"
                self.model.save_pretrained(tmp, state_dict=state)
                self.tok.save_pretrained(tmp)
                os.replace(tmp, dst)
                row["weights"] = dst.name
            with open(self.arm_dir / "snapshots.jsonl", "a", encoding="utf-8") as fh:
                fh.write(json.dumps(row) + "\n")
        os._exit(0)  # the budget is spent: the arm's process ends here

    def _copy(self) -> dict:
        copies: dict = {}  # by storage: a tied head stays one tensor
        for v in self.model.state_dict().values():
            if v.data_ptr() not in copies:
                copies[v.data_ptr()] = v.detach().clone()
        return {k: copies[v.data_ptr()] for k, v in self.model.state_dict().items()}

    def callback(self):
        from transformers import TrainerCallback

        snaps = self

        class Hold(TrainerCallback):
            def on_train_begin(self, args, state, control, model=None, **kw):
                snaps.model = model

            def on_pre_optimizer_step(self, args, state, control, **kw):
                snaps.lock.acquire()

            def on_optimizer_step(self, args, state, control, **kw):
                snaps.updates += 1
                snaps.lock.release()

        return Hold()


def trl_child(s: Any, task: Any, arm_dir: Path, seed: int, t0: float) -> int:
    """The TRL arm (in its own process) on ``bench_tta``'s setup ``s`` and task module ``task``:
    trains until the last snapshot is written, then exits."""
    snaps = TrlSnapshots(s, arm_dir, t0)
    threading.Thread(target=snaps.run, daemon=True).start()
    import torch
    from datasets import Dataset
    from transformers.utils import logging as hf_logging
    from trl import GRPOTrainer

    from saorl.models.loading import load_policy
    from saorl.models.tokenizer import load_tokenizer

    hf_logging.disable_progress_bar()
    torch.set_num_threads(s.trl_threads)
    tok = load_tokenizer(s.model)
    tok.padding_side = "left"
    snaps.tok = tok
    rows = [json.loads(line) for line in open(s.train_file, encoding="utf-8")]
    arm = task.trl_arm(rows, tok, s.max_new, **task_options(s))
    cfg = bench_trl.grpo_config(arm_dir / "trl", batch=s.batch, group=s.group, max_new=s.max_new, lr=s.lr,
                                seed=seed, reward_weights=arm["reward_weights"], **arm["config"])
    trainer = GRPOTrainer(model=load_policy(s.model), args=cfg, train_dataset=Dataset.from_list(arm["rows"]),
                          processing_class=tok, reward_funcs=arm["reward_funcs"], tools=arm["tools"],
                          callbacks=[snaps.callback()])
    trainer.train()  # (a run that ends before the budget: the thread still writes the rest, then exits)
    time.sleep(max(0.0, t0 + s.budget_s + 600 - time.time()))
    return 1
