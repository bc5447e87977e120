"""Disaggregated prefill and decode on Ray Serve, the way vLLM's KV-connector P/D works, over the shared KV tier.

A long prompt (at least `pd_min_prompt_chars` characters of prompt text, forward.prompt_text) is first sent to
a prefill replica as the same request cut to one generated token (`prefill_body`): that replica computes the
prompt, its engine writes every full prefix block to the shared tier (`--kv-shared`, Redis or a shared
directory: cache/kv_shared.py) and the replica answers only once its writer has sent them all. The request
itself then goes to a decode replica, whose prefix lookup finds those blocks in the shared tier (same model,
tokenizer, KV layout and API-key salt, so the same names) and computes only the prompt's last partial block
and the answer. The prefill replica runs the very app a colocated one does, with the client's headers, so the
prompt is rendered, salted and checked the same way.

Short prompts go straight to a decode replica. So does every request while the prefill role is missing: a
prefill call that fails (the replica died), that no replica accepts within `start_timeout_s` (none running, or
all full), or that takes longer than `timeout_s`, is a fallback: the decode replica computes the whole prompt
itself, as a colocated replica would, and for `retry_s` after that the ingress does not try the prefill role
again. A client never sees a prefill failure; /health names the missing role.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections import Counter
from dataclasses import dataclass

from lmserve.deploy.forward import ForwardedRequest, prompt_text

log = logging.getLogger("lmserve.deploy")

ACCEPTED = "accepted"  # a prefill replica's first item: it has the request (the rest may take seconds)
# The fields that would make the prefill run longer or stream; the cut request generates one token, whole.
_DROP = ("stream", "stream_options", "min_tokens", "max_completion_tokens", "best_of")
_ONE_TOKEN = {"/v1/completions": "max_tokens", "/v1/chat/completions": "max_tokens"}


def prefill_body(path: str, body: bytes) -> bytes | None:
    """The request's body cut to one generated token, not streamed, one choice; None where the route has no
    prompt to prefill (then the request goes straight to decode)."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    data = {k: v for k, v in data.items() if k not in _DROP}
    if path in _ONE_TOKEN:
        data[_ONE_TOKEN[path]] = 1
        data["n"] = 1
    elif path in ("/generate", "/"):  # TGI: parameters.max_new_tokens
        params = data.get("parameters") if isinstance(data.get("parameters"), dict) else {}
        params = {k: v for k, v in params.items() if k not in ("best_of", "decoder_input_details")}
        data["parameters"] = {**params, "max_new_tokens": 1}
    else:
        return None
    return json.dumps(data).encode()


def wants_prefill(req: ForwardedRequest, min_prompt_chars: int) -> bool:
    """A generation request whose prompt text is long enough to be worth a prefill replica."""
    if req.method != "POST" or req.replica is not None:  # a pinned request (an operator's) goes where it says
        return False
    text = prompt_text(req.path, req.body)
    return text is not None and len(text) >= min_prompt_chars


@dataclass
class PDStats:
    """The ingress's P/D figures since start: hand-offs, and fallbacks by reason."""

    handoffs: int = 0  # prompts a prefill replica computed before their decode replica ran
    fallbacks: Counter = dataclasses.field(default_factory=Counter)  # reason -> prompts decode computed whole
    prefill_seconds: float = 0.0  # summed over hand-offs: how long their prefill call took

    def as_dict(self) -> dict:
        return {"handoffs": self.handoffs, "fallbacks": dict(self.fallbacks),
                "prefill_seconds": round(self.prefill_seconds, 3)}


class PrefillClient:
    """The ingress's side of P/D: runs a long prompt on a prefill replica before decode; never raises for a
    failure of the prefill role (it counts a fallback and marks the role missing for `retry_s`)."""

    def __init__(self, handle, min_prompt_chars: int, start_timeout_s: float, timeout_s: float,
                 retry_s: float, metrics=None) -> None:
        self.handle = handle.options(method_name="prefill", stream=True)
        self.pinger = handle.options(method_name="ping")
        self.min_prompt_chars = min_prompt_chars
        self.start_timeout_s, self.timeout_s, self.retry_s = start_timeout_s, timeout_s, retry_s
        self.stats = PDStats()
        self.metrics = metrics  # ray.serve.metrics counters (handoffs, fallbacks), or None
        self.down_until = 0.0  # monotonic time until which the prefill role counts as missing

    async def before_decode(self, req: ForwardedRequest) -> str | None:
        """Prefill `req` if it is long enough: "handoff", a fallback's reason, or None (a short prompt)."""
        if not wants_prefill(req, self.min_prompt_chars):
            return None
        body = prefill_body(req.path, req.body)
        if body is None:
            return None
        if time.monotonic() < self.down_until:
            return self._fallback("prefill_unavailable")
        t0 = time.monotonic()
        outcome = await self._run(dataclasses.replace(req, body=body))
        if outcome != "handoff":
            return self._fallback(outcome)
        self.stats.handoffs += 1
        self.stats.prefill_seconds += time.monotonic() - t0
        if self.metrics is not None:
            self.metrics["handoffs"].inc()
        return outcome

    async def _run(self, req: ForwardedRequest) -> str:
        stream = self.handle.remote(req)
        done = False
        try:
            # a replica takes a request at once (its engine runs on its own thread): no answer in time means none
            # is running, or all are full, and decode is better off computing the prompt itself
            try:
                if await asyncio.wait_for(stream.__anext__(), self.start_timeout_s) != ACCEPTED:
                    return "prefill_failed"
            except asyncio.TimeoutError:
                return "prefill_busy"
            status = await asyncio.wait_for(stream.__anext__(), self.timeout_s)
            done = True
            # a 4xx is the request's own fault: decode answers it with the same error
            return "handoff" if status == 200 else "prefill_rejected" if 400 <= status < 500 else "prefill_failed"
        except asyncio.TimeoutError:
            return "prefill_timeout"
        except Exception as e:  # noqa: BLE001 - any failure of the prefill role (RayActorError, ...) is a fallback
            log.warning("prefill replica failed on %s (%s: %s); decode computes the prompt", req.path,
                        type(e).__name__, e)
            return "prefill_failed"
        finally:
            if not done:
                stream.cancel()

    def _fallback(self, reason: str) -> str:
        if reason != "prefill_rejected":
            self.down_until = max(self.down_until, time.monotonic() + self.retry_s)
        self.stats.fallbacks[reason] += 1
        if self.metrics is not None:
            self.metrics["fallbacks"].inc(tags={"reason": reason})
        return reason

    async def available(self, timeout_s: float = 1.0) -> bool:
        """The prefill role answers a ping now and has not failed in the last `retry_s`."""
        if time.monotonic() < self.down_until:
            return False
        response = self.pinger.remote()

        async def answer():
            return await response

        try:
            await asyncio.wait_for(answer(), timeout_s)
            return True
        except Exception:  # noqa: BLE001 - a timeout (no replica) or a dead one: missing either way
            response.cancel()
            return False
