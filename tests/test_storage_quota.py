"""Per-key storage quotas (issue 47, finding 9), as the holder of one key would try to fill the server's disk or push
out another key's data: files, shares, stored responses and their chains, and the response cache. Each limit
refuses (or, for stored responses and cache entries, evicts) only the key past it; the other key is unaffected."""

from __future__ import annotations

import httpx
import openai
import pytest

from lmserve.errors import ConfigError
from lmserve.server.api.responses.store import ResponseStore
from lmserve.server.key_file import parse_key_file
from lmserve.server.quotas import StorageQuota, parse_quota_flags
from tests.server_util import MODEL, running_server

KEY_A, KEY_B, ADMIN = "sk-team-a-0123456789abcdef", "sk-team-b-0123456789abcdef", "sk-ops-0123456789abcdef"
KEY_FILE = f"""
keys:
  - name: team-a
    key: {KEY_A}
    storage_quota: {{files: 2, file_bytes: 3000, shares: 2, responses: 3, response_chain: 3}}
  - name: team-b
    key: {KEY_B}
  - name: ops
    key: {ADMIN}
    role: admin
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("quota")
    (tmp / "keys.yaml").write_text(KEY_FILE)
    with running_server("--api-key-file", str(tmp / "keys.yaml"), "--storage-quota", "share_bytes=50000",
                        "--response-cache", f"sqlite:{tmp / 'cache.sqlite'}", "--response-cache-max-entries", "6",
                        "--batch-dir", str(tmp / "batches"), "--max-num-seqs", "2",
                        headers={"Authorization": f"Bearer {ADMIN}"}) as s:
        yield s


def client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def refused(call) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    assert e.value.status_code == 400 and e.value.code == "quota_exceeded"
    return e.value


def upload(c: openai.OpenAI, size: int):
    return c.files.create(file=("in.jsonl", b"x" * size), purpose="batch")


def test_files_are_refused_past_a_keys_count_and_bytes(server):
    a, b = client(server, KEY_A), client(server, KEY_B)
    first = upload(a, 1500)
    err = refused(lambda: upload(a, 1600))  # 3,100 bytes: over team-a's 3,000
    assert "3100 bytes" in err.message and err.param == "file"
    upload(a, 100)
    assert "already keeps 2 files" in refused(lambda: upload(a, 10)).message
    for _ in range(3):
        upload(b, 1600)  # team-b keeps the defaults (1,000 files, 4 GiB): unaffected
    a.files.delete(first.id)
    upload(a, 1000)  # room again once it deleted one


def share(server, key: str, prompt: str) -> httpx.Response:
    return httpx.post(server.url + "/playground/api/shares", headers={"Authorization": f"Bearer {key}"}, timeout=30,
                      json={"mode": "completion", "model": MODEL, "prompt": prompt, "params": {},
                            "output": {"text": "ok"}})


def test_shares_are_refused_past_a_keys_count_and_the_servers_byte_quota(server):
    assert [share(server, KEY_A, f"a{i}").status_code for i in range(2)] == [200, 200]
    third = share(server, KEY_A, "a2")
    assert third.status_code == 400 and third.json()["error"]["code"] == "quota_exceeded"
    assert share(server, KEY_B, "b" * 30_000).status_code == 200  # team-b: the server's 50,000 bytes
    big = share(server, KEY_B, "c" * 30_000)
    assert big.status_code == 400 and "over its limit of 50000" in big.json()["error"]["message"]
    assert [share(server, KEY_B, f"b{i}").status_code for i in range(3)] == [200] * 3  # count: the default 1,000


def respond(c: openai.OpenAI, text: str, previous: str | None = None):
    return c.responses.create(model=MODEL, input=text, max_output_tokens=2, temperature=0,
                              previous_response_id=previous)


def test_a_response_chain_past_a_keys_limit_is_a_400_and_the_oldest_responses_go_first(server):
    a, b = client(server, KEY_A), client(server, KEY_B)
    chain = [respond(a, "one")]
    for word in ("two", "three"):
        chain.append(respond(a, word, chain[-1].id))
    err = refused(lambda: respond(a, "four", chain[-1].id))  # team-a: 3 turns at most
    assert err.param == "previous_response_id" and "at most 3" in err.message
    other = [respond(b, "one")]
    for word in ("two", "three", "four", "five"):
        other.append(respond(b, word, other[-1].id))  # team-b: the default 1,000
    respond(a, "a new conversation")  # team-a keeps 3 responses: its oldest ("one") is dropped
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(chain[0].id)
    items = a.responses.input_items.list(chain[2].id, order="asc").data
    assert [i.content[0].text for i in items if i.type == "message" and i.role == "user"] == ["one", "two", "three"]
    assert b.responses.retrieve(other[0].id).id == other[0].id  # team-b's oldest are untouched


def test_a_chain_is_stored_once_per_turn_not_once_per_prefix(tmp_path):
    """previous_response_id chains stored each response's whole context: N turns took N²/2 items."""
    store = ResponseStore(tmp_path / "r.sqlite3")
    quota, previous, turn = StorageQuota(), None, 1_000 * "x"
    for i in range(40):
        response = {"id": f"resp_{i}", "output": [{"type": "message", "id": f"out_{i}", "content": "ok"}]}
        store.put("team-a", response, [{"id": f"in_{i}", "text": turn}], previous, quota)
        previous = store.get(f"resp_{i}", "team-a")
    count, size = store.usage("team-a")
    assert count == 40 and 40 * 1_000 < size < 40 * 1_200  # linear: ~820 KB if each copied its context
    assert [item["id"] for item in previous.context] == [x for i in range(39) for x in (f"in_{i}", f"out_{i}")] + [
        "in_39"]
    assert previous.depth == 40 and store.get("resp_39", "team-b") is None
    store.delete("resp_0", "team-a")  # hidden, still linked: the chain reads whole
    assert store.get("resp_0", "team-a") is None and len(store.get("resp_39", "team-a").context) == 79
    store.close()


