"""Test helpers (not a test module): a tiny sentence-transformers checkpoint (a random Llama with modules.json and a
1_Pooling config) and the float32 reference vectors of sentence-transformers and transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.tiny_models import build_hf

ST_MODE = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token", "last": "pooling_mode_lasttoken"}
TEXTS = ["w1 w2 w3", "w7 w9 w11 w13 w15 w17 w19 w21 w23 w25 w27 w29 w31 w33 w35 w37 w39 w41 w43 w45 w47 w49",
         " ".join(f"w{i}" for i in range(100, 140)), "w250"]


@pytest.fixture(scope="session")
def st_dir(tmp_path_factory) -> Path:
    """The tiny mean-pooling sentence-transformers checkpoint, shared by the engine and the server tests."""
    return write_sentence_transformer(tmp_path_factory.mktemp("st"), "mean")


@pytest.fixture(scope="session")
def st_reference(st_dir) -> tuple[list[list[int]], torch.Tensor]:
    """sentence-transformers' (ids, vectors) of TEXTS on st_dir."""
    return st_vectors(st_dir, TEXTS)


def write_sentence_transformer(root: Path, pooling: str = "mean") -> Path:
    """The tiny Llama saved as a sentence-transformers directory: Transformer (the checkpoint at the root), Pooling
    (`pooling`), Normalize."""
    path, _ = build_hf("llama", root)
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (path / "1_Pooling").mkdir()
    flags = {key: key == ST_MODE[pooling] for key in (*ST_MODE.values(), "pooling_mode_max_tokens",
                                                      "pooling_mode_mean_sqrt_len_tokens",
                                                      "pooling_mode_weightedmean_tokens")}
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 128, **flags,
                                                                "include_prompt": True}))
    (path / "2_Normalize").mkdir()
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256, "do_lower_case": False}))
    # a plain fast tokenizer over tokenizer.json (no Llama BOS rule): the ids lmserve's tokenizer gives
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                            "bos_token": "<s>", "eos_token": "</s>",
                                                            "pad_token": "<pad>"}))
    return path


def st_vectors(path: Path, texts: list[str]) -> tuple[list[list[int]], torch.Tensor]:
    """(token ids, [N, H] float32 unit vectors) as sentence-transformers encodes each text alone."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device="cpu")
    ids = [model.tokenize([t])["input_ids"][0].tolist() for t in texts]
    vecs = torch.stack([torch.as_tensor(model.encode(t, convert_to_numpy=True)) for t in texts])
    return ids, vecs.float()


def hf_pooled(path: Path, ids: list[list[int]], method: str) -> torch.Tensor:
    """[N, H] unit vectors from transformers' final hidden states (after the final norm), pooled by `method`."""
    import transformers

    model = transformers.AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for x in ids:
            h = model(torch.tensor([x])).last_hidden_state[0]  # [T, H]
            out.append({"last": h[-1], "cls": h[0], "mean": h.mean(dim=0)}[method])
    return F.normalize(torch.stack(out), dim=-1)
