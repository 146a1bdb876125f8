"""The start-up memory check: the run's estimated peak RSS against this machine's free memory.

A run of a 135M model on a CPU takes several GB (the trainer's policy, its AdamW moments, the
critic, a step's activations; each rollout worker's engine), and a machine short of it ends the run
with the OOM killer's SIGKILL, minutes in, without a word. So ``saorl train`` adds up, before any
model is loaded, what the RL steps will hold (:func:`estimate_memory`: parameter counts from the
model's config on the meta device, times bytes), and when ``MemAvailable`` of ``/proc/meminfo`` is
less, says so in one paragraph: the estimate, what is free, and the settings that lower it.

The parts, in MiB (``N`` the policy's parameters, ``b`` bytes a parameter in the training dtype):

- the trainer: :data:`BASE_MIB` (torch, transformers and saorl imported); the policy ``N·b``, its
  AdamW moments ``2·N·b`` and, during a step, its gradients ``N·b`` (with LoRA: the adapter only, a
  few MB: left out); the critic's trunk (a copy of the policy's without its vocabulary projection
  when untied), its trainable part's moments and gradients (frozen attention: the MLP projections
  only; ``algo.critic_train_layers``: the top layers' share of them); one pass's activations,
  ``tokens · (layers · hidden · 4 B · ACT_FLOATS + vocab · 4 B · LOGIT_COPIES)`` with
  ``tokens = min(batch_size · max_total_tokens, max_tokens_per_microbatch)``
  (activation checkpointing keeps a layer's input only; chunked scoring one chunk's logits);
- each rollout worker (``runtime.backend: local``, engine ``local``; in the trainer with
  ``inprocess``): :data:`BASE_MIB`, the engine's model, its oneDNN-packed copy (float32 on a CPU,
  ``pack_weights``; with ``pack_in_place`` the model's own linear weights are freed, a tied
  vocabulary projection's kept), the largest tensor of an update (read one at a time:
  :class:`~saorl.models.hf_format.FileWeights`; an adapter's merged weights too:
  :class:`~saorl.models.adapter.MergedWeights`), with LoRA a copy of the adapted weights (the base
  each adapter is merged into), and the KV cache of its slots;
- :data:`SLACK` on top: the allocator's free memory it keeps between steps.

Measured on SmolLM2-135M-Instruct, the sums recipe (``docs/performance.md``, "Memory"): the constants
below come from those runs, and the estimate is checked against them in the tests. The servers of
``vllm`` / ``sglang`` engines, a GPU's own memory and a sharded trainer's ranks are not estimated.

``run.memory_check``: ``auto`` (the default) warns when the estimate is more than is available
and stops the start only when it is more than the machine's whole memory (``MemTotal``: it cannot
fit however much is freed); ``warn`` never stops; ``skip`` says nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from saorl.config import SaorlConfig
from saorl.config.engines import LocalEngineConfig
from saorl.errors import StartupError

MIB = 2**20
BASE_MIB = 420
"""RSS of a process with torch, transformers and saorl imported (measured: 366 to 417 MiB)."""
ACT_FLOATS = 13
"""Floats a layer keeps per token and hidden unit for the backward (fit to SmolLM2-135M's policy
pass: 1.68 MB a token over 768 tokens with 4 logit copies)."""
CHECKPOINTED_FLOATS = 2
"""The same with activation checkpointing (a layer's input, and one layer recomputed at a time)."""
LOGIT_COPIES = 4
"""Float32 copies of a position's logits alive in a pass (logits, log-softmax, softmax for the
entropy, their gradient)."""
SLACK = 1.1
"""The allocator's share on top of the live tensors (the free memory it keeps between steps)."""
LOGITS_CHUNK_MIB = 64
"""A chunk of scored positions' logits (saorl.models.logprobs.LOGITS_CHUNK_BYTES)."""


@dataclass
class MemoryEstimate:
    """The parts (MiB) of the trainer's and of one rollout worker's peak, and how many workers."""

    trainer: dict[str, float] = field(default_factory=dict)
    worker: dict[str, float] = field(default_factory=dict)
    workers: int = 0
    packing_mib: float = 0.0
    """What a worker's packed copies add to its model's own weights (what ``pack_weights=false``
    saves, before :data:`SLACK`): the whole copy, or with ``pack_in_place`` the tied head's alone."""

    @property
    def trainer_mib(self) -> float:
        return SLACK * sum(self.trainer.values())

    @property
    def worker_mib(self) -> float:
        return SLACK * sum(self.worker.values())

    @property
    def total_mib(self) -> float:
        return self.trainer_mib + self.workers * self.worker_mib


def _bytes(dtype: str | torch.dtype) -> int:
    from saorl.models.loading import resolve_dtype

    return torch.empty((), dtype=resolve_dtype(dtype)).element_size()


def _shape(spec: str) -> dict:
    """Parameter counts and sizes of the policy ``spec`` from its config (meta device, no weights)."""
    from saorl.engines.kv import kv_per_token
    from saorl.models.critic import _MLP_TRAINABLE
    from saorl.models.loading import meta_policy

    model = meta_policy(spec)
    cfg = model.config
    params = dict(model.named_parameters())  # a tied head is one parameter, counted once
    total = sum(p.numel() for p in params.values())
    head = model.get_output_embeddings()
    head_own = 0 if head is None or cfg.tie_word_embeddings else head.weight.numel()
    mlp = sum(p.numel() for n, p in params.items() if _MLP_TRAINABLE.search(n))
    layers, hidden = cfg.num_hidden_layers, cfg.hidden_size
    by_name: dict[str, int] = {}  # each linear module's own name (q_proj, ...): its weights in all
    for name, m in model.named_modules():
        if type(m) is torch.nn.Linear:
            own = name.rpartition(".")[2]
            by_name[own] = by_name.get(own, 0) + m.weight.numel()
    linear = sum(by_name.values())
    tied = head.weight.numel() if head is not None and cfg.tie_word_embeddings else 0
    largest = max(p.numel() for p in params.values())
    return {"params": total, "trunk": total - head_own, "mlp": mlp, "linear": linear, "largest": largest,
            "released": linear - tied,  # what a worker's engine packs in place (not the tied head)
            "linear_by_name": by_name,
            "layers": layers,
            "hidden": hidden,
            "vocab": cfg.vocab_size, "kv_per_token": kv_per_token(cfg)}


def estimate_memory(cfg: SaorlConfig) -> MemoryEstimate | None:
    """The run's parts (module docstring); None where it is not estimated (a GPU, a sharded trainer)."""
    from saorl.models.loading import train_dtype

    if cfg.trainer.shard == "fsdp2" or not str(cfg.model.device).startswith("cpu"):
        return None
    s = _shape(cfg.model.policy)
    t, r = cfg.trainer, cfg.rollout
    b = _bytes(train_dtype(cfg.model.dtype))
    lora = cfg.model.lora.enabled
    est = MemoryEstimate()
    est.trainer["base"] = BASE_MIB
    est.trainer["policy"] = s["params"] * b / MIB
    est.trainer["policy AdamW moments"] = 0.0 if lora else 2 * s["params"] * b / MIB
    est.trainer["policy gradients"] = 0.0 if lora else s["params"] * b / MIB
    if cfg.algo.preset.use_critic:
        trains = 0 if lora and cfg.model.lora.critic else (
            s["mlp"] if cfg.algo.preset.freeze_critic_attention else s["trunk"])
        top = cfg.algo.preset.critic_train_layers
        if top is not None:  # only the top blocks train (their share of the layers, roughly)
            trains = trains * min(top, s["layers"]) / s["layers"]
        est.trainer["critic"] = s["trunk"] * b / MIB
        est.trainer["critic AdamW moments and gradients"] = 3 * trains * b / MIB
    tokens = min(t.batch_size * r.max_total_tokens, t.max_tokens_per_microbatch)
    floats = CHECKPOINTED_FLOATS if t.activation_checkpointing else ACT_FLOATS
    logits = tokens * s["vocab"] * 4 * LOGIT_COPIES / MIB
    if tokens * s["vocab"] * 4 > 256 * MIB:  # scored in chunks (saorl.models.logprobs.CHUNK_ABOVE_BYTES)
        logits = LOGITS_CHUNK_MIB * LOGIT_COPIES
    est.trainer["a pass's activations"] = tokens * s["layers"] * s["hidden"] * 4 * floats / MIB + logits
    engine = r.engine
    if isinstance(engine, LocalEngineConfig):
        eb = _bytes(engine.dtype or cfg.model.dtype)
        worker = {"base": BASE_MIB, "engine's model": s["params"] * eb / MIB,
                  "weights of an update": s["largest"] * eb / MIB,
                  "KV cache": engine.slots * r.max_total_tokens * s["kv_per_token"] * eb / MIB}
        if engine.pack_weights and eb == 4:  # every nn.Linear, the (tied) vocabulary projection too
            worker["packed copy"] = s["linear"] * eb / MIB
            est.packing_mib = worker["packed copy"]
            if engine.pack_in_place:  # the model's own linear weights freed, but a tied head's
                worker["engine's model"] -= s["released"] * eb / MIB
                est.packing_mib -= s["released"] * eb / MIB
        if lora:  # the base the adapters are merged into (saorl.models.adapter.AdapterMerger)
            adapted = sum(s["linear_by_name"].get(n, 0) for n in set(cfg.model.lora.target_modules))
            worker["the adapted weights' base (LoRA)"] = adapted * eb / MIB
        if cfg.runtime.backend == "inprocess":
            for k, v in worker.items():
                if k != "base":
                    est.trainer[f"engine: {k}"] = v
        else:
            est.worker, est.workers = worker, r.num_workers
    return est


def meminfo(path: Path = Path("/proc/meminfo")) -> dict[str, float]:
    """``/proc/meminfo`` in MiB (empty off Linux)."""
    out: dict[str, float] = {}
    try:
        for line in path.read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if len(parts) == 2 and parts[0].isdigit() and parts[1] == "kB":
                out[key] = int(parts[0]) / 1024
    except OSError:
        return {}
    return out


def size(mib: float) -> str:
    """``mib`` as the paragraph says it: ``5.5 GB``, or ``300 MiB`` under a GiB."""
    return f"{mib / 1024:.1f} GB" if mib >= 1024 else f"{mib:.0f} MiB"


def lowering(cfg: SaorlConfig, est: MemoryEstimate) -> list[str]:
    """The settings that would lower ``est``, each with what it saves."""
    t, r = cfg.trainer, cfg.rollout
    out = []
    act = est.trainer.get("a pass's activations", 0.0)
    if not t.activation_checkpointing:
        out.append(f"trainer.activation_checkpointing=true (most of the {size(SLACK * act)} of a pass's "
                   "activations, for a slower step)")
    if min(t.batch_size * r.max_total_tokens, t.max_tokens_per_microbatch) > 1024:
        out.append("trainer.max_tokens_per_microbatch=1024 (fewer tokens in one pass)")
    if "packed copy" in est.worker:
        out.append(f"rollout.engine.pack_weights=false ({size(SLACK * est.packing_mib)} a worker, "
                   "for slower decoding)")
    if est.workers > 1:
        out.append(f"rollout.num_workers=1 ({size((est.workers - 1) * est.worker_mib)})")
    if not cfg.model.lora.enabled:
        whole = SLACK * (est.trainer["policy AdamW moments"] + est.trainer["policy gradients"])
        out.append(f"model.lora.rank=8 (an adapter's gradients and moments instead of the whole policy's: "
                   f"{size(whole)})")
    return out


def memory_paragraph(cfg: SaorlConfig, est: MemoryEstimate, available: float) -> str:
    """The start-up paragraph: the estimate and its parts, what is free, what lowers it."""
    big = sorted(est.trainer.items(), key=lambda kv: -kv[1])[:4]
    parts = ", ".join(f"{k} {size(SLACK * v)}" for k, v in big)
    workers = (f" + {est.workers} rollout worker{'s' if est.workers > 1 else ''} of {size(est.worker_mib)} "
               "(the engine's model, its packed copy, its KV cache)" if est.workers else "")
    return (f"memory: this run is estimated to need {size(est.total_mib)} at its peak (the trainer "
            f"{size(est.trainer_mib)}: {parts}{workers}), but this machine has {size(available)} "
            "available (MemAvailable); short of it, the OOM killer ends the run without a word. Lower it "
            "with: " + "; ".join(lowering(cfg, est))
            + ". (saorl.stages.memory_check; run.memory_check=skip silences this)")


def check_memory(cfg: SaorlConfig, log: Callable[[str], None] = print,
                 info: dict[str, float] | None = None) -> MemoryEstimate | None:
    """Estimate, compare with ``MemAvailable`` (``info``: ``/proc/meminfo`` in MiB, read when None)
    and say so when short (module docstring); raises :class:`StartupError` under ``auto`` when the
    estimate passes ``MemTotal``. Returns the estimate (None: not estimated)."""
    mode = cfg.run.memory_check
    if mode == "skip":
        return None
    est = estimate_memory(cfg)
    info = meminfo() if info is None else info
    if est is None or "MemAvailable" not in info:
        return est
    if est.total_mib <= info["MemAvailable"]:
        return est
    text = memory_paragraph(cfg, est, info["MemAvailable"])
    if mode == "auto" and est.total_mib > info.get("MemTotal", float("inf")):
        raise StartupError(f"{text} It is more than this machine's whole memory ({size(info['MemTotal'])}, "
                           "MemTotal): the run cannot fit. To start it anyway: run.memory_check=warn.")
    log(text)
    return est
