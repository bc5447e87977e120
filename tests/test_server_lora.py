"""LoRA through the real server: adapters by `model` (openai client) and `parameters.adapter_id` (TGI), /v1/models,
vLLM's load/unload routes (path confinement, bad adapters, more adapters than --max-cpu-loras), and metrics; and,
as the holder of a second key would probe them, adapters isolated between keys (ownership, `models`, the
response cache keyed by what answered, files confined to --lora-dir)."""

from __future__ import annotations

import time

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
    keys = root / "keys.yaml"  # an admin key: it may name adapters anything and load from all of --lora-dir
    keys.write_text(f"keys:\n  - {{name: operator, key: {KEY}, role: admin}}\n")
    with running_server("--model", str(model), "--api-key-file", str(keys), "--enable-lora",
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
    if "c" not in {m.id for m in client.models.list().data}:  # loaded by the test above when it ran first here
        assert _load(lora_server, "c", lora_server.root / "loras" / "c").status_code == 200
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
    (["--lora-dtype", "float8"], ["--lora-dtype"]),
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
               "team-c": "sk-lora-team-c-0123456789", "ops": "sk-lora-ops-0123456789",
               "plain": "sk-lora-plain-0123456789"}
BASE = "tiny-llama"


@pytest.fixture(scope="module")
def tenants(tmp_path_factory):
    """A tiny Llama with runtime LoRA updating, a response cache and five keys: team-a and team-c may use any
    model, team-b only the base, `team-a/ada` and `team-b/*` (the issue's restricted key), ops is an admin, and a
    plain key. team-a may load from its own subdirectory of --lora-dir and `shared/*`, team-c from `shared/*`,
    team-b and the plain key from their own (the default). The operator's adapter `op` comes from
    --lora-modules. Under --lora-dir: shared/x and shared/y (different weights), a rank-16 shared/big,
    team-b/sql, and in team-a's: two adapters whose weight file or config is a symlink out of --lora-dir, one
    whose weight file links to team-b's, and a symlink to team-b's directory."""
    from lmserve.loader import read_model_config
    from tests.lora_adapters import write_random_adapter

    root = tmp_path_factory.mktemp("lora_tenants")
    model = tiny_llama_checkpoint(root)
    cfg = read_model_config(model)
    loras, outside = root / "loras", root / "outside"
    for name, seed, rank in (("shared/x", 1, 8), ("shared/y", 2, 8), ("op", 3, 8), ("shared/big", 4, 16),
                             ("team-b/sql", 8, 8)):
        write_random_adapter(loras / name, cfg, rank=rank, target_modules=("q_proj", "v_proj", "down_proj"), seed=seed)
    write_random_adapter(outside / "w", cfg, rank=8, seed=5)
    (outside / "secret.json").write_text('{"peft_type": "SECRET-FROM-OUTSIDE", "r": 8, "lora_alpha": 16}')
    team_a = loras / "team-a"
    for name, filename, target in (("evil-weights", "adapter_model.safetensors", outside / "w" / "adapter_model.safetensors"),
                                   ("evil-config", "adapter_config.json", outside / "secret.json"),
                                   ("b-weights", "adapter_model.safetensors",
                                    loras / "team-b" / "sql" / "adapter_model.safetensors")):
        write_random_adapter(team_a / name, cfg, rank=8, seed=6)
        (team_a / name / filename).unlink()
        (team_a / name / filename).symlink_to(target)
    (team_a / "to-b").symlink_to(loras / "team-b" / "sql")
    keys = root / "keys.yaml"
    keys.write_text(f"""keys:
  - {{name: team-a, key: {TENANT_KEYS["team-a"]}, lora_dirs: [team-a, "shared/*"]}}
  - {{name: team-b, key: {TENANT_KEYS["team-b"]}, models: [{BASE}, team-a/ada, "team-b/*"]}}
  - {{name: team-c, key: {TENANT_KEYS["team-c"]}, lora_dirs: ["shared/*"]}}
  - {{name: ops, key: {TENANT_KEYS["ops"]}, role: admin}}
""")
    with running_server("--model", str(model), "--api-key-file", str(keys), "--api-key", TENANT_KEYS["plain"],
                        "--enable-lora", "--lora-modules", f"op={loras / 'op'}", "--max-loras", "2",
                        "--max-cpu-loras", "4", "--max-lora-rank", "8", "--allow-runtime-lora-updating",
                        "--lora-dir", str(loras), "--response-cache", f"sqlite:{root / 'responses.sqlite'}",
                        "--num-kv-blocks", "64", headers={"Authorization": f"Bearer {TENANT_KEYS['ops']}"}) as s:
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
    assert _load_as(tenants, "team-a", "team-a/prod", "shared/x")["id"] == "team-a/prod"
    before = _text(_text_as(tenants, "team-a", "team-a/prod"))
    with pytest.raises(openai.PermissionDeniedError, match="belongs to another key"):  # C may see it, not manage it
        _unload_as(tenants, "team-c", "team-a/prod")
    with pytest.raises(openai.PermissionDeniedError, match="only under its own name"):  # A's namespace
        _load_as(tenants, "team-c", "team-a/prod", "shared/y")
    with pytest.raises(openai.NotFoundError):  # B's models do not cover team-a/prod: it cannot even see it
        _unload_as(tenants, "team-b", "team-a/prod")
    assert _text(_text_as(tenants, "team-a", "team-a/prod")) == before  # A's adapter, A's weights
    with pytest.raises(openai.PermissionDeniedError, match="operator"):  # --lora-modules adapters: admin only
        _unload_as(tenants, "team-a", "op")
    assert _unload_as(tenants, "ops", "team-a/prod")["deleted"] is True  # an admin manages every key's adapters
    with pytest.raises(openai.NotFoundError):
        _text_as(tenants, "team-a", "team-a/prod")
    assert _load_as(tenants, "ops", "team-a/prod", "shared/y")["id"] == "team-a/prod"  # an admin names any
    with pytest.raises(openai.PermissionDeniedError):  # the admin's now, in A's namespace
        _unload_as(tenants, "team-a", "team-a/prod")
    assert _unload_as(tenants, "ops", "team-a/prod")["deleted"] is True
    tenants.wait_idle()


