"""--kv-cache-dtype int8 / fp8_e4m3: the native writer stores exactly what the PyTorch codec (layers/attention/kv_quant.py)
computes, the paged attention reads those rows in place as exactly their dequantized values, the decode stack and the
module loop stay bit-identical over a quantized cache, and a token costs 0.53x the bytes of float16."""

from __future__ import annotations

import pytest
import torch

from lmserve.layers.attention import kv_quant
from lmserve.layers.attention.paged import decode_attention, write_kv_reference
from lmserve.layers.kernels.native import native_module
from lmserve.utils import KV_QUANT_DTYPES, resolve_kv_dtype

kernel = native_module()
needs_kernel = pytest.mark.skipif(kernel is None, reason="no C++ compiler here: the PyTorch path is used")
FORMATS = list(KV_QUANT_DTYPES.values())


def empty_cache(blocks: int, kv_heads: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(2, blocks, 16, kv_heads, kv_quant.row_width(dim, dtype), dtype=dtype)


@pytest.mark.parametrize("dtype", FORMATS)
def test_codec_round_trip_error_is_bounded_per_row(dtype):
    """Each 32 values of a (token, head) row are a block: the error is within half a step of the row's largest scale
    (float16-rounded), a row of zeros reads back as zeros, and a row's codes do not depend on the rows beside it."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 64, generator=g) * torch.tensor([0.01, 1.0, 300.0])[None, :, None]
    x[2, 1] = 0.0
    rows = kv_quant.quantize(x, dtype)
    assert rows.shape == (7, 3, 68) and rows.dtype == dtype
    back = kv_quant.dequantize(rows)
    amax = x.abs().amax(-1, keepdim=True)
    # int8: half a code step; e4m3: 3 mantissa bits, so half an ulp of the largest power of two below a value
    bound = amax / 127 / 2 if dtype == torch.int8 else x.abs() / 16 + amax / 448 * 2.0 ** -9
    assert ((back - x).abs() <= bound * (1 + 1e-3)).all()
    assert torch.equal(back[2, 1], torch.zeros(64))
    assert torch.equal(kv_quant.quantize(x[3:4, 2:3], dtype).view(torch.uint8), rows[3:4, 2:3].view(torch.uint8))


@needs_kernel
@pytest.mark.parametrize("dtype", FORMATS + [torch.float16, torch.float32])
@pytest.mark.parametrize("kv_heads,dim,tokens", [(3, 64, 5), (2, 128, 37), (1, 64, 1), (2, 68, 3)])
def test_native_writer_equals_the_reference_bitwise(dtype, kv_heads, dim, tokens):
    if dim % 32 and dtype in FORMATS:
        pytest.skip("a quantized row is whole blocks of 32 (engine/build.py checks the head size)")
    g = torch.Generator().manual_seed(tokens)
    k = torch.randn(tokens, kv_heads, dim, generator=g) * 3
    v = torch.randn(tokens, kv_heads, dim, generator=g) / 7
    k[0, 0, :5] = torch.tensor([448.0, -1e-9, 0.0, 1e-30, -2.5])  # extremes and values below e4m3's range
    if dtype == torch.float16:  # float16's edges: overflow, its largest, subnormals and their ties, ties, NaN payloads
        edges = torch.tensor([65520.0, -65504.0, 65519.0, 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -25, 3 * 2.0 ** -26,
                              1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, float("inf"), -float("inf"), 5.96e-8])
        k[0, 0, 5:5 + len(edges)] = edges
        nans = torch.tensor([0x7FC12345, -0x3FEDCC, 0x7FA00000], dtype=torch.int32).view(torch.float32)
        k[0, 0, 5 + len(edges):8 + len(edges)] = nans
        v[-1, -1, -len(edges):] = edges  # a row's last values: at dim 68 its last 4 go one by one (the tail)
        v[-1, -1, -3:] = nans
    slots = torch.randperm(8 * 16, generator=g)[:tokens]
    native, ref = empty_cache(8, kv_heads, dim, dtype), empty_cache(8, kv_heads, dim, dtype)
    kernel.write_kv(native, k, v, slots)
    write_kv_reference(ref, k, v, slots)
    if dtype == torch.float16 and "x86_64_v2" in kernel.__name__:
        # no F16C there: c10's bit work writes sign | 0x7E00 for every NaN, where torch's own vector conversion (the
        # reference) keeps the payload's top bits; elsewhere the writer uses the same instruction, so the same bits
        nan = ref.isnan()
        assert torch.equal(native.isnan(), nan) and torch.equal(native.signbit()[nan], ref.signbit()[nan])
        native[nan], ref[nan] = 0, 0
    assert torch.equal(native.view(torch.uint8), ref.view(torch.uint8))


@needs_kernel
def test_native_writer_refuses_slots_outside_the_cache():
    cache = empty_cache(2, 1, 64, torch.int8)
    # the numbers in the message too: an integer streamed into TORCH_CHECK's message crashed one CUDA host's build
    with pytest.raises(RuntimeError, match="slot 32 outside the cache's 32"):
        kernel.write_kv(cache, torch.ones(1, 1, 64), torch.ones(1, 1, 64), torch.tensor([32]))


def paged_case(dtype: torch.dtype, batch: int, heads: int, kv_heads: int, dim: int, max_len: int, seed: int):
    """A quantized cache written through the reference codec, shuffled block tables, mixed context lengths."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len + 1, (batch,), generator=g)
    lens[0] = max_len
    width = -(-max_len // 16)
    blocks = batch * width + 3
    cache = kv_quant.quantize(torch.randn(2, blocks, 16, kv_heads, dim, generator=g) * 2, dtype)
    tables = torch.randperm(blocks, generator=g)[:batch * width].view(batch, width)
    q = torch.randn(batch, heads, dim, generator=g)
    mask = (torch.arange(width * 16)[None, :] < lens[:, None])[:, None, None, :]
    return q, cache, tables, lens, mask


@needs_kernel
@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("batch,heads,kv_heads,dim,max_len", [
    (1, 9, 3, 64, 1), (5, 9, 3, 64, 70), (4, 16, 2, 128, 129), (33, 9, 3, 64, 300)])
def test_attention_reads_quantized_rows_as_their_dequantized_values(dtype, batch, heads, kv_heads, dim, max_len):
    """Bit for bit the float32 kernel over the dequantized cache (decode rows and prefill rows sharing tables), and
    close to the gather + SDPA reference."""
    q, cache, tables, lens, mask = paged_case(dtype, batch, heads, kv_heads, dim, max_len, seed=batch + dim)
    values = kv_quant.dequantize(cache)
    out = kernel.paged_decode_attention(q, cache[0], cache[1], tables, lens, dim ** -0.5)
    assert torch.equal(out, kernel.paged_decode_attention(q, values[0], values[1], tables, lens, dim ** -0.5))
    rows = torch.arange(batch) % tables.shape[0]
    row_lens = torch.minimum(torch.arange(1, batch + 1), lens[rows])
    got = kernel.paged_decode_attention(q, cache[0], cache[1], tables, row_lens, 0.125, rows)
    assert torch.equal(got, kernel.paged_decode_attention(q, values[0], values[1], tables, row_lens, 0.125, rows))
    ref = decode_attention(q, cache, tables, mask)
    assert torch.allclose(out.reshape(batch, -1), ref, atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("dim,window,softcap,scale", [(64, 5, None, None), (128, 20, 3.0, 0.05), (256, 16, 2.0, 0.0625)])
def test_window_softcap_scale_and_head_dim_256_over_a_quantized_cache(dtype, dim, window, softcap, scale):
    """The model families' options over a quantized cache (a sliding window ending mid-block, a soft-cap, a custom
    scale, head_dim 256): bit for bit the kernel over the dequantized values, and close to the PyTorch reference
    (as_values over the gathered blocks; attention_ref for the soft-cap)."""
    from lmserve.layers.attention.context import AttnOptions
    from lmserve.layers.attention.paged import context_mask

    q, cache, tables, lens, mask = paged_case(dtype, 6, 8, 2, dim, 70, seed=dim)
    values = kv_quant.dequantize(cache)
    args = (tables, lens, scale or dim ** -0.5, None, window, softcap or 0.0)
    out = kernel.paged_decode_attention(q, cache[0], cache[1], *args)
    assert torch.equal(out, kernel.paged_decode_attention(q, values[0], values[1], *args))
    mask = mask & ~context_mask(lens - window, mask.shape[-1])
    ref = decode_attention(q, cache, tables, mask, AttnOptions(scale=scale, window=window, soft_cap=softcap))
    assert torch.allclose(out.reshape(6, -1), ref, atol=2e-5, rtol=1e-4), (out.reshape(6, -1) - ref).abs().max()


@needs_kernel
@pytest.mark.parametrize("opts", [dict(window=6), dict(window=9, soft_cap=2.5, scale=0.1)])
def test_paged_attention_with_options_over_an_int8_cache_native_equals_pytorch(opts, monkeypatch):
    """A prompt, then a chunk after its cached prefix, then a decode row, with a window (and a soft-cap and scale)
    over an int8 cache: the native path equals the PyTorch one (reference writer, as_values over gathered blocks)."""
    from lmserve.layers.attention.context import AttnOptions
    from lmserve.layers.attention.paged import PagedAttention, PagedAttentionMetadata, PrefillChunk
    from lmserve.layers.kernels import native

    options, g = AttnOptions(**opts), torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(30, h, 64, generator=g) for h in (4, 2, 2))
    table = torch.tensor([3, 1])  # 16-token blocks

    def meta(a: int, n: int) -> PagedAttentionMetadata:
        slots = table[torch.arange(a, a + n) // 16] * 16 + torch.arange(a, a + n) % 16
        if n == 1:  # a decode row
            return PagedAttentionMetadata(slots, 1, table[None], None, [], torch.tensor([a + 1]))
        mask = None if a == 0 else torch.arange(a + n)[None, :] <= torch.arange(a, a + n)[:, None]
        return PagedAttentionMetadata(slots, 0, torch.zeros(0, 2, dtype=torch.long), None,
                                      [PrefillChunk(0, n, a + n, table, mask)], None, table[None],
                                      torch.zeros(n, dtype=torch.long), torch.arange(a + 1, a + n + 1))

    def run() -> torch.Tensor:
        cache = empty_cache(4, 2, 64, torch.int8)
        return torch.cat([PagedAttention([cache], meta(a, n)).attend(0, q[a:a + n], k[a:a + n], v[a:a + n], options)
                          for a, n in ((0, 12), (12, 17), (29, 1))])

    fast = run()
    monkeypatch.setattr(native, "_on", False)
    assert torch.allclose(run(), fast, atol=2e-5, rtol=1e-4)


@needs_kernel
def test_attention_rows_over_a_quantized_cache_do_not_depend_on_the_batch():
    q, cache, tables, lens, _ = paged_case(torch.int8, 12, 9, 3, 64, 100, seed=3)
    full = kernel.paged_decode_attention(q, cache[0], cache[1], tables, lens, 0.125)
    for i in (0, 5, 11):
        one = kernel.paged_decode_attention(q[i:i + 1], cache[0], cache[1], tables[i:i + 1], lens[i:i + 1], 0.125)
        assert torch.equal(one[0], full[i])


def test_kv_dtype_names_and_where_they_run():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_kv_dtype("int8", torch.float32, True, cpu) == torch.int8
    if "fp8_e4m3" in KV_QUANT_DTYPES:
        assert resolve_kv_dtype("fp8_e4m3", torch.float32, False, cpu) == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="CPU kernels only"):
        resolve_kv_dtype("int8", torch.bfloat16, False, cuda)
    with pytest.raises(ValueError, match="int8"):
        resolve_kv_dtype("int4", torch.float32, False, cpu)


def test_the_triton_backend_refuses_a_quantized_cache(monkeypatch):
    """The Triton kernels read float K/V: an int8 cache with them is one clear start-up error (on CPU they run only
    under Triton's interpreter, as the tests run them)."""
    pytest.importorskip("triton")
    from lmserve.config import CacheConfig, EngineConfig
    from lmserve.errors import ConfigError
    from lmserve.preflight import check_engine_config

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg = EngineConfig(device="cpu", attention_backend="triton", cache=CacheConfig(kv_cache_dtype="int8"))
    with pytest.raises(ConfigError, match="--kv-cache-dtype int8: the Triton attention kernels read float K/V only"):
        check_engine_config(cfg)


@pytest.fixture(scope="module")
def int8_engine():
    from lmserve.config import CacheConfig, EngineConfig
    from lmserve.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(device="cpu", quantization="gguf", cache=CacheConfig(num_blocks=128, block_size=16,
                                                               enable_prefix_caching=False, kv_cache_dtype="int8")))


@needs_kernel
def test_int8_cache_bytes_and_the_decode_stack_over_it(int8_engine):
    """A token's K/V take 0.53x the bytes of float16, and decode steps through the native stack give exactly the
    module loop's tokens and logprobs over the int8 cache (the same writer and reader in both)."""
    from lmserve.layers.kernels.decode_stack import NativeDecodeLoop, apply_decode_stack, remove_decode_stack
    from lmserve.sampling_params import SamplingParams
    from lmserve.worker.model_runner import kv_bytes_per_block
    from tests.test_decode_stack import generate
    from tests.test_engine import PROMPTS, assert_no_leak

    eng = int8_engine
    assert eng.kv_dtype == torch.int8 and all(c.dtype == torch.int8 for c in eng.runner.kv_caches)
    cfg = eng.loaded.model.config
    ratio = kv_bytes_per_block(cfg, 16, torch.int8) / kv_bytes_per_block(cfg, 16, torch.float16)
    assert ratio <= 0.55 and eng.block_bytes == kv_bytes_per_block(cfg, 16, torch.int8)
    model = eng.loaded.model
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True, logprobs=2)
    prompts = [PROMPTS[1], PROMPTS[3]]
    assert isinstance(model.layer_loop, NativeDecodeLoop)  # the runner applied the stack over the int8 cache
    remove_decode_stack(model)
    reference = generate(eng, prompts, params)
    stack = apply_decode_stack(model)
    assert stack is not None
    fused = generate(eng, prompts, params)
    assert stack.steps >= 20 and fused == reference
    assert_no_leak(eng)


