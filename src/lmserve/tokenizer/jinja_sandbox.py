"""The Jinja2 sandbox chat templates render in (tokenizer/chat_template.py says what a render promises).

Imported by the first render, not at start: jinja2 and the sandbox are ~0.05 CPU s of a start (issue 32).
"""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_RENDER_CHARS = 16 * 2**20  # far more text than any context window holds
_YIELD_EVERY = 64  # template lines between GIL hand-offs and clock checks (a real render runs a few thousand)


def render(template: str, timeout_s: float, **variables: Any) -> str:
    """Compile (cached) and render `template` within timeout_s and MAX_RENDER_CHARS; ValueError on any failure."""
    try:
        return _render_bounded(_compile(template), timeout_s, **variables)
    except TemplateBudgetError as e:
        raise ValueError(f"chat template stopped: {e}") from None
    except jinja2.TemplateError as e:  # syntax errors, raise_exception(), undefined values, sandbox refusals
        raise ValueError(f"chat template error: {e}"[:500]) from None
    except Exception as e:  # a template bug (e.g. adding a str to a list) must not escape as a traceback
        raise ValueError(f"chat template failed: {type(e).__name__}: {e}"[:500]) from None


class TemplateBudgetError(Exception):
    """A render ran past its time (chat_template.RENDER_TIMEOUT_S) or MAX_RENDER_CHARS."""


def _render_bounded(template: jinja2.Template, timeout_s: float, **variables: Any) -> str:
    """template.render within the time and size budget.

    Time (timeout_s): a trace function on this thread sees every line the template's compiled code runs (Jinja
    compiles to Python; its frames are named "<template>"), so even a loop that writes nothing is
    stopped: every _YIELD_EVERY lines it checks the clock, and first gives up the GIL for a moment, so a
    render that loops cannot starve the engine thread and the event loop. The exception it raises unwinds
    the render. The trace is this thread's only, and the one set before (a debugger, coverage) is put back.
    """
    deadline, lines = time.monotonic() + timeout_s, 0

    def trace_line(frame, event, arg):
        nonlocal lines
        lines += 1
        if lines % _YIELD_EVERY == 0:
            time.sleep(0)  # let the event loop and the engine thread have the GIL (a looping render held it)
            if time.monotonic() > deadline:
                raise TemplateBudgetError(f"rendering took longer than {timeout_s:g} s (does it loop?)")
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
