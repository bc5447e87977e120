"""A per-request field lives in the request object, its producer and its consumer (issue 45): `cache_salt` is named
by the OpenAI body (server/protocol.py), the route that translates it (server/api/openai/routes.py), the request
object (request.py) and its one consumer (engine/front.py, which folds it into the prefix salt). A fifth file naming
it is a relay that copies fields one by one. The branch t45-scratch-readd-salt re-adds it in those 4 files."""

from __future__ import annotations

from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "lmserve"


def test_cache_salt_is_named_in_four_files():
    named = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if "cache_salt" in p.read_text())
    assert named == ["engine/front.py", "request.py", "server/api/openai/routes.py", "server/protocol.py"], named
