"""Issue 2 section 2 through the kernel: names, directories, renames, attributes, limits.

One mount per module (mounting costs a daemon start); every test works in its own
directory under it.
"""
from __future__ import annotations

import errno
import os
import stat
import threading

import pytest

from support.files import MiB, content, errno_of, fallocate, put, read, renameat2, RENAME_NOREPLACE
from support.mount import open_mount
from support.mount import d, mnt  # noqa: F401 - shared fixtures

pytestmark = pytest.mark.mount



# ---- directories ------------------------------------------------------------
def test_mkdir_parents_and_racing_makedirs(d):
    deep = d / "a" / "b" / "c" / "d"
    os.makedirs(deep)
    assert deep.is_dir()
    assert os.listdir(d / "a" / "b") == ["c"]
    assert errno_of(os.mkdir, deep) == errno.EEXIST

    # 16 threads racing makedirs of the same parents (vLLM's writer threads)
    errors = []

    def worker(i):
        try:
            for j in range(20):
                os.makedirs(d / "race" / f"p{j % 5}" / f"q{j}", exist_ok=True)
                put(d / "race" / f"p{j % 5}" / f"q{j}" / f"t{i}.bin", b"x" * 10)
        except Exception as e:       # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for j in range(20):
        names = sorted(os.listdir(d / "race" / f"p{j % 5}" / f"q{j}"))
        assert names == sorted(f"t{i}.bin" for i in range(16))


def test_mkdir_mode(d):
    os.mkdir(d / "m", 0o700)
    assert stat.S_IMODE(os.stat(d / "m").st_mode) == 0o700 & ~_umask()
    assert stat.S_ISDIR(os.stat(d / "m").st_mode)


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def test_rmdir(d):
    os.mkdir(d / "full")
    (d / "full" / "f").write_bytes(b"1")
    assert errno_of(os.rmdir, d / "full") == errno.ENOTEMPTY
    (d / "file").write_bytes(b"x")
    assert errno_of(os.rmdir, d / "file") == errno.ENOTDIR
    assert errno_of(os.rmdir, d / "missing") == errno.ENOENT
    assert errno_of(os.unlink, d / "full") in (errno.EISDIR, errno.EPERM)
    os.unlink(d / "full" / "f")
    os.rmdir(d / "full")
    assert not (d / "full").exists()
    assert os.listdir(d) == ["file"]
    os.mkdir(d / "full")                     # the name can be reused
    assert (d / "full").is_dir()


def test_readdir_large_directory(d):
    names = {f"blk{i:05d}.bin" for i in range(3000)}
    for n in names:
        fd = os.open(d / n, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o644)
        os.close(fd)
    listed = os.listdir(d)
    assert len(listed) == len(set(listed)) == 3000
    assert set(listed) == names
    # a second pass in another process-style listing gives the same answer
    with os.scandir(d) as it:
        again = [e.name for e in it]
    assert sorted(again) == sorted(listed)


def test_readdir_while_entries_are_deleted(d):
    names = [f"e{i:05d}" for i in range(3000)]
    for n in names:
        os.close(os.open(d / n, os.O_CREAT | os.O_WRONLY, 0o644))
    seen: list[str] = []
    deleted_unseen: set[str] = set()
    pending = set(names)
    with os.scandir(d) as it:
        for k, e in enumerate(it):
            seen.append(e.name)
            pending.discard(e.name)
            if e.name not in deleted_unseen:      # (a buffered entry may outlive its unlink)
                os.unlink(d / e.name)             # delete what was just listed
            if k % 3 == 0 and pending:            # and one not listed yet
                victim = min(pending)
                pending.discard(victim)
                deleted_unseen.add(victim)
                os.unlink(d / victim)
    assert len(seen) == len(set(seen)), "a name was listed twice"
    assert set(seen) - deleted_unseen == set(names) - deleted_unseen
    never_deleted_before_seen = set(names) - deleted_unseen
    missing = never_deleted_before_seen - set(seen)
    assert not missing, f"{len(missing)} names never listed, e.g. {sorted(missing)[:5]}"
    assert set(seen) <= set(names)
    assert os.listdir(d) == []


