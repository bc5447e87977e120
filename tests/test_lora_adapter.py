"""lora/peft_adapter.py: PEFT adapter directories read into float32 A/B with their scaling, every refusal named."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from lmserve.loader import read_model_config
from lmserve.lora.peft_adapter import AdapterError, read_peft_adapter
from tests.lora_adapters import ALL_PROJECTIONS, hf_base_model, make_peft_adapter, tiny_llama_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny Llama base, its ModelConfig, and one rank-8 adapter on all seven projections."""
    root = tmp_path_factory.mktemp("lora")
    base = tiny_llama_checkpoint(root)
    adapter = make_peft_adapter(root / "all", base, rank=8, target_modules=ALL_PROJECTIONS, seed=3)
    return base, read_model_config(base), adapter


def edited(tmp_path, adapter, config_edit=None, tensor_edit=None):
    """A copy of `adapter` with its config and/or tensors changed."""
    out = tmp_path / "edited"
    shutil.copytree(adapter, out)
    if config_edit:
        cfg = json.loads((out / "adapter_config.json").read_text())
        config_edit(cfg)
        (out / "adapter_config.json").write_text(json.dumps(cfg))
    if tensor_edit:
        tensors = load_file(out / "adapter_model.safetensors")
        tensor_edit(tensors)
        save_file(tensors, out / "adapter_model.safetensors")
    return out


def test_reads_every_module_with_shapes_and_scaling(tiny):
    base, cfg, adapter_dir = tiny
    adapter = read_peft_adapter(adapter_dir, cfg, name="all")
    assert adapter.name == "all" and adapter.rank == 8
    assert adapter.target_modules == tuple(sorted(ALL_PROJECTIONS))
    assert set(adapter.modules) == {(i, p) for i in range(cfg.num_layers) for p in ALL_PROJECTIONS}
    q, down = adapter.modules[(0, "q_proj")], adapter.modules[(2, "down_proj")]
    assert q.a.shape == (8, cfg.hidden_size) and q.b.shape == (cfg.q_size, 8)
    assert down.a.shape == (8, cfg.intermediate_size) and down.b.shape == (cfg.hidden_size, 8)
    assert adapter.modules[(1, "k_proj")].b.shape == (cfg.kv_size, 8)
    assert q.a.dtype == torch.float32 and q.b.abs().sum() > 0
    assert q.scaling == 16 / 8
    assert adapter.nbytes == sum(4 * (m.a.numel() + m.b.numel()) for m in adapter.modules.values())


def test_delta_equals_peft(tiny):
    """scaling * B @ A is PEFT's own delta weight for the same module."""
    from peft import PeftModel

    base, cfg, adapter_dir = tiny
    adapter = read_peft_adapter(adapter_dir, cfg, name="all")
    model = PeftModel.from_pretrained(hf_base_model(str(base)), str(adapter_dir))
    try:
        layer = model.base_model.model.model.layers[1].mlp.up_proj
        assert torch.allclose(adapter.modules[(1, "up_proj")].delta(), layer.get_delta_weight("default"))
    finally:
        model.unload()


def test_rslora_and_patterns(tiny, tmp_path):
    base, cfg, _ = tiny
    rs = make_peft_adapter(tmp_path / "rs", base, rank=16, alpha=8, use_rslora=True, target_modules=("o_proj",))
    adapter = read_peft_adapter(rs, cfg, name="rs")
    assert adapter.target_modules == ("o_proj",) and adapter.rank == 16
    assert adapter.modules[(0, "o_proj")].scaling == pytest.approx(8 / math.sqrt(16))
    # alpha_pattern is matched against module names the way PEFT does (a regex on the name's end)
    patterned = edited(tmp_path, rs, config_edit=lambda c: c.update(use_rslora=False,
                                                                      alpha_pattern={"layers.1.self_attn.o_proj": 32}))
    adapter = read_peft_adapter(patterned, cfg, name="p")
    assert adapter.modules[(0, "o_proj")].scaling == 8 / 16 and adapter.modules[(1, "o_proj")].scaling == 32 / 16


