"""An :class:`InferenceEngine` that drives an HTTP inference server (stdlib only).

``dialect="openai"`` (default) speaks ``POST /v1/completions`` as served by ``saorl serve``
(:mod:`saorl.engines.server`) and by vLLM's OpenAI-compatible server. Request fields sent:
``prompt`` (token ids), ``max_tokens``, ``temperature``, ``top_p``, ``top_k`` (-1 when off, vLLM's
convention; saorl accepts it), ``stop``, ``stop_token_ids``, ``seed``, ``logprobs: 1``,
``return_tokens_as_token_ids: true``, ``model``. Response fields read from ``choices[0]``:
``token_ids`` if present (saorl; vLLM with ``return_token_ids``), else the ids parsed from
``logprobs.tokens`` (``"token_id:<id>"``, vLLM's format under ``return_tokens_as_token_ids``);
``logprobs.token_logprobs``; ``finish_reason``; ``stop_reason``. Per-token versions come from
``saorl.versions`` when present; vLLM does not report them, so the client tags tokens with
the version of its last ``update_weights`` call. vLLM's logprobs are those of the processed
distribution only with ``--logprobs-mode processed_logprobs``; set it for DIS.

``dialect="sglang"`` speaks SGLang's native ``POST /generate``: ``{"input_ids": [...],
"sampling_params": {"max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids",
"sampling_seed"}, "return_logprob": true}``; it reads ``output_ids``,
``meta_info.output_token_logprobs`` (``[logprob, token_id, text]`` triples) and
``meta_info.finish_reason`` (``{"type": "stop"|"length"|"abort", "matched": ...}``).

``update_weights`` sends a safetensors path to ``POST /update_weights`` (saorl); a state dict is
first written to a temporary file, so this works only when client and server share a disk.
vLLM / SGLang weight updates go through their own APIs (NCCL groups or disk reloads), which the
runtime's weight-sync layer drives; here they raise :class:`EngineError`.

Failures: connection refused is retried ``retries`` times with exponential backoff (a server
still starting); any other failure (connection dropped mid-request, timeout, non-200 status,
malformed body) raises :class:`EngineError` at once, naming the URL and the cause.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import torch

from saorl.engines.base import EngineError, GenerationResult, SamplingParams


class HttpEngine:
    """Client for ``saorl serve``, vLLM (``dialect="openai"``) or SGLang (``dialect="sglang"``)."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 60.0,
        retries: int = 2,
        model: str = "saorl",
        dialect: Literal["openai", "sglang"] = "openai",
        backoff_s: float = 0.2,
    ) -> None:
        if dialect not in ("openai", "sglang"):
            raise ValueError(f"dialect must be 'openai' or 'sglang', got {dialect!r}")
        if retries < 0 or timeout_s <= 0:
            raise ValueError(f"need retries >= 0 and timeout_s > 0, got {retries}, {timeout_s}")
        self.base_url = base_url.rstrip("/")
        self.timeout_s, self.retries, self.model, self.dialect, self.backoff_s = (
            timeout_s,
            retries,
            model,
            dialect,
            backoff_s,
        )
        self._version = 0
        self._stats = {"requests": 0, "tokens_generated": 0, "weight_updates": 0}

    @property
    def version(self) -> int:
        return self._version

    def stats(self) -> dict[str, float]:
        return dict(self._stats)

    # ----------------------------------------------------------------- transport
    def _request(self, method: str, path: str, body: dict | None = None) -> dict:
        url = self.base_url + path
        data = None if body is None else json.dumps(body).encode()
        for attempt in range(self.retries + 1):
            req = urllib.request.Request(
                url, data=data, method=method, headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    return json.loads(resp.read())
            except urllib.error.HTTPError as e:
                detail = e.read().decode(errors="replace")[:500]
                raise EngineError(f"{method} {url} failed with HTTP {e.code}: {detail}") from e
            except urllib.error.URLError as e:
                if isinstance(e.reason, ConnectionRefusedError) and attempt < self.retries:
                    time.sleep(self.backoff_s * 2**attempt)
                    continue
                raise EngineError(
                    f"{method} {url}: cannot reach server ({e.reason}) after {attempt + 1} attempt(s)"
                ) from e
            except TimeoutError as e:
                raise EngineError(f"{method} {url}: no response within {self.timeout_s}s") from e
            except (http.client.HTTPException, ConnectionError, OSError) as e:
                raise EngineError(f"{method} {url}: connection lost mid-request (server died?): {e!r}") from e
            except json.JSONDecodeError as e:
                raise EngineError(f"{method} {url}: response is not JSON: {e}") from e
        raise AssertionError("unreachable")

    # ----------------------------------------------------------------- dialects
    def _openai(self, prompt: list[int], p: SamplingParams) -> GenerationResult:
        body = dict(
            model=self.model,
            prompt=prompt,
            max_tokens=p.max_new_tokens,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k or -1,
            stop=list(p.stop),
            stop_token_ids=list(p.stop_token_ids),
            logprobs=1,
            return_tokens_as_token_ids=True,
        )
        if p.seed is not None:
            body["seed"] = p.seed
        out = self._request("POST", "/v1/completions", body)
        try:
            choice = out["choices"][0]
            lp = choice["logprobs"]
            ids = choice.get("token_ids") or [int(t.split(":", 1)[1]) for t in lp["tokens"]]
            extra = out.get("saorl") or {}
            versions = extra.get("versions") or [self._version] * len(ids)
            if "engine_version" in extra:
                self._version = int(extra["engine_version"])
            return GenerationResult(
                list(ids),
                [float(x) for x in lp["token_logprobs"]],
                choice["finish_reason"] or "abort",
                list(versions),
                choice.get("stop_reason"),
                dict(usage=out.get("usage", {})),
            )
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise EngineError(
                f"malformed completion response from {self.base_url}: {e!r}: {str(out)[:300]}"
            ) from e

    def _sglang(self, prompt: list[int], p: SamplingParams) -> GenerationResult:
        sp = dict(
            max_new_tokens=p.max_new_tokens,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k or -1,
            stop=list(p.stop),
            stop_token_ids=list(p.stop_token_ids),
        )
        if p.seed is not None:
            sp["sampling_seed"] = p.seed
        out = self._request(
            "POST", "/generate", dict(input_ids=prompt, sampling_params=sp, return_logprob=True)
        )
        try:
            meta = out["meta_info"]
            triples = meta["output_token_logprobs"]
            ids = out.get("output_ids") or [int(t[1]) for t in triples]
            fin = meta.get("finish_reason") or {}
            return GenerationResult(
                list(ids),
                [float(t[0]) for t in triples],
                fin.get("type", "abort"),
                [self._version] * len(ids),
                fin.get("matched"),
                dict(meta_info=meta),
            )
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise EngineError(
                f"malformed /generate response from {self.base_url}: {e!r}: {str(out)[:300]}"
            ) from e

    # ----------------------------------------------------------------- InferenceEngine
    def _one(self, prompt: list[int], params: SamplingParams) -> GenerationResult:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        res = (self._openai if self.dialect == "openai" else self._sglang)(list(prompt), params)
        self._stats["requests"] += 1
        self._stats["tokens_generated"] += len(res.token_ids)
        return res

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[GenerationResult]:
        """All prompts in flight at once (one HTTP request each), so the server batches them."""
        if len(prompts) <= 1:
            return [self._one(p, params) for p in prompts]
        with ThreadPoolExecutor(max_workers=min(32, len(prompts))) as pool:
            return list(pool.map(lambda p: self._one(p, params), prompts))

    async def agenerate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        return await asyncio.to_thread(self._one, prompt_ids, params)

    def update_weights(self, weights: dict[str, torch.Tensor] | str, version: int) -> None:
        if self.dialect != "openai":
            raise EngineError("update_weights over HTTP is implemented for saorl serve only")
        if isinstance(weights, str):
            self._request(
                "POST", "/update_weights", {"path": os.path.abspath(weights), "version": int(version)}
            )
        else:
            from safetensors.torch import save_file

            with tempfile.TemporaryDirectory() as d:
                path = os.path.join(d, "weights.safetensors")
                save_file({k: v.detach().contiguous().cpu() for k, v in _untied(weights).items()}, path)
                self._request("POST", "/update_weights", {"path": path, "version": int(version)})
        self._version = int(version)
        self._stats["weight_updates"] += 1

    def close(self) -> None:
        pass


def _untied(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop later names that share storage with an earlier one (safetensors refuses shared tensors)."""
    seen, out = set(), {}
    for k, v in weights.items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
        if key not in seen:
            seen.add(key)
            out[k] = v
    return out
