"""Versions against the kernel's per-inode page cache, on a real mount.

Issue 2 section 2: "readers that opened the old version keep reading it"; "a replaced name
must not serve stale bytes". kvfs/fs/ops.py tracks which version the cached pages hold and
gives direct_io to a handle opened while another version is open. A reader of a sealed,
non-empty version holds its inode (through FUSE passthrough, its one backing file; without,
its page cache): a rewrite by the name renews the name (a new inode with the same version,
kvfs/fs/opens.py ``Opens.changeable``) and goes on there, and the reader keeps the old inode
and its version, passthrough or not (stop 38: a ``MAP_PRIVATE`` mapping of the new version,
``direct_io`` beside an older cached reader on one inode, filled the shared page cache with
new bytes that the older reader then read).
"""
from __future__ import annotations

import os

import pytest

from support.files import MiB, content, put, read
from support.mount import open_mount
from support.mount import d  # noqa: F401 - shared fixture

pytestmark = pytest.mark.mount


@pytest.fixture(scope="module", params=["passthrough", "no-passthrough"])
def mnt(tmp_path_factory, request):
    extra = ("--passthrough",) if request.param == "passthrough" else ("--no-passthrough",)
    m = open_mount(tmp_path_factory.mktemp("kvfs-mod") / "kvfs", *extra)
    yield m
    m.cleanup()


def passthrough_opens(m) -> int:
    return ((m.stats().get("transport") or {}).get("passthrough") or {}).get("opens", 0)


def open_reader(mnt, p) -> tuple[int, bool]:
    """A read-only descriptor of ``p`` and whether the kernel serves it by passthrough."""
    before = passthrough_opens(mnt)
    r = os.open(p, os.O_RDONLY)
    return r, passthrough_opens(mnt) > before


def renewed(p, ino: int) -> None:
    """A rewrite of a file a reader of its sealed version held gave its name a new inode."""
    assert os.stat(p).st_ino != ino


@pytest.mark.parametrize("how", ["rewrite", "trunc"])
def test_old_reader_keeps_old_version(mnt, d, how):
    size = 3 * MiB
    v1, v2 = content("v1", size), content("v2", size)
    put(d / "f", v1)
    r, _ = open_reader(mnt, d / "f")
    try:
        assert os.pread(r, 4096, 0) == v1[:4096]          # the page cache holds v1 now
        flags = os.O_WRONLY | (os.O_TRUNC if how == "trunc" else 0)
        ino = os.fstat(r).st_ino
        w = os.open(d / "f", flags)
        try:
            os.pwrite(w, v2, 0)
        finally:
            os.close(w)                                   # v2 installed here
        renewed(d / "f", ino)
        old = os.pread(r, size + 1, 0)
        if old != v1:
            same_as_v2 = old == v2
            first_bad = next(i for i in range(min(len(old), size)) if old[i] != v1[i]) if len(old) else 0
            pytest.fail(f"the reader that opened v1 read {len(old)} bytes that are not v1 "
                        f"(equal to v2: {same_as_v2}; first differing byte at {first_bad})")
        # a new open sees v2, even though the old reader just re-filled the page cache
        assert read(d / "f") == v2, "a new open served the old version"
    finally:
        if r >= 0:
            os.close(r)
    assert read(d / "f") == v2


def test_old_reader_during_rewrite_keeps_old_version(mnt, d):
    """The rewrite is still open (not sealed): the old reader must not see its bytes either."""
    size = 2 * MiB
    v1, v2 = content("w1", size), content("w2", size)
    put(d / "f", v1)
    r, _ = open_reader(mnt, d / "f")
    try:
        assert os.pread(r, size, 0) == v1
        ino = os.fstat(r).st_ino
        w = os.open(d / "f", os.O_WRONLY)
        try:
            os.pwrite(w, v2, 0)
            mid = os.pread(r, size, 0)
            assert mid == v1, (f"while a rewrite was open, the old reader read new bytes "
                               f"(equal to the unsealed v2: {mid == v2})")
        finally:
            os.close(w)
        assert os.pread(r, size, 0) == v1
        renewed(d / "f", ino)
    finally:
        if r >= 0:
            os.close(r)
    assert read(d / "f") == v2


def test_a_private_mapping_of_the_new_version_does_not_reach_an_older_reader(mnt, d):
    """The hole renewal closes (stop 38): a reader of v1 in the kernel's cached mode, a rewrite
    of the name to v2, then a second reader that maps v2 ``MAP_PRIVATE``. On one inode that
    reader was ``direct_io`` (another version open), but the kernel serves a private mapping
    of a ``direct_io`` descriptor from the inode's page cache, which its faults filled with v2:
    the v1 reader's next reads returned v2's bytes. With the name renewed, each version has
    its own inode and page cache."""
    import mmap
    size = MiB
    v1, v2 = content("pv1", size), content("pv2", size)
    put(d / "f", v1)
    r1, _ = open_reader(mnt, d / "f")
    try:
        assert os.pread(r1, size, 0) == v1
        w = os.open(d / "f", os.O_RDWR)
        try:
            os.pwrite(w, v2, 0)
        finally:
            os.close(w)
        r2 = os.open(d / "f", os.O_RDONLY)
        try:
            with mmap.mmap(r2, size, mmap.MAP_PRIVATE, mmap.PROT_READ) as mm:
                assert mm[:] == v2
        finally:
            os.close(r2)
        assert os.pread(r1, size, 0) == v1, "the older reader read the newer version's pages"
        with mmap.mmap(r1, size, mmap.MAP_SHARED, mmap.PROT_READ) as mm:
            assert mm[:] == v1
    finally:
        os.close(r1)
    assert read(d / "f") == v2


def test_rewrites_by_name_beside_readers_that_keep_opening_never_fail(mnt, d):
    """Each rewrite by the name of a file that readers hold renews the name once: its retry
    (the VFS's one LOOKUP_REVAL) must not find the new inode renewed again by readers that
    opened it meanwhile (the probe's ESTALE to writers and readers, stop 38): a change coming
    back to a renewed inode goes on there, and readers that opened it before read uncached."""
    import threading
    p = d / "f"
    put(p, content("r0", 300_000))
    stop, errors, reads = threading.Event(), [], [0]

    def reader():
        while not stop.is_set():
            try:
                fd = os.open(p, os.O_RDONLY)
                try:
                    # (no length check: a truncate by path has the kernel's own window where
                    # fstat says more than a read gives, docs/design.md "Versions and sizes")
                    os.pread(fd, os.fstat(fd).st_size + 1, 0)
                    reads[0] += 1
                finally:
                    os.close(fd)
            except OSError as e:
                errors.append(f"reader: {e}")

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        for i in range(60):
            data = content(f"r{i}", 200_000 + 1000 * i)
            try:
                if i % 3 == 0:
                    put(p, data)                                  # O_WRONLY | O_TRUNC
                elif i % 3 == 1:
                    os.truncate(p, len(data))
                else:
                    fd = os.open(p, os.O_RDWR)
                    try:
                        os.pwrite(fd, data, 0)
                    finally:
                        os.close(fd)
            except OSError as e:
                errors.append(f"writer {i}: {e}")
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not errors, errors[:5]
    assert reads[0] > 0
