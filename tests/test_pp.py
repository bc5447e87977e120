"""Pipeline parallelism on CPU with gloo: each rank a real process holding only its layers.

The model-level tests run rank 0 in this process and rank 1 in a spawned one, each loading only its layers (the
embedded GGUF dequantized and kept in its packed blocks, a tiny random Gemma 3 and a tiny MoE from safetensors), and
compare rank 0's logits with one rank's. The engine tests run the whole path (paged KV cache of each rank's layers,
chunked prefill, micro-batches) on the embedded GGUF, a Gemma 3 with two KV groups and a MoE; the server tests start
`lmserve serve --pipeline-parallel-size 2` for real.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import torch
import torch.distributed as dist

from lmserve import LLM, SamplingParams
from lmserve.layers.attention.backends import attention_factory
from lmserve.layers.attention.context import ContiguousAttention
from lmserve.layers.formats.pipeline import AbsentLayer, PipelineLoop, PPStage, micro_batches
from lmserve.loader import read_model_config
from lmserve.loader.sharding import TPShard
from lmserve.worker.inputs import _attention_metadata
from lmserve.worker.tp_worker import RankSpec, init_group
from lmserve.worker.transforms import load_formatted
from lmserve.worker.upload import to_device
from tests.conftest import save_tiny_hf, write_tiny_llama
from tests.server_util import free_port, running_server, unhealthy_within
from tests.tiny_models import ARCHS, build_hf

# different lengths and contents: micro-batches put back in the wrong order would move rows
PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [1, 2, 3], [11, 200, 9, 9, 60]]


def _inputs():
    ids = torch.tensor([t for p in PROMPTS for t in p])
    pos = torch.cat([torch.arange(len(p)) for p in PROMPTS])
    return ids, pos, ContiguousAttention([len(p) for p in PROMPTS])


def _forward(rank: int, world: int, init_method: str, path: str, quantization: str | None,
             tp: int = 1, micro_batches: int = 2) -> torch.Tensor:
    """This rank's load and forward (`tp` > 1: stages of `tp` tensor-parallel ranks each); rank 0's logits."""
    init_group(RankSpec(rank, world, init_method, 60.0, 1, os.getppid()), torch.device("cpu"))
    try:
        stage = PPStage(rank // tp, world // tp, read_model_config(Path(path)).num_layers, rank % tp, tp,
                        micro_batches)
        shard = TPShard(rank % tp, tp) if tp > 1 else None
        model = load_formatted(path, torch.float32, torch.device("cpu"), stage=stage, shard=shard,
                               quantization=quantization).model
        held = [i for i, layer in enumerate(model.model.layers) if not isinstance(layer, AbsentLayer)]
        assert held == list(stage.layers)  # only its layers were built
        with torch.inference_mode():
            hidden = model(*_inputs())
            assert model.layer_loop.split_steps == (micro_batches > 1)  # the forward ran in parts (or did not)
            return model.compute_logits(hidden) if rank == 0 else torch.empty(0)
    finally:
        dist.destroy_process_group()


def _rank_main(rank: int, world: int, init_method: str, path: str, quantization: str | None, tp: int,
               micro_batches: int) -> None:
    torch.set_num_threads(1)
    _forward(rank, world, init_method, path, quantization, tp, micro_batches)
    os._exit(0)  # as test_tp.py: no C++ static destructors after gloo (an error above still exits non-zero)


def pp_logits(path, pp: int, quantization: str | None = None, tp: int = 1, micro_batches: int = 2) -> torch.Tensor:
    world = pp * tp
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as store_dir:
        init = f"file://{store_dir}/store"
        procs = [ctx.Process(target=_rank_main, args=(r, world, init, str(path), quantization, tp, micro_batches),
                             daemon=True)
                 for r in range(1, world)]
        for p in procs:
            p.start()
        try:
            logits = _forward(0, world, init, str(path), quantization, tp, micro_batches)
        finally:
            for p in procs:
                p.join(120)
    assert all(p.exitcode == 0 for p in procs)
    return logits


def one_rank_logits(path, quantization: str | None = None) -> torch.Tensor:
    whole = load_formatted(path, torch.float32, torch.device("cpu"), quantization=quantization).model
    with torch.inference_mode():
        return whole.compute_logits(whole(*_inputs()))


def test_stages_split_every_layer_once():
    for layers in (2, 6, 30):
        for world in range(1, layers + 1):
            ranges = [PPStage(r, world, layers).layers for r in range(world)]
            assert [i for r in ranges for i in r] == list(range(layers))
            assert all(len(r) >= 1 for r in ranges) and max(map(len, ranges)) - min(map(len, ranges)) <= 1


@pytest.mark.parametrize("kind", list(ARCHS))
def test_pp2_logits_equal_one_rank(tmp_path, kind):
    # every family tests/tiny_models.py builds, e.g. gemma3: sandwich norms, sliding and global layers, tied head;
    # qwen3_moe: every layer's experts routed; gpt_oss: sinks, biased experts; phi3: fused qkv and gate_up split
    path, _ = build_hf(kind, tmp_path)
    ref = one_rank_logits(path)
    got = pp_logits(path, 2)
    assert got.shape == ref.shape and not torch.equal(ref, torch.zeros_like(ref))
    assert (got - ref).abs().max().item() < 1e-5
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("quantization,micro_batches", [(None, 2), ("gguf", 1), ("gguf", 2), ("gguf", 3)])
def test_embedded_gguf_pp2_logits_equal_one_rank(smol_path, quantization, micro_batches):
    # None: the Q4_1 tensors dequantized, each rank only its layers'; gguf: kept in their packed blocks. With micro-
    # batches the three prompts travel the ring in two or three parts and come back in their rows' order
    ref = one_rank_logits(smol_path, quantization)
    got = pp_logits(smol_path, 2, quantization, micro_batches=micro_batches)
    assert (got - ref).abs().max().item() < 1e-5
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_micro_batches_default_to_two_on_cpu_and_one_on_cuda_unless_asked():
    from lmserve.config import ParallelConfig

    assert ParallelConfig().micro_batches_on("cpu") == 2
    assert ParallelConfig().micro_batches_on("cuda") == 1  # cut steps over NCCL have not run on two GPUs yet
    assert ParallelConfig(pipeline_micro_batches=3).micro_batches_on("cuda") == 3


def test_micro_batches_cut_between_sequences_balanced_by_tokens():
    seqs = ContiguousAttention([7, 3, 5, 1])
    assert micro_batches(seqs, 16, 1) == [(0, 16)]
    assert micro_batches(seqs, 16, 2) == [(0, 7), (7, 16)]  # 7 of 16 tokens is the nearest cut to 8
    assert micro_batches(seqs, 16, 3) == [(0, 7), (7, 10), (10, 16)]
    assert micro_batches(ContiguousAttention([9]), 9, 2) == [(0, 9)]  # one sequence: never cut
    assert seqs.rows(7, 15).seq_lens == [3, 5]


# 20 ms a row: each step's few gloo messages cost a few ms on a loaded 2-core host (123-127 ms measured at 10 ms a row
# against the ideal 120), a margin that scales down as the rows' time grows
ROW_S = 0.02


class _RowTimeLayer(torch.nn.Module):
    """A layer whose cost is wall time per row (a sleep: it needs no core, so the machine's load cannot hide or fake
    the overlap) and whose output tells the rows apart."""

    def forward(self, x, residual, rope, attn):
        time.sleep(ROW_S * x.shape[0])
        return x * 2 + 1, x if residual is None else residual + x


def _ring(rank: int, init_method: str, micro: int) -> tuple[float, torch.Tensor]:
    """Rank `rank` of two runs a real PipelineLoop over 8 one-token sequences, three times: (fastest s, output)."""
    init_group(RankSpec(rank, 2, init_method, 60.0, 1, os.getppid()), torch.device("cpu"))
    try:
        loop = PipelineLoop(PPStage(rank, 2, 2, micro_batches=micro))
        layers = torch.nn.ModuleList([_RowTimeLayer(), _RowTimeLayer()])
        x, best = torch.arange(8.0)[:, None].repeat(1, 4), float("inf")
        for _ in range(3):
            dist.barrier()
            start = time.perf_counter()
            h, residual = loop(layers, x, {}, ContiguousAttention([1] * 8))
            best = min(best, time.perf_counter() - start)
        return best, h + residual
    finally:
        dist.destroy_process_group()


def _ring_main(rank: int, init_method: str, micro: int) -> None:
    _ring(rank, init_method, micro)
    os._exit(0)


def _ring_programs(world: int, parts: int) -> list[list[tuple]]:
    """Each rank's step as PipelineLoop.forward really runs it, recorded with torch.distributed's posting replaced
    (no process group): ("run", part) when the rank's first layer starts a part, ("post", [(op, part), ...]) for
    each batch_isend_irecv, op "send" to the next rank or "recv" from the previous one."""
    import types

    from lmserve.layers.formats import pipeline

    programs = []

    class Work:
        def wait(self) -> None:
            pass

    class Recorder(torch.nn.Module):
        def forward(self, x, residual, rope, attn):
            prog.append(("run", len([a for a in prog if a[0] == "run"])))
            return x, x if residual is None else residual

    fake = types.SimpleNamespace(isend="send", irecv="recv", P2POp=lambda op, t, peer, tag: (op, tag),
                                 batch_isend_irecv=lambda ops: prog.append(("post", list(ops))) or [Work()] * len(ops))
    real = pipeline.dist
    pipeline.dist = fake
    try:
        for rank in range(world):
            prog: list[tuple] = []
            loop = PipelineLoop(PPStage(rank, world, world, micro_batches=parts))
            layers = torch.nn.ModuleList([Recorder() for _ in range(world)])
            loop(layers, torch.zeros(parts, 4), {}, ContiguousAttention([1] * parts))
            programs.append(prog)
    finally:
        pipeline.dist = real
    assert all(sum(a[0] == "run" for a in prog) == parts for prog in programs)
    return programs


def _nccl_replay(programs: list[list[tuple]]) -> bool:
    """Whether the ranks' step ends under NCCL's rules: a rank's point-to-point groups run on one stream, one after
    another, a group's sends only once their part has run; the k-th send from a to b meets the k-th receive at b
    from a (tags ignored: they must carry the same part), and a group ends once each of its ops' partners is in a
    group that has started; a rank > 0 runs part i only once its receive has ended. False: the ranks wait forever
    (or would pair two different parts)."""
    world = len(programs)
    groups = [[ops for kind, ops in prog if kind == "post"] for prog in programs]
    slot = {}  # (rank, op, part) -> (group index, k-th of its pair and direction)
    counts: dict = {}
    for r, gs in enumerate(groups):
        for g, ops in enumerate(gs):
            for op, part in ops:
                pair = (r, (r + 1) % world) if op == "send" else ((r - 1) % world, r)
                k = counts.get((pair, op), 0)
                counts[pair, op] = k + 1
                slot[r, op, part] = (g, pair, k)
    by_order = {(pair, op, k): (r, g, part) for (r, op, part), (g, pair, k) in slot.items()}
    if any(by_order.get((pair, "recv", k), (0, 0, None))[2] != part
           for (pair, op, k), (_, _, part) in by_order.items() if op == "send"):
        return False
    pc, queued, head, ran, done = [0] * world, [0] * world, [0] * world, [set() for _ in range(world)], set()
    started = [-1] * world  # the last group that started on each rank's stream
    while True:
        moved = False
        for r, prog in enumerate(programs):  # the host: posts enqueue, a run waits for its receive
            while pc[r] < len(prog):
                kind, what = prog[pc[r]]
                if kind == "run":
                    if r > 0 and (r, "recv", what) not in done:
                        break
                    ran[r].add(what)
                else:
                    queued[r] += 1
                pc[r], moved = pc[r] + 1, True
        for r in range(world):  # the stream: start the head group, end it once every partner has started
            g = head[r]
            if g >= queued[r]:
                continue
            ops = groups[r][g]
            if started[r] < g and all(p in ran[r] for op, p in ops if op == "send"):
                started[r], moved = g, True
            if started[r] == g:
                partners = []
                for op, part in ops:
                    _, pair, k = slot[r, op, part]
                    peer, peer_g, _ = by_order.get((pair, "recv" if op == "send" else "send", k), (None, None, None))
                    partners.append(peer is not None and started[peer] >= peer_g)
                if all(partners):
                    done.update((r, op, part) for op, part in ops)
                    head[r], moved = g + 1, True
        if not moved:
            return all(pc[r] == len(programs[r]) and head[r] == len(groups[r]) for r in range(world))


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("parts", [1, 2, 3, 5])
def test_the_ring_order_never_waits_under_nccls_rules(world, parts):
    """NCCL ignores tags and runs a process's sends and receives in posting order: the order PipelineLoop.forward
    posts in (recorded from it) ends on every ring; posting every receive first (enough over gloo) waits forever. The replay keeps all of a
    rank's groups on one stream (batch_isend_irecv over the default group), stricter than a stream per pair."""
    assert _nccl_replay(_ring_programs(world, parts))
    receives_first = [[("post", [("recv", i)]) for i in range(parts)] +
                      [a for i in range(parts) for a in (("run", i), ("post", [("send", i)]))] for _ in range(world)]
    assert not _nccl_replay(receives_first), "the replay must catch the order gloo alone allows"


