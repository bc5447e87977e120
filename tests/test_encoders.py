"""Encoder models through the engine (models/bert.py): the real all-MiniLM-L6-v2 against sentence-transformers, tiny
random BERT / XLM-R embedders against sentence-transformers and cross-encoders against its CrossEncoder, each prompt
run whole and padding-free in the engine's steps."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from lmserve.engine.llm import LLM
from lmserve.pooling_params import PoolingParams
from lmserve.sampling_params import SamplingParams
from tests.encoder_models import SENTENCES, build_encoder, build_rotary_encoder, minilm_dir

WORDS = ("retrieval augmented generation needs an embedder a reranker and a language model; the quick brown fox "
         "jumps over the lazy dog while servers answer requests in batches of varying lengths").split()


def mixed_sentences(n: int = 100, seed: int = 0) -> list[str]:
    """n sentences of 1 to 120 words (MiniLM's window is 256 tokens), shuffled lengths."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.choice([1, 3, 8, 20, 45, 80, 120]))).capitalize() + "."
            for _ in range(n)]


def _vectors(llm: LLM, prompts: list, params: PoolingParams | None = None) -> np.ndarray:
    return np.array([o.outputs.embedding for o in llm.embed(prompts, pooling_params=params, use_tqdm=False)])


@pytest.fixture(scope="module")
def minilm():
    path = minilm_dir()
    return path, LLM(str(path), max_num_seqs=64)


def test_minilm_matches_sentence_transformers_single_and_batched(minilm):
    from sentence_transformers import SentenceTransformer

    path, llm = minilm
    texts = mixed_sentences()
    ref = SentenceTransformer(str(path), device="cpu").encode(texts, batch_size=32)  # unit vectors (2_Normalize)
    batched = _vectors(llm, texts)  # the engine batches them, variable lengths in one step
    cos = (batched * ref).sum(1) / np.linalg.norm(batched, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() > 1 - 1e-5, cos.min()
    picks = sorted(range(len(texts)), key=lambda i: len(texts[i]))[::10]  # every length, one at a time
    single = np.stack([_vectors(llm, [texts[i]])[0] for i in picks])
    cos = (single * ref[picks]).sum(1) / np.linalg.norm(single, axis=1)
    assert cos.min() > 1 - 1e-5, cos.min()
    assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks  # every block back


def test_an_encoders_short_steps_run_the_skinny_kernel_where_onednn_is_avx2(minilm):
    """The weight-format transform widens an encoder's skinny steps (layers/formats/linear.py `widen_skinny_steps`):
    the single sentences above ran there, and their vectors matched sentence-transformers'."""
    from lmserve.layers.formats.linear import ENCODER_SKINNY_ROWS, SKINNY_MAX_ROWS, PackedLinear
    from lmserve.utils import cpu_flags

    _, llm = minilm
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, PackedLinear) and m.panels is not None]
    if not layers:
        pytest.skip("no layer runs the skinny kernel here (no native kernels, or oneDNN sums in another order)")
    flags = cpu_flags().split()
    wide = "avx2" in flags and "avx512f" not in flags
    assert {m.skinny_rows for m in layers} == {ENCODER_SKINNY_ROWS if wide else SKINNY_MAX_ROWS}
    # a sentence's vector is the same bits alone (a step of 9-64 tokens: the skinny kernel past its decoders' 8 rows,
    # composed GELU and adds, the native LayerNorm) as in one step with 11 others (284 tokens: oneDNN, fused where
    # exact)
    texts = mixed_sentences(12, seed=3)
    short = max((t for t in texts if len(llm.engine.tokenizer.encode(t)) in range(9, 65)), key=len)
    alone = _vectors(llm, [short])[0]
    batched = _vectors(llm, texts)[texts.index(short)]
    assert np.array_equal(alone, batched)


EMBED = SamplingParams(max_tokens=1, pooling=PoolingParams())


def test_an_encoders_kv_pool_is_one_steps_accounting_and_holds_the_worst_step(minilm):
    """No KV is kept between an encoder's steps: its pool is the blocks of one step's prompts, not the memory budget
    (on CUDA that budget was allocated and zeroed beside any chat model on the GPU). The worst step for it: every
    prompt one token past a block boundary (two blocks for 17 tokens), as many as the step's tokens allow."""
    from lmserve.cache.sizing import blocks_for

    path, _ = minilm
    llm = LLM(str(path), max_num_seqs=40, max_num_batched_tokens=680, kv_cache_memory=0.9)  # a budget it ignores
    sched = llm.engine.cfg.scheduler
    assert llm.engine.num_blocks == blocks_for(sched.max_num_batched_tokens, llm.engine.block_size) + 40
    # no KV tensor behind the accounting: the runner holds its scratch block alone (on CUDA it was the whole budget)
    assert all(t is None or t.shape[1] == 1 for t in llm.engine.runner.kv_tensors)
    ids = llm.engine.front.tokenize_prompt("a")  # [CLS] a [SEP]
    prompts = [ids[:1] + [ids[1]] * 15 + ids[-1:] for _ in range(100)]  # 17 tokens each: 40 a step, 2 blocks each
    for i, p in enumerate(prompts):
        llm.engine.add_request(f"w{i}", p, EMBED)
    batches = []
    while llm.engine.has_unfinished():
        llm.engine.step()
        batches.append(llm.engine.last_step.batch_size)
    assert batches == [40, 40, 20], batches  # the pool never holds a step back: the scheduler's limits do
    assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks  # every block back


