"""Vision towers + projectors (models/vision/) against transformers float32 on tiny random configs: each family's
per-image embeddings within 1e-4 of transformers' get_image_features for 1 and 2 images."""

from __future__ import annotations

import pytest
import torch

TOL = 1e-4


def _close(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    assert len(ours) == len(ref)
    for a, b in zip(ours, ref):
        assert a.shape == b.shape
        assert (a - b).abs().max().item() < TOL


def _pooled(out) -> list[torch.Tensor]:
    """transformers 5 returns get_image_features as a model output whose pooler_output holds the features."""
    feats = out.pooler_output if hasattr(out, "pooler_output") else out
    return list(feats) if isinstance(feats, (list, tuple)) else list(feats.unbind(0))


# ---- LLaVA-1.5 ---------------------------------------------------------------------------------------------------

def _tiny_llava(feature_layer=-2, select="default"):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(0)
    vision = CLIPVisionConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                              image_size=32, patch_size=8, projection_dim=32)
    text = LlamaConfig(vocab_size=256, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_id=255, vision_feature_layer=feature_layer,
                      vision_feature_select_strategy=select)
    return LlavaForConditionalGeneration(cfg).eval()


@pytest.mark.parametrize("n_images", [1, 2])
@pytest.mark.parametrize("layer,select", [(-2, "default"), ([-3, -1], "full")])
def test_llava_matches_transformers(n_images, layer, select):
    from lmserve.models.vision.llava import LlavaVision, LlavaVisionConfig

    hf = _tiny_llava(layer, select)
    ours = LlavaVision(LlavaVisionConfig.from_hf(hf.config)).eval()
    ours.load_hf_weights(hf.state_dict())  # the whole checkpoint: the text model's tensors are passed over
    pixels = torch.randn(n_images, 3, 32, 32)
    with torch.no_grad():
        ref = _pooled(hf.model.get_image_features(pixels, vision_feature_layer=layer,
                                                  vision_feature_select_strategy=select))
        got = ours.encode_images(pixels)
    assert got[0].shape[0] == ours.cfg.tokens_per_image
    _close(got, ref)


# ---- Gemma 3 -----------------------------------------------------------------------------------------------------

def _tiny_gemma3():
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    torch.manual_seed(0)
    vision = SiglipVisionConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                image_size=64, patch_size=4, vision_use_head=False)
    text = Gemma3TextConfig(vocab_size=300, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=24)
    cfg = Gemma3Config(vision_config=vision, text_config=text, mm_tokens_per_image=16, image_token_index=299,
                       boi_token_index=297, eoi_token_index=298)
    hf = Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # transformers initialises the norm weight to 0 (an identity): make it count
        hf.model.multi_modal_projector.mm_soft_emb_norm.weight.normal_(0, 0.5)
        hf.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.2)
    return hf


def _gemma3_ours(hf):
    from lmserve.models.vision.gemma3 import Gemma3Vision, Gemma3VisionConfig

    ours = Gemma3Vision(Gemma3VisionConfig.from_hf(hf.config)).eval()
    ours.load_hf_weights(hf.state_dict())
    return ours


@pytest.mark.parametrize("n_images", [1, 2])
def test_gemma3_matches_transformers(n_images):
    hf = _tiny_gemma3()
    ours = _gemma3_ours(hf)
    pixels = torch.randn(n_images, 3, 64, 64)
    with torch.no_grad():
        ref = _pooled(hf.model.get_image_features(pixels))
        got = ours.encode_images(pixels)
    assert got[0].shape == (16, 48)
    _close(got, ref)


def test_gemma3_projector_on_siglip_features():
    """The projector alone, fed transformers' own SiglipVisionModel output (the tower t42-core's siglip.py replaces)."""
    hf = _tiny_gemma3()
    ours = _gemma3_ours(hf)
    pixels = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        feats = hf.model.vision_tower(pixel_values=pixels).last_hidden_state
        _close(list(ours.multi_modal_projector(feats)), list(hf.model.multi_modal_projector(feats)))


# ---- Qwen2.5-VL --------------------------------------------------------------------------------------------------

