"""Writers of pre-quantized checkpoints for the tests: a tiny random Llama, and the GPTQ / AWQ packings of integer
codes, written here from their documented layouts with plain shifts (an implementation independent of the
loader's byte-view unpacking). No GPTQ/AWQ writer runs here: GPTQModel needs torch >= 2.14.1 and AutoGPTQ 0.7.1
cannot import with transformers 5, so the GPTQ and AWQ files are made from llm-compressor's own integer codes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 256, 128, 256, 2, 4, 2
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of a word holds output row 8j + AWQ_ORDER[i]


def write_tiny_base(path: Path, dtype: torch.dtype = torch.float32, tied: bool = False) -> Path:
    """A random-weight Llama (transformers' own init, seeded) with a word-level tokenizer: "t0 t17 ..." -> ids;
    saved in `dtype` (real checkpoints ship in bfloat16), its LM head tied to the embedding or not."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    # initializer_range 0.1 (not 0.02): logits far enough apart that greedy tokens are a meaningful comparison
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=512,
                      tie_word_embeddings=tied, initializer_range=0.1, eos_token_id=2, bos_token_id=1)
    LlamaForCausalLM(cfg).to(dtype).save_pretrained(path)
    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0").save_pretrained(path)
    return path


def pack_rows(values: np.ndarray, bits: int) -> np.ndarray:
    """uint [R, C] -> int32 [R * bits / 32, C]: 32 / bits consecutive rows per word, row r at bit bits * (r % per)."""
    per = 32 // bits
    v = values.astype(np.uint32).reshape(values.shape[0] // per, per, values.shape[1])
    words = np.zeros(v[:, 0].shape, np.uint32)
    for i in range(per):
        words |= v[:, i] << np.uint32(bits * i)
    return words.view(np.int32)


def pack_awq(values: np.ndarray) -> np.ndarray:
    """uint [R, N] (4-bit) -> int32 [R, N / 8] in AutoAWQ's GEMM order."""
    v = values.astype(np.uint32).reshape(values.shape[0], -1, 8)
    words = np.zeros(v[..., 0].shape, np.uint32)
    for i, row in enumerate(AWQ_ORDER):
        words |= v[..., row] << np.uint32(4 * i)
    return words.view(np.int32)


def codes_of(ct_dir: Path) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, int]]:
    """A compressed-tensors pack-quantized checkpoint's layers -> (unsigned codes [N, K], zeros [N, G], scales
    [N, G], bits), unpacked by compressed-tensors itself."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    tensors = load_file(str(ct_dir / "model.safetensors"))
    out = {}
    for name, packed in tensors.items():
        if not name.endswith(".weight_packed"):
            continue
        prefix = name.removesuffix(".weight_packed")
        shape = torch.Size(tensors[f"{prefix}.weight_shape"].tolist())
        scales = tensors[f"{prefix}.weight_scale"].float()
        bits = packed.shape[1] * 32 // shape[1]
        offset = 1 << (bits - 1)
        q = unpack_from_int32(packed, bits, shape).numpy().astype(np.int16) + offset
        zp = tensors.get(f"{prefix}.weight_zero_point")
        zeros = (np.full(scales.shape, offset, np.int16) if zp is None else
                 unpack_from_int32(zp, bits, scales.shape, packed_dim=0).numpy().astype(np.int16) + offset)
        out[prefix] = q, zeros, scales.numpy(), bits
    return out


def write_packed(ct_dir: Path, out: Path, method: str, v1: bool = True) -> Path:
    """The same layers as `ct_dir` in the GPTQ (v1 or v2) or AWQ (GEMM) packing, with their own config.json."""
    shutil.copytree(ct_dir, out)
    tensors = {k: v for k, v in load_file(str(ct_dir / "model.safetensors")).items()
               if not k.rpartition(".")[2].startswith("weight_")}
    symmetric = True
    for prefix, (codes, zeros, scales, bits) in codes_of(ct_dir).items():
        group = codes.shape[1] // scales.shape[1]
        symmetric &= bool((zeros == 1 << (bits - 1)).all())
        # the library's float32 scales as they are (real GPTQ/AWQ files hold float16: read the same way)
        tensors[f"{prefix}.scales"] = torch.from_numpy(np.ascontiguousarray(scales.T))
        if method == "awq":
            tensors[f"{prefix}.qweight"] = torch.from_numpy(pack_awq(codes.T))
            tensors[f"{prefix}.qzeros"] = torch.from_numpy(pack_awq(zeros.T))
        else:
            stored = (zeros - 1) % (1 << bits) if v1 else zeros  # v1 keeps zero - 1 (zero 0 wraps to 15)
            tensors[f"{prefix}.qweight"] = torch.from_numpy(pack_rows(codes.T, bits))
            tensors[f"{prefix}.qzeros"] = torch.from_numpy(np.ascontiguousarray(pack_rows(stored, bits).T))
            tensors[f"{prefix}.g_idx"] = torch.arange(codes.shape[1], dtype=torch.int32) // group
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm"}
        if method == "awq" else
        {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": False, "sym": symmetric,
         "checkpoint_format": "gptq" if v1 else "gptq_v2"})
    (out / "config.json").write_text(json.dumps(config))
    return out