# (case, edit, words the message has, the config value it must never quote: a config may be someone's secret)
REFUSALS = [
    ("peft_type", lambda c: c.update(peft_type="IA3-SECRET"), "peft_type is not supported", "IA3-SECRET"),
    ("modules_to_save", lambda c: c.update(modules_to_save=["lm_head"]), "modules_to_save", None),
    ("dora", lambda c: c.update(use_dora=True), "DoRA", None),
    ("bias", lambda c: c.update(bias="all-SECRET"), "bias is not supported", "all-SECRET"),
    ("embedding", lambda c: c.update(target_modules=["q_proj", "embed_tokens"]), "embed_tokens", None),
    ("lm_head", lambda c: c.update(target_modules=["lm_head"]), "lm_head", None),
    ("other target", lambda c: c.update(target_modules=["q_proj", "input_layernorm"]), r"target_modules\[1\] is not",
     "input_layernorm"),
    ("rank", lambda c: c.update(r="eight-SECRET"), "r must be", "eight-SECRET"),
]


@pytest.mark.parametrize("case, edit, words, secret", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_config_refusals(tiny, tmp_path, case, edit, words, secret):
    _, cfg, adapter = tiny
    with pytest.raises(AdapterError, match=words) as e:
        read_peft_adapter(edited(tmp_path, adapter, config_edit=edit), cfg, name="x")
    assert secret is None or secret not in str(e.value)


def test_file_refusals(tiny, tmp_path):
    _, cfg, adapter = tiny
    with pytest.raises(AdapterError, match="not a directory"):
        read_peft_adapter(tmp_path / "nowhere", cfg, name="x")
    no_config = edited(tmp_path, adapter)
    (no_config / "adapter_config.json").unlink()
    with pytest.raises(AdapterError, match="adapter_config.json is missing"):
        read_peft_adapter(no_config, cfg, name="x")
    pickle_only = tmp_path / "pickle"
    shutil.copytree(adapter, pickle_only)
    (pickle_only / "adapter_model.safetensors").rename(pickle_only / "adapter_model.bin")
    with pytest.raises(AdapterError, match="pickle.*adapter_model.safetensors"):
        read_peft_adapter(pickle_only, cfg, name="x")


def test_rank_above_max(tiny):
    _, cfg, adapter = tiny
    with pytest.raises(AdapterError, match="rank 8 .* above the maximum LoRA rank 4"):
        read_peft_adapter(adapter, cfg, name="x", max_rank=4)


Q0 = "base_model.model.model.layers.0.self_attn.q_proj"


def test_tensor_refusals(tiny, tmp_path):
    _, cfg, adapter = tiny
    cases = [
        (lambda t: t.update({Q0 + ".lora_A.weight": torch.zeros(8, cfg.hidden_size + 1)}),
         rf"{Q0[len('base_model.model.'):]}.lora_A.weight has shape \[8, {cfg.hidden_size + 1}\], "
         rf"but the base model needs \[8, {cfg.hidden_size}\]"),
        (lambda t: t.update({"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(8, 4)}),
         "embedding"),
        (lambda t: t.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 4)}), "LM head"),
        (lambda t: t.update({Q0 + ".lora_magnitude_vector": torch.zeros(4)}), "DoRA"),
        (lambda t: t.update({"base_model.model.model.layers.0.mlp.q_proj.lora_A.weight": torch.zeros(8, 4)}),
         "unknown tensor name"),
        (lambda t: t.pop(Q0 + ".lora_B.weight"), "has no lora_B.weight"),
        (lambda t: t.update({"base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight": torch.zeros(8, 4),
                             "base_model.model.model.layers.9.self_attn.q_proj.lora_B.weight": torch.zeros(4, 8)}),
         "layer 9 does not exist"),
    ]
    for i, (edit, words) in enumerate(cases):
        with pytest.raises(AdapterError, match=words):
            read_peft_adapter(edited(tmp_path / str(i), adapter, tensor_edit=edit), cfg, name="x")


def test_adapter_for_another_base_is_refused(tiny, tmp_path, smol_path):
    """An adapter made on the tiny Llama does not fit the embedded SmolLM2: the message names both shapes."""
    _, _, adapter = tiny
    with pytest.raises(AdapterError, match=r"layers.0.mlp.down_proj.lora_A.weight has shape \[8, 256\], "
                                           r"but the base model needs \[8, 1536\]"):
        read_peft_adapter(adapter, read_model_config(smol_path), name="x")


