"""The model transform pipeline: a loaded model is built pure (loader/: the model code's own modules, this rank's
weights in place), then every transform that makes it serve runs here, as gpt-fast applies quantization and tensor
parallelism to a finished model: `model = step(model, ctx)` for each step of TRANSFORMS, in order.

Each step is a named function over the whole model, a no-op where it does not apply, and each has a parity test
against the untransformed model (tests/test_transforms.py names them). The order matters: a weight format swaps the
float linears that the tensor-parallel wrappers then wrap; LoRA wraps the target linears of the finished format; the
MoE kernels read the experts' final format; the decode stack sees through LoRA and parallel wrappers only where they
pass through, so it comes after both; the warm-up builds the kernels the finished model calls.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from lmserve.config import LoraConfig
from lmserve.errors import ConfigError
from lmserve.layers.attention.paged import native_decode
from lmserve.layers.formats.linear import can_pack, pack_linears, skinny_coverage, widen_skinny_steps
from lmserve.layers.formats.parallel import apply_tensor_parallel
from lmserve.layers.formats.pipeline import apply_pipeline_parallel, stage_tp_group
from lmserve.layers.formats.quantized import quantize_linears
from lmserve.layers.kernels.decode_stack import DecodeStack, apply_decode_stack
from lmserve.layers.kernels.moe_kernels import apply_moe_kernels
from lmserve.layers.kernels.native import widens_half_fast
from lmserve.loader import LoadedModel, load_model
from lmserve.lora.slots import LoraSlots
from lmserve.utils import DTYPES

# the lines these steps log read as the load's (`lmserve.loader: skinny kernel: ...`), as before the pipeline
log = logging.getLogger("lmserve.loader")


@dataclass
class TransformContext:
    """What the steps read (the loaded model's facts and the engine's choices), and what two of them hand on."""

    loaded: LoadedModel  # its weight format (runtime_quantization), its shard, the whole model's config
    device: torch.device
    dtype: torch.dtype  # the dtype the model was loaded in
    pack: bool = True  # weight_format: the CPU float weights packed for oneDNN (False: plain nn.Linear)
    lora: LoraConfig | None = None  # None: LoRA off
    triton: bool = False  # the attention backend is Triton's: MoE layers take Triton's expert kernels
    kv_dtype: torch.dtype | None = None  # the KV cache's dtype (None: the parameters'), for warm_up
    # handed on by the steps
    lora_slots: LoraSlots | None = None  # lora: the device slots over the wrapped linears
    moe_layers: int = 0  # moe_kernels: layers that got a grouped expert kernel
    decode_stack: DecodeStack | None = None  # decode_stack: the native stack, where every layer is one it runs


Step = Callable[[nn.Module, TransformContext], nn.Module]


def weight_format(model: nn.Module, ctx: TransformContext) -> nn.Module:
    """The one weight-format transform over the filled model: int8/int4 weight-only layers (layers/formats/quantized.py),
    else the CPU float linears packed for oneDNN (layers/formats/linear.py). A GGUF file's or a pre-quantized checkpoint's
    blocks were kept while the model was built; what stayed float among them is packed here. An encoder's packed
    linears take the skinny kernel for steps of up to ENCODER_SKINNY_ROWS tokens (layers/formats/linear.py)."""
    quantization = ctx.loaded.runtime_quantization
    if quantization in ("int8", "int4"):
        quantize_linears(model, quantization)
    elif ctx.pack and can_pack(ctx.device, ctx.dtype):
        pack_linears(model)
        if quantization is None:
            _log_skinny_coverage(model)
        if ctx.loaded.config.encoder:
            widen_skinny_steps(model)
    return model


def tensor_parallel(model: nn.Module, ctx: TransformContext) -> nn.Module:
    """A rank's row-parallel layers wrapped to all-reduce their outputs (layers/formats/parallel.py), over any weight format;
    the loader left their biases on rank 0 alone. One rank: unchanged."""
    shard, stage = ctx.loaded.shard, ctx.loaded.stage
    if shard is None or shard.world_size == 1:
        return model
    if stage is not None and stage.world_size > 1:  # with pipeline stages: the all-reduces stay within the stage
        return apply_tensor_parallel(model, stage_tp_group(stage))
    return apply_tensor_parallel(model)


def pipeline_parallel(model: nn.Module, ctx: TransformContext) -> nn.Module:
    """A pipeline rank's layer loop replaced by its part of the send/receive ring (layers/formats/pipeline.py); the
    loader built only its layers. No pipeline: unchanged."""
    stage = ctx.loaded.stage
    if stage is None or stage.world_size == 1:
        return model
    return apply_pipeline_parallel(model, stage)


def lora(model: nn.Module, ctx: TransformContext) -> nn.Module:
    """With --enable-lora: the target linears wrapped with device slots (lora/slots.py); a step without adapters
    runs each wrapper's base layer alone."""
    c = ctx.lora
    if c is None:
        return model
    if ctx.loaded.shard is not None and ctx.loaded.shard.world_size > 1:
        raise ConfigError("--enable-lora does not split adapters across tensor-parallel ranks yet; "
                          "use --tensor-parallel-size 1")
    if ctx.loaded.stage is not None and ctx.loaded.stage.world_size > 1:
        raise ConfigError("--enable-lora does not split adapters across pipeline ranks yet; "
                          "use --pipeline-parallel-size 1")
    dtype = lora_slot_dtype(c.dtype, next(model.parameters()).dtype, ctx.device, ctx.loaded.runtime_quantization,
                            widens_half_fast())
    ctx.lora_slots = LoraSlots(model, ctx.loaded.config, c.max_loras, c.max_lora_rank, dtype, ctx.device)
    return model


