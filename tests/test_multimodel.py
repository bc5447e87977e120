"""Several models in one server: routing by `model`, LRU unload and reload beyond --max-loaded-models, requests
waiting on a load, and weighted --route splits (sticky per user). Real servers, the official openai client."""

from __future__ import annotations

import concurrent.futures
import gc
import time
import weakref

import httpx
import openai
import pytest
from starlette.testclient import TestClient

from tests.conftest import write_tiny_llama
from tests.server_util import running_server

PROMPT = "w1 w2 w3"
# 100 requests split 90/10: the canary's count is Binomial(100, 0.1) (mean 10, sd 3); outside 1..22 has
# probability < 2e-4, so a failure means the split is wrong, not unlucky.
SPLIT_N, SPLIT_LOW, SPLIT_HIGH = 100, 1, 22


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("multimodel") / "tiny"
    write_tiny_llama(path)
    return path


@pytest.fixture(scope="module")
def two(smol_path, tiny):
    """The embedded model and a tiny random checkpoint, with a 90/10 route over them."""
    with running_server("--model", f"smol={smol_path}", "--model", f"tiny={tiny}",
                        "--route", "chat=smol:90,tiny:10") as s:
        yield s


@pytest.fixture(scope="module")
def one_at_a_time(tiny):
    """The tiny checkpoint under two names, at most one loaded."""
    with running_server("--model", f"a={tiny}", "--model", f"b={tiny}", "--max-loaded-models", "1") as s:
        yield s


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_each_model_answers_under_its_name(two):
    c = client(two)
    assert [m.id for m in c.models.list().data] == ["smol", "tiny", "chat"]
    chat = c.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Say hi"}], max_tokens=4,
                                     temperature=0)
    assert chat.model == "smol" and chat.choices[0].message.content
    done = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0)
    assert done.model == "tiny" and done.choices[0].text.startswith(" w")  # the tiny word-level vocabulary
    with pytest.raises(openai.NotFoundError, match="'smol', 'tiny', 'chat'"):
        c.completions.create(model="nope", prompt=PROMPT, max_tokens=1)
    assert two.metric("lmserve:model_requests_total", 'model_name="tiny"') >= 1


def _served(server, n: int, users: list[str | None]) -> list[str]:
    c = client(server)

    def one(user):
        return c.completions.create(model="chat", prompt="Hi", max_tokens=1, user=user).model

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, users[:n]))


def test_route_splits_by_weight_and_metrics_name_the_model_served(two):
    before = {m: two.metric("lmserve:model_requests_total", f'model_name="{m}"') for m in ("smol", "tiny")}
    served = _served(two, SPLIT_N, [None] * SPLIT_N)
    assert set(served) <= {"smol", "tiny"}
    assert SPLIT_LOW <= served.count("tiny") <= SPLIT_HIGH, served.count("tiny")
    for m in ("smol", "tiny"):  # the dashboard's split is the clients' split
        assert two.metric("lmserve:model_requests_total", f'model_name="{m}"') - before[m] == served.count(m)


def test_route_is_sticky_per_user(two):
    users = [f"user-{i}" for i in range(SPLIT_N)]
    first = _served(two, SPLIT_N, users)
    assert SPLIT_LOW <= first.count("tiny") <= SPLIT_HIGH  # users hash across the split by weight too
    again = _served(two, 20, users[:10] + users[:10])
    assert again == first[:10] + first[:10]  # a user always gets the same model


def test_lru_unload_and_reload_alternating(one_at_a_time):
    s, c = one_at_a_time, client(one_at_a_time)
    for name in ("a", "b", "a", "b"):  # a is loaded at start; each switch unloads the other
        assert c.completions.create(model=name, prompt=PROMPT, max_tokens=3).model == name
    m = lambda metric, name: s.metric(metric, f'model_name="{name}"')  # noqa: E731
    assert (m("lmserve:model_loads_total", "a"), m("lmserve:model_loads_total", "b")) == (2, 2)
    assert (m("lmserve:model_unloads_total", "a"), m("lmserve:model_unloads_total", "b")) == (2, 1)
    assert m("lmserve:model_load_duration_seconds_count", "b") == 2 and m("lmserve:model_loaded", "a") == 0
    loaded = {card["id"]: card["loaded"] for card in httpx.get(s.url + "/v1/models").json()["data"]}
    assert loaded == {"a": False, "b": True}
    assert httpx.get(s.url + "/v2/models/a/ready").status_code == 503
    assert httpx.get(s.url + "/v2/models/b/ready").status_code == 200
    # Not loaded is an expected answer (a probe of a model that loads on demand), not a server error.
    assert s.metric("lmserve:requests_total", 'status="5xx"') == 0
    assert s.metric("lmserve:requests_total", 'status="not_ready"') >= 1