def test_files_confined_to_the_root_and_never_echoed(tiny, tmp_path):
    """With a root (--lora-dir), every file is resolved once opened: a weight file or config that is a symlink out
    is refused, the message names the path relative to the root, and nothing from the outside file is quoted."""
    _, cfg, adapter = tiny
    root, outside = tmp_path / "loras", tmp_path / "outside"
    outside.mkdir()
    secret = outside / "secret.json"
    secret.write_text('{"peft_type": "SECRET-TOKEN-123"}')
    shutil.copy(adapter / "adapter_model.safetensors", outside / "weights.safetensors")
    for filename, target in (("adapter_config.json", secret), ("adapter_model.safetensors",
                                                                outside / "weights.safetensors")):
        d = root / f"via-{filename}"
        shutil.copytree(adapter, d)
        (d / filename).unlink()
        (d / filename).symlink_to(target)
        if filename == "adapter_model.safetensors":  # an operator's path (no root) may hold links: HF snapshots do
            read_peft_adapter(d, cfg, name="x")
        with pytest.raises(AdapterError) as e:
            read_peft_adapter(d, cfg, name="x", root=root)
        message = str(e.value)
        assert f"adapter via-{filename}: {filename} leads outside --lora-dir" in message, message
        assert str(tmp_path) not in message and "SECRET" not in message
    inside = root / "linked-inside"  # links that stay inside the root are fine (a snapshot kept in --lora-dir)
    shutil.copytree(adapter, inside)
    (inside / "adapter_model.safetensors").rename(root / "blob")
    (inside / "adapter_model.safetensors").symlink_to(root / "blob")
    assert read_peft_adapter(inside, cfg, name="x", root=root).digest
    with pytest.raises(AdapterError) as e:
        read_peft_adapter(root / "missing", cfg, name="x", root=root)
    assert str(e.value).startswith("adapter missing: not a directory") and str(tmp_path) not in str(e.value)


def test_digest_is_of_the_bytes_read(tiny, tmp_path):
    """The digest names the content: the same bytes anywhere give the same digest, one changed byte another."""
    import hashlib

    _, cfg, adapter = tiny
    first = read_peft_adapter(adapter, cfg, name="x")
    copy = tmp_path / "copy"
    shutil.copytree(adapter, copy)
    assert read_peft_adapter(copy, cfg, name="other-name").digest == first.digest
    expected = hashlib.sha256()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        data = (adapter / name).read_bytes()
        expected.update(b"%s %d\n" % (name.encode(), len(data)) + data)
    assert first.digest == expected.hexdigest()
    config = json.loads((copy / "adapter_config.json").read_text())
    (copy / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": config["lora_alpha"] + 1}))
    assert read_peft_adapter(copy, cfg, name="x").digest != first.digest


def test_registry_keeps_the_digest_and_refuses_files_changed_since_loading(tiny, tmp_path):
    """A re-read (after the host LRU dropped the adapter) must find the bytes it registered: other bytes under the
    same registration would answer under the old digest, which the response cache trusts."""
    from lmserve.config import LoraConfig
    from lmserve.lora.registry import AdapterNameTaken, LoraRegistry

    _, cfg, adapter = tiny
    root = tmp_path / "loras"
    shutil.copytree(adapter, root / "a")
    shutil.copytree(adapter, root / "b")
    registry = LoraRegistry(LoraConfig(max_loras=1, max_cpu_loras=1, max_lora_rank=8), cfg)
    first = registry.register("a", root / "a", root)
    registry.register("b", root / "b", root)  # host cache of one: a is dropped
    assert registry.lookup("a").digest == first.adapter.digest == registry.get("a").adapter.digest  # re-read, same
    with pytest.raises(AdapterNameTaken):
        registry.register("a", root / "b", root)
    registry.get("b")  # a is dropped again
    config = json.loads((root / "a" / "adapter_config.json").read_text())
    (root / "a" / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 1}))
    with pytest.raises(AdapterError, match="changed on disk since it was loaded") as e:
        registry.get("a")
    assert str(tmp_path) not in str(e.value)
