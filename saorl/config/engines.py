"""``rollout.engine``: which inference engine samples the rollouts, one typed section per kind.

The kind is the discriminator ``kind`` and each kind has its own knobs, so a knob of another kind
(``slots`` with ``kind: vllm``) fails at load, naming the field and the kind::

    rollout:
      engine: {kind: local, slots: 16}                     # saorl's own torch engine (default)
      engine: {kind: vllm, urls: [http://gpu1:8000], model: policy}
      engine: vllm                                         # a bare kind: that kind with its defaults

What each kind is built into (its client, the admin that publishes weights to its servers, its
server's name) is one row of :data:`saorl.engines.kinds.KINDS`; the config does not import the
engines. Adding a kind is its section here (and in :data:`ENGINE_CONFIGS`), one row there, and
its client.

The flat spellings of before (``rollout.engine_slots``, ``rollout.engine_urls``,
``rollout.http_url``, ...) still load: :func:`nest_flat_spellings` moves each into the engine's
section (:data:`FLAT_SPELLINGS`). A flat knob of a kind the run does not use was ignored before
and is dropped now, silently at its old default (every run directory written before holds all of
them) and with a warning otherwise.
"""

from __future__ import annotations

import re
import warnings
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import Field, field_validator, model_validator

from saorl.config.base import FieldError, Section


class LocalEngineConfig(Section):
    """saorl's own torch engine (KV cache, continuous batching), in each rollout worker."""

    kind: Literal["local"] = "local"
    """``local``: the in-process torch engine, loaded from the policy in each rollout worker."""
    IN_PLACE: ClassVar[bool] = False
    """Whether the trainer puts each version on this kind's servers itself and checks it there (a
    server it does not control refuses ``ray.weights=object_store``)."""
    LOADS_ADAPTERS: ClassVar[bool] = True
    """Whether this kind takes a LoRA policy's published adapter (``model.lora``)."""
    slots: int = Field(16, ge=1)
    """Sequences the local engine decodes together (its batch size)."""
    prefix_cache_tokens: int = Field(65536, ge=0)
    """Tokens of KV cache the local engine keeps between the turns of its episodes, so a turn
    prefills only the new observation tokens (0 = off: every turn re-prefills its context). An
    episode's row is freed when the episode ends; the budget bounds the rows of episodes between
    turns (the oldest goes first)."""
    prefix_after_update: Literal["recompute", "keep"] = "keep"
    """What a weight update does to the kept KV: ``keep`` lets the next turn continue on KV
    computed by older weights, as a sequence in flight during an update does (each token's
    log-prob and version stay those of the weights that drew it; DIS absorbs the older context;
    in async runs, where weights change every step, ~1.6× the trained tokens/s of ``recompute``,
    docs/performance.md); ``recompute`` drops it, so the next turn re-prefills its context with
    the new weights and every turn is sampled exactly as after a full re-prefill."""
    pack_weights: bool = True
    """On a CPU, the local engine's float32 linear layers compute on oneDNN-packed copies of their
    weights, repacked after each update: 1.2-1.8× the decode tokens/s of plain ``nn.Linear`` on
    SmolLM2-135M (docs/performance.md); results equal up to float32 rounding. ``false``: plain."""
    pack_in_place: bool = True
    """In a rollout worker's engine (and the ``inprocess`` backend's, which loads a model of its
    own), whose model nothing else reads, the packed copies replace the layers' own weights instead
    of sitting beside them: the weights are held once (0.4 GB less on SmolLM2-135M; a vocabulary
    projection tied to the embedding keeps its own). Sampling is the same bit for bit. Needs
    ``pack_weights``; evaluations and value pretraining (on the trainer's policy) and ``saorl serve``
    always keep both."""
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """The local engine's own parameter dtype (None: ``model.dtype``); the trainer keeps
    ``model.dtype``. An engine in lower precision than the trainer is the engine/trainer mismatch of
    real deployments, which DIS exists to absorb."""
    moe_top_k: int | None = Field(None, ge=1)
    """The local engine routes each token to this many experts (None: the model's own); the trainer
    keeps the model's. A dial for engine/trainer routing mismatch (MoE policies only)."""
    router_noise: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    """The local engine picks experts from router logits plus N(0, σ²) noise, σ = this (the picked
    experts' weights stay the router's own probabilities); 0 = none. MoE policies only."""

    @property
    def perturbed(self) -> bool:
        """Whether the engine's routing differs from the model's (``moe_top_k`` or ``router_noise``)."""
        return self.moe_top_k is not None or bool(self.router_noise)


