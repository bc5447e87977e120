"""layers/blocks/fused_linear.py: a packed linear with its activation or residual add fused into oneDNN's GEMM gives
the composed reference's numbers (nn.Linear, then the activation or the add), at step sizes on both sides of the
skinny kernel's rows, and every other weight format runs the reference itself."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lmserve.layers.blocks import fused_linear
from lmserve.layers.blocks.fused_linear import ACTS, linear_act, linear_add
from lmserve.layers.formats.linear import SKINNY_MAX_ROWS, PackedLinear, can_pack

pytestmark = pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.float32), reason="oneDNN packing unavailable")


def _layer(n_in: int, n_out: int, bias: bool = True) -> tuple[nn.Linear, PackedLinear]:
    torch.manual_seed(n_in * 7 + n_out)
    ref = nn.Linear(n_in, n_out, bias=bias)
    return ref, PackedLinear(ref)


@pytest.mark.parametrize("rows", [1, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 1, 300])
@pytest.mark.parametrize("act", sorted(ACTS))
def test_linear_act_matches_reference(act: str, rows: int) -> None:
    ref, packed = _layer(96, 160)
    x = torch.randn(rows, 96) * 3
    want = ACTS[act](ref(x))
    got = linear_act(packed, x, act)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(linear_act(ref, x, act), want)  # a plain nn.Linear runs the reference


@pytest.mark.parametrize("rows", [1, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 1, 300])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_add_matches_reference(rows: int, bias: bool) -> None:
    ref, packed = _layer(160, 96, bias)
    x, residual = torch.randn(rows, 160), torch.randn(rows, 96)
    want = ref(x) + residual
    torch.testing.assert_close(linear_add(packed, x, residual), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(linear_add(ref, x, residual), want)
    strided = torch.randn(96, rows).t()  # not contiguous: the composed calls
    torch.testing.assert_close(linear_add(packed, x, strided), ref(x) + strided, rtol=1e-5, atol=1e-5)


def test_fused_only_where_onednn_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps the skinny kernel takes keep the composed calls (its rows are oneDNN's bits); larger ones call the fused
    op where it gives the composed calls' bits on this layer (checked once, the first time)."""
    _, packed = _layer(96, 160)
    linear_act(packed, torch.randn(SKINNY_MAX_ROWS + 1, 96), "gelu")  # the one-time check
    exact = packed.panels is None or packed._post_op_exact["gelu"]
    calls: list[str] = []
    real = torch.ops.mkldnn._linear_pointwise

    class Spy:
        def __call__(self, *args):
            calls.append(args[3])
            return real(*args)

        binary = real.binary

    monkeypatch.setattr(fused_linear.torch.ops.mkldnn, "_linear_pointwise", Spy())
    linear_act(packed, torch.randn(SKINNY_MAX_ROWS + 1, 96), "gelu")
    assert calls == (["gelu"] if exact else ["none"])
    calls.clear()
    linear_act(packed, torch.randn(2, 96), "gelu")
    assert calls == ([] if packed.panels is not None else ["gelu"])
    calls.clear()
    linear_act(packed, torch.randn(20, 96), "silu")  # no post-op of oneDNN's here: the linear, then F.silu
    assert calls == ["none"]


@pytest.mark.parametrize("op", [*sorted(ACTS), "add"])
def test_rows_do_not_depend_on_the_step_size(op: str) -> None:
    """A row's bits are the same in a step of 1-8 rows (the skinny kernel, composed) as in a step of 300 (oneDNN,
    fused where that gives the same bits): a sequence's numbers never depend on what shares its step."""
    _, packed = _layer(96, 96)
    x, residual = torch.randn(300, 96), torch.randn(300, 96)
    run = (lambda a, r: linear_add(packed, a, r)) if op == "add" else (lambda a, r: linear_act(packed, a, op))
    whole = run(x, residual)
    for m in range(1, SKINNY_MAX_ROWS + 1):
        assert torch.equal(run(x[:m], residual[:m]), whole[:m]), m


@pytest.mark.parametrize("op", ["gelu", "add"])
def test_an_encoders_short_steps_keep_their_bits_on_the_skinny_kernel(op: str) -> None:
    """An encoder's packed linears take steps of up to ENCODER_SKINNY_ROWS rows on the skinny kernel (slabs of 8,
    composed with the activation or add) on an AVX2 CPU without AVX-512; a row's bits are still those of a 300-row
    step (oneDNN, fused where exact), and other CPUs keep the decoders' limit."""
    from lmserve.layers.formats.linear import ENCODER_SKINNY_ROWS, widen_skinny_steps

    _, packed = _layer(96, 96)
    net = nn.Sequential(packed)
    assert widen_skinny_steps(net, "flags : fma avx2 avx512f") == 0 and packed.skinny_rows == SKINNY_MAX_ROWS
    assert widen_skinny_steps(net, "Features : fp asimd") == 0 and packed.skinny_rows == SKINNY_MAX_ROWS
    assert widen_skinny_steps(net, "flags : fma avx2") == (packed.panels is not None)
    if packed.panels is None:
        pytest.skip("this CPU's oneDNN sums in another order: the layer keeps oneDNN only")
    assert packed.skinny_rows == ENCODER_SKINNY_ROWS
    x, residual = torch.randn(300, 96), torch.randn(300, 96)
    run = (lambda a, r: linear_add(packed, a, r)) if op == "add" else (lambda a, r: linear_act(packed, a, op))
    whole = run(x, residual)
    for m in (1, 9, 17, 37, ENCODER_SKINNY_ROWS, ENCODER_SKINNY_ROWS + 1):
        assert torch.equal(run(x[:m], residual[:m]), whole[:m]), m


def test_encoder_layer_runs_fused_and_matches() -> None:
    """A BERT layer over packed linears (the weight-format transform's output) against the same layer unpacked."""
    from lmserve.models.bert import EncoderLayer, step_sequences
    from lmserve.models.config import ModelConfig

    cfg = ModelConfig(architecture="BertModel", vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=1,
                      num_heads=4, num_kv_heads=4, head_dim=16, rms_norm_eps=1e-12, hidden_act="gelu", encoder=True)
    torch.manual_seed(0)
    layer = EncoderLayer(cfg).eval()
    packed = EncoderLayer(cfg).eval()
    packed.load_state_dict(layer.state_dict())
    for name in ("qkv", "o_proj", "up", "down"):
        setattr(packed, name, PackedLinear(getattr(layer, name)))
    positions = torch.cat([torch.arange(n) for n in (5, 17, 40)])
    seqs = step_sequences(positions, positions.numel())
    x = torch.randn(positions.numel(), 64)
    with torch.no_grad():
        torch.testing.assert_close(packed(x, seqs), layer(x, seqs), rtol=1e-5, atol=1e-5)
