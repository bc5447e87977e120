"""The KV tier's stores on their own: the host LRU, the disk format and its checks, the block copies."""

from __future__ import annotations

import os
import time

import pytest
import torch

from lmserve.cache.kv_disk import HEADER, SECRET, DiskTier
from lmserve.cache.kv_tier import HostTier, KVTier, namespace
from lmserve.units import parse_bytes
from lmserve.worker.kv_transfer import BlockCopier

NS = namespace({"weights": "w1", "kv_layout": "float16[2,4,2,8]@1"})
BLOCK = 64


def block(seed: int, n: int = BLOCK) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def h(i: int) -> bytes:
    return bytes([i]) * 32


def written(tier: DiskTier, *ids: int) -> DiskTier:
    tier.submit([(h(i), block(i)) for i in ids])
    tier.flush()
    return tier


def test_host_tier_is_an_lru_bounded_in_bytes():
    host = HostTier(3 * BLOCK)
    for i in range(3):
        assert host.put(h(i), block(i))
    assert host.get(h(0)) is not None  # 0 is now the most recently used: 1 goes first
    assert host.put(h(3), block(3))
    assert [host.has(h(i)) for i in range(4)] == [True, False, True, True]
    assert host.used_bytes == 3 * BLOCK and len(host) == 3
    assert host.put(h(2), block(2))  # a block put again is refreshed, not counted twice
    assert host.used_bytes == 3 * BLOCK
    host.put(h(4), block(4))
    assert not host.has(h(0)) and host.has(h(2))  # 0 was least recent after 2's refresh
    assert not host.put(h(5), block(5, 4 * BLOCK))  # bigger than the whole budget: refused, nothing evicted
    assert len(host) == 3


def test_disk_round_trip_keeps_every_byte_and_the_file_names_what_it_holds(tmp_path):
    tier = written(DiskTier(tmp_path, NS, BLOCK, 2**20), 1, 2)
    assert tier.has(h(1)) and tier.has(h(2)) and not tier.has(h(3))
    assert torch.equal(tier.read(h(1)), block(1)) and torch.equal(tier.read(h(2)), block(2))
    path = tier._path(h(1))
    # named by a keyed digest: nobody without the install's secret can tell which file a prefix would be read from
    assert path.parent.parent == tmp_path / NS.hex()[:16] and path.name == tier.name_of(h(1)).hex() + ".kvb"
    assert h(1).hex() not in path.name
    magic, version, ns, stored, length, _ = HEADER.unpack(path.read_bytes()[:HEADER.size])
    assert (magic, ns, stored, length) == (b"LMSKVBLK", NS, h(1), BLOCK)
    assert oct(tier.dir.stat().st_mode & 0o777) == oct(0o700)
    assert oct(path.parent.stat().st_mode & 0o777) == oct(0o700) and oct(path.stat().st_mode & 0o777) == oct(0o600)
    assert oct((tmp_path / SECRET).stat().st_mode & 0o777) == oct(0o600)
    assert tier.stats.stores == 2 and tier.stats.loads == 2 and tier.stats.files == 2
    assert tier.stats.used_bytes == 2 * (HEADER.size + BLOCK)
    assert not list(tier.dir.rglob("*.tmp"))
    tier.close()


@pytest.mark.parametrize("damage", ["flip a payload byte", "truncate", "append", "other namespace", "other block",
                                    "zero length"])
def test_a_bad_file_is_refused_deleted_and_never_served(tmp_path, damage):
    tier = written(DiskTier(tmp_path, NS, BLOCK, 2**20), 1, 2)
    path = tier._path(h(1))
    raw = bytearray(path.read_bytes())
    if damage == "flip a payload byte":
        raw[HEADER.size + 10] ^= 0x01
    elif damage == "truncate":
        raw = raw[:-1]
    elif damage == "append":
        raw += b"\0"
    elif damage == "other namespace":  # another model's block (same tokens) copied under this model's name
        foreign = written(DiskTier(tmp_path / "other", namespace({"weights": "w2"}), BLOCK, 2**20), 1)
        raw = bytearray(foreign._path(h(1)).read_bytes())
        foreign.close()
    elif damage == "other block":  # block 2's file renamed to block 1's name
        raw = bytearray(tier._path(h(2)).read_bytes())
    else:
        raw = bytearray()
    path.write_bytes(bytes(raw))
    assert tier.has(h(1))
    assert tier.read(h(1)) is None
    assert not path.exists() and not tier.has(h(1)) and tier.stats.rejected == 1
    assert torch.equal(tier.read(h(2)), block(2))  # the other file is untouched
    assert tier.stats.files == 1 and tier.stats.used_bytes == HEADER.size + BLOCK
    tier.close()


def test_a_restart_finds_the_files_and_keeps_their_use_order(tmp_path):
    first = written(DiskTier(tmp_path, NS, BLOCK, 2**20), 1, 2, 3)
    first.close()
    past = time.time() - 100
    for i, age in ((1, 3), (2, 1), (3, 2)):  # last used: 2, then 3, then 1
        os.utime(first._path(h(i)), (past - age, past - age))
    stale = first._path(h(2)).with_name(".crashed.tmp")
    stale.parent.mkdir(exist_ok=True)
    stale.write_bytes(b"half a block")
    os.utime(stale, (past - 1000, past - 1000))
    live = first._path(h(2)).with_name(".writing.tmp")  # another process's write in flight: left alone
    live.write_bytes(b"x")
    file_bytes = HEADER.size + BLOCK
    again = DiskTier(tmp_path, NS, BLOCK, 2 * file_bytes)  # room for two: the least recently used (1) goes
    assert [again.has(h(i)) for i in (1, 2, 3)] == [False, True, True]
    assert not first._path(h(1)).exists() and again.stats.evicted == 1
    assert not stale.exists() and live.exists()
    assert again.read(h(3)) is not None  # a read makes 3 the most recent: 2 goes next
    written(again, 4)
    assert [again.has(h(i)) for i in (2, 3, 4)] == [False, True, True]
    assert again.stats.used_bytes == 2 * file_bytes
    again.close()


