"""Weighted traffic splits for canaries: `--route chat=stable:90,canary:10`.

A request naming the route's name is served by one of its models, picked by weight: a request with a
`user` always gets the same model (a hash of the user's string, so a user's conversation never flips
between versions, and every replica agrees), one without a user is picked at random.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


@dataclass(frozen=True)
class TrafficSplit:
    """A route name and its (model name, weight) targets; weights are positive integers."""

    name: str
    targets: tuple[tuple[str, int], ...]

    @property
    def total(self) -> int:
        return sum(w for _, w in self.targets)

    def pick(self, user: str | None, rng: random.Random) -> str:
        """The model serving one request: sticky per `user` (hashed), else random by weight."""
        if user:
            point = int.from_bytes(hashlib.sha256(f"{self.name}\0{user}".encode()).digest()[:8], "big") % self.total
        else:
            point = rng.randrange(self.total)
        for model, weight in self.targets:
            if point < weight:
                return model
            point -= weight
        raise AssertionError("unreachable: point < total")


def parse_split(text: str) -> TrafficSplit:
    """`NAME=MODEL:WEIGHT,MODEL:WEIGHT` -> TrafficSplit; ValueError naming what is wrong."""
    name, sep, rest = text.partition("=")
    if not sep or not _NAME.match(name.strip()):
        raise ValueError(f"expected NAME=MODEL:WEIGHT,MODEL:WEIGHT, got {text!r}")
    targets = []
    for part in rest.split(","):
        model, sep, weight = part.strip().rpartition(":")
        if not sep or not model or not weight.strip().isdigit() or int(weight) < 1:
            raise ValueError(f"{text!r}: each target is MODEL:WEIGHT with a whole weight >= 1, got {part!r}")
        targets.append((model.strip(), int(weight)))
    if len({m for m, _ in targets}) != len(targets):
        raise ValueError(f"{text!r} names a model twice")
    return TrafficSplit(name.strip(), tuple(targets))


def valid_name(name: str) -> bool:
    """A served model or route name: letters, digits and . _ : - (no '/' or '=': those mean a path)."""
    return bool(_NAME.match(name))
