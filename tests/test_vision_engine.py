"""Images through the engine (engine/images.py, worker/mm_encoder.py) with a tiny random Idefics3 (SmolVLM-shaped)
model: greedy tokens equal transformers' with the prompt prefilled in chunks that end inside images; a mixed batch
of text and image requests gives each what it gets alone; the same text with another image never reuses the first
image's KV blocks, the same image does; a repeated image is not encoded again."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmserve.engine.llm import LLM
from lmserve.errors import RequestRejected
from lmserve.sampling_params import SamplingParams
from tests.vision_models import build_idefics3, image

pytest.importorskip("transformers")
N_OUT = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=N_OUT, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path, hf = build_idefics3(tmp_path_factory.mktemp("vlm"))
    # 24 tokens a step: every image prompt (~60-90 tokens) is prefilled in chunks, boundaries inside image spans
    llm = LLM(str(path), dtype="float32", mm_encoder_dtype="float32", device="cpu", num_blocks=256, block_size=16, max_num_batched_tokens=24,
              max_num_seqs=8, enable_prefix_caching=True)
    return llm, hf


IMG_A, IMG_B = image(90, 50, seed=11), image(90, 50, seed=12)  # same size: same placeholder tokens


def _prompt(text: str, *images) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": list(images)}} if images else {"prompt": text}


def _tokens(llm: LLM, prompts: list[dict]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@torch.inference_mode()
def _hf_greedy(llm: LLM, hf, prompt: dict) -> list[int]:
    """transformers' greedy continuation of the same expanded prompt (full forward each step, no cache)."""
    front = llm.engine.front
    ids, mm = front.images.expand(front.tokenize_prompt(prompt["prompt"]), prompt["multi_modal_data"]["image"])
    pv = torch.from_numpy(np.concatenate([m.pixel_values for m in mm]))[None]
    mask = torch.ones(pv.shape[0], pv.shape[1], pv.shape[3], pv.shape[4], dtype=torch.bool)
    out = list(ids)
    for _ in range(N_OUT):
        logits = hf(input_ids=torch.tensor([out]), pixel_values=pv, pixel_attention_mask=mask).logits[0, -1]
        out.append(int(logits.argmax()))
    return out[len(ids):]


def test_chunked_image_prompts_equal_transformers(setup):
    llm, hf = setup
    for p in (_prompt("w3 w4 <image> w5 w6", IMG_A), _prompt("w7 <image> w8 <image> w9", IMG_B, image(40, 70, seed=3))):
        assert _tokens(llm, [p])[0] == _hf_greedy(llm, hf, p)


def test_mixed_batch_equals_each_alone(setup):
    llm, _ = setup
    prompts = [_prompt("w1 w2 w3 w4 w5 w6 w7 w8"), _prompt("w3 w4 <image> w5 w6", IMG_A),
               _prompt("w3 w4 <image> w5 w6", IMG_B), _prompt("w9 <image> w10 <image>", IMG_B, IMG_A),
               _prompt("w11 w12 w13")]
    alone = [_tokens(llm, [p])[0] for p in prompts]
    assert _tokens(llm, prompts) == alone
    assert alone[1] != alone[2]  # the same text with another image: another answer


