"""Per-request sampling and stopping parameters (plain data, validated once on creation)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from lmserve.pooling_params import PoolingParams

# Bounds that keep one request from exhausting the server (checked here so the
# offline API and the HTTP API reject the same things with the same words).
MAX_N = 16
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_CHOICES = 1024
MAX_GRAMMAR_CHARS = 256 * 1024  # a schema, regex or grammar text beyond this is refused before compiling

STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a language (vLLM's `structured_outputs` names); exactly one kind is set.

    json: a JSON schema (dict or its text); regex; choice: one of these strings exactly; grammar: EBNF
    (GBNF-style) text; json_object: any JSON object; structural_tag: xgrammar structural-tag JSON (free
    text with constrained regions, e.g. tool calls).
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        set_kinds = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError(f"structured_outputs: set exactly one of {', '.join(STRUCTURED_KINDS)} "
                             f"(got {', '.join(set_kinds) or 'none'})")
        self._check_types()
        if len(self.spec_text) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"structured_outputs.{self.kind}: longer than {MAX_GRAMMAR_CHARS} characters")

    @classmethod
    def from_dict(cls, d: dict) -> "StructuredOutputsParams":
        """From vLLM's `structured_outputs` object; unknown keys are named."""
        unknown = sorted(set(d) - set(STRUCTURED_KINDS))
        if unknown:
            raise ValueError(f"structured_outputs: unknown key(s) {', '.join(unknown)}; "
                             f"expected one of {', '.join(STRUCTURED_KINDS)}")
        return cls(**{k: v for k, v in d.items() if v is not None})

    def _check_types(self) -> None:
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("structured_outputs.json must be a JSON schema (an object)")
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            if not isinstance(self.choice, list) or not self.choice or len(self.choice) > MAX_CHOICES:
                raise ValueError(f"structured_outputs.choice must be a list of 1..{MAX_CHOICES} strings")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_outputs.choice: every choice must be a non-empty string")

    @property
    def kind(self) -> str:
        """Which constraint this is: one of STRUCTURED_KINDS."""
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    @property
    def spec_text(self) -> str:
        """The constraint as one canonical string (the compile cache's key with `kind`)."""
        value: Any = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, dict):
            return json.dumps(value, sort_keys=True, ensure_ascii=False)
        if self.kind == "choice":
            return json.dumps(value, ensure_ascii=False)
        return "" if value is True else value


