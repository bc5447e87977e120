"""GGUF blocks kept quantized (`--quantization gguf`): repacking against the gguf package's own dequantization,
the native int8-dot kernel against the dequantize-then-matmul reference for every type on odd shapes,
batch invariance, and the embedded model served from its Q4_1/Q8_0 blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from lmserve.layers.formats.gguf_embedding import GGUFEmbedding
from lmserve.layers.formats.gguf_linear import (
    BLOCK_BYTES,
    GGUFLinear,
    dequantize,
    pack,
    quantize_activations,
    reference_linear,
    repack,
    unpack,
)
from lmserve.layers.kernels.native import native_module

# byte offsets of each type's float16 fields (ggml's block structs)
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
              "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,), "MXFP4": ()}
E8M0_FIELDS = {"MXFP4": 0}  # byte offset of an exponent byte (2 ** (e - 128)): set to a realistic range
BLOCK_WEIGHTS = {t: (256 if t.endswith("_K") or t == "IQ4_XS" else 32) for t in BLOCK_BYTES}


def random_blocks(kind: str, n: int, k: int, seed: int) -> np.ndarray:
    """Valid random blocks: random codes and scale bytes, float16 fields set to small finite values."""
    rng = np.random.default_rng(seed)
    per_row = k // BLOCK_WEIGHTS[kind]
    raw = rng.integers(0, 256, size=(n, per_row, BLOCK_BYTES[kind]), dtype=np.uint8)
    for off in F16_FIELDS[kind]:
        vals = rng.uniform(0.002, 0.03, size=(n, per_row)).astype(np.float16)
        raw[..., off:off + 2] = vals[..., None].view(np.uint8).reshape(n, per_row, 2)
    if kind in E8M0_FIELDS:
        raw[..., E8M0_FIELDS[kind]] = rng.integers(118, 124, size=(n, per_row), dtype=np.uint8)
    return raw.reshape(n, -1)


def mapped_rss(path) -> int:
    """Bytes of `path`'s mappings resident in this process (/proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):
            inside = fields[-1] == str(path) if len(fields) >= 6 else False
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


def shape_for(kind: str, n: int = 37) -> tuple[int, int]:
    # odd row count (the row layout); K-quants 3 superblocks; simple types 33 blocks (the AVX-512 loop's block
    # pairs, its lone last block, and its offset sum over 16 blocks then a masked remainder). n = 48: whole groups
    # of 16 rows, which an AVX-512 VNNI build reads in the packed layout.
    return (n, 768) if BLOCK_WEIGHTS[kind] == 256 else (n, 1056)


def packs_here() -> bool:
    """Whether this machine's kernel reads whole 16-row groups in the packed layout (every x86-64 level's build)."""
    mod = native_module()
    return mod is not None and mod.quant_packed_rows() == 16


