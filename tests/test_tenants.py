"""API key files, per-key token buckets and their headers, without a server (tests/test_server_tenants.py has one)."""

from __future__ import annotations

import hashlib
import json

import pytest

from lmserve.errors import ConfigError
from lmserve.ops.record import RequestRecord
from lmserve.server.errors import APIError
from lmserve.server.key_file import key_specs, parse_key_file, plain_name, read_key_file
from lmserve.server.metrics import ServerMetrics
from lmserve.server.tenants import Tenants, duration, metric_labels

YAML = """
keys:
  - name: team-a
    key: sk-team-a-secret          # a comment, as a user writes it
    requests_per_minute: 60
    tokens_per_minute: 20000
    max_concurrent_requests: 4
    models: ["*"]
  - name: team-b
    sha256: {digest}
    models: [other-model]
"""


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def test_yaml_and_json_key_files_parse_the_same(tmp_path):
    a, b = parse_key_file(YAML.format(digest=sha("sk-b")), "f")
    assert (a.name, a.requests_per_minute, a.tokens_per_minute, a.max_concurrent_requests, a.models) == (
        "team-a", 60, 20000, 4, ("*",))
    assert a.digest == hashlib.sha256(b"sk-team-a-secret").digest() and "secret" not in repr(a)
    assert (b.name, b.requests_per_minute, b.models, b.digest.hex()) == ("team-b", None, ("other-model",), sha("sk-b"))
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [{"name": "team-a", "key": "sk-team-a-secret", "requests_per_minute": 60,
                                          "tokens_per_minute": 20000, "max_concurrent_requests": 4}]}))
    assert read_key_file(path) == ([], [a])


