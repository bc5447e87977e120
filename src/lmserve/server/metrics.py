"""Prometheus metrics (prefix `lmserve:`), labels from closed sets only."""

from __future__ import annotations

import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

from lmserve.sampling_params import STRUCTURED_KINDS

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256)
FIRST_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
TOKEN_GAP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
COMPILE_BUCKETS = (0.0001, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
MASK_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
LOAD_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
LORA_LOAD_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
FINISH_REASONS = ("stop", "length", "abort")
# "not_ready": a 503 answered while the model loads or the server drains (/health's included). Every start
# gives a few; counted as 5xx they would look like server errors to an error-rate alert.
STATUS_CLASSES = ("2xx", "4xx", "5xx", "not_ready")
ABORT_REASONS = ("client_disconnect", "shutdown", "error")
REJECT_REASONS = ("queue_full", "not_ready", "unauthorized", "invalid_request", "context_length", "validation_rule",
                  "rate_limited", "read_timeout", "model_loading")
TOKEN_KINDS = ("prompt", "completion")


class ServerMetrics:
    """All metrics of one server process, in their own registry."""

    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        self.requests = Counter("lmserve:requests", "HTTP requests by status class (2xx, 4xx, 5xx); "
                                "a 503 while the model loads or the server drains is not_ready, not 5xx",
                                ["status"], registry=r)
        self.aborts = Counter("lmserve:request_aborts", "Requests aborted, by reason", ["reason"], registry=r)
        self.rejected = Counter("lmserve:requests_rejected", "Requests refused before the engine, by reason",
                                ["reason"], registry=r)
        self.prompt_tokens = Counter("lmserve:prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("lmserve:generation_tokens", "Generated tokens", registry=r)
        self.batch_size = Histogram("lmserve:batch_size", "Requests per engine step", buckets=BATCH_BUCKETS,
                                    registry=r)
        self.max_batch_size = Gauge("lmserve:max_batch_size_seen", "Largest batch of any engine step", registry=r)
        self.step_seconds = Histogram("lmserve:engine_step_duration_seconds", "Engine step time", registry=r)
        for reason in ABORT_REASONS:
            self.aborts.labels(reason)
        for reason in REJECT_REASONS:
            self.rejected.labels(reason)
        for status in STATUS_CLASSES:
            self.requests.labels(status)
        self._engines: dict = {}  # served name -> the EngineFront of each loaded model
        self._max_batch = 0
        h = lambda name, doc, buckets: Histogram(name, doc, buckets=buckets, registry=r)  # noqa: E731
        self.ttft = h("lmserve:time_to_first_token_seconds", "Time to first token", FIRST_TOKEN_BUCKETS)
        self.itl = h("lmserve:inter_token_latency_seconds", "Gap between streamed tokens", TOKEN_GAP_BUCKETS)
        self.tpot = h("lmserve:time_per_output_token_seconds", "Per request: decode time / (tokens - 1)",
                      TOKEN_GAP_BUCKETS)
        self.e2e = h("lmserve:e2e_request_latency_seconds", "End-to-end request latency", REQUEST_BUCKETS)
        self.queue = h("lmserve:request_queue_time_seconds", "Waiting before first scheduled", REQUEST_BUCKETS)
        self.prefill = h("lmserve:request_prefill_time_seconds", "First scheduled to first token", REQUEST_BUCKETS)
        self.decode = h("lmserve:request_decode_time_seconds", "First token to finish", REQUEST_BUCKETS)
        self.req_prompt = h("lmserve:request_prompt_tokens", "Prompt tokens per request", COUNT_BUCKETS)
        self.req_generation = h("lmserve:request_generation_tokens", "Generated tokens per completion", COUNT_BUCKETS)
        self.finished = Counter("lmserve:request_success", "Finished completions by finish reason",
                                ["finish_reason"], registry=r)
        for reason in FINISH_REASONS:
            self.finished.labels(reason)
        # quantization: the file's own type (MOSTLY_Q4_1); weight_format: how it is served (--quantization resolved)
        self.model_info = Gauge("lmserve:model_info", "The served model", ["model_name", "model_version", "dtype",
                                                                         "quantization", "weight_format"], registry=r)
        self.load_seconds = Gauge("lmserve:model_load_seconds", "Weight load time", registry=r)
        self.warmup_seconds = Gauge("lmserve:model_warmup_seconds", "Warm-up time before serving", registry=r)
        self.structured_requests = Counter("lmserve:structured_output_requests",
                                           "Requests with structured outputs, by kind", ["kind"], registry=r)
        for kind in STRUCTURED_KINDS:
            self.structured_requests.labels(kind)
        self.grammar_compile = Histogram("lmserve:grammar_compile_seconds", "Grammar compile time (cache hit or miss)",
                                         ["cache"], buckets=COMPILE_BUCKETS, registry=r)
        self.grammar_mask = h("lmserve:grammar_bitmask_seconds", "Per step with constrained rows: filling their "
                              "token bitmask", MASK_BUCKETS)
        self.step_failures = Counter("lmserve:engine_step_failures", "Engine steps that raised (their requests "
                                     "failed with 500)", registry=r)
        self.engine_dead = Gauge("lmserve:engine_dead", "1 once the engine has failed for good (the process exits)",
                                 registry=r)
        self.in_flight = Gauge("lmserve:num_requests_in_flight", "HTTP generation requests admitted and not finished",
                               registry=r)
        self._bind_model_metrics()
        r.register(_EngineCollector(self))

    def _bind_model_metrics(self) -> None:
        """Per served model (its name from --model, a closed set): requests by the model that actually answered
        (a --route's split shows here), loads, unloads and load time."""
        r, labels = self.registry, ["model_name"]
        self.model_requests = Counter("lmserve:model_requests", "Generation requests admitted, by the model serving "
                                      "them", labels, registry=r)
        self.model_generation_tokens = Counter("lmserve:model_generation_tokens", "Generated tokens, by model",
                                               labels, registry=r)
        self.model_loads = Counter("lmserve:model_loads", "Times a model was loaded", labels, registry=r)
        self.model_unloads = Counter("lmserve:model_unloads", "Times a model was unloaded (least recently used "
                                     "beyond --max-loaded-models, or idle past its keep-alive)", labels, registry=r)
        self.model_loaded = Gauge("lmserve:model_loaded", "1 while the model is loaded", labels, registry=r)
        self.model_load_time = Histogram("lmserve:model_load_duration_seconds", "Weight load plus warm-up time of "
                                         "each load, by model", labels, buckets=LOAD_BUCKETS, registry=r)

    def bind_models(self, names: list[str]) -> None:
        """Create every model's series at zero, so a dashboard sees a model before its first request."""
        for name in names:
            for metric in (self.model_requests, self.model_generation_tokens, self.model_loads, self.model_unloads,
                           self.model_loaded):
                metric.labels(name)

    def bind_keys(self, labels: dict[str, str], reasons: tuple[str, ...], in_flight: Callable[[str], int]) -> None:
        """Per-key counters, addressed by key name and exported under the key's label (`labels`: name -> label).

        A key file's names are their own labels; a plain key's name (`key-` + 8 hex of its SHA-256) is a
        fingerprint of the key, so it is exported as `plain-N` instead. `in_flight(name)` is read at scrape time:
        the key's requests between admission and response end.
        """
        r = self.registry
        by_key = lambda metric: _ByKey(metric, labels)  # noqa: E731
        self.key_in_flight = by_key(Gauge("lmserve:key_requests_in_flight", "Requests admitted and not ended, by "
                                          "API key name (what max_concurrent_requests counts)", ["key_name"],
                                          registry=r))
        self.key_requests = by_key(Counter("lmserve:key_requests", "Generation requests admitted, by API key name",
                                           ["key_name"], registry=r))
        self.key_tokens = by_key(Counter("lmserve:key_tokens", "Tokens of ended requests, by API key name and kind",
                                         ["key_name", "kind"], registry=r))
        self.key_rejections = by_key(Counter("lmserve:key_rejections", "Requests refused by a key's limits or model "
                                             "list, by API key name and reason", ["key_name", "reason"], registry=r))
        self.key_prefix_hits = by_key(Counter("lmserve:key_prefix_cache_hit_tokens", "Prompt tokens whose KV came "
                                              "from the prefix cache, by API key name (a key's blocks are its own "
                                              "unless it opts in to sharing)", ["key_name"], registry=r))
        self.key_paced = by_key(Counter("lmserve:key_requests_paced", "Requests that waited before their body was "
                                        "read because their key's requests kept being refused while other keys "
                                        "were served (--pace-refused-requests), by API key name", ["key_name"],
                                        registry=r))
        for name in labels:
            self.key_paced.labels(name)
            self.key_in_flight.labels(name).set_function(lambda name=name: in_flight(name))
            self.key_requests.labels(name)
            self.key_prefix_hits.labels(name)
            for kind in TOKEN_KINDS:
                self.key_tokens.labels(name, kind)
            for reason in reasons:
                self.key_rejections.labels(name, reason)

    def bind_response_cache(self, entries: Callable[[], float]) -> None:
        """The response cache's counters; `entries()` is read at scrape time."""
        r = self.registry
        self.cache_hits = Counter("lmserve:response_cache_hits", "Requests answered from the response cache",
                                  registry=r)
        self.cache_misses = Counter("lmserve:response_cache_misses", "Cacheable requests the cache did not hold "
                                    "(or could not be asked: a backend fault)", registry=r)
        Gauge("lmserve:response_cache_entries", "Entries in the response cache", registry=r).set_function(entries)

    def bind_engine(self, front, warmup_seconds: float, name: str | None = None) -> None:
        """Read the engine's load at scrape time through its front end (engine/front.EngineFront).

        `name`: the served model it belongs to (default: the server's one model name)."""
        name = name or self.model_name
        self._engines[name] = front
        loaded = front.loaded
        self.model_info.labels(name, loaded.path.name, str(front.dtype).removeprefix("torch."),
                               loaded.quantization, loaded.weight_format).set(1)
        self.load_seconds.set(loaded.load_seconds)
        self.warmup_seconds.set(warmup_seconds)
        self.model_loads.labels(name).inc()
        self.model_loaded.labels(name).set(1)
        self.model_load_time.labels(name).observe(loaded.load_seconds + warmup_seconds)
        if front.num_speculative_tokens is not None and not hasattr(self, "spec_drafts"):  # shared by every model
            self._bind_spec(front.num_speculative_tokens)
        if front.loras is not None and not hasattr(self, "_lora_info"):  # one model's adapters (the first with any)
            self._bind_lora(front.loras, front.cfg.lora.max_loras)

    def _bind_lora(self, registry, max_loras: int) -> None:
        """LoRA metrics: vLLM's lora_requests_info, reads from disk (count, time), host-cache evictions."""
        r = self.registry
        self.lora_load_seconds = Histogram("lmserve:lora_load_seconds", "Reading a LoRA adapter from disk",
                                           buckets=LORA_LOAD_BUCKETS, registry=r)
        registry.load_listeners.append(self.lora_load_seconds.observe)
        self._lora_info = _LoraInfo(registry, max_loras)
        r.register(self._lora_info)

    def unbind_engine(self, name: str) -> None:
        """The model was unloaded: its engine gauges go, its info says 0."""
        self._engines.pop(name, None)
        self.model_unloads.labels(name).inc()
        self.model_loaded.labels(name).set(0)
        for labels in list(self.model_info._metrics):
            if labels[0] == name:
                self.model_info.labels(*labels).set(0)

    def _bind_spec(self, k: int) -> None:
        """Speculative-decoding counters (vLLM's names), present only when speculation is on."""
        r = self.registry
        c = lambda name, doc, labels=(): Counter(name, doc, labels, registry=r)  # noqa: E731
        self.spec_drafts = c("lmserve:spec_decode_num_drafts", "Verify runs (a request with drafts in a step)")
        self.spec_draft_tokens = c("lmserve:spec_decode_num_draft_tokens", "Draft tokens proposed")
        self.spec_accepted = c("lmserve:spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.spec_accepted_pos = c("lmserve:spec_decode_num_accepted_tokens_per_pos",
                                   "Draft tokens accepted, by position in the run", ["position"])
        for pos in range(k):
            self.spec_accepted_pos.labels(str(pos))

    def on_finished(self, delta, started: float, first_token: float | None, now: float) -> None:
        """Per-completion latencies (server clock) and phase times (engine clock)."""
        self.finished.labels(delta.finish_reason if delta.finish_reason in FINISH_REASONS else "abort").inc()
        self.e2e.observe(now - started)
        if first_token is not None and delta.num_output_tokens > 1:
            self.tpot.observe((now - first_token) / (delta.num_output_tokens - 1))
        if delta.index == 0:
            self.req_prompt.observe(delta.num_prompt_tokens)
        self.req_generation.observe(delta.num_output_tokens)
        if delta.timings is not None:
            self.queue.observe(delta.timings.queue_s)
            self.prefill.observe(delta.timings.prefill_s)
            self.decode.observe(delta.timings.decode_s)

    def on_step(self, stats, deltas) -> None:
        if stats.running_loras is not None:
            self._lora_info.running, self._lora_info.waiting = stats.running_loras, stats.waiting_loras
            self._lora_info.updated = time.time()
        if stats.num_drafts:
            self.spec_drafts.inc(stats.num_drafts)
            self.spec_draft_tokens.inc(stats.num_draft_tokens)
            self.spec_accepted.inc(stats.num_accepted_tokens)
            for pos, n in enumerate(stats.num_accepted_per_pos):
                if n:
                    self.spec_accepted_pos.labels(str(pos)).inc(n)
        if stats.grammar_mask_s:
            self.grammar_mask.observe(stats.grammar_mask_s)
        self.batch_size.observe(stats.batch_size)
        self.step_seconds.observe(stats.step_seconds)
        if stats.batch_size > self._max_batch:
            self._max_batch = stats.batch_size
            self.max_batch_size.set(stats.batch_size)

    def on_fault(self, fault) -> None:
        """An engine fault (on the engine thread): a failed step, or the engine's death."""
        if fault.fatal:
            self.engine_dead.set(1)
        else:
            self.step_failures.inc()

    def status(self, code: int, not_ready: bool = False) -> None:
        """Count one response; `not_ready`: the server is loading or draining (its 503s are expected)."""
        if code == 503 and not_ready:
            self.requests.labels("not_ready").inc()
        else:
            self.requests.labels(f"{min(code // 100, 5)}xx" if code < 600 else "5xx").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ByKey:
    """A per-key metric whose first label is given as a key name and exported as that key's label; a name not
    configured (never expected) is counted as "unknown" rather than exported."""

    def __init__(self, metric, labels: dict[str, str]) -> None:
        self._metric, self._labels = metric, labels

    def labels(self, name: str, *rest: str):
        return self._metric.labels(self._labels.get(name, "unknown"), *rest)


class _EngineCollector:
    """Gauges computed from the engine when scraped (ints read without locks are consistent enough)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.m = metrics

    def collect(self):
        # the engine thread of a loading model may add one meanwhile
        engines = {model: front.load() for model, front in list(self.m._engines.items())}
        labels = ["model_name"]
        values = {
            "lmserve:num_requests_running": lambda e: e.num_running,
            "lmserve:num_requests_waiting": lambda e: e.num_waiting,
            "lmserve:kv_cache_free_blocks": lambda e: e.kv_free_blocks,
            "lmserve:kv_cache_total_blocks": lambda e: e.kv_total_blocks,
            "lmserve:kv_cache_usage_perc": lambda e: e.kv_usage,
        }
        for name, value in values.items():
            g = GaugeMetricFamily(name, name.split(":")[1].replace("_", " "), labels=labels)
            for model, eng in engines.items():
                g.add_metric([model], float(value(eng)))
            yield g
        counters = {
            "lmserve:num_preemptions": ("Requests preempted (KV blocks ran out)", lambda e: e.num_preemptions),
            "lmserve:prefix_cache_hit_tokens": ("Prompt tokens whose KV came from the prefix cache",
                                                lambda e: e.prefix_hit_tokens),
            "lmserve:encoder_cache_images_encoded": ("Images run through the vision encoder (an image found in the "
                                                     "encoder cache runs none)", lambda e: e.images_encoded),
            "lmserve:cpu_gate_holds": ("An encoder's short steps that went first on the CPU: the other models' steps "
                                       "paused for them", lambda e: e.gate_holds),
            "lmserve:cpu_gate_paused_seconds": ("Time this model's steps paused for another model's short encoder "
                                                "steps (CPU; at most 50 ms a step)", lambda e: e.gate_paused_s),
        }
        for name, (doc, value) in counters.items():
            c = CounterMetricFamily(name, doc, labels=labels)
            for model, eng in engines.items():
                c.add_metric([model], float(value(eng)))
            yield c
        yield from _kv_tier_metrics(engines)


# The KV tier below the pool (cache/kv_tier.py), per model and tier (host | disk | shared); engines without one export none.
_TIER_COUNTERS = {
    "lmserve:kv_offload_hit_tokens": ("hit_tokens", "Prompt tokens whose KV was loaded from the KV tier, not computed"),
    "lmserve:kv_offload_loads": ("loads", "KV blocks copied from the tier into the pool"),
    "lmserve:kv_offload_load_bytes": ("load_bytes", "Bytes copied from the tier into the pool"),
    "lmserve:kv_offload_stores": ("stores", "KV blocks copied into the tier (host: evicted from the pool; disk: written)"),
    "lmserve:kv_offload_store_bytes": ("store_bytes", "Bytes copied into the tier"),
}
_DISK_COUNTERS = {
    "lmserve:kv_offload_disk_rejected_files": ("rejected", "Block files refused on read (corrupt, truncated, "
                                                           "foreign or forged) and deleted"),
    "lmserve:kv_offload_disk_dropped_blocks": ("dropped", "Blocks not written: the disk writer's queue was full"),
    "lmserve:kv_offload_disk_failed_writes": ("failed", "Block writes that failed (disk full, permissions)"),
}

# The shared tier (--kv-shared: Redis or a shared directory): its hits are kv_offload_*{tier="shared"}; these are its own
_SHARED_COUNTERS = {
    "lmserve:kv_shared_rejected_blocks": ("rejected", "Shared blocks refused on read (corrupt, truncated, foreign or "
                                                      "forged), deleted and recomputed"),
    "lmserve:kv_shared_dropped_blocks": ("dropped", "Blocks not sent to the shared store: its writer's queue was full"),
    "lmserve:kv_shared_failed_writes": ("failed", "Block writes to the shared store that failed"),
    "lmserve:kv_shared_errors": ("errors", "Shared store calls that failed (Redis down or slow): each a miss or a "
                                           "dropped write, never a failed request"),
}
_SHARED_LATENCY = {
    "lmserve:kv_shared_read_seconds": ("reads", "read_ns", "Time to fetch one block from the shared store"),
    "lmserve:kv_shared_write_seconds": ("writes", "write_ns", "Time to send one block to the shared store"),
}


def _kv_tier_metrics(engines: dict):
    """The tiers' counters and sizes, from each engine's load (EngineLoad.kv_tier: plain ints)."""
    stats = [(model, tier, st) for model, load in engines.items() for tier, st in load.kv_tier.items()]
    if not stats:
        return
    for name, (key, doc) in _TIER_COUNTERS.items():
        c = CounterMetricFamily(name, doc, labels=["model_name", "tier"])
        for model, tier, st in stats:
            c.add_metric([model, tier], float(st[key]))
        yield c
    g = GaugeMetricFamily("lmserve:kv_offload_usage_bytes", "Bytes the KV tier holds", labels=["model_name", "tier"])
    for model, tier, st in stats:
        g.add_metric([model, tier], float(st["used_bytes"]))
    yield g
    for name, (key, doc) in _DISK_COUNTERS.items():
        c = CounterMetricFamily(name, doc, labels=["model_name"])
        for model, tier, st in stats:
            if tier == "disk":
                c.add_metric([model], float(st[key]))
        yield c
    shared = [(model, st) for model, tier, st in stats if tier == "shared"]
    if not shared:
        return
    for name, (key, doc) in _SHARED_COUNTERS.items():
        c = CounterMetricFamily(name, doc, labels=["model_name"])
        for model, st in shared:
            c.add_metric([model], float(st[key]))
        yield c
    for name, (count, ns, doc) in _SHARED_LATENCY.items():
        m = SummaryMetricFamily(name, doc, labels=["model_name"])
        for model, st in shared:
            m.add_metric([model], count_value=st[count], sum_value=st[ns] / 1e9)
        yield m


class _LoraInfo:
    """vLLM's lmserve:lora_requests_info (one sample: the adapters of the last step's running and waiting
    requests as comma-separated labels, its value the time of that step) and the registry's counters."""

    def __init__(self, registry, max_loras: int) -> None:
        self.loras, self.max_loras = registry, max_loras
        self.running: tuple[str, ...] = ()
        self.waiting: tuple[str, ...] = ()
        self.updated = time.time()

    def collect(self):
        g = GaugeMetricFamily("lmserve:lora_requests_info", "Running stats on LoRA requests",
                              labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        g.add_metric([",".join(self.running), ",".join(self.waiting), str(self.max_loras)], self.updated)
        yield g
        yield CounterMetricFamily("lmserve:lora_loads", "LoRA adapters read from disk", value=self.loras.num_loads)
        yield CounterMetricFamily("lmserve:lora_evictions", "LoRA adapters dropped from host memory (--max-cpu-loras)",
                                  value=self.loras.num_evictions)
