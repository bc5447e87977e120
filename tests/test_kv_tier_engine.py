"""The KV tier in the engine: evicted blocks come back from host memory and disk bit for bit, per salt, across
engine and process restarts, for every KV group of a model with window layers (Gemma 3); a bad file is
recomputed; every block is returned."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lmserve.cache.kv_cache_manager import block_hash, group_key
from lmserve.config import CacheConfig, EngineConfig, KVOffloadConfig, SchedulerConfig
from lmserve.engine.llm_engine import LLMEngine
from lmserve.sampling_params import SamplingParams
from lmserve.utils import KV_QUANT_DTYPES
from tests.conftest import write_tiny_llama
from tests.tiny_models import build_hf

BS = 4  # tokens per block: prompts of a few dozen words span many blocks
PROMPT = " ".join(f"w{i}" for i in range(10, 58))  # 48 tokens: 11 full blocks leave one token to compute
FILLERS = [" ".join(f"w{(i * 37 + j) % 240 + 3}" for j in range(36)) for i in range(5)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "llama"
    write_tiny_llama(path)
    return path


def engine(model: Path, num_blocks: int = 24, block_size: int = BS, kv_dtype: str = "auto", step_tokens: int = 1024,
           **offload) -> LLMEngine:
    cache = CacheConfig(block_size=block_size, num_blocks=num_blocks, kv_cache_dtype=kv_dtype)
    device = "auto" if kv_dtype == "auto" else "cpu"  # quantized and float16 KV caches: the CPU kernels' formats
    # float32 where "auto" is CUDA too (CUDA's default dtype is bfloat16)
    return LLMEngine(EngineConfig(model=str(model), device=device, dtype="float32", cache=cache,
                                  kv_offload=KVOffloadConfig(**offload),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=step_tokens)))


def run(eng: LLMEngine, prompt: str, rid: str, salt: bytes = b"", params: SamplingParams = GREEDY) -> dict:
    """Greedy tokens, every logprob (chosen and top), and the prompt tokens served from the caches."""
    eng.add_request(rid, prompt, params, prefix_scope=salt)
    out = {"ids": [], "logprobs": [], "cached": None, "device": eng.runner.device.type}
    while eng.has_unfinished():
        for d in eng.step():
            out["ids"] += d.token_ids
            out["logprobs"] += [(lp.logprob, lp.top) for lp in d.logprobs or ()]
            if d.finished:
                out["cached"] = d.num_cached_tokens
    return out


def assert_no_leak(eng: LLMEngine) -> None:
    assert not eng.has_unfinished()
    assert eng.kv.num_free_blocks == eng.num_blocks and eng.kv.req_blocks == {}
    assert eng.kv_tier is None or eng.kv_tier._staged == {}


def assert_same_tokens(got: dict, want: dict) -> None:
    """The same greedy tokens, logprobs and alternatives. Bit for bit on the CPU, whose kernels compute each row on
    its own. On CUDA a prompt whose prefix came from a cache computes fewer rows than the cold run, and cuBLAS picks
    its GEMM by the row count (another order of adds): there within float32 rounding (seen on an H200: one
    alternative's logprob 5e-7 apart after a 32-token hit)."""
    assert got["ids"] == want["ids"]
    if "cuda" not in (got["device"], want["device"]):
        assert got["logprobs"] == want["logprobs"]
        return
    assert [[i for i, _ in top] for _, top in got["logprobs"]] == [[i for i, _ in top] for _, top in want["logprobs"]]

    def flat(run: dict) -> list[float]:
        return [x for lp, top in run["logprobs"] for x in (lp, *(v for _, v in top))]

    assert flat(got) == pytest.approx(flat(want), abs=1e-5)


def full_blocks(eng: LLMEngine, prompt: str) -> int:
    """Blocks a prefix hit can cover: all full ones, one token left to compute."""
    return (len(eng.front.tokenize_prompt(prompt)) - 1) // eng.block_size


def leading_in_pool(eng: LLMEngine, prompt: str, salt: bytes = b"") -> int:
    """How many of the prompt's leading full blocks the pool itself still holds."""
    ids, parent, n, bs = eng.front.tokenize_prompt(prompt), None, 0, eng.block_size
    for i in range(full_blocks(eng, prompt)):
        parent = block_hash(parent, ids[i * bs:(i + 1) * bs], salt)
        if eng.kv.pool.lookup(parent) is None:
            break
        n += 1
    return n


@pytest.fixture(scope="module")
def cold(tiny) -> dict:
    """The prompt computed by an engine without a tier: what every load must reproduce exactly."""
    eng = engine(tiny)
    out = run(eng, PROMPT, "cold")
    assert out["cached"] == 0
    return out


def evict(eng: LLMEngine, salt: bytes = b"") -> None:
    """Run other prompts until the pool holds none of PROMPT's blocks."""
    for i, filler in enumerate(FILLERS):
        run(eng, filler, f"fill{i}")
        if leading_in_pool(eng, PROMPT, salt) == 0:
            return
    raise AssertionError("the fillers did not evict the prompt's blocks")


def test_blocks_evicted_to_host_memory_load_back_bit_identical(tiny, cold):
    eng = engine(tiny, memory_bytes=2**20)
    first = run(eng, PROMPT, "a")
    assert_same_tokens(first, cold)
    evict(eng)
    host = eng.kv_tier.stats("host")
    assert host["stores"] >= full_blocks(eng, PROMPT) and host["used_bytes"] == host["store_bytes"]
    hits = host["hit_tokens"]
    again = run(eng, PROMPT, "a2")
    assert again["cached"] == full_blocks(eng, PROMPT) * BS  # the whole prefix, none of it from the pool
    assert eng.kv_tier.stats("host")["hit_tokens"] - hits == again["cached"]
    assert_same_tokens(again, cold)  # bit for bit on the CPU: logprobs as floats
    assert eng.kv.prefix_hits >= again["cached"]
    assert_no_leak(eng)


def prompt_block_bytes(eng: LLMEngine, prompt: str) -> list[torch.Tensor]:
    """Each of the prompt's full blocks as the pool holds it now: its raw bytes in every layer's cache."""
    ids, parent, out, bs = eng.front.tokenize_prompt(prompt), None, [], eng.block_size
    for i in range(full_blocks(eng, prompt)):
        parent = block_hash(parent, ids[i * bs:(i + 1) * bs])
        b = eng.kv.pool.lookup(parent).block_id
        out.append(torch.cat([kv[:, b].reshape(-1).view(torch.uint8) for kv in eng.runner.kv_caches]))
    return out


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory) -> Path:
    """A tiny Llama with head_dim 64 (a quantized KV row is blocks of 32 values; the other tiny Llama's is 16)."""
    return build_hf("llama", tmp_path_factory.mktemp("tiny64"))[0]


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_quantized_kv_blocks_come_back_from_host_memory_byte_for_byte(tiny64, kv_dtype):
    """--kv-cache-dtype int8 / fp8_e4m3 with the host tier: each evicted block's codes and scales are reloaded into
    a new pool block byte for byte, and the reloaded prompt gives the cold run's tokens and logprobs."""
    cold = run(engine(tiny64, kv_dtype=kv_dtype), PROMPT, "cold")
    eng = engine(tiny64, kv_dtype=kv_dtype, memory_bytes=2**20)
    assert all(kv.dtype == KV_QUANT_DTYPES[kv_dtype] for kv in eng.runner.kv_caches)
    first = run(eng, PROMPT, "a")
    assert_same_tokens(first, cold)
    saved = prompt_block_bytes(eng, PROMPT)
    evict(eng)
    again = run(eng, PROMPT, "a2")
    assert again["cached"] == full_blocks(eng, PROMPT) * BS == eng.kv_tier.stats("host")["hit_tokens"]
    reloaded = prompt_block_bytes(eng, PROMPT)
    assert len(reloaded) == len(saved) and all(torch.equal(a, b) for a, b in zip(reloaded, saved))
    assert_same_tokens(again, cold)
    assert_no_leak(eng)


