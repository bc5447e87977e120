"""Block pool and KV cache manager: exact block ids, reference counts, prefix hits, eviction order."""

from lmserve.cache.block_pool import BlockPool
from lmserve.cache.kv_cache_manager import KVCacheManager


def test_pool_hands_out_blocks_in_order_and_takes_them_back():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert [b.block_id for b in a] == [0, 1, 2]
    assert pool.num_free_blocks == 1
    pool.free(list(reversed(a)))
    assert pool.num_free_blocks == 4
    # freed blocks (no hash) come back last-in first-out, before block 3, whose pages were never touched
    assert [b.block_id for b in pool.allocate(4)] == [0, 1, 2, 3]


def test_freed_blocks_are_reused_before_untouched_ones():
    pool = BlockPool(100)
    for _ in range(50):  # one stream at a time: the same few blocks serve every request
        blocks = pool.allocate(3)
        pool.free(list(reversed(blocks)))
    assert pool.num_touched_blocks == 3 and pool.num_free_blocks == 100
    a = pool.allocate(2)
    b = pool.allocate(2)  # one recycled block left, then the first never-used block
    assert [x.block_id for x in a + b] == [0, 1, 2, 3] and pool.num_touched_blocks == 4
    pool.free([b[0]])
    pool.free([a[1]])
    assert [x.block_id for x in pool.allocate(3)] == [1, 2, 4]  # last freed first, then untouched


def test_cached_blocks_are_kept_until_no_other_block_is_free_then_evicted_oldest_first():
    pool = BlockPool(10)
    a, b = pool.allocate(2), pool.allocate(2)  # 0 1 | 2 3
    for blk, h in zip(a + b, (b"a0", b"a1", b"b0", b"b1")):
        pool.cache(blk, h)
    pool.free(list(reversed(a)))  # a's tail (1) before its prefix (0)
    pool.free(list(reversed(b)))
    assert [x.block_id for x in pool.allocate(6)] == [4, 5, 6, 7, 8, 9]  # never-used blocks before any prefix
    assert all(pool.lookup(h) is not None for h in (b"a0", b"a1", b"b0", b"b1"))
    plain = pool.allocate(1)[0]  # nothing else is free: the least recently freed cached block goes
    assert plain.block_id == 1 and pool.lookup(b"a1") is None and pool.lookup(b"a0") is not None
    pool.touch([pool.lookup(b"b0")])  # a prefix hit pulls block 2 out of the free lists
    assert [x.block_id for x in pool.allocate(2)] == [0, 3]
    assert pool.num_touched_blocks == 10 and pool.num_free_blocks == 0


def test_cached_blocks_beyond_the_retention_budget_go_before_never_used_ones():
    pool = BlockPool(100, retain=3)
    blocks = pool.allocate(5)
    for i, blk in enumerate(blocks):
        pool.cache(blk, b"p%d" % i)
    pool.free(blocks)  # 0 freed first: the oldest
    assert [x.block_id for x in pool.allocate(2)] == [0, 1]  # 5 then 4 kept > 3: the oldest evicted
    assert [x.block_id for x in pool.allocate(1)] == [5]  # 3 kept = the budget: a never-used block
    assert pool.lookup(b"p0") is None and all(pool.lookup(b"p%d" % i) is not None for i in (2, 3, 4))
    assert pool.num_touched_blocks == 6


def test_reset_prefix_cache_turns_cached_free_blocks_into_plain_ones():
    pool = BlockPool(4)
    (blk,) = pool.allocate(1)
    pool.cache(blk, b"x")
    pool.free([blk])
    pool.reset_prefix_cache()
    assert pool.lookup(b"x") is None and pool.num_free_blocks == 4
    assert [x.block_id for x in pool.allocate(2)] == [0, 1]


def test_double_free_is_an_error():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.free([b])
    try:
        pool.free([b])
    except RuntimeError as e:
        assert "freed more often" in str(e)
    else:
        raise AssertionError("double free went unnoticed")


def test_allocate_grows_block_table_and_fails_cleanly():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    tokens = list(range(10))
    assert kv.allocate("a", tokens, 0, 10)
    assert kv.block_ids("a") == [0, 1, 2]
    assert kv.allocate("a", tokens + [10, 11], 10, 2)  # still fits in block 2
    assert kv.block_ids("a") == [0, 1, 2]
    assert not kv.allocate("b", list(range(8)), 0, 8)  # needs 2, only 1 free: no change
    assert kv.block_ids("b") == [] and kv.num_free_blocks == 1
    kv.free("a")
    assert kv.num_free_blocks == 4


def test_prefix_hit_shares_full_blocks_and_refcounts():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    assert kv.allocate("a", prompt, 0, 10)
    assert kv.block_ids("a") == [0, 1, 2]
    hit = kv.find_computed("b", prompt)
    assert [b.block_id for b in hit.blocks] == [0, 1] and hit.num_tokens == 8
    assert kv.allocate("b", prompt, hit.num_tokens, 2, hit)
    assert kv.block_ids("b") == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 8


def test_whole_prompt_hit_still_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(8))  # exactly 2 blocks
    kv.allocate("a", prompt, 0, 8)
    hit = kv.find_computed("b", prompt)
    assert hit.num_tokens == 4  # the last block is recomputed so the step has logits to sample
    kv.free("a")


def test_freed_cached_blocks_are_reused_by_hash_until_evicted():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    prompt = list(range(9))
    kv.allocate("a", prompt, 0, 9)  # blocks 0, 1 full and cached, 2 partial
    kv.free("a")
    assert kv.num_free_blocks == 4
    hit = kv.find_computed("b", prompt)
    assert [b.block_id for b in hit.blocks] == [0, 1]
    assert kv.allocate("b", prompt, 4 * 2, 1, hit)
    assert kv.num_free_blocks == 1
    kv.free("b")
    # Fill the pool with other tokens: cached blocks get evicted and their hashes forgotten.
    kv.allocate("c", list(range(50, 66)), 0, 16)
    assert kv.find_computed("d", prompt).num_tokens == 0
    kv.free("c")
    assert kv.num_free_blocks == 4


def test_cache_salt_separates_prefixes():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(9))
    kv.allocate("a", prompt, 0, 9, extra=b"adapter-1")
    assert kv.find_computed("b", prompt, b"adapter-2").num_tokens == 0
    assert kv.find_computed("c", prompt, b"adapter-1").num_tokens == 8
    kv.free("a")
