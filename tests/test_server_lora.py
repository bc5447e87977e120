"""LoRA through the real server: adapters by `model` (openai client) and `parameters.adapter_id` (TGI), /v1/models,
vLLM's load/unload routes (path confinement, bad adapters, more adapters than --max-cpu-loras), and metrics; and,
as the holder of a second key would probe them, adapters isolated between keys (ownership, `models`, the
response cache keyed by what answered, files confined to --lora-dir)."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
from tests.lora_adapters import make_peft_adapter, tiny_llama_checkpoint
from tests.server_util import running_server

KEY = "lora-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "w5 w6 w7 w8"


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    """A server on a tiny Llama: adapter `a` from the start, one device slot, two adapters in host memory."""
    root = tmp_path_factory.mktemp("server_lora")
    model = tiny_llama_checkpoint(root)
    loras, outside = root / "loras", root / "outside"
    for i, name in enumerate("abcd"):
        make_peft_adapter(loras / name, model, rank=8, target_modules=("q_proj", "v_proj", "down_proj"), seed=i)
    make_peft_adapter(loras / "big", model, rank=16, target_modules=("q_proj",), seed=9)
    make_peft_adapter(outside / "x", model, rank=4, target_modules=("q_proj",), seed=7)
    (loras / "link").symlink_to(outside / "x")
    with running_server("--model", str(model), "--api-key", KEY, "--enable-lora",
                        "--lora-modules", f"a={loras / 'a'}", "--max-loras", "1", "--max-cpu-loras", "2",
                        "--max-lora-rank", "8", "--allow-runtime-lora-updating", "--lora-dir", str(loras),
                        "--num-kv-blocks", "64", "--metrics-public", headers=AUTH) as s:  # a plain key: no admin
        s.root = root
        yield s


@pytest.fixture(scope="module")
def client(lora_server):
    return openai.OpenAI(base_url=lora_server.url + "/v1", api_key=KEY, max_retries=0)


def _complete(client, model: str, max_tokens: int = 6) -> str:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0).choices[0].text


def _load(server, name: str, path) -> httpx.Response:
    return httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                      headers=AUTH, timeout=30)


def _unload(server, name: str) -> httpx.Response:
    return httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": name}, headers=AUTH, timeout=30)


def test_models_list_base_and_adapters_with_parent(client):
    models = {m.id: m for m in client.models.list().data}
    base = next(m for m in models.values() if getattr(m, "parent", None) is None)
    assert models["a"].parent == base.id


def test_adapter_by_model_and_by_tgi_adapter_id(lora_server, client):
    base_model = client.models.list().data[0].id
    with_a, base = _complete(client, "a"), _complete(client, base_model)
    assert with_a != base, "the adapter should change the greedy output"
    out = client.completions.create(model="a", prompt=PROMPT, max_tokens=6, temperature=0)
    assert out.model == "a" and out.choices[0].text == with_a
    tgi = httpx.post(lora_server.url + "/generate", headers=AUTH, timeout=30, json={
        "inputs": PROMPT, "parameters": {"max_new_tokens": 6, "adapter_id": "a"}}).json()
    assert tgi["generated_text"] == with_a
    unknown = httpx.post(lora_server.url + "/generate", headers=AUTH, timeout=30, json={
        "inputs": PROMPT, "parameters": {"adapter_id": "nope"}})
    assert unknown.status_code == 404 and unknown.json()["error_type"] == "not_found"


def test_unknown_model_is_404_in_openai_shape(client):
    with pytest.raises(openai.NotFoundError) as e:
        _complete(client, "no-such-adapter")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


def test_load_refuses_paths_outside_lora_dir_and_bad_adapters(lora_server):
    loras = lora_server.root / "loras"
    for path in (lora_server.root / "outside" / "x", loras / ".." / "outside" / "x", loras / "link", "/etc",
                 loras):
        r = _load(lora_server, "x", path)
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", (path, r.text)
        assert "--lora-dir" in r.json()["error"]["message"]
    r = _load(lora_server, "big", loras / "big")
    assert r.status_code == 400 and "rank 16" in r.json()["error"]["message"]
    r = _load(lora_server, "missing", loras / "missing")
    assert r.status_code == 400 and "adapter_config.json" in r.json()["error"]["message"]
    assert _load(lora_server, "a", loras / "b").status_code == 409  # the name is taken (by the operator)
    assert httpx.post(lora_server.url + "/v1/load_lora_adapter", json={"lora_name": "z", "lora_path": str(loras / "b")},
                      timeout=10).status_code == 401
    assert _unload(lora_server, "never-loaded").status_code == 404


def test_load_more_than_max_cpu_loras_then_use_all_and_unload(lora_server, client):
    loras = lora_server.root / "loras"
    for name in "bcd":
        r = _load(lora_server, name, loras / name)
        assert r.status_code == 200 and r.json()["id"] == name, r.text
    assert {"a", "b", "c", "d"} <= {m.id for m in client.models.list().data}
    texts = {name: _complete(client, name) for name in "abcd"}  # one slot, two in host memory: evictions, re-reads
    assert len(set(texts.values())) >= 3
    assert texts == {name: _complete(client, name) for name in "abcd"}
    assert lora_server.metric("lmserve:lora_evictions_total") >= 2
    assert lora_server.metric("lmserve:lora_loads_total") >= 6
    assert lora_server.metric("lmserve:lora_load_seconds_count") >= 6
    assert _unload(lora_server, "b").status_code == 200
    with pytest.raises(openai.NotFoundError):
        _complete(client, "b")
    assert "b" not in {m.id for m in client.models.list().data}
    lora_server.wait_idle()


def test_unloading_an_adapter_in_use_lets_its_request_finish(lora_server, client):
    expected = _complete(client, "c", max_tokens=300)
    stream = client.completions.create(model="c", prompt=PROMPT, max_tokens=300, temperature=0, stream=True)
    chunks = iter(stream)
    text = next(chunks).choices[0].text  # the request is running now
    assert _unload(lora_server, "c").status_code == 200
    text += "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected
    with pytest.raises(openai.NotFoundError):
        _complete(client, "c")
    lora_server.wait_idle()


def test_lora_requests_info_metric(lora_server):
    text = httpx.get(lora_server.url + "/metrics", headers=AUTH, timeout=10).text
    line = next(ln for ln in text.splitlines() if ln.startswith("lmserve:lora_requests_info{"))
    assert 'max_lora="1"' in line and "running_lora_adapters=" in line and "waiting_lora_adapters=" in line


@pytest.mark.parametrize("flags, words", [
    (["--lora-modules", "x=/nonexistent/adapter"], ["--lora-modules x", "adapter_config.json"]),
    (["--lora-modules", "x"], ["name=path"]),
    (["--max-loras", "4", "--max-cpu-loras", "2"], ["--max-cpu-loras"]),
    (["--allow-runtime-lora-updating"], ["--lora-dir"]),
])
def test_serve_refuses_bad_lora_flags_in_one_line(flags, words):
    from tests.test_cli_errors import assert_one_line_error, lmserve

    assert_one_line_error(lmserve("serve", "--enable-lora", *flags), *words)


def test_serve_refuses_an_adapter_above_max_lora_rank(lora_server):
    from tests.test_cli_errors import assert_one_line_error, lmserve

    loras = lora_server.root / "loras"
    p = lmserve("serve", "--model", str(lora_server.root / "tiny-llama"), "--enable-lora", "--lora-modules",
                f"big={loras / 'big'}", "--max-lora-rank", "8")
    assert_one_line_error(p, "--lora-modules big", "rank 16")


# -- tenants: what a second key can do to, or learn of, another key's adapters ------------------------------

TENANT_KEYS = {"team-a": "sk-lora-team-a-0123456789", "team-b": "sk-lora-team-b-0123456789",
               "team-c": "sk-lora-team-c-0123456789", "ops": "sk-lora-ops-0123456789"}
BASE = "tiny-llama"


@pytest.fixture(scope="module")
def tenants(tmp_path_factory):
    """A tiny Llama with runtime LoRA updating, a response cache and four keys: team-a and team-c may use any
    model, team-b only the base, `ada` and `b/*` (the issue's restricted key), ops is an admin. The operator's
    adapter `op` comes from --lora-modules. Under --lora-dir: adapters x and y (different weights), a rank-16
    one, and two whose weight file or config is a symlink out of the directory."""
    from lmserve.loader import read_model_config
    from tests.lora_adapters import write_random_adapter

    root = tmp_path_factory.mktemp("lora_tenants")
    model = tiny_llama_checkpoint(root)
    cfg = read_model_config(model)
    loras, outside = root / "loras", root / "outside"
    for name, seed, rank in (("x", 1, 8), ("y", 2, 8), ("op", 3, 8), ("big", 4, 16)):
        write_random_adapter(loras / name, cfg, rank=rank, target_modules=("q_proj", "v_proj", "down_proj"), seed=seed)
    write_random_adapter(outside / "w", cfg, rank=8, seed=5)
    (outside / "secret.json").write_text('{"peft_type": "SECRET-FROM-OUTSIDE", "r": 8, "lora_alpha": 16}')
    for name, filename, target in (("evil-weights", "adapter_model.safetensors", outside / "w" / "adapter_model.safetensors"),
                                   ("evil-config", "adapter_config.json", outside / "secret.json")):
        write_random_adapter(loras / name, cfg, rank=8, seed=6)
        (loras / name / filename).unlink()
        (loras / name / filename).symlink_to(target)
    keys = root / "keys.yaml"
    keys.write_text(f"""keys:
  - {{name: team-a, key: {TENANT_KEYS["team-a"]}}}
  - {{name: team-b, key: {TENANT_KEYS["team-b"]}, models: [{BASE}, ada, "b/*"]}}
  - {{name: team-c, key: {TENANT_KEYS["team-c"]}}}
  - {{name: ops, key: {TENANT_KEYS["ops"]}, role: admin}}
""")
    with running_server("--model", str(model), "--api-key-file", str(keys), "--enable-lora",
                        "--lora-modules", f"op={loras / 'op'}", "--max-loras", "2", "--max-cpu-loras", "4",
                        "--max-lora-rank", "8", "--allow-runtime-lora-updating", "--lora-dir", str(loras),
                        "--response-cache", f"sqlite:{root / 'responses.sqlite'}", "--num-kv-blocks", "64",
                        headers={"Authorization": f"Bearer {TENANT_KEYS['ops']}"}) as s:
        s.root, s.loras = root, loras
        yield s


def _as(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=TENANT_KEYS[key], max_retries=0, timeout=60)


def _load_as(server, key: str, name: str, adapter: str) -> dict:
    return _as(server, key).post("/load_lora_adapter", cast_to=object,
                                 body={"lora_name": name, "lora_path": str(server.loras / adapter)})


def _unload_as(server, key: str, name: str) -> dict:
    return _as(server, key).post("/unload_lora_adapter", cast_to=object, body={"lora_name": name})


def _text_as(server, key: str, model: str, cache: bool = False):
    """A greedy completion's raw response (`"cache": false` unless asked: only the cache test wants it)."""
    return _as(server, key).completions.with_raw_response.create(
        model=model, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={} if cache else {"cache": False})


def _text(raw) -> str:
    return raw.parse().choices[0].text


def test_a_key_cannot_unload_or_replace_another_keys_adapter(tenants):
    """The issue's first finding: B unloaded A's `prod` (A then got 404) and replaced it with its own weights."""
    assert _load_as(tenants, "team-a", "prod", "x")["id"] == "prod"
    before = _text(_text_as(tenants, "team-a", "prod"))
    with pytest.raises(openai.PermissionDeniedError, match="belongs to another key"):  # C may see it, not manage it
        _unload_as(tenants, "team-c", "prod")
    with pytest.raises(openai.ConflictError, match="already loaded"):
        _load_as(tenants, "team-c", "prod", "y")
    with pytest.raises(openai.NotFoundError):  # B's models do not cover prod: it cannot even see it
        _unload_as(tenants, "team-b", "prod")
    with pytest.raises(openai.PermissionDeniedError, match="may not use the name"):
        _load_as(tenants, "team-b", "prod", "y")
    assert _text(_text_as(tenants, "team-a", "prod")) == before  # A's adapter, A's weights
    with pytest.raises(openai.PermissionDeniedError, match="operator"):  # --lora-modules adapters: admin only
        _unload_as(tenants, "team-a", "op")
    assert _unload_as(tenants, "ops", "prod")["deleted"] is True  # an admin manages every key's adapters
    with pytest.raises(openai.NotFoundError):
        _text_as(tenants, "team-a", "prod")
    assert _load_as(tenants, "team-c", "prod", "y")["id"] == "prod"  # the name is free again: now C's
    with pytest.raises(openai.PermissionDeniedError):
        _unload_as(tenants, "team-a", "prod")
    assert _unload_as(tenants, "team-c", "prod")["deleted"] is True
    tenants.wait_idle()


def test_a_replaced_adapter_never_answers_from_the_response_cache(tenants):
    """The issue's second finding: after `prod` was replaced, A's cached greedy request answered the old text."""
    _load_as(tenants, "team-a", "ry", "y")
    y_text = _text(_text_as(tenants, "team-a", "ry"))  # what y's weights answer (not cached)
    _load_as(tenants, "team-a", "rc", "x")
    first, again = _text_as(tenants, "team-a", "rc", cache=True), _text_as(tenants, "team-a", "rc", cache=True)
    assert (first.headers["x-lmserve-cache"], again.headers["x-lmserve-cache"]) == ("miss", "hit")
    x_text = _text(first)
    assert x_text != y_text, "x and y should answer differently for this test to mean anything"
    _unload_as(tenants, "team-a", "rc")
    _load_as(tenants, "team-a", "rc", "y")  # the same name, other weights
    replaced = _text_as(tenants, "team-a", "rc", cache=True)
    assert replaced.headers["x-lmserve-cache"] == "miss" and _text(replaced) == y_text
    _unload_as(tenants, "team-a", "rc")
    _load_as(tenants, "team-a", "rc", "x")  # x's bytes again: the entry x answered is x's, so it may answer
    back = _text_as(tenants, "team-a", "rc", cache=True)
    assert back.headers["x-lmserve-cache"] == "hit" and _text(back) == x_text
    for name in ("rc", "ry"):
        _unload_as(tenants, "team-a", name)
    tenants.wait_idle()


def test_a_keys_models_list_covers_adapters(tenants):
    """The issue's third finding: B, restricted to the base and `ada`, got 200 for `"model": "prod"`."""
    _load_as(tenants, "team-a", "prod", "x")
    _load_as(tenants, "team-a", "ada", "y")
    b = _as(tenants, "team-b")
    with pytest.raises(openai.NotFoundError) as e:
        b.completions.create(model="prod", prompt=PROMPT, max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and "do not have access" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError) as missing:  # a name that exists is no different from one that does not
        b.completions.create(model="prue", prompt=PROMPT, max_tokens=2)
    assert missing.value.body == {**e.value.body, "message": e.value.body["message"].replace("prod", "prue")}
    tgi = httpx.post(tenants.url + "/generate", headers={"Authorization": f"Bearer {TENANT_KEYS['team-b']}"},
                     json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2, "adapter_id": "prod"}}, timeout=30)
    assert tgi.status_code == 404 and tgi.json()["error_type"] == "not_found"
    assert {m.id for m in b.models.list().data} == {BASE, "ada"}  # not prod, not the operator's op
    assert {"prod", "ada", "op", BASE} <= {m.id for m in _as(tenants, "team-a").models.list().data}
    assert _text(_text_as(tenants, "team-b", "ada"))  # named in its models: allowed
    assert _load_as(tenants, "team-b", "b/mine", "y")["id"] == "b/mine"  # a pattern (`b/*`) covers loads too
    assert "b/mine" in {m.id for m in b.models.list().data}
    for key, name in (("team-a", "prod"), ("team-a", "ada"), ("team-b", "b/mine")):
        _unload_as(tenants, key, name)
    tenants.wait_idle()


def test_adapter_files_are_confined_to_lora_dir_and_never_echoed(tenants):
    """The issue's sixth finding: a weight file symlinked out of --lora-dir loaded, a symlinked config had its
    values echoed in the 400, and errors carried absolute server paths."""
    root = str(tenants.root)
    cases = [("evil-weights", "evil-weights: adapter_model.safetensors leads outside --lora-dir"),
             ("evil-config", "evil-config: adapter_config.json leads outside --lora-dir"),
             ("big", "adapter big: rank 16 of "), ("missing", "adapter missing: not a directory")]
    for adapter, words in cases:
        with pytest.raises(openai.BadRequestError) as e:
            _load_as(tenants, "team-a", "z", adapter)
        message = e.value.body["message"]
        assert words in message and e.value.body["param"] == "lora_path", message
        assert root not in message and "SECRET" not in message
    with pytest.raises(openai.NotFoundError):  # nothing was registered
        _text_as(tenants, "team-a", "z")
