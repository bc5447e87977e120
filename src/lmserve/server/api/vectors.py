"""The response of a route that answers vectors (embeddings, a classifier's probabilities), rendered by orjson.

A 384-dimension embedding is 384 Python floats, and the standard library's encoder formats each by its repr on the
event loop that every other request waits on: 0.45 ms a vector on a Zen 1 core (starlette's JSONResponse), 46 ms
for a request of 100. orjson writes the same numbers (the shortest text that reads back as the same float64) in
18 us and 1.8 ms. A NaN or an infinity is refused as starlette's encoder refuses it (a ValueError: the server's 500,
logged), where orjson alone would write null, a number the client could not tell from the model's.
"""

from __future__ import annotations

import math
from typing import Any

import orjson
from starlette.responses import JSONResponse


class VectorsResponse(JSONResponse):
    """A JSONResponse whose body orjson renders (str keys, lists, numbers, strings: what the routes build)."""

    def render(self, content: Any) -> bytes:
        if not _finite(content):
            raise ValueError("Out of range float values are not JSON compliant")
        return orjson.dumps(content)


def _finite(value: Any) -> bool:
    """No NaN or infinity anywhere in `value`. A vector is summed once (a NaN or an infinity in it makes the sum
    NaN or infinite), and checked value by value only when the sum is not finite (finite values that overflow it)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, list):
        if value and type(value[0]) is float:
            try:
                if math.isfinite(sum(value)):
                    return True
            except TypeError:  # not numbers alone: each in turn
                pass
        return all(_finite(v) for v in value)
    return True
