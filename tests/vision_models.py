"""A tiny random Idefics3 (SmolVLM-shaped) model made by transformers and saved as a model directory the engine
serves: safetensors, config.json, the processor's two files and a word-level tokenizer whose image tokens
(`<image>`, `<fake_token_around_image>`, `<global-img>`, `<row_r_col_c>`) are special, as SmolVLM's are."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

TILE, PATCH, SCALE = 32, 8, 2  # 4x4 patches per tile, pixel shuffle by 2: 4 embeddings per tile
SEQ = (TILE // PATCH) ** 2 // SCALE ** 2
LONGEST = 4 * TILE
WORDS = ["<pad>", "<s>", "</s>"] + [f"w{i}" for i in range(200)]
SPECIAL = (["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"]
           + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
           + ["<start_of_image>", "<image_soft_token>", "<end_of_image>"]  # Gemma 3's
           + ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"])  # Qwen2.5-VL's
VOCAB = 256
IMAGE_TOKEN_ID = len(WORDS)  # "<image>"
# SmolVLM's template in miniature: text parts as they are, each image part as "<image>"
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }} {% else %}"
                 "{% for p in m['content'] %}{% if p['type'] == 'text' %}{{ p['text'] }} "
                 "{% elif p['type'] == 'image' %}<image> {% endif %}{% endfor %}{% endif %}{% endfor %}")


# Qwen2.5-VL's template in miniature: each image part as its vision span
QWEN_CHAT_TEMPLATE = CHAT_TEMPLATE.replace("<image> ", "<|vision_start|><|image_pad|><|vision_end|> ")


def write_tokenizer(path: Path, chat_template: str = CHAT_TEMPLATE) -> None:
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(WORDS + SPECIAL)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIAL])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                             "chat_template": chat_template}))


def build_idefics3(root: Path, seed: int = 0, vocab: int = VOCAB, kv_heads: int = 1) -> tuple[Path, torch.nn.Module]:
    """(model directory, the transformers model in float32, eval mode); `vocab`: the text model's rows (more than the
    tokenizer's leaves room for a converted tokenizer's extra pieces: tests/llama_convert.py); `kv_heads` 2: a text
    model tensor parallelism splits in two."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Idefics3Config(
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                           image_size=TILE, patch_size=PATCH, initializer_range=0.2),
        text_config=dict(model_type="llama", vocab_size=vocab, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=kv_heads, max_position_embeddings=1024,
                         initializer_range=0.2, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6),
        scale_factor=SCALE, image_token_id=IMAGE_TOKEN_ID)
    model = transformers.Idefics3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # the connector's default init is tiny: images would barely move the logits
        g = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if "connector" in name or "position_embedding" in name or "patch_embedding" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    path = root / "idefics3"
    model.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "Idefics3ImageProcessor", "size": {"longest_edge": LONGEST},
         "max_image_size": {"longest_edge": TILE}, "do_image_splitting": True, "resample": 1,
         "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "rescale_factor": 1 / 255}))
    (path / "processor_config.json").write_text(json.dumps({"image_seq_len": SEQ}))
    write_tokenizer(path)
    return path, model


PINPOINTS = [[32, 64], [64, 32], [64, 64]]  # tiny LLaVA-NeXT's tile grids (height, width)


def build_llava(root: Path, seed: int = 0, next_: bool = False, rows: int = VOCAB) -> tuple[Path, torch.nn.Module]:
    """A tiny random LLaVA-1.5 (CLIP tower read at layer -2, MLP projector, Llama): 16 `<image>` per image; with
    `next_` LLaVA-NeXT (the same over a base view and 32px anyres tiles, unpadded, row newlines); `rows`: as
    build_idefics3's `vocab`."""
    import transformers

    torch.manual_seed(seed)
    extra = {"image_grid_pinpoints": PINPOINTS} if next_ else {}
    cfg = (transformers.LlavaNextConfig if next_ else transformers.LlavaConfig)(
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                           num_attention_heads=2, image_size=TILE, patch_size=PATCH, projection_dim=16),
        text_config=dict(model_type="llama", vocab_size=rows, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                         initializer_range=0.2, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6),
        image_token_id=IMAGE_TOKEN_ID, vision_feature_layer=-2, vision_feature_select_strategy="default", **extra)
    model = (transformers.LlavaNextForConditionalGeneration if next_ else
             transformers.LlavaForConditionalGeneration)(cfg).eval()
    with torch.no_grad():  # the projector's default init is small: images would barely move the logits
        g = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if any(k in name for k in ("projector", "position_embedding", "patch_embedding", "image_newline")):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    path = root / ("llava_next" if next_ else "llava")
    model.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": TILE},
         "crop_size": {"height": TILE, "width": TILE}, **extra}))
    write_tokenizer(path)
    return path, model


