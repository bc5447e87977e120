"""KV cache tensors whose memory is committed as it is used.

On CPU `torch.zeros` of the whole pool writes every page at start: a pool sized at 15% of free memory
cost that much RSS before the first request. An anonymous private mmap is zero-filled by the kernel
page by page on first write instead, so a pool costs what its written blocks cost (the block pool
hands out recently freed blocks first to keep that set small). Pages never written read 0.0, exactly
as `torch.zeros` did, so masked or padded slots still never put NaN into attention.
"""

from __future__ import annotations

import mmap

import torch


def kv_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor for a KV cache: lazily committed pages on CPU, `torch.zeros` elsewhere."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = 1
    for n in shape:
        numel *= n
    nbytes = max(numel * dtype.itemsize, 1)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        # with THP on "always", one written block would commit a 2 MiB huge page around it
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    # frombuffer keeps `buf` alive as long as the tensor: the mapping is unmapped with its last view
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)