@needs_kernel
def test_int8_prefill_tokens_equal_their_decode_rows_on_the_embedded_model(int8_engine):
    """End to end over the int8 cache: a prompt and 12 greedy tokens; then the prompt with the first 6 of them
    appended, prefilled in one chunk (the kernel's prefill tiles, not the decode rows that first produced them), must
    continue with the same 6 tokens and bit-identical logprobs (chosen and top-2): every layer's K/V of those 6
    tokens came out of the tiled prefill attention and equal what the decode rows wrote."""
    from lmserve.sampling_params import SamplingParams
    from tests.test_decode_stack import generate
    from tests.test_engine import PROMPTS, assert_no_leak

    eng = int8_engine
    prompt = eng.front.tokenize_prompt(PROMPTS[10])  # 140 words: tiles of 16 rows, a part tile at the end
    first = generate(eng, [prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2))["0"]
    assert len(first) == 12
    again = generate(eng, [prompt + [t for t, _, _ in first[:6]]],
                     SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2))["0"]
    assert again == first[6:]
    assert_no_leak(eng)


def test_reference_gather_reads_back_what_the_reference_writer_stored():
    """The PyTorch path (no compiler, other devices): rows written by write_kv_reference and gathered for a prefix hit
    are the codec's values; an int8 slot costs D + D / 16 bytes per head."""
    from lmserve.layers.attention.paged import gather_context

    g = torch.Generator().manual_seed(11)
    k, v = torch.randn(20, 3, 64, generator=g), torch.randn(20, 3, 64, generator=g)
    for dtype in FORMATS:
        cache = empty_cache(4, 3, 64, dtype)
        write_kv_reference(cache, k, v, torch.arange(16, 36))  # blocks 1 and 2
        kc, vc = gather_context(cache, torch.tensor([1, 2]), 20)
        assert kc.shape == (20, 3, 68)
        assert torch.equal(kv_quant.as_values(kc, torch.float32), kv_quant.dequantize(kv_quant.quantize(k, dtype)))
        assert torch.equal(kv_quant.as_values(vc, torch.float32), kv_quant.dequantize(kv_quant.quantize(v, dtype)))


