"""`lmserve lora merge`: merged exports give the unmerged adapter's logits (transformers + PEFT, float32), load in
lmserve and transformers alike, combine adapters exactly as PEFT's add_weighted_adapter does, and refuse bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from lmserve.cli import main
from lmserve.loader import read_model_config
from lmserve.lora.export import round_trip
from lmserve.lora.merge import MergeSpec, combine
from lmserve.lora.peft_adapter import read_peft_adapter
from lmserve.worker.transforms import load_formatted
from tests.conftest import save_tiny_hf
from tests.lora_adapters import (
    ALL_PROJECTIONS,
    hf_base_model,
    make_peft_adapter,
    peft_reference,
    reference_logits,
    tiny_llama_checkpoint,
)
from tests.test_model_parity import flat_logits

TOL = 1e-4
PROMPTS = [[1, 17, 45, 200, 3], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 77, 150]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny Llama base and four adapters: rank 8 on q/v, rank 8 on all seven, rank 16 rslora, rank 16 on MLP."""
    root = tmp_path_factory.mktemp("merge")
    base = tiny_llama_checkpoint(root)
    adapters = {
        "qv8": make_peft_adapter(root / "qv8", base, rank=8, target_modules=("q_proj", "v_proj"), seed=1),
        "all8": make_peft_adapter(root / "all8", base, rank=8, target_modules=ALL_PROJECTIONS, seed=2),
        "rs16": make_peft_adapter(root / "rs16", base, rank=16, alpha=8, use_rslora=True,
                                  target_modules=("k_proj", "o_proj", "down_proj"), seed=3),
        "mlp16": make_peft_adapter(root / "mlp16", base, rank=16, target_modules=("gate_proj", "up_proj"), seed=4),
    }
    return base, adapters, root


def merge(*argv: str) -> int:
    return main(["lora", "merge", *argv])


def hf_logits(model_dir) -> list[torch.Tensor]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return [reference_logits(model, p) for p in PROMPTS]


def lmserve_logits(model_dir) -> list[torch.Tensor]:
    return flat_logits(load_formatted(model_dir, torch.float32, torch.device("cpu")).model, PROMPTS)


def assert_close(got: list[torch.Tensor], want: list[torch.Tensor], tol: float = TOL) -> None:
    for g, w in zip(got, want):
        assert (g - w).abs().max().item() <= tol * max(1.0, w.abs().max().item())


# The embedded model's 30 float32 layers against transformers: on AVX2 (Zen 3) oneDNN's kernels and ours order the
# sums unlike MKL's, 1.6e-4 of the largest logit (1.1e-4 with the native kernels off; under 1e-4 on AVX-512). A
# merge that drops this adapter moves them by 1.2 of the largest logit, 4,000 times the bound.
DEEP_TOL = 3e-4


@pytest.mark.parametrize("name", ["all8", "rs16"])
def test_merged_export_equals_unmerged_adapter(tiny, tmp_path, name):
    """transformers and lmserve on the export = transformers + PEFT with the adapter unmerged (float32)."""
    base, adapters, _ = tiny
    out = tmp_path / "out"
    assert merge("--base", str(base), "--adapter", str(adapters[name]), "--dtype", "float32", "--out", str(out)) == 0
    with peft_reference(base, adapters[name]) as model:
        want = [reference_logits(model, p) for p in PROMPTS]
    base_logits = [reference_logits(hf_base_model(str(base)), p) for p in PROMPTS]
    assert (want[1] - base_logits[1]).abs().max() > 0.1, "the adapter should change the output"
    assert_close(hf_logits(out), want)
    assert_close(lmserve_logits(out), want)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
    assert (out / "tokenizer.json").is_file()


