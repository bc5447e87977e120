"""Chat templates, rendered as transformers renders them, inside Jinja2's immutable sandbox.

A template inside a model file is untrusted input: it runs sandboxed, sees only plain JSON data,
and any failure becomes a ValueError with a short message (never a raw Jinja traceback). A render is
also bounded: RENDER_TIMEOUT_S of time (a template that loops, even without writing anything) and
MAX_RENDER_CHARS of output; `*` and `**` in a template cannot build a value past that size.

This module also marks special-token strings in user-supplied text (`mark_special`) so that
`Tokenizer.encode_chat` can tell the template's own special tokens from ones a user typed.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Private-use plane-15 code points around special-token text that came from the user.
MARK_OPEN, MARK_CLOSE = "\U000f0000", "\U000f0001"
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # aliases transformers fills in
# A real template renders a long conversation in milliseconds; these only stop templates that loop or explode.
RENDER_TIMEOUT_S = 5.0
MAX_RENDER_CHARS = 16 * 2**20  # far more text than any context window holds
_YIELD_EVERY = 64  # template lines between GIL hand-offs and clock checks (a real render runs a few thousand)


# The turn format of a family whose GGUF files often come without a template (`tokenizer.chat_template`), keyed by
# general.architecture prefix: what its own template renders. Gemma has no system role: a system message opens the
# first user turn, as Gemma 3's template and llama.cpp's built-in "gemma" format do it.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set first = messages[0]['content'] | trim + '\n\n' -%}{%- set messages = messages[1:] -%}"
    "{%- else -%}{%- set first = '' -%}{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n'"
    " + (first if loop.first else '') + m['content'] | trim + '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}")
BUILT_IN_TEMPLATES = {"gemma": GEMMA_TEMPLATE}


def built_in_template(architecture: str) -> str | None:
    """The turn format for a GGUF architecture whose file carries no chat template (None: none known)."""
    return next((t for prefix, t in BUILT_IN_TEMPLATES.items() if architecture.startswith(prefix)), None)


def message_text(message: Mapping[str, Any]) -> str:
    """A message's content as one string: a string, or OpenAI text parts joined; other parts are refused."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_text_part(part) for part in content)
    raise ValueError("message content must be a string or a list of text parts")


def _text_part(part: Any) -> str:
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    raise ValueError(f"message content part of type {kind!r} is not supported (only 'text')")