def test_int8_cache_through_the_pytorch_path(monkeypatch):
    """With the native kernels off, an int8 cache is written and read by the reference codec (prompts attend over
    the quantized cache too, as in the native path): float weights give the native path's greedy tokens, for
    whole prompts and after a prefix-cache hit."""
    from lmserve.config import CacheConfig, EngineConfig
    from lmserve.engine.llm_engine import LLMEngine
    from lmserve.layers.kernels import native
    from lmserve.sampling_params import SamplingParams
    from tests.test_decode_stack import generate
    from tests.test_engine import PROMPTS, assert_no_leak

    eng = LLMEngine(EngineConfig(device="cpu", quantization="none",
                                 cache=CacheConfig(num_blocks=64, kv_cache_dtype="int8")))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    prompts = [PROMPTS[3], PROMPTS[3] + " And then"]  # the second hits the first's cached blocks

    def tokens() -> list[list[int]]:
        eng.kv.reset_prefix_cache()
        before = eng.kv.prefix_hits
        out = [[t for t, *_ in generate(eng, [p], params)["0"]] for p in prompts]
        assert eng.kv.prefix_hits - before >= 128  # the second prompt really attended over cached int8 blocks
        return out

    fast = tokens()
    monkeypatch.setattr(native, "_on", False)
    assert tokens() == fast
    assert_no_leak(eng)


def test_a_head_dim_that_is_not_blocks_of_32_is_refused(tmp_path):
    """A quantized row is blocks of 32 values with a scale each: head_dim 16 (the tiny Llama's) is refused up front
    with the flag's name, not failed on inside a step."""
    from lmserve.config import CacheConfig, EngineConfig
    from lmserve.engine.llm_engine import LLMEngine
    from lmserve.errors import ConfigError
    from tests.conftest import write_tiny_llama

    write_tiny_llama(tmp_path / "llama")
    with pytest.raises(ConfigError, match="--kv-cache-dtype int8: .*head_dim is 16"):
        LLMEngine(EngineConfig(model=str(tmp_path / "llama"), device="cpu",
                               cache=CacheConfig(num_blocks=8, kv_cache_dtype="int8")))
