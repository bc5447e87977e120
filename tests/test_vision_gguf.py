"""A vision-language model from llama.cpp's two files (loader/mmproj.py): the tiny random Idefics3 (SmolVLM-shaped)
model made by transformers, converted by llama.cpp's own convert_hf_to_gguf.py to a text GGUF and an mmproj GGUF,
loaded with `mmproj=`: the same weights as its safetensors load, logits within 1e-4 of it and of transformers with
one and two images, 32 greedy tokens identical; the engine answers image requests as the safetensors model does and
`lmserve serve --mmproj` (the GGUF's own tokenizer) as the offline engine on the same files; a wrong projector file is one line at start.
The text GGUF requantized to Q8_0/Q4_0 serves images from its blocks beside the float projector."""

from __future__ import annotations

import shutil

import pytest
import torch

from lmserve.config import EngineConfig
from lmserve.engine.llm import LLM
from lmserve.engine.llm_engine import LLMEngine
from lmserve.layers.attention.context import ContiguousAttention
from lmserve.loader.model_loader import load_model
from lmserve.multimodal.idefics3 import Idefics3Config
from lmserve.sampling_params import SamplingParams
from lmserve.tokenizer import Tokenizer
from tests.llama_convert import convert, requantize
from tests.test_cli_errors import assert_one_line_error, lmserve
from tests.test_vision_models import _hf_logits, _ours_logits, _prompt
from tests.tiny_models import build_hf, write_gguf
from tests.vision_models import IMAGE_TOKEN_ID, WORDS, build_idefics3, image, image_bytes

pytest.importorskip("transformers")
CPU = torch.device("cpu")
VOCAB = 272  # the tokenizer's 246 words and special tokens, then the SentencePiece pieces the words are merged from


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm-gguf")
    path, hf = build_idefics3(root, vocab=VOCAB)
    text, mmproj = convert(path, root, sentencepiece=True)
    gguf = load_model(text, torch.float32, CPU, quantization="none", mmproj=mmproj)
    st = load_model(path, torch.float32, CPU, quantization="none")
    return path, text, mmproj, hf, gguf, st


def test_the_two_files_load_the_safetensors_weights(models):
    """Every tensor of the tower, connector and text model, by name, equal to the safetensors load's; the config and
    the preprocessing settings are what the HF files say."""
    path, _, _, _, gguf, st = models
    a, b = gguf.model.state_dict(), st.model.state_dict()
    assert set(a) == set(b)
    for k in b:
        assert torch.equal(a[k], b[k]), k
    assert gguf.config.architecture == "Idefics3ForConditionalGeneration"
    assert gguf.config.vision == st.config.vision.__class__(**{**st.config.vision.__dict__, "image_token_id": None})
    assert Idefics3Config.from_dicts(gguf.mmproj.preprocessor, gguf.mmproj.processor) == Idefics3Config.from_dir(path)


@pytest.mark.parametrize("sizes", [[(70, 40)], [(50, 90), (30, 30)]], ids=["one-image", "two-images"])
@torch.inference_mode()
def test_logits_and_greedy_equal_the_safetensors_load(models, sizes):
    path, _, _, hf, gguf, st = models
    ids, pixels = _prompt(path, [image(w, h, seed=w + h) for w, h in sizes])
    assert ids.count(IMAGE_TOKEN_ID) == sum(p.shape[0] for p in pixels) * 4
    got, want, ref = _ours_logits(gguf.model, ids, pixels), _ours_logits(st.model, ids, pixels), _hf_logits(hf, ids, pixels)
    assert (got - want).abs().max().item() <= 1e-4
    assert (got - ref).abs().max().item() <= 1e-4
    a, b = list(ids), list(ids)
    for _ in range(32):
        a.append(int(_logits(gguf.model, a, pixels, len(ids))[-1].argmax()))
        b.append(int(_logits(st.model, b, pixels, len(ids))[-1].argmax()))
    assert a == b and len(set(a[len(ids):])) > 1


def _logits(model, ids: list[int], pixels, prompt_len: int) -> torch.Tensor:
    """test_vision_models' _ours_logits, the embeddings placed in the prompt alone (a generated `<image>` token is
    a token)."""
    t = torch.tensor(ids)
    x = model.embed(t)
    x[(t == IMAGE_TOKEN_ID) & (torch.arange(len(ids)) < prompt_len)] = torch.cat(
        [model.encode_images(torch.from_numpy(p)) for p in pixels])
    hidden = model(t, torch.arange(len(ids)), ContiguousAttention([len(ids)]), inputs_embeds=x)
    return model.compute_logits(hidden)