@dataclass
class SamplingParams:
    """How to pick the next token and when to stop. Defaults are greedy-free sampling at T=1."""

    n: int = 1
    max_tokens: int | None = 16  # None: up to the model's context
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k >= 0: chosen token plus top-k alternatives
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # (start, end) reasoning tags, e.g. ("<think>", "</think>"): the structured output applies only after the
    # output's end tag, unless the prompt already closed the reasoning (a reasoning parser's requests, as vLLM)
    reasoning_tags: tuple[str, str] | None = None
    # at most this many reasoning tokens (the end tag's included), then the end tag is forced and the answer
    # follows (structured/reasoning_budget.py); needs reasoning_tags; None: the reasoning runs until max_tokens
    reasoning_budget: int | None = None
    # (begin, end) of a tool call, e.g. ("<tool_call>", "</tool_call>"): a call that repeats one already in the
    # output (same text, whitespace outside strings aside) ends the request before it (engine/repeat_stop.py)
    repeat_stop: tuple[str, str] | None = None
    # set: a pooling (embedding) request: the prompt is prefilled and pooled, nothing is sampled (pooling_params.py)
    pooling: PoolingParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    @property
    def greedy(self) -> bool:
        """Temperature 0 means argmax; sampling filters are then irrelevant."""
        return self.temperature < 1e-5

    def validate(self) -> None:
        """Raise ValueError naming the field and the bound for any out-of-range value."""
        _int_range("n", self.n, 1, MAX_N)
        if self.max_tokens is not None:
            _int_range("max_tokens", self.max_tokens, 1, None)
        _int_range("min_tokens", self.min_tokens, 0, self.max_tokens)
        _float_range("temperature", self.temperature, 0.0, 100.0)
        _int_range("top_k", self.top_k, 0, None)
        _float_range("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _float_range("min_p", self.min_p, 0.0, 1.0)
        _float_range("repetition_penalty", self.repetition_penalty, 0.0, 10.0, low_open=True)
        _float_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _float_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        if self.seed is not None:
            _int_range("seed", self.seed, -(2**63), 2**63 - 1)
        if self.logprobs is not None:
            _int_range("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _int_range("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_LEN:
                raise ValueError(f"stop: each stop string must be 1..{MAX_STOP_STRING_LEN} characters")
        for t in self.stop_token_ids:
            _int_range("stop_token_ids", t, 0, None)
        for tok, bias in (self.logit_bias or {}).items():
            _int_range("logit_bias key", tok, 0, None)
            _float_range("logit_bias value", bias, -100.0, 100.0)
        if self.reasoning_tags is not None and (len(self.reasoning_tags) != 2 or not all(
                isinstance(t, str) and t for t in self.reasoning_tags)):
            raise ValueError("reasoning_tags must be two non-empty strings (start, end)")
        if self.reasoning_budget is not None and (
                isinstance(self.reasoning_budget, bool) or not isinstance(self.reasoning_budget, int)
                or self.reasoning_budget < 0 or self.reasoning_tags is None):
            raise ValueError("reasoning_budget must be an integer >= 0, with reasoning_tags")
        if self.repeat_stop is not None and (len(self.repeat_stop) != 2 or not all(
                isinstance(t, str) and t for t in self.repeat_stop)):
            raise ValueError("repeat_stop must be two non-empty strings (begin, end)")
        if self.pooling is not None and (self.n != 1 or self.structured_outputs is not None):
            raise ValueError("a pooling request has one output and no structured outputs")

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids given by the caller must exist in the model's vocabulary."""
        for field_name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", (self.logit_bias or {}).keys())):
            bad = next((t for t in ids if t >= vocab_size), None)
            if bad is not None:
                raise VocabError(field_name, f"{field_name}: token id {bad} is out of vocabulary (size {vocab_size})")


class VocabError(ValueError):
    """A token id the caller gave is not in the vocabulary; `param` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _int_range(name: str, value: object, low: int | None, high: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {type(value).__name__}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")


def _float_range(name: str, value: object, low: float, high: float, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    if value < low or (low_open and value == low) or value > high:
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be in {bracket}{low}, {high}], got {value}")


EARLY_STOPPING = (True, False, "never")


@dataclass
class BeamSearchParams:
    """Beam search as vLLM spells it (`LLM.beam_search`), scored as transformers' `generate(num_beams=...)` scores.

    A finished beam's score is sum(logprobs) / len(generated tokens) ** length_penalty. `early_stopping`, as
    transformers: True ends once `beam_width` beams finished; False ends when the best running beam, normalised at
    its current length, cannot beat the worst finished one; "never" assumes it could still grow to max_tokens (for
    a positive length_penalty). Beams are greedy: temperature must be 0.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    include_stop_str_in_output: bool = False  # vLLM's field: the EOS token's text is never shown here

    def __post_init__(self) -> None:
        _int_range("beam_width", self.beam_width, 1, MAX_N)
        _int_range("max_tokens", self.max_tokens, 1, None)
        if self.temperature != 0:
            raise ValueError(f"temperature must be 0 with beam search (beams are ranked greedily), got {self.temperature}")
        _float_range("length_penalty", self.length_penalty, -10.0, 10.0)
        if not any(self.early_stopping is v or self.early_stopping == v and isinstance(v, str) for v in EARLY_STOPPING):
            raise ValueError(f'early_stopping must be true, false or "never", got {self.early_stopping!r}')