# ---- renames --------------------------------------------------------------------
def test_rename_file_and_dir(d):
    put(d / "a", b"A" * 1000)
    os.rename(d / "a", d / "b")
    assert not (d / "a").exists() and read(d / "b") == b"A" * 1000
    os.makedirs(d / "src" / "inner")
    put(d / "src" / "inner" / "f", b"F")
    os.mkdir(d / "dst")
    os.rename(d / "src", d / "dst" / "moved")
    assert read(d / "dst" / "moved" / "inner" / "f") == b"F"
    assert not (d / "src").exists()
    # across directories, a file
    os.rename(d / "b", d / "dst" / "moved" / "b2")
    assert read(d / "dst" / "moved" / "b2") == b"A" * 1000


def test_rename_replaces_target_atomically(d):
    old = content("old", 3 * MiB)
    new = content("new", 3 * MiB)
    put(d / "blk.bin", old)
    assert read(d / "blk.bin") == old          # page cache now holds the old bytes
    ino_old = os.stat(d / "blk.bin").st_ino
    put(d / "blk.bin", new)                    # name.tmp then os.replace
    assert read(d / "blk.bin") == new, "a replaced name served stale bytes"
    assert os.stat(d / "blk.bin").st_ino != ino_old
    assert sorted(os.listdir(d)) == ["blk.bin"]
    # replacing many times in a row always gives the latest
    for i in range(10):
        data = content(f"v{i}", 100_000 + i)
        put(d / "blk.bin", data)
        assert read(d / "blk.bin") == data


def test_rename_errors(d):
    os.makedirs(d / "dir" / "sub")
    assert errno_of(os.rename, d / "dir", d / "dir" / "sub" / "x") == errno.EINVAL
    assert errno_of(os.rename, d / "dir", d / "dir" / "x") == errno.EINVAL
    put(d / "f", b"f")
    os.mkdir(d / "full")
    put(d / "full" / "x", b"x")
    os.mkdir(d / "empty")
    assert errno_of(os.rename, d / "f", d / "empty") == errno.EISDIR
    assert errno_of(os.rename, d / "empty", d / "f") == errno.ENOTDIR
    assert errno_of(os.rename, d / "dir", d / "full") in (errno.ENOTEMPTY, errno.EEXIST)
    assert errno_of(os.rename, d / "missing", d / "g") == errno.ENOENT
    os.rename(d / "dir", d / "empty")          # a dir over an empty dir
    assert (d / "empty" / "sub").is_dir() and not (d / "dir").exists()
    assert read(d / "f") == b"f"


def test_rename_noreplace(d):
    put(d / "a", b"a")
    put(d / "b", b"b")
    assert errno_of(renameat2, d / "a", d / "b", RENAME_NOREPLACE) == errno.EEXIST
    assert read(d / "a") == b"a" and read(d / "b") == b"b"
    renameat2(d / "a", d / "c", RENAME_NOREPLACE)
    assert read(d / "c") == b"a" and not (d / "a").exists()


# ---- files: unlink, symlinks, attributes -----------------------------------
def test_unlink_and_open_after_unlink(d):
    data = content("u", 2 * MiB)
    put(d / "f", data)
    fd = os.open(d / "f", os.O_RDONLY)
    try:
        os.unlink(d / "f")
        assert not (d / "f").exists()
        assert errno_of(os.stat, d / "f") == errno.ENOENT
        assert os.pread(fd, len(data) + 1, 0) == data      # the open reader keeps reading
    finally:
        os.close(fd)
    assert errno_of(os.unlink, d / "f") == errno.ENOENT
    assert os.listdir(d) == []


