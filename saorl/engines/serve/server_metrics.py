"""``GET /metrics`` of ``saorl serve``: Prometheus text, under the names vLLM 0.32 gives the same
quantities, so a dashboard or autoscaler written for vLLM reads saorl serve too.

- ``vllm:num_requests_running`` (gauge): generations the engine is working on (each choice counts);
- ``vllm:num_requests_waiting`` (gauge): generations admitted but waiting (a paused emulated server);
- ``vllm:prompt_tokens_total`` (counter): prompt tokens of finished requests, each prompt once (as
  usage counts them);
- ``vllm:generation_tokens_total`` (counter): tokens sampled;
- ``vllm:request_success_total{finished_reason}`` (counter): finished choices by ``stop`` /
  ``length`` / ``abort`` (aborted by a pause, or cancelled because their client left, streamed or
  not: :meth:`ServerMetrics.abandoned`);
- ``vllm:e2e_request_latency_seconds`` (histogram, vLLM's buckets): seconds from a request's arrival
  to its last token, per choice;
- ``saorl:weight_version`` (gauge): the version of the weights the engine samples with;
- ``saorl:refused_busy_total`` (counter): requests answered 503 (``--max-pending``).

Each sample carries ``model_name`` (the first served name) and ``engine="0"``, as vLLM's do.
"""

from __future__ import annotations

import bisect
from collections import Counter

from saorl.engines.base import GenerationResult

BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
           480.0, 960.0, 1920.0, 7680.0)
REASONS = ("stop", "length", "abort")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class ServerMetrics:
    """The counters behind ``/metrics``; updated by the routes as requests finish (one event loop,
    so no lock)."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: Counter[str] = Counter()
        self.buckets = [0] * len(BUCKETS)
        self.latency_sum = 0.0
        self.latency_count = 0
        self.refused_busy = 0
        self.cancelled = 0
        """Requests whose client left before the response (their generations were cancelled)."""

    def abandoned(self, choices: int) -> None:
        """A request whose client left: its ``choices`` generations were cancelled, each counted
        as finished by ``abort`` (as vLLM counts a request aborted on disconnect)."""
        self.cancelled += 1
        self.finished["abort"] += choices

    def record(self, prompt_tokens: int, results: list[GenerationResult], seconds: float) -> None:
        self.prompt_tokens += prompt_tokens
        for r in results:
            self.generation_tokens += len(r.token_ids)
            self.finished[r.finish_reason] += 1
            self.latency_sum += seconds
            self.latency_count += 1
            at = bisect.bisect_left(BUCKETS, seconds)
            for i in range(at, len(BUCKETS)):
                self.buckets[i] += 1

    def render(self, model_name: str, running: int, waiting: int, version: int) -> str:
        base = f'engine="0",model_name="{_label(model_name)}"'
        lines: list[str] = []

        def metric(name: str, kind: str, helptext: str, samples: list[tuple[str, str, float]]) -> None:
            lines.extend([f"# HELP {name} {helptext}", f"# TYPE {name} {kind}"])
            lines.extend(f"{name}{sfx}{{{base}{labels}}} {float(value)!r}" for sfx, labels, value in samples)

        metric("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
               [("", "", running)])
        metric("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
               [("", "", waiting)])
        metric("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
               [("", "", self.prompt_tokens)])
        metric("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
               [("", "", self.generation_tokens)])
        metric("vllm:request_success_total", "counter", "Count of successfully processed requests.",
               [("", f',finished_reason="{r}"', self.finished[r]) for r in REASONS])
        hist = [("_bucket", f',le="{b}"', n) for b, n in zip(BUCKETS, self.buckets)]
        hist += [("_bucket", ',le="+Inf"', self.latency_count), ("_count", "", self.latency_count),
                 ("_sum", "", self.latency_sum)]
        metric("vllm:e2e_request_latency_seconds", "histogram",
               "Histogram of e2e request latency in seconds.", hist)
        metric("saorl:weight_version", "gauge", "Version of the weights the engine samples with.",
               [("", "", version)])
        metric("saorl:refused_busy_total", "counter", "Requests refused with 503 (--max-pending).",
               [("", "", self.refused_busy)])
        return "\n".join(lines) + "\n"
