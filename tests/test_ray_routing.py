"""The Ray Serve application's parts that need no cluster: routing keys, rendezvous ranking, the ASGI
bridge, the application's arguments and the Serve config file in deploy/."""

from __future__ import annotations

import asyncio
import json
import shlex
from pathlib import Path

import pytest
import yaml

from lmserve.deploy.forward import ForwardedRequest, ResponseStart, routing_key, run_asgi
from lmserve.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"


def key(path: str, body: dict | bytes, chars: int = 32) -> str | None:
    return routing_key(path, body if isinstance(body, bytes) else json.dumps(body).encode(), chars)


def test_prompts_sharing_their_first_characters_share_a_key():
    system = "s" * 40
    a = key("/v1/completions", {"prompt": system + "first question"})
    assert a == key("/v1/completions", {"prompt": system + "another one"})
    assert a != key("/v1/completions", {"prompt": "t" + system})
    chat = [{"role": "system", "content": system}, {"role": "user", "content": "q1"}]
    assert key("/v1/chat/completions", {"messages": chat}) == key(
        "/v1/chat/completions", {"messages": chat[:1] + [{"role": "user", "content": "q2"}]})
    assert key("/v1/chat/completions", {"messages": [{"role": "user", "content": system}]}) != key(
        "/v1/chat/completions", {"messages": [{"role": "system", "content": system}]})  # roles count
    parts = [{"role": "user", "content": [{"type": "text", "text": system}]}]
    assert key("/v1/chat/completions", {"messages": parts}) == key(
        "/v1/chat/completions", {"messages": [{"role": "user", "content": system}]})
    assert key("/generate", {"inputs": system}) == key("/v1/completions", {"prompt": system})  # TGI too
    assert key("/v1/completions", {"prompt": [1, 2, 3]}) == key("/v1/completions", {"prompt": [1, 2, 3]})


def test_keys_of_other_routes():
    assert key("/v1/models", b"") is None and key("/health", b"") is None
    assert key("/v1/completions", b"{not json") is None  # the replica's app answers it with its 400
    assert key("/v1/completions", {"prompt": 5}) is None and key("/v1/chat/completions", {"messages": "x"}) is None
    # state on one replica's disk: every batch call shares one key, so one replica holds a job and its files
    assert key("/v1/files", b"...") == key("/v1/batches/batch_1", b"") == "batch-api"
    assert key("/v1/filesystem", b"") is None


def test_rendezvous_rank_is_stable_and_moves_only_the_keys_of_a_lost_replica():
    router = pytest.importorskip("lmserve.deploy.router")
    replicas = ["a1", "b2", "c3"]
    keys = [f"k{i}" for i in range(300)]
    first = {k: router.rendezvous_rank(k, replicas)[0] for k in keys}
    assert first == {k: router.rendezvous_rank(k, list(reversed(replicas)))[0] for k in keys}  # order-free
    counts = {r: list(first.values()).count(r) for r in replicas}
    assert min(counts.values()) > 60, counts  # ~100 each
    after = {k: router.rendezvous_rank(k, ["a1", "c3"])[0] for k in keys}
    moved = {k for k in keys if after[k] != first[k]}
    assert moved == {k for k in keys if first[k] == "b2"}  # only b2's keys moved
    assert sorted(router.rendezvous_rank("k", replicas)) == sorted(replicas)


def _drive(app, req: ForwardedRequest, take: int | None = None) -> list:
    async def go():
        items, gen = [], run_asgi(app, req, ((b"x-extra", b"1"),))
        async for item in gen:
            items.append(item)
            if take is not None and len(items) == take:
                await gen.aclose()
                break
        await asyncio.sleep(0.05)
        return items

    return asyncio.run(go())


