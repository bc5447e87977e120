"""schemathesis against the served /openapi.json: a bounded number of generated requests per operation.

No 5xx, every answer in its documented status and schema, and afterwards the server is healthy with
every KV block free. `--max-tokens-limit 16` keeps generation short whatever max_tokens the fuzzer picks.
"""

from __future__ import annotations

import os

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis.checks import not_a_server_error, response_schema_conformance, status_code_conformance  # noqa: E402

from tests.server_util import running_server  # noqa: E402

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_EXAMPLES = int(os.environ.get("LMSERVE_FUZZ_EXAMPLES", "15"))  # per operation and mode; ~1 min at 15
POSITIVE = schemathesis.GenerationMode.POSITIVE
CHECKS = [not_a_server_error, status_code_conformance, response_schema_conformance]


def fuzz(operation, base_url: str, mode) -> None:
    """Run MAX_EXAMPLES generated requests against one operation; the first failing check raises.

    Positive cases follow the schema (they generate text); negative ones break it (they must get a 4xx).
    """

    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(mode))
    def run(case) -> None:
        case.call_and_validate(base_url=base_url, headers=AUTH, checks=CHECKS, timeout=60)

    run()


@pytest.mark.slow
def test_fuzz_every_operation(tmp_path):
    with running_server("--max-tokens-limit", "16", "--api-key", KEY, "--batch-dir", str(tmp_path),
                        "--metrics-public", headers=AUTH) as s:  # a plain key reads /metrics only so
        schema = schemathesis.openapi.from_url(s.url + "/openapi.json", headers=AUTH)
        failures = {}
        for result in schema.get_all_operations():
            operation = result.ok()
            # Negative cases need something to break: only operations with a body have one.
            modes = list(schemathesis.GenerationMode) if len(operation.body) else [POSITIVE]
            for mode in modes:
                try:
                    fuzz(operation, s.url, mode)
                except (Exception, BaseExceptionGroup) as e:  # noqa: F821 - Python 3.11+ (the suite's); collect each failure
                    failures[f"{operation.label} ({mode.value})"] = f"{type(e).__name__}: {str(e)[:1500]}"
        assert s.metric("lmserve:requests_total", 'status="2xx"') >= MAX_EXAMPLES  # it did reach the routes
        assert not failures, "\n\n".join(f"{k}: {v}" for k, v in failures.items())
        assert httpx.get(s.url + "/health").status_code == 200
        s.wait_idle()


RETRIEVAL = ("/v1/embeddings", "/v1/rerank", "/v2/rerank", "/rerank", "/v1/score", "/classify", "/embed")


@pytest.mark.slow
def test_fuzz_retrieval_operations_on_an_encoder():
    """The same checks on the retrieval routes of an encoder (the real all-MiniLM-L6-v2), whose tasks differ from
    the decoder's above: what it does not answer is a documented 400, nothing a 5xx, every block back."""
    from tests.encoder_models import minilm_dir

    with running_server("--model", str(minilm_dir()), "--api-key", KEY, "--metrics-public", headers=AUTH) as s:
        schema = schemathesis.openapi.from_url(s.url + "/openapi.json", headers=AUTH)
        failures = {}
        for result in schema.get_all_operations():
            operation = result.ok()
            if operation.path not in RETRIEVAL:
                continue
            for mode in schemathesis.GenerationMode:
                try:
                    fuzz(operation, s.url, mode)
                except (Exception, BaseExceptionGroup) as e:  # noqa: F821 - Python 3.11+ (the suite's)
                    failures[f"{operation.label} ({mode.value})"] = f"{type(e).__name__}: {str(e)[:1500]}"
        assert not failures, "\n\n".join(f"{k}: {v}" for k, v in failures.items())
        s.wait_idle()