def test_disk_blocks_serve_a_restarted_engine_bit_identical(tiny, cold, tmp_path):
    first = engine(tiny, directory=str(tmp_path))
    run(first, PROMPT, "a")
    first.close()  # writes what is queued
    stores = first.kv_tier.stats("disk")["stores"]
    assert stores >= full_blocks(first, PROMPT) and first.kv_tier.disk.stats.dropped == 0
    files = list((tmp_path).rglob("*.kvb"))
    assert len(files) == stores
    (note,) = tmp_path.glob("*/identity.json")
    assert json.loads(note.read_text())["block_size"] == str(BS)

    restarted = engine(tiny, directory=str(tmp_path))
    assert restarted.kv_tier.disk.stats.files == stores
    again = run(restarted, PROMPT, "a2")
    assert again["cached"] == full_blocks(restarted, PROMPT) * BS
    assert restarted.kv_tier.stats("disk")["hit_tokens"] == again["cached"]
    assert_same_tokens(again, cold)
    assert_no_leak(restarted)
    restarted.close()


def test_the_tier_keeps_each_salt_to_itself(tiny, tmp_path):
    """Per API key (the server's salt) and per adapter: a block in host memory or on disk serves its salt alone."""
    eng = engine(tiny, memory_bytes=2**20, directory=str(tmp_path))
    a = run(eng, PROMPT, "a", salt=b"key:team-a")
    evict(eng, salt=b"key:team-a")
    before = {t: eng.kv_tier.stats(t)["hit_tokens"] for t in ("host", "disk")}
    b = run(eng, PROMPT, "b", salt=b"key:team-b")
    assert b["cached"] == 0 and {t: eng.kv_tier.stats(t)["hit_tokens"] for t in ("host", "disk")} == before
    assert run(eng, PROMPT, "a2", salt=b"key:team-a")["cached"] == full_blocks(eng, PROMPT) * BS
    eng.close()
    fresh = engine(tiny, directory=str(tmp_path))  # only the disk now: b's own blocks were written meanwhile
    assert run(fresh, PROMPT, "c", salt=b"key:team-c")["cached"] == 0
    assert run(fresh, PROMPT, "n")["cached"] == 0  # nor the unsalted pool's
    again = run(fresh, PROMPT, "a3", salt=b"key:team-a")
    assert again["cached"] == full_blocks(fresh, PROMPT) * BS and again["ids"] == a["ids"]
    assert_no_leak(fresh)
    fresh.close()


