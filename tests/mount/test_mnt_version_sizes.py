"""A descriptor's read, pread, mmap and fstat agree when its file changes size under it
(issue 32; docs/design.md, "Versions and sizes").

A read-only descriptor reads the version it opened; the kernel keeps one size per inode, the
current one, which fstat shows on every descriptor. So an older version's descriptor reads its
version's bytes up to the current size, zeros past their end, and EOF at the current size:
never EOF and never SIGBUS inside the size it is told, never a byte of another version.
Every way to change a size (truncate by path, ftruncate, write past EOF, O_APPEND,
copy_file_range, O_TRUNC) x a reader opened before the change (on a sealed file; on a new name
opened O_RDONLY|O_CREAT; on a version that a longer one replaced before the change) x
read/pread/mmap, with the write state in the daemon's memory, in a
tmpfs file and spilled to NVMe, and with small and large RAM tiers.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest

from support.files import MiB, content, put, read
from support.mount import open_mount

pytestmark = pytest.mark.mount

# (ram, nvme size, old size, grown size, shrunk size): the write state in memory (< 256 KiB),
# in a tmpfs file, spilled to NVMe (RAM smaller than the buffer), and a large RAM tier
PROFILES = {
    "mem": ("8MiB", "64MiB", 100_003, 230_001, 30_001),
    "tmpfs": ("8MiB", "64MiB", 1_000_003, 1_872_697, 300_001),
    "spill": ("4MiB", "64MiB", 3 * MiB + 1, 6 * MiB + 5, MiB + 7),
    "large": ("64MiB", "256MiB", 1_000_003, 1_872_697, 300_001),
    # without FUSE passthrough (the fallback transport; the kernel transport with it off):
    # every reader above 256 KiB keeps its version while the file changes under it
    "tmpfs-pyfuse3": ("8MiB", "64MiB", 1_000_003, 1_872_697, 300_001),
    "large-nopassthrough": ("64MiB", "256MiB", 1_000_003, 1_872_697, 300_001),
}
EXTRA = {"tmpfs-pyfuse3": ("--transport", "pyfuse3"), "large-nopassthrough": ("--no-passthrough",),
         **{p: ("--passthrough",) for p in ("mem", "tmpfs", "spill", "large")}}

MMAP_CHILD = """
import hashlib, mmap, sys
fd, size = int(sys.argv[1]), int(sys.argv[2])
m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
print(hashlib.sha256(m[:size]).hexdigest(), m[size - 1])
"""


@pytest.fixture(scope="module", params=sorted(PROFILES))
def prof(request, tmp_path_factory):
    ram, nvme, *sizes = PROFILES[request.param]
    m = open_mount(tmp_path_factory.mktemp(f"vs-{request.param}") / "kvfs", *EXTRA.get(request.param, ()),
                   ram=ram, nvme_size=nvme)
    yield m, sizes
    m.cleanup()


def mmap_digest(fd: int, size: int) -> str:
    """Map ``size`` bytes of ``fd`` in a child process and hash them (a SIGBUS kills the child,
    not the test)."""
    res = subprocess.run([sys.executable, "-c", MMAP_CHILD, str(fd), str(size)], pass_fds=(fd,),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"mmap reader exited {res.returncode} (-7: SIGBUS): {res.stderr[-800:]}"
    return res.stdout.split()[0]


def expected(old: bytes, size: int) -> bytes:
    keep = min(len(old), size)
    return old[:keep] + bytes(size - keep)


def check_reader(fd: int, path, old: bytes, *, mapped: bool = True) -> int:
    """fstat, pread, read to EOF and mmap of ``fd`` agree, and hold ``old``'s bytes, then
    zeros, up to the size fstat gives (the file's current size; ``path`` None: the file has
    no name any more)."""
    size = os.fstat(fd).st_size
    assert path is None or os.stat(path).st_size == size
    want = expected(old, size)
    spots = [(0, 4096), (size // 2, 2931), (1_064_312, 2931), (max(0, size - 1), 1),
             (max(0, size - 5000), 10_000), (size, 10)]
    for off, ln in spots:
        got = os.pread(fd, ln, off)
        assert got == want[off:off + ln], f"pread({ln}, {off}) of {size}: {len(got)} bytes"
    os.lseek(fd, 0, os.SEEK_SET)
    parts = []
    while chunk := os.read(fd, 1 << 20):
        parts.append(chunk)
    got = b"".join(parts)
    assert len(got) == size and got == want, f"read to EOF: {len(got)} of {size} bytes"
    if mapped and size:
        assert mmap_digest(fd, size) == hashlib.sha256(want).hexdigest()
    assert os.fstat(fd).st_size == size          # no short read shrank the kernel's size
    return size


def _open_w(p, extra=0):
    return os.open(p, os.O_WRONLY | extra)


# each change: (path, the other file, sizes) -> the writer's descriptor (None: by path)
def ch_truncate_grow(p, src, old, big, small):
    os.truncate(p, big)
    return None


def ch_truncate_shrink(p, src, old, big, small):
    os.truncate(p, small)
    return None


def ch_ftruncate_grow(p, src, old, big, small):
    w = _open_w(p)
    os.ftruncate(w, big)
    return w


def ch_ftruncate_shrink(p, src, old, big, small):
    w = _open_w(p)
    os.ftruncate(w, small)
    return w


def ch_write_past_eof(p, src, old, big, small):
    w = _open_w(p)
    assert os.pwrite(w, content("past", 4321), big - 4321) == 4321
    return w


def ch_append(p, src, old, big, small):
    w = _open_w(p, os.O_APPEND)
    data = content("append", big - os.fstat(w).st_size)
    assert os.write(w, data) == len(data)
    return w


def ch_copy_file_range(p, src, old, big, small):
    w = _open_w(p)
    s = os.open(src, os.O_RDONLY)
    try:
        n = os.copy_file_range(s, w, 77_777, 0, big - 77_777)
        assert n == 77_777
    finally:
        os.close(s)
    return w


def ch_shrink_then_grow(p, src, old, big, small):
    w = _open_w(p)
    os.ftruncate(w, small)
    assert os.pwrite(w, content("regrow", 999), big - 999) == 999
    return w


def ch_o_trunc(p, src, old, big, small):
    w = _open_w(p, os.O_TRUNC)
    assert os.write(w, content("otrunc", big)) == big
    return w


CHANGES = {f.__name__[3:]: f for f in (ch_truncate_grow, ch_truncate_shrink, ch_ftruncate_grow,
                                       ch_ftruncate_shrink, ch_write_past_eof, ch_append,
                                       ch_copy_file_range, ch_shrink_then_grow, ch_o_trunc)}


@pytest.mark.parametrize("reader", ["sealed", "rdonly_creat"])
@pytest.mark.parametrize("change", sorted(CHANGES))
def test_reader_opened_before_a_size_change(prof, request, change, reader):
    """``sealed``: a reader of a sealed file, alone; every change below comes by the file's
    name, so the name is renewed (a new inode with the same version) and the reader keeps its
    inode, version and size, passthrough or not (``renewed_under``). ``rdonly_creat``: a reader
    of a new, empty name follows the file (issue 32: its version's no bytes, then zeros up to
    the size it is told), on the same inode as the writer. (An older version's reader of a
    named file no longer shares its inode with a newer version: the change that makes one
    renews the name. kvfs has no hard links, so only a shared volume, whose names are not
    renewed, keeps versions on one inode.)"""
    m, (old_size, big, small) = prof
    d = m.path / request.node.name.replace("[", "_").replace("]", "_")
    d.mkdir()
    p, src = d / "f", d / "src"
    put(src, content("src", 100_000))
    if reader == "rdonly_creat":
        old = b""
        r = os.open(p, os.O_RDONLY | os.O_CREAT, 0o640)
    else:
        old = content("old", old_size)
        put(p, old)
        r = os.open(p, os.O_RDONLY)
        return renewed_under(r, p, src, old, change, sizes=(big, small))
    try:
        check_reader(r, p, old)
        w = CHANGES[change](p, src, old, big, small)
        try:
            check_reader(r, p, old)                  # while the new version is written
        finally:
            if w is not None:
                os.close(w)
        size = check_reader(r, p, old)               # and once it is sealed
        new = read(p)                                        # a new open reads the new version
        assert len(new) == size
        r2 = os.open(p, os.O_RDONLY)                        # direct_io beside r: no mmap
        try:
            assert os.fstat(r2).st_size == size and os.pread(r2, size + 10, 0) == new
        finally:
            os.close(r2)
        check_reader(r, p, old)
    finally:
        os.close(r)
    assert read(p) == new


def passthrough_opens(m) -> int:
    return ((m.stats().get("transport") or {}).get("passthrough") or {}).get("opens", 0)


def check_held(fd: int, old: bytes) -> None:
    """fstat, pread, read to EOF and mmap of ``fd`` give exactly ``old`` (its own inode's size)."""
    assert os.fstat(fd).st_size == len(old)
    assert os.pread(fd, len(old) + 10, 0) == old
    os.lseek(fd, 0, os.SEEK_SET)
    assert b"".join(iter(lambda: os.read(fd, 1 << 20), b"")) == old
    if old:
        assert mmap_digest(fd, len(old)) == hashlib.sha256(old).hexdigest()


def renewed_under(r: int, p, src, old: bytes, change: str, sizes) -> None:
    """A reader of a sealed version (through FUSE passthrough or the daemon) holds its inode,
    so a change of the file by its name renews the name (a new inode with the same version:
    docs/design.md, "How a read travels", "Versions and sizes") and goes on there: the reader
    keeps its inode, its version and its size, as after a rename over the name; a descriptor
    opened by the change is on the new inode."""
    ino = os.fstat(r).st_ino
    try:
        check_held(r, old)
        w = CHANGES[change](p, src, old, *sizes)
        try:
            check_held(r, old)                  # while the new version is written
            if w is not None:
                assert os.fstat(w).st_ino == os.stat(p).st_ino != ino
        finally:
            if w is not None:
                os.close(w)
        check_held(r, old)                      # and once it is sealed
        assert os.stat(p).st_ino != ino
    finally:
        os.close(r)
    new = read(p)
    assert new != old and os.stat(p).st_size == len(new)


@pytest.mark.parametrize("how", ["unlink", "rename_over"])
@pytest.mark.parametrize("reader", ["sealed", "empty"])
def test_reader_of_a_file_removed_while_written(prof, request, how, reader):
    """fsx seeds 801 and 802 (30,000 operations): a writer grew the file, the name was unlinked
    or another file renamed over it while the writer and a reader of the older version had it
    open, then the writer closed. fstat on the reader's descriptor gave the writer's size and
    pread below it gave EOF (the orphan's record still named the reader's version, so its reads
    were taken for the current version's and only cut, never padded). ``sealed``: the writer's
    open by the name renews it (the reader keeps its inode). ``empty``: a reader of a new name
    (``O_RDONLY|O_CREAT``) shares the inode with the writer, as every older reader did before
    renewal: its reads are zeros up to the size it is told, the writer's."""
    m, (old_size, big, small) = prof
    d = m.path / request.node.name.replace("[", "_").replace("]", "_")
    d.mkdir()
    p, src = d / "f", d / "src"
    if reader == "sealed":
        old = content("old", old_size)
        put(p, old)
        r = os.open(p, os.O_RDONLY)
    else:
        old = b""
        r = os.open(p, os.O_RDONLY | os.O_CREAT, 0o640)
    try:
        w = os.open(p, os.O_WRONLY)
        if reader == "sealed":              # a writer renews the name: no shared inode
            try:
                assert os.fstat(w).st_ino != os.fstat(r).st_ino
                assert os.pwrite(w, content("past", 4321), big - 4321) == 4321
                if how == "unlink":
                    os.unlink(p)
            finally:
                os.close(w)
            assert check_reader(r, None, old) == len(old)
            return
        try:
            assert os.fstat(w).st_ino == os.fstat(r).st_ino
            assert os.pwrite(w, content("past", 4321), big - 4321) == 4321
            if how == "unlink":
                os.unlink(p)
            else:
                put(src, content("src", 100_000))
                os.rename(src, p)
            assert check_reader(r, None, old) == big
            os.ftruncate(w, big + 7777)          # the last size the writer gives it
        finally:
            os.close(w)                          # its flush seals the orphan's version
        assert check_reader(r, None, old) == big + 7777
    finally:
        os.close(r)
    if how == "rename_over":
        assert read(p) == content("src", 100_000)


@pytest.mark.parametrize("ram", ["8MiB", "64MiB"])
def test_issue_32_repro_rdonly_creat_then_truncate_by_path(tmp_path, ram):
    """The report: an O_RDONLY|O_CREAT descriptor of a new file, the file extended by path;
    fstat gave 1872697 and pread(2931, 1064312) gave 0 bytes (POSIX: 2931 zeros)."""
    m = open_mount(tmp_path / "kvfs", ram=ram, nvme_size="64MiB")
    try:
        p = m.path / "f6"
        fd = os.open(p, os.O_RDONLY | os.O_CREAT, 0o640)
        try:
            os.truncate(p, 1872697)
            assert os.fstat(fd).st_size == 1872697
            assert os.pread(fd, 2931, 1064312) == bytes(2931)
            assert mmap_digest(fd, 1872697) == hashlib.sha256(bytes(1872697)).hexdigest()
            assert os.fstat(fd).st_size == 1872697
        finally:
            os.close(fd)
    finally:
        m.cleanup()
