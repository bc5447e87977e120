"""Embeddings in the engine: pooling requests batched by the scheduler (chunked, preempted, beside generations),
their vectors equal to sentence-transformers' and transformers' pooled hidden states (float32, 1e-5), and the
offline API as vLLM spells it (LLM.embed, LLM.generate(lora_request=...)). Every engine is pinned to float32, the
references' dtype: --dtype auto picks bf16 on an AMX CPU where it measures bf16 faster (cpu_dtype.py)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from lmserve import LLM, LoRARequest, PoolingParams, SamplingParams
from lmserve.errors import CheckpointError, RequestRejected
from lmserve.loader.pooling import pooler_config
from tests.embedding_models import TEXTS, hf_pooled, st_dir, st_reference  # noqa: F401  (fixtures)
from tests.tiny_models import build_hf

ATOL = 1e-5


@pytest.fixture(scope="module")
def reference(st_reference):
    return st_reference  # (ids, [N, H] vectors)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return build_hf("qwen3", tmp_path_factory.mktemp("qwen3"))[0]  # a plain decoder: no sentence-transformers files


@pytest.fixture(scope="module")
def mean_llm(st_dir):
    # a 16-token budget: the 40-token text runs in three chunks
    return LLM(str(st_dir), dtype="float32", num_blocks=64, max_num_batched_tokens=16)


def _vectors(outputs) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in outputs])


def test_mean_pooling_from_the_checkpoint_equals_sentence_transformers(mean_llm, reference):
    ids, expected = reference
    assert mean_llm.engine.front.pooler.method == "mean"
    outs = mean_llm.embed(ids, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == ids
    torch.testing.assert_close(_vectors(outs), expected, atol=ATOL, rtol=0)
    # text in, the same ids and vectors (lmserve's tokenizer agrees with the checkpoint's)
    texts = mean_llm.embed(TEXTS, use_tqdm=False)
    assert [o.prompt_token_ids for o in texts] == ids
    torch.testing.assert_close(_vectors(texts), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("method", ["last", "cls"])
def test_last_token_and_cls_pooling_equal_transformers(qwen3_dir, method):
    path = qwen3_dir
    ids = [[5, 9, 11, 40, 3], list(range(20, 60)), [7]]
    llm = LLM(str(path), dtype="float32", num_blocks=32, max_num_batched_tokens=16,
              **({"pooling": "cls"} if method == "cls" else {}))
    assert llm.engine.front.pooler.method == method  # last: the default without the checkpoint files
    torch.testing.assert_close(_vectors(llm.embed(ids, use_tqdm=False)), hf_pooled(path, ids, method),
                               atol=ATOL, rtol=0)


def test_dimensions_keep_the_first_components_renormalised_and_normalize_false_is_raw(mean_llm, reference):
    ids, expected = reference
    cut = _vectors(mean_llm.embed(ids, pooling_params=PoolingParams(dimensions=16), use_tqdm=False))
    torch.testing.assert_close(cut, F.normalize(expected[:, :16], dim=-1), atol=ATOL, rtol=0)
    raw = _vectors(mean_llm.embed(ids, pooling_params=PoolingParams(normalize=False), use_tqdm=False))
    assert (raw.norm(dim=-1) - 1).abs().max() > 1e-2
    torch.testing.assert_close(F.normalize(raw, dim=-1), expected, atol=ATOL, rtol=0)


def test_pooling_requests_run_beside_a_generation_finish_after_their_prompt_and_free_their_blocks(mean_llm, reference):
    ids, expected = reference
    engine = mean_llm.engine
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    alone = mean_llm.generate([[3, 4, 5]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    engine.add_request("gen", [3, 4, 5], greedy)
    engine.add_request("short", ids[0], SamplingParams(max_tokens=1, pooling=PoolingParams()))
    first = {d.request_id: d for d in engine.step()}
    assert first["short"].finished and first["short"].token_ids == [] and not first["gen"].finished
    assert "short" not in engine.scheduler.requests  # finished after its prompt: no decode, no KV kept
    torch.testing.assert_close(torch.tensor(first["short"].embedding), expected[0], atol=ATOL, rtol=0)
    tokens = list(first["gen"].token_ids)
    while engine.has_unfinished():
        tokens += [t for d in engine.step() for t in d.token_ids]
    assert tokens == alone  # the generation sampled as it does alone
    assert engine.kv.num_free_blocks == engine.num_blocks


def test_a_preempted_pooling_request_starts_over_and_pools_the_same(st_dir, reference):
    ids, expected = reference
    # 5 blocks of 16: the generation grows into the blocks the 40-token pooling request holds, which is newer
    llm = LLM(str(st_dir), dtype="float32", num_blocks=5, max_num_batched_tokens=16)
    engine = llm.engine
    engine.add_request("gen", list(range(10, 40)), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    engine.add_request("pool", ids[2], SamplingParams(max_tokens=1, pooling=PoolingParams()))
    vector = None
    while engine.has_unfinished():
        for d in engine.step():
            vector = d.embedding if d.request_id == "pool" and d.finished else vector
    assert engine.scheduler.num_preemptions >= 1
    torch.testing.assert_close(torch.tensor(vector), expected[2], atol=ATOL, rtol=0)
    assert engine.kv.num_free_blocks == engine.num_blocks


def _pool(engine, rid: str, ids: list[int]):
    engine.add_request(rid, ids, SamplingParams(max_tokens=1, pooling=PoolingParams()))
    while engine.has_unfinished():
        for d in engine.step():
            if d.finished:
                return d


def test_prefix_cache_serves_last_token_pooling_and_is_skipped_for_mean(st_dir, mean_llm):
    last = LLM(str(st_dir), dtype="float32", num_blocks=32, pooling="last").engine
    prompt = list(range(3, 50))
    a, b = _pool(last, "a", prompt), _pool(last, "b", prompt)
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 32  # two full blocks of 16 reused
    torch.testing.assert_close(torch.tensor(b.embedding), torch.tensor(a.embedding), atol=ATOL, rtol=0)
    mean = mean_llm.engine
    c, d = _pool(mean, "c", prompt), _pool(mean, "d", prompt)
    assert c.num_cached_tokens == d.num_cached_tokens == 0  # mean reads every token's hidden state
    assert c.embedding == d.embedding


def test_bad_pooling_requests_are_refused_before_the_engine(mean_llm):
    with pytest.raises(RequestRejected, match="context"):
        mean_llm.embed([[5] * 257], use_tqdm=False)  # max_position_embeddings 256
    with pytest.raises(RequestRejected, match="dimensions"):
        mean_llm.embed(["w1"], pooling_params=PoolingParams(dimensions=129), use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions"):
        PoolingParams(dimensions=0)
    with pytest.raises(ValueError, match="pooling request"):
        SamplingParams(n=2, pooling=PoolingParams())
    assert not mean_llm.engine.has_unfinished()
    assert mean_llm.engine.kv.num_free_blocks == mean_llm.engine.num_blocks
    # a whole-context prompt fits: nothing is generated after it
    assert len(mean_llm.embed([[5] * 256], use_tqdm=False)[0].outputs.embedding) == 128


def test_pooling_config_comes_from_the_sentence_transformers_files_or_the_flag(tmp_path, st_dir):
    assert (pooler_config(st_dir, None).method, pooler_config(st_dir, None).source) == ("mean", "1_Pooling/config.json")
    assert pooler_config(st_dir, "cls").method == "cls"  # --pooling overrides the files
    assert pooler_config(tmp_path, None).method == "last"  # no modules.json: vLLM's default for decoder LMs
    bad = tmp_path / "bad"
    (bad / "1_Pooling").mkdir(parents=True)
    (bad / "modules.json").write_text((st_dir / "modules.json").read_text())
    (bad / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_weightedmean_tokens": True}))
    with pytest.raises(CheckpointError, match="pooling_mode_weightedmean_tokens is not supported"):
        pooler_config(bad, None)
    (bad / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    assert pooler_config(bad, None).method == "max"  # a running maximum (worker/pooler.py)


def test_generate_takes_vllms_lora_request(tmp_path, st_dir, mean_llm):
    from tests.lora_adapters import make_peft_adapter, peft_reference, reference_logits

    path = st_dir  # the tiny Llama under the sentence-transformers files
    adapter = make_peft_adapter(tmp_path / "adapter", path, rank=8)
    llm = LLM(str(path), dtype="float32", num_blocks=32, enable_lora=True, max_lora_rank=8)
    prompt, greedy = [5, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    req = LoRARequest("sql", 1, str(adapter))
    with_adapter = llm.generate([prompt], greedy, use_tqdm=False, lora_request=req)[0].outputs[0].token_ids
    base = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    expected, seq = [], list(prompt)
    with peft_reference(path, adapter) as ref:
        for _ in range(4):
            expected.append(int(reference_logits(ref, seq)[-1].argmax()))
            seq.append(expected[-1])
    assert with_adapter == expected != base
    # the same name again is the registered adapter; per-prompt adapters (None: the base model)
    outs = llm.generate([prompt, prompt], greedy, use_tqdm=False, lora_request=[req, None])
    assert [o.outputs[0].token_ids for o in outs] == [expected, base]
    with pytest.raises(ValueError, match="enable_lora"):
        mean_llm.generate([prompt], greedy, use_tqdm=False, lora_request=req)  # an LLM without enable_lora


def test_a_headless_checkpoint_loads_and_pools(tmp_path, qwen3_dir):
    """Embedding models saved as the base model alone (Qwen3-Embedding: `layers.0...`, tied, no LM head) load."""
    from safetensors.torch import load_file, save_file

    path = qwen3_dir
    headless = tmp_path / "headless"
    headless.mkdir()
    tensors = load_file(str(path / "model.safetensors"))
    save_file({k.removeprefix("model."): v for k, v in tensors.items() if not k.startswith("lm_head.")},
              str(headless / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    (headless / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (headless / name).write_text((path / name).read_text())
    ids = [[5, 9, 11, 40, 3], list(range(20, 60))]
    llm = LLM(str(headless), dtype="float32", num_blocks=32)
    torch.testing.assert_close(_vectors(llm.embed(ids, use_tqdm=False)), hf_pooled(path, ids, "last"),
                               atol=ATOL, rtol=0)
