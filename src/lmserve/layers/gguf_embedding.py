"""An embedding table kept in a GGUF file's quantized blocks (`--quantization gguf`), rows dequantized on lookup.

The float path holds the table as float32 (49152 x 576 x 4 B = 108 MiB for the embedded model) beside the
LM head's quantized copy of the same tensor (tied models read one GGUF tensor for both). Only the rows a
step looks up are ever needed, so the table keeps the repacked blocks and dequantizes those rows with the
reference `dequantize`: the same float32 numbers the float path's table holds (d * q in float32).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from lmserve.layers.gguf_linear import Repacked, dequantize


class GGUFEmbedding(nn.Module):
    """input_ids [T] -> float32 [T, embedding_dim], from repacked blocks (shared with a tied LM head)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, kind: int,
                 embedding_dim: int) -> None:
        super().__init__()
        self.kind, self.embedding_dim = kind, embedding_dim
        self.num_embeddings = codes.shape[0]
        # the same tensors as a tied GGUFLinear head's buffers: one copy of the blocks for both
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)
        self.register_buffer("mins", mins)

    @classmethod
    def from_repacked(cls, w: Repacked, embedding_dim: int) -> "GGUFEmbedding":
        mins = None if w.mins is None else torch.from_numpy(np.ascontiguousarray(w.mins, dtype=np.float32))
        return cls(torch.from_numpy(np.ascontiguousarray(w.codes)),
                   torch.from_numpy(np.ascontiguousarray(w.scales, dtype=np.float32)), mins, w.kind, embedding_dim)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)
        rows = Repacked(self.kind, self.codes[ids].numpy(), self.scales[ids].numpy(),
                        None if self.mins is None else self.mins[ids].numpy())
        return dequantize(rows).view(*input_ids.shape, self.embedding_dim)
