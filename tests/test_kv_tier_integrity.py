"""The KV disk tier against someone who can write into its directory, as the holder of a second API key would try it
(issue 47, finding 6): forged and copied block files, symlinks at the names the server writes and reads, a directory
every user may write, a secret others may read. A block that fails a check is refused, deleted and counted; it
never reaches the model."""

from __future__ import annotations

import hashlib
import os
import zlib

import pytest
import torch

from lmserve.cache.kv_disk import HEADER, MAGIC, SECRET, SIGNED, DiskTier
from lmserve.cache.kv_tier import namespace
from lmserve.files import create_private, private_dir, read_secret, write_private

NS = namespace({"weights": "w1", "kv_layout": "float16[2,4,2,8]@1"})
BLOCK = 64


def block(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (BLOCK,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def prefix_hash(tokens: list[int], key_name: str) -> bytes:
    """A block hash as anyone can compute it: the tokens and a key's name are all it takes (no secret)."""
    return hashlib.sha256(repr((tokens, key_name)).encode()).digest()


def tier_with(tmp_path, *hashes: bytes) -> DiskTier:
    tier = DiskTier(tmp_path, NS, BLOCK, 2**20)
    tier.submit([(x, block(i)) for i, x in enumerate(hashes)])
    tier.flush()
    return tier


def test_a_block_forged_under_a_keys_names_is_never_served(tmp_path):
    """The attacker computes team-a's block hash and writes a block there, as the old scheme named and checked it
    (name = the hash, a CRC), and as the new format lays it out but without the secret (a guessed MAC)."""
    team_a = prefix_hash([1, 2, 3], "team-a")
    tier = tier_with(tmp_path, team_a)
    tier.close()
    evil = torch.full((BLOCK,), 7, dtype=torch.uint8)
    payload = evil.numpy().tobytes()
    old_name = tier.dir / team_a.hex()[:2] / (team_a.hex() + ".kvb")  # the old scheme's name
    old_name.parent.mkdir(exist_ok=True)
    old_head = SIGNED.pack(MAGIC, 1, NS, team_a, BLOCK) + zlib.crc32(payload).to_bytes(4, "little")
    old_name.write_bytes(old_head + payload)
    real = tier._path(team_a)  # and, should the attacker learn the real name, a forged file there too
    signed = SIGNED.pack(MAGIC, 2, NS, team_a, BLOCK)
    real.write_bytes(signed + hashlib.sha256(signed + payload).digest() + payload)

    again = DiskTier(tmp_path, NS, BLOCK, 2**20)  # a restart: both files are indexed by their names
    assert again.has(team_a)
    assert again.read(team_a) is None  # the forged MAC: refused, deleted, counted
    assert again.stats.rejected == 1 and not real.exists() and not again.has(team_a)
    assert again.stats.loads == 0
    again.close()


def test_a_genuine_block_copied_to_another_keys_name_is_refused(tmp_path):
    """team-b's own, correctly signed block put under team-a's file name: its header names team-b's prefix."""
    team_a, team_b = prefix_hash([1, 2, 3], "team-a"), prefix_hash([1, 2, 3], "team-b")
    tier = tier_with(tmp_path, team_a, team_b)
    tier._path(team_a).write_bytes(tier._path(team_b).read_bytes())
    assert tier.read(team_a) is None and tier.stats.rejected == 1
    assert torch.equal(tier.read(team_b), block(1))  # team-b's own file still serves team-b
    tier.close()


def test_a_symlink_planted_where_a_block_is_read_or_written_is_not_followed(tmp_path):
    """The old writer wrote `.<name>.<pid>.tmp` with open(): a symlink planted there wrote the block through it.
    Symlinks at every such predictable name, and at a block's own name, leave their targets untouched."""
    target = tmp_path / "victim"
    target.write_bytes(b"precious")
    team_a = prefix_hash([4, 5], "team-a")
    tier = DiskTier(tmp_path / "kv", NS, BLOCK, 2**20)
    final = tier._path(team_a)
    final.parent.mkdir(exist_ok=True)
    for pid in range(max(os.getpid() - 50, 1), os.getpid() + 50):
        os.symlink(target, final.with_name(f".{final.name}.{pid}.tmp"))
    tier.submit([(team_a, block(1))])
    tier.flush()
    assert target.read_bytes() == b"precious" and tier.stats.stores == 1 and not final.is_symlink()
    assert torch.equal(tier.read(team_a), block(1))

    final.unlink()
    os.symlink(target, final)  # a link at the block's name: refused on read (O_NOFOLLOW), the link deleted
    assert tier.read(team_a) is None and tier.stats.rejected == 1
    assert target.read_bytes() == b"precious" and not os.path.lexists(final)
    tier.close()


def test_private_files_are_never_written_through_a_planted_link(tmp_path):
    target = tmp_path / "victim"
    target.write_bytes(b"precious")
    os.symlink(target, tmp_path / "link")
    with pytest.raises(OSError):
        create_private(tmp_path / "link")
    write_private(tmp_path / "link", b"new")  # replaces the link itself, through a temporary name of its own
    assert target.read_bytes() == b"precious" and (tmp_path / "link").read_bytes() == b"new"
    assert oct((tmp_path / "link").stat().st_mode & 0o777) == oct(0o600)


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o757])
def test_a_directory_every_user_may_write_is_refused(tmp_path, mode):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    with pytest.raises(PermissionError, match="writable by every user"):
        DiskTier(shared, NS, BLOCK, 2**20)
    assert not list(shared.iterdir())  # refused before anything was written there


def test_an_existing_directory_of_ours_is_tightened_and_new_ones_are_private(tmp_path):
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    loose.chmod(0o755)
    private_dir(loose, own=True)
    assert oct(loose.stat().st_mode & 0o777) == oct(0o700)
    deep = private_dir(tmp_path / "a" / "b" / "c")
    assert all(oct(p.stat().st_mode & 0o777) == oct(0o700) for p in (deep, deep.parent, deep.parent.parent))


def test_the_secret_is_private_made_once_and_refused_when_others_may_read_it(tmp_path):
    first = read_secret(tmp_path / SECRET)
    assert len(first) == 32 and read_secret(tmp_path / SECRET) == first
    assert oct((tmp_path / SECRET).stat().st_mode & 0o777) == oct(0o600)
    (tmp_path / SECRET).chmod(0o644)
    with pytest.raises(PermissionError, match="read by other users"):
        DiskTier(tmp_path, NS, BLOCK, 2**20)
    (tmp_path / SECRET).chmod(0o600)
    other = tmp_path / "other"
    a, b = tier_with(tmp_path, b"\1" * 32), tier_with(other, b"\1" * 32)  # two installs: two secrets
    assert a.name_of(b"\1" * 32) != b.name_of(b"\1" * 32)
    b._path(b"\1" * 32).write_bytes(a._path(b"\1" * 32).read_bytes())  # a's genuine file into b's directory
    assert b.read(b"\1" * 32) is None and b.stats.rejected == 1
    a.close()
    b.close()


def test_the_mac_covers_every_header_field_and_the_payload(tmp_path):
    h = prefix_hash([9], "team-a")
    tier = tier_with(tmp_path, h)
    raw = tier._path(h).read_bytes()
    for i in range(SIGNED.size, HEADER.size):  # every MAC byte
        bad = bytearray(raw)
        bad[i] ^= 0x80
        tier._path(h).write_bytes(bytes(bad))
        tier._add(tier.name_of(h))  # indexed again: each try reads the file
        assert tier.read(h) is None
    assert tier.stats.rejected == HEADER.size - SIGNED.size
    tier.close()