def test_concurrent_requests_during_a_load_all_succeed(one_at_a_time):
    s, c = one_at_a_time, client(one_at_a_time)
    c.completions.create(model="b", prompt=PROMPT, max_tokens=1)  # b in, so a is out (also when run alone)
    loads = s.metric("lmserve:model_loads_total", 'model_name="a"')
    errors = s.metric("lmserve:requests_total", 'status="5xx"')
    names = ["a", "b"] * 6  # while one model loads, requests for both keep coming

    def one(name):
        if name == "a":
            return c.completions.create(model=name, prompt=PROMPT, max_tokens=4).model
        with c.completions.create(model=name, prompt=PROMPT, max_tokens=4, stream=True) as stream:
            return {chunk.model for chunk in stream}.pop()

    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        assert list(pool.map(one, names)) == names
    assert s.metric("lmserve:model_loads_total", 'model_name="a"') > loads
    assert s.metric("lmserve:requests_total", 'status="5xx"') == errors
    s.wait_idle()


def test_runtime_adapters_outlive_an_lru_eviction_of_their_model(tiny, tmp_path):
    """Issue 47: a model unloaded to make room for another took every key's runtime adapters with it (the next
    request for one was a 404). Now they load again with the model, each still its key's."""
    from lmserve.loader import read_model_config
    from tests.lora_adapters import write_random_adapter

    loras, keys = tmp_path / "loras", tmp_path / "keys.yaml"
    write_random_adapter(loras / "team-a" / "x", read_model_config(tiny), rank=8, seed=1,
                         target_modules=("q_proj", "v_proj", "down_proj"))
    keys.write_text("keys:\n" + "".join(f"  - {{name: {k}, key: sk-evict-{k}{role}}}\n" for k, role in
                                        (("team-a", ""), ("team-b", ""), ("ops", ", role: admin"))))
    with running_server("--model", f"a={tiny}", "--model", f"b={tiny}", "--max-loaded-models", "1",
                        "--enable-lora", "--max-lora-rank", "8", "--allow-runtime-lora-updating", "--lora-dir",
                        str(loras), "--api-key-file", str(keys), headers={"Authorization": "Bearer sk-evict-ops"}) as s:
        a, b = (openai.OpenAI(base_url=s.url + "/v1", api_key=f"sk-evict-{k}", max_retries=0, timeout=60)
                for k in ("team-a", "team-b"))
        text = lambda model: a.completions.create(model=model, prompt=PROMPT, max_tokens=6,  # noqa: E731
                                                  temperature=0).choices[0].text
        a.post("/load_lora_adapter", cast_to=object, body={"lora_name": "team-a/x",
                                                            "lora_path": str(loras / "team-a" / "x")})
        before = text("team-a/x")
        assert before != text("a"), "the adapter should change the greedy output"
        assert a.completions.create(model="b", prompt=PROMPT, max_tokens=1).model == "b"  # a is evicted
        assert s.metric("lmserve:model_unloads_total", 'model_name="a"') == 1
        cards = {m.id: m for m in a.models.list().data}  # listed while its model is out, as not loaded
        assert (cards["team-a/x"].parent, cards["team-a/x"].loaded) == ("a", False)
        assert text("team-a/x") == before  # loads a again, team-a's adapter with it
        assert s.metric("lmserve:model_loads_total", 'model_name="a"') == 2
        with pytest.raises(openai.PermissionDeniedError, match="another key"):  # and still team-a's
            b.post("/unload_lora_adapter", cast_to=object, body={"lora_name": "team-a/x"})


