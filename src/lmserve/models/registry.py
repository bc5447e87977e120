"""Architecture name -> model family. A name is a config.json `architectures` entry or a GGUF
`general.architecture`; the family says how to read that file (models/family.py), and every family builds
the shared CausalLM (models/decoder.py)."""

from __future__ import annotations

from torch import nn

from lmserve.models import (
    bert,
    gemma,
    gemma3_vision,
    gpt_oss,
    idefics3,
    llama,
    llava,
    moe,
    phi3,
    qwen2_5_vl,
    rotary_encoder,
)
from lmserve.models.config import ModelConfig
from lmserve.models.family import Family

HF_ARCHITECTURES: dict[str, Family] = {
    "LlamaForCausalLM": llama.LLAMA,
    "MistralForCausalLM": llama.MISTRAL,
    "Qwen2ForCausalLM": llama.QWEN2,
    "Qwen3ForCausalLM": llama.QWEN3,
    "SmolLM3ForCausalLM": llama.SMOLLM3,
    "Gemma2ForCausalLM": gemma.GEMMA2,
    "Gemma3ForCausalLM": gemma.GEMMA3,
    "Gemma3ForConditionalGeneration": gemma3_vision.GEMMA3_VISION,  # SigLIP pooled to soft tokens, Gemma 3 text
    "Phi3ForCausalLM": phi3.PHI3,
    "MixtralForCausalLM": moe.MIXTRAL,
    "Qwen2MoeForCausalLM": moe.QWEN2_MOE,
    "Qwen3MoeForCausalLM": moe.QWEN3_MOE,
    "GptOssForCausalLM": gpt_oss.GPT_OSS,
    "Idefics3ForConditionalGeneration": idefics3.IDEFICS3,  # SmolVLM: SigLIP tower, pixel-shuffle connector, Llama
    "SmolVLMForConditionalGeneration": idefics3.IDEFICS3,
    "LlavaForConditionalGeneration": llava.LLAVA,  # LLaVA-1.5: CLIP tower at a middle layer, MLP projector, Llama
    "LlavaNextForConditionalGeneration": llava.LLAVA_NEXT,  # LLaVA-NeXT: LLaVA over anyres tiles, row newlines
    "Qwen2_5_VLForConditionalGeneration": qwen2_5_vl.QWEN2_5_VL,  # windowed ViT, 2x2 merger, Qwen2 text with M-RoPE
    # encoders: embedders (sentence-transformers' MiniLM, bge, e5, gte) and cross-encoders
    "BertModel": bert.BERT,
    "BertForSequenceClassification": bert.BERT,
    "XLMRobertaModel": bert.XLM_ROBERTA,
    "XLMRobertaForSequenceClassification": bert.XLM_ROBERTA,
    "RobertaModel": bert.XLM_ROBERTA,
    "RobertaForSequenceClassification": bert.XLM_ROBERTA,
    "ModernBertModel": rotary_encoder.MODERNBERT,
    "ModernBertForSequenceClassification": rotary_encoder.MODERNBERT,
    "NomicBertModel": rotary_encoder.NOMIC_BERT,
}
GGUF_ARCHITECTURES: dict[str, Family] = {
    "llama": llama.LLAMA,  # also Mistral's and Mixtral's files
    "qwen2": llama.QWEN2,
    "qwen2vl": qwen2_5_vl.QWEN2VL_TEXT,  # Qwen2(.5)-VL's text model (M-RoPE); with its mmproj file, Qwen2.5-VL
    "qwen3": llama.QWEN3,
    "smollm3": llama.SMOLLM3,
    "gemma2": gemma.GEMMA2,
    "gemma3": gemma.GEMMA3,
    "phi3": phi3.PHI3,
    "qwen2moe": moe.QWEN2_MOE,
    "qwen3moe": moe.QWEN3_MOE,
    "gpt-oss": gpt_oss.GPT_OSS,
    "bert": bert.BERT,  # llama.cpp's converter: BertModel (MiniLM, bge, e5) embedders
    "nomic-bert": rotary_encoder.NOMIC_BERT,  # nomic-embed-text v1 / v1.5
    "modern-bert": rotary_encoder.MODERNBERT,  # ModernBERT embedders and rerankers (gte-modernbert, granite R2)
}


def family_of(cfg: ModelConfig) -> Family:
    """The family a config was read as."""
    return HF_ARCHITECTURES.get(cfg.architecture) or GGUF_ARCHITECTURES[cfg.architecture]


def build_model(cfg: ModelConfig) -> nn.Module:
    """Instantiate the model of the config's family."""
    return family_of(cfg).model(cfg)
