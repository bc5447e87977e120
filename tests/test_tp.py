"""Tensor parallelism on CPU with gloo: each rank a real process, tiny random checkpoints written here.

The model-level tests run rank 0 in this process and ranks 1..N-1 in spawned ones, each loading only its
shard (safetensors slices; the GGUF sliced after dequantization), and compare rank 0's logits with the
unsharded model's. The server tests start `lmserve serve --tensor-parallel-size 2` for real.
"""

from __future__ import annotations

import ipaddress
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import torch
import torch.distributed as dist

from lmserve import LLM, SamplingParams
from lmserve.errors import ConfigError
from lmserve.layers.attention.context import ContiguousAttention
from lmserve.loader.sharding import TPShard, shard_bounds
from lmserve.worker.tp_worker import RankSpec, init_group
from lmserve.worker.transforms import load_formatted
from tests.conftest import save_tiny_hf, write_tiny_llama
from tests.server_util import free_port, running_server, unhealthy_within

PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [1, 2, 3]]


def _forward(rank: int, world: int, init_method: str, path: str) -> torch.Tensor:
    """This rank's load and forward over PROMPTS; rank 0's logits (the others return nothing useful)."""
    init_group(RankSpec(rank, world, init_method, 60.0, 1, os.getppid()), torch.device("cpu"))
    try:
        model = load_formatted(path, torch.float32, torch.device("cpu"), shard=TPShard(rank, world)).model
        ids = torch.tensor([t for p in PROMPTS for t in p])
        pos = torch.cat([torch.arange(len(p)) for p in PROMPTS])
        with torch.inference_mode():
            hidden = model(ids, pos, ContiguousAttention([len(p) for p in PROMPTS]))
            return model.compute_logits(hidden) if rank == 0 else torch.empty(0)
    finally:
        dist.destroy_process_group()


def _rank_main(rank: int, world: int, init_method: str, path: str) -> None:
    torch.set_num_threads(1)
    _forward(rank, world, init_method, path)
    # Done: leave without C++ static destructors. Once in a CI run the interpreter's teardown after gloo
    # aborted the spawned rank ("terminate called without an active exception"), exit code -6, after its
    # forward had completed; an error inside _forward still raises and exits non-zero.
    os._exit(0)


def tp_logits(path: Path, world: int) -> torch.Tensor:
    """Rank 0's logits with `world` ranks (ranks >= 1 in spawned processes)."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as store_dir:  # the rendezvous the executor uses: a file store, no socket
        init = f"file://{store_dir}/store"
        procs = [ctx.Process(target=_rank_main, args=(r, world, init, str(path)), daemon=True) for r in range(1, world)]
        for p in procs:
            p.start()
        try:
            logits = _forward(0, world, init, str(path))
        finally:
            for p in procs:
                p.join(60)
    assert all(p.exitcode == 0 for p in procs)
    return logits


def one_rank_logits(path: Path) -> torch.Tensor:
    """The whole model's logits over PROMPTS in this process: what rank 0 must give under tensor parallelism."""
    whole = load_formatted(path, torch.float32, torch.device("cpu")).model
    ids = torch.tensor([t for p in PROMPTS for t in p])
    pos = torch.cat([torch.arange(len(p)) for p in PROMPTS])
    with torch.inference_mode():
        return whole.compute_logits(whole(ids, pos, ContiguousAttention([len(p) for p in PROMPTS])))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tp2_logits_equal_tp1(tmp_path, kind):
    # llama: untied LM head, llama3 rope; qwen2: q/k/v biases, tied head; both GQA (4 heads, 2 KV heads)
    path, _ = save_tiny_hf(tmp_path, kind)
    ref = one_rank_logits(path)
    got = tp_logits(path, 2)
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() < 1e-5
    assert not torch.equal(ref, torch.zeros_like(ref))


@pytest.mark.slow
def test_embedded_gguf_tp3_logits_equal_tp1(smol_path):
    # SmolLM2-135M has 9 heads and 3 KV heads: TP=3 splits it (TP=2 is refused, below). Q4_1 tensors are
    # dequantized whole, Q/K un-permuted with the whole head count, then sliced per rank.
    ref = one_rank_logits(smol_path)
    got = tp_logits(smol_path, 3)
    # 30 layers of 576-wide sums in another order: measured 1.9e-4 on logits of magnitude ~20 (1e-5 relative)
    assert (got - ref).abs().max().item() < 2e-5 * ref.abs().max().item()
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def write_llama_hd64(path: Path) -> None:
    """A tiny random Llama with head_dim 64 (4 heads, 2 KV heads), so each rank's decode runs the native kernel."""
    import transformers

    write_tiny_llama(path)  # for its tokenizer.json; config and weights are replaced below
    for f in path.glob("*.safetensors"):
        f.unlink()
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=False, eos_token_id=2, bos_token_id=1)
    transformers.LlamaForCausalLM(cfg).float().save_pretrained(path, safe_serialization=True)