def test_micro_batches_overlap_the_ranks():
    # 8 rows at 20 ms a row per rank: whole, rank 1 waits for rank 0's 160 ms, 320 ms a step; in two parts rank 0
    # runs rows 4-7 while rank 1 runs rows 0-3, 240 ms. Rows back in order: each row's result is its own
    got = {}
    for micro in (1, 2):
        with tempfile.TemporaryDirectory() as store_dir:
            peer = mp.get_context("spawn").Process(target=_ring_main, args=(1, f"file://{store_dir}/store", micro),
                                                   daemon=True)
            peer.start()
            try:
                got[micro] = _ring(0, f"file://{store_dir}/store", micro)
            finally:
                peer.join(60)
            assert peer.exitcode == 0
    x = torch.arange(8.0)[:, None].repeat(1, 4)
    assert torch.equal(got[1][1], (x * 2 + 1) * 2 + 1 + x + x * 2 + 1) and torch.equal(got[2][1], got[1][1])
    assert got[1][0] > 15.5 * ROW_S and got[2][0] < 0.8 * got[1][0], got


def _paged_step(num_decodes: int, chunks: list[tuple[int, int]], block_size: int = 4):
    """A real step's paged metadata (worker/inputs.py's builder) and a filled cache: decodes of growing context, then
    prefill chunks (start, length); every sequence its own blocks."""
    torch.manual_seed(0)
    rows, starts, lens, tables, slots, positions, next_block = [], [], [], [], [], [], 0
    for i in range(num_decodes):
        ctx = 3 + 2 * i
        positions.append(ctx - 1)
        starts.append(ctx - 1)
        lens.append(1)
        rows.append(ctx)
    for start, n in chunks:
        positions.extend(range(start, start + n))
        starts.append(start)
        lens.append(n)
        rows.append(start + n)
    width = max(-(-r // block_size) for r in rows)
    for r in rows:
        need = -(-r // block_size)
        tables.append(list(range(next_block, next_block + need)) + [0] * (width - need))
        next_block += need
    req_idx = [i for i, n in enumerate(lens) for _ in range(n)]
    slots = [tables[j][p // block_size] * block_size + p % block_size for j, p in zip(req_idx, positions)]
    meta = _attention_metadata([SimpleNamespace(request_id=str(i)) for i in range(len(chunks))],
                               np.array(lens[num_decodes:]), np.array(starts[num_decodes:]), np.array(tables),
                               num_decodes, np.array(slots), np.array(positions), np.array(req_idx), num_decodes,
                               block_size, {})
    cache = torch.randn(2, next_block, block_size, 2, 64)  # [2, blocks, block_size, kv_heads, head_dim]
    return to_device(meta, torch.device("cpu")), cache


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("num_decodes,chunks,parts", [(5, [], 3), (3, [(0, 6)], 2), (4, [(4, 5), (0, 3)], 3),
                                                      (0, [(0, 4), (2, 5), (0, 3)], 3), (1, [(0, 9), (3, 2)], 3)])
def test_paged_rows_attend_as_the_whole_step(backend, num_decodes, chunks, parts):
    # each micro-batch's rows through their own metadata (the native decode and prefill rows; Triton's decode and
    # extend kernels) equal the whole step's; cuts fall between decodes and between prefill chunks
    meta, cache = _paged_step(num_decodes, chunks)
    t = meta.slot_mapping.shape[0]
    q, k, v = torch.randn(t, 4, 64), torch.randn(t, 2, 64), torch.randn(t, 2, 64)
    ctx = attention_factory(backend)
    whole = ctx([cache.clone()], meta).attend(0, q, k, v)
    cut = micro_batches(ctx([cache], meta), t, 3)
    starts = {0, *range(num_decodes + 1), *(num_decodes + sum(n for _, n in chunks[:i]) for i in range(len(chunks)))}
    assert len(cut) == parts and cut[-1][1] == t and all(lo in starts for lo, _ in cut)  # whole sequences
    split = torch.cat([ctx([cache], meta).rows(lo, hi).attend(0, q[lo:hi], k[lo:hi], v[lo:hi]) for lo, hi in cut])
    if backend == "reference":
        assert torch.equal(split, whole)
    else:
        assert (split - whole).abs().max().item() < 1e-5


def _engine_pp2_equals_one_rank(path, prompts: list[list[int]], inspect=lambda llm, pp: None, **kw) -> None:
    """Greedy tokens and prompt logprobs of one rank, and of two without and with micro-batches (2), are the same;
    `inspect(llm, pp)` looks at each engine before it runs. Steps of `max_num_batched_tokens` (in `kw`) small enough
    that short prompts decode beside a long one's prefill chunks: micro-batched steps are cut (split_steps)."""
    params = SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=0, ignore_eos=True)
    results = {}
    for pp, micro in ((1, 1), (2, 1), (2, 2)):
        llm = LLM(str(path), pipeline_parallel_size=pp, pipeline_micro_batches=micro, dtype="float32", num_threads=1,
                  **kw)
        try:
            inspect(llm, pp)
            results[pp, micro] = llm.generate(prompts, params, use_tqdm=False)
            if pp > 1:
                split = llm.engine.runner.model.layer_loop.split_steps
                assert (split > 0) == (micro > 1), split
        finally:
            llm.close()
    for two in (results[2, 1], results[2, 2]):
        for one, other in zip(results[1, 1], two):
            assert one.outputs[0].token_ids == other.outputs[0].token_ids and len(one.outputs[0].token_ids) == 6
            lp1 = [t.logprob for t in one.prompt_logprobs[1:]]
            lp2 = [t.logprob for t in other.prompt_logprobs[1:]]
            assert max(abs(a - b) for a, b in zip(lp1, lp2)) < 1e-5
    assert len({tuple(r.outputs[0].token_ids) for r in results[2, 2]}) > 1  # rows in the wrong order would show


# 8-token steps: the short prompts decode beside the long one's prefill chunks, so a step is cut between decode rows
# with the chunk in its last part
ENGINE_PROMPTS = [[1, 2, 3], [7, 8], [5, 17, 42, 99, 3, 250, 7] * 3, [9, 10, 11, 12]]


def test_engine_pp2_greedy_and_prompt_logprobs_equal_one_rank(smol_path):
    # The engine path on each rank: the paged KV cache of its layers, chunked prefill, packed GGUF weights (auto)
    def inspect(llm, pp):
        # rank 0's KV cache holds its 15 layers of 30 (Llama: one group, a tensor per layer)
        assert sum(kv is not None for kv in llm.engine.runner.kv_tensors) == 30 // pp

    _engine_pp2_equals_one_rank(smol_path, ENGINE_PROMPTS, inspect, num_blocks=16, max_num_batched_tokens=8)


def test_engine_pp2_two_kv_groups_equal_one_rank(tmp_path):
    # Gemma 3 with a 4-token window on layers 0 and 2 and full attention on 1 and 3: two KV groups of two layers
    # (cache/kv_groups.py, the full one first), and each rank holds one layer of each, so every step's context on
    # every rank is a GroupedAttention whose micro-batches cut each group's metadata. 4-token blocks: the 21-token
    # prompt's window group releases the blocks its window left while the full group keeps them
    path, _ = build_hf("gemma3", tmp_path, num_hidden_layers=4, sliding_window=4,
                       layer_types=["sliding_attention", "full_attention"] * 2)
    released = []

    def inspect(llm, pp):
        runner, kv = llm.engine.runner, llm.engine.kv
        assert [g.window for g in kv.groups] == [None, 4] and runner.num_kv_groups == 2
        # every rank builds its runner from these groups (executor.send_pool): each holds layers of both
        assert all({runner.layer_group[i] for i in PPStage(r, pp, 4).layers} == {0, 1} for r in range(pp))
        # a block is a page in each of the two tensors the groups share; rank 0's layers 0 and 1 use the first only
        assert [t is not None for t in runner.kv_tensors] == [True, pp == 1]
        free = kv.free

        def counting_free(request_id):  # the window group's released entries (None) when a request ends
            released.append(sum(b is None for t in kv.req_blocks.get(request_id, ()) for b in t))
            free(request_id)
        kv.free = counting_free

    _engine_pp2_equals_one_rank(path, ENGINE_PROMPTS, inspect, num_blocks=32, block_size=4,
                                max_num_batched_tokens=8)
    # in each of the three runs the 27-token request's window group had dropped 5 of its 7 blocks (tokens 0-19)
    assert sorted(released)[-3:] == [5, 5, 5], released


def test_engine_pp2_moe_equals_one_rank(tmp_path):
    # a mixture of experts (8 experts, top-2, every layer sparse; one layer a rank) through the engine's grouped
    # expert kernels: each micro-batch routes its own rows
    path, _ = build_hf("qwen3_moe", tmp_path)

    def inspect(llm, pp):
        assert llm.engine.runner.moe_layers == 2 // pp  # rank 0's layers only

    _engine_pp2_equals_one_rank(path, ENGINE_PROMPTS, inspect, num_blocks=32, max_num_batched_tokens=8)


@pytest.mark.parametrize("flag,size", [("--pipeline-parallel-size", "0"), ("--pipeline-parallel-size", "31"),
                                       ("--pipeline-micro-batches", "0")])
def test_bad_pipeline_sizes_are_refused_with_one_line(flag, size):
    # the embedded model has 30 layers: 31 ranks would leave one without a layer
    r = subprocess.run([sys.executable, "-m", "lmserve.cli", "serve", "--port", str(free_port()), flag, size],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and flag in r.stderr and "Traceback" not in r.stderr
    assert len([line for line in r.stderr.splitlines() if flag in line]) == 1


def test_tp2_x_pp2_logits_equal_one_rank(tmp_path):
    # 4 processes: two stages (one layer each), each split across two tensor-parallel ranks (4 heads, 2 KV heads)
    path, _ = save_tiny_hf(tmp_path, "qwen2")
    ref = one_rank_logits(path)
    got = pp_logits(path, 2, tp=2)
    assert (got - ref).abs().max().item() < 1e-5
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_engine_tp2_x_pp2_greedy_equals_one_rank(tmp_path):
    path = tmp_path / "tiny-llama"  # 8 heads, 2 KV heads
    write_tiny_llama(path)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    got = {}
    for tp, pp in ((1, 1), (2, 2)):
        llm = LLM(str(path), tensor_parallel_size=tp, pipeline_parallel_size=pp, dtype="float32", num_blocks=16,
                  num_threads=1)
        try:
            got[tp] = [o.outputs[0].token_ids for o in llm.generate([[5, 17, 42, 99], [1, 2, 3]], params,
                                                                    use_tqdm=False)]
        finally:
            llm.close()
    assert got[1] == got[2] and all(len(t) == 6 for t in got[1])


# -- through the server ------------------------------------------------------------------------------

SERVE_ARGS = ["--dtype", "float32", "--num-kv-blocks", "64", "--num-threads", "1", "--pipeline-parallel-size", "2"]


def _ranks(pid: int) -> list[int]:
    """The server's worker-rank processes (its multiprocessing spawn children)."""
    out = []
    for child in __import__("psutil").Process(pid).children():
        try:
            if "spawn_main" in " ".join(child.cmdline()):
                out.append(child.pid)
        except Exception:  # gone meanwhile
            continue
    return out


def test_killing_a_rank_mid_request_fails_it_within_5s_and_health(tmp_path):
    path = tmp_path / "tiny-llama"
    write_tiny_llama(path)
    with running_server("--model", str(path), *SERVE_ARGS, env={"TMPDIR": str(tmp_path)}) as s:
        ranks = _ranks(s.proc.pid)
        assert len(ranks) == 1 and httpx.get(s.url + "/health").status_code == 200
        body = {"model": "tiny-llama", "prompt": "w1 w2 w3", "max_tokens": 4, "temperature": 0}
        assert httpx.post(s.url + "/v1/completions", json=body, timeout=60).status_code == 200
        body = {**body, "max_tokens": 500, "ignore_eos": True, "stream": True}  # context: 512
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))  # the ring is running
            os.kill(ranks[0], signal.SIGKILL)
            killed = time.monotonic()
            rest = list(lines)  # the stream ends (with an error event) once the engine fails the request
            ended = time.monotonic() - killed
        assert ended <= 5, f"the request ended {ended:.1f} s after its rank was killed"
        assert any("error" in line for line in rest)
        assert unhealthy_within(s.url, 5, start=killed)
        assert s.proc.wait(timeout=20) == 1


def _long_prompt(seed: int, words: int = 1200) -> str:
    """~1,300 tokens of prose no other prompt shares (no prefix-cache hit)."""
    rng = random.Random(seed)
    vocab = "river stone cloud market lantern orchard violin harbor meadow copper signal winter garden".split()
    return f"Story {seed}: " + " ".join(rng.choice(vocab) for _ in range(words))


def test_killing_a_rank_mid_prefill_and_under_a_non_streamed_request_fails_each_within_5s(smol_path, tmp_path):
    """The embedded model over PP=2 with 32-token prefill chunks, so a long prompt's prefill spans many ring steps.
    A streamed request's rank is killed during its prefill (before its first token: at a third of the same-length
    prompt's TTFT, measured first), on a second server a non-streamed one's while it decodes: each request ends
    within 5 s with an error (the stream's error event; a 5xx in OpenAI's error shape), health fails, the server
    exits 1."""
    args = ["--model", str(smol_path), "--num-threads", "1", "--pipeline-parallel-size", "2",
            "--max-num-batched-tokens", "32", "--max-model-len", "2048"]
    url = "/v1/completions"
    with running_server(*args, env={"TMPDIR": str(tmp_path)}) as s:
        start = time.monotonic()
        r = httpx.post(s.url + url, json={"prompt": _long_prompt(1), "max_tokens": 1}, timeout=120)
        ttft = time.monotonic() - start
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > 1000 and ttft > 0.6, (r.text, ttft)
        body = {"prompt": _long_prompt(2), "max_tokens": 8, "stream": True}
        with httpx.stream("POST", s.url + url, json=body, timeout=30) as r:
            assert r.status_code == 200
            time.sleep(ttft / 3)
            os.kill(_ranks(s.proc.pid)[0], signal.SIGKILL)
            killed = time.monotonic()
            lines = [line for line in r.iter_lines() if line.startswith("data:")]
            ended = time.monotonic() - killed
        assert ended <= 5, f"the request ended {ended:.1f} s after its rank was killed"
        assert lines and "error" in lines[0] and not any('"text"' in line for line in lines), lines[:3]  # no token
        assert unhealthy_within(s.url, 5, start=killed)
        assert s.proc.wait(timeout=20) == 1
    with running_server(*args, env={"TMPDIR": str(tmp_path)}) as s:
        def kill_soon():
            time.sleep(1.0)
            os.kill(_ranks(s.proc.pid)[0], signal.SIGKILL)
            killed.append(time.monotonic())
        killed: list[float] = []
        threading.Thread(target=kill_soon).start()
        r = httpx.post(s.url + url, json={"prompt": "Tell me a long story.", "max_tokens": 1500,
                                          "ignore_eos": True}, timeout=60)
        ended = time.monotonic() - killed[0]
        assert ended <= 5, f"the request ended {ended:.1f} s after its rank was killed"
        assert r.status_code in (500, 503) and set(r.json()["error"]) >= {"message", "type"}, r.text
        assert unhealthy_within(s.url, 5, start=killed[0])
        assert s.proc.wait(timeout=20) == 1
