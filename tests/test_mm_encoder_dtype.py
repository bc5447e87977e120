"""--mm-encoder-dtype: a vision model's tower and projector in their own dtype (cpu_dtype.py `encoder_dtype_why`,
cast where the model is built: loader/empty_model.py `encoder_to`).

The decision from given CPU flags and timings, and on this machine from its own measurement (bf16 only where it has
bf16 instructions and the measured matmul is >= MIN_ENCODER_SPEEDUP x float32's); a served tower that really holds
and runs bf16 beside a float32 text model; bf16 embeddings of SmolVLM's (Idefics3) and LLaVA's towers against
transformers' within twice transformers' own bf16 error (both against transformers float32); and, in bf16, the
engine's invariants: a mixed batch gives each request its tokens alone, a repeated image is encoded once."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from lmserve.cpu_dtype import (
    MIN_ENCODER_SPEEDUP,
    cache_file,
    decide_encoder,
    encoder_dtype_why,
)
from lmserve.engine.llm import LLM
from lmserve.layers.formats.linear import PackedLinear, can_pack
from lmserve.loader.model_loader import load_model
from lmserve.sampling_params import SamplingParams
from lmserve.utils import cpu_flags, cpu_has_fast_bf16
from tests.vision_models import build_idefics3, build_llava, image

pytest.importorskip("transformers")
CPU = torch.device("cpu")
ZEN3 = "flags : fpu sse sse2 avx avx2 fma f16c"  # AVX2, no bf16 instructions
ZEN5 = ZEN3 + " avx512f avx512bw avx512vl avx512_vnni avx512_bf16"
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture()
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LMSERVE_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_the_decision_from_flags_and_timings(cache_dir):
    assert decide_encoder({"f32": 3.0, "bf16": 1.0})[0] == "bfloat16"
    assert decide_encoder({"f32": 1.2, "bf16": 1.0})[0] == "float32"  # faster, but not clearly
    assert decide_encoder({"f32": 1.0, "bf16": 2.0})[0] == "float32"  # emulated bf16
    assert encoder_dtype_why("auto", torch.device("cuda"))[0] == torch.bfloat16
    assert encoder_dtype_why("auto", CPU, ZEN3)[0] == torch.float32
    assert not cache_file(ZEN3, "mm-encoder-dtype").exists()  # no bf16 instructions: nothing measured
    assert encoder_dtype_why("float32", torch.device("cuda"))[0] == torch.float32
    assert encoder_dtype_why("bfloat16", CPU, ZEN3)[0] == torch.bfloat16  # asked for: as asked
    with pytest.raises(ValueError, match="mm-encoder-dtype"):
        encoder_dtype_why("float16", CPU)
    # with bf16 instructions, a decision cached for these flags is the answer (measured once a machine)
    path = cache_file(ZEN5, "mm-encoder-dtype")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"dtype": "float32", "why": "measured 1.1x"}))
    assert encoder_dtype_why("auto", CPU, ZEN5) == (torch.float32, "measured 1.1x")
    path.write_text(json.dumps({"dtype": "bfloat16", "why": "measured 3x"}))
    assert encoder_dtype_why("auto", CPU, ZEN5) == (torch.bfloat16, "measured 3x")


def test_auto_on_this_machine_follows_its_measurement(cache_dir):
    """This CPU: float32 without bf16 instructions; with them, bf16 exactly when the matmul it timed (and cached)
    ran >= MIN_ENCODER_SPEEDUP x float32's."""
    flags = cpu_flags()
    dtype, why = encoder_dtype_why("auto", CPU)
    path = cache_file(flags, "mm-encoder-dtype")
    if not cpu_has_fast_bf16(flags):
        assert dtype == torch.float32 and not path.exists()
        return
    m = json.loads(path.read_text())["measured"]
    assert m["f32"] > 0 and m["bf16"] > 0
    assert (dtype == torch.bfloat16) == (m["f32"] / m["bf16"] >= MIN_ENCODER_SPEEDUP), why
    assert encoder_dtype_why("auto", CPU) == (dtype, why)  # the second start reads the cache


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory):
    return build_idefics3(tmp_path_factory.mktemp("vlm"))


@pytest.fixture(scope="module")
def bf16_llm(idefics3):
    path, _ = idefics3
    return LLM(str(path), dtype="float32", mm_encoder_dtype="bfloat16", device="cpu", num_blocks=256, block_size=16,
               max_num_batched_tokens=24, max_num_seqs=8)


def test_the_served_tower_runs_in_bf16(bf16_llm):
    """The tower and connector hold bf16 (packed for oneDNN where it packs bf16), the text model float32; the
    encoder cache holds what the tower computed: bf16 embeddings."""
    model = bf16_llm.engine.runner.model
    assert bf16_llm.engine.front.loaded.encoder_dtype == torch.bfloat16
    assert model.model.embed_tokens.weight.dtype == torch.float32
    tower = list(model.vision_model.parameters()) + list(model.connector.parameters())
    assert tower and all(p.dtype == torch.bfloat16 for p in tower)
    q = model.vision_model.encoder.layers[0].self_attn.q_proj
    if can_pack(CPU, torch.bfloat16):
        assert isinstance(q, PackedLinear) and q.packed.dtype == torch.bfloat16
    bf16_llm.generate([{"prompt": "w1 <image> w2", "multi_modal_data": {"image": [image(70, 40, seed=5)]}}], GREEDY,
                      use_tqdm=False)
    cache = bf16_llm.engine.runner.images.cache
    assert cache._entries and all(e.dtype == torch.bfloat16 for e in cache._entries.values())


