"""Qwen2.5-VL (models/qwen2_5_vl.py over models/vision/qwen2_5_vl.py; multimodal/qwen2_5_vl.py) against transformers
in float32: a tiny random model made by transformers, loaded by lmserve's loader.

M-RoPE's rotary equals transformers' (and, where the three axes agree, the plain rotary the decode path uses); the
logits of prompts with one and two images within 1e-4 and wrong without M-RoPE positions; through the engine, 32
greedy tokens equal transformers' generate (its rope_deltas for the generated tokens), in one prefill and in 5-token
chunks that end inside images; a text-only and an image request batched equal each alone; a prefix-cache hit that
skips the image's tokens keeps the text after it at its M-RoPE positions; through a real server, an image_url
data: URL from the openai client answers as the offline engine does.
"""

from __future__ import annotations

import io

import numpy as np
import openai
import pytest
import torch

from lmserve.engine.llm import LLM
from lmserve.layers.attention.context import ContiguousAttention
from lmserve.layers.blocks.rotary import RotaryTables, inv_frequencies
from lmserve.loader.model_loader import load_model
from lmserve.multimodal.registry import processor_for
from lmserve.sampling_params import SamplingParams
from tests.server_util import running_server
from tests.test_media import data_url
from tests.vision_models import SPECIAL, WORDS, build_qwen25_vl, image, image_bytes

pytest.importorskip("transformers")
VOCAB = {w: i for i, w in enumerate(WORDS + SPECIAL)}
PAD, START, END = VOCAB["<|image_pad|>"], VOCAB["<|vision_start|>"], VOCAB["<|vision_end|>"]
ARCH = "Qwen2_5_VLForConditionalGeneration"
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path, hf = build_qwen25_vl(tmp_path_factory.mktemp("qwen25vl"))
    hf.generation_config.eos_token_id = None
    return path, hf, load_model(path, torch.float32, torch.device("cpu")).model, processor_for(ARCH, path)


def test_mrope_rotary_matches_transformers():
    from transformers import Qwen2_5_VLTextConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding

    cfg = Qwen2_5_VLTextConfig(hidden_size=256, num_attention_heads=2, rope_theta=10000.0,
                               rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]})
    ref = Qwen2_5_VLRotaryEmbedding(cfg)
    ours = RotaryTables({"full": (inv_frequencies(128, 10000.0), 1.0)}, (16, 24, 24))
    pos = torch.randint(0, 500, (3, 40))
    want_cos, want_sin = ref(torch.zeros(1, dtype=torch.float32), pos[:, None, :])
    cos, sin = ours(pos, torch.float32)["full"]
    assert torch.equal(cos[:, 0], want_cos[0]) and torch.equal(sin[:, 0], want_sin[0])
    # every axis equal (text and generated tokens): the plain table at that position, what [T] positions take
    same = pos[0].expand(3, -1)
    assert all(torch.equal(a, b) for a, b in zip(ours(same, torch.float32)["full"], ours(pos[0], torch.float32)["full"]))
    assert not torch.equal(cos, ours(pos[0], torch.float32)["full"][0])  # the sections do take other axes