class _ServersConfig(Section):
    """Clients of servers at ``urls``; each worker spreads its requests over all of them."""

    kind: str
    IN_PLACE: ClassVar[bool] = False
    LOADS_ADAPTERS: ClassVar[bool] = False
    urls: list[str] = Field(default_factory=list)
    """Base URLs (``http://host:port``) of the servers (at least one); each worker spreads its
    requests over all of them."""
    routing: Literal["least_loaded", "round_robin"] = "least_loaded"
    """How a worker picks a server per request: the one with the fewest of its requests in flight,
    or in turn."""

    @field_validator("urls")
    @classmethod
    def _urls(cls, v: list[str]) -> list[str]:
        bad = [u for u in v if not re.fullmatch(r"https?://[^\s/]+(:\d+)?/?", u)]
        if bad:
            raise ValueError(f"each URL must look like http://host:port, got {bad}")
        if len(set(v)) != len(v):
            raise ValueError(f"a URL is listed twice: {v}")
        return v

    @model_validator(mode="after")
    def _some_urls(self) -> _ServersConfig:
        if not self.urls:
            raise FieldError("urls", f"required when kind is {self.kind!r}: the base URLs of the servers you "
                             f"started, e.g. rollout.engine='{{kind: {self.kind}, urls: [http://127.0.0.1:8000]}}'")
        return self


class _InPlaceConfig(_ServersConfig):
    """Servers the user started that the trainer updates in place after every step and checks."""

    IN_PLACE: ClassVar[bool] = True
    LOADS_ADAPTERS: ClassVar[bool] = True
    weight_update_timeout_s: float = Field(600.0, gt=0.0)
    """Watchdog of one weight update on a server (pause + load); past it the run stops with an
    error naming the server (the server is resumed first)."""
    verify_every: int = Field(5, ge=0)
    """After the first publication (the starting weights) and the second (the first that changed
    them), and then every this many versions, each server's log-probs of one sampled request are
    compared with the trainer's for the same tokens (same temperature and truncation); 0 = the
    first two only. A failed check stops the run (exit 3)."""
    verify_tol: float | None = Field(None, ge=0.0)
    """The largest per-token log-prob gap (nats) a check accepts; None: by ``model.dtype``, 1e-3 for
    float32, 0.25 for bfloat16, 0.1 for float16 (measured gaps: docs/engines.md)."""


class HttpEngineConfig(_ServersConfig):
    """``saorl serve`` servers, which load each published version from the run's files themselves."""

    kind: Literal["http"] = "http"
    """``http``: ``saorl serve`` servers at ``urls`` (started with ``--weights-dir`` on a disk they
    share with the trainer)."""
    model: str | None = None
    """The served model name sent as ``model`` (``saorl serve --served-model-name``); None sends
    none (the server's only model)."""


class VllmEngineConfig(_InPlaceConfig):
    """vLLM servers the user started (docs/engines.md: versions, launch flags)."""

    kind: Literal["vllm"] = "vllm"
    """``vllm``: vLLM servers at ``urls``, updated in place by the trainer after every step."""
    model: str | None = None
    """The served model name sent as ``model`` (vLLM's ``--served-model-name``); None sends none
    (the server's only model)."""


class SglangEngineConfig(_InPlaceConfig):
    """SGLang servers the user started (docs/engines.md: versions, launch flags)."""

    kind: Literal["sglang"] = "sglang"
    """``sglang``: SGLang servers at ``urls``, updated in place by the trainer after every step."""
    pause_mode: Literal["abort", "retract", "in_place"] = "abort"
    """How SGLang pauses for a weight update: ``abort`` returns requests in flight at once and the
    client continues them with the new weights (exact per-token versions, KV recomputed);
    ``retract`` / ``in_place`` keep them on the server (their cached KV was computed by the old
    weights)."""


