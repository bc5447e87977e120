"""Sizes and durations as users write them (`--kv-cache-memory 2GiB`, Ollama's `keep_alive: "5m"`). No torch: the
key file's quotas and the model flags read them in `lmserve serve`'s checks before torch is imported (server/start.py)."""

from __future__ import annotations

import math
import re

_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
               "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """A size as people write it: `2GiB`, `512MiB`, `1.5G` (SI: 10**9), `4096` (bytes); ValueError otherwise."""
    s = text.strip().lower().replace(" ", "")
    number = s.rstrip("kmgtib")
    unit = s[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _SIZE_UNITS or not 0 <= value < float("inf"):  # also refuses NaN
        raise ValueError(f"{text!r} is not a size (write e.g. 2GiB, 512MiB, 10GB or a number of bytes)")
    return int(value * _SIZE_UNITS[unit])


_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")


def parse_duration(value: str | float) -> float | None:
    """A keep-alive as Ollama takes it -> seconds, or None for "forever" (any negative value).

    A number is seconds; a string is a Go duration ("5m", "1h30m", "250ms", "-1m") or a plain number of seconds
    ("300"). ValueError otherwise (also for NaN and infinities).
    """
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"{value!r} is not a duration (write e.g. 5m, 30s, 1h or a number of seconds)")
    if isinstance(value, str):
        value = _duration_seconds(value.strip())
    if not math.isfinite(value):
        raise ValueError(f"{value!r} is not a duration (write e.g. 5m, 30s, 1h or a number of seconds)")
    return None if value < 0 else float(value)


def _duration_seconds(text: str) -> float:
    sign, body = (-1.0, text[1:]) if text.startswith("-") else (1.0, text.removeprefix("+"))
    try:
        return sign * float(body) if body and not body[-1].isalpha() else sign * _go_duration(body)
    except ValueError:
        raise ValueError(f"{text[:40]!r} is not a duration (write e.g. 5m, 30s, 1h or a number of "
                         "seconds)") from None


def _go_duration(body: str) -> float:
    parts = list(_DURATION_PART.finditer(body))
    if not parts or "".join(p.group(0) for p in parts) != body:
        raise ValueError(body)
    return sum(float(p.group(1)) * _DURATION_UNITS[p.group(2)] for p in parts)