def test_the_write_queue_is_bounded_and_never_waits(tmp_path):
    tier = DiskTier(tmp_path, NS, BLOCK, 2**20, queue_bytes=BLOCK - 1)  # not even one block fits
    tier.submit([(h(i), block(i)) for i in range(5)])
    tier.flush()
    assert tier.stats.dropped == 5 and tier.stats.stores == 0 and not tier.has(h(0))
    tier.close()
    ok = DiskTier(tmp_path, NS, BLOCK, 2**20)
    ok.submit([(h(1), block(1)), (h(1), block(1))])  # queued once
    ok.flush()
    assert ok.stats.stores == 1 and not ok.wants(h(1)) and ok.wants(h(2))
    ok.close()


def test_staging_refuses_the_whole_hit_when_one_file_is_bad(tmp_path):
    disk = written(DiskTier(tmp_path, NS, BLOCK, 2**20), 1, 2)
    tier = KVTier(BLOCK, 16, host_bytes=4 * BLOCK, disk=disk)
    tier.save([(h(3), block(3))])
    assert all(tier.contains(h(i)) for i in (1, 2, 3)) and not tier.contains(h(4))
    disk._path(h(2)).write_bytes(b"garbage")
    assert not tier.stage([h(3), h(1), h(2)])
    assert not tier.contains(h(2)) and tier._staged == {}
    assert tier.stage([h(3), h(1)])
    assert torch.equal(tier.take_staged(h(1)), block(1)) and torch.equal(tier.take_staged(h(3)), block(3))
    assert tier.stats("disk")["loads"] == 1 and tier.stats("host")["loads"] == 1
    assert tier.stats("host")["hit_tokens"] == 16 and tier.stats("host")["stores"] == 1
    assert not tier.wants_save(h(3)) and tier.wants_save(h(4))  # held already: only its LRU place moves
    assert not tier.wants_persist(h(1)) and tier.wants_persist(h(4))
    tier.close()


def test_the_namespace_changes_with_every_identity_field():
    base = {"weights": "w", "tokenizer": "t", "kv_layout": "l", "block_size": "16", "dtype": "float32"}
    seen = {namespace(base)}
    for k in base:
        seen.add(namespace(base | {k: base[k] + "x"}))
    assert len(seen) == len(base) + 1


def test_block_copies_move_raw_bytes_of_every_tensor_of_a_block():
    """Any element types and block dimensions (a quantized cache's int8 data and its per-block scales included)."""
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 6, 4, 2, 8, generator=g).to(torch.float16)  # [2, blocks, block_size, heads, dim]
    codes = torch.randint(-128, 128, (2, 6, 4, 2, 8), dtype=torch.int8, generator=g)
    scales = torch.randn(6, 2, 3, generator=g)  # [blocks, heads, 3]: block index first
    kv[0, 3, 0, 0, 0] = float("nan")  # bytes, not values: a NaN round-trips too
    copier = BlockCopier([(kv, 1), (codes, 1), (scales, 0)])
    assert copier.block_bytes == 2 * 4 * 2 * 8 * (2 + 1) + 2 * 3 * 4
    assert copier.layout() == "float16[2, 4, 2, 8]@1;int8[2, 4, 2, 8]@1;float32[2, 3]@0"
    data = copier.gather([3, 1])
    assert data.shape == (2, copier.block_bytes) and data.dtype == torch.uint8
    before = [t.clone() for t in (kv, codes, scales)]
    copier.scatter([5, 0], data)
    for t, old, d in zip((kv, codes, scales), before, (1, 1, 0)):
        assert torch.equal(t.select(d, 5).view(torch.uint8), old.select(d, 3).view(torch.uint8))
        assert torch.equal(t.select(d, 0).view(torch.uint8), old.select(d, 1).view(torch.uint8))
        for untouched in (1, 2, 3, 4):
            assert torch.equal(t.select(d, untouched).view(torch.uint8), old.select(d, untouched).view(torch.uint8))


def test_sizes_parse_as_people_write_them():
    assert parse_bytes("2GiB") == 2 * 2**30 and parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("10GB") == 10**10 and parse_bytes("1.5g") == 1_500_000_000 and parse_bytes("4096") == 4096
    for bad in ("", "GiB", "2XB", "-1G", "nan", "inf"):
        with pytest.raises(ValueError, match="not a size"):
            parse_bytes(bad)


def test_close_writes_what_is_queued_once_and_later_blocks_are_ignored(tmp_path):
    tier = DiskTier(tmp_path, NS, BLOCK, 2**20)
    tier.submit([(h(i), block(i)) for i in range(3)])
    tier.close()
    assert tier.stats.stores == 3 and all(tier.has(h(i)) for i in range(3))
    tier.close()  # a second close, and a flush after it, return at once
    tier.flush()
    tier.submit([(h(9), block(9))])
    assert not tier.has(h(9)) and tier.stats.dropped == 0


def test_the_offline_api_takes_the_tier_flags_as_keywords(tmp_path):
    from lmserve.engine.llm import _engine_config

    cfg = _engine_config(None, {"kv_offload_memory": "2GiB", "kv_offload_dir": str(tmp_path),
                                "kv_offload_disk_size": 10**9}).kv_offload
    assert (cfg.memory_bytes, cfg.directory, cfg.disk_bytes) == (2 * 2**30, str(tmp_path), 10**9)
