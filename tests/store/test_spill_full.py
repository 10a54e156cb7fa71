"""A write buffer spilled to a directory without room for it is an error, never a short file
(sealing one would map bytes the file lacks: SIGBUS); a RAM object file that was shared has
its bytes punched out in a worker thread, not on the trio thread. Needs root (mounts a
small tmpfs)."""
from __future__ import annotations

import os
import uuid

import pytest
import trio
import trio.testing

from kvfs.store import ownerlinks
from kvfs.store.nvme import NvmeTier
from kvfs.store.ram import RamTier
from support.store import info, nvme_tier, small_tmpfs

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs (root)")
MiB = 1 << 20


@pytest.mark.parametrize("mapped_min", [8 * MiB, 64 << 10], ids=["in-memory", "tmpfs-file"])
async def test_a_spill_to_a_full_directory_is_enospc_never_a_short_file(tmp_path, mapped_min):
    data = os.urandom(3 * MiB)
    ram = RamTier(64 * MiB, "/dev/shm", uuid.uuid4().hex, mapped_min=mapped_min)
    await ram.open()
    with small_tmpfs(tmp_path / "nvme", "2m") as where:
        nvme = NvmeTier(64 * MiB, where)
        await nvme.open()
        try:
            s = ram.new_staging()
            await s.write(0, data)
            assert (s.mem is not None) == (mapped_min > len(data))
            with pytest.raises(OSError) as e:
                await s.spill(nvme.staging_dir)
            assert e.value.errno == 28                   # ENOSPC
            assert not s.spilled and os.listdir(nvme.staging_dir.path) == []
            assert await s.read(0, len(data)) == data    # the buffer stays where it was
            s.discard()
        finally:
            await nvme.close()
            await ram.close()


async def test_a_shared_ram_object_file_is_punched_in_a_worker_thread(tmp_path):
    """RamTier.delete unlinks the name at once and punches the bytes in a worker thread: with
    the thread limiter held, the delete waits and the bytes are still there."""
    data = os.urandom(4 * MiB)
    with small_tmpfs(tmp_path / "shm") as shm:
        ram = RamTier(64 * MiB, shm, uuid.uuid4().hex, mapped_min=64 << 10)
        await ram.open()
        nvme = await nvme_tier(tmp_path)
        try:
            await ram.put(info(7, data), memoryview(data))
            name = f"{7:016x}"
            os.chmod(ram.dir / name, ownerlinks.SHARED_FILE_MODE)
            ram.grants.exposed.add(7)
            kept = os.open(ram.dir / name, os.O_RDONLY)
            limiter = trio.to_thread.current_default_thread_limiter()
            limiter.total_tokens = 1
            try:
                async with trio.open_nursery() as nursery:
                    await limiter.acquire()
                    nursery.start_soon(ram.delete, 7, b"")
                    await trio.testing.wait_all_tasks_blocked()
                    assert not (ram.dir / name).exists()            # the name: at once
                    assert os.fstat(kept).st_blocks > 0             # the punch: waits for a thread
                    limiter.release()
                assert os.fstat(kept).st_blocks == 0 and ram.grants.scrubbed == 1
            finally:
                os.close(kept)
        finally:
            await ram.close()
            await nvme.close()
