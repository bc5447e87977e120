"""Qwen2.5-VL from llama.cpp's two files (loader/mmproj.py projector type `qwen2.5vl_merger` beside the `qwen2vl`
text GGUF): the tiny random model made by transformers (tests/vision_models.py), converted by llama.cpp's own
convert_hf_to_gguf.py (text and `--mmproj`), loaded with `mmproj=`: the safetensors load's weights, config and
preprocessing, logits within 1e-4 of transformers float32 and of the safetensors load with one and two images,
32 greedy tokens identical to the safetensors load, the engine answering image prompts as the safetensors engine
does, `lmserve serve --mmproj` (the GGUF's own tokenizer) answering as the offline engine on the same files, and a
malformed file refused in one line.

The model has what the converter keeps of a released Qwen2.5-VL and nothing it would lose: the file has no window
size (llama.cpp hard-codes 112 px), merge size or pixel bounds, so the tiny model uses 112 px windows and the released
processor's bounds (which the projector's settings default to), and its 4 blocks attend to the whole image every
2nd (1 and 3: the converter's `n_wa_pattern` 2); images of up to 250 px make grids of several windows. The converter
splits the fused qkv and the Conv3d into pieces that are joined again; with `--outtype f32` it writes every tensor of
this projector in float32 (no weight needs rounding to float16). Converted files are cached under
~/.cache/lmserve/converted (tests/llama_convert.py)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from lmserve.config import EngineConfig
from lmserve.engine.llm import LLM
from lmserve.engine.llm_engine import LLMEngine
from lmserve.errors import CheckpointError
from lmserve.layers.attention.context import ContiguousAttention
from lmserve.loader.model_loader import load_model
from lmserve.multimodal.qwen2_5_vl import Qwen2VLImageProcessor, mrope_positions
from lmserve.multimodal.registry import processor_for, processor_from_settings
from lmserve.sampling_params import SamplingParams
from lmserve.tokenizer import Tokenizer
from tests.llama_convert import convert, rewrite
from tests.test_vision_gguf import quantized_pair
from tests.test_vision_gguf_families import assert_same_expansions
from tests.test_vision_qwen25 import ARCH, PAD, _hf_inputs, _prompt
from tests.vision_models import build_qwen25_vl, image

pytest.importorskip("transformers")
CPU = torch.device("cpu")
ROWS = 272  # the tokenizer's words and special tokens, then the SentencePiece pieces (tests/llama_convert.py)
RELEASED_PIXELS = (56 * 56, 28 * 28 * 16384)  # Qwen2.5-VL's preprocessor_config.json
# transformers 5 saves `model.visual.*` and `model.language_model.*`; the released files (and the converter) have
# `visual.*` and `model.*`
RELEASED_NAMES = {"model.visual.": "visual.", "model.language_model.": "model."}
# (mean, max) |logits| gap of the quantized text file to the float files with images: about 1.3x measured (Q8_0 mean
# 0.019, max 0.19; Q4_0 mean 0.22, max 3.5; other images move the logits by a mean of ~1.45)
TOLERANCE = {"Q8_0": (0.025, 0.25), "Q4_0": (0.3, 4.5)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen25-gguf")
    path, hf = build_qwen25_vl(root, rows=ROWS, window=112, pixels=RELEASED_PIXELS, fullatt=(1, 3))
    text, mmproj = convert(path, root, ARCH, sentencepiece=True, released=RELEASED_NAMES)
    gguf = load_model(text, torch.float32, CPU, quantization="none", mmproj=mmproj)
    st = load_model(path, torch.float32, CPU, quantization="none")
    return path, text, mmproj, hf, gguf, st


def test_the_two_files_give_the_safetensors_weights_and_settings(models):
    """Every tensor (q/k/v and the two patch kernels joined again) equal to the safetensors load's; the tower's config
    and the processor's settings are the HF files'; the text GGUF alone is the Qwen2 text model with M-RoPE."""
    path, text, _, _, gguf, st = models
    a, b = gguf.model.state_dict(), st.model.state_dict()
    assert set(a) == set(b) and any(k.endswith("attn.qkv.weight") for k in a)
    for k in b:
        assert torch.equal(a[k], b[k]), k
    assert gguf.config.architecture == ARCH and gguf.config.mrope_section == st.config.mrope_section == (4, 6, 6)
    assert gguf.config.vision == replace(st.config.vision, image_token_id=None)
    assert gguf.config.vision.fullatt_blocks == (1, 3) and gguf.config.vision.window_size == 112
    ours, want = Qwen2VLImageProcessor.from_hf(gguf.mmproj.preprocessor), processor_for(ARCH, path).pixels_of
    # the file holds the mean and std in float32, as the normalisation computes them
    assert replace(ours, mean=None, std=None) == replace(want, mean=None, std=None)
    assert all(np.array_equal(np.float32(getattr(ours, k)), np.float32(getattr(want, k))) for k in ("mean", "std"))
    alone = load_model(text, torch.float32, CPU, quantization="none")
    assert (alone.config.architecture, alone.config.mrope_section, alone.config.qkv_bias) == ("qwen2vl", (4, 6, 6), True)
    ids = torch.tensor([1, 7, 9, 30])
    hidden = [m.model(ids, torch.arange(4), ContiguousAttention([4])) for m in (alone, gguf)]
    assert torch.equal(*(m.model.compute_logits(h) for m, h in zip((alone, gguf), hidden)))


def _positions(ids: list[int], prompt_len: int, grids) -> torch.Tensor:
    """[3, len(ids)]: the prompt's M-RoPE positions, then each generated token at its index + the prompt's delta
    (a generated `<|image_pad|>` is a token, not an image's)."""
    pos, delta = mrope_positions(ids[:prompt_len], PAD, grids)
    tail = np.arange(prompt_len, len(ids)) + delta
    return torch.from_numpy(np.concatenate([pos, np.broadcast_to(tail, (3, len(tail)))], 1))


def _logits(model, ids: list[int], processed, prompt_len: int | None = None) -> torch.Tensor:
    t, n = torch.tensor(ids), prompt_len or len(ids)
    x = model.embed(t)
    x[(t == PAD) & (torch.arange(len(ids)) < n)] = torch.cat(
        [model.encode_images(torch.from_numpy(p.pixel_values), **p.meta) for p in processed])
    positions = _positions(ids, n, [p.meta["grid"] for p in processed])
    return model.compute_logits(model(t, positions, ContiguousAttention([len(ids)]), inputs_embeds=x))


@pytest.mark.parametrize("sizes", [[(250, 140)], [(130, 230), (180, 120)]], ids=["one-image", "two-images"])
@torch.inference_mode()
def test_logits_and_greedy_equal_the_safetensors_load(models, sizes):
    path, _, _, hf, gguf, st = models
    proc = processor_for(ARCH, path)
    ids, processed = _prompt(proc, [image(w, h, seed=w + h) for w, h in sizes])
    assert all(max(p.meta["grid"][1:]) > 8 for p in processed)  # more than one 8-patch window per side
    got, want = _logits(gguf.model, ids, processed), _logits(st.model, ids, processed)
    ref = hf(**_hf_inputs(ids, processed)).logits[0]
    assert (got - want).abs().max().item() <= 1e-4
    assert (got - ref).abs().max().item() <= 1e-4
    a, b = list(ids), list(ids)
    for _ in range(32):
        a.append(int(_logits(gguf.model, a, processed, len(ids))[-1].argmax()))
        b.append(int(_logits(st.model, b, processed, len(ids))[-1].argmax()))
    assert a == b and len(set(a[len(ids):])) > 1


def test_the_engine_answers_as_the_safetensors_engine(models):
    """LLM(text.gguf, mmproj=...): the processor made from the projector's metadata expands an image into the same
    ids, pixels and M-RoPE positions as the model directory's, and 32 greedy tokens after one and two images are the
    safetensors engine's (the directory's tokenizer on both: the GGUF's SentencePiece one adds "▁" pieces)."""
    path, text, mmproj, *_ = models
    tok = Tokenizer.from_pretrained(path)
    cfg = EngineConfig(model=str(text), mmproj=str(mmproj), dtype="float32", mm_encoder_dtype="float32", device="cpu", quantization="none")
    llm_g = LLM(engine=LLMEngine(cfg, tokenizer=tok))
    llm_s = LLM(str(path), dtype="float32", mm_encoder_dtype="float32", device="cpu", num_blocks=128, block_size=16, quantization="none")
    span = "<|vision_start|><|image_pad|><|vision_end|>"
    prompts = [{"prompt": f"w3 w4 {span} w5", "multi_modal_data": {"image": [image(200, 120, seed=5)]}},
               {"prompt": f"w7 {span} w8 {span} w9", "multi_modal_data": {"image": [image(90, 240, seed=6),
                                                                                  image(60, 60, seed=7)]}}]
    fg, fs = llm_g.engine.front, llm_s.engine.front
    assert isinstance(fg.images.processor, type(processor_from_settings(ARCH, {}, {})))
    assert_same_expansions(fg, fs, prompts)
    assert all(m.rope is not None for p in prompts
               for m in fg.images.expand(fg.tokenize_prompt(p["prompt"]), p["multi_modal_data"]["image"])[1])
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    out_g, out_s = (llm.generate(prompts, greedy, use_tqdm=False) for llm in (llm_g, llm_s))
    for g, s in zip(out_g, out_s):
        assert g.outputs[0].token_ids == s.outputs[0].token_ids and len(set(g.outputs[0].token_ids)) > 1


def _refused(text, mmproj, *needles: str) -> None:
    with pytest.raises(CheckpointError) as e:
        load_model(text, torch.float32, CPU, quantization="none", mmproj=mmproj)
    msg = str(e.value)
    assert "\n" not in msg and all(n in msg for n in needles), msg


def test_a_malformed_file_is_one_line(models, tmp_path):
    """Without the window-attention period, with one of the patch kernels or one of q/k/v missing, beside a text
    GGUF that is not `qwen2vl`, or a text GGUF whose M-RoPE sections are not 3: each a CheckpointError in one line."""
    from tests.tiny_models import build_hf, write_gguf

    _, text, mmproj, *_ = models
    _refused(text, rewrite(mmproj, tmp_path / "a.gguf", {"clip.vision.n_wa_pattern": None}),
             "malformed metadata", "n_wa_pattern")
    _refused(text, rewrite(mmproj, tmp_path / "b.gguf", drop=("v.patch_embd.weight.1",)),
             "visual.patch_embed.proj.weight incomplete")
    _refused(text, rewrite(mmproj, tmp_path / "c.gguf", drop=("v.blk.2.attn_k.bias",)),
             "visual.blocks.2.attn.qkv.bias incomplete")
    _refused(rewrite(text, tmp_path / "t.gguf", {"qwen2vl.rope.dimension_sections": [4, 6, 4, 2]}), mmproj,
             "rope.dimension_sections [4, 6, 4, 2]")
    _, llama = build_hf("llama", tmp_path)
    _refused(write_gguf("llama", llama, tmp_path / "llama.gguf"), mmproj, "architecture qwen2vl", "'llama'")


def test_serve_with_mmproj_answers_as_the_offline_engine(models):
    """`lmserve serve --model text.gguf --mmproj mmproj.gguf` (the GGUF's own tokenizer and chat template), asked
    with the openai client: each image's greedy answer and prompt token count equal LLM(text.gguf, mmproj=...)'s
    for the same chat, and two images give two answers."""
    import io

    import openai
    from PIL import Image

    from tests.server_util import running_server
    from tests.test_media import data_url
    from tests.vision_models import image_bytes

    _, text, mmproj, *_ = models
    offline = LLM(str(text), mmproj=str(mmproj), dtype="float32", mm_encoder_dtype="float32", device="cpu", num_blocks=64, block_size=16,
                  quantization="none")
    pngs = [image_bytes(200, 130, seed=11), image_bytes(90, 160, seed=12)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tok, front = offline.tokenizer, offline.engine.front
    conv = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "w5 w6"}]}]
    ids = tok.encode_rendered(tok.render_chat(conv, add_generation_prompt=True))  # as server/api/chat_plan.py does
    want = []
    for png in pngs:
        img = Image.open(io.BytesIO(png))
        out = offline.generate([{"prompt": ids, "multi_modal_data": {"image": [img]}}], greedy, use_tqdm=False)[0]
        want.append((out.outputs[0].text, len(front.images.expand(ids, [img])[0])))
    assert want[0][0] != want[1][0]
    with running_server("--model", str(text), "--mmproj", str(mmproj), "--served-model-name", "qwen-vl",
                        "--dtype", "float32", "--mm-encoder-dtype", "float32", "--quantization", "none", "--max-model-len", "512") as s:
        oai = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        for png, (answer, prompt_tokens) in zip(pngs, want):
            r = oai.chat.completions.create(
                model="qwen-vl", max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True},
                messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png)}},
                                                       {"type": "text", "text": "w5 w6"}]}])
            assert r.choices[0].message.content == answer and r.usage.prompt_tokens == prompt_tokens
        s.wait_idle()


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
@torch.inference_mode()
def test_a_quantized_text_gguf_with_its_projector(models, tmp_path, kind):
    """The `qwen2vl` text GGUF quantized (tests/llama_convert.py requantize: llama-quantize's blocks, by gguf-py)
    beside its float projector, served from its blocks (`--quantization auto` picks gguf): on text alone the model
    with the projector is the text model (logits equal, 32 greedy tokens), and with images its logits stay as near
    the float files' as quantization puts this tiny random model's (TOLERANCE: about 1.3x measured) while mirrored
    images move them."""
    path, text, mmproj, _, float_vlm, _ = models
    vlm, lm = quantized_pair(text, mmproj, tmp_path, kind)
    ids = Tokenizer.from_pretrained(path).encode_prompt("w5 w9 w2 w7 w3", add_special_tokens=False)
    a, b = list(ids), list(ids)
    for _ in range(32):
        la, lb = (m.compute_logits(m(torch.tensor(x), torch.arange(len(x)), ContiguousAttention([len(x)])))
                  for m, x in ((vlm.model, a), (lm.model, b)))
        assert torch.equal(la, lb)
        a.append(int(la[-1].argmax()))
        b.append(int(lb[-1].argmax()))
    assert a == b and len(set(a[len(ids):])) > 1
    mean, most = TOLERANCE[kind]
    proc = processor_for(ARCH, path)
    for sizes in ([(250, 140)], [(130, 230), (180, 120)]):
        ids, processed = _prompt(proc, [image(w, h, seed=w + h) for w, h in sizes])
        got, ref = _logits(vlm.model, ids, processed), _logits(float_vlm.model, ids, processed)
        assert (got - ref).abs().mean().item() <= mean and (got - ref).abs().max().item() <= most
    mirrored = [p._replace(pixel_values=np.ascontiguousarray(p.pixel_values[::-1])) for p in processed]
    other = _logits(vlm.model, ids, mirrored)
    assert (other - got).abs().mean().item() > mean
