"""Publishing each policy version to vLLM / SGLang servers without restarting them, and checking
that the servers then sample from exactly that version.

:class:`ServerPublisher` is the run's :class:`~saorl.runtime.weights.files.WeightPublisher` when
``rollout.engine`` is ``vllm`` or ``sglang``. ``publish(buckets, version)`` of a state dict in the
model's names, under one lock (so two publications never interleave), does:

1. write the weights as a Hugging Face model directory ``RUN/weights/hf/v<version>`` (config.json
   + safetensors under the on-disk names, tied weights included:
   :func:`~saorl.models.hf_format.served_names`), atomically: built in a temporary sibling,
   renamed into place, so a server never reads a half-written directory;
2. on every server at once: pause → load the directory and label the weights ``version`` →
   resume (:class:`~saorl.engines.clients.remote.ServerAdmin`; the routes are each server's own). Resume
   always runs, also when the pause or the load failed. A watchdog bounds pause + load by
   ``timeout_s``: a hung update becomes a :class:`WeightPublishError` naming the server, never a
   silent stall;
3. when the check is due (:meth:`ServerCheck.due`), verify the version on every server (below);
4. announce the version to the rollout workers through the file pointer
   (:class:`~saorl.runtime.weights.files.FilePublisher`), only now that the servers run it, so a
   worker's belief (its fallback version tag) is never ahead of the servers;
5. keep the newest ``keep`` directories and delete older ones.

``publish(buckets, version, WeightNames.checkpoint(config))`` — the sharded trainer's publication,
buckets of full tensors already in checkpoint names — does the same with the directory written bucket by
bucket (never the whole model in memory); its check scores the request with a CPU copy of the
policy loaded from the directory just published (the sharded policy is not whole in this process).

**LoRA adapters** (``WeightNames.adapter(config)``, a ``model.lora`` run on vLLM or SGLang servers):
the base weights never change on the servers, so nothing is paused or reloaded. The adapter directory
``RUN/weights/v<version>-adapter`` (peft's layout) is written atomically and loaded on every server
at once under its own name (:func:`saorl.engines.clients.adapters.adapter_name`; ``POST
/v1/load_lora_adapter``, bounded by ``timeout_s``); the check, when due, asks the servers for that
name and scores the tokens with the trainer's LoRA policy (base + adapter); then the version is
announced (the workers derive the name from the announced directory and name it in every request,
so each token's version is exact), and every adapter but the newest
:data:`~saorl.engines.clients.adapters.KEEP_LOADED` (this one and the one before it, which requests in
flight, or a worker that has not read the announcement yet, may still name) is unloaded (vLLM's
``POST /v1/unload_lora_adapter``, SGLang's ``POST /unload_lora_adapter``: new requests for it are
refused, running ones finish; a worker further behind retries under the newest name,
:mod:`saorl.engines.clients.adapters`).

**The check** (:class:`ServerCheck`). DIS divides by the engine's log-probs, so a server that
samples from other weights than the trainer's — a reload that silently kept a layer, a server
started from another model — trains wrongly without any error. So each server is sent one request
(a fixed prompt, the run's temperature / top-k / top-p, a fixed seed), and the log-probs it returns
for the tokens it sampled are compared with the trainer's own for the same tokens
(:func:`saorl.models.logprobs.token_logprobs` under the same temperature and truncation), by the
**largest per-token gap**; a server fails when two requests in a row (two seeds) are past the
bounds. It runs after the first publication (the run's starting weights: a wrong
model or dtype, a server that returns raw log-probs), after the second (the first that changed the
weights: a reload that did not take) and then every ``every``-th version. A gap above
``tolerance`` stops the run (exit 3) with one paragraph naming the server, the version, the gap and
the likely cause; a server whose log-probs match the *untempered, untruncated* distribution better
is named as running vLLM without ``--logprobs-mode processed_logprobs``. Each check's largest gap
is the step's ``weights/verify_max_gap`` metric.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import shutil
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from saorl.engines.base import EngineError, InferenceEngine, SamplingParams
from saorl.engines.clients.adapters import KEEP_LOADED, adapter_name
from saorl.engines.clients.remote import ServerAdmin
from saorl.engines.clients.transport import HttpTransport
from saorl.errors import RunFailure
from saorl.models.hf_format import save_hf_weights
from saorl.runtime.weights.base import MODEL_NAMES, WeightNames, merged
from saorl.runtime.weights.files import FilePublisher, write_checkpoint_dir

DEFAULT_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.25, "float16": 0.1}
"""The largest per-token log-prob gap a check accepts, by the trainer's dtype (``rollout.engine.verify_tol``
overrides). float32 servers match to < 1e-6 (vLLM 0.32.0 CPU, docs/engines.md); bfloat16 measured
in docs/engines.md."""


class WeightPublishError(RunFailure):
    """A version could not be put on an inference server, or the server does not sample from it;
    the message says which server, which version and why (exit 3)."""


@dataclass
class ServerCheck:
    """One request per server, its log-probs compared with the trainer's (module docstring)."""

    make_engine: Callable[[str], InferenceEngine]
    prompt: list[int]
    sampling: SamplingParams
    tolerance: float
    server_name: str
    every: int = 5
    """Check every ``every``-th version after the first two publications (0: those two only)."""
    replay: bool = False
    """Score with the experts the server routed each token to (``algo.routing_replay``: the
    engine must return routes), as the learner does."""

    def due(self, publications: int, version: int) -> bool:
        """Whether the ``publications``-th publication (1-based) of this run, of ``version``, is checked."""
        return publications <= 2 or (self.every > 0 and version % self.every == 0)

    def check(self, model: torch.nn.Module, urls: Sequence[str], version: int,
              source: str | None = None) -> dict[str, float]:
        """The largest per-token gap per server; raises :class:`WeightPublishError` when a server
        fails (:meth:`judge`). ``source``: the published LoRA adapter directory the requests name
        (``model`` is then the trainer's LoRA policy: base + adapter); None: the servers' weights."""
        gaps = {}
        for url in urls:
            measured, first, ok = self.judge(model, url, (source, version) if source else None)
            if not ok:
                raise WeightPublishError(self.explain(url, f"after version {version} was put on it", *first))
            gaps[url] = measured[0]
        return gaps

    def judge(self, model: torch.nn.Module, url: str, adapter: tuple[str, int] | None = None
              ) -> tuple[tuple, tuple, bool]:
        """``(measurement, first measurement, passed)`` for ``url``: a server fails when two
        requests in a row are out of bounds, the second with the next seed (one round-off outlier
        of a low-precision server is not a wrong model; a wrong model fails every request).
        ``adapter``: ``(directory, version)`` of the LoRA adapter the requests name."""
        first = self.measure(model, url, adapter)
        if self.passed(*first):
            return first, first, True
        again = replace(self, sampling=replace(self.sampling, seed=(self.sampling.seed or 0) + 1))
        second = again.measure(model, url, adapter)
        return second, first, self.passed(*second)

    def passed(self, gap: float, raw_gap: float, tokens: int, outside: int) -> bool:
        """Whether one request's measurement (:meth:`measure`) is within the check's bounds."""
        return gap <= self.tolerance and outside <= tokens // 8

    def measure(self, model: torch.nn.Module, url: str, adapter: tuple[str, int] | None = None
                ) -> tuple[float, float, int, int]:
        """``(largest gap, largest gap to the raw distribution, tokens, tokens outside the
        trainer's top-k / top-p set or at its edge)`` of one request to ``url``. A sampled token
        the trainer's truncation drops (a near-tie at the top-k / top-p edge, as bfloat16 round-off
        makes on a flat distribution) has no finite gap, and a position whose kept set float
        round-off decides (:func:`~saorl.models.truncation.edge_rows`: the server may keep one token
        more or less there, shifting every log-probability of it by that token's share) has no
        exact one: they are counted, not measured."""
        from saorl.models.logprobs import LOGPROB_FLOOR, token_logprobs
        from saorl.models.truncation import edge_rows

        engine = self.make_engine(url)
        try:
            if adapter is not None:
                engine.update_weights(*adapter)
            res = engine.generate([self.prompt], self.sampling)[0]
        except EngineError as e:
            raise WeightPublishError(f"checking the weights on the {self.server_name} server at {url} "
                                     f"failed: {e}") from e
        finally:
            engine.close()
        if not res.token_ids:
            raise WeightPublishError(f"the {self.server_name} server at {url} sampled no token for the "
                                     "weight check; it cannot be verified")
        vocab = model.get_output_embeddings().weight.shape[0]
        if max(res.token_ids) >= vocab:
            raise WeightPublishError(f"the {self.server_name} server at {url} sampled token id "
                                     f"{max(res.token_ids)} for the weight check, beyond the trainer's "
                                     f"vocabulary of {vocab}: it runs another model than the trainer "
                                     "(start it from the run's starting policy)")
        if len(res.logprobs) != len(res.token_ids):
            raise WeightPublishError(f"the {self.server_name} server at {url} returned {len(res.logprobs)} "
                                     f"log-probs for {len(res.token_ids)} tokens of the weight check")
        ids = torch.tensor([self.prompt + res.token_ids], device=next(model.parameters()).device)
        s, n = self.sampling, len(self.prompt)
        with torch.no_grad(), self._routed(model, res.routes, ids.shape[1], url):
            mine = token_logprobs(model, ids, torch.ones_like(ids), temperature=s.temperature or 1.0,
                                  top_k=s.top_k, top_p=s.top_p)[0, n:].float().cpu()
            raw = token_logprobs(model, ids, torch.ones_like(ids))[0, n:].float().cpu()
            logits = model(input_ids=ids).logits[0, n - 1:-1].float() / (s.temperature or 1.0)
        served = torch.tensor(res.logprobs, dtype=torch.float32)
        kept = (mine > LOGPROB_FLOOR / 2) & ~edge_rows(logits, s.top_k, s.top_p).cpu()
        gap = float((served - mine)[kept].abs().max()) if kept.any() else float("inf")
        return gap, float((served - raw).abs().max()), len(res.token_ids), int((~kept).sum())

    def _routed(self, model: torch.nn.Module, routes: list[list[int]] | None, length: int, url: str):
        """With :attr:`replay`, the forward routed as the server did (its routes cover every
        position but the last, which routes as usual)."""
        if not self.replay or routes is None:
            return contextlib.nullcontext()
        from saorl.models.routing import num_moe_layers, replay_routes

        fed = torch.tensor(routes, dtype=torch.long, device=next(model.parameters()).device)
        layers = num_moe_layers(model)
        if fed.dim() != 2 or fed.shape[0] >= length or not layers or fed.shape[1] % layers:
            raise WeightPublishError(f"the {self.server_name} server at {url} returned routes of shape "
                                     f"{tuple(fed.shape)} for {length} tokens, which do not fit the "
                                     f"trainer's {layers} MoE layers: it routes another model")
        full = torch.full((length, fed.shape[1]), -1, dtype=torch.long, device=fed.device)
        full[: fed.shape[0]] = fed
        return replay_routes(model, full.reshape(1, length, layers, -1))

    def explain(self, url: str, when: str, gap: float, raw_gap: float, tokens: int, outside: int) -> str:
        """The paragraph of a failed check of ``url`` (``when``: e.g. "after version 7 was put on it")."""
        s = self.sampling
        off = (f" ({outside} of them outside the trainer's top-k / top-p set or at its edge)"
               if outside else "")
        where = (f"the {self.server_name} server at {url}, checked {when}, "
                 f"returns log-probs up to {gap:.3g} nats per token away from the trainer's for the "
                 f"same {tokens} tokens{off} (tolerance {self.tolerance:g}; temperature={s.temperature}, "
                 f"top_k={s.top_k}, top_p={s.top_p}), so it samples from another distribution than "
                 "the one being trained and every DIS ratio would be wrong. ")
        if math.isfinite(gap) and raw_gap < gap / 10:
            cause = ("Its log-probs match the untempered, untruncated distribution instead (gap "
                     f"{raw_gap:.3g}): start vLLM with --logprobs-mode processed_logprobs.")
        else:
            cause = ("Likely causes: the server runs another model or dtype than the trainer (start it "
                     "from the run's starting policy, with --dtype equal to model.dtype); or a weight "
                     "reload that left some layers on the old weights (vLLM's CPU build keeps "
                     "Mixture-of-Experts weights packed at load: start it with saorl's plugin, "
                     "docs/engines.md). `saorl check-server` tells which. In bfloat16 raise "
                     "rollout.engine.verify_tol only if the gap is rounding.")
        return where + cause


