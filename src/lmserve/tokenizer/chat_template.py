"""Chat templates, rendered as transformers renders them, in Jinja2's immutable sandbox (tokenizer/jinja_sandbox.py).

A template inside a model file is untrusted input: it runs sandboxed, sees only plain JSON data,
and any failure becomes a ValueError with a short message (never a raw Jinja traceback). A render is
also bounded: RENDER_TIMEOUT_S of time (a template that loops, even without writing anything) and
jinja_sandbox.MAX_RENDER_CHARS of output; `*` and `**` in a template cannot build a value past that size.

This module also marks special-token strings in user-supplied text (`mark_special`) so that
`Tokenizer.encode_chat` can tell the template's own special tokens from ones a user typed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# Private-use plane-15 code points around special-token text that came from the user.
MARK_OPEN, MARK_CLOSE = "\U000f0000", "\U000f0001"
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # aliases transformers fills in
# A real template renders a long conversation in milliseconds; this only stops templates that loop
# (jinja_sandbox.MAX_RENDER_CHARS stops the ones that explode).
RENDER_TIMEOUT_S = 5.0


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


def _is_image_part(part: Any) -> bool:
    return isinstance(part, Mapping) and part.get("type") == "image"


def _parts(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A message's content as OpenAI parts, as HF vision templates read it: text parts and `{"type": "image"}`
    (the template writes the image token for it, so it is the template's, never the user's); others refused."""
    content = message.get("content")
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [{"type": "image"} if _is_image_part(p) else {"type": "text", "text": _text_part(p)} for p in content]


def normalize_messages(messages: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the template sees them: None fields dropped, content one string (OpenAI parts in every message of
    a conversation with an image: vision templates loop over the parts), reasoning aliased."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    images = any(isinstance(m, Mapping) and isinstance(m.get("content"), list)
                 and any(_is_image_part(p) for p in m["content"]) for m in messages)
    out = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise ValueError(f"each message must be an object, got {type(message).__name__}")
        # Like transformers: a None field is dropped, since many templates test presence, not value.
        msg = {k: v for k, v in message.items() if v is not None}
        if "content" in msg:
            msg["content"] = _parts(msg) if images and isinstance(msg["content"], (str, list)) else message_text(msg)
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
    # The sandbox (and jinja2) is imported by the first render, not by a start (issue 32: ~0.05 CPU s).
    from lmserve.tokenizer.jinja_sandbox import render

    variables = {"tools": None, "documents": None, **special_tokens, **_plain_data(kwargs)}
    return render(template, RENDER_TIMEOUT_S, messages=messages, add_generation_prompt=add_generation_prompt,
                  **variables)


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
