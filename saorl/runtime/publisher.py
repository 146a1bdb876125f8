"""Publishing each policy version to vLLM / SGLang servers without restarting them.

:class:`ServerWeightSync` is the run's :class:`~saorl.runtime.weights.WeightSync` when
``rollout.engine`` is ``vllm`` or ``sglang``. ``publish(state_dict, version)``, under one lock (so
two publications never interleave), does:

1. write the weights as a Hugging Face model directory ``RUN/weights/hf/v<version>`` (config.json
   + safetensors under the on-disk names), atomically: built in a temporary sibling, renamed into
   place, so a server never reads a half-written directory;
2. on every server at once: pause → load the directory and label the weights ``version`` →
   resume (:class:`~saorl.engines.remote.ServerAdmin`; the routes are each server's own). Resume
   always runs, also when the pause or the load failed. A watchdog bounds pause + load by
   ``timeout_s``: a hung update becomes a :class:`WeightPublishError` naming the server, never a
   silent stall;
3. announce the version to the rollout workers through the file pointer
   (:class:`~saorl.runtime.weights.FileWeightSync`), only now that the servers run it, so a
   worker's belief (its fallback version tag) is never ahead of the servers;
4. keep the newest ``keep`` directories and delete older ones.

``publish_checkpoint(buckets, version, config)`` — the sharded trainer's publication, buckets of
full tensors already in checkpoint names — does the same with the directory written bucket by
bucket (never the whole model in memory), without the log-prob probe (which needs the whole
policy in this process).

After the first publication (the run's starting weights) a :class:`LogprobProbe` sends one request
to each server with the run's sampling settings and compares the log-probs it returns with the
trainer's own (:func:`saorl.models.logprobs.token_logprobs` under the same temperature and
truncation). DIS divides by the engine's log-probs, so they must be those of the distribution the
token was sampled from; vLLM returns them only with ``--logprobs-mode processed_logprobs``. A
mismatch stops the run before any training, with what to change.
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from saorl.engines.base import EngineError, InferenceEngine, SamplingParams
from saorl.engines.remote import ServerAdmin
from saorl.engines.transport import HttpTransport
from saorl.models.serialize import save_hf_weights
from saorl.runtime.weights import FileWeightSync, write_checkpoint_dir


class WeightPublishError(RuntimeError):
    """A version could not be put on an inference server; the message says which and why."""


@dataclass
class LogprobProbe:
    """One request per server, its log-probs compared with the trainer's (see the module docstring)."""

    make_engine: Callable[[str], InferenceEngine]
    prompt: list[int]
    sampling: SamplingParams
    tolerance: float
    server_name: str

    def check(self, model: torch.nn.Module, urls: Sequence[str]) -> dict[str, float]:
        """Mean |server − trainer| log-prob per server; raises WeightPublishError past ``tolerance``."""
        from saorl.models.logprobs import token_logprobs

        gaps = {}
        for url in urls:
            engine = self.make_engine(url)
            try:
                res = engine.generate([self.prompt], self.sampling)[0]
            finally:
                engine.close()
            if not res.token_ids:
                continue
            ids = torch.tensor([self.prompt + res.token_ids])
            device = next(model.parameters()).device
            with torch.no_grad():
                mine = token_logprobs(model, ids.to(device), torch.ones_like(ids).to(device),
                                      temperature=self.sampling.temperature, top_k=self.sampling.top_k,
                                      top_p=self.sampling.top_p)[0, len(self.prompt):].tolist()
            gaps[url] = statistics.fmean(abs(a - b) for a, b in zip(res.logprobs, mine))
            if gaps[url] > self.tolerance:
                s = self.sampling
                raise WeightPublishError(
                    f"the log-probs {self.server_name} at {url} returns differ from the trainer's by "
                    f"{gaps[url]:.3f} nats per token on average (tolerance {self.tolerance}; "
                    f"temperature={s.temperature}, top_k={s.top_k}, top_p={s.top_p}): DIS needs the "
                    "log-prob of each token under the distribution it was sampled from. Start vLLM "
                    "with --logprobs-mode processed_logprobs, check that the server runs the same "
                    "model and dtype as the trainer, or raise rollout.logprob_probe_tol.")
        return gaps


class ServerWeightSync:
    """A :class:`WeightSync` that puts each version on inference servers (module docstring)."""

    def __init__(self, files: FileWeightSync, admins: Sequence[ServerAdmin], transport: HttpTransport,
                 model: torch.nn.Module, *, timeout_s: float = 600.0, keep: int = 2,
                 probe: LogprobProbe | None = None) -> None:
        if timeout_s <= 0 or keep < 1 or not admins:
            raise ValueError(f"need servers, timeout_s > 0 and keep >= 1, got {len(admins)} servers, "
                             f"{timeout_s}, {keep}")
        self.files, self.admins, self.transport, self.model = files, list(admins), transport, model
        self.timeout_s, self.keep, self.probe = timeout_s, keep, probe
        self.root = files.dir / "hf"
        self._lock = threading.Lock()
        self.probe_gaps: dict[str, float] | None = None

    def publish(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        with self._lock:
            path = save_hf_weights(self.model, state_dict, self.root / f"v{version:08d}")
            self.transport.run(self._put_everywhere(str(path.resolve()), version))
            self.files.publish(state_dict, version)
            self._prune()
            if self.probe is not None and self.probe_gaps is None:
                self.probe_gaps = self.probe.check(self.model, [a.url for a in self.admins])

    def publish_checkpoint(self, buckets, version: int, config) -> None:
        """The sharded trainer's publication (buckets already in checkpoint names): the directory
        is written once, bucket by bucket, then put on the servers and announced, as in
        :meth:`publish`. The log-prob probe needs the whole policy in this process, so a sharded
        run does without it."""
        with self._lock:
            path = write_checkpoint_dir(buckets, config, self.root / f"v{version:08d}")
            self.transport.run(self._put_everywhere(str(path.resolve()), version))
            self.files.announce(version, f"{self.root.name}/{path.name}")
            self._prune()

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

    def latest(self) -> tuple[int, str] | None:
        return self.files.latest()

    def load(self, version: int | None = None) -> tuple[int, dict[str, torch.Tensor]] | None:
        return self.files.load(version)

    def close(self) -> None:
        self.transport.close()
