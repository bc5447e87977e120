"""How far integer linears would move an encoder's outputs from float32: the precision half of issue 44's int16
question (the rate half is benchmarks/int16_gemm_cpu.cpp; the results are in benchmarks/results/).

    python benchmarks/encoder_int_linears.py [--bits 12,13,14,15,16] [--out benchmarks/results/encoder_int_linears.json]

Every nn.Linear of the reference model (sentence-transformers' SentenceTransformer and CrossEncoder, as the parity
tests run them; the pooler's and the classifier head's too) is replaced, for the run, by one whose input is rounded
per token and whose weight is rounded per output channel to symmetric b-bit codes (|q| <= 2^(b-1) - 1, the codes an
int16 GEMM would multiply), the products summed exactly (float64). That is what such a kernel computes up to its
float32 epilogue, per-token and per-channel scales being the finest a plain GEMM keeps. Most of the parity tests'
models (not the `last`-token and ModernBERT `cls` poolings, nor the classifiers), with their metrics, against the same
model in float32:
  all-MiniLM-L6-v2 (the real model)   the worst 1 - cosine over tests/test_encoders.py's 100 mixed sentences (row: 1e-5)
  tiny random BERT / XLM-R embedders,  the largest absolute difference of the outputs tests/test_encoders.py compares
  cross-encoders, ModernBERT, NomicBERT (row: 1e-4)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lmserve  # noqa: F401, E402, I001  (before torch, as every benchmark: lmserve's OpenMP settings)
import numpy as np  # noqa: E402
import torch  # noqa: E402

from tests.encoder_models import SENTENCES, build_encoder, build_rotary_encoder, minilm_dir  # noqa: E402
from tests.test_encoders import mixed_sentences  # noqa: E402

FLOAT_FORWARD = torch.nn.Linear.forward


def codes(t: torch.Tensor, bits: int) -> torch.Tensor:
    """t rounded to symmetric `bits`-bit codes along its last dimension (each row its own scale), as values."""
    scale = t.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30) / (2 ** (bits - 1) - 1)
    return torch.round(t / scale) * scale


def integer_linears(bits: int | None) -> None:
    """Every nn.Linear from now on: b-bit inputs (per token) and weights (per output channel), exact sums; None:
    back to float32."""
    if bits is None:
        torch.nn.Linear.forward = FLOAT_FORWARD
        return

    def forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        y = codes(x.double(), bits) @ codes(self.weight.double(), bits).t()
        return (y if self.bias is None else y + self.bias.double()).to(x.dtype)

    torch.nn.Linear.forward = forward


def cases(root: Path) -> dict:
    """name -> (metric, a function giving the model's outputs as the parity tests compare them)."""
    from sentence_transformers import CrossEncoder, SentenceTransformer

    out = {}
    minilm = SentenceTransformer(str(minilm_dir()), device="cpu")
    texts = mixed_sentences()
    out["all-MiniLM-L6-v2"] = ("1 - cos", lambda: minilm.encode(texts, batch_size=32))
    for kind, pooling, normalize in [("bert", "mean", True), ("bert", "max", False), ("xlm-roberta", "cls", True)]:
        model = SentenceTransformer(str(build_encoder(root / f"{kind}-{pooling}", kind, pooling=pooling,
                                                      normalize=normalize)), device="cpu")
        out[f"tiny {kind} ({pooling})"] = ("max abs", lambda m=model: m.encode(SENTENCES, normalize_embeddings=True))
    pairs = [(q, d) for q in SENTENCES[:2] for d in SENTENCES]
    for kind in ("bert", "xlm-roberta"):
        ce = CrossEncoder(str(build_encoder(root / f"ce-{kind}", kind, num_labels=1, pooling=None)), device="cpu")
        out[f"tiny {kind} cross-encoder"] = ("max abs", lambda c=ce: c.predict(pairs))
    for kind in ("modernbert", "nomic"):
        model = SentenceTransformer(str(build_rotary_encoder(root / kind, kind)), device="cpu", trust_remote_code=True)
        out[f"tiny {kind}"] = ("max abs", lambda m=model: m.encode(SENTENCES, normalize_embeddings=True))
    return out


def gap(metric: str, got: np.ndarray, ref: np.ndarray) -> float:
    if metric == "max abs":
        return float(np.abs(got - ref).max())
    cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
    return float((1 - cos).max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bits", default="12,13,14,15,16")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    bits = [int(b) for b in args.bits.split(",")]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (metric, run) in cases(Path(tmp)).items():
            ref = np.asarray(run(), dtype=np.float64)  # float32: each integer run below restores it
            row = {}
            for b in bits:
                integer_linears(b)
                try:
                    row[str(b)] = gap(metric, np.asarray(run(), dtype=np.float64), ref)
                finally:
                    integer_linears(None)
            results[name] = {"metric": metric, "row": 1e-5 if metric == "1 - cos" else 1e-4, "gaps": row}
    lines = ["| model | metric (parity row) | " + " | ".join(f"{b} bits" for b in bits) + " |",
             "|---|---|" + "---|" * len(bits)]
    for name, r in results.items():
        cells = [f"**{g:.1e}**" if g > r["row"] else f"{g:.1e}" for g in r["gaps"].values()]
        lines.append(f"| {name} | {r['metric']} ({r['row']:.0e}) | " + " | ".join(cells) + " |")
    print("\n".join(lines) + "\n\n(bold: past the parity row)")
    if args.out:
        args.out.write_text(json.dumps({"bits": bits, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