GEMMA_TOKENS = 4  # the tiny Gemma 3's soft tokens per image: 4x4 patches average-pooled 2x2


def build_gemma3(root: Path, seed: int = 0, rows: int = VOCAB, layer_types: tuple[str, ...] = (
        "sliding_attention", "full_attention"), kv_heads: int = 1) -> tuple[Path, torch.nn.Module]:
    """A tiny random Gemma 3 with its SigLIP tower (4 soft tokens per image; sliding and full layers); `rows`: as
    build_idefics3's `vocab`; `layer_types`: one per layer (a GGUF file has no pattern key: llama.cpp and
    models/gemma.py read Gemma 3's five sliding layers, then one full)."""
    import transformers

    vocab = {w: i for i, w in enumerate(WORDS + SPECIAL)}
    torch.manual_seed(seed)
    cfg = transformers.Gemma3Config(
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=48,
                           num_hidden_layers=2, num_attention_heads=2, image_size=TILE, patch_size=PATCH),
        text_config=dict(model_type="gemma3_text", vocab_size=rows, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=len(layer_types), num_attention_heads=2, num_key_value_heads=kv_heads,
                         head_dim=64, max_position_embeddings=1024, initializer_range=0.2, bos_token_id=1,
                         eos_token_id=2, sliding_window=16, layer_types=list(layer_types),
                         query_pre_attn_scalar=64),  # the head size, as the released 1B-12B models have it
        mm_tokens_per_image=GEMMA_TOKENS, image_token_id=vocab["<image_soft_token>"],
        boi_token_id=vocab["<start_of_image>"], eoi_token_id=vocab["<end_of_image>"])
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if any(k in name for k in ("projector", "position_embedding", "patch_embedding")):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif "language_model" in name and "norm" in name:  # Gemma's (1 + w) norms start at w = 0: vary them
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    path = root / "gemma3"
    model.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "Gemma3ImageProcessor", "size": {"height": TILE, "width": TILE},
         "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 2,
         "image_seq_length": GEMMA_TOKENS}))  # as the released files have it (256); llama.cpp's converter reads it
    write_tokenizer(path)
    return path, model


QWEN_PIXELS = (56 * 56, 112 * 112)  # the tiny Qwen2.5-VL's min and max pixels: 4 to 16 merged tokens per image


def build_qwen25_vl(root: Path, seed: int = 0, rows: int = VOCAB, window: int = 56,
                    pixels: tuple[int, int] = QWEN_PIXELS, fullatt: tuple[int, ...] = (1,), kv_heads: int = 1
                    ) -> tuple[Path, torch.nn.Module]:
    """A tiny random Qwen2.5-VL: a windowed ViT of `fullatt[-1] + 1` blocks (`window`-pixel windows; the blocks
    `fullatt` attend to the whole image), 2x2 merger, a Qwen2 text model whose 16 rotary pairs split 4/6/6 over
    M-RoPE's time, row and column axes; `rows`: as build_idefics3's `vocab`; `pixels`: the processor's min and max
    pixels."""
    import transformers

    vocab = {w: i for i, w in enumerate(WORDS + SPECIAL)}
    torch.manual_seed(seed)
    cfg = transformers.Qwen2_5_VLConfig(
        vision_config=dict(depth=fullatt[-1] + 1, hidden_size=32, intermediate_size=48, num_heads=2,
                           out_hidden_size=64, fullatt_block_indexes=list(fullatt), window_size=window, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2),
        text_config=dict(vocab_size=rows, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=kv_heads, max_position_embeddings=1024,
                         initializer_range=0.2, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6,
                         rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]}),
        image_token_id=vocab["<|image_pad|>"], vision_start_token_id=vocab["<|vision_start|>"],
        vision_end_token_id=vocab["<|vision_end|>"])
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # the merger's default init is small: images would barely move the logits
        g = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if "visual" in name and ("merger.mlp" in name or "patch_embed" in name):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif "visual" in name and ("norm" in name or "ln_q" in name):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
    path = root / "qwen2_5_vl"
    model.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": pixels[0], "max_pixels": pixels[1],
         "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
         # the released file's (CLIP's, the processor's default); llama.cpp's converter requires them
         "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}))
    write_tokenizer(path, QWEN_CHAT_TEMPLATE)
    return path, model


def image(w: int, h: int, seed: int):
    """A PIL RGB test image: a gradient plus noise (seeded)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    base = np.linspace(0, 255, w * h * 3).reshape(h, w, 3)[..., rng.permutation(3)]
    return Image.fromarray(np.clip(base + rng.integers(-60, 60, (h, w, 3)), 0, 255).astype(np.uint8))


def image_bytes(w: int, h: int, seed: int) -> bytes:
    import io

    buf = io.BytesIO()
    image(w, h, seed).save(buf, format="PNG")
    return buf.getvalue()