@pytest.mark.parametrize("kind", sorted(BLOCK_BYTES))
def test_repacked_weights_equal_the_gguf_packages_dequantization(kind):
    n, k = shape_for(kind)
    raw = random_blocks(kind, n, k, seed=1)
    want = gguf_dequantize(raw, GGMLQuantizationType[kind]).reshape(n, k)
    got = dequantize(repack(kind, raw, n, k)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_mxfp4_exponents_as_ggml_reads_them():
    """Every E8M0 byte -> the gguf package's 2 ** (e - 128), subnormal ones included, bit for bit."""
    from gguf.quants import MXFP4

    from lmserve.layers.formats.gguf_linear import e8m0_half

    e = np.arange(256, dtype=np.uint8)
    assert np.array_equal(e8m0_half(e).view(np.uint32), MXFP4.e8m0_to_fp32_half(e).view(np.uint32))


needs_native = pytest.mark.skipif(native_module() is None, reason="native kernels unavailable (no compiler)")


@pytest.mark.parametrize("kind", sorted(BLOCK_BYTES))
def test_packing_is_a_regrouping_that_unpack_inverts(kind):
    n, k = shape_for(kind, 48)
    w = repack(kind, random_blocks(kind, n, k, seed=6), n, k)
    p = pack(w)
    assert p.codes.nbytes == w.codes.nbytes and p.codes.shape[:2] == (3, k // 32)
    # lane i of group g holds row 16 g + i's scale; the packed bytes are the row's bytes (S8: + 128)
    assert p.scales[2, 2, 7] == w.scales[39, 2]
    back = unpack(p)
    assert back.codes.dtype == w.codes.dtype and np.array_equal(back.codes, w.codes)
    assert np.array_equal(back.scales, w.scales) and (w.mins is None or np.array_equal(back.mins, w.mins))
    assert np.array_equal(dequantize(back).numpy(), dequantize(w).numpy())


@needs_native
@pytest.mark.parametrize("n", [37, 48])
@pytest.mark.parametrize("kind", sorted(BLOCK_BYTES))
def test_kernel_equals_the_dequantize_then_matmul_reference(kind, n):
    n, k = shape_for(kind, n)
    w = repack(kind, random_blocks(kind, n, k, seed=2), n, k)
    layer = GGUFLinear(w, k, torch.randn(n))
    assert layer.packed == (n == 48 and packs_here())
    assert np.array_equal(layer.repacked().codes, w.codes)  # the row layout back, whichever is held
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(3))
    ref = reference_linear(x, w, layer.bias)
    for m in (1, 3, 17, 37):
        out = layer(x[:m])
        torch.testing.assert_close(out, ref[:m], rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    # a row's result never depends on the rows beside it (nor on its place in the packed kernel's tiles: 4 rows, and
    # 16 for S8 on AVX-512; U8, NL4, K2 and K3 at 1 or 2 rows take 2 parts a pass on the narrow builds)
    full = layer(x)
    assert all(torch.equal(layer(x[m:m + 1]), full[m:m + 1]) for m in (0, 5, 16, 21, 36))
    assert torch.equal(layer(x[2:9]), full[2:9]) and torch.equal(layer(x[3:19]), full[3:19])
    assert torch.equal(layer(x[5:7]), full[5:7])
    # nor on the packed kernel's passes of 128 rows (a prefill's): rows on both sides of a pass's edge, alone and
    # in a call that starts mid-pass
    long = torch.randn(300, k, generator=torch.Generator().manual_seed(4))
    whole = layer(long)
    assert all(torch.equal(layer(long[m:m + 1]), whole[m:m + 1]) for m in (0, 127, 128, 255, 256, 299))
    assert torch.equal(layer(long[100:290]), whole[100:290])
    assert torch.equal(layer(long[:129]), whole[:129]) and torch.equal(layer(long[:258]), whole[:258])  # 1-2-row passes


@pytest.mark.parametrize("n", [37, 48])
@pytest.mark.parametrize("kind", ["Q2_K", "Q3_K"])
def test_low_bit_k_quants_are_held_near_their_file_size(kind, n):
    """Q2_K and Q3_K keep their 2- and 3-bit planes and their integer scales per 16 (row layout and packed): within
    6% of the file's bytes (per 256 weights Q2_K holds 88 bytes against 84, Q3_K 116 against 110: float d and dmin
    where the file has float16, and Q3_K's 6-bit scales a byte each)."""
    n, k = shape_for(kind, n)
    layer = GGUFLinear(repack(kind, random_blocks(kind, n, k, seed=8), n, k), k, None)
    held = sum(t.nbytes for t in (layer.codes, layer.scales, layer.mins) if t is not None)
    assert held <= 1.06 * (n * k // 256) * BLOCK_BYTES[kind]


@needs_native
def test_native_activation_codes_equal_the_reference_bit_for_bit():
    """The vectorized int8 quantization rounds exactly as the reference: halves to even, one scale per block."""
    k = 1056
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(5)) * 3
    x[1, :32] = torch.tensor([127.0] + [v + 0.5 for v in range(-15, 16)])  # scale 1: every other value a tie
    x[2, 32:64] = 0  # a zero block
    x[3, 64:96] = -1e-30  # a block of tiny values
    buf = native_module().quantize_activations(x)
    nb = k // 32
    codes = buf[:, :k].float()
    floats = buf[:, k:].contiguous().view(torch.float32)
    q, scale = quantize_activations(x)
    assert torch.equal(codes, q)
    assert torch.equal(floats[:, :nb], scale)
    sums = q.view(9, nb, 32).sum(-1)
    assert torch.equal(floats[:, nb:], scale * sums)


@needs_native
@pytest.mark.parametrize("kind", sorted(BLOCK_BYTES))
def test_zero_rows_and_a_zero_block_of_activations(kind):
    """Every kind (each takes its own tiles at 0, 1 and 2 rows): no rows give an empty result, and a block whose
    activation scale is 0 gives codes of 0, not NaN."""
    n, k = shape_for(kind, 48)
    w = repack(kind, random_blocks(kind, n, k, seed=4), n, k)
    layer = GGUFLinear(w, k, None)
    x = torch.randn(2, k)
    x[0, :32] = 0
    ref = reference_linear(x, w, None)
    torch.testing.assert_close(layer(x), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert layer(torch.zeros(0, k)).shape == (0, n)


def test_refused_where_it_cannot_run(tmp_path):
    from lmserve.loader import load_model
    from tests.conftest import write_tiny_llama

    with pytest.raises(ValueError, match="runs on CPU"):
        load_model(None, torch.float32, torch.device("meta"), quantization="gguf")
    write_tiny_llama(tmp_path / "tiny")
    with pytest.raises(ValueError, match="safetensors checkpoint"):
        load_model(tmp_path / "tiny", torch.float32, torch.device("cpu"), quantization="gguf")
    with pytest.raises(ValueError, match="cannot be kept quantized"):
        repack("IQ2_XS", np.zeros((1, 66), np.uint8), 1, 256)


@needs_native
def test_embedded_model_from_its_own_blocks():
    """The embedded Q4_1 file with --quantization gguf: every projection and the tied LM head read the file's
    blocks, and so does the embedding lookup (no float32 table); logits stay close to the float (dequantized) model's; a request's greedy tokens are the same
    alone and in a batch (batch invariance); no KV block leaks."""
    from lmserve.config import CacheConfig, EngineConfig
    from lmserve.engine.llm_engine import LLMEngine
    from lmserve.layers.attention.context import ContiguousAttention
    from lmserve.sampling_params import SamplingParams
    from tests.test_engine import PROMPTS, assert_no_leak, run

    eng = LLMEngine(EngineConfig(quantization="gguf", cache=CacheConfig(num_blocks=256)))
    model = eng.loaded.model
    layers = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    assert len(layers) == 4 * eng.model_config.num_layers + 1 and isinstance(model.lm_head, GGUFLinear)
    float_eng = LLMEngine(EngineConfig(quantization="none", dtype="float32", cache=CacheConfig(num_blocks=16)))
    ids = eng.tokenizer.encode_prompt(" ".join(PROMPTS))[:256]
    x, pos = torch.tensor(ids), torch.arange(len(ids))
    with torch.inference_mode():
        lq = model.compute_logits(model(x, pos, ContiguousAttention([len(ids)])))
        lf = float_eng.loaded.model.compute_logits(float_eng.loaded.model(x, pos, ContiguousAttention([len(ids)])))
    assert (lq.argmax(-1) == lf.argmax(-1)).float().mean().item() > 0.9
    # the embedding table is no second float copy: rows come from the head's blocks, the float table's exact numbers
    emb = model.model.embed_tokens
    assert isinstance(emb, GGUFEmbedding) and emb.codes.data_ptr() == model.lm_head.codes.data_ptr()
    assert all(t.numel() < emb.num_embeddings * emb.embedding_dim for t in model.parameters())
    probe = torch.tensor([[0, 1, 17], [eng.model_config.vocab_size - 1, 500, 3]])
    with torch.inference_mode():
        assert torch.equal(emb(probe), float_eng.loaded.model.model.embed_tokens(probe))
    # nor is the file's map: both loads read all of it, and neither keeps its pages resident afterwards
    size = eng.loaded.path.stat().st_size
    assert mapped_rss(eng.loaded.path) < min(16 * 2**20, size / 4), (mapped_rss(eng.loaded.path), size)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = {str(i): run(eng, [p], params)["0"]["ids"] for i, p in enumerate(PROMPTS[:6])}
    together = run(eng, PROMPTS[:6], params)
    assert {k: v["ids"] for k, v in together.items()} == alone
    assert_no_leak(eng)


@needs_native
def test_lora_delta_runs_beside_the_gguf_blocks(tmp_path):
    """--enable-lora on --quantization gguf: every adapted projection keeps its GGUF blocks (the delta is added
    beside the quantized matmul, never merged); the adapter changes the output; a batch mixing the adapter and
    the base gives each request's tokens alone."""
    from lmserve.config import CacheConfig, EngineConfig, LoraConfig
    from lmserve.engine.llm_engine import LLMEngine
    from lmserve.loader import default_model_path, read_model_config
    from lmserve.sampling_params import SamplingParams
    from tests.lora_adapters import write_random_adapter

    adapter = write_random_adapter(tmp_path / "a", read_model_config(default_model_path()), rank=8)
    eng = LLMEngine(EngineConfig(quantization="gguf", cache=CacheConfig(num_blocks=64),
                                 lora=LoraConfig((("a", str(adapter)),), max_loras=1, max_cpu_loras=1, max_lora_rank=8)))
    assert {type(w.base).__name__ for w in eng.lora_slots.wrappers} == {"GGUFLinear"}
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    lora = eng.loras.get("a")

    def run(requests):
        for rid, l in requests:
            eng.add_request(rid, "Tell me about the sea.", params, lora=l)
        out = {rid: [] for rid, _ in requests}
        while eng.has_unfinished():
            for d in eng.step():
                out[d.request_id] += d.token_ids
        return out

    alone_base, alone_lora = run([("b", None)])["b"], run([("l", lora)])["l"]
    assert alone_lora != alone_base
    assert run([("b", None), ("l", lora)]) == {"b": alone_base, "l": alone_lora}
    assert eng.kv.num_free_blocks == eng.num_blocks


# the low-bit types that Q2_K / Q3_K_S / Q3_K_M / IQ4_XS files mix in, one per projection, embedding and head
LOW_BIT = {"attn_q": "Q2_K", "attn_k": "Q3_K", "attn_v": "IQ4_NL", "attn_output": "IQ4_XS", "ffn_gate": "Q3_K",
           "ffn_up": "IQ4_NL", "ffn_down": "Q2_K", "token_embd": "Q2_K", "output": "IQ4_XS"}


def write_low_bit_gguf(path, hidden: int = 256, inter: int = 512, vocab: int = 256, layers: int = 2) -> None:
    """A llama GGUF whose matrices are random valid blocks of the LOW_BIT types (the gguf package cannot quantize to
    them), norms float32; K-quant rows are whole superblocks, so hidden and inter are multiples of 256."""
    import gguf

    rng = np.random.default_rng(7)
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((w.add_block_count, layers), (w.add_context_length, 128), (w.add_embedding_length, hidden),
                       (w.add_feed_forward_length, inter), (w.add_head_count, 2), (w.add_head_count_kv, 1),
                       (w.add_layer_norm_rms_eps, 1e-5), (w.add_rope_freq_base, 10000.0)):
        add(value)

    def matrix(name: str, rows: int, cols: int) -> None:
        kind = LOW_BIT[name.split(".")[-2]]
        raw = random_blocks(kind, rows, cols, seed=int(rng.integers(1 << 30)))
        w.add_tensor(name, raw, raw_dtype=GGMLQuantizationType[kind])

    def norm(name: str) -> None:
        w.add_tensor(name, (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))

    matrix("token_embd.weight", vocab, hidden)
    norm("output_norm.weight")
    matrix("output.weight", vocab, hidden)
    for i in range(layers):
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
        for name, rows, cols in (("attn_q", hidden, hidden), ("attn_k", hidden // 2, hidden),
                                 ("attn_v", hidden // 2, hidden), ("attn_output", hidden, hidden),
                                 ("ffn_gate", inter, hidden), ("ffn_up", inter, hidden), ("ffn_down", hidden, inter)):
            matrix(f"blk.{i}.{name}.weight", rows, cols)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@needs_native
def test_a_low_bit_model_decodes_the_reference_paths_greedy_tokens(tmp_path, monkeypatch):
    """A whole model in Q2_K, Q3_K, IQ4_NL and IQ4_XS: every matrix stays in its blocks (embedding and head too),
    and its greedy tokens, alone and in a batch, are those of the plain path (native kernels off: GGUFLinear's
    dequantize-then-matmul reference, the module loop and SDPA attention)."""
    from lmserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from lmserve.engine.llm_engine import LLMEngine
    from lmserve.layers.formats.gguf_linear import FusedGGUFLinear
    from lmserve.layers.kernels import native
    from lmserve.sampling_params import SamplingParams
    from lmserve.tokenizer import Tokenizer
    from tests.tiny_models import write_word_tokenizer

    path = tmp_path / "low.gguf"
    write_low_bit_gguf(path)
    write_word_tokenizer(tmp_path)
    prompts = [[5, 17, 200, 3, 9], list(range(40, 71)), [250, 1, 7]]
    # 10 tokens: the random blocks make a model of huge, near-tied logits, and float32 kernels against the float64
    # reference flip a near tie after ~15 steps (the first prompt's 15th token on an AVX-512 VNNI build)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

    def run(batch: list[list[int]]) -> list[list[int]]:
        eng = LLMEngine(EngineConfig(model=str(path), quantization="gguf", cache=CacheConfig(num_blocks=32),
                                     scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)),
                        tokenizer=Tokenizer.from_pretrained(tmp_path))
        model = eng.loaded.model
        linears = [m for m in model.modules() if isinstance(m, GGUFLinear)]
        # q, k, v in three layouts (a fused qkv of parts), o, gate and up (two layouts), down; and the head
        assert isinstance(model.lm_head, GGUFLinear) and isinstance(model.model.embed_tokens, GGUFEmbedding)
        assert len(linears) == 2 * 7 + 1
        assert all(t.numel() <= 256 for t in model.parameters())  # norms only: no matrix became float
        assert isinstance(model.model.layers[0].self_attn.qkv_proj, FusedGGUFLinear)
        for i, ids in enumerate(batch):
            eng.add_request(str(i), ids, params)
        out: dict[str, list[int]] = {}
        while eng.has_unfinished():
            for d in eng.step():
                out.setdefault(d.request_id, []).extend(d.token_ids)
        assert eng.kv.num_free_blocks == eng.num_blocks
        return [out[str(i)] for i in range(len(batch))]

    fast = run(prompts)
    assert run(prompts[1:2]) == fast[1:2]  # a row's tokens never depend on its batch
    monkeypatch.setattr(native, "_on", False)  # what LMSERVE_NATIVE_KERNELS=0 sets at start-up
    assert run(prompts) == fast


def test_the_loaders_type_table_is_the_gguf_packages():
    """gguf_file's tables (a start imports no `gguf`) name and size every tensor type, and name every file type, as
    the gguf package does."""
    from gguf import LlamaFileType
    from gguf.constants import GGML_QUANT_SIZES

    from lmserve.loader.gguf_file import FILE_TYPES, GGML_TYPES

    assert GGML_TYPES == {int(q): (q.name, *GGML_QUANT_SIZES[q]) for q in GGMLQuantizationType if q in GGML_QUANT_SIZES}
    assert FILE_TYPES == {int(t): t.name for t in LlamaFileType}