def _tiny_qwen25_vl():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    # window 56px = 2x2 merge blocks, so the grids below hold several windows, some partial; block 1 attends fully
    vision = dict(depth=3, hidden_size=64, intermediate_size=96, num_heads=4, out_hidden_size=48,
                  fullatt_block_indexes=[1], window_size=56, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    text = dict(vocab_size=256, hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1)
    hf = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision)).eval()
    with torch.no_grad():  # RMSNorm weights start at 1: make them count
        for name, p in hf.model.visual.named_parameters():
            if "norm" in name or "ln_q" in name:
                p.normal_(1.0, 0.3)
    return hf


@pytest.mark.parametrize("grids", [[(1, 6, 8)], [(1, 8, 4), (1, 4, 12)]])
def test_qwen25_vision_matches_transformers(grids):
    from lmserve.models.vision.qwen2_5_vl import Qwen25VisionConfig, Qwen25VisionTransformer

    hf = _tiny_qwen25_vl()
    ours = Qwen25VisionTransformer(Qwen25VisionConfig.from_hf(hf.config.vision_config)).eval()
    ours.load_hf_weights(hf.state_dict())
    n = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(n, 3 * 2 * 14 * 14)
    with torch.no_grad():
        ref = _pooled(hf.model.get_image_features(pixels, image_grid_thw=torch.tensor(grids)))
        got = ours.encode_images(pixels, grids)
    _close(got, ref)


# ---- LLaVA-NeXT (anyres) ------------------------------------------------------------------------------------------

def _tiny_llava_next():
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaNextConfig, LlavaNextForConditionalGeneration

    torch.manual_seed(0)
    vision = CLIPVisionConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                              image_size=32, patch_size=8, projection_dim=32)
    text = LlamaConfig(vocab_size=256, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1)
    cfg = LlavaNextConfig(vision_config=vision, text_config=text, image_token_id=255,
                          image_grid_pinpoints=[[32, 64], [64, 32], [64, 64], [96, 32], [32, 96]])
    return LlavaNextForConditionalGeneration(cfg).eval()


@pytest.mark.parametrize("sizes", [[(50, 120)], [(300, 200), (64, 64)]])
def test_llava_next_matches_transformers(sizes):
    from lmserve.models.vision.llava import LlavaNextVision, LlavaVisionConfig
    from lmserve.multimodal.llava_next import LlavaNextImageProcessor

    hf = _tiny_llava_next()
    ours = LlavaNextVision(LlavaVisionConfig.from_hf(hf.config)).eval()
    ours.load_hf_weights(hf.state_dict())
    proc = LlavaNextImageProcessor(tile=32, pinpoints=tuple(map(tuple, hf.config.image_grid_pinpoints)))
    grids = [proc.tile_grid(h, w) for h, w in sizes]
    views = [torch.randn(1 + r * c, 3, 32, 32) for r, c in grids]
    most = max(v.shape[0] for v in views)  # transformers takes the batch padded to the most views
    batch = torch.stack([torch.cat([v, v.new_zeros(most - v.shape[0], 3, 32, 32)]) for v in views])
    with torch.no_grad():
        ref = _pooled(hf.model.get_image_features(batch, image_sizes=torch.tensor(sizes)))
        got = ours.encode_images(views, sizes, grids)
    assert [g.shape[0] for g in got] == [proc.num_image_tokens(h, w, 8) for h, w in sizes]
    _close(got, ref)


def test_transformers4_checkpoint_names_load():
    """Checkpoints saved by transformers 4 (llava-hf, google/gemma-3) spell the tower `vision_tower.vision_model.*`
    with no `model.` prefix; they load to the same weights."""
    from lmserve.models.vision.llava import LlavaVision, LlavaVisionConfig

    hf = _tiny_llava()
    v4 = {k.removeprefix("model.").replace("vision_tower.", "vision_tower.vision_model."): t
          for k, t in hf.state_dict().items()}
    v4["vision_tower.vision_model.embeddings.position_ids"] = torch.arange(17)[None]  # a buffer old files kept
    a, b = (LlavaVision(LlavaVisionConfig.from_hf(hf.config)).eval() for _ in range(2))
    a.load_hf_weights(hf.state_dict())
    b.load_hf_weights(v4)
    pixels = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(a.encode_images(pixels)[0], b.encode_images(pixels)[0])
