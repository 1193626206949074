"""Prometheus metrics for `/metrics`, named after vLLM's with an `llmjax:` prefix.

Gauges and counters are read at scrape time from the engine loop's `EngineStats` snapshot;
time to first token is observed when a request samples its first token (`observe_first_token`,
as vLLM's); the other per-request histograms and `request_success_total{finished_reason}` when it
finishes (`observe_finished`; inter-token latencies then too, where vLLM observes them every step:
a steady step's host work stays free of them). Both are called on the engine loop thread
(prometheus-client is thread-safe). Each `ServerMetrics` has its own registry, so several apps (tests, replicas) can
live in one process. Every sample carries `model_name`, except `cache_config_info` (value 1),
which carries the KV cache's configuration in its labels, as vLLM's does.

Prefix-cache queries and hits count tokens, as vLLM's do: queried prompt tokens and the tokens
found cached (`experiments/routing.py` and `load.py` read them from each replica with `parse_metrics`).

A request with n > 1 samples: the histograms and `prompt_tokens` count it once (its prompt once,
its generation tokens summed over the samples, the first sample's first token, the steps that
sampled any of them), while `request_success` and the prefix-cache counters count each sample
(each is admitted and looks up its prompt; one collecting prompt logprobs computes the whole prompt
and looks up nothing). vLLM makes each sample a request of its own and counts
samples throughout; with n = 1 the two agree.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from llmjax.engine import RequestOutput
from llmjax.outputs import RequestMetrics
from llmjax.request import RequestStatus
from llmjax.serve.async_engine import EngineStats

PREFIX = "llmjax:"
FINISH_REASONS = ("stop", "length", "abort", "error")
# vLLM's buckets: TTFT from 1 ms, inter-token latency from 10 ms, a request's phases and whole life up to
# ~2 hours
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector:
    """Gauges and counters from the latest `EngineStats` snapshot."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str):
        self.stats = stats
        self.model_name = model_name

    def collect(self):
        s = self.stats()
        for name, doc, value in [
            ("num_requests_running", "Requests in the running batch.", s.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
            ("kv_cache_usage_perc", "Fraction of KV blocks held by requests (1 = full).", s.kv_usage),
        ]:
            gauge = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            gauge.add_metric([self.model_name], value)
            yield gauge
        for name, doc, value in [
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache (by each sample).",
             s.prefix_queried_tokens),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_hit_tokens),
            ("num_preemptions", "Requests preempted (recomputed later).", s.num_preemptions),
            ("prompt_tokens", "Prompt tokens of requests that got a first token (an n > 1 request's once).",
             s.prompt_tokens),
            ("generation_tokens", "Generated tokens.", s.generation_tokens),
            ("engine_errors", "Requests the engine failed (an exception admitting or stepping them), a dead loop.",
             s.num_engine_errors),
            ("step_compilations", "Step functions compiled outside warm-up; the engine waited for each.",
             s.num_serving_compiles),
            ("step_compile_seconds", "Time of the steps that compiled a step function outside warm-up.",
             s.serving_compile_seconds),
        ]:
            counter = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            counter.add_metric([self.model_name], value)
            yield counter


def token_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `max_model_len` (vLLM's 1-2-5 buckets for token counts)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class ServerMetrics:
    """`cache_config`: label -> value of `cache_config_info` (block_size, num_gpu_blocks, ...)."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str, max_model_len: int,
                 cache_config: dict[str, str]):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats, model_name))

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            h = Histogram(PREFIX + name, doc, ["model_name"], registry=self.registry, buckets=buckets)
            return h.labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first generated token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive generated tokens.",
                             ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish, for requests not aborted.",
                             REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Queued in the engine (after tokenizing) to first scheduled.", REQUEST_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "First scheduled to first generated token.",
                                      REQUEST_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds",
                                     "First generated token to finish, for requests not aborted.", REQUEST_BUCKETS)
        tokens = token_buckets(max_model_len)
        self.prompt_tokens = histogram("request_prompt_tokens", "Prompt length of finished requests.", tokens)
        self.generation_tokens = histogram("request_generation_tokens", "Tokens generated per finished request.",
                                           tokens)
        success = Counter(PREFIX + "request_success", "Finished samples by finish reason (n per request).",
                          ["model_name", "finished_reason"], registry=self.registry)
        self.success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        info = Gauge(PREFIX + "cache_config_info", "The KV cache's configuration (in the labels).",
                     sorted(cache_config), registry=self.registry)
        info.labels(**cache_config).set(1)

    def observe_first_token(self, m: RequestMetrics) -> None:
        """Record a request's time to first token, when it sampled it (`LLMEngine.on_first_token`)."""
        self.ttft.observe(m.first_token_time - m.arrival_time)

    def observe_finished(self, output: RequestOutput) -> None:
        """Record a finished request (from the engine's monotonic timestamps): its histograms once,
        and each sample's finish reason (a request with n samples counts n, as in vLLM, whose
        samples are requests of their own). A request aborted has no e2e or decode time."""
        m = output.metrics
        if m.first_scheduled_time is not None:
            self.queue_time.observe(m.first_scheduled_time - m.queued_time)  # the engine's queue alone, as vLLM's
            if m.first_token_time is not None:
                self.prefill_time.observe(m.first_token_time - m.first_scheduled_time)
        for before, after in zip(m.token_times, m.token_times[1:]):
            self.itl.observe(after - before)
        for reason in m.finish_reasons:
            if reason in self.success:
                self.success[reason].inc()
        self.prompt_tokens.observe(len(output.prompt_token_ids))
        self.generation_tokens.observe(m.num_generation_tokens)
        if RequestStatus.FINISHED_ABORTED.value not in m.finish_reasons and m.finish_time is not None:
            self.e2e.observe(m.finish_time - m.arrival_time)
            if m.first_token_time is not None:
                self.decode_time.observe(m.finish_time - m.first_token_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def parse_metrics(text: str) -> dict[str, float]:
    """Sample name -> value summed over label sets (e.g. `llmjax:num_requests_running`,
    `llmjax:prompt_tokens_total`, `llmjax:time_to_first_token_seconds_count`)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values