ENGINE_CONFIGS: dict[str, type[Section]] = {
    "local": LocalEngineConfig, "http": HttpEngineConfig, "vllm": VllmEngineConfig,
    "sglang": SglangEngineConfig,
}
"""Each kind's section, by ``kind``."""

IN_PLACE_KINDS: tuple[str, ...] = tuple(k for k, c in ENGINE_CONFIGS.items() if c.IN_PLACE)
"""The kinds of servers the trainer updates in place, the first the default of ``saorl check-server``."""

EngineConfig = Annotated[
    Union[LocalEngineConfig, HttpEngineConfig, VllmEngineConfig, SglangEngineConfig],  # noqa: UP007
    Field(discriminator="kind"),
]
"""``rollout.engine``: one of the sections above, picked by its ``kind``."""

ServerEngineConfig = Union[HttpEngineConfig, VllmEngineConfig, SglangEngineConfig]  # noqa: UP007
"""The kinds that are clients of servers."""


# ------------------------------------------------------------------------------- flat spellings
FLAT_SPELLINGS: dict[str, tuple[str, Any]] = {
    "engine_slots": ("slots", 16), "prefix_cache_tokens": ("prefix_cache_tokens", 65536),
    "prefix_after_update": ("prefix_after_update", "keep"), "dtype": ("dtype", None),
    "moe_top_k": ("moe_top_k", None), "router_noise": ("router_noise", 0.0),
    "engine_urls": ("urls", []), "http_url": ("urls", None), "engine_routing": ("routing", "least_loaded"),
    "engine_model": ("model", None), "sglang_pause_mode": ("pause_mode", "abort"),
    "weight_update_timeout_s": ("weight_update_timeout_s", 600.0), "verify_every": ("verify_every", 5),
    "verify_tol": ("verify_tol", None),
}
"""The fields of ``rollout`` that were flat before the engine had a section: old name → (its name in
the engine's section, its old default)."""


def engine_section(value: Any) -> Any:
    """``rollout.engine`` as a section: a bare kind (``vllm``) becomes ``{kind: vllm}``; a mapping
    without ``kind`` is the local engine's. Anything else is left to the validation."""
    if isinstance(value, str):
        return {"kind": value}
    if isinstance(value, dict) and "kind" not in value:
        return {"kind": "local", **value}
    return value


def nest_flat_spellings(data: Any) -> Any:
    """The ``rollout`` mapping ``data`` with its flat engine knobs (:data:`FLAT_SPELLINGS`) moved
    into ``engine`` (see the module docstring); a knob given both ways is an error."""
    if not isinstance(data, dict):
        return data
    flat = {k: data[k] for k in FLAT_SPELLINGS if k in data}
    engine = engine_section(data.get("engine", "local"))
    if not flat or not isinstance(engine, dict) or engine.get("kind") not in ENGINE_CONFIGS:
        return data if "engine" not in data else {**data, "engine": engine}
    out = {k: v for k, v in data.items() if k not in flat}
    engine = dict(engine)
    kind = engine["kind"]
    knobs = ENGINE_CONFIGS[kind].model_fields
    if kind == "http" and flat.get("http_url") and not flat.get("engine_urls"):
        flat["engine_urls"] = [flat["http_url"]]  # engine_urls won when both were given
    for old, value in flat.items():
        new, default = FLAT_SPELLINGS[old]
        if old == "http_url" and kind == "http":
            continue
        if new not in knobs or old == "http_url":
            if value != default:
                owners = [k for k, section in ENGINE_CONFIGS.items() if new in section.model_fields]
                warnings.warn(f"rollout.{old}={value!r} is ignored: rollout.engine is {kind!r}, and its "
                              f"knobs are {', '.join(k for k in knobs if k != 'kind')} (rollout.{old} is "
                              f"now spelled rollout.engine.{new}, a knob of kind {' and '.join(owners)})",
                              UserWarning, stacklevel=2)
            continue
        if new in engine and engine[new] != value:
            raise FieldError(old, f"now spelled rollout.engine.{new}, which is set too: "
                             f"rollout.engine.{new}={engine[new]!r} and rollout.{old}={value!r}; keep one")
        engine[new] = value
    out["engine"] = engine
    return out
