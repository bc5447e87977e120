"""LLaVA-1.5 (models/llava.py over models/vision/llava.py, multimodal/llava.py) against transformers in float32: a
tiny random model made by transformers, loaded by lmserve's loader; the logits of prompts with one and two images
within 1e-4 and 32 greedy tokens identical, directly and through the engine (chunked prefill ending inside images)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmserve.engine.llm import LLM
from lmserve.layers.attention.context import ContiguousAttention
from lmserve.loader.model_loader import load_model
from lmserve.multimodal.llava import LlavaProcessor
from lmserve.sampling_params import SamplingParams
from tests.vision_models import IMAGE_TOKEN_ID, WORDS, build_llava, image

pytest.importorskip("transformers")
N_TOKENS = 16  # (32 / 8)^2 patches, CLS dropped


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path, hf = build_llava(tmp_path_factory.mktemp("llava"))
    return path, hf, load_model(path, torch.float32, torch.device("cpu")).model


def _prompt(path, images) -> tuple[list[int], list[np.ndarray]]:
    """<s> w5 w6 <image>*16 w10 <image>*16 w11 ...: each image expanded as the processor expands it."""
    proc = LlavaProcessor.from_dir(path)
    ids, pixels = [1, WORDS.index("w5"), WORDS.index("w6")], []
    for k, img in enumerate(images):
        p = proc.process(img)
        assert p.placeholder == "<image>" * N_TOKENS
        ids += [IMAGE_TOKEN_ID] * N_TOKENS + [WORDS.index(f"w{10 + k}")]
        pixels.append(p.pixel_values)
    return ids, pixels


def _ours_logits(model, ids: list[int], pixels: list[np.ndarray]) -> torch.Tensor:
    t = torch.tensor(ids)
    x = model.embed(t)
    x[t == IMAGE_TOKEN_ID] = torch.cat([model.encode_images(torch.from_numpy(p)) for p in pixels])
    hidden = model(t, torch.arange(len(ids)), ContiguousAttention([len(ids)]), inputs_embeds=x)
    return model.compute_logits(hidden)


def _hf_logits(model, ids: list[int], pixels: list[np.ndarray]) -> torch.Tensor:
    pv = torch.from_numpy(np.concatenate(pixels))
    return model(input_ids=torch.tensor([ids]), pixel_values=pv).logits[0].float()


@pytest.mark.parametrize("sizes", [[(70, 40)], [(50, 90), (30, 30)]], ids=["one-image", "two-images"])
@torch.inference_mode()
def test_logits_and_greedy_equal_transformers(models, sizes):
    path, hf, ours = models
    ids, pixels = _prompt(path, [image(w, h, seed=w + h) for w, h in sizes])
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
    path, _, ours = models
    a = _ours_logits(ours, *_prompt(path, [image(70, 40, seed=1)]))
    b = _ours_logits(ours, *_prompt(path, [image(70, 40, seed=2)]))
    assert (a[-1] - b[-1]).abs().max().item() > 1e-2


@torch.inference_mode()
def test_engine_greedy_equals_transformers(models):
    """Through the engine: the `<image>` marker expanded by the registered processor, prefilled in 12-token chunks
    (boundaries inside the 16-token images), a one- and a two-image prompt batched; 32 tokens equal transformers'."""
    path, hf, _ = models
    llm = LLM(str(path), dtype="float32", device="cpu", num_blocks=64, block_size=16, max_num_batched_tokens=12,
              max_num_seqs=4)
    prompts = [{"prompt": "w3 w4 <image> w5", "multi_modal_data": {"image": [image(60, 40, seed=5)]}},
               {"prompt": "w7 <image> w8 <image> w9",
                "multi_modal_data": {"image": [image(40, 70, seed=6), image(33, 33, seed=7)]}}]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    front = llm.engine.front
    for p, o in zip(prompts, outs):
        ids, mm = front.images.expand(front.tokenize_prompt(p["prompt"]), p["multi_modal_data"]["image"])
        assert ids.count(IMAGE_TOKEN_ID) == N_TOKENS * len(mm)
        # transformers' own generate (its KV cache: a generated id equal to `<image>`'s stays a plain token)
        pv = torch.from_numpy(np.concatenate([m.pixel_values for m in mm]))
        hf.generation_config.eos_token_id = None
        seq = hf.generate(input_ids=torch.tensor([ids]), pixel_values=pv, max_new_tokens=32, do_sample=False)[0]
        assert list(o.outputs[0].token_ids) == seq[len(ids):].tolist()