def test_run_asgi_streams_and_tells_the_app_when_its_caller_left():
    seen: list[str] = []

    async def app(scope, receive, send):
        body = (await receive())["body"]
        await send({"type": "http.response.start", "status": 201, "headers": [(b"a", b"1"), (b"a", b"2")]})
        for i in range(3):
            await send({"type": "http.response.body", "body": body + str(i).encode(), "more_body": True})
        seen.append((await receive())["type"])  # waits for the caller to go
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    req = ForwardedRequest("POST", "/x", b"", ((b"h", b"v"),), b"hi")
    items = _drive(app, req, take=3)
    assert items == [ResponseStart(201, ((b"a", b"1"), (b"a", b"2"), (b"x-extra", b"1"))), b"hi0", b"hi1"]
    assert seen == ["http.disconnect"]


def test_run_asgi_turns_an_app_crash_into_a_500():
    async def app(scope, receive, send):
        raise KeyError("bug")

    items = _drive(app, ForwardedRequest("GET", "/x", b"", (), b""))
    assert items[0].status == 500 and json.loads(items[1])["error"]["type"] == "internal_error"


def test_app_arguments_are_typed_and_checked():
    rs = pytest.importorskip("lmserve.deploy.ray_serve")
    a = rs.RayServeArgs.from_args({"num_replicas": "2", "num_threads": "3", "target_ongoing_requests": "4"})
    assert (a.num_replicas, a.num_threads, a.target_ongoing_requests) == (2, 3, 4.0)
    assert rs.RayServeArgs.from_args({"num_replicas": "auto"}).num_replicas is None
    assert a.serve_argv()[:3] == ["serve", "--num-threads", "3"]
    with pytest.raises(ConfigError, match="unknown argument.*replicas"):
        rs.RayServeArgs.from_args({"replicas": 2})
    with pytest.raises(ConfigError, match="num_threads='two' is not an int"):
        rs.RayServeArgs.from_args({"num_threads": "two"})
    with pytest.raises(ConfigError, match="bad lmserve serve flags"):
        rs.app({"serve_args": "--kv-cache-memory lots"})
    with pytest.raises(ConfigError, match="--port"):
        rs.app({"serve_args": "--port 0"})
    fixed = rs.engine_options(a)
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"]["num_cpus"] == 3
    assert fixed["request_router_config"].request_router_class is not None
    auto = rs.engine_options(rs.RayServeArgs())
    assert auto["autoscaling_config"]["target_ongoing_requests"] == 8.0 and "num_replicas" not in auto


def test_serve_config_file_is_valid_and_builds():
    rs = pytest.importorskip("lmserve.deploy.ray_serve")
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load((DEPLOY / "ray-serve.yaml").read_text())
    ServeDeploySchema.model_validate(config)  # Ray's own schema for `serve deploy`
    (application,) = config["applications"]
    assert application["import_path"] == "lmserve.deploy.ray_serve:app"
    assert rs.app(application["args"]) is not None  # the builder accepts every argument the file gives
    assert rs.RayServeArgs.from_args(application["args"]).num_replicas is None  # the file autoscales


def test_serve_config_file_requires_keys():
    """Issue 47: the example served on 0.0.0.0 with no key and --metrics-public. Serve's proxies still listen on
    every interface (each node's must be reachable), so the replicas require keys and keep /metrics closed."""
    rs = pytest.importorskip("lmserve.deploy.ray_serve")
    config = yaml.safe_load((DEPLOY / "ray-serve.yaml").read_text())
    (application,) = config["applications"]
    flags = rs.parse_serve_args(rs.RayServeArgs.from_args(application["args"]).serve_argv())
    assert flags.require_api_key and flags.api_key_file and not flags.metrics_public
    assert not flags.api_key  # no key written into the config file itself
    assert "LMSERVE_API_KEY" not in json.dumps(config)