def test_the_engine_answers_as_the_safetensors_model(models):
    """LLM(text.gguf, mmproj=...): the processor built from the mmproj's metadata expands an image as the model
    directory's processor does, and 32 greedy tokens after two images equal the safetensors engine's."""
    path, text, mmproj, _, _, _ = models
    kw = dict(dtype="float32", mm_encoder_dtype="float32", device="cpu", num_blocks=128, block_size=16, quantization="none")
    tok = Tokenizer.from_pretrained(path)  # the directory's ids (the GGUF's SentencePiece one adds "▁" pieces)
    cfg = EngineConfig(model=str(text), mmproj=str(mmproj), dtype="float32", mm_encoder_dtype="float32", device="cpu", quantization="none")
    llm_g = LLM(engine=LLMEngine(cfg, tokenizer=tok))
    llm_s = LLM(str(path), **kw)
    imgs = [image(90, 50, seed=3), image(40, 70, seed=4)]
    prompt = {"prompt": "w1 w2 <image> w3 <image> w4", "multi_modal_data": {"image": imgs}}
    fg, fs = llm_g.engine.front, llm_s.engine.front
    ids_g, mm_g = fg.images.expand(fg.tokenize_prompt(prompt["prompt"]), imgs)
    ids_s, mm_s = fs.images.expand(fs.tokenize_prompt(prompt["prompt"]), imgs)
    assert ids_g == ids_s and len(ids_g) > 40
    for a, b in zip(mm_g, mm_s):
        assert (a.pixel_values == b.pixel_values).all() and (a.positions == b.positions).all()
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    out_g, out_s = (llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids for llm in (llm_g, llm_s))
    assert out_g == out_s and len(set(out_g)) > 1


def test_a_wrong_projector_file_is_one_line_at_start(models, tmp_path):
    """Another projector type, a projector of another model (its width not the text model's), a text GGUF as the
    projector, and --mmproj beside a model directory: each `lmserve serve` refuses in one line, before loading."""
    path, text, mmproj, *_ = models
    other = tmp_path / "internvl.gguf"
    data = mmproj.read_bytes()
    assert data.count(b"idefics3") == 1  # the projector type's value (general.name is "Idefics3")
    other.write_bytes(data.replace(b"idefics3", b"internvl"))
    assert_one_line_error(lmserve("serve", "--model", str(text), "--mmproj", str(other)),
                          "projector type 'internvl' is not supported")
    llama_dir, llama = build_hf("llama", tmp_path)  # hidden size 128; the projector writes 64
    llama_gguf = write_gguf("llama", llama, tmp_path / "llama.gguf")
    assert_one_line_error(lmserve("serve", "--model", str(llama_gguf), "--mmproj", str(mmproj)),
                          "64-wide embeddings", "hidden size is 128")
    assert_one_line_error(lmserve("serve", "--model", str(text), "--mmproj", str(text)), "expected 'clip'")
    assert_one_line_error(lmserve("serve", "--model", str(path), "--mmproj", str(mmproj)), "text .gguf file")
    shutil.rmtree(llama_dir)


def test_serve_with_mmproj_answers_as_the_offline_engine(models):
    """`lmserve serve --model text.gguf --mmproj mmproj.gguf`, asked with the openai client: each image's greedy
    answer equals LLM(text.gguf, mmproj=...)'s for the same chat encoded as the server encodes one (its template's
    text and the user's text apart: the GGUF's SentencePiece tokenizer puts a prefix space on each), and two images
    give two answers."""
    import io

    import openai
    from PIL import Image

    from tests.server_util import running_server
    from tests.test_media import data_url

    _, text, mmproj, *_ = models
    offline = LLM(str(text), mmproj=str(mmproj), dtype="float32", mm_encoder_dtype="float32", device="cpu", num_blocks=64, block_size=16,
                  quantization="none")
    pngs = [image_bytes(90, 50, seed=11), image_bytes(30, 30, seed=12)]

    def chat(png: bytes) -> list[dict]:
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png)}},
                                             {"type": "text", "text": "w5 w6"}]}]

    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tok = offline.tokenizer
    want = []
    for png in pngs:
        # as server/api/chat_plan.py renders it: the image part `{"type": "image"}`, the template writes its marker
        conv = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "w5 w6"}]}]
        ids = tok.encode_rendered(tok.render_chat(conv, add_generation_prompt=True))
        img = Image.open(io.BytesIO(png))
        out = offline.generate([{"prompt": ids, "multi_modal_data": {"image": [img]}}], greedy, use_tqdm=False)[0]
        want.append(out.outputs[0].text)
    assert want[0] != want[1]
    with running_server("--model", str(text), "--mmproj", str(mmproj), "--served-model-name", "vlm",
                        "--dtype", "float32", "--mm-encoder-dtype", "float32", "--quantization", "none", "--max-model-len", "512") as s:
        oai = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        for png, expected in zip(pngs, want):
            r = oai.chat.completions.create(model="vlm", messages=chat(png), max_tokens=8, temperature=0.0,
                                            extra_body={"ignore_eos": True})
            assert r.choices[0].message.content == expected
            assert r.usage.prompt_tokens > 10  # the image's placeholder tokens are counted
        s.wait_idle()