def test_a_replaced_adapter_never_answers_from_the_response_cache(tenants):
    """The issue's second finding: after `prod` was replaced, A's cached greedy request answered the old text."""
    _load_as(tenants, "team-a", "team-a/ry", "shared/y")
    y_text = _text(_text_as(tenants, "team-a", "team-a/ry"))  # what y's weights answer (not cached)
    _load_as(tenants, "team-a", "team-a/rc", "shared/x")
    first, again = _text_as(tenants, "team-a", "team-a/rc", cache=True), _text_as(tenants, "team-a", "team-a/rc",
                                                                                 cache=True)
    assert (first.headers["x-lmserve-cache"], again.headers["x-lmserve-cache"]) == ("miss", "hit")
    x_text = _text(first)
    assert x_text != y_text, "x and y should answer differently for this test to mean anything"
    _unload_as(tenants, "team-a", "team-a/rc")
    _load_as(tenants, "team-a", "team-a/rc", "shared/y")  # the same name, other weights
    replaced = _text_as(tenants, "team-a", "team-a/rc", cache=True)
    assert replaced.headers["x-lmserve-cache"] == "miss" and _text(replaced) == y_text
    _unload_as(tenants, "team-a", "team-a/rc")
    _load_as(tenants, "team-a", "team-a/rc", "shared/x")  # x's bytes again: the entry x answered is x's, so it may
    back = _text_as(tenants, "team-a", "team-a/rc", cache=True)
    assert back.headers["x-lmserve-cache"] == "hit" and _text(back) == x_text
    for name in ("team-a/rc", "team-a/ry"):
        _unload_as(tenants, "team-a", name)
    tenants.wait_idle()


