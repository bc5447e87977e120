"""Gemma 3 and LLaVA-1.5 from llama.cpp's two files (loader/mmproj.py projector types `gemma3` and `mlp`): the tiny
random models made by transformers (tests/vision_models.py), converted as llama.cpp's users convert them (Gemma 3:
convert_hf_to_gguf.py, text and `--mmproj`; LLaVA-1.5: the text by convert_hf_to_gguf.py, the projector by the legacy
llava_surgery_v2.py + convert_image_encoder_to_gguf.py, since `--mmproj` refuses a CLIP tower), loaded with
`mmproj=`: logits within 1e-4 of transformers float32 and of the safetensors load with one and two images, 32 greedy
tokens identical to the safetensors load, and the engine (the processor built from the projector's metadata)
answering image prompts as the safetensors engine does.

Both converters store a few matrices in float16 whatever `--outtype` says (Gemma 3's input projection; LLaVA's
patch convolution and projector matrices): those weights of the tiny models are made float16-exact before they are
saved, so the files hold the same weights and the comparison stays at 1e-4. Converted files are cached under
~/.cache/lmserve/converted (tests/llama_convert.py)."""

from __future__ import annotations

import pytest
import torch

from lmserve.config import EngineConfig
from lmserve.engine.llm import LLM
from lmserve.engine.llm_engine import LLMEngine
from lmserve.layers.attention.context import ContiguousAttention
from lmserve.loader.model_loader import load_model
from lmserve.multimodal.registry import processor_for
from lmserve.sampling_params import SamplingParams
from lmserve.tokenizer import Tokenizer
from tests import test_vision_gemma3 as gem
from tests import test_vision_llava as lla
from tests.llama_convert import convert, convert_llava_legacy
from tests.vision_models import build_gemma3, build_llava, image

pytest.importorskip("transformers")
CPU = torch.device("cpu")
ROWS = 272  # the tokenizer's words and special tokens, then the SentencePiece pieces (tests/llama_convert.py)
GEMMA_LAYERS = ("sliding_attention",) * 5 + ("full_attention",)  # Gemma 3's pattern, which a GGUF file implies


def _f16_exact(model: torch.nn.Module, names: tuple[str, ...]) -> None:
    """Round the parameters whose names contain one of `names` to float16 values (kept float32)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(n in name for n in names):
                p.copy_(p.half().float())


class Family:
    """One family's files, its transformers model, both lmserve loads and how its test prompts are written."""

    def __init__(self, kind: str, root):
        self.kind = kind
        if kind == "gemma3":
            self.path, self.hf = build_gemma3(root, rows=ROWS, layer_types=GEMMA_LAYERS)
            _f16_exact(self.hf, ("mm_input_projection_weight",))
            self.hf.save_pretrained(self.path)
            # transformers 5 saves the tower without its `vision_model.` level; the released files and the converter
            # have it
            self.text, self.mmproj = convert(self.path, root, "Gemma3ForCausalLM", sentencepiece=True,
                                             released={"vision_tower.": "vision_tower.vision_model."})
            self.arch, self.marker = "Gemma3ForConditionalGeneration", "<start_of_image>"
        else:
            self.path, self.hf = build_llava(root, rows=ROWS)
            _f16_exact(self.hf, ("patch_embedding", "multi_modal_projector.linear_1.weight",
                                 "multi_modal_projector.linear_2.weight"))
            self.hf.save_pretrained(self.path)
            self.text, self.mmproj = convert_llava_legacy(self.path, self.hf.model.vision_tower, root)
            self.arch, self.marker = "LlavaForConditionalGeneration", "<image>"
        self.gguf = load_model(self.text, torch.float32, CPU, quantization="none", mmproj=self.mmproj)
        self.st = load_model(self.path, torch.float32, CPU, quantization="none")
        self.proc = processor_for(self.arch, self.path)

    def prompt(self, images):
        return (gem._prompt if self.kind == "gemma3" else lla._prompt)(self.proc, images)

    def images(self, model, inputs) -> torch.Tensor:
        """The prompt's image embeddings, in placeholder order."""
        if self.kind == "gemma3":
            return torch.cat([model.encode_images(torch.from_numpy(p)) for p in inputs])
        return torch.cat([model.encode_images(torch.from_numpy(p.pixel_values)) for p in inputs])

    def ours(self, model, ids, embeds, prompt_len=None):
        """The model's logits, the image embeddings placed in the first `prompt_len` positions only (a generated
        placeholder id is a token); Gemma 3's image spans attend both ways."""
        t, n = torch.tensor(ids), prompt_len or len(ids)
        x = model.embed(t)
        x[(t == (gem.SOFT if self.kind == "gemma3" else lla.IMAGE_TOKEN_ID)) & (torch.arange(len(ids)) < n)] = embeds
        spans = [[s for s in gem._spans(ids) if s[1] <= n]] if self.kind == "gemma3" else None
        hidden = model(t, torch.arange(len(ids)), ContiguousAttention([len(ids)], spans), inputs_embeds=x)
        return model.compute_logits(hidden)

    def hf_logits(self, ids, inputs):
        return (gem._hf_logits if self.kind == "gemma3" else lla._hf_logits)(self.hf, ids, inputs)