def scaling_out_commands() -> list[list[str]]:
    """docs/deployment.md's `sh` commands under "Scaling out" (not run by test_readme: they need Ray, Docker, a
    cluster)."""
    from tests.test_readme import readme_blocks

    page = ROOT / "docs" / "deployment.md"
    blocks = [b for b in readme_blocks(page.read_text()) if b.lang == "sh"
              and b.section in ("Replicas on Ray Serve", "Prefill and decode on separate replicas (Ray Serve)",
                                "Kubernetes")]
    assert len(blocks) == 3
    return [shlex.split(line) for b in blocks for line in b.text.splitlines() if line.strip()]


def test_readme_scaling_out_commands_are_real():
    """`serve run` lines go through the very functions Ray's CLI uses for their `key=value` arguments; the files
    the other lines name exist."""
    pytest.importorskip("ray")
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve.scripts import convert_args_to_dict

    from lmserve.deploy import ray_serve

    commands = scaling_out_commands()
    runs = [c for c in commands if c[:2] == ["serve", "run"]]
    assert runs
    for c in runs:
        assert c[2] == "lmserve.deploy.ray_serve:app"
        call_user_app_builder_with_args_if_necessary(ray_serve.app, convert_args_to_dict(tuple(c[3:])))
    assert any("prefill_replicas=1" in c for c in runs)
    named = [w for c in commands for w in c[1:] if w.startswith(("deploy/", "Dockerfile"))]
    assert named and all((ROOT / w).exists() for w in named), named



def test_prefill_requests_are_cut_to_one_token():
    """P/D's prefill request (deploy/pd.py): the same prompt and options, one token, whole, one choice."""
    from lmserve.deploy.pd import prefill_body

    body = {"model": "m", "prompt": "long", "max_tokens": 300, "stream": True, "stream_options": {"include_usage": True},
            "n": 3, "best_of": 4, "min_tokens": 20, "temperature": 0, "logprobs": 2}
    assert json.loads(prefill_body("/v1/completions", json.dumps(body).encode())) == {
        "model": "m", "prompt": "long", "max_tokens": 1, "n": 1, "temperature": 0, "logprobs": 2}
    chat = {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 50, "stream": True}
    assert json.loads(prefill_body("/v1/chat/completions", json.dumps(chat).encode())) == {
        "messages": chat["messages"], "max_tokens": 1, "n": 1}
    tgi = {"inputs": "x", "parameters": {"max_new_tokens": 40, "best_of": 2, "temperature": 0.5}}
    assert json.loads(prefill_body("/generate", json.dumps(tgi).encode()))["parameters"] == {
        "max_new_tokens": 1, "temperature": 0.5}
    assert prefill_body("/v1/completions", b"{bad") is None and prefill_body("/v1/embeddings", b"{}") is None


def test_only_long_unpinned_generation_prompts_are_prefilled():
    from lmserve.deploy.pd import wants_prefill

    def req(prompt: str, path: str = "/v1/completions", replica: str | None = None) -> ForwardedRequest:
        return ForwardedRequest("POST", path, b"", (), json.dumps({"prompt": prompt}).encode(), replica=replica)

    assert wants_prefill(req("x" * 100), 100) and not wants_prefill(req("x" * 99), 100)
    assert not wants_prefill(req("x" * 100, replica="r1"), 100)  # an operator's pinned request goes where it says
    assert not wants_prefill(req("x" * 100, path="/v1/embeddings"), 100)


def test_pd_app_needs_a_shared_tier(tmp_path):
    rs = pytest.importorskip("lmserve.deploy.ray_serve")
    with pytest.raises(ConfigError, match="prefill_replicas needs a KV tier the replicas share: add --kv-shared"):
        rs.app({"prefill_replicas": "1"})
    args = rs.RayServeArgs.from_args({"prefill_replicas": "2", "pd_min_prompt_chars": "100", "pd_timeout_s": "9"})
    assert (args.prefill_replicas, args.pd_min_prompt_chars, args.pd_timeout_s) == (2, 100, 9.0)
    assert rs.app({"prefill_replicas": "1", "serve_args": f"--kv-shared {tmp_path}"}) is not None
