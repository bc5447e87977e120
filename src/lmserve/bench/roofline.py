"""`lmserve bench roofline`: this machine's memory bandwidth and matmul throughput, and the ceilings
they put on a model: decode tokens/s at batch 1 (bytes read per token) and prefill tokens/s (FLOPs).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from lmserve.models import bert
from lmserve.models.config import ModelConfig
from lmserve.models.registry import family_of


@dataclass
class Roofline:
    """Measured machine limits and the model's ceilings derived from them."""

    bandwidth_gbs: float  # the slower of the two read-bandwidth measurements
    bandwidth_model_sized_gbs: float
    bandwidth_1gib_gbs: float
    matmul_tflops: dict[str, float]  # dtype -> TFLOP/s at the model's shapes
    weight_bytes: int
    flops_per_token: float
    decode_tok_s_ceiling: float  # batch 1: every weight byte read once per token
    prefill_tok_s_ceiling: float  # compute bound at the model's dtype

    def as_dict(self) -> dict:
        return asdict(self)


_WEIGHT_BUFFERS = ("packed", "codes", "scales", "mins", "half_panels")  # oneDNN-packed float weights; GGUF blocks
# kept quantized; a bf16 / fp16 head's panels, or a bf16 head's 12-bit codes (layers/formats/half_linear.py)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights read per decoded token: every projection and the LM head once.

    The embedding table only has rows looked up, so it counts only when it doubles as the LM head (a tied
    float head is the same Parameter; a tied GGUF head shares the table's storage).
    """
    embed = model.model.embed_tokens
    seen, total = set(), 0
    for module in model.modules():
        if module is embed:
            continue
        tensors = [*module.parameters(recurse=False),
                   *(b for n, b in module.named_buffers(recurse=False) if n in _WEIGHT_BUFFERS)]
        for t in tensors:
            key = _storage_key(t)
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
    return total


def _storage_key(t: torch.Tensor) -> int:
    """One key per weight held in memory: tensors sharing a storage (a tied head) count once."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # oneDNN-packed buffers are opaque: the object is the weight
        return id(t)


def flops_per_token(cfg: ModelConfig, context: int = 0) -> float:
    """Matmul FLOPs for one token, 2 per weight it multiplies: q, k, v and o; the MLP's three matrices where it is gated
    (two in BERT and XLM-R, whose MLP is up, GELU, down); an MoE layer's top-k experts, shared expert and router
    instead; the LM head, which an encoder has not (it pools; a classifier head runs once a sequence); plus
    attention over `context` keys."""
    h = cfg.hidden_size
    per_layer = h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h
    mlp_matrices = 2 if family_of(cfg).model is bert.EncoderModel else 3  # BERT's layers: up, GELU, down
    mlp = 0
    for i in range(cfg.num_layers):
        if cfg.is_moe_layer(i):
            shared = cfg.shared_expert_intermediate_size
            mlp += 3 * h * cfg.expert_size * cfg.num_experts_per_tok + h * cfg.num_experts \
                + (3 * h * shared + h if shared else 0)
        else:
            mlp += mlp_matrices * h * cfg.intermediate_size
    head = 0 if cfg.encoder else h * cfg.vocab_size
    attn = 2 * cfg.num_heads * cfg.head_dim * context  # q.k and p.v over the context
    return 2.0 * (cfg.num_layers * per_layer + mlp + head) + 2.0 * cfg.num_layers * attn


def read_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """GB/s of a full read (sum) over a buffer of `nbytes`, median of repeats after a warm-up."""
    buf = torch.ones(max(nbytes // 4, 1), dtype=torch.float32)
    buf.sum()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t)
    return buf.numel() * 4 / statistics.median(times) / 1e9


def matmul_tflops(cfg: ModelConfig, dtype: torch.dtype, tokens: int = 256, repeats: int = 3) -> float:
    """Best TFLOP/s of [tokens, hidden] x [hidden, intermediate] and back (the model's MLP shapes), over
    the plain and the pre-packed weight formats (layers/formats/linear.py)."""
    from lmserve.layers.formats.linear import PackedLinear, can_pack

    x = torch.randn(tokens, cfg.hidden_size, dtype=dtype)
    l1 = torch.nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False, dtype=dtype)
    l2 = torch.nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False, dtype=dtype)
    best = _time_mlp(lambda: l2(l1(x)), repeats)
    if can_pack(torch.device("cpu"), dtype):
        p1, p2 = PackedLinear(l1), PackedLinear(l2)
        best = min(best, _time_mlp(lambda: p2(p1(x)), repeats))
    return 2 * 2 * tokens * cfg.hidden_size * cfg.intermediate_size / best / 1e12


def _time_mlp(run, repeats: int) -> float:
    """Median seconds of `run` after one warm-up."""
    with torch.inference_mode():
        run()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            run()
            times.append(time.perf_counter() - t)
    return statistics.median(times)



def measure(model: torch.nn.Module, cfg: ModelConfig, dtype: torch.dtype) -> Roofline:
    """Measure the machine and derive the model's ceilings."""
    wbytes = weight_bytes(model)
    bw_model = read_bandwidth(wbytes)
    bw_big = read_bandwidth(2**30)
    tflops = {str(d).removeprefix("torch."): matmul_tflops(cfg, d) for d in (torch.float32, torch.bfloat16)}
    bandwidth = min(bw_model, bw_big)
    fpt = flops_per_token(cfg)
    compute = tflops.get(str(dtype).removeprefix("torch."), tflops["float32"])
    return Roofline(bandwidth, bw_model, bw_big, tflops, wbytes, fpt,
                    decode_tok_s_ceiling=bandwidth * 1e9 / wbytes,
                    prefill_tok_s_ceiling=compute * 1e12 / fpt)


def format_roofline(r: Roofline, model_name: str) -> str:
    """Human-readable report."""
    lines = [
        f"model: {model_name}  weights read per token: {r.weight_bytes / 2**20:.0f} MiB  "
        f"FLOPs per token: {r.flops_per_token / 1e9:.2f} GFLOP",
        f"memory read bandwidth: {r.bandwidth_gbs:.1f} GB/s (model-sized buffer {r.bandwidth_model_sized_gbs:.1f}, "
        f"1 GiB buffer {r.bandwidth_1gib_gbs:.1f}; the slower counts)",
        "matmul at the model's shapes: " + ", ".join(f"{k} {v:.3f} TFLOP/s" for k, v in r.matmul_tflops.items()),
        f"ceiling, decode at batch 1: {r.decode_tok_s_ceiling:.1f} tok/s (bandwidth / weight bytes)",
        f"ceiling, prefill: {r.prefill_tok_s_ceiling:.0f} tok/s (matmul throughput / FLOPs per token)",
    ]
    return "\n".join(lines)
