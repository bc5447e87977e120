"""Prometheus metrics (prefix `lmserve:`), labels from closed sets only."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256)
STATUS_CLASSES = ("2xx", "4xx", "5xx")


class ServerMetrics:
    """All metrics of one server process, in their own registry."""

    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        self.requests = Counter("lmserve:requests", "HTTP requests by status class", ["status"], registry=r)
        self.aborts = Counter("lmserve:request_aborts", "Requests aborted, by reason", ["reason"], registry=r)
        self.rejected = Counter("lmserve:requests_rejected", "Requests refused before the engine, by reason",
                                ["reason"], registry=r)
        self.prompt_tokens = Counter("lmserve:prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("lmserve:generation_tokens", "Generated tokens", registry=r)
        self.batch_size = Histogram("lmserve:batch_size", "Requests per engine step", buckets=BATCH_BUCKETS,
                                    registry=r)
        self.max_batch_size = Gauge("lmserve:max_batch_size_seen", "Largest batch of any engine step", registry=r)
        self.step_seconds = Histogram("lmserve:engine_step_duration_seconds", "Engine step time", registry=r)
        for reason in ("client_disconnect", "shutdown"):
            self.aborts.labels(reason)
        for status in STATUS_CLASSES:
            self.requests.labels(status)
        self._engine = None
        self._max_batch = 0
        self.in_flight = Gauge("lmserve:num_requests_in_flight", "HTTP generation requests admitted and not finished",
                               registry=r)

    def bind_engine(self, engine) -> None:
        """Read live engine state at scrape time, and observe every step (on the engine thread: cheap)."""
        self._engine = engine
        self.registry.register(_EngineCollector(self))

    def on_step(self, stats, deltas) -> None:
        self.batch_size.observe(stats.batch_size)
        self.step_seconds.observe(stats.step_seconds)
        if stats.batch_size > self._max_batch:
            self._max_batch = stats.batch_size
            self.max_batch_size.set(stats.batch_size)

    def status(self, code: int) -> None:
        self.requests.labels(f"{min(code // 100, 5)}xx" if code < 600 else "5xx").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Gauges computed from the engine when scraped (ints read without locks are consistent enough)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.m = metrics

    def collect(self):
        eng = self.m._engine
        if eng is None:
            return
        labels = ["model_name"]
        values = {
            "lmserve:num_requests_running": len(eng.scheduler.running),
            "lmserve:num_requests_waiting": len(eng.scheduler.waiting),
            "lmserve:kv_cache_free_blocks": eng.kv.num_free_blocks,
            "lmserve:kv_cache_total_blocks": eng.num_blocks,
            "lmserve:kv_cache_usage_perc": eng.kv.usage,
            "lmserve:num_preemptions_total": eng.scheduler.num_preemptions,
        }
        for name, value in values.items():
            g = GaugeMetricFamily(name, name.split(":")[1].replace("_", " "), labels=labels)
            g.add_metric([self.m.model_name], float(value))
            yield g
