"""Ops: the one object the server talks to about observing requests (tracing, payload log, rules, drift).

Every part is optional (off by default). The server calls, per API request:
  begin(record, headers)  when the request arrives (tracing continues an incoming traceparent),
  check(record, prompt_token_counts)  once the prompts are tokenized (validation rules; may raise RuleViolation),
  finish(record)  when the response has ended, whatever the outcome (never raises; all work is cheap or queued).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from lmserve.ops.record import RequestRecord

log = logging.getLogger(__name__)


@dataclass
class Ops:
    tracer: Any = None  # lmserve.ops.tracing.RequestTracer
    payload_log: Any = None  # lmserve.ops.payload_log.PayloadLogger
    rules: Any = None  # lmserve.ops.rules.RuleChecker
    drift: Any = None  # lmserve.ops.drift.DriftMonitor
    _spans: dict[int, Any] = field(default_factory=dict)  # id(record) -> open request span

    def begin(self, record: RequestRecord, headers: Mapping[str, str]) -> None:
        if self.tracer is not None:
            try:
                self._spans[id(record)] = self.tracer.start(record, headers)
            except Exception:  # noqa: BLE001 - a tracing fault must not fail the request
                log.exception("starting the trace of a request failed")

    def check(self, record: RequestRecord, prompt_token_counts: list[int]) -> None:
        """Apply the validation rules; raises RuleViolation when a rule with policy `reject` matches."""
        if self.rules is not None:
            self.rules.check(record, prompt_token_counts)

    def finish(self, record: RequestRecord) -> None:
        span = self._spans.pop(id(record), None)
        for name, part, call in (("tracer", self.tracer, lambda t: t.finish(span, record)),
                                 ("payload log", self.payload_log, lambda p: p.submit(record)),
                                 ("drift", self.drift, lambda d: d.observe(record))):
            if part is None or (name == "tracer" and span is None):
                continue
            try:
                call(part)
            except Exception:  # noqa: BLE001 - observing must never break serving
                log.exception("%s failed on request %s", name, record.request_id)

    def close(self) -> None:
        """Flush what is queued (payload lines, spans); called once at shutdown after requests have drained."""
        for part in (self.payload_log, self.tracer):
            if part is not None:
                try:
                    part.close()
                except Exception:  # noqa: BLE001
                    log.exception("closing %s failed", type(part).__name__)


def build_ops(args: Any, registry: Any, rule_params: Callable[[], Collection[str]]) -> Ops:
    """The parts that `lmserve serve`'s flags ask for (imported only when used); `rule_params`: the request
    parameters a validation rule may name (the server's body models say; ops imports no server code)."""
    ops = Ops()
    if args.otlp_traces_endpoint or args.otel_console_traces:
        from lmserve.ops.tracing import RequestTracer, make_tracer_provider

        ops.tracer = RequestTracer(make_tracer_provider(args.otlp_traces_endpoint, args.otel_console_traces))
    if args.payload_log:
        from lmserve.ops.payload_log import DEFAULT_REDACTIONS, PayloadLogger

        redact = (() if args.payload_log_no_default_redactions else DEFAULT_REDACTIONS) + tuple(args.payload_log_redact)
        ops.payload_log = PayloadLogger(args.payload_log, sample_rate=args.payload_log_sample_rate, redact=redact,
                                        max_field_chars=args.payload_log_max_field_chars,
                                        max_bytes=args.payload_log_max_bytes, backups=args.payload_log_backups,
                                        registry=registry)
    if args.validation_rules:
        from lmserve.ops.rules import RuleChecker

        ops.rules = RuleChecker.load(args.validation_rules, rule_params(), registry=registry)
    if args.drift_reference or args.drift_capture:
        import json

        from lmserve.ops.drift import DriftMonitor

        reference = None
        if args.drift_reference:
            with open(args.drift_reference, encoding="utf-8") as f:
                reference = json.load(f)
        ops.drift = DriftMonitor(reference=reference, capture=args.drift_capture, window=args.drift_window,
                                 threshold=args.drift_threshold, registry=registry)
    return ops


def add_ops_args(g: Any) -> None:
    """`lmserve serve` flags for tracing, payload logging, validation rules and drift detection (into group `g`)."""
    g.add_argument("--otlp-traces-endpoint", default=None,
                   help="send OpenTelemetry traces over OTLP/HTTP, e.g. http://localhost:4318/v1/traces (default: none)")
    g.add_argument("--otel-console-traces", action="store_true", help="print OpenTelemetry spans to stdout")
    g.add_argument("--payload-log", default=None, metavar="PATH",
                   help="one JSON line per finished request (default: none)")
    g.add_argument("--payload-log-sample-rate", type=float, default=1.0, help="fraction of requests logged")
    g.add_argument("--payload-log-redact", action="append", default=[], metavar="REGEX",
                   help="also redact matches of REGEX (repeatable; e-mail addresses and keys are redacted by default)")
    g.add_argument("--payload-log-no-default-redactions", action="store_true",
                   help="do not redact e-mail addresses and API keys/bearer tokens (only --payload-log-redact's)")
    g.add_argument("--payload-log-max-field-chars", type=int, default=10_000, help="longer strings are cut")
    g.add_argument("--payload-log-max-bytes", type=int, default=100 * 2**20, help="rotate the file at this size")
    g.add_argument("--payload-log-backups", type=int, default=5, help="rotated files kept (PATH.1 .. PATH.N)")
    g.add_argument("--validation-rules", default=None, metavar="FILE",
                   help="YAML or JSON constraints on requests, each rejecting (400) or logging and counting (default: none)")
    g.add_argument("--drift-reference", default=None, metavar="FILE",
                   help="reference profile from `lmserve monitor profile payload.jsonl` (default: none)")
    g.add_argument("--drift-capture", type=int, default=0, metavar="N",
                   help="without a reference file: the first N requests become the reference (default: 0, off)")
    g.add_argument("--drift-window", type=int, default=500, help="requests in the rolling window compared")
    g.add_argument("--drift-threshold", type=float, default=0.2, help="PSI above which a feature has drifted")