def peft_with(base, adapters: dict, names: list[str]):
    """transformers + PEFT with the named adapters loaded (the caller unloads)."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(hf_base_model(str(base)), str(adapters[names[0]]), adapter_name=names[0])
    for n in names[1:]:
        model.load_adapter(str(adapters[n]), adapter_name=n)
    return model


def peft_weighted(model, names, weights, method, density, seed) -> str:
    """PEFT's add_weighted_adapter; the new adapter's name."""
    from peft.tuners.lora import LoraLayer

    new = f"merged_{method}"
    model.add_weighted_adapter(names, weights, new, combination_type=method, density=density)
    if method.startswith("dare"):
        # PEFT draws DARE's masks from torch's global generator after its inject_adapter has drawn the new
        # adapter's random init; run its own per-module merge step again from the seed, in its module order.
        torch.manual_seed(seed)
        for _, target in model.base_model.model.named_modules():
            if isinstance(target, LoraLayer) and new in target.lora_A:
                a, b = model.base_model._generalized_task_arithmetic_weighted_adapter(
                    method, names, weights, target, density, "total")
                target.lora_A[new].weight.data, target.lora_B[new].weight.data = a, b
    return new


COMBINATIONS = [("linear", ["qv8", "all8"], [0.7, -0.4], None), ("ties", ["qv8", "all8"], [0.7, 0.5], 0.5),
                ("dare_linear", ["qv8", "all8"], [1.0, 0.6], 0.4), ("dare_ties", ["all8", "qv8"], [0.8, 0.8], 0.7),
                ("cat", ["qv8", "all8", "mlp16"], [0.5, 1.2, -0.3], None)]


def test_combinations_equal_peft_add_weighted_adapter(tiny):
    """Every method's merged delta, per projection, equals the delta of PEFT's add_weighted_adapter adapter."""
    base, adapters, _ = tiny
    cfg = read_model_config(base)
    model = peft_with(base, adapters, ["qv8", "all8", "mlp16"])
    try:
        for method, names, weights, density in COMBINATIONS:
            ours = combine([read_peft_adapter(adapters[n], cfg, name=n) for n in names],
                           MergeSpec(tuple(weights), method, density, seed=5))
            new = peft_weighted(model, names, weights, method, density, seed=5)
            assert set(ours) == {(i, p) for i in range(cfg.num_layers) for p in
                                 set().union(*(read_peft_adapter(adapters[n], cfg, name=n).target_modules
                                               for n in names))}
            for (layer, proj), module in ours.items():
                group = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                target = getattr(getattr(model.base_model.model.model.layers[layer], group), proj)
                want = target.get_delta_weight(new)
                assert torch.allclose(module.delta(), want, rtol=1e-5, atol=1e-7), (method, layer, proj)
    finally:
        model.unload()


def test_seeded_dare_merge_through_cli_matches_peft(tiny, tmp_path):
    """The whole command with --method dare_ties --seed: the export's logits = PEFT's merged adapter's, unmerged."""
    base, adapters, _ = tiny
    out = tmp_path / "dare"
    assert merge("--base", str(base), "--adapter", str(adapters["qv8"]), "--adapter", str(adapters["all8"]),
                 "--weights", "0.6,0.9", "--method", "dare_ties", "--density", "0.5", "--seed", "11",
                 "--dtype", "float32", "--out", str(out)) == 0
    model = peft_with(base, adapters, ["qv8", "all8"])
    try:
        model.set_adapter(peft_weighted(model, ["qv8", "all8"], [0.6, 0.9], "dare_ties", 0.5, seed=11))
        want = [reference_logits(model, p) for p in PROMPTS]
    finally:
        model.unload()
    assert_close(lmserve_logits(out), want)
    other = tmp_path / "dare_seed12"
    merge("--base", str(base), "--adapter", str(adapters["qv8"]), "--adapter", str(adapters["all8"]),
          "--weights", "0.6,0.9", "--method", "dare_ties", "--density", "0.5", "--seed", "12", "--out", str(other))
    assert not torch.equal(load_file(out / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"],
                           load_file(other / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"])


def test_qlora_int4_merges_onto_the_quantized_weights(tiny, tmp_path):
    """--quantization int4: each projection is lmserve's int4 codes dequantized, plus the delta; --dtype applies."""
    base, adapters, _ = tiny
    out = tmp_path / "q4"
    assert merge("--base", str(base), "--adapter", str(adapters["all8"]), "--quantization", "int4",
                 "--dtype", "bfloat16", "--out", str(out)) == 0
    merged = load_file(out / "model.safetensors")
    stored = load_file(base / "model.safetensors")
    module = read_peft_adapter(adapters["all8"], read_model_config(base), name="a").modules[(1, "up_proj")]
    name = "model.layers.1.mlp.up_proj.weight"
    want = (round_trip(stored[name].float(), "int4") + module.delta()).to(torch.bfloat16)
    assert merged[name].dtype == torch.bfloat16 and torch.equal(merged[name], want)
    assert torch.equal(merged["model.embed_tokens.weight"], stored["model.embed_tokens.weight"].to(torch.bfloat16))


def error_line(capsys, *argv: str) -> str:
    capsys.readouterr()  # drop what came before (transformers' progress bars)
    assert merge(*argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lmserve: error: ") and "\n" not in err, err
    return err


def test_bad_input_is_one_line_and_exit_2(tiny, tmp_path, capsys):
    base, adapters, root = tiny
    b, qv8, all8, mlp16 = str(base), str(adapters["qv8"]), str(adapters["all8"]), str(adapters["mlp16"])
    out = str(tmp_path / "out")
    assert "adapter_config.json is missing" in error_line(capsys, "--base", b, "--adapter", b, "--out", out)
    assert "not a directory" in error_line(capsys, "--base", b, "--adapter", str(root / "nope"), "--out", out)
    assert "at least one --adapter" in error_line(capsys, "--base", b, "--out", out)
    other_base, _ = save_tiny_hf(tmp_path, "llama")  # hidden size 64, not 128: an adapter for another base
    foreign = make_peft_adapter(tmp_path / "foreign", other_base, rank=8)
    assert "but the base model needs" in error_line(capsys, "--base", b, "--adapter", str(foreign), "--out", out)
    assert "--weights has 1 value(s) but 2 adapter(s)" in error_line(
        capsys, "--base", b, "--adapter", qv8, "--adapter", all8, "--weights", "0.5", "--out", out)
    assert "comma-separated numbers" in error_line(capsys, "--base", b, "--adapter", qv8, "--weights", "a", "--out", out)
    assert "--method 'svd' is not a merge method" in error_line(
        capsys, "--base", b, "--adapter", qv8, "--adapter", all8, "--method", "svd", "--out", out)
    for density in ("1.5", "0", "-0.1"):
        assert "--density must be in (0, 1]" in error_line(
            capsys, "--base", b, "--adapter", qv8, "--adapter", all8, "--method", "ties", "--density", density,
            "--out", out)
    assert "needs --density" in error_line(
        capsys, "--base", b, "--adapter", qv8, "--adapter", all8, "--method", "dare_linear", "--out", out)
    assert "needs adapters of one rank" in error_line(
        capsys, "--base", b, "--adapter", qv8, "--adapter", mlp16, "--out", out)
    assert "--dtype 'int8'" in error_line(capsys, "--base", b, "--adapter", qv8, "--dtype", "int8", "--out", out)
    assert "--quantization 'int3'" in error_line(
        capsys, "--base", b, "--adapter", qv8, "--quantization", "int3", "--out", out)
    assert "does not exist" in error_line(capsys, "--base", str(root / "nope"), "--adapter", qv8, "--out", out)
    assert "not an empty directory" in error_line(capsys, "--base", b, "--adapter", qv8, "--out", str(root))


def test_error_exit_code_from_the_real_command(tiny, tmp_path):
    base, adapters, _ = tiny
    proc = subprocess.run([sys.executable, "-m", "lmserve.cli", "lora", "merge", "--base", str(base), "--adapter",
                           str(adapters["qv8"]), "--adapter", str(adapters["all8"]), "--method", "ties",
                           "--density", "2", "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip() == "lmserve: error: --density must be in (0, 1], got 2.0"


@pytest.mark.slow
def test_embedded_gguf_export(tmp_path, smol_path):
    """The embedded Q4_1 GGUF (dequantized) + a rank-16 adapter on all projections: the export carries a config.json
    and tokenizer written from the GGUF, and both transformers and lmserve give PEFT's unmerged logits."""
    import transformers

    from lmserve.tokenizer import Tokenizer

    adapter = make_peft_adapter(tmp_path / "a", smol_path, rank=16, target_modules=ALL_PROJECTIONS, seed=7)
    out = tmp_path / "out"
    assert main(["lora", "merge", "--adapter", str(adapter), "--dtype", "float32", "--out", str(out)]) == 0
    with peft_reference(smol_path, adapter) as model:
        want = [reference_logits(model, p) for p in PROMPTS]
    assert_close(hf_logits(out), want)
    assert_close(lmserve_logits(out), want, DEEP_TOL)
    gguf_cfg, export_cfg = read_model_config(smol_path), read_model_config(out)
    assert export_cfg.architecture == "LlamaForCausalLM"
    assert {**vars(export_cfg), "architecture": "llama"} == vars(gguf_cfg)
    theirs, ours, gguf_tok = (transformers.AutoTokenizer.from_pretrained(str(out)), Tokenizer.from_pretrained(out),
                              Tokenizer.from_gguf(smol_path))
    chat = [{"role": "user", "content": "Merge me, then say héllo 👋\n  twice."}]
    for text in ("Hello world, über-tokens!", gguf_tok.apply_chat_template(chat)):
        assert ours.encode_prompt(text) == gguf_tok.encode_prompt(text) == theirs(text)["input_ids"]
    assert ours.apply_chat_template(chat) == theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert ours.eos_token_ids == gguf_tok.eos_token_ids


def test_rslora_first_adapter_differs_from_peft_by_sqrt_rank(tiny):
    """The one documented difference: PEFT's combined adapter keeps the first adapter's use_rslora, so its delta is
    sqrt(new rank) times the combination; ours keeps scaling 1 (here cat: rank 16 + 16)."""
    base, adapters, _ = tiny
    cfg = read_model_config(base)
    ours = combine([read_peft_adapter(adapters[n], cfg, name=n) for n in ("rs16", "mlp16")],
                   MergeSpec((1.0, 0.5), "cat"))
    model = peft_with(base, adapters, ["rs16", "mlp16"])
    try:
        new = peft_weighted(model, ["rs16", "mlp16"], [1.0, 0.5], "cat", None, seed=0)
        want = model.base_model.model.model.layers[0].mlp.down_proj.get_delta_weight(new)
        assert torch.allclose(ours[(0, "down_proj")].delta() * 32**0.5, want, rtol=1e-5, atol=1e-7)
    finally:
        model.unload()


def test_failed_export_leaves_nothing(tiny, tmp_path, capsys):
    base, adapters, _ = tiny
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in base.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "model.safetensors").write_bytes((base / "model.safetensors").read_bytes()[:5000])  # truncated
    assert merge("--base", str(broken), "--adapter", str(adapters["qv8"]), "--out", str(tmp_path / "out")) == 2
    assert "not a valid safetensors file" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