def test_symlink_readlink(d):
    put(d / "target", b"T" * 10)
    os.symlink("target", d / "link")
    os.symlink("/nowhere/at/all", d / "dangling")
    assert os.readlink(d / "link") == "target"
    assert os.readlink(d / "dangling") == "/nowhere/at/all"
    assert stat.S_ISLNK(os.lstat(d / "link").st_mode)
    assert os.lstat(d / "link").st_size == len("target")
    assert read(d / "link") == b"T" * 10
    assert errno_of(os.readlink, d / "target") == errno.EINVAL
    assert errno_of(os.symlink, "x", d / "link") == errno.EEXIST
    os.unlink(d / "link")
    assert read(d / "target") == b"T" * 10


def test_hard_link_refused(d):
    put(d / "f", b"f")
    assert errno_of(os.link, d / "f", d / "g") == errno.EPERM
    assert not (d / "g").exists()


def test_chmod_chown_utime(d):
    put(d / "f", b"x" * 100)
    os.chmod(d / "f", 0o640)
    assert stat.S_IMODE(os.stat(d / "f").st_mode) == 0o640
    os.chmod(d / "f", 0o4755)
    assert stat.S_IMODE(os.stat(d / "f").st_mode) == 0o4755
    os.chown(d / "f", 1234, 5678)
    st = os.stat(d / "f")
    assert (st.st_uid, st.st_gid) == (1234, 5678)
    os.chown(d / "f", -1, 42)
    st = os.stat(d / "f")
    assert (st.st_uid, st.st_gid) == (1234, 42)
    os.utime(d / "f", ns=(1_000_000_123, 2_000_000_456))
    st = os.stat(d / "f")
    assert st.st_atime_ns == 1_000_000_123 and st.st_mtime_ns == 2_000_000_456
    os.mkdir(d / "dir")
    os.chmod(d / "dir", 0o711)
    assert stat.S_IMODE(os.stat(d / "dir").st_mode) == 0o711
    assert read(d / "f") == b"x" * 100


def test_truncate_sealed_file(d):
    data = content("t", 3 * MiB + 17)
    put(d / "f", data)
    assert read(d / "f") == data
    os.truncate(d / "f", 1000)
    assert os.stat(d / "f").st_size == 1000
    assert read(d / "f") == data[:1000]
    os.truncate(d / "f", 5000)
    assert read(d / "f") == data[:1000] + bytes(4000)
    os.truncate(d / "f", 0)
    assert read(d / "f") == b""
    assert os.stat(d / "f").st_size == 0