def test_offline_tp2_equals_tp1_through_the_engine_with_native_kernels(tmp_path):
    # The whole engine path on each rank: paged KV cache holding the rank's KV heads, native decode kernel
    # (head_dim 64), fused row-wise ops and skinny matmuls on the rank's shapes, chunked prefill (where the
    # native module cannot be built, the same test covers each rank's PyTorch fallback).
    path = tmp_path / "hd64"
    write_llama_hd64(path)
    prompts = [[5, 17, 42, 99, 3, 250, 7] * 5, [1, 2, 3]]
    params = SamplingParams(max_tokens=16, temperature=0, prompt_logprobs=0, ignore_eos=True)
    results = {}
    for tp in (1, 2):
        llm = LLM(str(path), tensor_parallel_size=tp, dtype="float32", num_blocks=32, num_threads=1,
                  max_num_batched_tokens=16)  # the long prompt runs in chunks
        try:
            results[tp] = llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.close()
    for one, two in zip(results[1], results[2]):
        assert one.outputs[0].token_ids == two.outputs[0].token_ids and len(one.outputs[0].token_ids) == 16
        lp1 = [t.logprob for t in one.prompt_logprobs[1:]]
        lp2 = [t.logprob for t in two.prompt_logprobs[1:]]
        assert max(abs(a - b) for a, b in zip(lp1, lp2)) < 1e-5


def test_shard_bounds_split_heads_and_keep_the_rest_whole():
    s = TPShard(1, 2)
    assert shard_bounds("model.layers.0.self_attn.q_proj.weight", (64, 64), s) == (0, 32, 32)
    assert shard_bounds("model.layers.0.self_attn.k_proj.bias", (32,), s) == (0, 16, 16)
    assert shard_bounds("model.layers.0.mlp.up_proj.weight", (112, 64), s) == (0, 56, 56)
    assert shard_bounds("model.layers.0.self_attn.o_proj.weight", (64, 64), s) == (1, 32, 32)
    assert shard_bounds("model.layers.0.mlp.down_proj.weight", (64, 112), s) == (1, 56, 56)
    for whole in ("model.layers.0.self_attn.o_proj.bias", "model.embed_tokens.weight", "lm_head.weight",
                  "model.norm.weight", "model.layers.0.input_layernorm.weight"):
        assert shard_bounds(whole, (64, 64), s) is None


