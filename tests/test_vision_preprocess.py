"""Idefics3 / SmolVLM preprocessing (multimodal/idefics3.py) against transformers' Idefics3ImageProcessor and
Idefics3Processor, built from settings here (nothing downloaded): pixel values within 1e-6, the same frames and
the same placeholder text, for five sizes and aspect ratios."""

from __future__ import annotations

import numpy as np
import pytest

from lmserve.multimodal.idefics3 import Idefics3Config, Idefics3Processor

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

TILE, LONGEST, SEQ = 32, 128, 4
# (width, height): wide, tall, square, one tile, smaller than a tile
SIZES = [(90, 50), (41, 127), (200, 200), (32, 32), (17, 9)]


def _image(w: int, h: int, seed: int):
    rng = np.random.default_rng(seed)
    # smooth plus noise: resampling filters see edges and flats, as in a photo
    base = np.linspace(0, 255, w * h * 3).reshape(h, w, 3)
    return Image.fromarray(np.clip(base + rng.integers(-40, 40, (h, w, 3)), 0, 255).astype(np.uint8))


def _word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = (["<pad>", "<s>", "</s>", "hi", "there", "<image>", "<fake_token_around_image>", "<global-img>"]
             + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)])
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"additional_special_tokens": words[5:]})
    return fast


@pytest.fixture(scope="module")
def hf():
    ip = transformers.Idefics3ImageProcessor(size={"longest_edge": LONGEST}, max_image_size={"longest_edge": TILE})
    return transformers.Idefics3Processor(ip, _word_tokenizer(), image_seq_len=SEQ)


@pytest.fixture(scope="module")
def ours():
    return Idefics3Processor(Idefics3Config(longest_edge=LONGEST, tile=TILE, image_seq_len=SEQ))


@pytest.mark.parametrize("size", SIZES)
def test_pixels_and_placeholder_equal_transformers(hf, ours, size):
    img = _image(*size, seed=sum(size))
    ref = hf(text=["hi <image> there"], images=[[img]], return_text_replacement_offsets=True)
    got = ours.process(img)
    want = ref["pixel_values"][0]  # [frames, 3, TILE, TILE]
    assert got.pixel_values.shape == want.shape and got.pixel_values.dtype == np.float32
    assert np.abs(got.pixel_values - want).max() <= 1e-6
    assert got.placeholder == ref["text_replacement_offsets"][0][0]["replacement"]


def test_config_read_from_the_processor_files():
    """preprocessor_config.json + processor_config.json as transformers writes them give the same settings."""
    ip = transformers.Idefics3ImageProcessor(size={"longest_edge": LONGEST}, max_image_size={"longest_edge": TILE},
                                             do_image_splitting=False)
    cfg = Idefics3Config.from_dicts(ip.to_dict(), {"image_seq_len": SEQ})
    assert (cfg.longest_edge, cfg.tile, cfg.do_image_splitting, cfg.image_seq_len) == (LONGEST, TILE, False, SEQ)
    img = _image(70, 40, 3)
    want = ip(images=[[img]], return_tensors="np")["pixel_values"][0]
    np.testing.assert_allclose(Idefics3Processor(cfg).process(img).pixel_values, want, atol=1e-6, rtol=0)


def test_smolvlm_defaults_one_large_photo(ours):
    """SmolVLM's own settings (364-pixel tiles, 1456 longest edge) on a 4:3 photo: 4x3 tiles plus the global view."""
    ip = transformers.Idefics3ImageProcessor()
    img = _image(800, 600, 7)
    want = ip(images=[[img]], return_tensors="np")["pixel_values"][0]
    got = Idefics3Processor(Idefics3Config()).process(img)
    assert got.pixel_values.shape == want.shape == (13, 3, 364, 364)
    assert np.abs(got.pixel_values - want).max() <= 1e-6
