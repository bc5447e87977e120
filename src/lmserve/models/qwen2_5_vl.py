"""Qwen2.5-VL: a dynamic-resolution ViT with windowed attention (models/vision/qwen2_5_vl.py) beside a Qwen2 text
model whose rotary is M-RoPE (three position axes, `mrope_section`).

The text model is the shared CausalLM read as models/llama.py reads Qwen2; this family adds `encode_images` and the
tower's settings and tensor names. The positions are not the model's business: the processor computes each image
token's (time, row, column) position (multimodal/qwen2_5_vl.py `mrope_positions`), the request carries them on its
images (MMInput.rope) and the runner hands the forward [3, T] positions (worker/mm_encoder.py).
Checkpoints of transformers 4 (text at the top level, `model.layers.*`, `visual.*`) and 5 (`text_config`,
`model.language_model.*`, `model.visual.*`) both load. llama.cpp's text GGUF of it has the architecture `qwen2vl`
(`QWEN2VL_TEXT`: Qwen2 with M-RoPE's sections in `rope.dimension_sections`); beside its mmproj file
(loader/mmproj.py, projector type `qwen2.5vl_merger`) it is served as this family.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from lmserve.errors import CheckpointError
from lmserve.models import llama
from lmserve.models.config import ModelConfig, VisionConfig
from lmserve.models.decoder import CausalLM
from lmserve.models.family import Family, Fields, GGUFMeta, Tensors
from lmserve.models.vision.qwen2_5_vl import Qwen25VisionConfig, Qwen25VisionTransformer
from lmserve.models.vision.vit import ACTIVATIONS

# Qwen2_5_VLVisionConfig's defaults (a config.json names only what differs)
_VISION = {"depth": 32, "hidden_size": 3584, "intermediate_size": 3420, "num_heads": 16, "hidden_act": "silu",
           "out_hidden_size": 3584, "fullatt_block_indexes": [7, 15, 23, 31], "patch_size": 14,
           "temporal_patch_size": 2, "spatial_merge_size": 2, "window_size": 112, "in_channels": 3}


def tower_config(cfg: ModelConfig) -> Qwen25VisionConfig:
    """The pure tower's config from ModelConfig.vision (what `_hf_fields` read); its output is the text width."""
    v = cfg.vision
    return Qwen25VisionConfig(v.hidden_size, v.intermediate_size, v.num_layers, v.num_heads, v.hidden_act,
                              cfg.hidden_size, v.fullatt_blocks, v.patch_size, v.temporal_patch_size, v.scale_factor,
                              v.window_size, in_channels=v.num_channels)


class Qwen25VLM(CausalLM):
    """CausalLM (M-RoPE) plus Qwen2.5-VL's vision transformer and merger (under `vision.`)."""

    ENCODER_PREFIXES = ("vision.",)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.vision = Qwen25VisionTransformer(tower_config(cfg))

    def encode_images(self, pixel_values: torch.Tensor, grid: tuple[int, int, int] = (1, 0, 0)) -> torch.Tensor:
        """One image's patches [t*h*w, 3*2*14*14] and its grid (t, h, w) in patches (the processor's meta) -> its
        embeddings [t*h*w / merge^2, hidden]."""
        dtype = self.vision.merger.ln_q.weight.dtype  # a norm: no transform repacks it
        return self.vision.encode_images(pixel_values.to(dtype), [tuple(int(g) for g in grid)])[0]


def _mrope(scaling: Mapping[str, Any] | None) -> tuple[dict | None, list | None]:
    """(the rope scaling without M-RoPE's keys, mrope_section): transformers 4 writes `type: mrope` beside a
    default rope, 5 `rope_type: default` beside `type: mrope`."""
    if not scaling:
        return None, None
    rest = {k: v for k, v in scaling.items() if k != "mrope_section"}
    if rest.get("type") == "mrope":
        rest.pop("type")
    if rest.get("rope_type") == "mrope":
        rest["rope_type"] = "default"
    return rest, scaling.get("mrope_section")