def test_a_keys_models_list_covers_adapters(tenants):
    """The issue's third finding: B, restricted to the base and `ada`, got 200 for `"model": "prod"`."""
    _load_as(tenants, "team-a", "team-a/prod", "shared/x")
    _load_as(tenants, "team-a", "team-a/ada", "shared/y")
    b = _as(tenants, "team-b")
    with pytest.raises(openai.NotFoundError) as e:
        b.completions.create(model="team-a/prod", prompt=PROMPT, max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and "do not have access" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError) as missing:  # a name that exists is no different from one that does not
        b.completions.create(model="team-a/prue", prompt=PROMPT, max_tokens=2)
    assert missing.value.body == {**e.value.body, "message": e.value.body["message"].replace("prod", "prue")}
    tgi = httpx.post(tenants.url + "/generate", headers={"Authorization": f"Bearer {TENANT_KEYS['team-b']}"},
                     json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2, "adapter_id": "team-a/prod"}},
                     timeout=30)
    assert tgi.status_code == 404 and tgi.json()["error_type"] == "not_found"
    assert {m.id for m in b.models.list().data} == {BASE, "team-a/ada"}  # not team-a/prod, not the operator's op
    assert {"team-a/prod", "team-a/ada", "op", BASE} <= {m.id for m in _as(tenants, "team-a").models.list().data}
    assert _text(_text_as(tenants, "team-b", "team-a/ada"))  # named in its models: allowed
    assert _load_as(tenants, "team-b", "team-b/mine", "team-b/sql")["id"] == "team-b/mine"  # `team-b/*` covers it
    assert "team-b/mine" in {m.id for m in b.models.list().data}
    for key, name in (("team-a", "team-a/prod"), ("team-a", "team-a/ada"), ("team-b", "team-b/mine")):
        _unload_as(tenants, key, name)
    tenants.wait_idle()


def test_adapter_files_are_confined_to_lora_dir_and_never_echoed(tenants):
    """The issue's sixth finding: a weight file symlinked out of --lora-dir loaded, a symlinked config had its
    values echoed in the 400, and errors carried absolute server paths."""
    root = str(tenants.root)
    cases = [("team-a/evil-weights", "evil-weights: adapter_model.safetensors leads outside --lora-dir"),
             ("team-a/evil-config", "evil-config: adapter_config.json leads outside --lora-dir"),
             ("shared/big", "adapter big: rank 16 of "), ("team-a/missing", "adapter missing: not a directory")]
    for adapter, words in cases:
        with pytest.raises(openai.BadRequestError) as e:
            _load_as(tenants, "team-a", "team-a/z", adapter)
        message = e.value.body["message"]
        assert words in message and e.value.body["param"] == "lora_path", message
        assert root not in message and "SECRET" not in message
    with pytest.raises(openai.NotFoundError):  # nothing was registered
        _text_as(tenants, "team-a", "team-a/z")


# -- issue 47: adapter names and directories scoped to keys; adapters outlive their model's unload -------------


def test_a_key_registers_adapters_only_in_its_own_namespace(tenants):
    """Issue 47's fifth finding: team-a (models "*") registered `team-b/sql`, and team-b's requests for it then
    ran team-a's weights. Every non-admin key, a plain one included, names adapters `<its name>/...` only."""
    for name in ("team-b/sql", "sql", "team-a", "team-a/", "team-ab/sql", BASE + "/x"):
        with pytest.raises(openai.PermissionDeniedError, match="only under its own name") as e:
            _load_as(tenants, "team-a", name, "shared/x")
        assert e.value.body["code"] == "permission_denied" and e.value.body["param"] == "lora_name"
    with pytest.raises(openai.PermissionDeniedError, match=r"only under its own name, key-[0-9a-f]{8}/NAME"):
        _load_as(tenants, "plain", "team-b/sql", "shared/x")
    assert _load_as(tenants, "team-a", "team-a/sql", "shared/x")["id"] == "team-a/sql"
    assert _load_as(tenants, "team-b", "team-b/sql", "team-b/sql")["id"] == "team-b/sql"
    a_text, b_text = _text(_text_as(tenants, "team-a", "team-a/sql")), _text(_text_as(tenants, "team-b", "team-b/sql"))
    assert a_text != b_text  # team-b's name runs team-b's weights
    for key in ("team-a", "team-b"):
        _unload_as(tenants, key, f"{key}/sql")
    tenants.wait_idle()