def test_plain_key_per_line_file_still_works(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text("key-one\n\n  key-two  \nsk-with:colon\n# the CI key, rotated monthly\n")
    assert read_key_file(path) == (["key-one", "key-two", "sk-with:colon"], [])  # a comment is not a key


@pytest.mark.parametrize("text,message", [
    ("keys: []", "non-empty list"),
    ("kyes: [{name: a, key: k}]", "unknown field 'kyes'"),
    ("keys: [{name: a, key: k, rpm: 3}]", "keys[0] (a): unknown field 'rpm'"),
    ("keys: [{name: a}]", "exactly one of `key` or `sha256`"),
    ("keys: [{name: a, key: k, sha256: " + "0" * 64 + "}]", "exactly one of"),
    ("keys: [{name: a, sha256: abc}]", "64 hex digits"),
    ("keys: [{name: a, sha256: " + sha("") + "}]", "empty key"),
    ("keys: [{key: k}]", "`name` must be"),
    ("keys: [{name: 'a b', key: k}]", "`name` must be"),
    ("keys: [{name: a, key: k}, {name: a, key: j}]", "'a' is used twice"),
    ("keys: [{name: a, key: k}, {name: b, key: k}]", "same key"),
    ("keys: [{name: anonymous, key: k}]", "reserved"),
    ("keys: [{name: a, key: k, requests_per_minute: 0}]", "positive integer"),
    ("keys: [{name: a, key: k, tokens_per_minute: 1.5}]", "positive integer"),
    ("keys: [{name: a, key: k, max_concurrent_requests: true}]", "positive integer"),
    ("keys: [{name: a, key: k, models: []}]", "`models`"),
    ('{"keys": [{"name": "a", "key": " k"}]}', "surrounding spaces"),
])
def test_bad_key_files_name_the_entry_and_never_the_key(text, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")) as e:
        parse_key_file(text, "--api-key-file k.yaml")
    assert str(e.value).startswith("--api-key-file k.yaml") and "\n" not in str(e.value)


def test_every_plain_key_is_its_own_identity_whose_name_the_file_may_not_take():
    """Plain keys are named key-<8 hex of their SHA-256>: one identity each (cache, shares, files, batches,
    limits, prefix blocks), a label that is never the key, and a form no key-file entry may take."""
    p1, p2 = key_specs(("p1", "p2", "p1", ""), ())  # a repeated key is one identity, an empty one none
    assert (p1.name, p2.name) == ("key-" + sha("p1")[:8], "key-" + sha("p2")[:8]) == (plain_name("p1"), plain_name("p2"))
    assert p1.plain and not p1.admin and p1.models == ("*",) and "p1" not in repr(p1)
    with pytest.raises(ConfigError, match="reserved"):
        parse_key_file(f"keys: [{{name: {plain_name('p1')}, key: other}}]", "f")
    assert parse_key_file("keys: [{name: key-12345678x, key: k}, {name: default, key: j}]", "f")  # other forms are fine
    named = tuple(parse_key_file("keys: [{name: a, key: p1}]", "f"))
    with pytest.raises(ConfigError, match="also the key of a named entry"):
        key_specs(("p1",), named)
    t = Tenants(key_specs(("p1", "p2"), ()))
    assert t.identify("Bearer p1") == p1.name and t.identify("Bearer p2") == p2.name
    assert not t.is_admin(p1.name) and not t.is_admin(p2.name)  # plain keys have no roles: none reads /metrics
    # /metrics labels: never the fingerprint; plain-N in the order given, after the file's names as they are
    named_a = tuple(parse_key_file("keys: [{name: a, key: ka}]", "f"))
    assert metric_labels(key_specs(("p2", "p1"), named_a)) == {"a": "a", p2.name: "plain-1", p1.name: "plain-2"}
    for reserved in ("plain-1", "plain-12"):  # a key file cannot take a plain key's label
        with pytest.raises(ConfigError, match="reserved"):
            parse_key_file(f"keys: [{{name: {reserved}, key: other}}]", "f")


def test_roles_prefix_cache_and_model_patterns_from_the_key_file():
    specs = parse_key_file("""
keys:
  - {name: ops, key: k-ops, role: admin}
  - {name: team-a, key: k-a, models: [base, "base/*"], prefix_cache: shared}
  - {name: team-b, key: k-b, models: [base, ada]}
""", "f")
    ops, a, b = specs
    assert (ops.role, ops.admin, ops.prefix_cache, a.role, a.prefix_cache) == ("admin", True, "isolated", "user", "shared")
    assert a.allows("base") and a.allows("base/prod") and not a.allows("prod") and not a.allows("base2")
    assert b.allows("ada") and not b.allows("prod") and not b.allows("ada2")  # an adapter is not its base
    t = Tenants(tuple(specs))
    assert t.is_admin("ops") and not t.is_admin("team-a")
    assert Tenants(()).is_admin("anonymous")  # no keys: an open server, everyone manages everything
    # prompt blocks: each key's own unless it shares (a request's own cache_salt overrides it: tests/test_engine.py)
    assert t.prefix_scope("team-b") == b"key:team-b" != t.prefix_scope("ops")
    assert t.prefix_scope("team-a") == b"" == Tenants(()).prefix_scope("anonymous")
    assert not t.allows("gone", "base") and not t.is_admin("gone")  # a name no longer in the file (a saved job)
    with pytest.raises(APIError) as e:
        t.admit(record("gone"), 1)
    assert e.value.status == 401 and "no longer accepted" in e.value.message
    for bad, words in (("role: root", "`role` must be one of user, admin"),
                       ("prefix_cache: global", "`prefix_cache` must be one of isolated, shared")):
        with pytest.raises(ConfigError, match=words):
            parse_key_file(f"keys: [{{name: a, key: k, {bad}}}]", "f")


def test_lora_dirs_from_the_key_file_default_to_the_keys_own_subdirectory():
    """Issue 47: which --lora-dir subdirectories a key may load adapters from (None: all of them)."""
    from pathlib import Path

    from lmserve.server.adapter_owners import allowed_root

    specs = parse_key_file("""
keys:
  - {name: ops, key: k-ops, role: admin}
  - {name: ops2, key: k-ops2, role: admin, lora_dirs: [ops]}
  - {name: team-a, key: k-a}
  - {name: team-b, key: k-b, lora_dirs: [team-b, "shared/*"]}
  - {name: nobody, key: k-n, lora_dirs: []}
""", "f")
    t = Tenants(key_specs(("p1",), tuple(specs)))
    assert [t.lora_dirs(n) for n in ("ops", "ops2", "team-a", "team-b", "nobody", plain_name("p1"), "gone")] == \
        [None, ("ops",), ("team-a",), ("team-b", "shared/*"), (), (plain_name("p1"),), ()]
    assert Tenants(()).lora_dirs("anonymous") is None  # no keys: everyone loads from all of --lora-dir
    root = Path("/srv/loras")
    cases = {("team-a", "x"): root / "team-a", ("team-a",): root / "team-a", ("team-ab", "x"): None,
             ("team-b", "sql"): None, ("shared", "sql"): root / "shared" / "sql",
             ("shared", "sql", "v2"): root / "shared" / "sql", ("shared",): None}
    for parts, inside in cases.items():
        assert allowed_root(root.joinpath(*parts), root, ("team-a", "shared/*")) == inside, parts
    assert allowed_root(root / "x", root, None) == root and allowed_root(root / "x", root, ()) is None
    for bad in ("[../team-b]", "[/etc]", "[team-a/..]", "[.]", "[a//b]", "team-a", "['']"):
        with pytest.raises(ConfigError, match="`lora_dirs`"):
            parse_key_file(f"keys: [{{name: a, key: k, lora_dirs: {bad}}}]", "f")


def record(name: str, prompt: int = 0, output: int = 0) -> RequestRecord:
    r = RequestRecord("r", "/v1/completions", key_name=name, prompt_tokens=prompt)
    r.output(0).tokens = output
    return r


def headers(t: Tenants, name: str) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in t.headers(name)}


def test_buckets_reserve_at_admission_and_settle_to_actual_usage():
    spec = parse_key_file("keys: [{name: a, key: k, requests_per_minute: 2, tokens_per_minute: 100, "
                          "max_concurrent_requests: 1}]", "f")
    t = Tenants(tuple(spec), ServerMetrics("m"))
    first = record("a", prompt=10)
    t.admit(first, 10 + 50)
    h = headers(t, "a")
    assert (h["x-ratelimit-limit-requests"], h["x-ratelimit-remaining-requests"]) == ("2", "1")
    assert (h["x-ratelimit-limit-tokens"], h["x-ratelimit-remaining-tokens"]) == ("100", "40")
    # full again after 60 tokens at 100 a minute: 36 s (a hair less by the time it is read)
    assert h["x-ratelimit-reset-tokens"].startswith(("36s", "35.9")) and h["x-ratelimit-reset-requests"][:2] in ("30", "29")
    with pytest.raises(APIError) as e:  # one in flight already
        t.admit(record("a"), 1)
    assert e.value.status == 429 and e.value.headers == {"Retry-After": "1"} and "concurrent" in e.value.message
    first.output(0).tokens = 5
    t.settle(first)  # used 15 of the 60 reserved: 45 come back
    assert int(headers(t, "a")["x-ratelimit-remaining-tokens"]) in (85, 86)
    with pytest.raises(APIError, match="tokens per minute") as e:
        t.admit(record("a"), 90)
    assert int(e.value.headers["Retry-After"]) in (3, 4)  # 90 - 85 tokens at 100 a minute
    with pytest.raises(APIError, match="lower max_tokens") as e:
        t.admit(record("a"), 101)  # can never pass: no Retry-After
    assert e.value.headers == {}
    second = record("a")
    t.admit(second, 1)
    t.settle(second)
    with pytest.raises(APIError, match="2 requests per minute") as e:
        t.admit(record("a"), 1)
    assert e.value.headers["Retry-After"] == "30"
    text = ServerMetrics.render(t.metrics).decode()
    for reason, count in (("concurrency", 1), ("tokens_per_minute", 2), ("requests_per_minute", 1), ("model", 0)):
        assert f'lmserve:key_rejections_total{{key_name="a",reason="{reason}"}} {count:.1f}' in text
    assert 'lmserve:key_tokens_total{key_name="a",kind="completion"} 5.0' in text


def test_unlimited_keys_send_no_rate_limit_headers_and_anonymous_is_the_name_without_keys():
    t = Tenants(())
    assert not t.enabled and list(t.usage) == ["anonymous"] and t.headers("anonymous") == []
    t.admit(record("anonymous"), 10**9)


@pytest.mark.parametrize("seconds,text", [(0, "0s"), (0.12, "120ms"), (0.0001, "1ms"), (1, "1s"), (1.5, "1.5s"),
                                          (59.9996, "1m0s"), (360, "6m0s"), (86.4, "1m26.4s")])
def test_reset_durations_read_like_openai(seconds, text):
    assert duration(seconds) == text


def test_a_prompt_is_held_by_its_byte_bounds_before_tokenizing_and_settled_at_admission():
    spec = parse_key_file("keys: [{name: a, key: k, requests_per_minute: 5, tokens_per_minute: 100}]", "f")
    t = Tenants(tuple(spec), ServerMetrics("m"))
    t.take_request("a")  # the middleware's, before the body is read
    assert headers(t, "a")["x-ratelimit-remaining-requests"] == "4"
    with pytest.raises(APIError, match="needs at least 101 by its prompt's bytes.*shorter prompt") as e:
        t.hold(record("a"), 101, 500)  # even the fewest tokens it can be never fit: no Retry-After
    assert e.value.headers == {}
    held = record("a")
    t.hold(held, 30, 500)  # the most it can be is more than is left: all of it is held while it tokenizes
    assert int(headers(t, "a")["x-ratelimit-remaining-tokens"]) in (0, 1)
    with pytest.raises(APIError, match="needs at least 10") as e:
        t.hold(record("a"), 10, 10)  # a second prompt meanwhile waits for the first one's exact count
    assert int(e.value.headers["Retry-After"]) >= 1
    held.rate_charged = True
    t.admit(held, 40)  # the exact count replaces what was held
    assert int(headers(t, "a")["x-ratelimit-remaining-tokens"]) in (60, 61)
    assert headers(t, "a")["x-ratelimit-remaining-requests"] == "4"  # its request was taken before work
    refused = record("a")
    t.hold(refused, 5, 20)
    t.settle(refused)  # refused between hold and admission (its exact length): what it held comes back
    assert int(headers(t, "a")["x-ratelimit-remaining-tokens"]) in (60, 61)
