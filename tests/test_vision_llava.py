"""LLaVA-1.5 and LLaVA-NeXT (models/llava.py over models/vision/llava.py; multimodal/llava.py, llava_next.py) against
transformers in float32: a tiny random model of each made by transformers, loaded by lmserve's loader; the logits of
prompts with one and two images within 1e-4 and 32 greedy tokens identical, directly and through the engine
(chunked prefill ending inside images; LLaVA-NeXT's size and tile grid ride on the MMInput's `meta`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmserve.engine.llm import LLM
from lmserve.layers.attention.context import ContiguousAttention
from lmserve.loader.model_loader import load_model
from lmserve.multimodal.registry import processor_for
from lmserve.sampling_params import SamplingParams
from tests.vision_models import IMAGE_TOKEN_ID, WORDS, build_llava, image

pytest.importorskip("transformers")
ARCH = {False: "LlavaForConditionalGeneration", True: "LlavaNextForConditionalGeneration"}


@pytest.fixture(scope="module", params=[False, True], ids=["llava", "llava-next"])
def models(request, tmp_path_factory):
    path, hf = build_llava(tmp_path_factory.mktemp("llava"), next_=request.param)
    return path, hf, load_model(path, torch.float32, torch.device("cpu")).model, processor_for(
        ARCH[request.param], path)


def _prompt(proc, images) -> tuple[list[int], list]:
    """<s> w5 w6 <image>... w10 <image>... w11: each image expanded as the registered processor expands it."""
    ids, processed = [1, WORDS.index("w5"), WORDS.index("w6")], []
    for k, img in enumerate(images):
        p = proc.process(img)
        n = p.placeholder.count("<image>")
        assert p.placeholder == "<image>" * n
        ids += [IMAGE_TOKEN_ID] * n + [WORDS.index(f"w{10 + k}")]
        processed.append(p)
    return ids, processed


def _ours_logits(model, ids: list[int], processed) -> torch.Tensor:
    t = torch.tensor(ids)
    x = model.embed(t)
    x[t == IMAGE_TOKEN_ID] = torch.cat([model.encode_images(torch.from_numpy(p.pixel_values), **(p.meta or {}))
                                        for p in processed])
    hidden = model(t, torch.arange(len(ids)), ContiguousAttention([len(ids)]), inputs_embeds=x)
    return model.compute_logits(hidden)


def _hf_inputs(processed) -> dict:
    """transformers' pixel inputs: LLaVA's images stacked; LLaVA-NeXT's views padded to the most, and sizes."""
    if processed[0].meta is None:
        return {"pixel_values": torch.from_numpy(np.concatenate([p.pixel_values for p in processed]))}
    most = max(p.pixel_values.shape[0] for p in processed)
    pv = np.stack([np.concatenate([p.pixel_values, np.zeros((most - p.pixel_values.shape[0],
                                                             *p.pixel_values.shape[1:]), np.float32)])
                   for p in processed])
    return {"pixel_values": torch.from_numpy(pv), "image_sizes": torch.tensor([p.meta["image_size"] for p in processed])}


def _hf_logits(model, ids: list[int], processed) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids]), **_hf_inputs(processed)).logits[0].float()


@pytest.mark.parametrize("sizes", [[(70, 40)], [(50, 90), (30, 30)]], ids=["one-image", "two-images"])
@torch.inference_mode()
def test_logits_and_greedy_equal_transformers(models, sizes):
    path, hf, ours, proc = models
    ids, processed = _prompt(proc, [image(w, h, seed=w + h) for w, h in sizes])
    want, got = _hf_logits(hf, ids, processed), _ours_logits(ours, ids, processed)
    assert (got - want).abs().max().item() <= 1e-4
    hf_ids, our_ids = list(ids), list(ids)
    for _ in range(32):
        hf_ids.append(int(_hf_logits(hf, hf_ids, processed)[-1].argmax()))
        our_ids.append(int(_ours_logits(ours, our_ids, processed)[-1].argmax()))
    assert our_ids == hf_ids
    assert len(set(our_ids[len(ids):])) > 1  # the model says something, not one token 32 times


@torch.inference_mode()
def test_the_image_changes_the_answer(models):
    _, _, ours, proc = models
    a = _ours_logits(ours, *_prompt(proc, [image(70, 40, seed=1)]))
    b = _ours_logits(ours, *_prompt(proc, [image(70, 40, seed=2)]))
    assert (a[-1] - b[-1]).abs().max().item() > 1e-2


@torch.inference_mode()
def test_engine_greedy_equals_transformers(models):
    """Through the engine: the `<image>` marker expanded by the registered processor, prefilled in 12-token chunks
    (boundaries inside the images), a one- and a two-image prompt batched; 32 tokens equal transformers'."""
    path, hf, _, proc = models
    llm = LLM(str(path), dtype="float32", mm_encoder_dtype="float32", device="cpu", num_blocks=128, block_size=16, max_num_batched_tokens=12,
              max_num_seqs=4)
    prompts = [{"prompt": "w3 w4 <image> w5", "multi_modal_data": {"image": [image(60, 40, seed=5)]}},
               {"prompt": "w7 <image> w8 <image> w9",
                "multi_modal_data": {"image": [image(40, 70, seed=6), image(33, 33, seed=7)]}}]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    front = llm.engine.front
    hf.generation_config.eos_token_id = None
    for p, o in zip(prompts, outs):
        imgs = p["multi_modal_data"]["image"]
        ids, mm = front.images.expand(front.tokenize_prompt(p["prompt"]), imgs)
        assert ids.count(IMAGE_TOKEN_ID) == sum(len(m.positions) for m in mm)
        # transformers' own generate (its KV cache: a generated id equal to `<image>`'s stays a plain token)
        seq = hf.generate(input_ids=torch.tensor([ids]), **_hf_inputs([proc.process(i) for i in imgs]),
                          max_new_tokens=32, do_sample=False)[0]
        assert list(o.outputs[0].token_ids) == seq[len(ids):].tolist()