def test_truncate_open_file(d):
    fd = os.open(d / "f", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        os.write(fd, b"a" * 10000)
        os.ftruncate(fd, 100)
        assert os.fstat(fd).st_size == 100
        os.pwrite(fd, b"z", 199)
        os.ftruncate(fd, 300)
        assert os.pread(fd, 1000, 0) == b"a" * 100 + bytes(99) + b"z" + bytes(100)
    finally:
        os.close(fd)
    assert read(d / "f") == b"a" * 100 + bytes(99) + b"z" + bytes(100)
    # truncate by path while another handle has it open for writing
    fd = os.open(d / "f", os.O_WRONLY)
    try:
        os.pwrite(fd, b"q", 0)
        os.truncate(d / "f", 2)
    finally:
        os.close(fd)
    assert read(d / "f") == b"qa"


def test_statfs_totals(mnt, d):
    sv = os.statvfs(mnt.path)
    assert sv.f_frsize * sv.f_blocks == (64 << 20) + (1 << 30)
    assert 0 < sv.f_bavail <= sv.f_blocks
    assert sv.f_namemax == 255
    before = sv.f_bfree * sv.f_frsize
    put(d / "f", content("s", 8 * MiB))
    after = os.statvfs(mnt.path).f_bfree * sv.f_frsize
    assert after <= before - 8 * MiB + 64 * 1024, (before, after)


def test_name_length_limit(d):
    ok = "n" * 255
    (d / ok).write_bytes(b"ok")
    assert read(d / ok) == b"ok"
    os.mkdir(d / ("d" * 255))
    long = "n" * 256
    assert errno_of(open, d / long, "wb") == errno.ENAMETOOLONG
    assert errno_of(os.mkdir, d / long) == errno.ENAMETOOLONG
    assert errno_of(os.symlink, "x", d / long) == errno.ENAMETOOLONG
    assert errno_of(os.rename, d / ok, d / long) == errno.ENAMETOOLONG
    assert errno_of(os.stat, d / long) == errno.ENAMETOOLONG
    # multi-byte: 85 three-byte characters are 255 bytes
    (d / ("\u20ac" * 85)).write_bytes(b"euro")
    assert errno_of(open, d / ("\u20ac" * 86), "wb") == errno.ENAMETOOLONG
    assert sorted(os.listdir(d)) == sorted([ok, "d" * 255, "\u20ac" * 85])


def test_control_dir_reserved(mnt):
    root = mnt.path
    assert errno_of(os.mkdir, root / ".kvfs") in (errno.EEXIST, errno.EPERM)
    assert errno_of(open, root / ".kvfs", "wb") in (errno.EEXIST, errno.EPERM, errno.EISDIR)
    assert errno_of(os.open, root / ".kvfs", os.O_CREAT | os.O_EXCL | os.O_WRONLY) in (errno.EEXIST, errno.EPERM)
    assert errno_of(os.symlink, "x", root / ".kvfs") in (errno.EEXIST, errno.EPERM)
    assert errno_of(os.rmdir, root / ".kvfs") is not None
    assert errno_of(open, root / ".kvfs" / "newfile", "wb") is not None
    assert errno_of(os.mkdir, root / ".kvfs" / "sub") is not None
    assert errno_of(os.unlink, root / ".kvfs" / "stats") is not None
    os.mkdir(root / "tmp_ctl")
    try:
        assert errno_of(os.rename, root / "tmp_ctl", root / ".kvfs") is not None
        # the name is reserved only at the root
        os.mkdir(root / "tmp_ctl" / ".kvfs")
        put(root / "tmp_ctl" / ".kvfs" / "f", b"ok")
        assert read(root / "tmp_ctl" / ".kvfs" / "f") == b"ok"
    finally:
        pass
    assert (root / ".kvfs").is_dir()
    assert sorted(os.listdir(root / ".kvfs")) == ["commit", "events", "get", "lease", "lookup", "stats"]


# ---- open flags ---------------------------------------------------------------
def test_o_trunc_o_append_o_excl(d):
    put(d / "f", b"0123456789")
    fd = os.open(d / "f", os.O_WRONLY | os.O_TRUNC)
    os.write(fd, b"ab")
    os.close(fd)
    assert read(d / "f") == b"ab"
    fd = os.open(d / "f", os.O_WRONLY | os.O_APPEND)
    os.write(fd, b"cd")
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, b"ef")                      # O_APPEND: still at the end
    os.close(fd)
    assert read(d / "f") == b"abcdef"
    assert errno_of(os.open, d / "f", os.O_CREAT | os.O_EXCL | os.O_WRONLY) == errno.EEXIST
    fd = os.open(d / "g", os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_TRUNC, 0o600)
    os.write(fd, b"g")
    os.close(fd)
    assert read(d / "g") == b"g"
    assert stat.S_IMODE(os.stat(d / "g").st_mode) == 0o600
    # O_TRUNC on a read-write open of an existing sealed file
    fd = os.open(d / "g", os.O_RDWR | os.O_TRUNC)
    assert os.read(fd, 10) == b""
    os.close(fd)
    assert read(d / "g") == b""


def test_o_direct_aligned_io(d):
    import mmap
    size = 4 * MiB
    data = content("direct", size)
    buf = mmap.mmap(-1, size)
    buf[:] = data
    fd = os.open(d / "blk.bin", os.O_CREAT | os.O_WRONLY | os.O_DIRECT | os.O_EXCL | os.O_TRUNC, 0o644)
    try:
        off = 0
        while off < size:                     # 1 MiB aligned writes
            off += os.pwrite(fd, memoryview(buf)[off:off + MiB], off)
    finally:
        os.close(fd)
    rbuf = mmap.mmap(-1, size)
    fd = os.open(d / "blk.bin", os.O_RDONLY | os.O_DIRECT)
    try:
        n = os.preadv(fd, [rbuf], 0)
        assert n == size
        assert rbuf[:] == data
        part = mmap.mmap(-1, 4096)
        assert os.preadv(fd, [part], 8192) == 4096
        assert part[:] == data[8192:12288]
    finally:
        os.close(fd)
    assert read(d / "blk.bin") == data


