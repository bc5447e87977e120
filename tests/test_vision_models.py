"""Idefics3 / SmolVLM (models/idefics3.py, models/vision/siglip.py) against transformers in float32: a tiny
random model made by transformers, loaded from its safetensors by lmserve's loader; the logits of prompts with one
and two images within 1e-4, and 32 greedy tokens identical."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmserve.layers.attention.context import ContiguousAttention
from lmserve.loader.model_loader import load_model
from lmserve.multimodal.idefics3 import Idefics3Config, Idefics3Processor
from tests.vision_models import IMAGE_TOKEN_ID, build_idefics3, image

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path, hf = build_idefics3(tmp_path_factory.mktemp("vlm"))
    ours = load_model(path, torch.float32, torch.device("cpu")).model
    return path, hf, ours


def _prompt(path, images) -> tuple[list[int], list[np.ndarray]]:
    """w5 w6 <image> w7 ... with each <image> expanded as the processor expands it (ids of the tiny vocabulary)."""
    from tests.vision_models import SPECIAL, WORDS

    proc = Idefics3Processor(Idefics3Config.from_dir(path))
    vocab = {w: i for i, w in enumerate(WORDS + SPECIAL)}
    ids, pixels = [1, vocab["w5"], vocab["w6"]], []
    for k, img in enumerate(images):
        p = proc.process(img)
        text = p.placeholder.replace("\n", " ")
        for name in ("<fake_token_around_image>", "<global-img>", "<image>") + tuple(
                f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)):
            text = text.replace(name, f" {name} ")
        ids += [vocab[t] for t in text.split()] + [vocab[f"w{10 + k}"]]
        pixels.append(p.pixel_values)
    return ids, pixels


def _ours_logits(model, ids: list[int], pixels: list[np.ndarray]) -> torch.Tensor:
    t = torch.tensor(ids)
    x = model.embed(t)
    emb = torch.cat([model.encode_images(torch.from_numpy(p)) for p in pixels])
    x[t == IMAGE_TOKEN_ID] = emb
    hidden = model(t, torch.arange(len(ids)), ContiguousAttention([len(ids)]), inputs_embeds=x)
    return model.compute_logits(hidden)


def _hf_logits(model, ids: list[int], pixels: list[np.ndarray]) -> torch.Tensor:
    pv = torch.from_numpy(np.concatenate(pixels))[None]
    mask = torch.ones(pv.shape[0], pv.shape[1], pv.shape[3], pv.shape[4], dtype=torch.bool)
    return model(input_ids=torch.tensor([ids]), pixel_values=pv, pixel_attention_mask=mask).logits[0].float()


@pytest.mark.parametrize("sizes", [[(70, 40)], [(50, 90), (30, 30)]], ids=["one-image", "two-images"])
@torch.inference_mode()
def test_logits_and_greedy_equal_transformers(models, sizes):
    path, hf, ours = models
    ids, pixels = _prompt(path, [image(w, h, seed=w + h) for w, h in sizes])
    assert ids.count(IMAGE_TOKEN_ID) == sum(p.shape[0] for p in pixels) * 4
    want, got = _hf_logits(hf, ids, pixels), _ours_logits(ours, ids, pixels)
    assert (got - want).abs().max().item() <= 1e-4
    hf_ids, our_ids = list(ids), list(ids)
    for _ in range(32):
        hf_ids.append(int(_hf_logits(hf, hf_ids, pixels)[-1].argmax()))
        our_ids.append(int(_ours_logits(ours, our_ids, pixels)[-1].argmax()))
    assert our_ids == hf_ids
    assert len(set(our_ids[len(ids):])) > 1  # the model says something, not one token 32 times


@torch.inference_mode()
def test_the_image_changes_the_answer(models):
    """Two different images behind the same text: different logits (the embeddings reach the text model)."""
    path, _, ours = models
    a = _ours_logits(ours, *_prompt(path, [image(70, 40, seed=1)]))
    b = _ours_logits(ours, *_prompt(path, [image(70, 40, seed=2)]))
    assert (a[-1] - b[-1]).abs().max().item() > 1e-2
