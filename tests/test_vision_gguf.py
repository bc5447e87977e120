"""A vision-language model from llama.cpp's two files (loader/mmproj.py): the tiny random Idefics3 (SmolVLM-shaped)
model made by transformers, converted by llama.cpp's own convert_hf_to_gguf.py to a text GGUF and an mmproj GGUF,
loaded with `mmproj=`: the same weights as its safetensors load, logits within 1e-4 of it and of transformers with
one and two images, 32 greedy tokens identical; the engine and `lmserve serve --mmproj` answer image requests as
the safetensors model does; a wrong projector file is one line at start."""

from __future__ import annotations

import shutil

import pytest
import torch

from lmserve.config import EngineConfig
from lmserve.engine.llm import LLM
from lmserve.engine.llm_engine import LLMEngine
from lmserve.loader.model_loader import load_model
from lmserve.multimodal.idefics3 import Idefics3Config
from lmserve.sampling_params import SamplingParams
from lmserve.tokenizer import Tokenizer
from tests.llama_convert import convert
from tests.test_cli_errors import assert_one_line_error, lmserve
from tests.test_vision_models import _hf_logits, _ours_logits, _prompt
from tests.tiny_models import build_hf, write_gguf
from tests.vision_models import IMAGE_TOKEN_ID, build_idefics3, image

pytest.importorskip("transformers")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm-gguf")
    path, hf = build_idefics3(root)
    text, mmproj = convert(path, root)
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
        a.append(int(_ours_logits(gguf.model, a, pixels)[-1].argmax()))
        b.append(int(_ours_logits(st.model, b, pixels)[-1].argmax()))
    assert a == b and len(set(a[len(ids):])) > 1


def test_the_engine_answers_as_the_safetensors_model(models):
    """LLM(text.gguf, mmproj=...): the processor built from the mmproj's metadata expands an image as the model
    directory's processor does, and 32 greedy tokens after two images equal the safetensors engine's."""
    path, text, mmproj, _, _, _ = models
    kw = dict(dtype="float32", device="cpu", num_blocks=128, block_size=16, quantization="none")
    tok = Tokenizer.from_pretrained(path)  # the tiny word-level vocabulary has no merges for a GGUF BPE tokenizer
    cfg = EngineConfig(model=str(text), mmproj=str(mmproj), dtype="float32", device="cpu", quantization="none")
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
