"""Bad checkpoints raise CheckpointError naming the file and the problem, never a crash deep in torch."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from lmserve.loader import CheckpointError, load_model
from tests.conftest import save_tiny_hf

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _ = save_tiny_hf(tmp_path_factory.mktemp("ckpt"), "llama")
    return path


def copy_of(tiny, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(tiny, dst)
    return dst


def shards(path):
    return sorted(path.glob("*.safetensors"))


def load(path):
    return load_model(path, torch.float32, CPU)


def test_truncated_safetensors(tiny, tmp_path):
    path = copy_of(tiny, tmp_path)
    victim = shards(path)[1]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=victim.name):
        load(path)


def test_garbage_header(tiny, tmp_path):
    path = copy_of(tiny, tmp_path)
    victim = shards(path)[0]
    victim.write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="not a valid safetensors file"):
        load(path)


def test_wrong_tensor_shape(tiny, tmp_path):
    path = copy_of(tiny, tmp_path)
    victim = shards(path)[0]
    tensors = load_file(victim)
    name = next(iter(tensors))
    tensors[name] = torch.zeros(3, 5)
    save_file(tensors, victim, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{victim.name}.*{name}.*shape \(3, 5\)"):
        load(path)


def test_config_mismatch_is_caught(tiny, tmp_path):
    path = copy_of(tiny, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["hidden_size"] = 96
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="expected"):
        load(path)


def test_missing_tensor(tiny, tmp_path):
    path = copy_of(tiny, tmp_path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    victim = shards(path)[-1]
    tensors = load_file(victim)
    dropped = sorted(tensors)[0]
    del tensors[dropped]
    save_file(tensors, victim, metadata={"format": "pt"})
    assert dropped in index["weight_map"]
    with pytest.raises(CheckpointError, match="not found in the shards|missing"):
        load(path)


def test_index_pointing_outside_directory(tiny, tmp_path):
    path = copy_of(tiny, tmp_path)
    outside = tmp_path / "evil.safetensors"
    shutil.copy(shards(path)[0], outside)
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "../evil.safetensors"
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="outside the model directory"):
        load(path)


def test_pickle_only_directory_is_refused(tmp_path):
    path = tmp_path / "pickled"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 8,
                                                   "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
                                                   "num_attention_heads": 2}))
    (path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match="safetensors"):
        load(path)


def test_unsupported_architecture_in_config(tiny, tmp_path):
    path = copy_of(tiny, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="GPT2LMHeadModel.*not supported"):
        load(path)


@pytest.mark.parametrize("q,message", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}, "desc_act = True: act-order"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method = 'bitsandbytes': not loaded"),
    ({"quant_method": "mxfp4"}, "quant_method = 'mxfp4': read for gpt-oss's experts only"),
])
def test_refused_quantization_config_names_the_field(tiny, tmp_path, q, message):
    """A pre-quantized checkpoint the int kernels cannot run exactly is refused before any weight is read."""
    path = copy_of(tiny, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = q
    (path / "config.json").write_text(json.dumps(cfg))
    from lmserve.loader import read_model_config

    for check in (read_model_config, load):
        with pytest.raises(CheckpointError, match=f"config.json: quantization_config.{message}"):
            check(path)


def write_gguf(path, arch: str, tensors: dict[str, np.ndarray]):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    for name, arr in tensors.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    write_gguf(path, "gpt2", {"token_embd.weight": np.zeros((16, 8), dtype=np.float32)})
    with pytest.raises(CheckpointError, match="'gpt2' is not supported"):
        load(path)


def test_gguf_truncated(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, "llama", {"token_embd.weight": np.ones((16, 8), dtype=np.float32)})
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 200])
    with pytest.raises(CheckpointError, match="tiny.gguf"):
        load(path)


def test_not_a_gguf(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"this is not a gguf file at all")
    with pytest.raises(CheckpointError, match="junk.gguf"):
        load(path)


def test_missing_path():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load("/nonexistent/model.gguf")


def write_llava_mmproj(path, **next_keys) -> None:
    """A projector file as llama.cpp's legacy convert_image_encoder_to_gguf.py writes a LLaVA one (type `mlp`), with
    the keys it adds for LLaVA-NeXT (`image_grid_pinpoints`, flattened; `mm_patch_merge_type`) where given."""
    import gguf

    w = gguf.GGUFWriter(str(path), "clip")
    w.add_bool("clip.has_text_encoder", False)
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.has_llava_projector", True)
    w.add_string("clip.projector_type", "mlp")
    for key, value in (("image_size", 32), ("patch_size", 8), ("embedding_length", 16), ("feed_forward_length", 32),
                       ("block_count", 1), ("attention.head_count", 2)):
        w.add_uint32(f"clip.vision.{key}", value)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-5)
    w.add_bool("clip.use_gelu", False)
    if "pinpoints" in next_keys:
        w.add_array("clip.vision.image_grid_pinpoints", next_keys["pinpoints"])
    if "merge" in next_keys:
        w.add_string("clip.vision.mm_patch_merge_type", next_keys["merge"])
    w.add_tensor("mm.2.weight", np.zeros((16, 16), dtype=np.float32))  # square: the text model's width either way
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("next_keys,named", [
    ({"pinpoints": [336, 672, 672, 336], "merge": "spatial_unpad"}, "image_grid_pinpoints"),
    ({"pinpoints": [336, 672, 672, 336]}, "image_grid_pinpoints"),
    ({"merge": "spatial_unpad"}, "mm_patch_merge_type 'spatial_unpad'"),
])
def test_a_llava_next_projector_file_is_refused_by_its_metadata(tmp_path, next_keys, named):
    """LLaVA-NeXT's legacy projector file has LLaVA-1.5's type (`mlp`): its anyres keys are what refuse it, so the
    same file without them (LLaVA-1.5, merge type `flat` or none) reads."""
    from types import SimpleNamespace

    from lmserve.loader.mmproj import read_mmproj

    text = SimpleNamespace(hidden_size=16)  # read_mmproj reads only the text model's width
    for plain in ({}, {"merge": "flat"}):
        write_llava_mmproj(tmp_path / "llava15.gguf", **plain)
        assert read_mmproj(tmp_path / "llava15.gguf", text).projector.architecture == "LlavaForConditionalGeneration"
    write_llava_mmproj(tmp_path / "next.gguf", **next_keys)
    with pytest.raises(CheckpointError) as e:
        read_mmproj(tmp_path / "next.gguf", text)
    message = str(e.value)
    assert "next.gguf" in message and named in message and "LLaVA-NeXT" in message
    assert "HF safetensors" in message and "\n" not in message


def test_serve_refuses_a_llava_next_projector_in_one_line(tmp_path):
    from tests.test_cli_errors import assert_one_line_error, lmserve
    from tests.tiny_models import build_hf
    from tests.tiny_models import write_gguf as write_text_gguf

    _, llama = build_hf("llama", tmp_path)
    text = write_text_gguf("llama", llama, tmp_path / "llama.gguf")
    write_llava_mmproj(tmp_path / "next.gguf", pinpoints=[336, 672, 672, 336], merge="spatial_unpad")
    assert_one_line_error(lmserve("serve", "--model", str(text), "--mmproj", str(tmp_path / "next.gguf")),
                          "LLaVA-NeXT projector", "from its HF safetensors directory")