def test_the_projector_file_is_part_of_the_weights_fingerprint(models, tmp_path):
    """The response cache and the KV tier key by the served weights: another projector file beside the same text
    GGUF is other weights (its images encode differently)."""
    from dataclasses import replace

    from lmserve.loader.fingerprint import served_fingerprint, weights_fingerprint
    from lmserve.loader.mmproj import read_mmproj

    _, text, mmproj, _, gguf, _ = models
    other = tmp_path / "other-mmproj.gguf"
    data = bytearray(mmproj.read_bytes())
    data[-4:] = b"\0\0\0\0"  # the last weight's bytes differ
    other.write_bytes(bytes(data))
    fp = served_fingerprint(gguf)
    assert fp != weights_fingerprint(text) and fp == served_fingerprint(gguf)
    assert served_fingerprint(replace(gguf, mmproj=read_mmproj(other, gguf.config))) != fp


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
@torch.inference_mode()
def test_a_quantized_text_gguf_with_its_projector(models, tmp_path, kind):
    """The text GGUF quantized (tests/llama_convert.py requantize: llama-quantize's blocks, by gguf-py) beside its
    float projector, served from its blocks (`--quantization auto` picks gguf): on text alone the model with the
    projector is the text model (logits equal, 32 greedy tokens), and with images its logits stay as near the float
    files' as quantization puts this tiny random model's (|logits| up to 7.3; measured Q8_0 mean 0.033, max 0.46;
    Q4_0 mean 0.36, max 5.0; on text alone max 0.22 and 3.3) while other images move them."""
    path, text, mmproj, _, float_vlm, _ = models
    vlm, lm = quantized_pair(text, mmproj, tmp_path, kind)
    ids = [1] + [WORDS.index(f"w{k}") for k in (5, 9, 2, 7, 3)]
    a, b = list(ids), list(ids)
    for _ in range(32):
        la, lb = _text_logits(vlm.model, a), _text_logits(lm.model, b)
        assert torch.equal(la, lb)
        a.append(int(la[-1].argmax()))
        b.append(int(lb[-1].argmax()))
    assert a == b and len(set(a[len(ids):])) > 1
    mean, most = {"Q8_0": (0.05, 0.6), "Q4_0": (0.5, 6.5)}[kind]  # the stated tolerance: about 1.3x measured
    for sizes in ([(70, 40)], [(50, 90), (30, 30)]):
        ids, pixels = _prompt(path, [image(w, h, seed=w + h) for w, h in sizes])
        got, ref = _ours_logits(vlm.model, ids, pixels), _ours_logits(float_vlm.model, ids, pixels)
        assert (got - ref).abs().mean().item() <= mean and (got - ref).abs().max().item() <= most
    other = _ours_logits(vlm.model, ids, [p[:, :, ::-1].copy() for p in pixels])  # the images mirrored
    assert (other - got).abs().mean().item() > mean


def quantized_pair(text, mmproj, tmp_path, kind: str):
    """The text GGUF requantized to `kind`, loaded from its blocks with its float projector and without (vlm, lm)."""
    from lmserve.layers.formats.gguf_linear import GGUFLinear

    q = requantize(text, tmp_path / f"text-{kind}.gguf", kind)
    vlm = load_model(q, torch.float32, CPU, quantization="auto", mmproj=mmproj)
    lm = load_model(q, torch.float32, CPU, quantization="auto")
    assert vlm.runtime_quantization == lm.runtime_quantization == "gguf"
    assert isinstance(vlm.model.model.layers[0].mlp.down_proj, GGUFLinear)
    return vlm, lm


def _text_logits(model, ids: list[int]) -> torch.Tensor:
    hidden = model(torch.tensor(ids), torch.arange(len(ids)), ContiguousAttention([len(ids)]))
    return model.compute_logits(hidden)