def test_kv_offload_for_an_encoder_is_refused_naming_why(minilm):
    from lmserve.errors import ConfigError

    with pytest.raises(ConfigError, match="an encoder keeps no KV"):
        LLM(str(minilm[0]), kv_offload_memory=2**26)


def test_a_windowed_encoders_pool_holds_its_longest_input_in_every_kv_group(tmp_path):
    """ModernBERT's local layers are a KV group of their own: a request takes its blocks in each group, so the pool is
    one step's blocks times the groups (a review found one group's worth refusing a max_model_len input)."""
    from lmserve.cache.sizing import blocks_for

    llm = LLM(str(build_rotary_encoder(tmp_path, "modernbert")), max_num_seqs=1, max_num_batched_tokens=128)
    groups = len(llm.engine.kv.groups)
    assert groups > 1  # global and local layers
    assert llm.engine.num_blocks == (blocks_for(128, llm.engine.block_size) + 1) * groups
    longest = [2] + [7] * (llm.engine.max_model_len - 2) + [3]
    assert len(_vectors(llm, [longest, longest[:20], longest])) == 3
    assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks
    # several at once (the +max_num_seqs of each group): 4 inputs of 17 tokens, 2 blocks each in each group
    wide = LLM(str(build_rotary_encoder(tmp_path / "wide", "modernbert")), max_num_seqs=4, max_num_batched_tokens=128)
    for i in range(8):
        wide.engine.add_request(f"x{i}", longest[:16] + [3], EMBED)
    batches = []
    while wide.engine.has_unfinished():
        wide.engine.step()
        batches.append(wide.engine.last_step.batch_size)
    assert batches == [4, 4], batches


def test_minilm_window_is_sentence_transformers_max_seq_length(minilm):
    _, llm = minilm
    assert llm.engine.max_model_len == 256  # sentence_bert_config.json, under the 512 positions of config.json
    assert llm.engine.front.tasks == ("embed", "score", "rerank")


@pytest.mark.parametrize("kind,pooling,normalize", [("bert", "mean", True), ("bert", "max", False),
                                                    ("bert", "last", True), ("xlm-roberta", "cls", True)])
def test_tiny_embedders_match_sentence_transformers(tmp_path, kind, pooling, normalize):
    """Each pooling mode read from 1_Pooling/config.json (`last`: pooling_mode_lasttoken, each text's closing
    [SEP], which sits at a different row for each length in the step)."""
    from sentence_transformers import SentenceTransformer

    path = build_encoder(tmp_path, kind, pooling=pooling, normalize=normalize)
    ref = SentenceTransformer(str(path), device="cpu").encode(SENTENCES, normalize_embeddings=True)
    llm = LLM(str(path))
    assert llm.engine.front.pooler.method == pooling  # from the checkpoint's files, not a default
    got = _vectors(llm, SENTENCES)
    assert np.abs(got - ref).max() < 1e-4


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta"])
def test_tiny_cross_encoders_match_sentence_transformers(tmp_path, kind):
    from sentence_transformers import CrossEncoder

    path = build_encoder(tmp_path, kind, num_labels=1, pooling=None)
    pairs = [(q, d) for q in SENTENCES[:2] for d in SENTENCES]
    ref = CrossEncoder(str(path), device="cpu").predict(pairs)  # sigmoid of the one logit (its default activation)
    llm = LLM(str(path))
    assert llm.engine.front.tasks == ("score", "rerank", "classify")
    ids = [llm.tokenizer.encode_pair(q, d) for q, d in pairs]
    got = _vectors(llm, ids)[:, 0]
    assert np.abs(got - ref).max() < 1e-4
    with pytest.raises(Exception, match="does not generate"):
        llm.generate(["a dog"], use_tqdm=False)


def test_bert_classifier_softmax_matches_transformers(tmp_path):
    import transformers

    path = build_encoder(tmp_path, "bert", num_labels=3, pooling=None)
    ref_model = transformers.AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    llm = LLM(str(path))
    ids = [llm.tokenizer.encode(t) for t in SENTENCES]
    with torch.no_grad():
        ref = np.stack([ref_model(torch.tensor([x])).logits[0].softmax(-1).numpy() for x in ids])
    assert np.abs(_vectors(llm, ids) - ref).max() < 1e-4


