"""Issue 34, defect 2, second half: the RAM tier's tmpfs full of bytes its accounting does not
know of. Writes through the mount and ``.kvfs/commit`` go to NVMe instead (whole, under their
final names), and RAM takes writes again once it has room."""
from __future__ import annotations

import errno
import mmap
import os
import subprocess
from pathlib import Path

import pytest

from kvfs.kv.commit import CommitClient
from support.files import MiB, content, read
from support.mount import wait_for

pytestmark = pytest.mark.mount


def fill(where: Path) -> int:
    """Take every free byte of ``where``'s filesystem (as another process would)."""
    n = 0
    with open(where / "filler", "wb") as f:
        chunk = b"\x5a" * (8 * MiB)
        while True:
            try:
                n += os.write(f.fileno(), chunk)
            except OSError as e:
                assert e.errno == errno.ENOSPC
                if len(chunk) == 4096:
                    return n
                chunk = chunk[:len(chunk) // 2]


def test_a_full_ram_tmpfs_spills_writes_to_nvme(kvfs_mount):
    m = kvfs_mount(ram="16MiB", nvme_size="256MiB")
    d = m.path / "ns"
    d.mkdir()
    (d / "warm").write_bytes(content("warm", 2_000_000))
    assert os.getxattr(d / "warm", "user.kvfs.tier") == b"ram"
    st = m.stats()
    tmpfs = Path(st["ram_dir"]).parent      # the daemon's own huge-page tmpfs (root), or shm_dir
    fill(tmpfs)
    ram = m.stats()["tiers"]["ram"]
    assert ram["used"] < 16 * MiB and ram["fs_free"] < MiB     # room on the books, not on the tmpfs
    try:
        # writes through the mount: whole, on NVMe, under their names
        for i in range(10):
            data = content(f"w{i}", 2_000_000)
            with open(d / f"w{i}", "wb") as f:
                f.write(data)
            assert read(d / f"w{i}") == data
            assert os.getxattr(d / f"w{i}", "user.kvfs.tier") == b"nvme"
        # written in pieces, across the point where the buffer leaves the daemon's memory
        data = content("pieces", 3 * MiB)
        with open(d / "pieces", "wb") as f:
            for k in range(0, len(data), 100_000):
                f.write(data[k:k + 100_000])
        assert read(d / "pieces") == data
        # .kvfs/commit: its copies into RAM find no room either
        pages = {f"c{i}": content(f"c{i}", MiB + 4096 * i) for i in range(6)}
        c = CommitClient(str(m.path))
        try:
            assert c.commit("ns", [(n, [p]) for n, p in pages.items()]) == [0] * len(pages)
        finally:
            c.close()
        for n, p in pages.items():
            assert read(d / n) == p
        assert m.stats()["tiers"]["ram"]["fs_spills"] > 0
        sizes = {p.name: p.stat().st_size for p in d.iterdir()}
        assert 0 not in sizes.values(), sizes          # never an empty file under a final name
    finally:
        os.unlink(tmpfs / "filler")
    # room again: writes land in RAM
    data = content("after", 2_000_000)
    (d / "after").write_bytes(data)
    assert read(d / "after") == data
    assert os.getxattr(d / "after", "user.kvfs.tier") == b"ram"
    assert read(d / "warm") == content("warm", 2_000_000)


def test_a_write_no_tier_can_hold_fails_and_leaves_no_file(kvfs_mount, tmp_path):
    """RAM's tmpfs full and the NVMe directory's filesystem too: the write fails with ENOSPC,
    close reports it, and the new file is gone (not left empty or short under its name)."""
    disk = tmp_path / "small-disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "kvfs-test-nvme", str(disk)], check=True)
    try:
        m = kvfs_mount(ram="16MiB", nvme=disk / "nvme", nvme_size="16MiB")
        d = m.path / "ns"
        d.mkdir()
        tmpfs = Path(m.stats()["ram_dir"]).parent
        fill(tmpfs)
        try:
            fill(disk)
            f = open(d / "big", "wb")
            with pytest.raises(OSError) as e:
                f.write(content("big", 4 * MiB))
                f.flush()
            assert e.value.errno == errno.ENOSPC
            with pytest.raises(OSError):
                f.close()
            assert not (d / "big").exists()
            os.unlink(disk / "filler")
            # room below again: the same write succeeds (spilled to NVMe)
            (d / "big").write_bytes(content("big", 4 * MiB))
            assert read(d / "big") == content("big", 4 * MiB)
        finally:
            os.unlink(tmpfs / "filler")
            m.cleanup()
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_the_name_table_cannot_grow_on_a_full_tmpfs_and_the_daemon_lives(kvfs_mount):
    """The name table lives in the RAM tier's tmpfs and grows by a new file: on a full tmpfs
    that is ENOSPC (the table is dropped, clients look names up) -- a mapped sparse file
    would have killed the daemon with SIGBUS at its first write to a new page."""
    m = kvfs_mount(ram="16MiB", nvme_size="256MiB")
    d = m.path / "many"
    d.mkdir()
    assert m.stats()["names"] is not None
    tmpfs = Path(m.stats()["ram_dir"]).parent
    fill(tmpfs)
    try:
        for i in range(1500):                   # past the first table's 60 % of 1,024 slots
            (d / f"n{i}").write_bytes(b"x" * (i % 7))
        assert len(os.listdir(d)) == 1500
        assert m.stats()["names"] is None       # dropped: it could not grow
        assert (d / "n1499").read_bytes() == b"x" * (1499 % 7)
        data = content("big", 3 * MiB)
        (d / "big").write_bytes(data)
        assert read(d / "big") == data
    finally:
        os.unlink(tmpfs / "filler")


def test_a_rewrite_that_cannot_be_sealed_leaves_the_old_version_whole(kvfs_mount):
    """A rewrite grows a file until no tier can hold it (EFBIG, then ENOSPC at close): the
    file keeps its sealed version, and stat, read and mmap agree on it (the kernel kept the
    failed writer's size, and reads inside it gave EOF)."""
    m = kvfs_mount(ram="8MiB", nvme_size="16MiB")
    p = m.path / "f"
    old = content("old", 2 * MiB)
    p.write_bytes(old)
    os.setxattr(p, "user.kvfs.pin", b"1")       # a cache evicts what is not pinned
    for i in range(10):                         # pinned files leave the rewrite no room
        q = m.path / f"pin{i}"
        try:
            q.write_bytes(content(f"pin{i}", 2 * MiB))
            os.setxattr(q, "user.kvfs.pin", b"1")
        except OSError:
            break
    w = os.open(p, os.O_RDWR)
    failed = None
    try:
        for k in range(40):
            os.pwrite(w, content(f"new{k}", MiB), 2 * MiB + k * MiB)
    except OSError as e:
        failed = e.errno
    assert failed in (errno.EFBIG, errno.ENOSPC)
    assert os.fstat(w).st_size > len(old)       # the writer's size, now in the kernel's attributes
    with pytest.raises(OSError):
        os.close(w)
    wait_for(lambda: m.stats()["open_handles"] == 0, 60, "the writer's release")
    assert os.stat(p).st_size == len(old)
    assert read(p) == old
    fd = os.open(p, os.O_RDONLY)
    try:
        assert os.fstat(fd).st_size == len(old)
        assert os.pread(fd, 4096, len(old) - 4096) == old[-4096:]
        with mmap.mmap(fd, len(old), prot=mmap.PROT_READ) as mm:
            assert mm[:] == old
    finally:
        os.close(fd)
