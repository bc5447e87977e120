"""A newcomer's ordinary mistakes: one clear line on stderr, exit 2, no traceback, and no server started.

Each case runs the real `lmserve` command. The checks run before any weights load (and before uvicorn
starts), so these processes take about as long as the imports. Also here: Hub ids served offline from a
hub-cache layout, the KV pool and context checks, and --default-max-tokens / --max-tokens-limit.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import httpx
import pytest
import torch

from lmserve.server.api.params import chat_params
from lmserve.server.config import TokenLimits
from lmserve.server.errors import APIError
from lmserve.server.protocol import ChatRequest
from tests import bad_files as bf
from tests.conftest import write_tiny_llama
from tests.server_util import free_port, running_server

SRC = str(Path(__file__).resolve().parents[1] / "src")
COMMIT = "0123456789abcdef0123456789abcdef01234567"  # the snapshot's (made-up) commit hash
STARTED = "Application startup complete"


def lmserve(*args: str, env: dict | None = None, stdin: str = "") -> subprocess.CompletedProcess:
    """Run `python -m lmserve.cli ARGS` offline (the Hub is never reached from a test)."""
    env = {**os.environ, "PYTHONPATH": SRC, "HF_HUB_OFFLINE": "1", **(env or {})}
    if args and args[0] == "serve" and "--port" not in args:
        # serve binds its port before it checks the other flags (server/start.py): a free one, so that two refused
        # starts in neighbouring test workers never meet on the default 8000 ("port in use" instead of the mistake)
        args = ("serve", "--port", str(free_port()), *args[1:])
    return subprocess.run([sys.executable, "-m", "lmserve.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env, input=stdin)


def lmserve_imports(*args: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, set[str]]:
    """`lmserve ARGS` with Python's import times on: (the run, its import lines taken out of stderr; the modules it
    imported)."""
    p = lmserve(*args, env={**(env or {}), "PYTHONPROFILEIMPORTTIME": "1"})
    times = [line for line in p.stderr.splitlines() if line.startswith("import time:")]
    p.stderr = "\n".join(line for line in p.stderr.splitlines() if not line.startswith("import time:"))
    return p, {line.rsplit("|", 1)[-1].strip() for line in times}


def assert_one_line_error(p: subprocess.CompletedProcess, *words: str) -> None:
    """Exit 2; stderr is one line, `lmserve: error: ...`, naming the problem; nothing started."""
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2, p.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("lmserve: error: "), p.stderr[-3000:]
    assert "Traceback" not in p.stderr and STARTED not in p.stderr + p.stdout
    for w in words:
        assert w in lines[0], lines[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    write_tiny_llama(path)  # a word-level tokenizer ("w1 w2 ..."), max_position_embeddings 512
    return path


@pytest.fixture(scope="module")
def hub_cache(tiny, tmp_path_factory) -> Path:
    """The tiny checkpoint as the Hugging Face cache holds `org/tiny` at main (snapshots + refs, no blobs)."""
    root = tmp_path_factory.mktemp("hf") / "hub"
    repo = root / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    (repo / "snapshots").mkdir()
    shutil.copytree(tiny, repo / "snapshots" / COMMIT)
    return root


def _junk(tmp_path: Path, name: str, text: str = "this is a note, not a model\n") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


SERVE_CASES = [
    ("not-a-model", lambda t: ["--model", _junk(t, "notes.txt")], ["notes.txt", "expected a .gguf file"]),
    ("text-renamed-gguf", lambda t: ["--model", _junk(t, "model.gguf")], ["model.gguf", "not a GGUF file"]),
    ("missing-path", lambda t: ["--model", str(t / "nowhere" / "m.gguf")], ["does not exist"]),
    ("port", lambda t: ["--port", "99999"], ["--port", "99999"]),
    ("max-model-len", lambda t: ["--max-model-len", "-5"], ["--max-model-len", "-5"]),
    ("max-num-seqs", lambda t: ["--max-num-seqs", "0"], ["--max-num-seqs must be >= 1"]),
    ("batched-tokens", lambda t: ["--max-num-batched-tokens", "0"], ["--max-num-batched-tokens"]),
    ("kv-zero", lambda t: ["--kv-cache-memory", "0"], ["--kv-cache-memory must be > 0"]),
    ("gpu-util", lambda t: ["--gpu-memory-utilization", "1.5"], ["--gpu-memory-utilization must be in (0, 1]"]),
    ("kv-no-block", lambda t: ["--kv-cache-memory", "1000"], ["not even one block", "--kv-cache-memory"]),
    ("default-over-limit", lambda t: ["--default-max-tokens", "50", "--max-tokens-limit", "10"],
     ["--default-max-tokens 50", "--max-tokens-limit 10"]),
    ("limit-zero", lambda t: ["--max-tokens-limit", "0"], ["--max-tokens-limit must be >= 1"]),
    ("image-bytes-zero", lambda t: ["--max-image-bytes", "0"], ["--max-image-bytes must be >= 1"]),
    ("media-domain-url", lambda t: ["--allowed-media-domains", "images.example,https://cdn.example/x"],
     ["--allowed-media-domains 'https://cdn.example/x'", "not URLs"]),
    ("media-domain-port", lambda t: ["--allowed-media-domains", "images.example:99999"],
     ["--allowed-media-domains 'images.example:99999'", "port '99999'"]),
    ("media-domain-v6-port", lambda t: ["--allowed-media-domains", "[2001:4860::8888]x"],
     ["--allowed-media-domains '[2001:4860::8888]x'", "[address]:port"]),
    ("hub-id-not-cached", lambda t: ["--model", "nobody/not-cached"],
     ["nobody/not-cached", "not in the local Hugging Face cache", "hf download"]),
]


# The mistakes found without torch (a flag's number, the model's path, its header file, the key file): `lmserve serve`
# refuses them before it imports torch (server/first_checks.py), with the line prepare() would give.
BEFORE_TORCH = {"not-a-model", "text-renamed-gguf", "missing-path", "max-model-len", "max-num-seqs", "batched-tokens",
                "kv-zero", "gpu-util", "hub-id-not-cached", "gguf-alignment-zero", "gguf-alignment-string",
                "gguf-alignment-three", "gguf-nested-arrays", "nested-config", "key-file-missing",
                "named-missing-path", "key-file-and-model"}
# and the HTTP side's flags, checked before the port is bound (server/listen.py check_serve_args)
BEFORE_LISTEN = {"port", "default-over-limit", "limit-zero", "image-bytes-zero", "media-domain-url", "media-domain-port",
                 "media-domain-v6-port"}


def refuse(name: str, args: list[str], words: list[str], env: dict | None = None) -> None:
    """`lmserve serve ARGS` is refused in one line naming `words`; without importing torch where `name` is one of
    BEFORE_TORCH or BEFORE_LISTEN, and after importing it otherwise (the lists are exact both ways)."""
    p, imported = lmserve_imports("serve", *args, env=env)
    assert_one_line_error(p, *words)
    assert ("torch" in imported) == (name not in BEFORE_TORCH | BEFORE_LISTEN), name


@pytest.mark.parametrize("name,make_args,words", SERVE_CASES, ids=[c[0] for c in SERVE_CASES])
def test_serve_refuses_an_ordinary_mistake_in_one_line(tmp_path, name, make_args, words):
    refuse(name, make_args(tmp_path), words, env={"HF_HUB_CACHE": str(tmp_path / "hub")})


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda():
    assert_one_line_error(lmserve("serve", "--device", "cuda"), "--device cuda", "CUDA is not available")


LOADING_COMMANDS = {"generate": ["generate", "hi"], "chat": ["chat"], "run-batch": ["run-batch", "-i", "{in}", "-o",
                    "{out}"], **{f"bench-{k}": ["bench", k] for k in ("latency", "throughput", "roofline", "startup")}}


@pytest.mark.parametrize("command", LOADING_COMMANDS.values(), ids=LOADING_COMMANDS)
def test_every_loading_command_refuses_a_file_that_is_not_a_model_before_torch(tmp_path, command):
    """The commands that load a model read its file before importing torch (cli.checked_engine, run-batch's own
    order, bench/cli.py `_checked`): a typo is one line at once."""
    (tmp_path / "in.jsonl").write_text('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "hi"}}\n')
    command = [c.format(**{"in": tmp_path / "in.jsonl", "out": tmp_path / "out.jsonl"}) for c in command]
    p, imported = lmserve_imports(*command, "--model", _junk(tmp_path, "model.gguf"))
    assert_one_line_error(p, "not a GGUF file")
    assert "torch" not in imported


@pytest.mark.parametrize("input_name,output_name,words", [("missing.jsonl", "out.jsonl", ["missing.jsonl", "does not exist"]),
                                                        ("in.jsonl", "in.jsonl", ["must not be the input file"])])
def test_run_batch_refuses_its_paths_before_torch(tmp_path, input_name, output_name, words):
    (tmp_path / "in.jsonl").write_text("")
    p, imported = lmserve_imports("run-batch", "-i", str(tmp_path / input_name), "-o", str(tmp_path / output_name))
    assert_one_line_error(p, *words)
    assert "torch" not in imported


def test_serve_refuses_a_directory_without_a_tokenizer(tiny, tmp_path):
    shutil.copytree(tiny, tmp_path / "untokenized")
    (tmp_path / "untokenized" / "tokenizer.json").unlink()
    assert_one_line_error(lmserve("serve", "--model", str(tmp_path / "untokenized")), "no tokenizer.json")


def test_max_model_len_above_the_context_is_capped_with_a_warning(tiny):
    p = lmserve("generate", "w1 w2", "--model", str(tiny), "--max-model-len", "100000", "--max-tokens", "2",
                "--num-threads", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "--max-model-len 100000 is more than the model's context of 512 tokens; using 512" in p.stderr


def test_kv_pool_smaller_than_one_request_is_refused_then_the_named_fix_works(tiny, tmp_path):
    """A 10M-token context does not fit the default KV budget: refused, naming the max_model_len that fits."""
    import psutil

    per_token = 2 * 3 * 2 * 16 * 4  # K and V, 3 layers, 2 KV heads, head_dim 16, float32
    if 0.15 * psutil.virtual_memory().available >= 10**7 * per_token:
        pytest.skip("this machine's default KV budget holds a 10M-token context")
    big = tmp_path / "big"
    shutil.copytree(tiny, big)
    cfg = json.loads((big / "config.json").read_text())
    (big / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 10**7}))
    p = lmserve("serve", "--model", str(big))
    assert_one_line_error(p, "fewer than one request of max_model_len 10000000", "lower --max-model-len to")
    fits = int(p.stderr.split("lower --max-model-len to ")[1].split()[0])
    assert 1024 < fits < 10**7
    p = lmserve("generate", "w1 w2", "--model", str(big), "--max-model-len", "1024", "--max-tokens", "2",
                "--num-threads", "2")  # well under `fits`, and a small pool for a shared test machine
    assert p.returncode == 0, p.stderr[-3000:]
    # Sizing the pool explicitly is the way to accept a small one: a warning, not an error.
    p = lmserve("generate", "w1 w2", "--model", str(tiny), "--num-kv-blocks", "4", "--max-tokens", "2",
                "--num-threads", "2")
    assert p.returncode == 0 and "holds 64 tokens, fewer than one request of max_model_len 512" in p.stderr


def test_serve_a_hub_id_from_the_offline_cache(hub_cache):
    env = {"HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"}
    with running_server("--model", "org/tiny", "--max-tokens-limit", "5", "--default-max-tokens", "3",
                        env=env) as s:
        assert httpx.get(s.url + "/v1/models").json()["data"][0]["id"] == "org/tiny"  # the id, as vLLM
        body = {"model": "org/tiny", "prompt": "w1 w2 w3", "ignore_eos": True, "temperature": 0}
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3  # --default-max-tokens
        r = httpx.post(s.url + "/v1/completions", json={**body, "max_tokens": 5}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        r = httpx.post(s.url + "/v1/completions", json={**body, "max_tokens": 6}, timeout=60)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "max_tokens" and "at most 5" in err["message"]
        r = httpx.post(s.url + "/generate", json={"inputs": "w1 w2", "parameters": {"details": True}}, timeout=60)
        assert r.status_code == 200 and r.json()["details"]["generated_tokens"] <= 3
        r = httpx.post(s.url + "/generate", json={"inputs": "w1", "parameters": {"max_new_tokens": 6}}, timeout=60)
        assert r.status_code == 422 and "max_new_tokens must be at most 5" in r.json()["error"]  # TGI's status


def test_hub_revision(hub_cache):
    env = {"HF_HUB_CACHE": str(hub_cache)}
    p = lmserve("generate", "w1 w2", "--model", "org/tiny", "--revision", COMMIT, "--max-tokens", "2",
                "--num-threads", "2", env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert_one_line_error(lmserve("generate", "w1", "--model", "org/tiny", "--revision", "v9", env=env),
                          "org/tiny", "not in the local Hugging Face cache")


def test_token_limits_resolve_as_documented():
    none, both = TokenLimits(), TokenLimits(default=100, limit=500)
    assert none.resolve(None, 16, "max_tokens") == 16 and none.resolve(None, None, "max_tokens") is None
    assert both.resolve(None, 16, "max_tokens") == 100 and both.resolve(700 - 300, None, "max_tokens") == 400
    assert TokenLimits(limit=500).resolve(None, None, "max_tokens") == 500  # chat's "rest of the context", held
    assert TokenLimits(limit=8).resolve(None, 16, "max_tokens") == 8
    with pytest.raises(APIError, match="max_completion_tokens must be at most 500"):
        chat_params(ChatRequest(model="m", messages=[{"role": "user", "content": "x"}], max_completion_tokens=501),
                    both)
    chat = ChatRequest(model="m", messages=[{"role": "user", "content": "x"}])
    assert chat_params(chat).max_tokens is None and chat_params(chat, both).max_tokens == 100


# -- the malformed files of issue 47's probe (finding 8): each was a traceback; tests/test_file_fuzz.py fuzzes more

def _bad_gguf(key: str, value: tuple) -> Callable[[Path, Path], list[str]]:
    return lambda t, tiny: ["--model", str(bf.write_tiny_gguf(t / "bad.gguf", lambda m: m.update({key: value})))]


def _nested_in(filename: str) -> Callable[[Path, Path], list[str]]:
    def make(t: Path, tiny: Path) -> list[str]:
        shutil.copytree(tiny, t / "model")
        bf.with_nested_field(t / "model" / filename)
        return ["--model", str(t / "model")]
    return make


def _nested_adapter(t: Path, tiny: Path) -> list[str]:
    from lmserve.loader import read_model_config
    from tests.lora_adapters import write_random_adapter

    adapter = write_random_adapter(t / "adapter", read_model_config(tiny), rank=4, target_modules=("q_proj",))
    bf.with_nested_field(adapter / "adapter_config.json")
    return ["--model", str(tiny), "--enable-lora", "--lora-modules", f"a={adapter}"]


MALFORMED = [
    ("gguf-alignment-zero", _bad_gguf("general.alignment", (bf.U32, 0)), ["bad.gguf", "general.alignment"]),
    ("gguf-alignment-string", _bad_gguf("general.alignment", (bf.STR, "32")), ["bad.gguf", "general.alignment"]),
    ("gguf-alignment-three", _bad_gguf("general.alignment", (bf.U32, 3)), ["bad.gguf", "power of two"]),
    ("gguf-head-count-zero", _bad_gguf("llama.attention.head_count", (bf.U32, 0)),
     ["bad.gguf", "llama.attention.head_count", "got 0"]),
    ("gguf-nested-arrays", _bad_gguf("deep", bf.nested_gguf_array(bf.ISSUE_NESTING)), ["bad.gguf", "'deep'", "nested"]),
    ("nested-config", _nested_in("config.json"), ["config.json", "nested more than 64 levels"]),
    ("nested-tokenizer", _nested_in("tokenizer.json"), ["tokenizer.json", "nested more than 64 levels"]),
    ("nested-adapter-config", _nested_adapter, ["--lora-modules a", "adapter_config.json", "nested more than 64"]),
]


@pytest.mark.parametrize("name,make_args,words", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_serve_refuses_the_probes_malformed_files_in_one_line(tiny, tmp_path, name, make_args, words):
    refuse(name, make_args(tmp_path, tiny), words)


# mistakes outside the tables above that are refused before torch, each with its args and words
KEY_AND_MODEL = {
    "key-file-missing": (lambda t: ["--api-key-file", str(t / "keys.yaml")], ["--api-key-file", "keys.yaml"]),
    "named-missing-path": (lambda t: ["--model", f"x={t / 'nowhere' / 'm.gguf'}"], ["m.gguf", "does not exist"]),
    # two mistakes: the key file is read first (prepare's order), so it is the one named
    "key-file-and-model": (lambda t: ["--api-key-file", str(t / "keys.yaml"), "--model", str(t / "nowhere.gguf")],
                           ["--api-key-file", "keys.yaml"]),
}


@pytest.mark.parametrize("name", KEY_AND_MODEL)
def test_a_bad_key_file_or_named_model_is_refused_before_torch(tmp_path, name):
    make_args, words = KEY_AND_MODEL[name]
    refuse(name, make_args(tmp_path), words)


EARLY = [c for c in SERVE_CASES if c[0] in BEFORE_TORCH and c[0] != "hub-id-not-cached"]  # (the Hub's env is the
# process's: its cache path is read when huggingface_hub is imported)
EARLY += [(n, lambda t, m=m: m(t, t / "tiny"), w) for n, m, w in MALFORMED if n in BEFORE_TORCH]
EARLY += [(n, m, w) for n, (m, w) in KEY_AND_MODEL.items()]


@pytest.mark.parametrize("name,make_args,words", EARLY, ids=[c[0] for c in EARLY])
def test_the_first_checks_refuse_as_prepare_does(tiny, tmp_path, name, make_args, words):
    """What first_checks refuses (the checks `serve` runs before importing torch), prepare() refuses with the same
    words when it runs every check itself: nothing it checks comes before them."""
    from lmserve.cli import parse_args
    from lmserve.errors import CheckpointError, ConfigError
    from lmserve.server.first_checks import first_checks
    from lmserve.server.main import prepare

    shutil.copytree(tiny, tmp_path / "tiny")
    args = parse_args(["serve", *make_args(tmp_path)])
    with pytest.raises((ConfigError, CheckpointError)) as early:
        first_checks(args)
    with pytest.raises((ConfigError, CheckpointError)) as full:
        prepare(args)
    assert str(early.value) == str(full.value) and all(w in str(early.value) for w in words)


def test_the_first_checks_pass_what_only_torch_refuses(tiny):
    """A pool too small for one request (known from the header's sizes, checked after torch) passes the first
    checks and prepare() refuses it."""
    from lmserve.cli import parse_args
    from lmserve.errors import ConfigError
    from lmserve.server.first_checks import first_checks
    from lmserve.server.main import prepare

    args = parse_args(["serve", "--model", str(tiny), "--kv-cache-memory", "1000"])
    first = first_checks(args)
    assert [name for name, _ in first.models] == ["tiny"]
    with pytest.raises(ConfigError, match="not even one block"):
        prepare(args, first)


def test_a_key_file_that_is_a_pipe_is_read_once_and_its_key_required(tiny, tmp_path):
    """`--api-key-file <(...)` is a pipe: read twice (the first checks, then prepare), the second read found it
    empty and the server ran with an open API. A FIFO written once stands in for it."""
    import threading

    fifo = tmp_path / "keys"
    os.mkfifo(fifo)

    def write_once() -> None:
        with open(fifo, "w") as f:  # blocks until the server opens it for reading
            f.write("sk-fifo-secret\n")

    threading.Thread(target=write_once, daemon=True).start()
    with running_server("--model", str(tiny), "--api-key-file", str(fifo), start_timeout=180) as s:
        assert httpx.get(s.url + "/v1/models", timeout=30).status_code == 401
        ok = httpx.get(s.url + "/v1/models", headers={"Authorization": "Bearer sk-fifo-secret"}, timeout=30)
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "tiny", ok.text