def lora_slot_dtype(name: str, param_dtype: torch.dtype, device: torch.device, quantization: str | None,
                    fast_half: bool = True) -> torch.dtype:
    """--lora-dtype: a name, or auto. auto is float16 on a CPU whose base is float32 activations over weights kept in
    quantized blocks (a GGUF file's, int8/int4, a pre-quantized checkpoint's) and whose native kernels widen float16
    in vector loads (`fast_half`: layers/kernels/native.widens_half_fast), else the parameters' dtype (a kept GGUF's
    are float32). Why float16 there: a decode step reads every active adapter's A and B once, and in float32 that was
    more bytes than the 4-bit base (8 rank-16 adapters on the embedded SmolLM2: ~149 MiB a step against its ~100 MiB);
    a weight keeps 11 significant bits (below 6.1e-5, float16's subnormals, a fixed step of 6e-8 instead), far finer
    than the base's blocks. The native kernel widens them exactly and sums in float32 (csrc/lora_delta.cpp). Without
    F16C (x86-64-v2, no native kernels) it widened one value at a time, 3-5x slower than float32 slots: float32 there.
    A float base keeps float32 slots: its user asked for float32 everywhere."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cpu" and param_dtype == torch.float32 and quantization is not None and fast_half:
        return torch.float16
    return param_dtype


def moe_kernels(model: nn.Module, ctx: TransformContext) -> nn.Module:
    """Mixture-of-experts layers run their experts grouped, one kernel call per projection (Triton's with the Triton
    backend, else the native CPU kernels'); a weight format without one keeps the module path, the reference."""
    ctx.moe_layers = apply_moe_kernels(model, triton=ctx.triton)
    return model


def decode_stack(model: nn.Module, ctx: TransformContext) -> nn.Module:
    """Decode-only steps run every layer in one native call where the layers are ones it runs (layers/kernels/decode_stack.py);
    the module loop stays the reference. Not on a pipeline rank: its loop sends and receives between its layers."""
    if ctx.loaded.stage is not None and ctx.loaded.stage.world_size > 1:
        return model
    if not model.config.encoder:  # an encoder runs prompts only
        ctx.decode_stack = apply_decode_stack(model)
    return model


def warm_up(model: nn.Module, ctx: TransformContext) -> nn.Module:
    """Build or load the native decode kernel for this model's query and cache dtypes now (once per machine, ~30 s),
    not inside the first request. The model is unchanged."""
    cfg = model.config
    if cfg.encoder:  # no KV cache, no decode
        return model
    dtype = next(model.parameters()).dtype
    cache = torch.empty(0, cfg.head_dim, dtype=ctx.kv_dtype or dtype, device=ctx.device)  # only its dtype is read
    native_decode(cache, torch.empty(1, cfg.num_heads, cfg.head_dim, dtype=dtype, device=ctx.device))
    return model


# The pipeline, in order. Each step runs on every model that serves: the engine's (engine/build.py), a tensor-parallel
# worker rank's (worker/tp_worker.py) and a draft model's (engine/speculate.py).
TRANSFORMS: tuple[Step, ...] = (weight_format, tensor_parallel, pipeline_parallel, lora, moe_kernels, decode_stack, warm_up)
# What a model needs to run as loaded, with no runner (tests, benchmarks): `load_formatted`.
WEIGHT_STEPS: tuple[Step, ...] = (weight_format, tensor_parallel, pipeline_parallel)
# Steps that change how the weights are stored: a model reused for another engine (build_engine(cfg, loaded=...))
# keeps them, where a second run would quantize or wrap twice. The others re-apply (another backend may pick other
# kernels); LoRA wraps again, as it did before the pipeline.
_ONCE = frozenset({"weight_format", "tensor_parallel", "pipeline_parallel"})


def apply_transforms(ctx: TransformContext, steps: tuple[Step, ...] = TRANSFORMS) -> TransformContext:
    """Run `steps` over ctx.loaded.model in order (ctx.loaded.model becomes the result); returns ctx, with what the
    steps handed on."""
    model = ctx.loaded.model
    done: set[str] = model.__dict__.get("applied_transforms", set())  # names of the steps this model has had
    for step in steps:
        if step.__name__ in _ONCE and step.__name__ in done:
            continue
        model = step(model, ctx)
        done.add(step.__name__)
    model.__dict__["applied_transforms"] = done  # beside layer_progress's counter: a plain attribute, no submodule
    ctx.loaded.model = model
    return ctx


def load_formatted(model: str | Path | None, dtype: torch.dtype, device: torch.device, pack: bool = True,
                   **kwargs) -> LoadedModel:
    """load_model, then the weight steps (weight format, tensor parallelism): a model that runs as its weights will
    serve, for callers without a runner. `pack=False` keeps plain float nn.Linear; kwargs go to load_model."""
    loaded = load_model(model, dtype, device, **kwargs)
    apply_transforms(TransformContext(loaded, device, dtype, pack=pack), WEIGHT_STEPS)
    return loaded


def _log_skinny_coverage(net: nn.Module) -> None:
    """One line for the whole model instead of one per layer that failed the bit-identity check."""
    used, checked = skinny_coverage(net)
    if checked == 0:  # no native kernels, or weights that are not float32: nothing was checked
        return
    kept = f"; {checked - used} keep oneDNN (not bit-identical)" if used < checked else ""
    log.info("skinny kernel: %d of %d layers use it%s", used, checked, kept)