def normalize_messages(messages: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the template sees them: None fields dropped, content one string, reasoning aliased."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    out = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise ValueError(f"each message must be an object, got {type(message).__name__}")
        # Like transformers: a None field is dropped, since many templates test presence, not value.
        msg = {k: v for k, v in message.items() if v is not None}
        if "content" in msg:
            msg["content"] = message_text(msg)
        reasoning = next((msg[k] for k in _REASONING_FIELDS if msg.get(k) is not None), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        out.append(_plain_data(msg))
    return out


def _plain_data(value: Any) -> Any:
    """Rebuild `value` from plain JSON types: the sandbox cannot vet methods of arbitrary objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (bool, str, int, float):  # subclasses (enums, numpy scalars) lose their extra methods
        if isinstance(value, base):
            return base(value)
    if isinstance(value, Mapping):
        return {_plain_data(k): _plain_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain_data(v) for v in value]
    return f"<{type(value).__name__}>"


# -- rendering -------------------------------------------------------------------------------------

def render_chat(template: str, messages: list[dict[str, Any]], add_generation_prompt: bool,
                special_tokens: Mapping[str, str], **kwargs: Any) -> str:
    """Render normalized `messages`; template variables are those transformers' apply_chat_template sets."""
    variables = {"tools": None, "documents": None, **special_tokens, **_plain_data(kwargs)}
    try:
        return _render_bounded(_compile(template), messages=messages, add_generation_prompt=add_generation_prompt,
                               **variables)
    except TemplateBudgetError as e:
        raise ValueError(f"chat template stopped: {e}") from None
    except jinja2.TemplateError as e:  # syntax errors, raise_exception(), undefined values, sandbox refusals
        raise ValueError(f"chat template error: {e}"[:500]) from None
    except Exception as e:  # a template bug (e.g. adding a str to a list) must not escape as a traceback
        raise ValueError(f"chat template failed: {type(e).__name__}: {e}"[:500]) from None


class TemplateBudgetError(Exception):
    """A render ran past RENDER_TIMEOUT_S or MAX_RENDER_CHARS."""


def _render_bounded(template: jinja2.Template, **variables: Any) -> str:
    """template.render within the time and size budget.

    Time: a trace function on this thread sees every line the template's compiled code runs (Jinja
    compiles to Python; its frames are named "<template>"), so even a loop that writes nothing is
    stopped: every _YIELD_EVERY lines it checks the clock, and first gives up the GIL for a moment, so a
    render that loops cannot starve the engine thread and the event loop. The exception it raises unwinds
    the render. The trace is this thread's only, and the one set before (a debugger, coverage) is put back.
    """
    deadline, lines = time.monotonic() + RENDER_TIMEOUT_S, 0

    def trace_line(frame, event, arg):
        nonlocal lines
        lines += 1
        if lines % _YIELD_EVERY == 0:
            time.sleep(0)  # let the event loop and the engine thread have the GIL (a looping render held it)
            if time.monotonic() > deadline:
                raise TemplateBudgetError(f"rendering took longer than {RENDER_TIMEOUT_S:g} s (does it loop?)")
        return trace_line

    def trace_call(frame, event, arg):
        return trace_line if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(trace_call)
    try:
        parts, size = [], 0
        for chunk in template.generate(**variables):
            size += len(chunk)
            if size > MAX_RENDER_CHARS:
                raise TemplateBudgetError(f"its output passed {MAX_RENDER_CHARS} characters")
            parts.append(chunk)
        return "".join(parts)
    finally:
        sys.settrace(previous)


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with `*` and `**` unable to build huge strings, lists or numbers."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "**" and isinstance(right, int) and abs(right) > 1024:
            raise TemplateBudgetError(f"exponent {right} is too large")
        if operator == "*" and isinstance(left, int) and isinstance(right, (str, list, tuple)):
            left, right = right, left
        if operator == "*" and isinstance(left, (str, list, tuple)) and isinstance(right, int) \
                and len(left) * right > MAX_RENDER_CHARS:
            raise TemplateBudgetError(f"a value of {len(left) * right} items is too large")
        return super().call_binop(context, operator, left, right)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True,
                          extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise, strftime_now=_strftime_now, dict=_TemplateDict(),
                       namespace=_TemplateNamespace)
    try:
        return env.from_string(template)
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template does not compile: {e}"[:500]) from None


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes; templates expect plain JSON, as transformers renders it.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _TemplateDict:
    """`dict(...)` for templates without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict:
        return dict.fromkeys(*args)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's namespace(), refusing underscore attributes so a template cannot reach Python internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature trick: `namespace(self=...)` works
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask markup some templates use) renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


# -- user text that spells special tokens --------------------------------------------------------

def special_pattern(special_strings: list[str]) -> re.Pattern[str] | None:
    """A regex matching any special-token string, longest first (so a token wins over ones it contains)."""
    if not special_strings:
        return None
    return re.compile("|".join(re.escape(s) for s in sorted(set(special_strings), key=len, reverse=True)))


def mark_special(value: Any, pattern: re.Pattern[str]) -> Any:
    """Wrap every special-token string inside user strings (recursively; dict keys untouched) in markers."""
    if isinstance(value, str):
        # Markers the user typed are dropped first, so they cannot forge or unbalance a marked token.
        value = value.replace(MARK_OPEN, "").replace(MARK_CLOSE, "")
        return pattern.sub(lambda m: MARK_OPEN + m.group(0) + MARK_CLOSE, value)
    if isinstance(value, dict):
        return {k: mark_special(v, pattern) for k, v in value.items()}
    if isinstance(value, list):
        return [mark_special(v, pattern) for v in value]
    return value


def unmark(value: Any) -> Any:
    """`value` with every marked special-token string removed (what the template writes by itself)."""
    if isinstance(value, str):
        return re.sub(f"{MARK_OPEN}[^{MARK_CLOSE}]*{MARK_CLOSE}", "", value)
    if isinstance(value, dict):
        return {k: unmark(v) for k, v in value.items()}
    if isinstance(value, list):
        return [unmark(v) for v in value]
    return value


def split_marked(rendered: str, pattern: re.Pattern[str]) -> list[tuple[str, bool]]:
    """Rendered text -> [(segment, is_user_special)], marked tokens separated from the template's text.

    A template that cuts a marked token apart leaves a lone marker: it is dropped, but still ends
    the segment, so text on either side of it cannot join into a special token.
    """
    marked = re.compile(f"{MARK_OPEN}({pattern.pattern}){MARK_CLOSE}|[{MARK_OPEN}{MARK_CLOSE}]")
    segments: list[tuple[str, bool]] = []
    pos = 0
    for m in marked.finditer(rendered):
        segments.append((rendered[pos:m.start()], False))
        if m.group(1) is not None:
            segments.append((m.group(1), True))
        pos = m.end()
    segments.append((rendered[pos:], False))
    return [(text, user) for text, user in segments if text]