def test_heads_not_divisible_are_refused(smol_path):
    with pytest.raises(ConfigError, match=r"attention heads \(9\) are not divisible by 2.*sizes that split it: 3"):
        LLM(str(smol_path), tensor_parallel_size=2)
    r = subprocess.run([sys.executable, "-m", "lmserve.cli", "serve", "--port", str(free_port()), "--tensor-parallel-size", "2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "not divisible by 2" in r.stderr and "Traceback" not in r.stderr


# -- through the server ------------------------------------------------------------------------------

TEXT_PROMPTS = ["w1 w2 w3 w4", "w10 w20", "w7 w7 w7 w8 w9 w100 w200"]
SERVE_ARGS = ["--dtype", "float32", "--num-kv-blocks", "64", "--num-threads", "1", "--tensor-parallel-size", "2"]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp") / "tiny-llama"  # 8 heads, 2 KV heads: TP=2 gives each rank 4 and 1
    write_tiny_llama(path)
    return path


def _network_interface() -> str | None:
    """An interface that is up with a non-loopback IPv4 address: where an attacker on the network would connect."""
    stats = psutil.net_if_stats()
    for name, addrs in psutil.net_if_addrs().items():
        if name in stats and stats[name].isup and any(
                a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback for a in addrs):
            return name
    return None


def _server_env(tmp: Path) -> dict[str, str]:
    """TMPDIR where the test sees the rank store's directory; GLOO_SOCKET_IFNAME naming a network-facing
    interface (as an operator's environment might), which the server must not let its ranks listen on."""
    iface = _network_interface()
    return {"TMPDIR": str(tmp), **({"GLOO_SOCKET_IFNAME": iface} if iface else {})}


@pytest.fixture(scope="module")
def tp_server(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp-tmpdir")
    with running_server("--model", str(tiny_llama), *SERVE_ARGS, env=_server_env(tmp)) as s:
        s.tmpdir = tmp
        yield s


def _ranks(pid: int) -> list[int]:
    """The server's worker-rank processes (its multiprocessing spawn children)."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            stat = (d / "stat").read_text()
            if d.name.isdigit() and int(stat.rsplit(")", 1)[1].split()[1]) == pid \
                    and b"spawn_main" in (d / "cmdline").read_bytes():
                out.append(int(d.name))
        except (OSError, ValueError, IndexError):
            continue
    return out


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for p in pids:
        try:
            state = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state != "Z":
                alive.append(p)
        except OSError:
            pass
    return alive


def test_greedy_tokens_through_the_server_equal_tp1(tp_server, tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", num_blocks=64)
    want = [o.outputs[0].text for o in llm.generate(TEXT_PROMPTS, SamplingParams(max_tokens=12, temperature=0),
                                                    use_tqdm=False)]
    c = openai.OpenAI(base_url=tp_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    model = c.models.list().data[0].id
    got = c.completions.create(model=model, prompt=TEXT_PROMPTS, max_tokens=12, temperature=0)
    assert [ch.text for ch in sorted(got.choices, key=lambda ch: ch.index)] == want
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=model, prompt=TEXT_PROMPTS[2], max_tokens=12, temperature=0, stream=True))
    assert streamed == want[2] and want[2].strip()
    assert len(_ranks(tp_server.proc.pid)) == 1


def _bound_sockets(pid: int) -> list[tuple[int, str, object]]:
    """(pid, kind, address) of every listening TCP socket, bound UDP socket and named Unix socket of the server
    and all its descendants."""
    out = []
    for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        for c in p.net_connections("inet"):
            if c.status == psutil.CONN_LISTEN or (c.type == socket.SOCK_DGRAM and c.laddr):
                out.append((p.pid, "inet", c.laddr))
        out += [(p.pid, "unix", c.laddr) for c in p.net_connections("unix") if c.laddr]
    return out


def _loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback


def test_no_rank_listens_off_loopback_and_the_store_is_private(tp_server):
    # What an attacker on the network sees: a TCPStore on *:PORT took and grew any key written to it. Every
    # socket of the server and its ranks must be on loopback (a Unix socket only in a 0700 directory), the
    # rendezvous a store file in a 0700 directory.
    bound = _bound_sockets(tp_server.proc.pid)
    inet = [(pid, a) for pid, kind, a in bound if kind == "inet"]
    assert any(a.port == tp_server.port for _, a in inet)  # the listing sees at least the HTTP port
    assert len({pid for pid, _ in inet}) == 2  # and gloo's pair listener in the rank process
    assert [(pid, a) for pid, a in inet if not _loopback(a.ip)] == []
    for pid, _, path in (b for b in bound if b[1] == "unix"):
        assert path.startswith("/"), f"pid {pid}: abstract Unix socket {path!r} (any local user may connect)"
        assert os.stat(os.path.dirname(path)).st_mode & 0o077 == 0, f"pid {pid}: {path} in a shared directory"
    stores = list(tp_server.tmpdir.glob("lmserve-tp-*"))
    assert len(stores) == 1 and stores[0].stat().st_mode & 0o777 == 0o700


def test_sigterm_stops_every_rank(tp_server):
    ranks = _ranks(tp_server.proc.pid)
    assert len(ranks) == 1
    tp_server.proc.send_signal(signal.SIGTERM)
    assert tp_server.proc.wait(timeout=30) == 0
    deadline = time.monotonic() + 10
    while _alive(ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(ranks)
    assert list(tp_server.tmpdir.glob("lmserve-tp-*")) == []  # the store's directory goes with the ranks


def test_killing_an_idle_rank_fails_health_and_exits_nonzero(tiny_llama, tmp_path):
    with running_server("--model", str(tiny_llama), *SERVE_ARGS, env={"TMPDIR": str(tmp_path)}) as s:
        ranks = _ranks(s.proc.pid)
        assert len(ranks) == 1 and httpx.get(s.url + "/health").status_code == 200
        os.kill(ranks[0], signal.SIGKILL)  # no request in flight: the executor's watcher must notice
        assert unhealthy_within(s.url, 3)
        assert s.proc.wait(timeout=20) == 1
        assert list(tmp_path.glob("lmserve-tp-*")) == []  # stopped on the failure path too


@pytest.mark.slow
def test_a_hung_rank_fails_health_and_exits_nonzero_leaving_no_rank(tiny_llama):
    with running_server("--model", str(tiny_llama), *SERVE_ARGS, "--engine-step-timeout", "2") as s:
        ranks = _ranks(s.proc.pid)
        os.kill(ranks[0], signal.SIGSTOP)  # alive but stuck: rank 0's all-reduce waits for it
        try:
            r = httpx.post(s.url + "/v1/completions", json={"model": "tiny-llama", "prompt": "w1 w2", "max_tokens": 4},
                           timeout=30)
            assert r.status_code in (500, 503)
            assert unhealthy_within(s.url, 3)
            assert s.proc.wait(timeout=20) == 1
            deadline = time.monotonic() + 5  # a killed process's teardown may take a moment on a loaded machine
            while _alive(ranks) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not _alive(ranks)  # a stopped rank is killed, not left behind
        finally:
            if _alive(ranks):
                os.kill(ranks[0], signal.SIGKILL)


def test_ranks_exit_when_their_parent_is_killed(tiny_llama, tmp_path):
    # SIGKILL leaves the parent no chance to stop its ranks: they must notice on their own (no orphans).
    # Nor can it remove its rank store's directory: TMPDIR keeps that in this test's own directory.
    script = ("import sys, time; from lmserve import LLM; "
              "llm = LLM(sys.argv[1], tensor_parallel_size=2, num_blocks=16, num_threads=1); "
              "print('ready', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", script, str(tiny_llama)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        assert proc.stdout.readline().strip() == "ready"
        ranks = _ranks(proc.pid)
        assert len(ranks) == 1
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 5
        while _alive(ranks) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(ranks)
    finally:
        if proc.poll() is None:
            proc.kill()