def cached(c: openai.OpenAI, prompt: str) -> str:
    raw = c.chat.completions.with_raw_response.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                      max_tokens=1, temperature=0)
    return raw.headers["x-lmserve-cache"]


def test_one_keys_flood_evicts_only_its_own_response_cache_entries(server):
    """6 entries, 3 keys: 2 each. Before, team-a's 6 new answers pushed out every older entry, team-b's included."""
    a, b = client(server, KEY_A), client(server, KEY_B)
    assert [cached(b, f"team-b question {i}") for i in range(2)] == ["miss", "miss"]
    assert [cached(a, f"team-a flood {i}") for i in range(6)] == ["miss"] * 6
    assert [cached(b, f"team-b question {i}") for i in range(2)] == ["hit", "hit"]  # survived the flood
    assert [cached(a, f"team-a flood {i}") for i in (4, 5)] == ["hit", "hit"]  # its newest two: its share
    assert cached(a, "team-a flood 0") == "miss"  # its own oldest went


def test_quota_flags_and_key_file_entries_are_checked():
    assert parse_quota_flags(["files=5", "file_bytes=2GiB", "cache_entries=none"]) == StorageQuota(
        files=5, file_bytes=2 * 2**30, cache_entries=None)
    for bad in (["files"], ["file=5"], ["files=-1"], ["shares=lots"]):
        with pytest.raises(ValueError):
            parse_quota_flags(bad)
    spec, = parse_key_file("keys:\n  - {name: a, key: k1, storage_quota: {shares: 3, share_bytes: 1MiB}}\n", "f")
    assert StorageQuota().merged(spec.storage_quota) == StorageQuota(shares=3, share_bytes=2**20)
    with pytest.raises(ConfigError, match="unknown storage quota 'sharez'"):
        parse_key_file("keys:\n  - {name: a, key: k1, storage_quota: {sharez: 3}}\n", "f")
