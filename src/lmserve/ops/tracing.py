"""OpenTelemetry traces: one span per generation request, with children tokenize, queue, prefill, decode, detokenize.

The request span opens when the request arrives (continuing a W3C `traceparent` from the caller);
the children are built when it ends, from the phase times the record carries (the engine thread
never touches OpenTelemetry). Attribute names follow the OpenTelemetry GenAI conventions where they
exist (gen_ai.*); prompt and output text are never attributes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from lmserve.ops.record import RequestRecord

_PROPAGATOR = TraceContextTextMapPropagator()
_PARAMS = {"temperature": "gen_ai.request.temperature", "top_p": "gen_ai.request.top_p",
           "top_k": "gen_ai.request.top_k", "max_tokens": "gen_ai.request.max_tokens",
           "max_new_tokens": "gen_ai.request.max_tokens", "seed": "gen_ai.request.seed", "n": "gen_ai.request.choice.count"}


def make_tracer_provider(otlp_endpoint: str | None, console: bool, service_name: str = "lmserve") -> TracerProvider | None:
    """A provider exporting over OTLP/HTTP and/or to stdout (batched, off the request path); None if neither."""
    if not otlp_endpoint and not console:
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint)))
    if console:
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    return provider


@dataclass
class _Open:
    span: trace.Span
    context: Any  # the request span's context, parent of the children
    offset_ns: int  # wall-clock ns minus monotonic ns, to place children given in monotonic seconds


class RequestTracer:
    """Opens and closes request spans on a given provider (never the global one, so tests can own theirs)."""

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("lmserve")

    def start(self, record: RequestRecord, headers: Mapping[str, str]) -> _Open:
        """Open the request span at record.start, as a child of an incoming traceparent (tracestate kept)."""
        parent = _PROPAGATOR.extract({k.lower(): v for k, v in headers.items()})
        offset = time.time_ns() - time.monotonic_ns()
        span = self.tracer.start_span(f"POST {record.route}", context=parent, kind=SpanKind.SERVER,
                                      start_time=offset + int(record.start * 1e9),
                                      attributes={"lmserve.route": record.route, "http.request.method": "POST"})
        record.trace_id = f"{span.get_span_context().trace_id:032x}"
        return _Open(span, trace.set_span_in_context(span), offset)

    def finish(self, handle: _Open, record: RequestRecord) -> None:
        """Add the phase children and attributes, then end the request span when the response ended."""
        span = handle.span

        def ns(t: float) -> int:  # monotonic seconds -> epoch ns, with the offset taken at start
            return handle.offset_ns + int(t * 1e9)

        # e2e_s is None only if the middleware never closed the record: end now rather than at the start.
        end = record.start + record.e2e_s if record.e2e_s is not None else time.monotonic()
        self._children(handle, record, ns)
        span.set_attributes(_attributes(record))
        if record.status >= 400:  # semconv: error.type; a server span is an error only for 5xx
            span.set_attribute("error.type", str(record.status))
        if record.status >= 500:
            span.set_status(Status(StatusCode.ERROR, record.error or f"HTTP {record.status}"))
        elif record.error:
            span.set_attribute("lmserve.error", record.error[:200])
        span.end(end_time=ns(end))

    def _children(self, handle: _Open, record: RequestRecord, ns: Callable[[float], int]) -> None:
        def child(name: str, start: float, seconds: float, **attrs: Any) -> None:
            s = self.tracer.start_span(name, context=handle.context, start_time=ns(start), attributes=attrs or None)
            s.end(end_time=ns(start + max(seconds, 0.0)))

        child("tokenize", record.start, record.tokenize_s)
        if record.engine_arrival is None:  # refused before the engine: only tokenize happened
            return
        t = record.engine_arrival
        child("queue", t, record.queue_s)
        child("prefill", t + record.queue_s, record.prefill_s, **{"gen_ai.usage.input_tokens": record.prompt_tokens})
        decode_start = t + record.queue_s + record.prefill_s
        child("decode", decode_start, record.decode_s, **{"gen_ai.usage.output_tokens": record.output_tokens,
                                                          "lmserve.preemptions": record.num_preemptions})
        # Detokenizing is interleaved with every step; one span of its total time, ending with decode.
        child("detokenize", decode_start + record.decode_s - record.detokenize_s, record.detokenize_s,
              **{"lmserve.cumulative": True})

    def close(self) -> None:
        """Export what is batched, then stop the exporters (once, at shutdown)."""
        self.provider.force_flush()
        self.provider.shutdown()


def _attributes(record: RequestRecord) -> dict[str, Any]:
    """The request span's attributes: GenAI names where they exist, lmserve.* otherwise; never text."""
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": "chat" if record.route.endswith("chat/completions") else "text_completion",
        "gen_ai.system": "lmserve", "gen_ai.request.model": record.requested_model or record.model or "",
        "gen_ai.response.model": record.model or "", "gen_ai.usage.input_tokens": record.prompt_tokens,
        "gen_ai.usage.output_tokens": record.output_tokens, "http.response.status_code": record.status,
        "lmserve.stream": record.stream,
    }
    if record.request_id:
        attrs["gen_ai.response.id"] = record.request_id
    reasons = [r for r in record.finish_reasons if r]
    if reasons:
        attrs["gen_ai.response.finish_reasons"] = reasons
    for key, name in _PARAMS.items():
        value = record.params.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            attrs[name] = value
    if record.ttft_s is not None:
        attrs["lmserve.time_to_first_token_s"] = record.ttft_s
    if record.rule_violations:
        attrs["lmserve.rule_violations"] = list(record.rule_violations)
    if record.key_name:  # the API key's name from the key file; the key itself is never recorded
        attrs["lmserve.key_name"] = record.key_name
    return attrs
