"""The shared KV tier (--kv-shared) between two engines, replica A and replica B, on one real redis-server or one
directory: a prompt A computed is loaded by B bit for bit, for its salt alone; a corrupt, foreign or other-salt
value under a block's name is refused and recomputed; Redis going away turns lookups into misses, never errors."""

from __future__ import annotations

import time

import pytest

from lmserve.cache.kv_cache_manager import block_hash
from lmserve.cache.kv_redis import RETRY_S
from lmserve.engine.front import _prefix_salt
from lmserve.engine.llm_engine import LLMEngine
from tests.redis_server import redis_server
from tests.test_kv_tier_engine import BS, PROMPT, assert_no_leak, engine, full_blocks, run


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.conftest import write_tiny_llama

    path = tmp_path_factory.mktemp("tiny") / "llama"
    write_tiny_llama(path)
    return path


@pytest.fixture(scope="module")
def cold(tiny) -> dict:
    """The prompt computed by an engine without a tier: what every load must reproduce exactly."""
    out = run(engine(tiny), PROMPT, "cold")
    assert out["cached"] == 0
    return out


@pytest.fixture(scope="module")
def redis_srv():
    with redis_server() as server:
        yield server


@pytest.fixture(params=["redis", "dir"])
def store(request, redis_srv, tmp_path) -> str:
    """What `--kv-shared` names: a fresh Redis database's URL, or a fresh directory."""
    if request.param == "dir":
        return str(tmp_path / "shared")
    redis_srv.client().flushall()
    return redis_srv.url


def replica(tiny, store: str, **kw) -> LLMEngine:
    return engine(tiny, shared=store, **kw)


def computed_on_a(tiny, store: str, salt: bytes = b"") -> tuple[LLMEngine, dict]:
    a = replica(tiny, store)
    out = run(a, PROMPT, "a", salt=salt)
    a.kv_tier.flush()  # the writer has sent every block
    assert a.kv_tier.stats("shared")["stores"] >= full_blocks(a, PROMPT)
    return a, out


def prefix_hashes(eng: LLMEngine, salt: bytes = b"") -> list[bytes]:
    ids, out, parent = eng.front.tokenize_prompt(PROMPT), [], None
    extra = _prefix_salt(None, salt)  # as the engine salts a request's blocks
    for i in range(full_blocks(eng, PROMPT)):
        parent = block_hash(parent, ids[i * BS:(i + 1) * BS], extra)
        out.append(parent)
    return out


def stored(tier, h: bytes) -> bytes:
    """A block's stored bytes in either backend."""
    if hasattr(tier, "_redis"):
        return tier._redis.get(tier._key(tier._seal.name_of(h)))
    return tier._path(h).read_bytes()


def overwrite(tier, h: bytes, value: bytes) -> None:
    if hasattr(tier, "_redis"):
        tier._redis.set(tier._key(tier._seal.name_of(h)), value)
    else:
        tier._path(h).write_bytes(value)


def test_a_prompt_computed_on_a_is_loaded_by_b_bit_identical(tiny, cold, store):
    a, first = computed_on_a(tiny, store)
    assert first["ids"] == cold["ids"]
    b = replica(tiny, store)
    again = run(b, PROMPT, "b")
    assert again["cached"] == full_blocks(b, PROMPT) * BS  # all of B's prefill but the last token skipped
    shared = b.kv_tier.stats("shared")
    assert shared["hit_tokens"] == again["cached"] and shared["loads"] == full_blocks(b, PROMPT)
    assert again["ids"] == cold["ids"] and again["logprobs"] == cold["logprobs"]  # bit for bit
    summary = b.kv_tier.summary()["shared"]
    assert summary["rejected"] == 0 and summary["errors"] == 0 and summary["reads"] >= shared["loads"]
    assert summary["read_ns"] > 0 and a.kv_tier.summary()["shared"]["write_ns"] > 0
    assert_no_leak(b)
    a.close()
    b.close()


