"""Chat templates rendered in Jinja2's immutable sandbox: a template inside a model file is untrusted."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


def message_text(message: dict) -> str:
    """A message's content as one string: a string, or OpenAI text parts joined; other parts are refused."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"message content part of type {kind!r} is not supported (only 'text')")
            texts.append(part["text"])
        return "".join(texts)
    raise ValueError("message content must be a string or a list of text parts")


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes; chat templates expect plain JSON as transformers renders it.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compile(template: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool, bos_token: str | None,
                eos_token: str | None, **kwargs: Any) -> str:
    """Render `messages` (content normalised to strings) with the model's template."""
    normalised = [{**m, "content": message_text(m)} for m in messages]
    try:
        return _compile(template).render(messages=normalised, add_generation_prompt=add_generation_prompt,
                                         bos_token=bos_token or "", eos_token=eos_token or "", **kwargs)
    except TemplateError as e:
        raise ValueError(f"chat template error: {e.message or type(e).__name__}"[:300]) from None
    except Exception as e:  # a sandbox violation or a template bug must not escape as a raw traceback
        raise ValueError(f"chat template failed: {type(e).__name__}") from None