@pytest.mark.parametrize("lens,groups", [([5, 1, 17, 9, 17], 4), ([12, 10, 14], 1), ([30, 2, 3, 40, 29], 2)])
def test_padded_attention_equals_the_per_sequence_reference(lens, groups):
    """Sequences padded group by group (lengths within GROUP_SPREAD of each other), in any order in the step."""
    from lmserve.models.bert import bidirectional_padded, bidirectional_ref, step_sequences

    torch.manual_seed(0)
    positions = torch.cat([torch.arange(n) for n in lens])
    qkv = torch.randn(sum(lens), 3, 4, 16)
    seqs = step_sequences(positions, sum(lens))
    assert seqs.lens == lens and len(seqs.groups) == groups
    assert torch.allclose(bidirectional_padded(qkv, seqs), bidirectional_ref(qkv, lens), atol=1e-5)


@pytest.mark.parametrize("window", [None, 0, 3, 40])
@pytest.mark.parametrize("lens,heads,dim", [([5, 1, 17, 9, 17], 4, 16), ([128, 16, 77, 1, 250], 12, 32),
                                            ([3], 2, 64), ([33, 7], 3, 24)])
def test_native_encoder_attention_equals_the_per_sequence_reference(lens, heads, dim, window):
    """csrc/encoder_attention.cpp straight from the packed rows (no padding), any head size, windowed or not; a
    sequence's rows are the same bits whatever shares its step (batch invariance)."""
    from lmserve.layers.kernels.fused import encoder_attention
    from lmserve.layers.kernels.native import native_module
    from lmserve.models.bert import bidirectional, bidirectional_ref, step_sequences

    if native_module() is None:
        pytest.skip("native kernels unavailable")
    torch.manual_seed(0)
    positions = torch.cat([torch.arange(n) for n in lens])
    qkv = torch.randn(sum(lens), 3, heads, dim)
    seqs = step_sequences(positions, sum(lens))
    got = bidirectional(qkv, seqs, window)
    assert torch.equal(got, encoder_attention(qkv, seqs.starts, window))
    assert "groups" not in vars(seqs)  # the native path builds no padded groups (host work it never reads)
    assert torch.allclose(got, bidirectional_ref(qkv.double(), lens, window).float(), atol=1e-5)
    last = lens[-1]
    alone = encoder_attention(qkv[-last:].contiguous(), torch.tensor([0, last]), window)
    assert torch.equal(alone, got[-last:])


def test_native_encoder_attention_refuses_bad_bounds():
    from lmserve.layers.kernels.native import native_module

    mod = native_module()
    if mod is None:
        pytest.skip("native kernels unavailable")
    qkv = torch.randn(6, 3, 2, 8)
    for starts in ([0, 5], [0, 3, 3, 6], [1, 6]):
        with pytest.raises(RuntimeError, match="encoder_attention"):
            mod.encoder_attention(qkv, torch.tensor(starts), 0.3)


@pytest.mark.parametrize("kind,pooling", [("modernbert", "mean"), ("modernbert", "cls"), ("modernbert_hub", "mean"),
                                          ("nomic_bert", "mean"), ("nomic_bert_hub", "mean")])
def test_rotary_embedders_match_sentence_transformers(tmp_path, kind, pooling):
    """ModernBERT (global and ±4-token local layers: the 19-token sentence crosses the window) and NomicBERT, the
    reference always transformers' own (loaded before a released-form config.json replaces the one it saved)."""
    from sentence_transformers import SentenceTransformer

    path = build_rotary_encoder(tmp_path, kind.removesuffix("_hub"), pooling=pooling)
    ref = SentenceTransformer(str(path), device="cpu").encode(SENTENCES, normalize_embeddings=True)
    if kind.endswith("_hub"):
        path = build_rotary_encoder(tmp_path / "hub", kind, pooling=pooling)
    llm = LLM(str(path))
    got = _vectors(llm, SENTENCES)  # one step, every length
    assert np.abs(got - ref).max() < 1e-4
    alone = _vectors(llm, SENTENCES[2:3])  # alone in its step: the unpadded reference path
    assert np.abs(alone - ref[2:3]).max() < 1e-4


def test_modernbert_classifier_matches_transformers(tmp_path):
    import transformers

    path = build_rotary_encoder(tmp_path, "modernbert", num_labels=3, pooling=None)
    ref_model = transformers.AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    llm = LLM(str(path))
    assert llm.engine.front.tasks == ("classify",)
    ids = [llm.tokenizer.encode(t) for t in SENTENCES]
    with torch.no_grad():
        ref = np.stack([ref_model(torch.tensor([x])).logits[0].softmax(-1).numpy() for x in ids])
    assert np.abs(_vectors(llm, ids) - ref).max() < 1e-4


def test_windowed_padded_attention_equals_the_reference():
    from lmserve.models.bert import bidirectional_padded, bidirectional_ref, step_sequences

    torch.manual_seed(0)
    lens = [5, 1, 17, 9]
    positions = torch.cat([torch.arange(n) for n in lens])
    qkv = torch.randn(sum(lens), 3, 4, 16)
    seqs = step_sequences(positions, sum(lens))
    assert torch.allclose(bidirectional_padded(qkv, seqs, 3), bidirectional_ref(qkv, lens, 3), atol=1e-5)
