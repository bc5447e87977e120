"""Tracing with an in-memory exporter: the span tree, its attributes, and a continued incoming traceparent."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
import uvicorn
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from lmserve.ops.hub import Ops
from lmserve.ops.record import OutputRecord, RequestRecord
from lmserve.ops.tracing import RequestTracer, make_tracer_provider
from tests.server_util import BASE_ARGS, MODEL, free_port

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
CHILDREN = ["tokenize", "queue", "prefill", "decode", "detokenize"]


def memory_tracer() -> tuple[RequestTracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return RequestTracer(provider), exporter


def finished_record() -> RequestRecord:
    r = RequestRecord("", "/v1/chat/completions", model=MODEL, params={"temperature": 0.5, "max_tokens": 8})
    r.request_id, r.prompt_tokens, r.status = "chatcmpl-1", 12, 200
    r.tokenize_s, r.engine_arrival = 0.002, r.start + 0.003
    r.queue_s, r.prefill_s, r.decode_s, r.detokenize_s = 0.01, 0.05, 0.2, 0.001
    r.e2e_s, r.ttft_s = 0.27, 0.064
    r.outputs.append(OutputRecord("hi", 8, "length", -3.0))
    return r


def tree(exporter: InMemorySpanExporter):
    spans = exporter.get_finished_spans()
    roots = [s for s in spans if s.kind == SpanKind.SERVER]
    assert len(roots) == 1
    root = roots[0]
    children = sorted((s for s in spans if s is not root), key=lambda s: s.start_time)
    return root, children


def test_span_tree_and_attributes():
    tracer, exporter = memory_tracer()
    r = finished_record()
    handle = tracer.start(r, {"content-type": "application/json"})
    assert len(r.trace_id) == 32
    tracer.finish(handle, r)
    root, children = tree(exporter)
    assert root.name == "POST /v1/chat/completions" and root.parent is None
    assert [c.name for c in children] == CHILDREN
    assert all(c.parent.span_id == root.context.span_id for c in children)
    assert all(c.context.trace_id == root.context.trace_id == int(r.trace_id, 16) for c in children)
    a = root.attributes
    assert a["gen_ai.request.model"] == MODEL and a["gen_ai.usage.input_tokens"] == 12
    assert a["gen_ai.usage.output_tokens"] == 8 and tuple(a["gen_ai.response.finish_reasons"]) == ("length",)
    assert a["gen_ai.request.temperature"] == 0.5 and a["gen_ai.request.max_tokens"] == 8
    assert a["gen_ai.operation.name"] == "chat" and a["http.response.status_code"] == 200
    assert "hi" not in str(dict(a))  # no text in attributes
    span = {c.name: c for c in children}
    assert abs((root.end_time - root.start_time) / 1e9 - 0.27) < 1e-6
    assert abs((span["prefill"].end_time - span["prefill"].start_time) / 1e9 - 0.05) < 1e-6
    assert span["queue"].end_time <= span["prefill"].start_time + 1000 and \
        span["prefill"].end_time <= span["decode"].start_time + 1000
    assert root.start_time <= span["tokenize"].start_time and span["decode"].end_time <= root.end_time + 1000


def test_incoming_traceparent_is_continued_and_bad_one_ignored():
    tracer, exporter = memory_tracer()
    r = finished_record()
    tracer.finish(tracer.start(r, {"Traceparent": TRACEPARENT, "tracestate": "vendor=abc"}), r)
    root, children = tree(exporter)
    assert r.trace_id == TRACE_ID and f"{root.parent.span_id:016x}" == PARENT_ID and root.parent.is_remote
    assert root.context.trace_state.get("vendor") == "abc"  # the caller's vendor state travels on
    assert all(c.context.trace_id == int(TRACE_ID, 16) for c in children)
    exporter.clear()
    r = finished_record()
    tracer.finish(tracer.start(r, {"traceparent": "00-zzzz-nope-01"}), r)
    root, _ = tree(exporter)
    assert root.parent is None and r.trace_id != TRACE_ID


def test_error_status_and_refused_request():
    tracer, exporter = memory_tracer()
    r = RequestRecord("", "/v1/completions", model=MODEL)
    r.status, r.error, r.e2e_s = 503, "the server is at capacity", 0.001
    tracer.finish(tracer.start(r, {}), r)
    root, children = tree(exporter)
    assert root.status.status_code == StatusCode.ERROR and [c.name for c in children] == ["tokenize"]
    assert root.attributes["error.type"] == "503"

    exporter.clear()  # a 4xx is the client's fault: not an error span, but the message is kept
    r = RequestRecord("", "/v1/completions", model=MODEL)
    r.status, r.error, r.e2e_s = 400, "rule 'x': max_tokens 100 is above the maximum 8", 0.001
    tracer.finish(tracer.start(r, {}), r)
    root, _ = tree(exporter)
    assert root.status.status_code == StatusCode.UNSET and root.attributes["lmserve.error"] == r.error


def test_unclosed_record_ends_now_not_at_start():
    tracer, exporter = memory_tracer()
    r = RequestRecord("", "/v1/completions", model=MODEL)
    handle = tracer.start(r, {})
    time.sleep(0.01)
    tracer.finish(handle, r)  # e2e_s still None
    root, _ = tree(exporter)
    assert (root.end_time - root.start_time) / 1e9 >= 0.01


def test_make_tracer_provider():
    assert make_tracer_provider(None, False) is None
    provider = make_tracer_provider("http://127.0.0.1:1/v1/traces", True, service_name="svc")
    assert provider.resource.attributes["service.name"] == "svc"
    assert len(provider._active_span_processor._span_processors) == 2  # OTLP and console, each batched
    provider.shutdown()  # nothing was recorded: no export is attempted


@pytest.fixture(scope="module")
def traced_server():
    """The real app and engine under uvicorn in this process, tracing into an in-memory exporter."""
    from lmserve.cli import build_parser
    from lmserve.config import engine_config
    from lmserve.server.app import build_app
    from lmserve.server.main import load_engine
    from lmserve.server.metrics import ServerMetrics
    from lmserve.server.models.pool import ModelSpec
    from lmserve.server.state import ServerConfig, ServerState

    tracer, exporter = memory_tracer()
    args = build_parser().parse_args(["serve", *BASE_ARGS])
    state = ServerState(ServerConfig(MODEL), ServerMetrics(MODEL), ops=Ops(tracer=tracer))

    state.async_engine = load_engine(state, ModelSpec(MODEL, engine_config(args)), on_dead=None)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(state), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", exporter
    server.should_exit = True
    thread.join(10)
    state.async_engine.shutdown()


def test_server_traces_requests(traced_server):
    url, exporter = traced_server
    exporter.clear()
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    out = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                    temperature=0, extra_headers={"traceparent": TRACEPARENT})
    deadline = time.time() + 5
    while not any(s.kind == SpanKind.SERVER for s in exporter.get_finished_spans()) and time.time() < deadline:
        time.sleep(0.01)  # the span ends right after the last body byte
    root, children = tree(exporter)
    assert root.context.trace_id == int(TRACE_ID, 16) and f"{root.parent.span_id:016x}" == PARENT_ID
    assert [c.name for c in children] == CHILDREN
    a = root.attributes
    assert a["gen_ai.response.id"] == out.id and a["gen_ai.usage.output_tokens"] == out.usage.completion_tokens
    assert a["gen_ai.usage.input_tokens"] == out.usage.prompt_tokens
    assert a["lmserve.key_name"] == "anonymous"  # a key's name, never the key (this server takes none)
    assert tuple(a["gen_ai.response.finish_reasons"]) == (out.choices[0].finish_reason,)
    assert all(c.end_time >= c.start_time for c in children)

    exporter.clear()  # a streamed TGI request, no incoming trace: a new root
    with httpx.stream("POST", url + "/generate_stream", json={"inputs": "Hello", "parameters": {"max_new_tokens": 3}},
                      timeout=30) as r:
        assert r.status_code == 200
        r.read()
    deadline = time.time() + 5
    while not exporter.get_finished_spans() and time.time() < deadline:
        time.sleep(0.01)
    root, children = tree(exporter)
    assert root.parent is None and root.name == "POST /generate_stream" and len(children) == 5
    assert root.attributes["lmserve.stream"] is True and root.attributes["gen_ai.usage.output_tokens"] == 3
