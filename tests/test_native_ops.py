"""The fused native row ops and the skinny matmul equal their references, do not depend on the batch,
and fall back cleanly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmserve.layers.blocks.rotary import apply_rotary
from lmserve.layers.kernels import fused, native

mod = native.native_module()
needs_kernel = pytest.mark.skipif(mod is None, reason="no C++ compiler here: the PyTorch path is used")


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3


@needs_kernel
@pytest.mark.parametrize("rows,dim", [(1, 576), (7, 576), (300, 64), (2049, 960), (3, 17)])
def test_rms_norm_and_residual_add_equal_the_reference(rows, dim):
    x, res, w = rand(rows, dim, seed=1), rand(rows, dim, seed=2), rand(dim, seed=3)
    out, same = fused.rms_norm(x, w, 1e-5)
    assert same is x
    torch.testing.assert_close(out, fused.rms_norm_ref(x, w, 1e-5), rtol=1e-5, atol=1e-5)
    expected_res = res + x
    out, new_res = fused.rms_norm(x, w, 1e-5, res.clone())
    assert torch.equal(new_res, expected_res)  # one float add: bit-exact
    torch.testing.assert_close(out, fused.rms_norm_ref(expected_res, w, 1e-5), rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("rows,dim,affine", [(1, 384, "both"), (18, 384, "both"), (2049, 768, "both"), (3, 17, "both"),
                                            (5, 1024, "weight"), (4, 9, "none")])
def test_layer_norm_equals_the_reference(rows, dim, affine):
    """As close to float64's as F.layer_norm is (rows far from zero mean: the variance is taken about the mean), and
    each row's bits whatever else is in the call; the LayerNorm block runs it and loads nn.LayerNorm's names."""
    from lmserve.layers.blocks.norm import LayerNorm

    x = rand(rows, dim, seed=20) + 50.0
    w = rand(dim, seed=21) if affine != "none" else None
    b = rand(dim, seed=22) if affine == "both" else None
    out = fused.layer_norm(x, w, b, 1e-12)
    exact = F.layer_norm(x.double(), (dim,), None if w is None else w.double(), None if b is None else b.double(), 1e-12)
    aten = F.layer_norm(x, (dim,), w, b, 1e-12)
    assert (out.double() - exact).abs().max() <= 2 * (aten.double() - exact).abs().max() + 1e-6
    assert torch.equal(mod.layer_norm(x[-1:].clone(), w, b, 1e-12)[0], out[-1])  # its own buffer, alone
    block = LayerNorm(dim, eps=1e-12, elementwise_affine=affine != "none", bias=affine == "both")
    if affine != "none":
        block.load_state_dict({"weight": w, **({"bias": b} if b is not None else {})})
    assert torch.equal(block(x.view(1, rows, dim)), out.view(1, rows, dim))
    half = block.to(torch.bfloat16)  # not float32: ATen's own
    assert torch.equal(half(x.bfloat16()), F.layer_norm(x.bfloat16(), (dim,), half.weight, half.bias, 1e-12))


@needs_kernel
def test_residual_is_updated_in_place():
    x, res, w = rand(4, 64, seed=4), rand(4, 64, seed=5), rand(64, seed=6)
    before = res.clone()
    _, new_res = fused.rms_norm(x, w, 1e-6, res)
    assert new_res.data_ptr() == res.data_ptr() and torch.equal(res, before + x)


@needs_kernel
@pytest.mark.parametrize("rows,inter", [(1, 1536), (5, 1536), (700, 96), (2, 7)])
def test_silu_and_mul_equals_the_reference(rows, inter):
    gu = rand(rows, 2 * inter, seed=7)
    gu[0, :min(inter, 6)] = torch.tensor([0.0, -0.0, 30.0, -30.0, -100.0, 1e-20])[:min(inter, 6)]  # the vector exp's ends
    ref = F.silu(gu[:, :inter]) * gu[:, inter:]
    torch.testing.assert_close(fused.silu_and_mul(gu), ref, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("rows,inter", [(1, 2048), (5, 2048), (300, 96), (2, 7)])
def test_gelu_tanh_and_mul_equals_the_reference(rows, inter):
    gu = rand(rows, 2 * inter, seed=14)
    gu[0, :6] = torch.tensor([0.0, -0.0, 30.0, -30.0, 1e-20, -12.0])  # the branches and the far tails
    # atol: for x below about -9 ATen's 0.5 x (1 + tanh(u)) cancels to 0 where the sigmoid form keeps ~1e-6
    torch.testing.assert_close(fused.gelu_tanh_and_mul(gu), fused.gelu_tanh_and_mul_ref(gu), rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("tokens,heads,kv_heads,dim", [(1, 9, 3, 64), (37, 9, 3, 64), (5, 32, 8, 128)])
def test_rotary_in_place_on_a_strided_qkv_view_equals_the_reference(tokens, heads, kv_heads, dim):
    qkv = rand(tokens, (heads + 2 * kv_heads) * dim, seed=8)
    v_before = qkv[:, (heads + kv_heads) * dim:].clone()
    qk = qkv[:, :(heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)  # rows strided, as in the model
    angles = rand(tokens, 1, dim // 2, seed=9)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    ref = apply_rotary(qk.clone(), cos, sin)
    out = fused.rotary(qk, cos, sin)
    assert out.data_ptr() == qkv.data_ptr()  # rotated where it lies
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], v_before)  # v untouched


@needs_kernel
def test_rows_do_not_depend_on_the_batch():
    x, res, w, gu = rand(64, 576, seed=10), rand(64, 576, seed=11), rand(576, seed=12), rand(64, 3072, seed=13)
    full_norm = mod.add_rms_norm_(x, res.clone(), w, 1e-5)
    full_silu, full_gelu = mod.silu_and_mul(gu), mod.gelu_tanh_and_mul(gu)
    for i in (0, 17, 63):
        assert torch.equal(mod.add_rms_norm_(x[i:i + 1], res[i:i + 1].clone(), w, 1e-5)[0], full_norm[i])
        assert torch.equal(mod.silu_and_mul(gu[i:i + 1])[0], full_silu[i])
        assert torch.equal(mod.gelu_tanh_and_mul(gu[i:i + 1])[0], full_gelu[i])


@needs_kernel
def test_native_ops_refuse_what_they_cannot_run():
    with pytest.raises(RuntimeError, match="float32"):
        mod.rms_norm(rand(2, 8).bfloat16(), rand(8), 1e-5)
    with pytest.raises(RuntimeError, match="weight has 7 elements"):
        mod.rms_norm(rand(2, 8), rand(7), 1e-5)
    with pytest.raises(RuntimeError, match=r"\[T, 2 \* I\]"):
        mod.silu_and_mul(rand(2, 7))
    with pytest.raises(RuntimeError, match="contiguous"):
        mod.add_rms_norm_(rand(2, 8), rand(8, 2).t(), rand(8), 1e-5)
    with pytest.raises(RuntimeError, match="bias has 7 elements"):
        mod.layer_norm(rand(2, 8), rand(8), rand(7), 1e-5)
    with pytest.raises(RuntimeError, match="float32"):
        mod.layer_norm(rand(2, 8).double(), None, None, 1e-5)


def test_other_dtypes_and_switch_off_use_pytorch(monkeypatch):
    x, w = rand(3, 64).bfloat16(), rand(64).bfloat16()
    out, _ = fused.rms_norm(x, w, 1e-5)
    assert out.dtype == torch.bfloat16 and torch.equal(out, fused.rms_norm_ref(x, w, 1e-5))
    monkeypatch.setattr(native, "_on", False)
    x32, res = rand(3, 64), rand(3, 64)
    out, new_res = fused.rms_norm(x32, rand(64), 1e-5, res)
    assert new_res.data_ptr() != res.data_ptr()  # the reference path never writes into the caller's tensor
    gu = rand(2, 16)
    assert torch.equal(fused.silu_and_mul(gu), F.silu(gu[:, :8]) * gu[:, 8:])
    assert torch.equal(fused.gelu_tanh_and_mul(gu), F.gelu(gu[:, :8], approximate="tanh") * gu[:, 8:])
    w, b = rand(64, seed=1), rand(64, seed=2)
    assert torch.equal(fused.layer_norm(x32, w, b, 1e-5), F.layer_norm(x32, (64,), w, b, 1e-5))
    assert torch.equal(fused.layer_norm(x.float().double(), w.double(), None, 1e-5),
                       F.layer_norm(x.float().double(), (64,), w.double(), None, 1e-5))


@needs_kernel
@pytest.mark.parametrize("k,n,bias", [(576, 960, False), (1536, 576, False), (2100, 100, True), (64, 7, True),
                                      (576, 49152, False)])
def test_skinny_linear_gives_onednns_bits(k, n, bias):
    """Steps of up to SKINNY_MAX_ROWS rows run the skinny kernel; its rows are oneDNN's bits in a batch of 64."""
    from lmserve.layers.formats.linear import SKINNY_MAX_ROWS, PackedLinear

    torch.manual_seed(k + n)
    lin = torch.nn.Linear(k, n, bias=bias)
    layer = PackedLinear(lin)
    if layer.panels is None:
        pytest.skip("this CPU's oneDNN sums in another order: the layer keeps oneDNN only")
    x = rand(64, k, seed=n)
    batch = torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")
    assert torch.equal(layer(x), batch)  # 64 rows: oneDNN itself
    for m in range(1, SKINNY_MAX_ROWS + 1):
        assert torch.equal(layer(x[:m]), batch[:m]), m
    torch.testing.assert_close(layer(x[:3]), F.linear(x[:3], lin.weight, lin.bias), rtol=1e-5, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("k,n,bias", [(37, 7, False), (1000, 100, True), (2100, 250, False), (3001, 33, True)])
def test_skinny_kernel_gives_onednns_bits_for_1_to_8_rows(k, n, bias):
    """Every row grouping (4s, then 3, 2 or 1; slabs of 8 past 8 rows) gives each row oneDNN's bits in a
    batch too big for the kernel.

    K is not a multiple of 16, of the kernel's 64-input chunks nor of its 1024-input chain blocks, and N
    leaves a part-filled panel.
    """
    from lmserve.layers.formats.linear import PackedLinear

    torch.manual_seed(k * n)
    layer = PackedLinear(torch.nn.Linear(k, n, bias=bias))
    if layer.panels is None:
        pytest.skip("this CPU's oneDNN sums in another order: the layer keeps oneDNN only")
    x = rand(40, k, seed=k + n)
    batch = torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")
    for m in [*range(1, 9), 12, 17]:
        for start in (0, 40 - m):  # rows of another group of x give their own bits too
            rows = x[start:start + m]
            assert torch.equal(mod.skinny_linear(rows, layer.panels, n, layer.bias), batch[start:start + m]), (m, start)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k,n,bias", [(37, 7, False), (576, 1000, True), (1100, 33, False), (2100, 250, True)])
def test_half_panels_give_the_float_kernels_bits_and_the_reference(dtype, k, n, bias):
    """bfloat16 / float16 panels (an LM head held in its checkpoint's dtype): each weight is widened exactly, so every
    row equals the float32 kernel over the upcast panels bit for bit, in any batch (batch invariant: 1-8 rows, slabs
    of 8 past that), and the plain reference (one float32 matmul) up to summation order. Odd K and a part panel."""
    from lmserve.layers.formats.half_linear import HalfLinear, reference_half_linear

    w = (rand(n, k, seed=k) / k ** 0.5).to(dtype)
    b = rand(n, seed=n) if bias else None
    layer = HalfLinear(w, b, coded=False)
    assert layer.half_panels.dtype == dtype and layer.half_panels.shape == (-(-n // 16), k, 16)
    x = rand(40, k, seed=k + n)
    upcast = layer.half_panels.float()
    full = mod.skinny_linear(x, upcast, n, layer.bias)
    assert torch.equal(layer(x), full)
    for m in [*range(1, 9), 12, 17]:
        for start in (0, 40 - m):
            assert torch.equal(layer(x[start:start + m]), full[start:start + m]), (m, start)
    want = F.linear(x, w.float(), b)
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(reference_half_linear(x, layer.half_rows(), layer.bias), want, rtol=1e-5, atol=1e-4)


def with_exceptions(n: int, k: int) -> torch.Tensor:
    """A bfloat16 [n, k] matrix whose first and last rows hold weights of many rare magnitudes (2^+-20..80: high
    bytes outside their panel's 16 commonest), in the last (part) group of inputs too, and some zeros."""
    w = rand(n, k, seed=k) / k ** 0.5
    j = torch.arange(k)
    w[0] *= torch.where(j % 9 == 0, 2.0 ** (20 + j % 60), 1.0)
    w[n - 1] *= torch.where(j % 11 == 1, 2.0 ** -(20 + j % 60), 1.0)
    w[n - 1, k - 1] = 1e30
    w[n // 2, ::7] = 0.0
    return w.bfloat16()


@needs_kernel
@pytest.mark.parametrize("k,n,bias", [(47, 17, False), (45, 70, True), (576, 100, True), (1100, 33, False)])
def test_coded_bf16_head_is_lossless_and_gives_the_plain_panels_bits(k, n, bias):
    """A bfloat16 head in 12 bits a weight (per panel: 16 high bytes, 4-bit indices, raw low bytes, exceptions): its
    rows come back bit for bit, and every row count gives the plain bfloat16 panels' outputs bit for bit (the same
    chains: batch invariant), the plain reference up to summation order. K not a multiple of 4 (a part group), past
    1024 (a restarted chain), N not a multiple of 16, exceptions present."""
    from lmserve.layers.formats.half_linear import HalfLinear, reference_half_linear

    w, b = with_exceptions(n, k), (rand(n, seed=n) if bias else None)
    coded, plain = HalfLinear(w, b), HalfLinear(w, b, coded=False)
    assert coded.coded is not None and coded.coded.exc_val.numel() > 0 and not hasattr(coded, "half_panels")
    assert torch.equal(coded.half_rows().view(torch.int16), w.view(torch.int16))
    x = rand(20, k, seed=k + n)
    full = plain(x)
    for m in (1, 2, 3, 4, 5, 8, 9):
        for start in (0, 20 - m):
            assert torch.equal(coded(x[start:start + m]), full[start:start + m]), (m, start)
    want = F.linear(x, w.float(), b)
    got = reference_half_linear(x, coded.half_rows(), coded.bias)
    assert torch.equal(got, want)
    assert torch.allclose(coded(x), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@needs_kernel
@pytest.mark.parametrize("k,n", [(47, 17), (45, 70), (576, 100), (3, 5)])
def test_native_coder_gives_the_reference_codings_bytes(k, n):
    """The native coder (load time) writes the tensor-op reference's coding byte for byte: tables (ties between
    equally common high bytes broken the same way), indices and low bytes in the kernel's order, the padded inputs
    of a part group, and the exception lists; also for a panel of fewer than 16 distinct high bytes."""
    from lmserve.layers.formats.half_linear import code_panels_reference
    from lmserve.layers.formats.linear import to_panels
    from lmserve.layers.kernels.native import native_module

    for w in (with_exceptions(n, k), torch.full((n, k), 0.5).bfloat16()):
        panels = to_panels(w)
        native, reference = native_module().code_half_panels(panels), code_panels_reference(panels)
        for got, want in zip(native, reference):
            assert got.dtype == want.dtype and torch.equal(got, want)


def test_a_float16_head_keeps_its_plain_panels():
    """float16's high byte holds 2 mantissa bits: 16 values leave too many weights out, so no coding is made."""
    from lmserve.layers.formats.half_linear import HalfLinear

    layer = HalfLinear(rand(64, 96, seed=3).half())
    assert layer.coded is None and layer.half_panels.dtype == torch.float16


def test_half_embedding_rows_from_the_tied_head():
    """A tied table held once, in the head (coded or plain panels): a looked-up row is the table's row widened
    (exact, exceptions included)."""
    from lmserve.layers.formats.half_linear import HalfEmbedding, HalfLinear, tied_half

    w = with_exceptions(37, 200)
    table, head = tied_half(w)
    assert table.head_rows.__self__ is head and not list(table.buffers())  # one copy
    assert head.coded.exc_val.numel() > 0
    ids = torch.tensor([[0, 36, 15, 16], [17, 1, 31, 32], [36, 36, 0, 18]])
    assert torch.equal(table(ids), w.float()[ids])  # the native look-up where the kernels are on
    assert torch.equal(head.half_rows(ids.view(-1)).view(torch.int16), w[ids.view(-1)].view(torch.int16))  # reference
    assert torch.equal(HalfEmbedding(37, HalfLinear(w, coded=False))(ids), w.float()[ids])
    assert torch.equal(HalfEmbedding(37, w.half())(ids), w.half().float()[ids])


@needs_kernel
def test_skinny_linear_refuses_bad_inputs():
    from lmserve.layers.formats.linear import to_panels

    panels = to_panels(rand(20, 8))
    assert panels.shape == (2, 8, 16) and torch.equal(panels[1, :, 4:], torch.zeros(8, 12))  # zero padded
    with pytest.raises(RuntimeError, match="float32"):
        mod.skinny_linear(rand(1, 8).bfloat16(), panels, 20, None)
    with pytest.raises(RuntimeError, match="expected x"):
        mod.skinny_linear(rand(1, 9), panels, 20, None)