def test_bf16_mixed_batch_equals_each_alone_and_caches_images(bf16_llm):
    """Each image is encoded alone (worker/mm_encoder.py), so in bf16 too a request's greedy tokens do not depend on
    the batch it ran in, and a repeated image is encoded once."""
    a, b = image(90, 50, seed=11), image(90, 50, seed=12)
    prompts = [{"prompt": "w1 w2 w3 w4 w5"}, {"prompt": "w3 w4 <image> w5 w6", "multi_modal_data": {"image": [a]}},
               {"prompt": "w3 w4 <image> w5 w6", "multi_modal_data": {"image": [b]}},
               {"prompt": "w9 <image> w10 <image>", "multi_modal_data": {"image": [b, a]}}]

    def tokens(ps):
        return [o.outputs[0].token_ids for o in bf16_llm.generate(ps, GREEDY, use_tqdm=False)]

    cache = bf16_llm.engine.runner.images.cache
    before = cache.num_encoded
    alone = [tokens([p])[0] for p in prompts]
    assert cache.num_encoded == before + 2  # a and b, each once
    assert tokens(prompts) == alone and alone[1] != alone[2]
    assert cache.num_encoded == before + 2


def _err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return (got.float() - ref.float()).abs().max().item()


def _within_transformers_bf16(ours: torch.Tensor, theirs: torch.Tensor, ref32: torch.Tensor) -> None:
    """Our bf16 embeddings are as close to transformers' float32 as transformers' own bf16 ones are (within 2x, and
    a floor of 1% of the embeddings' range for where theirs happen to land very close)."""
    assert ours.dtype == torch.bfloat16 and ours.shape == ref32.shape == theirs.shape
    scale = ref32.abs().max().item()
    assert _err(ours, ref32) <= max(2 * _err(theirs, ref32), 0.01 * scale), (_err(ours, ref32), _err(theirs, ref32))
    assert _err(ours, ref32) <= 0.05 * scale


@torch.inference_mode()
def test_idefics3_bf16_tower_against_transformers(idefics3):
    path, hf = idefics3
    ours = load_model(path, torch.float32, CPU, encoder_dtype="bfloat16").model
    pixels = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))  # 3 frames of one image

    def features(m, dtype):
        return m.model.connector(m.model.vision_model(pixel_values=pixels.to(dtype)).last_hidden_state)

    ref32, theirs = features(hf, torch.float32), features(copy.deepcopy(hf).to(torch.bfloat16), torch.bfloat16)
    got = ours.encode_images(pixels)
    _within_transformers_bf16(got, theirs.reshape(got.shape), ref32.reshape(got.shape))


@torch.inference_mode()
def test_llava_bf16_tower_against_transformers(tmp_path):
    path, hf = build_llava(tmp_path)
    ours = load_model(path, torch.float32, CPU, encoder_dtype="bfloat16").model
    pixels = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))

    def features(m, dtype):
        out = m.model.get_image_features(pixels.to(dtype), vision_feature_layer=-2,
                                         vision_feature_select_strategy="default")
        feats = out.pooler_output if hasattr(out, "pooler_output") else out
        return torch.cat(list(feats)) if isinstance(feats, (list, tuple)) else feats.reshape(-1, feats.shape[-1])

    ref32, theirs = features(hf, torch.float32), features(copy.deepcopy(hf).to(torch.bfloat16), torch.bfloat16)
    _within_transformers_bf16(ours.encode_images(pixels), theirs, ref32)
    assert ours.model.embed_tokens.weight.dtype == torch.float32


def test_float32_pins_the_tower(idefics3):
    """`float32` keeps the tower float32 (what every parity test against transformers float32 asks for)."""
    path, _ = idefics3
    loaded = load_model(path, torch.float32, CPU, encoder_dtype="float32")
    assert loaded.encoder_dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in loaded.model.vision_model.parameters())
    assert load_model(path, torch.float32, CPU).encoder_dtype == torch.float32  # no name: the model's dtype


def test_the_tower_dtype_is_part_of_the_served_fingerprint(idefics3):
    """The response cache and the KV tier key by the served weights: a bf16 tower's image KV is not a float32 one's."""
    from lmserve.loader.fingerprint import served_fingerprint

    path, _ = idefics3
    f32, bf16 = (load_model(path, torch.float32, CPU, encoder_dtype=d) for d in ("float32", "bfloat16"))
    assert served_fingerprint(f32) != served_fingerprint(bf16)
    assert served_fingerprint(f32) == served_fingerprint(load_model(path, torch.float32, CPU))
