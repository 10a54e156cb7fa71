"""A RAM tier whose tmpfs is full of bytes its accounting does not know of (another process's
files in a shared /dev/shm, a grantee's): write buffers spill to NVMe instead of failing, a
promotion into RAM is TierFull (never a SIGBUS), and a granted object file freed by the daemon
holds no bytes whatever names or descriptors others kept. Needs root (mounts a small tmpfs)."""
from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path

import pytest

from kvfs.errors import TierFull
from kvfs.store import ownerlinks, ramroom
from kvfs.store.ram import RamTier
from support.store import info, nvme_tier, small_tmpfs

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs (root)")
MiB = 1 << 20


def fill(where: Path) -> int:
    """Take every free byte of ``where``'s filesystem with a file of its own: its size."""
    n = 0
    with open(where / "filler", "wb") as f:
        chunk = b"\xa5" * MiB
        try:
            while True:
                n += os.write(f.fileno(), chunk)
        except OSError as e:
            assert e.errno == errno.ENOSPC
    return n


async def tiers(shm: Path, tmp: Path):
    ram = RamTier(64 * MiB, shm, uuid.uuid4().hex, mapped_min=64 << 10)
    await ram.open()
    nvme = await nvme_tier(tmp)
    ram.overflow = nvme.staging_dir
    return ram, nvme


async def test_a_full_tmpfs_spills_the_write_buffer_to_nvme(tmp_path):
    data = os.urandom(3 * MiB)
    with small_tmpfs(tmp_path / "shm") as shm:
        ram, nvme = await tiers(shm, tmp_path)
        try:
            # room when the buffer becomes a file: it does; then another process fills the tmpfs
            s = ram.new_staging()
            assert await s.write(0, data[:MiB]) == MiB
            assert not s.spilled and s.fd >= 0
            fill(shm)
            assert await s.write(MiB, data[MiB:]) == 2 * MiB    # ENOSPC (or short): spilled, whole
            assert s.spilled and s.size == 3 * MiB
            assert await s.read(0, 3 * MiB) == data
            assert ram.used == ram.staged == 0 and ram.status()["fs_spills"] == 1
            assert os.listdir(ram.staging.path) == []                # nothing left in RAM
            s.discard()
            # a new buffer on the full tmpfs goes straight to NVMe (fstatvfs: no room)
            s = ram.new_staging()
            await s.write(0, data[:100])
            assert not s.spilled                                     # in memory: no tmpfs pages
            await s.write(100, data[100:2 * MiB])
            assert s.spilled and await s.read(0, 2 * MiB) == data[:2 * MiB]
            assert ram.used == 0 and ram.status()["fs_spills"] == 2
            s.discard()
        finally:
            await ram.close()
            await nvme.close()


async def test_a_put_into_a_full_tmpfs_is_tier_full_and_leaves_nothing(tmp_path):
    data = os.urandom(2 * MiB)
    with small_tmpfs(tmp_path / "shm") as shm:
        ram, nvme = await tiers(shm, tmp_path)
        try:
            await ram.put(info(1, data), memoryview(data))
            assert bytes(ram.view(1)) == data
            fill(shm)
            # a mapping written into the full tmpfs would be a SIGBUS: this is TierFull
            with pytest.raises(TierFull):
                await ram.put(info(2, data), memoryview(data))
            assert ram.used == 2 * MiB and ram.objects == 1
            assert sorted(os.listdir(ram.dir)) == [f"{1:016x}", "staging"]
            os.unlink(shm / "filler")
            await ram.put(info(2, data), memoryview(data))
            assert bytes(ram.view(2)) == data
        finally:
            await ram.close()
            await nvme.close()


async def test_a_freed_shared_object_file_keeps_no_bytes_under_other_names(tmp_path):
    """What a grantee kept of an object file (an open descriptor, a hard link where
    fs.protected_hardlinks allows one) holds no space once the daemon frees the object."""
    data = os.urandom(4 * MiB)
    with small_tmpfs(tmp_path / "shm") as shm:
        ram, nvme = await tiers(shm, tmp_path)
        try:
            await ram.put(info(7, data), memoryview(data))
            name = f"{7:016x}"
            os.chmod(ram.dir / name, ownerlinks.SHARED_FILE_MODE)   # as a grant makes it
            ram.grants.exposed.add(7)
            kept = os.open(ram.dir / name, os.O_RDONLY)
            os.link(ram.dir / name, shm / "kept")
            try:
                before = ramroom.fs_free(ram.home.fd)
                await ram.delete(7, b"")
                assert os.fstat(kept).st_blocks == 0 and (shm / "kept").stat().st_blocks == 0
                assert ramroom.fs_free(ram.home.fd) >= before + 4 * MiB
                assert ram.grants.scrubbed == 1
            finally:
                os.close(kept)
            # an object never shared is not touched (no extra work per delete)
            await ram.put(info(8, data), memoryview(data))
            await ram.delete(8, b"")
            assert ram.grants.scrubbed == 1
        finally:
            await ram.close()
            await nvme.close()


async def test_a_buffer_filled_from_a_sealed_version_spills_on_a_full_tmpfs(tmp_path):
    """Opening a sealed file for writing copies its bytes into a new buffer: on a full tmpfs
    that copy goes to NVMe too."""
    data = os.urandom(3 * MiB)
    with small_tmpfs(tmp_path / "shm") as shm:
        ram, nvme = await tiers(shm, tmp_path)
        try:
            s = ram.new_staging()
            await s.truncate(MiB)               # a tmpfs file (sparse): made while there is room
            fill(shm)
            s.discard()
            s = ram.new_staging()
            await s.fill_from(memoryview(data))
            assert s.spilled and await s.read(0, len(data)) == data
            assert ram.used == 0
            s.discard()
        finally:
            await ram.close()
            await nvme.close()
