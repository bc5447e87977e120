"""Image preprocessing (multimodal/) against transformers' PIL-backend image processors built from a config (no hub):
pixel values within 1e-6 for 5 sizes and aspect ratios, and the same placeholder counts."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from lmserve.multimodal.image_io import ImageData

TOL = 1e-6
# (width, height): landscape, portrait, exact, wide, small
SIZES = [(640, 480), (480, 640), (336, 336), (1000, 217), (57, 90)]


def _image(width: int, height: int) -> ImageData:
    """A smooth gradient with noise, so that resampling filters matter."""
    from PIL import Image

    rng = np.random.default_rng(width * 7919 + height)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([xx * 255 / width, yy * 255 / height, (xx + yy) * 127 / (width + height)], -1)
    arr = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
    return ImageData(image=Image.fromarray(arr, "RGB"), digest=hashlib.sha256(arr.tobytes()).hexdigest())


def _close(ours: np.ndarray, ref) -> None:
    ref = np.asarray(ref)
    assert ours.shape == ref.shape and ours.dtype == np.float32
    assert np.abs(ours - ref).max() < TOL


# ---- LLaVA-1.5 (CLIP) --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("size", SIZES)
def test_clip_processor_matches_transformers(size):
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from lmserve.multimodal.llava import CLIPImageProcessor

    conf = {"size": {"shortest_edge": 336}, "crop_size": {"height": 336, "width": 336}}
    img = _image(*size)
    ref = CLIPImageProcessorPil(**conf)(images=[img.image], return_tensors="np")["pixel_values"]
    _close(CLIPImageProcessor.from_hf(conf).preprocess(img)["pixel_values"], ref)


@pytest.mark.parametrize("size", SIZES)
def test_llava_pad_processor_matches_transformers(size):
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    from lmserve.multimodal.llava import CLIPImageProcessor

    conf = {"size": {"shortest_edge": 224}, "crop_size": {"height": 224, "width": 224}, "do_pad": True}
    img = _image(*size)
    ref = LlavaImageProcessorPil(**conf)(images=[img.image], return_tensors="np")["pixel_values"]
    _close(CLIPImageProcessor.from_hf(conf).preprocess(img)["pixel_values"], ref)


def test_llava_placeholder_count():
    from lmserve.multimodal.llava import num_image_tokens, placeholder_ids, placeholder_text

    assert num_image_tokens(336, 14) == 576  # llava-1.5
    assert num_image_tokens(336, 14, "full") == 577
    assert placeholder_ids(32000, 32, 8) == [32000] * 16
    assert placeholder_text(32, 8) == "<image>" * 16


# ---- Gemma 3 -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("size", SIZES)
def test_gemma3_processor_matches_transformers(size):
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from lmserve.multimodal.gemma3 import Gemma3ImageProcessor

    conf = {"size": {"height": 896, "width": 896}, "resample": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
            "do_pan_and_scan": False}
    img = _image(*size)
    ref = Gemma3ImageProcessorPil(**conf)(images=[img.image], return_tensors="np")
    ours = Gemma3ImageProcessor.from_hf(conf).preprocess(img)
    _close(ours["pixel_values"], ref["pixel_values"])
    assert list(ours["num_crops"]) == list(ref["num_crops"])


@pytest.mark.parametrize("size", [*SIZES, (1600, 400), (300, 1500)])
def test_gemma3_pan_and_scan_matches_transformers(size):
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from lmserve.multimodal.gemma3 import Gemma3ImageProcessor

    conf = {"size": {"height": 64, "width": 64}, "resample": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
            "do_pan_and_scan": True, "pan_and_scan_min_crop_size": 100, "pan_and_scan_max_num_crops": 3,
            "pan_and_scan_min_ratio_to_activate": 1.2}
    img = _image(*size)
    ref = Gemma3ImageProcessorPil(**conf)(images=[img.image], return_tensors="np")
    ours = Gemma3ImageProcessor.from_hf(conf).preprocess(img)
    _close(ours["pixel_values"], ref["pixel_values"])
    assert list(ours["num_crops"]) == list(ref["num_crops"])


def test_gemma3_image_sequence():
    from lmserve.multimodal.gemma3 import image_sequence, image_text, placeholder_ids

    text = image_sequence(4)
    assert text == "\n\n<start_of_image>" + "<image_soft_token>" * 4 + "<end_of_image>\n\n"
    assert image_text(0, 4) == text and image_text(2, 4).count("<start_of_image>") == 3
    assert placeholder_ids(7, 8, 9, 3) == [7, 8, 8, 8, 9]


# ---- Qwen2.5-VL --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("pixels", [(56 * 56, 28 * 28 * 1280), (256 * 28 * 28, 512 * 28 * 28)])
def test_qwen2vl_processor_matches_transformers(size, pixels):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from lmserve.multimodal.qwen2_5_vl import Qwen2VLImageProcessor, placeholder_text

    conf = {"min_pixels": pixels[0], "max_pixels": pixels[1], "patch_size": 14, "temporal_patch_size": 2,
            "merge_size": 2}
    img = _image(*size)
    ref = Qwen2VLImageProcessorPil(**conf)(images=[img.image], return_tensors="np")
    proc = Qwen2VLImageProcessor.from_hf(conf)
    ours = proc.preprocess(img)
    _close(ours["pixel_values"], ref["pixel_values"])
    assert ours["image_grid_thw"].tolist() == ref["image_grid_thw"].tolist()
    grid = tuple(ours["image_grid_thw"][0])
    assert proc.grid(img.image.height, img.image.width) == grid
    n_patches = Qwen2VLImageProcessorPil(**conf).get_number_of_image_patches(img.image.height, img.image.width)
    assert proc.num_image_tokens(grid) == n_patches // 4
    assert placeholder_text(proc.num_image_tokens(grid)).count("<|image_pad|>") == n_patches // 4


def _hf_rope_index(ids: list[int], grids: list[tuple[int, int, int]], image_id: int):
    import torch
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    cfg = Qwen2_5_VLConfig(text_config=dict(vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=1),
                           vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2,
                                              out_hidden_size=16),
                           image_token_id=image_id)
    model = Qwen2_5_VLModel(cfg)
    input_ids = torch.tensor([ids])
    pos, delta = model.get_rope_index(input_ids, (input_ids == image_id).int(),
                                      image_grid_thw=torch.tensor(grids) if grids else None)
    return pos[:, 0].numpy(), int(delta[0, 0])


@pytest.mark.parametrize("layout", ["text", "one", "two", "start", "end"])
def test_mrope_positions_match_transformers(layout):
    from lmserve.multimodal.qwen2_5_vl import mrope_positions

    img, vs, ve = 60, 61, 62
    grids = {"text": [], "one": [(1, 6, 8)], "two": [(1, 8, 4), (1, 12, 2)], "start": [(1, 4, 4)],
             "end": [(1, 2, 10)]}[layout]
    spans = [[vs, *[img] * (t * h * w // 4), ve] for t, h, w in grids]
    text = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    if layout == "start":
        ids = [img] * 4 + [ve, 3, 4]
    elif layout == "end":
        ids = [1, 2, vs] + [img] * 5
    else:
        ids = text[0] + sum((s + text[k + 1] for k, s in enumerate(spans)), [])
    ref, ref_delta = _hf_rope_index(ids, grids, img)
    ours, delta = mrope_positions(ids, img, grids)
    assert ours.tolist() == ref.tolist()
    assert delta == ref_delta


# ---- LLaVA-NeXT (anyres) ------------------------------------------------------------------------------------------

NEXT_SIZES = [(640, 480), (480, 640), (336, 336), (1000, 217), (57, 90), (900, 1100)]


@pytest.mark.parametrize("size", NEXT_SIZES)
def test_llava_next_processor_matches_transformers(size):
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    from lmserve.multimodal.llava_next import LlavaNextImageProcessor

    conf = {"size": {"shortest_edge": 336}, "crop_size": {"height": 336, "width": 336},
            "image_grid_pinpoints": [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]}
    img = _image(*size)
    ref = LlavaNextImageProcessorPil(**conf)(images=[img.image], return_tensors="np")
    ours = LlavaNextImageProcessor.from_hf(conf).preprocess(img)
    _close(ours["pixel_values"], ref["pixel_values"])
    assert ours["image_sizes"].tolist() == ref["image_sizes"].tolist()


# ---- the placeholder from the size alone (the server's context check before decoding) ------------------------

def _engine_processors() -> dict:
    from lmserve.multimodal.gemma3 import Gemma3ImageProcessor, Gemma3Processor
    from lmserve.multimodal.idefics3 import Idefics3Config, Idefics3Processor
    from lmserve.multimodal.llava import CLIPImageProcessor, LlavaProcessor
    from lmserve.multimodal.llava_next import LlavaNextImageProcessor, LlavaNextProcessor
    from lmserve.multimodal.qwen2_5_vl import Qwen2VLImageProcessor, Qwen25VLProcessor

    clip = {"size": {"shortest_edge": 336}, "crop_size": {"height": 336, "width": 336}}
    return {
        "idefics3": Idefics3Processor(Idefics3Config(longest_edge=4 * 96, tile=96, image_seq_len=4)),
        "idefics3_one_view": Idefics3Processor(Idefics3Config(longest_edge=96, tile=96, do_image_splitting=False)),
        "gemma3": Gemma3Processor(Gemma3ImageProcessor.from_hf({"size": {"height": 64, "width": 64}}), 16),
        "llava": LlavaProcessor(CLIPImageProcessor.from_hf(clip), 336, 14),
        "llava_next": LlavaNextProcessor(LlavaNextImageProcessor.from_hf(clip), 14),
        "qwen2_5_vl": Qwen25VLProcessor(Qwen2VLImageProcessor.from_hf({"max_pixels": 64 * 28 * 28})),
    }


@pytest.mark.parametrize("family", list(_engine_processors()))
@pytest.mark.parametrize("size", [*SIZES, (1, 1), (97, 95), (2000, 31), (31, 700), (1500, 1500)])
def test_placeholder_from_the_size_equals_the_processed_images(family, size):
    proc = _engine_processors()[family]
    img = _image(*size)
    assert proc.placeholder_for(*size) == proc.process(img.image).placeholder