def test_a_key_loads_only_from_its_own_lora_dirs(tenants):
    """Issue 47's fifth finding: any key loaded any directory under --lora-dir, another team's included. `..`, a
    symlink to team-b's directory and a weight file linked into it are refused as well."""
    for adapter in ("team-b/sql", "team-a/../team-b/sql", "team-a/to-b", "team-b", "team-b/not-there", "op"):
        with pytest.raises(openai.PermissionDeniedError) as e:
            _load_as(tenants, "team-a", "team-a/b", adapter)
        message = e.value.body["message"]
        assert "(team-a, shared/*: its key entry's lora_dirs)" in message, message
        assert e.value.body["param"] == "lora_path" and e.value.body["code"] == "permission_denied"
    with pytest.raises(openai.BadRequestError, match="b-weights: adapter_model.safetensors leads outside"):
        _load_as(tenants, "team-a", "team-a/b", "team-a/b-weights")  # inside --lora-dir, outside team-a's
    with pytest.raises(openai.BadRequestError, match="not inside a --lora-dir"):
        _load_as(tenants, "team-a", "team-a/b", "../outside/w")
    with pytest.raises(openai.PermissionDeniedError, match=r"\(team-b: its key entry"):  # the default: its own
        _load_as(tenants, "team-b", "team-b/x", "shared/x")
    with pytest.raises(openai.PermissionDeniedError, match=r"\(key-[0-9a-f]{8}: its key entry"):
        _load_as(tenants, "plain", _plain_name() + "/x", "shared/x")
    assert _load_as(tenants, "ops", "team-b/by-ops", "team-b/sql")["id"] == "team-b/by-ops"  # an admin: all
    with pytest.raises(openai.NotFoundError):  # nothing team-a tried was registered
        _text_as(tenants, "team-a", "team-a/b")
    _unload_as(tenants, "ops", "team-b/by-ops")
    tenants.wait_idle()


def _plain_name() -> str:
    from lmserve.server.key_file import plain_name

    return plain_name(TENANT_KEYS["plain"])


def test_adapters_outlive_an_unload_of_their_model_and_answer_after_the_reload(tenants):
    """Issue 47's first finding, second half: a `keep_alive: 0` unloaded the shared model and every key's runtime
    adapters went with it (team-a's next request for its adapter was a 404). Now they are registered again,
    with their owners, when the model loads."""
    import ollama

    _load_as(tenants, "team-a", "team-a/keep", "shared/x")
    _load_as(tenants, "team-b", "team-b/sql", "team-b/sql")
    asks = (("team-a", "team-a/keep"), ("team-b", "team-b/sql"), ("team-a", "op"))
    before = {name: _text(_text_as(tenants, key, name)) for key, name in asks}
    loads = tenants.metric("lmserve:model_loads_total", f'model_name="{BASE}"')
    ops = ollama.Client(host=tenants.url, timeout=60, headers={"Authorization": f"Bearer {TENANT_KEYS['ops']}"})
    assert ops.generate(model=BASE, keep_alive=0).done_reason == "unload"
    deadline = time.monotonic() + 60
    while ops.ps().models:
        assert time.monotonic() < deadline, "the model was never unloaded"
        time.sleep(0.1)
    # The first request after the unload names team-a's adapter: it loads the model, the adapters with it.
    assert {name: _text(_text_as(tenants, key, name)) for key, name in asks} == before
    assert tenants.metric("lmserve:model_loads_total", f'model_name="{BASE}"') == loads + 1
    with pytest.raises(openai.PermissionDeniedError, match="belongs to another key"):  # owners came back too
        _unload_as(tenants, "team-c", "team-a/keep")
    assert "team-b/sql" in {m.id for m in _as(tenants, "team-b").models.list().data}
    for key, name in asks[:2]:
        assert _unload_as(tenants, key, name)["deleted"] is True
    tenants.wait_idle()
