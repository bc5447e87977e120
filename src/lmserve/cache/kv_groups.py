"""KV cache groups: which layers share a block table, and how many blocks a window group still needs.

A model whose layers all attend to the whole context has one group: a block is `block_size` token slots in every
layer. With sliding-window layers (Gemma 2/3's local layers, Mistral, gpt-oss) the layers are split by window into
groups of equal size, as vLLM's hybrid KV cache manager does: every group allocates from the one block pool, a
block is `block_size` slots in `group_size` layers (one page in each of the runner's `group_size` KV tensors, which
the groups share), and each group has its own block table per request. A window group keeps only the blocks its
window can still reach, so a long request's KV for those layers is bounded by the window while its full-attention
layers keep every block. One pool means no split of the memory between kinds to guess: a token costs one slot per
full group and, once past the window, nothing more per window group.

Gemma 3's real pattern (5 local : 1 global) with 18 layers gives 6 groups of 3 layers: one full, five windowed;
Gemma 2 (1 : 1) two groups; Llama one.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd
from typing import Sequence

from lmserve.cache.sizing import blocks_for


@dataclass(frozen=True)
class KVGroup:
    """Layers that share one block table; `window` as Hugging Face counts it (None: the whole context)."""

    layers: tuple[int, ...]
    window: int | None = None


def kv_groups(windows: Sequence[int | None]) -> tuple[KVGroup, ...]:
    """Groups of equal size for layers with these windows (None: full attention), full-attention groups first.

    Layers of one window are cut, in layer order, into groups of gcd(layers per window) layers, so every group's
    block has the same bytes and one pool serves them all.
    """
    if not windows:
        return (KVGroup(()),)
    kinds: dict[int | None, list[int]] = {}
    for i, w in enumerate(windows):
        kinds.setdefault(w, []).append(i)
    if len(kinds) == 1:
        return (KVGroup(tuple(range(len(windows))), windows[0]),)
    size = 0
    for layers in kinds.values():
        size = gcd(size, len(layers))
    order = sorted(kinds, key=lambda w: (w is not None, w or 0))  # full first: group 0 is the full-attention one
    return tuple(KVGroup(tuple(kinds[w][i:i + size]), w) for w in order for i in range(0, len(kinds[w]), size))


def engine_groups(windows: Sequence[int | None], max_model_len: int, hybrid: bool = True) -> tuple[KVGroup, ...]:
    """The groups an engine builds for layers with these windows: a window the context never passes is no window
    for the cache; `hybrid=False` (--disable-hybrid-kv-cache-manager) keeps every layer's every block in one group."""
    return kv_groups([w if hybrid and w is not None and w < max_model_len else None for w in windows])


def first_needed_block(num_computed: int, window: int | None, block_size: int) -> int:
    """The first block a window group still needs once `num_computed` tokens are computed: the next query (at
    position num_computed) sees keys > num_computed - window, and later queries see no earlier ones."""
    if window is None:
        return 0
    return max(0, num_computed - window + 1) // block_size


def peak_blocks(groups: Sequence[KVGroup], num_tokens: int, block_size: int, max_step_tokens: int | None) -> int:
    """The most blocks one request of `num_tokens` tokens holds at once, over every group.

    A window group holds its window's blocks plus those of the tokens one step adds (a prefill chunk, a decode and
    its drafts: at most `max_step_tokens`; None: no bound), plus one block the window may start inside.
    """
    full = blocks_for(num_tokens, block_size)
    total = 0
    for g in groups:
        if g.window is None or max_step_tokens is None:
            total += full
        else:
            total += min(full, blocks_for(g.window - 1 + max_step_tokens, block_size) + 1)
    return total
