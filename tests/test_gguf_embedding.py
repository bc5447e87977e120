"""The embedding table kept quantized (GGUFEmbedding) and what `--quantization auto` (the default) chooses.

Looked-up rows equal the gguf package's dequantized rows bit for bit for every kept type; the embedded model's
Q8_0 table and its tied LM head share one set of blocks; auto keeps the embedded Q4_1 file's blocks and keeps
float weights for an F32 GGUF, a safetensors checkpoint, tensor parallelism, bfloat16 or CUDA; `none` is the
float path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from lmserve.layers.formats.gguf_embedding import NATIVE_ROWS, GGUFEmbedding, dequantize_rows
from lmserve.layers.formats.gguf_linear import BLOCK_BYTES, S8, SUPER, GGUFLinear, kernel_layout, repack
from lmserve.layers.kernels.native import native_module
from lmserve.loader.gguf_file import read_gguf
from lmserve.loader.gguf_packed import auto_quantization
from lmserve.worker.transforms import load_formatted
from tests.test_gguf_linear import BLOCK_WEIGHTS, packs_here, random_blocks

CPU = torch.device("cpu")


# 48: whole 16-row groups, which a tied head's kernel reads packed where it packs (the loader hands such a
# table over in kernel_layout); 41 rows, or a table only looked up, stays in rows
@pytest.mark.parametrize("n", [41, 48])
@pytest.mark.parametrize("kind", sorted(BLOCK_BYTES))
def test_looked_up_rows_equal_the_gguf_packages_rows(kind, n):
    k = 512 if BLOCK_WEIGHTS[kind] == 256 else 96
    raw = random_blocks(kind, n, k, seed=5)
    table = gguf_dequantize(raw, GGMLQuantizationType[kind]).reshape(n, k)
    assert not GGUFEmbedding(repack(kind, raw, n, k)).packed
    emb = GGUFEmbedding(kernel_layout(repack(kind, raw, n, k)))
    assert emb.packed == (n == 48 and packs_here())
    ids = torch.tensor([[3, 0, n - 1], [3, 17, 1]])  # repeats, first and last row, a 2-D batch
    out = emb(ids)
    assert out.shape == (2, 3, k) and out.dtype == torch.float32
    np.testing.assert_array_equal(out.numpy(), table[ids.numpy()])


@pytest.mark.parametrize("kind", sorted(BLOCK_BYTES))
def test_the_native_lookup_equals_its_reference(kind):
    """A packed table's rows through the one native call (U4, U8 and S8 kinds) equal the torch reference's (the
    words gathered by advanced indexing, then dequantize_rows) bit for bit, on every level (test_native_levels);
    an id outside the table is refused, not read."""
    if not packs_here():
        pytest.skip("this build has no packed layout")
    n, k = 64, 512 if BLOCK_WEIGHTS[kind] == 256 else 96
    emb = GGUFEmbedding(kernel_layout(repack(kind, random_blocks(kind, n, k, seed=11), n, k)))
    if emb.kind in SUPER:
        pytest.skip("K2/K3 tables are looked up through their unpacked groups (_super_rows)")
    ids = torch.tensor([5, 0, 63, 5, 17, 40, 33, 16, 15, 1, 2, 3, 4, 6, 7, 8, 9, 62, 48, 31])  # 20: two chunks
    reference = dequantize_rows(emb.kind, *emb._rows(ids))
    assert torch.equal(emb(ids), reference)
    if emb.kind not in NATIVE_ROWS:
        return
    rows = native_module().packed_table_rows(emb.codes, emb.scales, emb.mins, ids, emb.kind)
    assert torch.equal(rows, reference)  # the native call itself, not only whichever path forward took
    with pytest.raises(RuntimeError, match="outside the table"):
        native_module().packed_table_rows(emb.codes, emb.scales, emb.mins, torch.tensor([n]), emb.kind)
    empty = None if emb.mins is None else emb.mins[:0]
    with pytest.raises(RuntimeError, match="an empty table"):  # refused before any division by its width
        native_module().packed_table_rows(emb.codes[:0], emb.scales[:0], empty, torch.tensor([0]), emb.kind)


@pytest.fixture(scope="module")
def auto_loaded(smol_path):
    return load_formatted(smol_path, torch.float32, CPU, quantization="auto")


def test_auto_keeps_the_embedded_models_blocks_and_one_table(smol_path, auto_loaded):
    from lmserve.loader.gguf_loader import _dequantize

    model = auto_loaded.model
    assert auto_loaded.runtime_quantization == "gguf" and auto_loaded.weight_format == "gguf"
    emb, head = model.model.embed_tokens, model.lm_head
    assert isinstance(emb, GGUFEmbedding) and isinstance(head, GGUFLinear)
    assert emb.kind == S8 and emb.packed == packs_here()  # Q8_0 -> the S8 layout, packed where the kernel packs
    # the tied head reads the table's own blocks: no second copy
    assert head.codes.data_ptr() == emb.codes.data_ptr() and head.scales.data_ptr() == emb.scales.data_ptr()
    assert all(isinstance(layer.self_attn.qkv_proj, GGUFLinear) for layer in model.model.layers)
    f = read_gguf(smol_path)
    table = _dequantize(next(t for t in f.tensors if t.name == "token_embd.weight"), f.path)
    ids = torch.tensor([0, 1, 2, 100, 49151])
    assert torch.equal(emb(ids), table[ids])  # the float loader's rows, bit for bit
    # nothing float of the size of a projection or the table was made: only norms (and rotary) remain float
    floats = sum(p.numel() for p in model.parameters())
    assert floats < 100_000, floats


def test_none_is_the_float_path(smol_path):
    loaded = load_formatted(smol_path, torch.float32, CPU, quantization="none")
    assert loaded.runtime_quantization is None and loaded.weight_format == "none"
    model = loaded.model
    assert isinstance(model.model.embed_tokens, torch.nn.Embedding)
    assert not any(isinstance(m, (GGUFLinear, GGUFEmbedding)) for m in model.modules())


def test_auto_chooses_float_where_blocks_cannot_run(smol_path, tmp_path):
    f = read_gguf(smol_path)
    assert auto_quantization(f, CPU, torch.float32, 1)[0] == "gguf"
    for device, dtype, world, why in ((CPU, torch.float32, 2, "tensor parallel size 2"),
                                      (CPU, torch.bfloat16, 1, "dtype bfloat16"),
                                      (torch.device("cuda"), torch.float32, 1, "device cuda")):
        scheme, reason = auto_quantization(f, device, dtype, world)
        assert scheme is None and why in reason
    assert auto_quantization(None, CPU, torch.float32, 1) == (None, "not a GGUF file")
    from tests.conftest import write_tiny_llama

    write_tiny_llama(tmp_path / "tiny")
    assert load_formatted(tmp_path / "tiny", torch.float32, CPU, quantization="auto").weight_format == "none"


def test_auto_keeps_an_f32_gguf_float(tmp_path):
    path = tmp_path / "f32.gguf"
    write_tiny_gguf(path)
    loaded = load_formatted(path, torch.float32, CPU, quantization="auto")
    assert loaded.weight_format == "none"
    assert "projection" in auto_quantization(read_gguf(path), CPU, torch.float32, 1)[1]
    assert isinstance(loaded.model.model.embed_tokens, torch.nn.Embedding)


def write_tiny_gguf(path) -> None:
    """A one-layer llama GGUF with every tensor F32 (nothing that can stay quantized)."""
    import gguf

    rng = np.random.default_rng(0)
    hidden, inter, vocab = 64, 96, 32
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((w.add_block_count, 1), (w.add_context_length, 64), (w.add_embedding_length, hidden),
                       (w.add_feed_forward_length, inter), (w.add_head_count, 2), (w.add_head_count_kv, 2),
                       (w.add_layer_norm_rms_eps, 1e-5)):
        add(value)
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,),
              "blk.0.attn_norm.weight": (hidden,), "blk.0.ffn_norm.weight": (hidden,),
              "blk.0.attn_q.weight": (hidden, hidden), "blk.0.attn_k.weight": (hidden, hidden),
              "blk.0.attn_v.weight": (hidden, hidden), "blk.0.attn_output.weight": (hidden, hidden),
              "blk.0.ffn_gate.weight": (inter, hidden), "blk.0.ffn_up.weight": (inter, hidden),
              "blk.0.ffn_down.weight": (hidden, inter)}
    for name, shape in shapes.items():
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
