"""What ``saorl serve`` says of the model it serves, and the defaults it samples with, as vLLM 0.32 does.

:class:`ServedModel` holds the served names (vLLM's ``--served-model-name``: a request naming
another model gets a 404; responses carry the first name), the path the model came from (the
``root`` of ``/v1/models``), the context length (``--max-model-len``: a prompt longer than it is a
400, and no request generates past it), the system fingerprint, and the sampling defaults of the
model's ``generation_config.json``.

**generation_config.json, as vLLM reads it** (``--generation-config auto``, the default;
``vllm/config/model.py:get_diff_sampling_param``): the file's ``temperature``, ``top_p``,
``top_k``, ``min_p``, ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty`` and
``max_new_tokens`` (else those of ``config.json``, which transformers falls back to) are the
defaults of a request that leaves the field unset; ``max_new_tokens`` is chat's default
``max_tokens`` (completions keep their 16). Its ``eos_token_id`` ids other than the tokenizer's
EOS stop every request too, reported as ``stop_reason: <id>`` (the tokenizer's EOS stops with
``stop_reason: null``). ``--generation-config vllm`` ignores the file; ``--generation-config DIR``
reads ``DIR/generation_config.json`` instead. A default the engine cannot apply (a penalty,
``min_p``; :mod:`saorl.engines.serve.openai_fields`) is refused when the server starts
(:func:`unhonoured_default`), not silently dropped.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from saorl import __version__
from saorl.engines.serve.openai_api import ModelNotFound
from saorl.engines.serve.openai_fields import UNHONOURED

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "max_new_tokens")


@dataclass(frozen=True)
class ServedModel:
    names: tuple[str, ...] = ("saorl",)
    """The names a request may give as ``model``; the first is the one responses carry."""
    root: str = "saorl"
    """What the model was loaded from (``/v1/models``'s ``root``)."""
    max_model_len: int | None = None
    """The context length (prompt + completion); None: the engine's own."""
    defaults: dict[str, Any] = field(default_factory=dict)
    """Sampling defaults by request field name (``max_tokens`` for ``max_new_tokens``)."""
    eos_token_id: int | None = None
    """The EOS the engine stops on by itself (reported as ``stop_reason: null``); None: none."""
    extra_eos: tuple[int, ...] = ()
    """``generation_config.json``'s other EOS ids: stop tokens of every request."""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not self.names or any(not isinstance(n, str) or not n for n in self.names):
            raise ValueError(f"served model names must be non-empty strings, got {self.names!r}")

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def fingerprint(self) -> str:
        """``saorl-<version>-<8 hex digits of what is served>``, as vLLM's ``system_fingerprint``."""
        digest = hashlib.sha256(json.dumps([self.root, self.max_model_len, self.defaults]).encode())
        return f"saorl-{__version__}-{digest.hexdigest()[:8]}"

    def check(self, model: str | None) -> None:
        """:class:`~saorl.engines.serve.openai_api.ModelNotFound` (a 404) when ``model`` names none of
        the served names; no model at all is the served one, as in vLLM."""
        if model and model not in self.names:
            names = ", ".join(self.names)
            shown = model if len(model) <= 200 else f"{model[:200]}... ({len(model)} characters)"
            raise ModelNotFound(f"The model `{shown}` does not exist. Valid aliases: {names}.")


def generation_defaults(model_dir: str | Path | None,
                        mode: str = "auto") -> tuple[dict[str, Any], tuple[int, ...]]:
    """``(sampling defaults, EOS ids)`` of ``model_dir`` (a local directory; anything else has none)
    under ``--generation-config mode``: ``auto`` (the model's), ``vllm`` (none) or a directory."""
    if mode == "vllm":
        return {}, ()
    where = Path(model_dir) if mode == "auto" and model_dir is not None else (
        Path(mode) if mode != "auto" else None)
    config = _read(where)
    defaults = {k: config[k] for k in SAMPLING_KEYS if config.get(k) is not None}
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    eos = config.get("eos_token_id")
    eos = [eos] if isinstance(eos, int) else eos if isinstance(eos, list) else []
    return defaults, tuple(e for e in eos if isinstance(e, int))


def _read(where: Path | None) -> dict[str, Any]:
    if where is None or not where.is_dir():
        return {}
    for name in ("generation_config.json", "config.json"):
        if (where / name).is_file():
            try:
                out = json.loads((where / name).read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise ValueError(f"{where / name} is not readable JSON: {e}") from None
            return out if isinstance(out, dict) else {}
    return {}


def unhonoured_default(defaults: dict[str, Any]) -> str | None:
    """Why the server cannot start with ``defaults`` (a default the engine cannot apply, or one no
    request could sample with), or None."""
    from saorl.engines.base import SamplingParams

    try:
        SamplingParams(temperature=defaults.get("temperature", 1.0), top_p=defaults.get("top_p", 1.0),
                       top_k=max(defaults.get("top_k", 0), 0), max_new_tokens=defaults.get("max_tokens", 1))
    except (TypeError, ValueError) as e:
        return f"the model's generation_config.json holds a default no request can sample with: {e}"
    for name, value in defaults.items():
        if name in UNHONOURED and not UNHONOURED[name][0](value):
            return (f"the model's generation_config.json sets {name}={value}, which saorl serve's engine "
                    f"cannot apply (it samples with temperature, top-k and top-p only); vLLM would apply "
                    f"it to every request that leaves {name} unset. Start with --generation-config vllm "
                    "to ignore the file's defaults, or --generation-config DIR for another file")
    return None