def test_another_salt_gets_nothing_and_a_foreign_layout_nothing(tiny, cold, store):
    a, _ = computed_on_a(tiny, store, salt=b"key:team-a")
    b = replica(tiny, store)
    assert run(b, PROMPT, "b", salt=b"key:team-b")["cached"] == 0
    assert run(b, PROMPT, "n")["cached"] == 0  # nor unsalted
    assert b.kv_tier.stats("shared")["hit_tokens"] == 0
    other = replica(tiny, store, block_size=8)  # another KV layout: another namespace, none of A's blocks
    assert run(other, PROMPT, "o", salt=b"key:team-a")["cached"] == 0
    assert run(b, PROMPT, "b2", salt=b"key:team-a")["cached"] == full_blocks(b, PROMPT) * BS
    for eng in (a, b, other):
        eng.close()


@pytest.mark.parametrize("damage", ["flipped", "other_salt"])
def test_a_corrupt_or_planted_block_is_refused_and_recomputed(tiny, cold, store, damage):
    """A flipped byte, or another salt's genuine signed block under this salt's name: the 4th block is refused
    (deleted, counted), the 3 before it load, the rest is recomputed and the tokens are the cold run's."""
    a, _ = computed_on_a(tiny, store)
    tier = a.kv_tier.shared
    target = prefix_hashes(a)[3]
    if damage == "flipped":
        raw = bytearray(stored(tier, target))
        raw[-1] ^= 0xFF
    else:
        run(a, PROMPT, "t", salt=b"key:team-b")
        a.kv_tier.flush()
        raw = stored(tier, prefix_hashes(a, b"key:team-b")[3])
    overwrite(tier, target, bytes(raw))
    b = replica(tiny, store)
    again = run(b, PROMPT, "b")
    assert again["cached"] == 3 * BS and b.kv_tier.summary()["shared"]["rejected"] == 1
    assert again["ids"] == cold["ids"] and again["logprobs"] == cold["logprobs"]
    b.kv_tier.flush()  # B wrote the recomputed block back: the next replica loads the whole prefix
    c = replica(tiny, store)
    assert run(c, PROMPT, "c")["cached"] == full_blocks(c, PROMPT) * BS
    for eng in (a, b, c):
        eng.close()


def test_redis_going_away_mid_run_turns_the_tier_into_misses_until_it_is_back(tiny, cold):
    with redis_server() as srv:
        a = replica(tiny, srv.url)
        run(a, PROMPT, "a")
        a.kv_tier.flush()
        b = replica(tiny, srv.url)
        srv.kill()
        out = run(b, PROMPT, "b")  # Redis is gone: computed, not shared, and the request completes
        assert out["cached"] == 0 and out["ids"] == cold["ids"]
        assert b.kv_tier.summary()["shared"]["errors"] >= 1
        again = run(a, PROMPT, "a2")  # A still serves from its own pool
        assert again["cached"] == full_blocks(a, PROMPT) * BS
        late = replica(tiny, srv.url)  # a replica started while Redis is down starts, and computes
        assert run(late, PROMPT, "l")["ids"] == cold["ids"]
        with redis_server(srv.port):  # Redis back, empty: after RETRY_S the tier shares again, one secret for all
            time.sleep(RETRY_S + 0.5)
            c = replica(tiny, srv.url)  # a new replica first: its secret goes in, and the others adopt it
            run(b, PROMPT, "b2", salt=b"again")
            b.kv_tier.flush()
            back = run(c, PROMPT, "c", salt=b"again")
            assert back["cached"] == full_blocks(c, PROMPT) * BS and back["ids"] == cold["ids"]
            assert run(late, PROMPT, "l2", salt=b"again")["cached"] == full_blocks(late, PROMPT) * BS
            for eng in (a, b, late, c):
                assert_no_leak(eng)
                eng.close()
