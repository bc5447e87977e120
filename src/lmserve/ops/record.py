"""RequestRecord: everything known about one API request once it has ended (plain data, JSON-able)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from time import monotonic
from time import time as wall_clock
from typing import Any


@dataclass
class OutputRecord:
    """One completion of the request (one per prompt x n)."""

    text: str = ""
    tokens: int = 0
    finish_reason: str | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestRecord:
    """Filled in as the request goes: the middleware opens it, routes and streams add to it, Ops reads it.

    Times are seconds; `time` is wall-clock (for logs), the others come from monotonic clocks.
    """

    request_id: str  # set by the route once known; the middleware puts a provisional one
    route: str  # "/v1/completions", "/v1/chat/completions", "/generate", ...
    time: float = field(default_factory=wall_clock)
    start: float = field(default_factory=monotonic)  # arrival, monotonic
    model: str | None = None  # the served model that answered (the client's own string is never a label)
    requested_model: str | None = None  # the name the client asked for when a --route picked `model` for it
    adapter: str | None = None
    key_name: str | None = None  # the API key's name from the key file (never the key); "anonymous" without keys
    rate_charged: bool = False  # its request was taken from the key's rate bucket (server/tenants.py), before work
    params: dict[str, Any] = field(default_factory=dict)  # the request's parameters as sent (no prompt)
    prompt: Any = None  # str | list[str] | list[int] | list[list[int]] as sent
    messages: list[dict[str, Any]] | None = None  # chat requests
    prompt_tokens: int = 0
    num_cached_tokens: int = 0  # of prompt_tokens, those found in the prefix cache (set as each prompt finishes)
    outputs: list[OutputRecord] = field(default_factory=list)
    status: int = 0  # HTTP status sent (499 when the client left first)
    error: str | None = None  # the error message for 4xx/5xx
    stream: bool = False
    trace_id: str | None = None  # hex, when tracing is on
    tokenize_s: float = 0.0
    inline_work: int = 0  # characters (ids count half) tokenized on the event loop for it: server/served.py caps it
    engine_arrival: float | None = None  # monotonic: when the first prompt entered the engine
    ttft_s: float | None = None  # arrival -> first token, as the server sent it
    e2e_s: float | None = None  # arrival -> response end
    queue_s: float = 0.0  # engine timings (the longest over the request's completions)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    detokenize_s: float = 0.0
    num_preemptions: int = 0
    rule_violations: list[str] = field(default_factory=list)  # names of validation rules that matched

    def output(self, index: int) -> OutputRecord:
        while len(self.outputs) <= index:
            self.outputs.append(OutputRecord())
        return self.outputs[index]

    @property
    def output_tokens(self) -> int:
        return sum(o.tokens for o in self.outputs)

    @property
    def mean_logprob(self) -> float | None:
        """Mean logprob per generated token over all completions (None when nothing was generated)."""
        total = [o.cumulative_logprob for o in self.outputs if o.cumulative_logprob is not None]
        return sum(total) / self.output_tokens if total and self.output_tokens else None

    @property
    def finish_reasons(self) -> list[str | None]:
        return [o.finish_reason for o in self.outputs]

    def prompt_text(self) -> str:
        return prompt_text(self.prompt, self.messages)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("start")
        d["output_tokens"] = self.output_tokens
        d["mean_logprob"] = self.mean_logprob
        return d


def prompt_text(prompt: Any, messages: Any) -> str:
    """The prompt as text: a string, several strings, or the messages' text contents, joined (ids: "")."""
    if isinstance(messages, list):
        parts = []
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts += [p.get("text", "") for p in content if isinstance(p, dict)]
        return "\n".join(parts)
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return "\n".join(p for p in prompt if isinstance(p, str))
    return ""