# -- in process: the load timeout, and an unloaded engine's memory ---------------------------------------------


@pytest.fixture(scope="module")
def pool_app(tiny):
    from lmserve.config import CacheConfig, EngineConfig
    from lmserve.preflight import check_engine_config
    from lmserve.server.app import build_app
    from lmserve.server.main import load_engine, unload_engine
    from lmserve.server.metrics import ServerMetrics
    from lmserve.server.models.pool import ModelPool, ModelSpec
    from lmserve.server.state import ServerConfig, ServerState

    config = check_engine_config(EngineConfig(model=str(tiny), num_threads=2, cache=CacheConfig(num_blocks=64))).config
    pool = ModelPool([ModelSpec("a", config), ModelSpec("b", config)], max_loaded=1, load_timeout=30)
    state = ServerState(ServerConfig("a"), ServerMetrics("a"), models=pool)
    pool.loader = lambda model: load_engine(state, model.spec, None)
    pool.unloader = lambda model, engine: unload_engine(state, model, engine)
    pool.get("a").async_engine = load_engine(state, pool.get("a").spec, None)
    state.started = True
    with TestClient(build_app(state)) as c:
        yield c, state
    for engine in pool.engines():
        engine.shutdown()


def _complete(c: TestClient, name: str):
    return c.post("/v1/completions", json={"model": name, "prompt": PROMPT, "max_tokens": 2})


def test_a_load_past_the_timeout_is_503_with_retry_after_then_serves(pool_app):
    c, state = pool_app
    state.models.load_timeout = 0.001  # far shorter than loading b (and unloading a) takes
    r = _complete(c, "b")
    assert r.status_code == 503 and r.headers["Retry-After"] == "5" and "still loading" in r.json()["error"]["message"]
    state.models.load_timeout = 30
    assert _complete(c, "b").json()["model"] == "b"  # the same load went on; this request waited for it


def test_an_unloaded_engine_is_freed(pool_app):
    c, state = pool_app
    assert _complete(c, "a").status_code == 200
    engine = weakref.ref(state.models.get("a").async_engine.engine)
    assert _complete(c, "b").status_code == 200  # unloads a
    deadline = time.time() + 10
    while engine() is not None and time.time() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert engine() is None, gc.get_referrers(engine())[:3]


# -- flags and the split itself (no server) ---------------------------------------------------------------------


def test_split_parsing_and_picks():
    import random

    from lmserve.server.models.traffic import parse_split

    split = parse_split("chat=stable:90,canary:10")
    assert split.targets == (("stable", 90), ("canary", 10)) and split.total == 100
    picks = [split.pick(f"user-{i}", random.Random(0)) for i in range(10_000)]
    assert 850 <= picks.count("canary") <= 1150  # Binomial(10000, 0.1): mean 1000, sd 30
    assert all(split.pick(f"user-{i}", random.Random(i)) == picks[i] for i in range(100))  # the user decides alone
    for bad in ("chat", "chat=a", "chat=a:0", "chat=a:x", "chat=a:1,a:2", "=a:1", "a/b=c:1"):
        with pytest.raises(ValueError):
            parse_split(bad)


@pytest.mark.parametrize("flags, says", [
    (["--model", "a={tiny}", "--model", "a={tiny}"], "given twice"),
    (["--model", "a={tiny}", "--model", "b={tiny}", "--served-model-name", "x"], "--served-model-name"),
    (["--model", "a={tiny}", "--route", "chat=a:90,zz:10"], "'zz' is not a served model"),
    (["--model", "a={tiny}", "--route", "a=a:1"], "already a model's"),
    (["--model", "a={tiny}", "--route", "chat=a"], "--route"),
    (["--model", "a={tiny}", "--max-loaded-models", "0"], "--max-loaded-models"),
    (["--model", "a=/no/such/model"], "/no/such/model"),
])
def test_bad_model_flags_are_one_line_errors(tiny, capsys, flags, says):
    from lmserve.cli import main
    from tests.server_util import free_port

    # a free port: serve binds it before these checks, and a neighbour's refused start may hold 8000 a moment
    assert main(["serve", "--port", str(free_port()), *[f.format(tiny=tiny) for f in flags]]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1, err