def test_a_corrupt_file_is_recomputed_and_rewritten(tiny, cold, tmp_path):
    first = engine(tiny, directory=str(tmp_path))
    run(first, PROMPT, "a")
    first.close()
    ids = first.front.tokenize_prompt(PROMPT)
    hashes = [None]
    for i in range(full_blocks(first, PROMPT)):
        hashes.append(block_hash(hashes[-1], ids[i * BS:(i + 1) * BS]))
    bad = first.kv_tier.disk._path(hashes[4])  # the 4th block: 3 load, the rest are recomputed
    raw = bytearray(bad.read_bytes())
    raw[-1] ^= 0xFF
    bad.write_bytes(bytes(raw))

    second = engine(tiny, directory=str(tmp_path))
    again = run(second, PROMPT, "a2")
    assert second.kv_tier.disk.stats.rejected == 1
    assert again["cached"] == 3 * BS and second.kv_tier.stats("disk")["hit_tokens"] == 3 * BS
    assert_same_tokens(again, cold)
    second.kv_tier.flush()  # the recomputed block went to disk again
    assert bad.exists() and second.kv_tier.disk.read(hashes[4]) is not None
    assert_no_leak(second)
    second.close()


def test_another_kv_layout_never_reads_the_files(tiny, tmp_path):
    first = engine(tiny, directory=str(tmp_path))
    run(first, PROMPT, "a")
    first.close()
    for other in (engine(tiny, kv_dtype="float16", directory=str(tmp_path)),
                  engine(tiny, block_size=8, num_blocks=12, directory=str(tmp_path))):
        assert other.kv_tier.disk.dir != first.kv_tier.disk.dir and other.kv_tier.disk.stats.files == 0
        assert run(other, PROMPT, "b")["cached"] == 0
        other.close()
    assert len(list(tmp_path.glob("*/identity.json"))) == 3


def test_preemption_and_a_mixed_batch_with_the_tier_keep_every_output(tiny, tmp_path):
    prompts = [PROMPT] + FILLERS + [PROMPT + " w3 w4", FILLERS[0]]
    base = engine(tiny, num_blocks=256)
    alone = [run(base, p, f"alone{i}")["ids"] for i, p in enumerate(prompts)]
    # chunked prefill over several steps, a pool too small for the batch
    eng = engine(tiny, num_blocks=24, step_tokens=64, memory_bytes=2**20, directory=str(tmp_path))
    for rnd in range(2):
        for i, p in enumerate(prompts):
            eng.add_request(f"r{rnd}-{i}", p, GREEDY)
        got: dict[str, list[int]] = {}
        while eng.has_unfinished():
            for d in eng.step():
                got.setdefault(d.request_id, []).extend(d.token_ids)
        assert [got[f"r{rnd}-{i}"] for i in range(len(prompts))] == alone
        assert_no_leak(eng)
    assert eng.scheduler.num_preemptions > 0
    assert eng.kv_tier.stats("host")["loads"] + eng.kv_tier.stats("disk")["loads"] > 0
    eng.close()


