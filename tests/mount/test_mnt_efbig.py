"""Issue 40, item 4: a write past the largest tier. ``dd`` of 100 MiB onto a 64 MiB NVMe tier got
EFBIG at 64 MiB, but close returned 0 and sealed the 64 MiB prefix (a short file with a valid
checksum), evicting every other file to make room for it. Now the failed piece marks the
version failed: close answers EFBIG, a new file is removed, an existing one keeps its last
sealed version, and nothing is evicted for it."""
from __future__ import annotations

import errno
import os

import pytest

from support.files import MiB, content, read

pytestmark = pytest.mark.mount


def write_big(path, total: int, flags: int = os.O_CREAT | os.O_WRONLY | os.O_TRUNC) -> tuple[int, int | None, int | None]:
    """Write ``total`` bytes in 1 MiB pieces as dd does: (bytes written, errno of the write that
    failed, errno of close)."""
    fd = os.open(path, flags, 0o644)
    done, werr, cerr = 0, None, None
    piece = content("big", MiB)
    try:
        while done < total:
            try:
                done += os.write(fd, piece)
            except OSError as e:
                werr = e.errno
                break
    finally:
        try:
            os.close(fd)
        except OSError as e:
            cerr = e.errno
    return done, werr, cerr


def evictions(m) -> int:
    return sum(t.get("evictions", 0) for t in m.stats()["tiers"].values())


def test_a_write_past_the_largest_tier_evicts_nothing_and_leaves_no_short_file(kvfs_mount):
    m = kvfs_mount(ram="16MiB", nvme_size="64MiB")
    d = m.path / "ns"
    d.mkdir()
    for i in range(20):
        (d / f"f{i}").write_bytes(content(f"f{i}", 2 * MiB))
    before = evictions(m)
    done, werr, cerr = write_big(d / "new", 100 * MiB)
    assert werr == errno.EFBIG and done <= 64 * MiB
    assert cerr == errno.EFBIG                  # close reports it: the file is not complete
    assert not (d / "new").exists()             # a new file never sealed is removed
    assert evictions(m) == before               # nothing was evicted for it
    for i in range(20):
        assert read(d / f"f{i}") == content(f"f{i}", 2 * MiB), i
    # over an existing file: it keeps its last sealed version
    (d / "old").write_bytes(content("old", 3 * MiB))
    done, werr, cerr = write_big(d / "old", 100 * MiB)
    assert werr == errno.EFBIG and cerr == errno.EFBIG
    assert read(d / "old") == content("old", 3 * MiB)
    assert evictions(m) == before
    # a truncate past every tier: EFBIG, before anything moves
    with pytest.raises(OSError) as e:
        os.truncate(d / "old", 100 * MiB)
    assert e.value.errno == errno.EFBIG
    assert read(d / "old") == content("old", 3 * MiB)
    m.umount()


def test_a_commit_entry_past_the_largest_tier_is_refused_before_anything_moves(kvfs_mount):
    import mmap
    from kvfs.kv.commit import CommitClient
    m = kvfs_mount(ram="16MiB", nvme_size="64MiB")
    d = m.path / "ns"
    d.mkdir()
    for i in range(5):
        (d / f"f{i}").write_bytes(content(f"f{i}", 2 * MiB))
    before = evictions(m)
    big = mmap.mmap(-1, 100 * MiB)              # its size is known up front: refused at once
    c = CommitClient(str(m.path))
    try:
        try:
            got = c.commit("ns", [("big", [big])])
        except OSError as e:                    # the request as a whole
            got = [e.errno]
    finally:
        c.close()
        big.close()
    assert got == [errno.EFBIG]
    assert not (d / "big").exists()
    assert evictions(m) == before
    for i in range(5):
        assert read(d / f"f{i}") == content(f"f{i}", 2 * MiB)