def test_writes_at_arbitrary_offsets_before_close(d):
    fd = os.open(d / "f", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        os.pwrite(fd, b"END", 3 * MiB)
        os.pwrite(fd, b"mid", 1 * MiB + 7)
        os.pwrite(fd, b"start", 0)
        os.pwrite(fd, b"S", 1)               # overwrite inside
        assert os.fstat(fd).st_size == 3 * MiB + 3
        assert os.pread(fd, 5, 0) == b"sSart"
    finally:
        os.close(fd)
    want = bytearray(3 * MiB + 3)
    want[3 * MiB:] = b"END"
    want[MiB + 7:MiB + 10] = b"mid"
    want[0:5] = b"sSart"
    assert read(d / "f") == bytes(want)
    # and a sealed file rewritten in place at offsets
    fd = os.open(d / "f", os.O_WRONLY)
    try:
        os.pwrite(fd, b"XY", 2 * MiB)
    finally:
        os.close(fd)
    want[2 * MiB:2 * MiB + 2] = b"XY"
    assert read(d / "f") == bytes(want)


def test_mmap_read_of_sealed_file(d):
    import mmap
    data = content("mmap", 5 * MiB + 123)
    put(d / "f", data)
    with open(d / "f", "rb") as f:
        with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
            assert len(mm) == len(data)
            assert mm[:] == data
            assert mm[4 * MiB:4 * MiB + 10] == data[4 * MiB:4 * MiB + 10]


def test_fsync_and_flush_seal_errors_reach_caller(d):
    fd = os.open(d / "f", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        os.write(fd, b"abc")
        os.fsync(fd)
        os.write(fd, b"def")
    finally:
        os.close(fd)
    assert read(d / "f") == b"abcdef"


# ---- fallocate (documented in docs/design.md) --------------------------------------------
def test_fallocate_is_refused_and_posix_fallocate_emulated(d):
    """pyfuse3 3.5 routes no FUSE_FALLOCATE (its fuse_lowlevel_ops leave .fallocate NULL, so
    libfuse answers ENOSYS): fallocate(2) gives EOPNOTSUPP, every mode; glibc's posix_fallocate
    then writes a byte per block itself: it extends O_RDWR files and growing O_WRONLY ones, and
    fails with EBADF on O_APPEND descriptors and on O_WRONLY ones over existing bytes."""
    p = d / "f"
    put(p, b"a" * 5000)
    fd = os.open(p, os.O_RDWR)
    try:
        for mode in (0, 1):                       # 0: allocate and extend; 1: FALLOC_FL_KEEP_SIZE
            assert errno_of(fallocate, fd, mode, 0, 65536) == errno.EOPNOTSUPP
        os.posix_fallocate(fd, 0, 20000)          # the emulation: reads, then writes, each block
        assert os.fstat(fd).st_size == 20000
    finally:
        os.close(fd)
    assert read(p) == b"a" * 5000 + bytes(15000)
    fd = os.open(p, os.O_WRONLY)
    try:
        os.posix_fallocate(fd, 30000, 5000)       # past the end: no byte to read first
        assert os.fstat(fd).st_size == 35000
        assert errno_of(os.posix_fallocate, fd, 0, 100) == errno.EBADF   # over existing bytes
    finally:
        os.close(fd)
    fd = os.open(p, os.O_RDWR | os.O_APPEND)
    try:
        assert errno_of(os.posix_fallocate, fd, 0, 50000) == errno.EBADF
    finally:
        os.close(fd)
    assert read(p) == b"a" * 5000 + bytes(30000)