def _text_config(raw: Mapping[str, Any]) -> Mapping[str, Any]:
    """The text model's config (nested or at the top level), M-RoPE's section under `_mrope_section` and the
    tower's settings under `_vision`, for `_hf_fields`."""
    text = dict(raw.get("text_config") or {k: v for k, v in raw.items() if k != "vision_config"})
    section = None
    for key in ("rope_scaling", "rope_parameters"):
        if text.get(key):
            text[key], found = _mrope(text[key])
            section = section or found
    if "tie_word_embeddings" in raw:
        text["tie_word_embeddings"] = raw["tie_word_embeddings"]
    text["_mrope_section"] = section
    text["_vision"] = dict(_VISION | dict(raw.get("vision_config") or {}), image_token_id=raw.get("image_token_id"))
    return text


def _hf_fields(cfg: Mapping[str, Any]) -> Fields:
    v = cfg["_vision"]
    if v["hidden_act"] not in ACTIVATIONS:
        raise ValueError(f"vision_config.hidden_act {v['hidden_act']!r} is not supported")
    section = cfg["_mrope_section"]
    if not section:
        raise CheckpointError("config.json: Qwen2.5-VL without rope_scaling.mrope_section")
    return llama._qwen2_hf(cfg) | {"mrope_section": tuple(int(s) for s in section), "vision": VisionConfig(
        hidden_size=int(v["hidden_size"]), intermediate_size=int(v["intermediate_size"]),
        num_layers=int(v["depth"]), num_heads=int(v["num_heads"]), patch_size=int(v["patch_size"]),
        num_channels=int(v["in_channels"]), hidden_act=v["hidden_act"], scale_factor=int(v["spatial_merge_size"]),
        temporal_patch_size=int(v["temporal_patch_size"]), window_size=int(v["window_size"]),
        fullatt_blocks=tuple(int(i) for i in v["fullatt_block_indexes"]),
        image_token_id=None if v.get("image_token_id") is None else int(v["image_token_id"]))}


_TEXT = (("model.language_model.", "model."), ("lm_head.", "lm_head."), ("model.", "model."))


def _checkpoint_tensors(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> Tensors:
    """The tower's tensors (`visual.*`, `model.visual.*`) under `vision.`; the text model's under `model.`."""
    bare = name.removeprefix("model.")
    if bare.startswith("visual."):
        yield "vision." + bare[len("visual."):], tensor
        return
    for prefix, new in _TEXT:
        if name.startswith(prefix):
            yield new + name[len(prefix):], tensor
            return
    yield name, tensor  # an unexpected tensor: load_weights names it


def _gguf_fields(m: GGUFMeta) -> Fields:
    """llama.cpp's `qwen2vl`: Qwen2 (q/k/v biases, rotary halves rotated as HF's, so no q/k permutation) whose
    `rope.dimension_sections` are M-RoPE's (time, row, column) pairs padded with a 4th, unused axis to 4."""
    sections = [int(s) for s in m.require("rope.dimension_sections")]
    if len(sections) not in (3, 4) or any(sections[3:]):
        raise CheckpointError(f"GGUF metadata: {m.arch}.rope.dimension_sections {sections} must be 3 M-RoPE sections "
                              "(time, row, column) and an unused 4th of 0")
    return {"qkv_bias": True, "mrope_section": tuple(sections[:3])}


QWEN2_5_VL = Family("qwen2_5_vl", hf_fields=_hf_fields, text_config=_text_config,
                    checkpoint_tensors=_checkpoint_tensors, model=Qwen25VLM)

# the text GGUF alone (llama.cpp's `qwen2vl`): the text model, with M-RoPE; its positions are [T] without images
QWEN2VL_TEXT = Family("qwen2vl", gguf_fields=_gguf_fields)
