"""A vision-language model from llama.cpp's two files: the text GGUF and its multimodal projector (`mmproj`) GGUF.

llama.cpp's converter (`convert_hf_to_gguf.py --mmproj`) writes the vision tower and the connector into a file of
architecture `clip` whose `clip.projector_type` names the connector. This module is the one place that knows that
file: its metadata becomes our VisionConfig and the family's preprocessing settings (in the shape of the HF
processor files, so the family's own processor reads them), and its tensor names become the tower's HF names. The
model files stay as they are: the text GGUF loads as for a text model, then the config is the vision family's.

Supported projector types: `idefics3` (SmolVLM / Idefics3: SigLIP, pixel shuffle, one linear).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from lmserve.errors import CheckpointError
from lmserve.loader.gguf_file import GGUFFile, read_gguf
from lmserve.loader.gguf_loader import _dequantize
from lmserve.models.config import ModelConfig, VisionConfig

# SigLIP's layer tensors: llama.cpp's clip names (tools/mtmd/clip-impl.h) -> the tower's HF names
_SIGLIP_LAYER = {"ln1": "layer_norm1", "ln2": "layer_norm2", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                 "attn_v": "self_attn.v_proj", "attn_out": "self_attn.out_proj", "ffn_up": "mlp.fc1",
                 "ffn_down": "mlp.fc2"}
_SIGLIP_TOP = {"v.patch_embd": "vision_model.embeddings.patch_embedding",
               "v.position_embd": "vision_model.embeddings.position_embedding", "v.post_ln": "vision_model.post_layernorm"}
_BLOCK = re.compile(r"^v\.blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)$")


@dataclass(frozen=True)
class Projector:
    """What one `clip.projector_type` is in our terms: the HF architecture served, and its connector's tensors."""

    architecture: str
    connector: dict[str, str]  # clip tensor name (without .weight/.bias) -> our name


PROJECTORS = {
    "idefics3": Projector("Idefics3ForConditionalGeneration", {"mm.model.fc": "connector.modality_projection.proj"}),
}


@dataclass
class Mmproj:
    """A read, checked mmproj file: its tensors, the tower's config and the preprocessing settings."""

    file: GGUFFile
    projector: Projector
    vision: VisionConfig
    preprocessor: dict[str, Any]  # preprocessor_config.json's keys, as the family's processor reads them
    processor: dict[str, Any]  # processor_config.json's

    @property
    def path(self) -> Path:
        return self.file.path


def read_mmproj(path: str | Path, text: ModelConfig) -> Mmproj:
    """Read and check an mmproj file against the text model it is served with; a CheckpointError (one line, naming
    the file) for anything that is not a supported projector of that text model."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise CheckpointError(f"--mmproj {path}: no such file")
    f = read_gguf(path)
    meta = f.metadata
    if meta.get("general.architecture") != "clip":
        raise CheckpointError(f"--mmproj {path}: general.architecture is {meta.get('general.architecture')!r}, "
                              "expected 'clip' (a multimodal projector file written by convert_hf_to_gguf.py --mmproj)")
    if not meta.get("clip.has_vision_encoder"):
        raise CheckpointError(f"--mmproj {path}: no vision encoder (clip.has_vision_encoder is not true)")
    kind = meta.get("clip.projector_type")
    projector = PROJECTORS.get(kind)
    if projector is None:
        raise CheckpointError(f"--mmproj {path}: projector type {kind!r} is not supported (supported: "
                              f"{', '.join(sorted(PROJECTORS))})")
    try:
        vision, pre, proc = _idefics3(meta)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"--mmproj {path}: malformed metadata: {e}") from None
    out = _connector_width(f, projector)
    if out != text.hidden_size:
        raise CheckpointError(f"--mmproj {path}: its projector writes {out}-wide embeddings but the text model's "
                              f"hidden size is {text.hidden_size} (an mmproj of another model?)")
    return Mmproj(f, projector, vision, pre, proc)


def vision_model_config(text: ModelConfig, mm: Mmproj) -> ModelConfig:
    """The text GGUF's config as the vision family's: its architecture and the tower's config."""
    return replace(text, architecture=mm.projector.architecture, vision=mm.vision)


