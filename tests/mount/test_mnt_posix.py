"""POSIX details a real mount gets right (what pjdfstest checks, issue 34 item 6), and the
documented refusals: directory link counts, an unlinked open file's link count, ctime on
(f)truncate, EFBIG at the truncate itself, special files refused with EPERM (not ENOSYS), a
regular file made by mknod. The deviations kvfs keeps are in docs/design.md."""
from __future__ import annotations

import errno
import os
import socket
import stat

import pytest

from support.files import errno_of
from support.mount import open_mount

pytestmark = pytest.mark.mount


@pytest.fixture(scope="module")
def m(tmp_path_factory):
    mnt = open_mount(tmp_path_factory.mktemp("posix") / "kvfs", ram="64MiB", nvme_size="256MiB")
    yield mnt
    mnt.cleanup()


def test_directory_nlink_counts_its_subdirectories(m):
    d = m.path / "nl"
    d.mkdir()
    assert os.stat(d).st_nlink == 2
    (d / "a").mkdir()
    (d / "b").mkdir()
    (d / "f").write_bytes(b"x")                     # files do not count
    assert os.stat(d).st_nlink == 4
    assert os.stat(d / "a").st_nlink == 2
    os.rename(d / "a", m.path / "moved")            # out of d
    assert os.stat(d).st_nlink == 3
    os.rename(m.path / "moved", d / "b2")           # back in
    assert os.stat(d).st_nlink == 4
    os.rename(d / "b2", d / "b")                    # over an empty directory: one fewer
    assert os.stat(d).st_nlink == 3
    os.rmdir(d / "b")
    assert os.stat(d).st_nlink == 2
    assert os.stat(m.path).st_nlink >= 3            # the root: its subdirectories too


def test_an_unlinked_open_file_has_no_links(m):
    p = m.path / "gone"
    p.write_bytes(b"data")
    fd = os.open(p, os.O_RDONLY)
    try:
        assert os.fstat(fd).st_nlink == 1
        os.unlink(p)
        assert os.fstat(fd).st_nlink == 0
        assert os.pread(fd, 4, 0) == b"data"
    finally:
        os.close(fd)


def test_truncate_and_ftruncate_change_ctime(m):
    for name, how in (("t1", lambda p: os.truncate(p, 123)), ("t2", None)):
        p = m.path / name
        p.write_bytes(b"y" * 10000)
        old = os.stat(p)
        os.utime(p, ns=(old.st_atime_ns, 10**9))     # mtime and ctime apart: ctime is now
        st1 = os.stat(p)
        assert st1.st_mtime_ns == 10**9 and st1.st_ctime_ns > 10**9
        if how is not None:
            how(p)
            st2 = os.stat(p)
        else:
            fd = os.open(p, os.O_RDWR)
            try:
                os.ftruncate(fd, 123)
                st2 = os.fstat(fd)
            finally:
                os.close(fd)
            assert os.stat(p).st_ctime_ns >= st2.st_ctime_ns
        assert st2.st_size == 123
        assert st2.st_mtime_ns > 10**9, name
        assert st2.st_ctime_ns >= st1.st_ctime_ns and st2.st_ctime_ns >= st2.st_mtime_ns, name


def test_truncate_past_the_largest_tier_is_efbig_at_once(m):
    p = m.path / "huge"
    p.write_bytes(b"z" * 100)
    assert errno_of(os.truncate, p, 999_999_999_999_999) == errno.EFBIG
    fd = os.open(p, os.O_RDWR)
    try:
        assert errno_of(os.ftruncate, fd, 999_999_999_999_999) == errno.EFBIG
        assert os.fstat(fd).st_size == 100
    finally:
        os.close(fd)                                 # nothing left to fail at close
    assert p.read_bytes() == b"z" * 100
    largest = max(t["capacity"] for t in m.stats()["tiers"].values())
    assert largest == 256 << 20                            # the NVMe tier's
    assert errno_of(os.truncate, p, largest + 1) == errno.EFBIG
    os.truncate(p, 8 << 20)
    assert os.stat(p).st_size == 8 << 20
    with open(p, "rb") as f:
        assert f.read(200) == b"z" * 100 + bytes(100)


def test_a_write_past_the_largest_tier_is_efbig_at_once(m):
    """It was ENOSPC after about 90 s of the daemon's time, then ENOMEM at close. The file
    lacks the refused bytes, so that version is never sealed (issue 40): close answers EFBIG
    and a new file is removed, an existing one keeps its last sealed version."""
    p = m.path / "far"
    fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        os.write(fd, b"near")
        assert errno_of(os.pwrite, fd, b"x", 999_999_999_999_999) == errno.EFBIG
        assert errno_of(os.pwrite, fd, b"x", 256 << 20) == errno.EFBIG     # ends one past it
        assert os.fstat(fd).st_size == 4
    finally:
        assert errno_of(os.close, fd) == errno.EFBIG
    assert not p.exists()
    p.write_bytes(b"sealed")
    fd = os.open(p, os.O_RDWR)
    os.pwrite(fd, b"S", 0)
    assert errno_of(os.pwrite, fd, b"x", 256 << 20) == errno.EFBIG
    assert errno_of(os.close, fd) == errno.EFBIG
    assert p.read_bytes() == b"sealed"


def test_special_files_are_refused_with_eperm(m):
    assert errno_of(os.mkfifo, m.path / "fifo") == errno.EPERM
    assert errno_of(os.mknod, m.path / "chr", stat.S_IFCHR | 0o600, os.makedev(1, 3)) == errno.EPERM
    assert errno_of(os.mknod, m.path / "blk", stat.S_IFBLK | 0o600, os.makedev(7, 0)) == errno.EPERM
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        assert errno_of(s.bind, str(m.path / "sock")) == errno.EPERM
    finally:
        s.close()
    for n in ("fifo", "chr", "blk", "sock"):
        assert not os.path.lexists(m.path / n)


def test_mknod_of_a_regular_file_makes_an_empty_file(m):
    p = m.path / "plain"
    os.mknod(p, stat.S_IFREG | 0o640)
    st = os.stat(p)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) & 0o700 == 0o600 and st.st_size == 0
    p.write_bytes(b"after")
    assert p.read_bytes() == b"after"


@pytest.mark.parametrize("transport", ["auto", "pyfuse3"])
def test_a_large_directory_lists_whole_on_both_transports(kvfs_mount, transport):
    """Thousands of short names: the kernel asks for directory pages larger than 4 KiB, and one
    answer holds more entries than writev takes pieces (IOV_MAX, 1024) -- that answer once
    failed and the lister waited forever. Every name once, through readdir and readdirplus."""
    mnt = kvfs_mount("--transport", transport, ram="32MiB", nvme_size="256MiB")
    d = mnt.path / "many"
    d.mkdir()
    names = {f"n{i}" for i in range(3000)}
    for n in names:
        os.close(os.open(d / n, os.O_CREAT | os.O_WRONLY, 0o644))
    listed = os.listdir(d)
    assert len(listed) == len(names) and set(listed) == names
    with os.scandir(d) as it:                       # with the attributes (readdirplus)
        sizes = {e.name: e.stat().st_size for e in it}
    assert sizes.keys() == names and set(sizes.values()) == {0}