def test_transformers4_config_reads_as_transformers5s():
    """Released Qwen2.5-VL checkpoints (transformers 4) keep the text config at the top level, `rope_scaling` of
    type mrope and the tower's `in_chans`; transformers 5 nests `text_config` with `rope_parameters`."""
    from lmserve.errors import CheckpointError
    from lmserve.models.config_hf import config_from_hf

    v4 = {"architectures": [ARCH], "model_type": "qwen2_5_vl", "vocab_size": 1000, "hidden_size": 256,
          "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
          "rope_theta": 1000000.0, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
          "tie_word_embeddings": True, "image_token_id": 151655, "use_sliding_window": False, "sliding_window": 32768,
          "vision_config": {"depth": 4, "hidden_size": 64, "intermediate_size": 96, "num_heads": 2, "in_chans": 3,
                            "out_hidden_size": 256, "fullatt_block_indexes": [3], "window_size": 112}}
    cfg = config_from_hf(v4)
    assert (cfg.mrope_section, cfg.rope_type, cfg.rope_theta, cfg.tie_word_embeddings, cfg.qkv_bias) == (
        (16, 24, 24), "default", 1e6, True, True)
    assert (cfg.vision.num_layers, cfg.vision.fullatt_blocks, cfg.vision.image_token_id) == (4, (3,), 151655)
    v5 = {"architectures": [ARCH], "image_token_id": 151655, "vision_config": v4["vision_config"],
          "text_config": {k: v for k, v in v4.items() if k not in ("architectures", "vision_config", "rope_scaling",
                                                                  "rope_theta")}
          | {"rope_parameters": {"rope_type": "default", "type": "mrope", "mrope_section": [16, 24, 24],
                                 "rope_theta": 1000000.0}}}
    assert config_from_hf(v5) == cfg
    with pytest.raises(CheckpointError, match="mrope_section"):  # the sections must cover the rotated pairs
        config_from_hf(v4 | {"rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 16]}})


def _prompt(proc, images) -> tuple[list[int], list]:
    """<s> w5 then each image's span and a word, as the template and processor write them."""
    ids, processed = [1, VOCAB["w5"]], []
    for k, img in enumerate(images):
        p = proc.process(img)
        ids += [START] + [PAD] * p.placeholder.count("<|image_pad|>") + [END, VOCAB[f"w{10 + k}"]]
        processed.append(p)
    return ids, processed


def _hf_inputs(ids: list[int], processed) -> dict:
    t = torch.tensor([ids])
    return {"input_ids": t, "mm_token_type_ids": (t == PAD).int(),
            "pixel_values": torch.from_numpy(np.concatenate([p.pixel_values for p in processed])),
            "image_grid_thw": torch.tensor([p.meta["grid"] for p in processed])}


def _ours_logits(model, proc, ids: list[int], processed, positions=None) -> torch.Tensor:
    t = torch.tensor(ids)
    x = model.embed(t)
    x[t == PAD] = torch.cat([model.encode_images(torch.from_numpy(p.pixel_values), **p.meta) for p in processed])
    if positions is None:
        positions = torch.from_numpy(proc.rope_positions(ids, PAD, [p.meta for p in processed]))
    return model.compute_logits(model(t, positions, ContiguousAttention([len(ids)]), inputs_embeds=x))


@pytest.mark.parametrize("sizes", [[(70, 40)], [(50, 90), (100, 30)]], ids=["one-image", "two-images"])
@torch.inference_mode()
def test_logits_equal_transformers(models, sizes):
    _, hf, ours, proc = models
    ids, processed = _prompt(proc, [image(w, h, seed=w + h) for w, h in sizes])
    assert len({p.meta["grid"] for p in processed}) == len(sizes)  # not square: rows and columns differ
    want = hf(**_hf_inputs(ids, processed)).logits[0]
    assert (_ours_logits(ours, proc, ids, processed) - want).abs().max().item() <= 1e-4
    plain = _ours_logits(ours, proc, ids, processed, torch.arange(len(ids)))
    assert (plain - want).abs().max().item() > 1e-2  # positions counted one by one: other logits


def _engine_prompts():
    return [{"prompt": "w3 w4 <|vision_start|><|image_pad|><|vision_end|> w5",
             "multi_modal_data": {"image": [image(60, 40, seed=5)]}},
            {"prompt": "w7 <|vision_start|><|image_pad|><|vision_end|> w8 <|vision_start|><|image_pad|><|vision_end|> w9",
             "multi_modal_data": {"image": [image(40, 90, seed=6), image(112, 56, seed=7)]}}]


def _hf_greedy(llm, hf, prompt: dict) -> list[int]:
    front = llm.engine.front
    imgs = prompt.get("multi_modal_data", {}).get("image", [])
    ids, mm = front.images.expand(front.tokenize_prompt(prompt["prompt"]), imgs)
    if not imgs:
        seq = hf.generate(input_ids=torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0]
        return seq[len(ids):].tolist()
    proc = front.images.processor
    seq = hf.generate(**_hf_inputs(ids, [proc.process(i) for i in imgs]), max_new_tokens=32, do_sample=False)[0]
    return seq[len(ids):].tolist()


@pytest.mark.parametrize("chunk", [None, 5], ids=["whole-prefill", "5-token-chunks"])
@torch.inference_mode()
def test_engine_greedy_equals_transformers_generate(models, chunk):
    """A one- and a two-image prompt batched; with 5-token chunks every image is split across steps."""
    path, hf, _, _ = models
    extra = {"max_num_batched_tokens": chunk} if chunk else {}
    llm = LLM(str(path), dtype="float32", mm_encoder_dtype="float32", device="cpu", num_blocks=128, block_size=16, max_num_seqs=4, **extra)
    prompts = _engine_prompts()
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for p, o in zip(prompts, outs):
        want = _hf_greedy(llm, hf, p)
        assert list(o.outputs[0].token_ids) == want
        assert len(set(want)) > 1  # the model says something, not one token 32 times


@torch.inference_mode()
def test_mixed_batch_equals_each_alone(models):
    """A text-only request beside an image request (their positions [T] and [3, T] in one step) gives each the
    tokens it gets alone and transformers gives it."""
    path, hf, _, _ = models
    text = {"prompt": "w3 w9 w27 w81"}
    img = _engine_prompts()[0]
    alone = [LLM(str(path), dtype="float32", mm_encoder_dtype="float32", device="cpu", num_blocks=64, block_size=16, enable_prefix_caching=False)
             .generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in (text, img)]
    llm = LLM(str(path), dtype="float32", mm_encoder_dtype="float32", device="cpu", num_blocks=64, block_size=16, max_num_seqs=4,
              enable_prefix_caching=False)
    both = [o.outputs[0].token_ids for o in llm.generate([text, img], GREEDY, use_tqdm=False)]
    assert [list(t) for t in both] == [list(t) for t in alone]
    assert list(both[0]) == _hf_greedy(llm, hf, text) and list(both[1]) == _hf_greedy(llm, hf, img)


@torch.inference_mode()
def test_prefix_cache_hit_keeps_mrope_positions(models):
    """The same image and text again: its blocks (the image's tokens among them) come from the prefix cache, so the
    step runs only the tail, whose positions still count from the image's compressed span; another image of
    another size gives its own answer."""
    path, hf, _, _ = models
    llm = LLM(str(path), dtype="float32", mm_encoder_dtype="float32", device="cpu", num_blocks=128, block_size=4, max_num_seqs=1)
    first = _engine_prompts()[1]
    want = llm.generate([first], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate([first], GREEDY, use_tqdm=False)[0]
    front = llm.engine.front
    _, mm = front.images.expand(front.tokenize_prompt(first["prompt"]), first["multi_modal_data"]["image"])
    assert again.num_cached_tokens > mm[0].span[1]  # the first image's tokens came from the cache
    assert again.outputs[0].token_ids == want
    other = {"prompt": first["prompt"], "multi_modal_data": {"image": [image(56, 112, seed=8), image(33, 70, seed=9)]}}
    got = llm.generate([other], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert list(got) == _hf_greedy(llm, hf, other) != list(want)


def test_openai_image_url_through_the_server(models):
    """`lmserve serve` with the tiny Qwen2.5-VL; the openai client sends a data: URL; the answer and its prompt
    token count (the image's pad tokens included) equal the offline engine's chat."""
    path = models[0]
    png = image_bytes(84, 56, seed=3)
    parts = [{"type": "image_url", "image_url": {"url": data_url(png)}}, {"type": "text", "text": "w3 w4"}]
    offline = LLM(str(path), dtype="float32", mm_encoder_dtype="float32", device="cpu", num_blocks=64, block_size=16)
    want = offline.chat([{"role": "user", "content": parts}], SamplingParams(temperature=0.0, max_tokens=8),
                        use_tqdm=False)[0]
    with running_server("--model", str(path), "--served-model-name", "qwen-vl", "--dtype", "float32", "--mm-encoder-dtype", "float32",
                        "--max-model-len", "512") as server:
        oai = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        r = oai.chat.completions.create(model="qwen-vl", max_tokens=8, temperature=0,
                                        messages=[{"role": "user", "content": parts}])
        other = oai.chat.completions.create(model="qwen-vl", max_tokens=8, temperature=0, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image_bytes(
                56, 84, seed=4))}}, parts[1]]}])
        with pytest.raises(openai.BadRequestError) as e:  # the processor's own limit: a 400 counted from the header
            oai.chat.completions.create(model="qwen-vl", max_tokens=8, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_url(image_bytes(600, 2, seed=5))}}, parts[1]]}])
        assert "aspect ratio" in e.value.body["message"], e.value.body
        server.wait_idle()
    assert r.choices[0].message.content == want.outputs[0].text
    assert r.usage.completion_tokens == len(want.outputs[0].token_ids)
    from PIL import Image

    ids, mm = offline.engine.front.images.expand(want.prompt_token_ids, [Image.open(io.BytesIO(png))])
    assert r.usage.prompt_tokens == len(ids) and len(mm[0].positions) == 6  # the image's 6 pad tokens counted
    assert other.choices[0].message.content != r.choices[0].message.content


def test_cli_generate_with_an_image(models, tmp_path):
    """`lmserve generate --image PATH` writes the image as the template would (vision start, pad, end) before the
    text: the answer of LLM.generate for that prompt."""
    import subprocess
    import sys

    path = models[0]
    (tmp_path / "a.png").write_bytes(image_bytes(84, 56, seed=3))
    from PIL import Image

    llm = LLM(str(path), dtype="float32", mm_encoder_dtype="float32", device="cpu", num_blocks=64, block_size=16)
    want = llm.generate([{"prompt": "<|vision_start|><|image_pad|><|vision_end|>w3 w4",
                          "multi_modal_data": {"image": [Image.open(tmp_path / "a.png")]}}],
                        SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0].outputs[0].text
    p = subprocess.run([sys.executable, "-m", "lmserve.cli", "generate", "w3 w4", "--image", str(tmp_path / "a.png"),
                        "--model", str(path), "--dtype", "float32", "--mm-encoder-dtype", "float32", "--device", "cpu", "--num-threads", "1",
                        "--temperature", "0", "--max-tokens", "8"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.rstrip("\n") == want
