"""LoRA through the real server: adapters by `model` (openai client) and `parameters.adapter_id` (TGI), /v1/models,
vLLM's load/unload routes (path confinement, bad adapters, more adapters than --max-cpu-loras), and metrics."""

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
                        "--num-kv-blocks", "64", headers=AUTH) as s:
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
    assert _load(lora_server, "a", loras / "b").status_code == 400  # the name is taken
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