def test_a_failed_step_drops_its_staged_loads_and_returns_every_block(tiny, cold, monkeypatch):
    eng = engine(tiny, memory_bytes=2**20)
    run(eng, PROMPT, "a")
    evict(eng)

    def broken(new):  # the runner fails before its copies: the loads staged at schedule time never run
        raise RuntimeError("injected fault")

    with monkeypatch.context() as m:
        m.setattr(eng.runner.batch, "add", broken)
        eng.add_request("b", PROMPT, GREEDY)
        with pytest.raises(RuntimeError, match="injected"):
            eng.step()
        assert eng.kv_tier._staged  # scheduled, never loaded
        assert eng.fail_step() == ["b"]
    assert_no_leak(eng)
    again = run(eng, PROMPT, "c")  # the host tier kept its blocks
    assert again["cached"] == full_blocks(eng, PROMPT) * BS and again["ids"] == cold["ids"]


_CHILD = textwrap.dedent("""
    import json, sys
    from lmserve.config import CacheConfig, EngineConfig, KVOffloadConfig
    from lmserve.engine.llm_engine import LLMEngine
    from lmserve.sampling_params import SamplingParams

    model, directory, prompt = sys.argv[1:4]
    eng = LLMEngine(EngineConfig(model=model, dtype="float32", num_threads=2, cache=CacheConfig(block_size=4, num_blocks=64),
                                 kv_offload=KVOffloadConfig(directory=directory)))
    eng.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True))
    ids, lps, cached = [], [], None
    while eng.has_unfinished():
        for d in eng.step():
            ids += d.token_ids
            lps += [[lp.logprob, lp.top] for lp in d.logprobs or ()]
            if d.finished:
                cached = d.num_cached_tokens
    eng.close()
    print(json.dumps({"ids": ids, "logprobs": lps, "cached": cached, "device": eng.runner.device.type,
                      "disk_hits": eng.kv_tier.stats("disk")["hit_tokens"]}))
""")