@pytest.fixture(scope="module", params=["gemma3", "llava"])
def family(request, tmp_path_factory):
    return Family(request.param, tmp_path_factory.mktemp(request.param + "-gguf"))


def test_the_two_files_give_the_towers_weights_and_settings(family):
    """The tower's and projector's tensors equal the safetensors load's (LLaVA's tower is cut after the layer its
    projector reads: the layers it keeps), and the tower's geometry is the HF config's."""
    a, b = family.gguf.model.state_dict(), family.st.model.state_dict()
    vision = [k for k in a if k.startswith("vision.")]
    assert vision and set(vision) <= set(b)
    for k in vision:
        assert torch.allclose(a[k], b[k], rtol=0, atol=1e-6), k
    g, s = family.gguf.config.vision, family.st.config.vision
    assert (g.hidden_size, g.image_size, g.patch_size, g.num_heads) == (s.hidden_size, s.image_size, s.patch_size,
                                                                        s.num_heads)
    if family.kind == "gemma3":
        assert g.tokens_per_image == s.tokens_per_image == 4 and g.num_layers == s.num_layers
    else:  # feature layer -2 of 3 = the last of the 2 layers kept
        assert (g.num_layers, g.feature_layers, s.num_layers, s.feature_layers) == (2, (-1,), 3, (-2,))


@pytest.mark.parametrize("sizes", [[(70, 40)], [(50, 90), (30, 30)]], ids=["one-image", "two-images"])
@torch.inference_mode()
def test_logits_and_greedy_equal_the_safetensors_load(family, sizes):
    ids, inputs = family.prompt([image(w, h, seed=w + h) for w, h in sizes])
    eg, es = family.images(family.gguf.model, inputs), family.images(family.st.model, inputs)
    got, want = family.ours(family.gguf.model, ids, eg), family.ours(family.st.model, ids, es)
    ref = family.hf_logits(ids, inputs)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-4
    assert (got - ref).abs().max().item() <= 1e-4
    a, b = list(ids), list(ids)
    for _ in range(32):
        a.append(int(family.ours(family.gguf.model, a, eg, len(ids))[-1].argmax()))
        b.append(int(family.ours(family.st.model, b, es, len(ids))[-1].argmax()))
    assert a == b
    if family.kind == "llava" or len(sizes) == 1:  # the tiny Gemma repeats one token after two images (as in
        assert len(set(a[len(ids):])) > 1  # test_vision_gemma3), and says something after one


def test_the_engine_answers_as_the_safetensors_engine(family):
    """LLM(text.gguf, mmproj=...): the processor made from the projector's metadata expands an image into the same
    ids and pixels as the model directory's, and 32 greedy tokens after one and two images are the safetensors
    engine's (the directory's tokenizer on both: the GGUF's SentencePiece one adds "▁" pieces)."""
    tok = Tokenizer.from_pretrained(family.path)
    cfg = EngineConfig(model=str(family.text), mmproj=str(family.mmproj), dtype="float32", mm_encoder_dtype="float32", device="cpu",
                       quantization="none")
    llm_g = LLM(engine=LLMEngine(cfg, tokenizer=tok))
    llm_s = LLM(str(family.path), dtype="float32", mm_encoder_dtype="float32", device="cpu", num_blocks=128, block_size=16, quantization="none")
    m = family.marker
    prompts = [{"prompt": f"w3 w4 {m} w5", "multi_modal_data": {"image": [image(60, 40, seed=5)]}},
               {"prompt": f"w7 {m} w8 {m} w9", "multi_modal_data": {"image": [image(40, 70, seed=6),
                                                                                image(33, 33, seed=7)]}}]
    assert_same_expansions(llm_g.engine.front, llm_s.engine.front, prompts)
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    out_g, out_s = (llm.generate(prompts, greedy, use_tqdm=False) for llm in (llm_g, llm_s))
    for g, s in zip(out_g, out_s):
        assert g.outputs[0].token_ids == s.outputs[0].token_ids
    if family.kind == "llava":  # the tiny 6-layer Gemma repeats one token here (its logits: the test above)
        assert len(set(out_g[0].outputs[0].token_ids)) > 1


def assert_same_expansions(front_g, front_s, prompts: list[dict]) -> None:
    """Each prompt's expanded ids and images (pixels, placements, M-RoPE positions) the same from the GGUF + mmproj
    load (`front_g`) as from the safetensors one."""
    for p in prompts:
        imgs = p["multi_modal_data"]["image"]
        ids_g, mm_g = front_g.images.expand(front_g.tokenize_prompt(p["prompt"]), imgs)
        ids_s, mm_s = front_s.images.expand(front_s.tokenize_prompt(p["prompt"]), imgs)
        assert ids_g == ids_s
        for a, b in zip(mm_g, mm_s, strict=True):
            assert (a.pixel_values == b.pixel_values).all() and (a.positions == b.positions).all()
            assert (a.rope is None) == (b.rope is None) and (a.rope is None or (a.rope == b.rope).all())
