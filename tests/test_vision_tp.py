"""Images under tensor parallelism: a tiny random vision model of each kind the engine places images in differently
(Idefics3: plain placement; Qwen2.5-VL: M-RoPE positions; Gemma 3: bidirectional image spans) served with
--tensor-parallel-size 2 gives the greedy tokens of one rank and its prompt logprobs within 1e-5, for a request
with two images beside a text-only one in the same batch.

Every rank runs the whole tower itself (loader/sharding.py keeps tower tensors whole) and places the same embeddings
(worker/model_runner.py forward_only), so the split text model's all-reduces see rank 0's inputs.
"""

from __future__ import annotations

import pytest

from lmserve import LLM, SamplingParams
from lmserve.multimodal.processor import image_text
from tests.vision_models import build_gemma3, build_idefics3, build_qwen25_vl, image

pytest.importorskip("transformers")
BUILDERS = {"idefics3": build_idefics3, "qwen2_5_vl": build_qwen25_vl, "gemma3": build_gemma3}


def _prompts(llm: LLM) -> list:
    """Two images around some text (the family's own image text: marker, or Qwen's start/pad/end), and text alone."""
    mark = image_text(llm.engine.front.images.processor)
    images = [image(90, 50, seed=11), image(56, 84, seed=12)]
    return [{"prompt": f"{mark} w1 w2 {mark} w3", "multi_modal_data": {"image": images}}, "w4 w5 w6"]


@pytest.mark.parametrize("family", list(BUILDERS))
def test_tp2_with_images_equals_one_rank(tmp_path, family):
    path, _ = BUILDERS[family](tmp_path, kv_heads=2)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=0)
    results = {}
    for tp in (1, 2):
        llm = LLM(str(path), tensor_parallel_size=tp, dtype="float32", num_blocks=64, num_threads=1)
        try:
            results[tp] = llm.generate(_prompts(llm), params, use_tqdm=False)
        finally:
            llm.close()
    for one, two in zip(results[1], results[2]):
        assert one.outputs[0].token_ids == two.outputs[0].token_ids and len(one.outputs[0].token_ids) == 12
        gaps = [abs(a.logprob - b.logprob) for a, b in zip(one.prompt_logprobs[1:], two.prompt_logprobs[1:])]
        assert len(gaps) == len(one.prompt_logprobs) - 1 and max(gaps) < 1e-5, max(gaps)
    # the image request's prompt as the model ran it: each image expanded to its placeholder tokens
    assert len(results[1][0].prompt_logprobs) > len(results[1][0].prompt_token_ids) + 2