def test_a_new_process_loads_the_blocks_bit_identical(tiny, tmp_path):
    def child() -> dict:
        done = subprocess.run([sys.executable, "-c", _CHILD, str(tiny), str(tmp_path), PROMPT], capture_output=True,
                              text=True, timeout=300, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    first, second = child(), child()
    assert first["cached"] == 0 and first["disk_hits"] == 0
    assert second["cached"] == second["disk_hits"] == 44  # 11 full blocks of 4
    assert_same_tokens(second, first)


@pytest.fixture(scope="module")
def smol_engine():
    return LLMEngine(EngineConfig(num_threads=2, cache=CacheConfig(num_blocks=64)))


def test_the_embedded_gguf_model_loads_blocks_back_bit_identical(smol_engine, tmp_path):
    """The default model (a Q4_1 GGUF through the native kernels, float16 KV) from host memory and from disk."""
    base = smol_engine
    words = ("The quick brown fox jumps over the lazy dog while the sun sets behind distant hills and rivers carry "
             "stories of old towns, markets, bridges and songs to the patient sea. ").split()
    prompt = " ".join(words[i % len(words)] for i in range(80))  # 5 full blocks of 16
    fillers = [f"Story {i}: " + " ".join(words[(i * 5 + j) % len(words)] for j in range(70)) for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True)
    cold = run(base, prompt, "cold", params=params)

    def like(**offload) -> LLMEngine:
        return LLMEngine(EngineConfig(num_threads=2, cache=CacheConfig(num_blocks=16),
                                      kv_offload=KVOffloadConfig(**offload)), loaded=base.loaded,
                         tokenizer=base.tokenizer)

    eng = like(memory_bytes=64 * 2**20, directory=str(tmp_path))
    assert eng.kv_dtype == base.kv_dtype
    run(eng, prompt, "a", params=params)
    for i, f in enumerate(fillers):
        run(eng, f, f"f{i}", params=SamplingParams(temperature=0.0, max_tokens=1))
        if leading_in_pool(eng, prompt) == 0:
            break
    assert leading_in_pool(eng, prompt) == 0
    again = run(eng, prompt, "a2", params=params)
    full = (len(eng.front.tokenize_prompt(prompt)) - 1) // eng.block_size * eng.block_size
    assert again["cached"] == full and eng.kv_tier.stats("host")["hit_tokens"] == full
    assert_same_tokens(again, cold)
    assert_no_leak(eng)
    eng.close()
    restarted = like(directory=str(tmp_path))
    from_disk = run(restarted, prompt, "a3", params=params)
    assert from_disk["cached"] == full and restarted.kv_tier.stats("disk")["hit_tokens"] == full
    assert_same_tokens(from_disk, cold)
    assert_no_leak(restarted)
    restarted.close()


# -- a model with several KV groups: Gemma 3's window layers beside its global one ----------------------------

GEMMA_PROMPT = [(i * 53) % 240 + 5 for i in range(37)]  # 9 full blocks of 4 leave one token; the window is 8
GEMMA_FILLERS = [[(i * 31 + j * 7) % 240 + 5 for j in range(37)] for i in range(1, 7)]
# the hit's 9 blocks in the full group, and in each of the 5 window groups the 2 its window reaches from the
# token after them (position 36 sees keys 29..36: blocks 7 and 8)
GEMMA_LOADS = 9 + 5 * 2


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """The tiny random Gemma 3 (5 window layers : 1 global, window 8), loaded once, and its cold outputs."""
    from lmserve.tokenizer import Tokenizer

    path = build_hf("gemma3", tmp_path_factory.mktemp("gemma"))[0]
    first = gemma_engine(path, None, Tokenizer.from_pretrained(path))
    assert len(first.kv.groups) == 6
    return path, first, run(first, GEMMA_PROMPT, "cold")


def gemma_engine(path: Path, like: LLMEngine | None, tokenizer=None, **offload) -> LLMEngine:
    """An engine on the tiny Gemma 3 (`like`'s weights and tokenizer when given) with the tier `offload` asks for."""
    cfg = EngineConfig(model=str(path), quantization="none", dtype="float32",
                       cache=CacheConfig(block_size=BS, num_blocks=80), kv_offload=KVOffloadConfig(**offload),
                       scheduler=SchedulerConfig(max_num_batched_tokens=12))  # the prompts prefill in chunks
    return LLMEngine(cfg, loaded=like.loaded if like else None, tokenizer=like.tokenizer if like else tokenizer)


def gemma_in_pool(eng: LLMEngine) -> int:
    """How many of GEMMA_PROMPT's blocks, over every group, the pool itself still holds."""
    ids, hashes = GEMMA_PROMPT, [None]
    for i in range(9):
        hashes.append(block_hash(hashes[-1], ids[i * BS:(i + 1) * BS]))
    return sum(eng.kv.pool.lookup(group_key(h, g)) is not None for h in hashes[1:] for g in range(6))


def test_every_kv_group_comes_back_from_host_memory(gemma):
    """Gemma 3 with the host tier: after the pool evicted every group's blocks, a hit restores the full group's
    blocks and each window group's last two, and decodes the cold run's tokens."""
    path, first, cold = gemma
    eng = gemma_engine(path, first, memory_bytes=2**20)
    assert run(eng, GEMMA_PROMPT, "a")["ids"] == cold["ids"]
    for i, filler in enumerate(GEMMA_FILLERS):
        run(eng, filler, f"fill{i}")
        if gemma_in_pool(eng) == 0:
            break
    assert gemma_in_pool(eng) == 0
    again = run(eng, GEMMA_PROMPT, "a2")
    host = eng.kv_tier.stats("host")
    assert again["cached"] == 36 == host["hit_tokens"] and host["loads"] == GEMMA_LOADS
    assert_same_tokens(again, cold)
    assert_no_leak(eng)


def test_every_kv_group_comes_back_from_disk_after_a_restart(gemma, tmp_path):
    """Gemma 3 with the disk tier: every group's blocks are written under their group's key; a restarted engine
    restores them; a bad window-group file is refused and the hit ends before the blocks that needed it."""
    path, first, cold = gemma
    writer = gemma_engine(path, first, directory=str(tmp_path))
    run(writer, GEMMA_PROMPT, "a")
    writer.close()
    # each group's every full block, any prefix may hit: 37 prompt + 7 fed-back output tokens are 11 blocks of 4
    assert writer.kv_tier.stats("disk")["stores"] == 11 * 6
    restarted = gemma_engine(path, first, directory=str(tmp_path))
    again = run(restarted, GEMMA_PROMPT, "a2")
    disk = restarted.kv_tier.stats("disk")
    assert again["cached"] == 36 == disk["hit_tokens"] and disk["loads"] == GEMMA_LOADS
    assert_same_tokens(again, cold)
    assert_no_leak(restarted)
    restarted.close()

    h = None
    for i in range(9):
        h = block_hash(h, GEMMA_PROMPT[i * BS:(i + 1) * BS])
    bad = restarted.kv_tier.disk._path(group_key(h, 1))  # the last block of the first window group
    raw = bytearray(bad.read_bytes())
    raw[-1] ^= 0xFF
    bad.write_bytes(bytes(raw))
    third = gemma_engine(path, first, directory=str(tmp_path))
    again = run(third, GEMMA_PROMPT, "a3")
    # 8 blocks: the window from position 32 reaches blocks 6 and 7, which are whole
    assert third.kv_tier.disk.stats.rejected == 1 and again["cached"] == 32
    assert_same_tokens(again, cold)
    assert_no_leak(third)
    third.close()