def test_prefix_cache_keys_on_the_image(setup):
    """The same text and image again hits the prefix cache; the same text with another image never does, and
    gives that image's own answer."""
    llm, hf = setup
    c = _prompt("w20 w21 <image> w22", image(60, 60, seed=21))
    d = _prompt("w20 w21 <image> w22", image(60, 60, seed=22))
    first = llm.generate([c], GREEDY, use_tqdm=False)[0]
    again = llm.generate([c], GREEDY, use_tqdm=False)[0]
    other = llm.generate([d], GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert again.num_cached_tokens > 0 and other.num_cached_tokens == 0
    assert other.outputs[0].token_ids == _hf_greedy(llm, hf, d) != first.outputs[0].token_ids


def test_text_before_the_first_image_is_shared(setup):
    """Two blocks of text, then an image: another image reuses those two blocks (their KV cannot depend on it)
    and nothing after them; its answer is still its own."""
    llm, hf = setup
    text = " ".join(f"w{60 + i}" for i in range(34)) + " <image> w23"  # the image's tokens start in block 2
    e, f = (_prompt(text, image(50, 50, seed=s)) for s in (51, 52))
    llm.generate([e], GREEDY, use_tqdm=False)
    out = llm.generate([f], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 32
    assert out.outputs[0].token_ids == _hf_greedy(llm, hf, f)


def test_a_repeated_image_is_encoded_once(setup):
    llm, _ = setup
    cache = llm.engine.runner.images.cache
    img = image(120, 80, seed=31)
    before = cache.num_encoded
    _tokens(llm, [_prompt("w30 <image> w31", img)])
    assert cache.num_encoded == before + 1
    _tokens(llm, [_prompt("w32 w33 <image>", img), _prompt("<image> w34", img)])  # other text, the same image
    assert cache.num_encoded == before + 1


def test_image_count_must_match_the_markers(setup):
    llm, _ = setup
    with pytest.raises(RequestRejected, match="placeholder"):
        llm.generate([_prompt("w1 w2", IMG_A)], GREEDY, use_tqdm=False)
    assert _tokens(llm, [_prompt("w1 w2")])  # the engine still serves


def test_preempted_image_requests_resume_from_the_encoder_cache(setup, tmp_path):
    """A KV pool too small for three image requests at once: some are preempted and recomputed; each still gets
    its answer alone, and no image is encoded twice (the resumed prefill reads the encoder cache)."""
    llm, _ = setup
    small = LLM(str(llm.engine.front.loaded.path), dtype="float32", mm_encoder_dtype="float32", device="cpu", num_blocks=14, block_size=16,
                max_num_batched_tokens=24, max_num_seqs=8, enable_prefix_caching=False)
    imgs = [image(90, 50, seed=40 + i) for i in range(3)]
    prompts = [_prompt(f"w{40 + i} <image> w50", img) for i, img in enumerate(imgs)]
    alone = [_tokens(llm, [p])[0] for p in prompts]
    assert _tokens(small, prompts) == alone
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.runner.images.cache.num_encoded == len(imgs)
    kv = small.engine.scheduler.kv
    assert kv.num_free_blocks == kv.pool.num_blocks  # every block came back


def test_chat_with_image_parts(setup):
    """LLM.chat: a PIL image part and a base64 data: URL of the same pixels give the raw prompt's answer."""
    import base64

    from tests.vision_models import image_bytes

    llm, _ = setup
    png = image_bytes(90, 50, seed=11)  # IMG_A's pixels
    want = _tokens(llm, [_prompt("w3 w4 <image> w5 w6", IMG_A)])[0]
    for part in ({"type": "image", "image": IMG_A},
                 {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}}):
        msgs = [{"role": "user", "content": [{"type": "text", "text": "w3 w4"}, part, {"type": "text", "text": "w5 w6"}]}]
        assert llm.chat(msgs, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want


def test_a_text_only_model_refuses_images(offline_llm):
    with pytest.raises(RequestRejected, match="does not accept images"):
        offline_llm.generate([_prompt("Describe <image>", IMG_A)], GREEDY, use_tqdm=False)
    assert offline_llm.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_image_requests_under_a_lora_adapter(setup, tmp_path):
    """An adapter on the text model changes an image request's answer; in a batch mixing adapter and base,
    image and text requests, each gets what it gets alone."""
    from lmserve.request import LoRARequest
    from tests.lora_adapters import write_random_adapter

    llm, _ = setup
    path = llm.engine.front.loaded.path
    lora_llm = LLM(str(path), dtype="float32", mm_encoder_dtype="float32", device="cpu", num_blocks=256, block_size=16,
                   max_num_batched_tokens=24, max_num_seqs=8, enable_lora=True, max_lora_rank=8)
    adapter = LoRARequest("a", 1, str(write_random_adapter(tmp_path / "a", llm.engine.front.loaded.config)))
    prompts = [_prompt("w3 w4 <image> w5 w6", IMG_A), _prompt("w3 w4 <image> w5 w6", IMG_A),
               _prompt("w1 w2 w3"), _prompt("w7 <image> w8", IMG_B)]
    adapters = [adapter, None, adapter, adapter]

    def run(ps, ads):
        return [o.outputs[0].token_ids for o in lora_llm.generate(ps, GREEDY, use_tqdm=False, lora_request=ads)]

    alone = [run([p], [a])[0] for p, a in zip(prompts, adapters)]
    assert run(prompts, adapters) == alone
    assert alone[0] != alone[1]  # the adapter reaches the image request
    assert alone[1] == _tokens(llm, [prompts[1]])[0]  # base rows of a LoRA engine: the base model's answer


def test_cli_generate_with_an_image(setup, tmp_path):
    """`lmserve generate --image PATH`: the image's answer, the same as LLM.generate's for the same pixels."""
    import subprocess
    import sys

    from tests.vision_models import image_bytes

    llm, _ = setup
    (tmp_path / "a.png").write_bytes(image_bytes(90, 50, seed=11))  # IMG_A's pixels
    params = SamplingParams(temperature=0.0, max_tokens=N_OUT)  # as the CLI's flags below
    want = llm.generate([_prompt("<image>w5 w6", IMG_A)], params, use_tqdm=False)[0].outputs[0].text
    args = ["--model", str(llm.engine.front.loaded.path), "--dtype", "float32", "--mm-encoder-dtype", "float32", "--device", "cpu", "--num-threads",
            "1", "--temperature", "0", "--max-tokens", str(N_OUT)]
    p = subprocess.run([sys.executable, "-m", "lmserve.cli", "generate", "w5 w6", "--image", str(tmp_path / "a.png"),
                        *args], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.rstrip("\n") == want
    bad = subprocess.run([sys.executable, "-m", "lmserve.cli", "generate", "w5", "--image", str(tmp_path / "none.png"),
                          *args], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--image" in bad.stderr and "Traceback" not in bad.stderr
