"""The local torch inference engine: KV cache, continuous batching, per-token logprobs.

One background thread owns the model and a running batch of at most ``max_batch_size``
sequences. Each iteration of its loop:

1. applies a pending weight update, if any (between steps, never inside one);
2. admits waiting requests into free slots: their prompts are prefilled together (left-padded,
   explicit positions), the first token is sampled from the prefill logits, and their KV rows
   are merged into the running batch cache (see :mod:`saorl.engines.kv`);
3. runs one decode step for every running sequence (one new token each, per-row sampling
   parameters, see :mod:`saorl.engines.sampling`);
4. retires finished sequences, resolving their futures, and trims all-padding cache columns.

So a finished sequence's slot is refilled on the very next iteration and a long straggler
never idles the other slots (continuous batching, as in vLLM / SGLang, without paged memory).

Prefix reuse across the turns of an episode (:mod:`saorl.engines.prefix`): a request with
``SamplingParams.session`` leaves its KV row behind, and the session's next turn extends it —
its few new tokens fed by the decode steps (``_join``), or prefilled on top of it — instead of
re-prefilling its context; ``prefix_after_update`` says whether a weight update keeps the rows.

Weight updates follow asynchronous-RL engines (AReaL, slime, PipelineRL): in-flight sequences
keep their KV cache, computed by the old weights, and continue with the new ones; each token
records the version of the weights that sampled it (``GenerationResult.versions``). The
prompt's KV is *not* recomputed — a departure from strict on-policy sampling that the DIS mask
is there to absorb.

Stop conditions, checked after each sampled token (which is always kept): a stop token id (EOS
included unless ``stop_on_eos=False``), a stop string completed by the newly decoded text of the
response, ``max_new_tokens``, or ``max_seq_len`` (prompt + response).

On a CPU, float32 linear layers compute on oneDNN-packed copies of their weights, repacked after
each update (:mod:`saorl.engines.packed`; ``pack_weights=False``: the model's own ``nn.Linear``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from transformers import DynamicCache

from saorl.config.engines import LocalEngineConfig
from saorl.engines import kv
from saorl.engines.base import EngineError, GenerationResult, SamplingParams
from saorl.engines.packed import PackedLinears, held_state, packing_available
from saorl.engines.prefix import FEED_MAX_TOKENS, Prefix, PrefixStore, new_token_inputs, prefill_groups
from saorl.engines.request import Deliver, OnToken, Request, fed_routes, finish_reason, validate_request
from saorl.engines.sampling import sample_rows, top_alternatives
from saorl.engines.updates import update_state
from saorl.models import routing
from saorl.models.adapter import AdapterMerger

_DEFAULTS = LocalEngineConfig()
"""The engine's settings where a caller gives none: the config section's defaults, declared there alone."""


class LocalEngine:
    """Continuous-batching engine over an HF causal LM (see the module docstring)."""

    @classmethod
    def from_config(cls, section: LocalEngineConfig, model, tokenizer, *, device: str | torch.device = "cpu",
                    version: int = 0, **fixed: Any) -> LocalEngine:
        """The engine a ``rollout.engine`` section of kind ``local`` describes (its slots, prefix
        settings and packing) over ``model``: the one way every site of saorl builds it (a rollout
        worker, evaluation, value pretraining, ``saorl serve``, ``saorl bench``). ``fixed`` are the
        settings a site sets for its own reason (``stop_on_eos``, ``max_seq_len``, ``record_routes``).
        The model is taken as it is: its dtype and routing (``section.dtype``, ``moe_top_k``,
        ``router_noise``) are the caller's to set up."""
        return cls(model, tokenizer, max_batch_size=section.slots, device=device, version=version,
                   prefix_cache_tokens=section.prefix_cache_tokens,
                   prefix_after_update=section.prefix_after_update, pack_weights=section.pack_weights,
                   **fixed)

    def __init__(
        self,
        model,
        tokenizer,
        *,
        max_batch_size: int = _DEFAULTS.slots,
        device: str = "cpu",
        version: int = 0,
        max_seq_len: int | None = None,
        stop_on_eos: bool = True,
        prefix_cache_tokens: int = _DEFAULTS.prefix_cache_tokens,
        prefix_after_update: str = _DEFAULTS.prefix_after_update,
        record_routes: bool = False,
        pack_weights: bool = _DEFAULTS.pack_weights,
        release_weights: bool = False,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if prefix_after_update not in ("recompute", "keep"):
            raise ValueError(f"prefix_after_update must be 'recompute' or 'keep', "
                             f"got {prefix_after_update!r}")
        self._exact_prefix = prefix_after_update == "recompute"
        self._prefixes = PrefixStore(prefix_cache_tokens)
        self.model = model.to(device).eval()
        # float32 linear layers on oneDNN-packed copies, repacked after each update (engines/packed.py)
        # (release_weights: the packed copies replace the layers' own weights: a rollout worker's engine)
        self._packed = (PackedLinears(self.model, release=release_weights)
                        if pack_weights and packing_available(self.model) else None)
        self._packing = self._packed.active if self._packed is not None else contextlib.nullcontext
        self._record = record_routes
        if record_routes and not routing.num_moe_layers(self.model):
            raise ValueError(f"record_routes needs an MoE model; {type(model).__name__} routes no tokens")
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.max_batch_size = max_batch_size
        self.max_seq_len = int(max_seq_len or model.config.max_position_embeddings)
        self.vocab_size = int(model.config.vocab_size)
        eos = tokenizer.eos_token_id
        self._eos = frozenset([eos]) if (stop_on_eos and eos is not None) else frozenset()
        self._pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or 0)
        kv.check_supported(model.config)
        self._window = kv.sliding_window(model.config)
        self._version = version
        self._adapter = AdapterMerger()
        self._cond = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._updates: deque[tuple[Mapping[str, torch.Tensor], int, threading.Event]] = deque()
        self._closed = False
        self._seed_rng = torch.Generator().manual_seed(torch.initial_seed() % (2**63))
        self._active: list[Request] = []
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None
        counts = ("decode_steps", "tokens_generated", "busy_slot_steps", "prefills", "prefill_batches",
                  "prefill_tokens", "fed_tokens", "prefix_hits", "prefix_tokens_reused", "weight_updates",
                  "requests_finished")
        # seconds spent in each phase of the loop (a profile reads these, see stats())
        seconds = ("prefill_s", "prefill_forward_s", "decode_step_s", "decode_forward_s", "sampling_s",
                   "kv_s", "fed_s")
        self._stats: dict[str, float] = {**dict.fromkeys(counts, 0), **dict.fromkeys(seconds, 0.0)}
        self._thread = threading.Thread(target=self._loop, name="saorl-local-engine", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- public API
    @property
    def version(self) -> int:
        return self._version

    @property
    def records_routes(self) -> bool:
        """Whether results carry ``routes`` (``record_routes``; what ``saorl serve
        --enable-return-routed-experts`` turns on)."""
        return self._record

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[GenerationResult]:
        """Blocking; ``params`` may also be one SamplingParams per prompt (a saorl extension).

        All prompts join the waiting queue at once, so they are admitted together.
        """
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(plist)} SamplingParams")
        for p, sp in zip(prompts, plist):
            validate_request(p, sp, self.vocab_size, self.max_seq_len)
        futures = [concurrent.futures.Future() for _ in prompts]

        def deliver(f: concurrent.futures.Future) -> Deliver:
            return lambda r: f.set_exception(r) if isinstance(r, BaseException) else f.set_result(r)

        self._submit([self._request(p, sp, deliver(f)) for p, sp, f in zip(prompts, plist, futures)])
        return [f.result() for f in futures]

    async def agenerate(self, prompt_ids: list[int], params: SamplingParams, *,
                        on_token: OnToken | None = None) -> GenerationResult:
        """One request; ``on_token`` (a saorl extension, for streaming) sees each token as it is
        sampled, from the engine thread."""
        validate_request(prompt_ids, params, self.vocab_size, self.max_seq_len)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def resolve(r: Any) -> None:
            if fut.done():
                return
            if isinstance(r, BaseException):
                fut.set_exception(r)
            else:
                fut.set_result(r)

        def deliver(r: Any) -> None:
            try:
                loop.call_soon_threadsafe(resolve, r)
            except RuntimeError:  # the caller's event loop is gone; nobody is waiting
                pass

        req = self._request(prompt_ids, params, deliver)
        req.on_token = on_token
        self._submit([req])
        try:
            return await fut
        except asyncio.CancelledError:
            req.cancelled = True
            raise

    def update_weights(self, weights: dict[str, torch.Tensor] | str, version: int) -> None:
        """Load weights between decode steps; blocks until applied. ``weights``: a state dict, a file,
        a Hugging Face or a LoRA adapter directory (:func:`saorl.engines.updates.update_state`)."""
        weights = update_state(self.model, weights, self._adapter, base=held_state(self.model, self._packed))
        done = threading.Event()
        with self._cond:
            if self._closed:
                raise EngineError("engine is closed")
            self._updates.append((weights, int(version), done))
            self._cond.notify()
        done.wait()

    def end_session(self, session: str) -> None:
        """``session``'s episode is over: drop the KV row its last request left behind (a saorl
        extension, :func:`saorl.engines.prefix.end_session`; a later request of the session is
        prefilled in full)."""
        self._prefixes.drop(session)

    def abort_all(self) -> int:
        """Finish every waiting and running request with ``finish_reason="abort"`` after its next
        token, delivering what it has sampled (SGLang's abort semantics); returns how many."""
        with self._cond:
            reqs = [*self._waiting, *self._active]
            for r in reqs:
                r.cancelled = True
            self._cond.notify()
        return len(reqs)

    def stats(self) -> dict[str, float]:
        """Counters since construction; ``utilisation`` = busy slot-steps / (decode steps × slots).

        ``*_s`` are seconds spent in each phase of the engine loop: ``prefill_s`` (admitting
        requests; of which ``prefill_forward_s`` the model), ``decode_step_s`` (decode steps; of
        which ``decode_forward_s`` the model), ``sampling_s`` (both) and ``kv_s`` (cache
        bookkeeping: merge, row selection, trimming, zeroing padding, prefix copies).
        ``prefill_tokens`` counts the prompt tokens run through the model (in prefill forwards,
        or ``fed_tokens`` of them fed by decode steps, whose share of the decode forwards is
        ``fed_s``, part of ``decode_forward_s``), ``prefix_hits`` the requests that extended a
        stored session prefix, ``prefix_tokens_reused`` the prompt tokens those did not recompute;
        ``prefix_sessions_held`` and ``prefix_tokens_held`` are the store's size now."""
        s: dict[str, float] = dict(self._stats)
        total = s["decode_steps"] * self.max_batch_size
        s["utilisation"] = s["busy_slot_steps"] / total if total else 0.0
        s["version"] = self._version
        s["prefix_sessions_held"], s["prefix_tokens_held"] = len(self._prefixes), self._prefixes.held
        return s

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=30)
        if self._packed is not None:  # the model's own layers back (it may be a trainer's policy)
            self._packed.remove()

    def __enter__(self) -> LocalEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- submission
    def _request(self, prompt: list[int], params: SamplingParams, deliver: Deliver) -> Request:
        gen = None
        if params.temperature > 0:
            with self._cond:
                seed = params.seed
                if seed is None:
                    seed = int(torch.randint(0, 2**62, (), generator=self._seed_rng))
            gen = torch.Generator().manual_seed(seed)
        return Request(list(prompt), params, deliver, frozenset(params.stop_token_ids) | self._eos, gen)

    def _submit(self, reqs: list[Request]) -> None:
        with self._cond:
            if self._closed:
                raise EngineError("engine is closed")
            self._waiting.extend(reqs)
            self._cond.notify()

    # ----------------------------------------------------------------- the loop
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._closed or self._updates or self._waiting or self._active):
                    self._cond.wait()
                if self._closed:
                    break
                updates = list(self._updates)
                self._updates.clear()
                free = self.max_batch_size - len(self._active)
                admitted = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
            for weights, version, done in updates:
                self._apply_update(weights, version)
                done.set()
            try:
                with torch.inference_mode(), self._packing():
                    if admitted:
                        with self._timed("prefill_s"):
                            self._admit(admitted)
                    if self._active:
                        with self._timed("decode_step_s"):
                            self._decode_step()
            except Exception as e:  # a failed step fails its requests, not the engine
                self._fail_all(admitted, EngineError(f"local engine step failed: {e!r}"))
        with self._cond:
            pending = list(self._waiting) + self._active
            self._waiting.clear()
            updates = list(self._updates)
        self._fail_all(pending, EngineError("engine closed before the request finished"))
        for *_, done in updates:
            done.set()

    def _apply_update(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        own = self.model.state_dict()
        released = self._packed.released if self._packed is not None else {}
        with torch.no_grad():
            for name, t in weights.items():
                if name in released:
                    self._packed.set_weight(name, t)
                else:
                    own[name].copy_(t.to(own[name].device, own[name].dtype))
        if self._packed is not None:
            self._packed.repack()
        self._version = version
        self._stats["weight_updates"] += 1
        if self._exact_prefix:
            self._prefixes.clear()  # computed by the old weights: the next turns re-prefill

    def _keep_prefix(self, r: Request, cache: DynamicCache, mask: torch.Tensor, row: int) -> None:
        """Store finished ``r``'s KV row (right-aligned in ``cache``) for its session's next turn."""
        tokens = r.prompt + r.tokens[:-1]  # the last sampled token was never fed to the model
        if (not self._prefixes.wants(r.params.session, len(tokens)) or r.finish[0] == "abort"
                or (self._exact_prefix and r.kv_version != self._version)
                or int(mask[row].sum()) != len(tokens)):
            return
        with self._timed("kv_s"):
            self._prefixes.keep(r.params.session, Prefix(tokens, kv.row_kv(cache, row, len(tokens)),
                                                         self._version, fed_routes(r)))

    @contextlib.contextmanager
    def _routes_of(self, shape: tuple[int, int]) -> Iterator[list[torch.Tensor]]:
        """Around one forward on ``shape`` = ``[B, L]`` tokens: yields a list that holds, after the
        block, the ``[B, L, layers, k]`` routes of that forward (nothing without ``record_routes``)."""
        out: list[torch.Tensor] = []
        if not self._record:
            yield out
            return
        with routing.record_routes(self.model) as rec:
            yield out
        out.append(torch.stack([layer[-1] for layer in rec], dim=1).reshape(*shape, len(rec), -1).cpu())

    @contextlib.contextmanager
    def _timed(self, key: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._stats[key] += time.perf_counter() - t0

    def _fail_all(self, extra: list[Request], err: EngineError) -> None:
        for r in {id(r): r for r in [*self._active, *extra]}.values():
            if r.finish is None:
                r.finish = ("abort", None)
                r.deliver(err)
        self._active, self._cache, self._mask = [], None, None

    def _admit(self, reqs: list[Request]) -> None:
        """Admit requests: join session requests with at most ``FEED_MAX_TOKENS`` new tokens (beyond
        a stored prefix, or a whole short first prompt while a batch runs) to the running batch,
        whose decode steps feed them; prefill the others in one forward (only what extends a
        stored prefix, or whole prompts)."""
        version = self._version if self._exact_prefix else None
        pairs = [(r, self._prefixes.take(r.params.session, r.prompt, version)) for r in reqs]
        join = [(r, e) for r, e in pairs if r.params.session is not None
                and (e is not None or self._cache is not None)
                and len(r.prompt) - (len(e.tokens) if e else 0) <= FEED_MAX_TOKENS]
        rest = [(r, e) for r, e in pairs if not any(r is j for j, _ in join)]
        if join:
            self._join(join)
        for group in prefill_groups(rest, self._window):
            self._prefill(group)

    def _join(self, pairs: list[tuple[Request, Prefix | None]]) -> None:
        """Merge the sessions' stored rows (or empty rows) into the running batch; the decode steps
        feed the new tokens, one per step, and the request samples after the last."""
        like = self._cache.layers if self._cache is not None else None
        with self._timed("kv_s"):
            empty = None if like is None else [(x.keys.new_zeros(x.keys.shape[1], 0, x.keys.shape[-1]),) * 2
                                               for x in like]
            cache, mask = kv.from_rows(self.model.config, [e.kv if e else empty for _, e in pairs])
            if self._cache is None:
                self._cache, self._mask = cache, mask
            else:
                self._cache, self._mask = kv.merge(self._cache, self._mask, cache, mask)
        for r, e in pairs:
            r.feed, r.kv_version = r.prompt[len(e.tokens) if e else 0:], self._version
            r.routes = [e.routes] if e is not None and e.routes is not None else []
        self._stats["prefills"] += len(pairs)
        self._stats["prefix_hits"] += sum(e is not None for _, e in pairs)
        self._stats["prefix_tokens_reused"] += sum(len(e.tokens) for _, e in pairs if e)
        self._stats["prefill_tokens"] += sum(len(r.feed) for r, _ in pairs)
        self._active.extend(r for r, _ in pairs)

    def _prefill(self, pairs: list[tuple[Request, Prefix | None]]) -> None:
        """Prefill, in one forward, each request's tokens beyond its session's stored row (a
        request without one: its whole prompt) on top of those rows."""
        done = [len(e.tokens) if e else 0 for _, e in pairs]
        ids, new_mask, pos = new_token_inputs([r.prompt for r, _ in pairs], done, self._pad)
        if any(done):
            with self._timed("kv_s"):
                cache, past = kv.from_rows(self.model.config, [e and e.kv for _, e in pairs])
            mask = torch.cat([past, new_mask.to(self.device)], dim=1)
        else:
            cache, mask = kv.new_cache(self.model.config), new_mask.to(self.device)
        self._stats["prefix_hits"] += sum(n > 0 for n in done)
        self._stats["prefix_tokens_reused"] += sum(done)
        for r, e in pairs:
            r.routes = [e.routes] if e is not None and e.routes is not None else []
        self._start([r for r, _ in pairs], cache, ids.to(self.device), mask, pos.to(self.device),
                    int(new_mask.sum()))

    def _start(self, reqs: list[Request], cache: DynamicCache, ids: torch.Tensor, mask: torch.Tensor,
               pos: torch.Tensor, new_tokens: int) -> None:
        """Run the prompts' (new) tokens through the model on top of ``cache``, sample each
        request's first token and merge the survivors into the running batch."""
        with self._timed("prefill_forward_s"), self._routes_of(tuple(ids.shape)) as routes:
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache,
                             use_cache=True, logits_to_keep=1)
        if routes:  # each row's new tokens are its last ones (left padding)
            fresh = mask[:, -ids.shape[1]:].sum(dim=1).tolist()
            for i, r in enumerate(reqs):
                r.routes.append(routes[0][i, ids.shape[1] - int(fresh[i]):])
        with self._timed("kv_s"):
            kv.zero_padding(cache, mask)
            mask = kv.compact(cache, mask)
        version = self._version
        for r in reqs:
            r.kv_version = version
        self._stats["prefills"] += len(reqs)
        self._stats["prefill_batches"] += 1
        self._stats["prefill_tokens"] += new_tokens
        keep = self._sample_and_retire(reqs, out.logits[:, -1], cache, mask)
        if not keep:
            return
        rows = torch.tensor(keep, device=self.device)
        with self._timed("kv_s"):
            mask = kv.select_rows(cache, mask, rows)
            mask = kv.trim(cache, mask)
            if self._cache is None:
                self._cache, self._mask = cache, mask
            else:
                self._cache, self._mask = kv.merge(self._cache, self._mask, cache, mask)
        self._active.extend(reqs[i] for i in keep)

    def _decode_step(self) -> None:
        reqs = self._active
        ids = torch.tensor([[r.feed[0] if r.feed else r.tokens[-1]] for r in reqs], device=self.device)
        pos = self._mask.sum(dim=1, keepdim=True)
        self._mask = torch.cat([self._mask, torch.ones_like(self._mask[:, :1])], dim=1)
        forward_before = self._stats["decode_forward_s"]
        with self._timed("decode_forward_s"), self._routes_of(tuple(ids.shape)) as routes:
            out = self.model(
                input_ids=ids,
                attention_mask=self._mask,
                position_ids=pos,
                cache=self._cache,
                use_cache=True,
                logits_to_keep=1,
            )
        for i, r in enumerate(reqs if routes else ()):
            r.routes.append(routes[0][i])
        self._stats["decode_steps"] += 1
        self._stats["busy_slot_steps"] += len(reqs)
        fed = [r for r in reqs if r.feed]
        for r in fed:
            r.feed.pop(0)
        # the rows' share of the forward that went to feeding prompt tokens: prefill work
        self._stats["fed_tokens"] += len(fed)
        self._stats["fed_s"] += (self._stats["decode_forward_s"] - forward_before) * len(fed) / len(reqs)
        ready = [i for i, r in enumerate(reqs) if not r.feed]  # a row still being fed samples nothing
        logits = out.logits[:, -1]
        kept = self._sample_and_retire([reqs[i] for i in ready], logits[ready] if len(ready) < len(reqs)
                                       else logits, self._cache, self._mask, rows=ready)
        keep = sorted({i for i, r in enumerate(reqs) if r.feed} | {ready[j] for j in kept})
        if len(keep) == len(reqs):
            return
        if not keep:
            self._active, self._cache, self._mask = [], None, None
            return
        rows = torch.tensor(keep, device=self.device)
        with self._timed("kv_s"):
            self._mask = kv.select_rows(self._cache, self._mask, rows)
            self._mask = kv.trim(self._cache, self._mask)
        self._active = [reqs[i] for i in keep]

    def _sample_and_retire(self, reqs: list[Request], logits: torch.Tensor, cache: DynamicCache,
                           mask: torch.Tensor, rows: list[int] | None = None) -> list[int]:
        """Sample one token per request, record it, deliver finished ones (keeping their KV rows
        of ``cache``, ``rows[i]`` for ``reqs[i]``, for their sessions); returns kept indices."""
        if not reqs:
            return []
        dev = logits.device
        temp = torch.tensor([r.params.temperature for r in reqs], device=dev)
        top_k = torch.tensor([r.params.top_k for r in reqs], device=dev)
        top_p = torch.tensor([r.params.top_p for r in reqs], device=dev)
        with self._timed("sampling_s"):
            tokens, logprobs = sample_rows(logits, temp, top_k, top_p, [r.generator for r in reqs])
            want = max(r.params.top_logprobs for r in reqs)
            if want:
                alt_ids, alt_lps = (x.tolist() for x in top_alternatives(logits, temp, top_k, top_p, want))
        version = self._version
        keep = []
        for i, (r, t, lp) in enumerate(zip(reqs, tokens.tolist(), logprobs.tolist())):
            r.tokens.append(t)
            r.logprobs.append(lp)
            r.versions.append(version)
            if r.params.top_logprobs:
                k = r.params.top_logprobs
                r.top.append(list(zip(alt_ids[i][:k], alt_lps[i][:k])))
            if r.on_token is not None:
                r.on_token(t, lp, version, r.top[-1] if r.params.top_logprobs else None)
            self._stats["tokens_generated"] += 1
            r.finish = finish_reason(r, self.tokenizer, self.max_seq_len, t)
            if r.finish is None:
                keep.append(i)
            else:
                self._keep_prefix(r, cache, mask, i if rows is None else rows[i])
                self._deliver(r)
        return keep

    def _deliver(self, r: Request) -> None:
        self._stats["requests_finished"] += 1
        r.deliver(r.result())