def _key(meta: dict[str, Any], key: str, kind: type = int) -> Any:
    value = meta.get(f"clip.vision.{key}")
    if value is None:
        raise KeyError(f"clip.vision.{key} is missing")
    if kind is int and (not isinstance(value, (int, np.integer)) or isinstance(value, bool) or not 0 < value <= 1 << 20):
        raise ValueError(f"clip.vision.{key} must be a positive integer, got {value!r}"[:120])
    return kind(value)


def _f32(value: Any) -> float:
    """A float32 metadata value as the decimal it was written from (1e-06, not 9.99999997e-07): the shortest repr
    that round-trips the float32, so the LayerNorm sees the HF config's epsilon."""
    return float(str(np.float32(value)))


def _triple(meta: dict[str, Any], key: str) -> tuple[float, float, float]:
    value = [float(v) for v in meta.get(f"clip.vision.{key}", (0.5, 0.5, 0.5))]
    if len(value) != 3:
        raise ValueError(f"clip.vision.{key} must hold 3 numbers")
    return value[0], value[1], value[2]


def _idefics3(meta: dict[str, Any]) -> tuple[VisionConfig, dict[str, Any], dict[str, Any]]:
    """SmolVLM's tower and processor settings. llama.cpp keeps SigLIP's tanh GELU as `clip.use_gelu` and always
    splits an image larger than a tile (Idefics3's default), with the rescale of 1/255 it hard-codes."""
    image, patch = _key(meta, "image_size"), _key(meta, "patch_size")
    scale = int(meta.get("clip.vision.projector.scale_factor", 2))
    if image % patch or (image // patch) % scale:
        raise ValueError(f"image_size {image} is not a whole number of {patch}-pixel patches in {scale}x{scale} blocks")
    vision = VisionConfig(hidden_size=_key(meta, "embedding_length"), intermediate_size=_key(meta, "feed_forward_length"),
                          num_layers=_key(meta, "block_count"), num_heads=_key(meta, "attention.head_count"),
                          image_size=image, patch_size=patch,
                          layer_norm_eps=_f32(meta.get("clip.vision.attention.layer_norm_epsilon", 1e-6)),
                          hidden_act="gelu_tanh" if meta.get("clip.use_gelu", True) else "gelu", scale_factor=scale)
    longest = int(meta.get("clip.vision.preproc_image_size", image))
    pre = {"size": {"longest_edge": longest}, "max_image_size": {"longest_edge": image}, "do_image_splitting": True,
           "image_mean": list(_triple(meta, "image_mean")), "image_std": list(_triple(meta, "image_std")),
           "rescale_factor": 1 / 255}
    return vision, pre, {"image_seq_len": (image // patch) ** 2 // scale ** 2}


def _connector_width(f: GGUFFile, projector: Projector) -> int:
    """The connector's output width (the text model's hidden size it must equal)."""
    last = next(iter(projector.connector))  # the final projection is listed first
    t = next((t for t in f.tensors if t.name == last + ".weight"), None)
    if t is None or len(t.shape) != 2:
        raise CheckpointError(f"--mmproj {f.path}: no 2-D {last}.weight tensor")
    return int(t.shape[0])


def mmproj_tensors(mm: Mmproj) -> Iterator[tuple[str, torch.Tensor, str]]:
    """(our name, float32 tensor, file) for every tensor of the mmproj; an unknown tensor is a CheckpointError."""
    for t in mm.file.tensors:
        stem, _, kind = t.name.rpartition(".")
        m = _BLOCK.match(t.name)
        if m is not None and m.group(2) in _SIGLIP_LAYER:
            name = f"vision_model.encoder.layers.{m.group(1)}.{_SIGLIP_LAYER[m.group(2)]}.{kind}"
        elif stem in _SIGLIP_TOP:
            name = f"{_SIGLIP_TOP[stem]}.{kind}"
        elif stem in mm.projector.connector:
            name = f"{mm.projector.connector[stem]}.{kind}"
        else:
            raise CheckpointError(f"--mmproj {mm.path}: unexpected tensor {t.name!r}")
        yield name, _dequantize(t, mm.path), str(mm.path)
