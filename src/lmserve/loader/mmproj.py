"""A vision-language model from llama.cpp's two files: the text GGUF and its multimodal projector (`mmproj`) GGUF.

llama.cpp's converter (`convert_hf_to_gguf.py --mmproj`) writes the vision tower and the connector into a file of
architecture `clip` whose `clip.projector_type` names the connector. This module is the one place that knows that
file: its metadata becomes our VisionConfig and the family's preprocessing settings (in the shape of the HF
processor files, so the family's own processor reads them), and its tensor names become the tower's HF names. The
model files stay as they are: the text GGUF loads as for a text model, then the config is the vision family's.

Supported projector types: `idefics3` (SmolVLM / Idefics3: SigLIP, pixel shuffle, one linear), `gemma3` (Gemma 3:
SigLIP average-pooled to soft tokens, RMSNorm, one matmul), `mlp` (LLaVA-1.5 as llama.cpp's legacy script writes
it: CLIP cut at the layer read, a 2-layer MLP) and `qwen2.5vl_merger` (Qwen2.5-VL: the windowed ViT and its 2x2
merger, beside the `qwen2vl` text GGUF). LLaVA-NeXT's files from the legacy script (type `mlp` too, with
`clip.vision.image_grid_pinpoints`) are refused by that metadata: its anyres tiling is served from HF safetensors
only. The tower's tensors take the HF checkpoint's names, so the family's own checkpoint mapping reads them as it
reads a safetensors checkpoint; what the converter changed is undone here (Gemma 3's norm offset: `shift`;
Qwen2.5-VL's split qkv and its Conv3d cut into two 2-D kernels: `join`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from lmserve.errors import CheckpointError
from lmserve.loader.gguf_file import GGUFFile, read_gguf
from lmserve.loader.gguf_loader import _dequantize
from lmserve.models.config import ModelConfig, VisionConfig

# a ViT layer's tensors: llama.cpp's clip names (tools/mtmd/clip-impl.h) -> HF's (the converter's inverse)
_LAYER = {"ln1": "layer_norm1", "ln2": "layer_norm2", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_out": "self_attn.out_proj", "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"}
# the legacy LLaVA script (convert_image_encoder_to_gguf.py) names fc1 `ffn_down` and fc2 `ffn_up`
_LEGACY_LAYER = _LAYER | {"ffn_up": "mlp.fc2", "ffn_down": "mlp.fc1"}
_TOP = {"v.patch_embd": "embeddings.patch_embedding", "v.position_embd": "embeddings.position_embedding",
        "v.post_ln": "post_layernorm", "v.pre_ln": "pre_layrnorm", "v.class_embd": "embeddings.class_embedding"}
_BLOCK = re.compile(r"^v\.blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)$")
Settings = tuple[VisionConfig, dict[str, Any], dict[str, Any]]
Named = Iterator[tuple[str, torch.Tensor]]


def _as_is(tensors: Named) -> Named:
    return tensors


@dataclass(frozen=True)
class Projector:
    """What one `clip.projector_type` is in our terms: the HF architecture served, where its tower's tensors go, its
    connector's tensors, the tensor whose `width_axis` is the text model's hidden size, and how the metadata
    becomes the tower's config and the processor's settings."""

    architecture: str
    tower: str  # the HF checkpoint's prefix of the tower's tensors
    connector: dict[str, str]  # clip tensor name -> HF name
    width: str
    width_axis: int
    settings: Callable[[dict[str, Any]], Settings]
    layer: dict[str, str] = field(default_factory=lambda: _LAYER)
    shift: dict[str, float] = field(default_factory=dict)  # clip tensor name -> what the converter added to it
    blocks: str = "encoder.layers."  # the tower's prefix of layer N's tensors, before N
    top: dict[str, str] = field(default_factory=lambda: _TOP)  # the tower's other tensors (stems), clip -> HF
    join: Callable[[Named], Named] = _as_is  # the (HF name, tensor) stream with the converter's pieces put together
    text_architectures: tuple[str, ...] = ()  # the text GGUF's architectures it serves beside (empty: any)


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
    _refuse_llava_next(path, meta)
    projector = PROJECTORS.get(kind)
    if projector is None:
        raise CheckpointError(f"--mmproj {path}: projector type {kind!r} is not supported (supported: "
                              f"{', '.join(sorted(PROJECTORS))})")
    if projector.text_architectures and text.architecture not in projector.text_architectures:
        raise CheckpointError(f"--mmproj {path}: a {kind} projector goes with a text GGUF of architecture "
                              f"{' or '.join(projector.text_architectures)}, not {text.architecture!r}")
    try:
        vision, pre, proc = projector.settings(meta)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"--mmproj {path}: malformed metadata: {e}") from None
    out = _connector_width(f, projector)
    if out != text.hidden_size:
        raise CheckpointError(f"--mmproj {path}: its projector writes {out}-wide embeddings but the text model's "
                              f"hidden size is {text.hidden_size} (an mmproj of another model?)")
    return Mmproj(f, projector, vision, pre, proc)


def _refuse_llava_next(path: Path, meta: dict[str, Any]) -> None:
    """LLaVA-NeXT as the legacy script writes it: type `mlp` like LLaVA-1.5, told apart only by its anyres metadata.
    Read as LLaVA-1.5 it would load (its `image_newline` aside) and answer from one squashed view where the model
    was trained on tiles: refused by name instead."""
    pinpoints = meta.get("clip.vision.image_grid_pinpoints")
    merge = str(meta.get("clip.vision.mm_patch_merge_type") or "flat")
    if pinpoints is None and merge == "flat":  # LLaVA-1.5's files: no pinpoints, merge type absent or "flat"
        return
    found = ", ".join(([] if pinpoints is None else ["clip.vision.image_grid_pinpoints"])
                      + ([] if merge == "flat" else [f"mm_patch_merge_type {merge[:20]!r}"]))
    raise CheckpointError(f"--mmproj {path}: a LLaVA-NeXT projector ({found}) is not supported from GGUF; serve "
                          "LLaVA-NeXT from its HF safetensors directory (projector types supported: "
                          f"{', '.join(sorted(PROJECTORS))}; 'mlp' is LLaVA-1.5's)")


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


def _idefics3(meta: dict[str, Any]) -> Settings:
    """SmolVLM's tower and processor settings. llama.cpp keeps SigLIP's tanh GELU as `clip.use_gelu` and always
    splits an image larger than a tile (Idefics3's default), with the rescale of 1/255 it hard-codes."""
    image, patch = _key(meta, "image_size"), _key(meta, "patch_size")
    scale = int(meta.get("clip.vision.projector.scale_factor", 2))
    if image % patch or (image // patch) % scale:
        raise ValueError(f"image_size {image} is not a whole number of {patch}-pixel patches in {scale}x{scale} blocks")
    vision = _tower(meta, "gelu_tanh" if meta.get("clip.use_gelu", True) else "gelu", scale_factor=scale)
    longest = int(meta.get("clip.vision.preproc_image_size", image))
    pre = {"size": {"longest_edge": longest}, "max_image_size": {"longest_edge": image}, "do_image_splitting": True,
           "image_mean": list(_triple(meta, "image_mean")), "image_std": list(_triple(meta, "image_std")),
           "rescale_factor": 1 / 255}
    return vision, pre, {"image_seq_len": (image // patch) ** 2 // scale ** 2}


def _tower(meta: dict[str, Any], act: str, **fields: Any) -> VisionConfig:
    """The ViT's config from the clip.vision keys every projector type has."""
    return VisionConfig(hidden_size=_key(meta, "embedding_length"), intermediate_size=_key(meta, "feed_forward_length"),
                        num_layers=_key(meta, "block_count"), num_heads=_key(meta, "attention.head_count"),
                        image_size=_key(meta, "image_size"), patch_size=_key(meta, "patch_size"),
                        layer_norm_eps=_f32(meta.get("clip.vision.attention.layer_norm_epsilon", 1e-6)),
                        hidden_act=act, **fields)


def _gemma3(meta: dict[str, Any]) -> Settings:
    """Gemma 3's SigLIP, its patch grid average-pooled by `projector.scale_factor` (llama.cpp's default 4: 64x64
    patches to 16x16 = 256 soft tokens) and its processor: the image squashed to the tower's square, bilinear, as
    Gemma3ImageProcessor does (pan-and-scan off, its default). `clip.use_gelu` is ggml's GELU, the tanh form
    SigLIP's gelu_pytorch_tanh is."""
    scale = int(meta.get("clip.vision.projector.scale_factor", 4))
    side = _key(meta, "image_size") // _key(meta, "patch_size")
    if scale < 1 or side % scale:
        raise ValueError(f"a {side}x{side} patch grid is not pooled by {scale}")
    tokens = (side // scale) ** 2
    vision = _tower(meta, "gelu_tanh", tokens_per_image=tokens)
    size = vision.image_size
    pre = {"size": {"height": size, "width": size}, "resample": 2, "rescale_factor": 1 / 255,
           "image_mean": list(_triple(meta, "image_mean")), "image_std": list(_triple(meta, "image_std"))}
    return vision, pre, {"mm_tokens_per_image": tokens}


def _llava(meta: dict[str, Any]) -> Settings:
    """LLaVA-1.5 from the legacy script (tools/mtmd/legacy-models/convert_image_encoder_to_gguf.py): a CLIP tower
    cut after the layer the projector reads (`block_count`; `feature_layer`, non-negative, where the config named
    it), CLS dropped, a 2-layer GELU MLP. `clip.use_gelu` is the HF config's `hidden_act == "gelu"`, else CLIP's
    quick GELU. The processor is llava-hf's CLIPImageProcessor at the tower's size (shortest edge, centre crop,
    bicubic): the file does not say how the image was framed."""
    layers = [int(i) for i in meta.get("clip.vision.feature_layer", [])]
    vision = _tower(meta, "gelu" if meta.get("clip.use_gelu") else "quick_gelu",
                    feature_layers=tuple(layers) or (-1,), feature_select="default")
    if any(not 0 <= i <= vision.num_layers for i in layers):
        raise ValueError(f"clip.vision.feature_layer {layers} is outside the tower's {vision.num_layers} layers")
    size = vision.image_size
    pre = {"size": {"shortest_edge": size}, "crop_size": {"height": size, "width": size}, "resample": 3,
           "image_mean": list(_triple(meta, "image_mean")), "image_std": list(_triple(meta, "image_std"))}
    return vision, pre, {"image_size": size, "patch_size": vision.patch_size}


# Qwen2.5-VL's processor where the file does not say (the converter writes neither): the released checkpoints'
# preprocessor_config.json, so a released model serves as its safetensors directory does. llama.cpp itself
# hard-codes the attention window (112 px) and the merge (2); it resizes by its own rules.
_QWEN_PIXELS = (56 * 56, 28 * 28 * 16384)


def _qwen25vl(meta: dict[str, Any]) -> Settings:
    """Qwen2.5-VL's tower and Qwen2VLImageProcessor's settings. The converter keeps the full-attention blocks as
    their period `n_wa_pattern` (it refuses fullatt_block_indexes that are not every n-th block: 7, 15, 23, 31 is
    8), SiLU as `clip.use_silu` (else ggml's GELU, the tanh form), and the temporal patch as the two kernels it
    cut the Conv3d into (it refuses any but 2)."""
    layers, pattern = _key(meta, "block_count"), _key(meta, "n_wa_pattern")
    patch = _key(meta, "patch_size")
    merge = _key(meta, "spatial_merge_size") if "clip.vision.spatial_merge_size" in meta else 2
    window = _key(meta, "window_size") if "clip.vision.window_size" in meta else 112
    pixels = tuple(_key(meta, k) if f"clip.vision.{k}" in meta else d
                   for k, d in zip(("image_min_pixels", "image_max_pixels"), _QWEN_PIXELS))
    if window % (patch * merge):
        raise ValueError(f"window_size {window} is not whole {merge}x{merge} blocks of {patch}-pixel patches")
    if pixels[0] > pixels[1]:
        raise ValueError(f"image_min_pixels {pixels[0]} > image_max_pixels {pixels[1]}")
    # image_size (the converter's 560 where the config has none) means nothing to a dynamic-resolution tower
    vision = VisionConfig(
        hidden_size=_key(meta, "embedding_length"), intermediate_size=_key(meta, "feed_forward_length"),
        num_layers=layers, num_heads=_key(meta, "attention.head_count"), patch_size=patch,
        layer_norm_eps=_f32(meta.get("clip.vision.attention.layer_norm_epsilon", 1e-6)),
        hidden_act="silu" if meta.get("clip.use_silu") else "gelu_tanh", scale_factor=merge, temporal_patch_size=2,
        window_size=window, fullatt_blocks=tuple(i for i in range(layers) if (i + 1) % pattern == 0))
    pre = {"min_pixels": pixels[0], "max_pixels": pixels[1], "patch_size": patch, "temporal_patch_size": 2,
           "merge_size": merge, "image_mean": list(_triple(meta, "image_mean")),
           "image_std": list(_triple(meta, "image_std"))}
    return vision, pre, {}


_QKV = re.compile(r"^(visual\.blocks\.\d+\.attn\.)([qkv])\.(weight|bias)$")
_PATCH = "visual.patch_embed.proj.weight"


def _qwen_join(tensors: Named) -> Named:
    """The converter's pieces put back: q, k and v (rows) into the fused qkv; the two [hidden, 3, p, p] kernels (the
    temporal patch's frames) into the Conv3d's [hidden, 3, 2, p, p]. A fused `attn_qkv` passes as it is."""
    held: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in tensors:
        m = _QKV.match(name)
        if m is not None:
            key, part, count = f"{m.group(1)}qkv.{m.group(3)}", "qkv".index(m.group(2)), 3
        elif name in (_PATCH, _PATCH + ".1"):
            key, part, count = _PATCH, int(name != _PATCH), 2
        else:
            yield name, t
            continue
        group = held.setdefault(key, {})
        if part in group:
            raise ValueError(f"{name} appears twice")
        group[part] = t
        if len(group) == count:
            pieces = [group[i] for i in range(count)]
            if len({p.shape for p in pieces}) != 1:
                raise ValueError(f"the pieces of {key} differ in shape: {[tuple(p.shape) for p in pieces]}")
            yield key, torch.stack(pieces, 2) if key == _PATCH else torch.cat(pieces)
            del held[key]
    if held:
        raise ValueError(f"{', '.join(sorted(held))} incomplete: {len(next(iter(held.values())))} of its pieces")


_QWEN_LAYER = {"ln1": "norm1", "ln2": "norm2", "attn_q": "attn.q", "attn_k": "attn.k", "attn_v": "attn.v",
               "attn_qkv": "attn.qkv", "attn_out": "attn.proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}
_HF_TOWER = "vision_tower.vision_model."  # Gemma 3's and LLaVA's checkpoints
PROJECTORS = {
    "idefics3": Projector("Idefics3ForConditionalGeneration", "vision_model.",
                          {"mm.model.fc.weight": "connector.modality_projection.proj.weight"},
                          "mm.model.fc.weight", 0, _idefics3),
    # the converter stores the projection as HF's [vision, text] matrix and adds 1 to the Gemma RMSNorm's weight
    "gemma3": Projector("Gemma3ForConditionalGeneration", _HF_TOWER,
                        {"mm.input_projection.weight": "multi_modal_projector.mm_input_projection_weight",
                         "mm.soft_emb_norm.weight": "multi_modal_projector.mm_soft_emb_norm.weight"},
                        "mm.input_projection.weight", 1, _gemma3, shift={"mm.soft_emb_norm.weight": 1.0}),
    "mlp": Projector("LlavaForConditionalGeneration", _HF_TOWER,
                     {f"mm.{i}.{k}": f"multi_modal_projector.linear_{j}.{k}"
                      for i, j in ((0, 1), (2, 2)) for k in ("weight", "bias")},
                     "mm.2.weight", 0, _llava, layer=_LEGACY_LAYER),
    "qwen2.5vl_merger": Projector("Qwen2_5_VLForConditionalGeneration", "visual.",
                                  {f"mm.{i}.{k}": f"visual.merger.mlp.{i}.{k}" for i in (0, 2)
                                   for k in ("weight", "bias")},
                                  "mm.2.weight", 0, _qwen25vl, layer=_QWEN_LAYER, blocks="blocks.",
                                  top={"v.patch_embd": "patch_embed.proj", "v.post_ln": "merger.ln_q",
                                       "v.patch_embd.weight": "patch_embed.proj.weight"},  # + ".1": frame 2
                                  join=_qwen_join, text_architectures=("qwen2vl",)),
}


def _connector_width(f: GGUFFile, projector: Projector) -> int:
    """The connector's output width (the text model's hidden size it must equal)."""
    t = next((t for t in f.tensors if t.name == projector.width), None)
    if t is None or len(t.shape) != 2:
        raise CheckpointError(f"--mmproj {f.path}: no 2-D {projector.width} tensor")
    return int(t.shape[projector.width_axis])


def mmproj_tensors(mm: Mmproj) -> Iterator[tuple[str, torch.Tensor, str]]:
    """(our name, float32 tensor, file) for every tensor of the mmproj; an unknown tensor, or pieces that do not
    join, is a CheckpointError."""
    try:
        for name, tensor in mm.projector.join(_named(mm)):
            yield name, tensor, str(mm.path)
    except CheckpointError:
        raise
    except ValueError as e:  # the join's: a piece missing, twice, or of another shape
        raise CheckpointError(f"--mmproj {mm.path}: {e}") from None


def _named(mm: Mmproj) -> Named:
    """(HF name, float32 tensor) of each tensor of the file, as the converter wrote it (pieces apart)."""
    pr = mm.projector
    for t in mm.file.tensors:
        stem, _, kind = t.name.rpartition(".")
        m = _BLOCK.match(t.name)
        if m is not None and m.group(2) in pr.layer:
            name = f"{pr.tower}{pr.blocks}{m.group(1)}.{pr.layer[m.group(2)]}.{kind}"
        elif t.name == "v.class_embd":  # a vector: the legacy script writes it without `.weight`
            name = f"{pr.tower}embeddings.class_embedding"
        elif stem in pr.top:
            name = f"{pr.tower}{pr.top[stem]}.{kind}"
        elif t.name in pr.connector:
            name = pr.connector[t.name]
        else:
            raise CheckpointError(f"--mmproj {mm.path}: unexpected tensor {t.name!r}")
        tensor = _dequantize(t, mm.path)
        yield name, tensor - pr.shift[t.name] if t.name in pr.shift else tensor
