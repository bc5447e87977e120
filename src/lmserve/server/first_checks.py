"""The serve flags' checks that need no torch, which prepare() (server/main.py) runs first: the key file, then each
model flag's numbers, path and header file and the served names (server/models/args.py `check_model_flags`).

Why apart: `lmserve serve` runs them in its load thread before it imports torch and the engine (server/start.py), so
a mistyped path or a file that is not a model is one line in about the time Python takes to start, where it came
after `import torch` and the engine's imports (4-9 s on a first-generation Zen). prepare() then goes on from their
result instead of checking again: a key file is read once (it may be a pipe, `--api-key-file <(...)`, which a
second read would find empty: an open API), and a Hub id is resolved once.
"""

from __future__ import annotations

import argparse
from typing import NamedTuple

from lmserve.config import EngineConfig
from lmserve.server.key_file import KeySpec, read_api_keys
from lmserve.server.models.args import check_model_flags


class FirstChecks(NamedTuple):
    """What the first checks read: the API keys (read_api_keys) and the models (check_model_flags)."""

    keys: tuple[tuple[str, ...], tuple[KeySpec, ...]]
    models: list[tuple[str, EngineConfig]]


def first_checks(args: argparse.Namespace) -> FirstChecks:
    """The checks in prepare()'s order: the key file first, before the model checks warn about anything."""
    return FirstChecks(read_api_keys(args), check_model_flags(args))