class ServerPublisher:
    """A :class:`~saorl.runtime.weights.files.WeightPublisher` that puts each version on inference
    servers (module docstring); readers follow ``files``' directory."""

    def __init__(self, files: FilePublisher, admins: Sequence[ServerAdmin], transport: HttpTransport,
                 model: torch.nn.Module, *, timeout_s: float = 600.0, keep: int = 2,
                 check: ServerCheck | None = None) -> None:
        if timeout_s <= 0 or keep < 1 or not admins:
            raise ValueError(f"need servers, timeout_s > 0 and keep >= 1, got {len(admins)} servers, "
                             f"{timeout_s}, {keep}")
        self.files, self.admins, self.transport, self.model = files, list(admins), transport, model
        self.timeout_s, self.keep, self.check = timeout_s, keep, check
        self.root = files.dir / "hf"
        self._lock = threading.Lock()
        self.publications = 0
        self.gaps: dict[int, dict[str, float]] = {}
        """Version → the largest per-token gap of each server, for the newest 64 checked versions."""
        self._unreported: dict[str, float] = {}
        self._adapters: list[str] = []
        """The names of the LoRA adapters this object left loaded on the servers, oldest first."""

    def publish(self, buckets, version: int, names: WeightNames = MODEL_NAMES) -> None:
        with self._lock:
            if names.form == "adapter":
                self._publish_adapter(buckets, version, names)
            elif names.form == "checkpoint":
                self._publish_checkpoint(buckets, version, names.config)
            else:
                state_dict = merged(buckets)
                path = save_hf_weights(self.model, state_dict, self.root / f"v{version:08d}")
                self._put_and_check(path, version, lambda: self.model)
                self.files.publish([state_dict], version)
                self._prune()

    def published_version(self) -> int | None:
        return self.files.published_version()

    def _publish_adapter(self, buckets, version: int, names: WeightNames) -> None:
        """A LoRA run's publication (module docstring, "LoRA adapters"): the adapter directory is
        loaded on every server under its own name, checked, announced; then every adapter but this
        one and the one before it (which requests in flight may still name) is unloaded."""
        path = self.files.write(buckets, version, names).resolve()
        name = path.name
        lora = adapter_name(path)
        self.transport.run(self._everywhere("putting the LoRA adapter of version", version,
                                            lambda a: a.load_adapter(lora, str(path))))
        self._after_put(version, lambda: self.model, str(path))
        self.files.announce(version, name)
        self._adapters = [*[n for n in self._adapters if n != lora], lora]
        old, self._adapters = self._adapters[:-KEEP_LOADED], self._adapters[-KEEP_LOADED:]
        for gone in old:  # best effort: the version is out; a server that is down fails the next load
            with contextlib.suppress(WeightPublishError):
                self.transport.run(self._everywhere("unloading the LoRA adapter of a version before",
                                                    version, lambda a, gone=gone: a.unload_adapter(gone)))

    async def _everywhere(self, what: str, version: int, step: Callable) -> None:
        """``step(admin)`` on every server at once, bounded by ``timeout_s``; one
        :class:`WeightPublishError` naming every server it failed on."""
        async def one(admin: ServerAdmin) -> str | None:
            try:
                await asyncio.wait_for(step(admin), self.timeout_s)
            except asyncio.TimeoutError:
                return f"{what} {version} on the server at {admin.url} took over {self.timeout_s:g}s."
            except EngineError as e:
                # FastAPI's own 404: the route is missing (the admin says what adds it)
                route = getattr(admin, "lora_route_hint", None)
                hint = (f" The server does not load adapters at run time: {route}."
                        if route and "HTTP 404" in str(e) and '{"detail":"Not Found"}' in str(e) else "")
                return f"{what} {version} on the server at {admin.url} failed: {e}.{hint}"
            return None

        errors = [e for e in await asyncio.gather(*(one(a) for a in self.admins)) if e]
        if errors:
            raise WeightPublishError(" ".join(errors))

    def _publish_checkpoint(self, buckets, version: int, config) -> None:
        """The sharded trainer's publication (buckets already in checkpoint names): the directory
        is written once, bucket by bucket, then put on the servers, checked (with a CPU copy of the
        policy read from that directory) and announced, as in :meth:`publish`."""
        path = write_checkpoint_dir(buckets, config, self.root / f"v{version:08d}")
        dtype = next(self.model.parameters()).dtype  # the trainer's, whatever the config says
        self._put_and_check(path, version, lambda: _read_policy(path, dtype))
        self.files.announce(version, f"{self.root.name}/{path.name}")
        self._prune()

    def _put_and_check(self, path: Path, version: int, model: Callable[[], torch.nn.Module]) -> None:
        self.transport.run(self._put_everywhere(str(path.resolve()), version))
        self._after_put(version, model)

    def _after_put(self, version: int, model: Callable[[], torch.nn.Module],
                   source: str | None = None) -> None:
        """Count the publication and, when due, check it (``source``: what the check's client is
        told the servers run, an adapter directory it then names)."""
        self.publications += 1
        if self.check is not None and self.check.due(self.publications, version):
            gaps = self.check.check(model(), [a.url for a in self.admins], version, source)
            self.gaps[version] = gaps
            for old in list(self.gaps)[:-64]:
                del self.gaps[old]
            self._unreported = {"weights/verify_max_gap": max(gaps.values()),
                                "weights/verified_version": version}

    def metrics(self) -> dict[str, float]:
        """The newest check's result since the last call (``weights/verify_max_gap``), else {}."""
        out, self._unreported = self._unreported, {}
        return out

    async def _put_everywhere(self, path: str, version: int) -> None:
        errors = [e for e in await asyncio.gather(*(self._put(a, path, version) for a in self.admins)) if e]
        if errors:
            raise WeightPublishError(" ".join(errors))

    async def _put(self, admin: ServerAdmin, path: str, version: int) -> str | None:
        """pause → load + label → resume on one server; returns the error, if any."""
        error = None
        try:
            await asyncio.wait_for(self._pause_and_load(admin, path, version), self.timeout_s)
        except asyncio.TimeoutError:
            error = (f"version {version} was not on the server at {admin.url} within {self.timeout_s:g}s "
                     "(the update hung); the server was told to resume with the weights it had.")
        except EngineError as e:
            error = f"putting version {version} on the server at {admin.url} failed: {e}."
        finally:
            try:
                await asyncio.wait_for(admin.resume(), self.timeout_s)
            except (asyncio.TimeoutError, EngineError) as e:
                error = (error or "") + f" Resuming the server at {admin.url} failed too: {e!r}."
        return error

    @staticmethod
    async def _pause_and_load(admin: ServerAdmin, path: str, version: int) -> None:
        await admin.pause()
        await admin.load(path, version)

    def _prune(self) -> None:
        for old in sorted(self.root.glob("v*"))[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        self.transport.close()


def _read_policy(path: Path, dtype: torch.dtype) -> torch.nn.Module:
    from saorl.models.loading import load_policy
    from saorl.models.serialize import quiet_progress

    with quiet_progress():
        return load_policy(str(path), dtype=dtype)


def check_sampling(sampling: SamplingParams, seed: int, tokens: int = 32) -> SamplingParams:
    """The check's request: the run's temperature and truncation (temperature 1 for a greedy run),
    ``tokens`` new tokens, a fixed seed."""
    return replace(sampling, temperature=sampling.temperature or 1.0, max_new_tokens=tokens, seed=seed,
                   stop=(), stop_token_ids=())
