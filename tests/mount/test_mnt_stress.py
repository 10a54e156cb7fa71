"""Issue 11: correctness under stress through a real mount.

kill -9 of a daemon serving temp+rename writers, promotion racing a rename, shared-mapping
writes through O_APPEND fds, readdir of a file being written, parallel spills, sizes seen by
readers of unlinked files, mtimes set while a file is open, NVMe budgets larger than their
filesystem, read-ahead of deleted objects, O_RDONLY|O_CREAT, and writers opening a file
while its previous version is being sealed.
"""
from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from support.files import MiB, content, put, read
from support.mount import abort_conn, open_mount, stats_json, wait_for, lazy_unmount
from support.mount import d, mnt  # noqa: F401 - shared fixtures

pytestmark = pytest.mark.mount


def _proc_states(pid: int) -> dict[int, str]:
    """State letter of every thread of ``pid`` (empty once it is gone)."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                out[int(tid)] = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            pass
    return out


def _gone(pid: int) -> bool:
    """Every thread of ``pid`` exited (a zombie leader that nobody reaps counts as gone)."""
    return all(s in ("Z", "X") for s in _proc_states(pid).values())


def _fuse_conn(path) -> int:
    """The FUSE connection number (the mount's device minor) of a mounted kvfs."""
    return os.minor(os.stat(path).st_dev)




_WRITER = r"""
import os, sys
m, k = sys.argv[1], sys.argv[2]
i = 0
try:
    while True:
        data = (b"%08d" % i) * 8192          # 64 KiB, one pattern per version
        with open(os.path.join(m, k + ".tmp"), "wb") as f:
            f.write(data)
        os.rename(os.path.join(m, k + ".tmp"), os.path.join(m, k))
        i += 1
        if i == 20:
            print("going", flush=True)
except OSError:
    sys.exit(0)
"""


_WRITERS = 4


def _kill9_cycles(kvfs_mount, cycles: int) -> None:
    m = kvfs_mount()
    for cycle in range(cycles):
        conn = _fuse_conn(m.path)
        writers = [subprocess.Popen([sys.executable, "-c", _WRITER, str(m.path), f"x{k}"],
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
                   for k in range(_WRITERS)]
        try:
            for w in writers:
                assert w.stdout.readline() == b"going\n", f"cycle {cycle}: a writer failed to start"
            pid = m.pid
            os.kill(pid, signal.SIGKILL)
            try:
                wait_for(lambda: _gone(pid), 60, f"cycle {cycle}: killed daemon {pid} to exit")
            except AssertionError:
                raise AssertionError(f"cycle {cycle}: killed daemon's threads stay: {_proc_states(pid)}")
            for w in writers:
                try:
                    w.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    raise AssertionError(f"cycle {cycle}: a client of the dead mount is stuck "
                                         f"(threads {_proc_states(w.pid)})") from None
        except BaseException:
            abort_conn(conn)
            for w in writers:
                w.kill()
                w.wait()
            lazy_unmount(m.path)
            raise
        lazy_unmount(m.path)
        wait_for(lambda: not os.path.ismount(m.path), 30, "the dead mount to detach")
        m.pid = None
        m.mount()
        for k in range(_WRITERS):
            try:
                got = read(m.path / f"x{k}")
            except FileNotFoundError:
                continue                    # only RAM-resident versions existed: gone with the crash
            assert len(got) == 65536 and got == got[:8] * 8192, f"cycle {cycle}: torn file"


def test_kill9_with_rename_writers_never_wedges(kvfs_mount):
    _kill9_cycles(kvfs_mount, 10)


@pytest.mark.slow
def test_kill9_with_rename_writers_never_wedges_long(kvfs_mount):
    _kill9_cycles(kvfs_mount, 100)


# ---- 2: promotion racing a rename over the promoted file ----------------------------
def _wait_settled(m, what: str = "the store to settle") -> dict:
    return wait_for(lambda: (lambda s: s if s["settled"] else None)(m.stats()), 120, what)


def test_promotion_racing_rename_over_the_file(kvfs_mount):
    m = kvfs_mount(ram="16MiB")
    size = 4 * MiB
    expected = {}
    for i in range(8):
        expected[i] = content(f"cold{i}", size)
        put(m.path / f"cold{i}", expected[i])
    _wait_settled(m)
    for it in range(32):
        i = it % 8
        new = content(f"new{it}", size)
        (m.path / "new.tmp").write_bytes(new)
        for _ in range(2):                  # two opens: a promotion is queued
            assert read(m.path / f"cold{i}") == expected[i]
        os.rename(m.path / "new.tmp", m.path / f"cold{i}")     # while it is promoted
        expected[i] = new
    st = _wait_settled(m)
    assert st["pid"] == m.pid
    for i in range(8):
        assert read(m.path / f"cold{i}") == expected[i]
    ram = st["tiers"]["ram"]
    assert 0 <= ram["used"] <= ram["capacity"]
    assert "stale" not in m.log_tail(1000) and "Traceback" not in m.log_tail(1000)


# ---- 3: O_APPEND and shared mappings ------------------------------------------------
def test_shared_mapping_write_through_append_fd_lands_in_place(d):
    f = d / "f"
    f.write_bytes(b"A" * 8192)
    fd = os.open(f, os.O_RDWR | os.O_APPEND)
    try:
        mm = mmap.mmap(fd, 8192)
        mm[0:4] = b"ZZZZ"
        mm.flush()
        mm.close()
    finally:
        os.close(fd)
    got = read(f)
    assert len(got) == 8192 and got == b"ZZZZ" + b"A" * 8188


def test_appends_from_two_fds_interleave(d):
    f = d / "f"
    f.write_bytes(b"head")
    a = os.open(f, os.O_WRONLY | os.O_APPEND)
    b = os.open(f, os.O_WRONLY | os.O_APPEND)
    try:
        for i in range(50):
            os.write(a, b"a%03d" % i)
            os.write(b, b"b%03d" % i)
        assert os.fstat(a).st_size == 4 + 50 * 8
    finally:
        os.close(a)
        os.close(b)
    assert read(f) == b"head" + b"".join(b"a%03db%03d" % (i, i) for i in range(50))


# ---- 4: readdir of a file being written -----------------------------------------------
def test_readdir_reports_the_size_being_written(d):
    f = d / "f"
    f.write_bytes(b"x" * 5000)
    fd = os.open(f, os.O_RDWR)
    try:
        os.pwrite(fd, b"y" * 15000, 5000)
        assert sorted(os.listdir(d)) == ["f"]
        with os.scandir(d) as it:
            assert [e.stat().st_size for e in it] == [20000]
        assert os.fstat(fd).st_size == 20000
        assert os.pread(fd, 30000, 0) == b"x" * 5000 + b"y" * 15000
    finally:
        os.close(fd)
    assert os.stat(f).st_size == 20000


# ---- 5: parallel spills -------------------------------------------------------------------
def test_parallel_spills_keep_ram_accounting(kvfs_mount):
    m = kvfs_mount(ram="16MiB")
    for i in range(3):                                   # RAM mostly full of objects
        put(m.path / f"full{i}", content(f"full{i}", 4 * MiB))
    chunk, parts, nthreads = 4 * MiB, 3, 8
    errors, lows = [], []
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            t = m.stats()["tiers"]["ram"]
            lows.append((t["used"], t["staged"]))

    def writer(k):
        try:
            buf = mmap.mmap(-1, chunk)
            fd = os.open(m.path / f"w{k}", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
            try:
                for p in range(parts):
                    buf[:] = content(f"w{k}.{p}", chunk)
                    assert os.pwritev(fd, [buf], p * chunk) == chunk
            finally:
                os.close(fd)
        except Exception as e:       # noqa: BLE001
            errors.append((k, e))

    sampler = threading.Thread(target=sample)
    sampler.start()
    threads = [threading.Thread(target=writer, args=(k,)) for k in range(nthreads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    sampler.join()
    assert not errors, errors
    for k in range(nthreads):
        assert read(m.path / f"w{k}") == b"".join(content(f"w{k}.{p}", chunk) for p in range(parts)), k
    st = _wait_settled(m)
    ram = st["tiers"]["ram"]
    assert min(u for u, s in lows) >= 0 and min(s for u, s in lows) >= 0, "RAM accounting went negative"
    assert ram["staged"] == 0 and 0 <= ram["used"] <= ram["capacity"], ram


# ---- 7: readers of an unlinked file ---------------------------------------------------------
def test_reader_of_unlinked_file_being_written_keeps_size_and_bytes(d):
    data = content("unlinked", 100000)
    w = os.open(d / "f", os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(w, data)
    r = os.open(d / "f", os.O_RDONLY)
    try:
        os.unlink(d / "f")
        os.close(w)                                      # the last writer closes
        assert os.fstat(r).st_size == 100000
        assert os.pread(r, 200000, 0) == data
    finally:
        os.close(r)
    assert os.listdir(d) == []


def test_reader_of_unlinked_sealed_file_keeps_size_and_bytes(d):
    data = content("sealed", 100000)
    put(d / "f", data)
    r = os.open(d / "f", os.O_RDONLY)
    try:
        os.unlink(d / "f")
        assert os.fstat(r).st_size == 100000
        assert os.pread(r, 200000, 0) == data
    finally:
        os.close(r)


# ---- 8: mtimes set while a writer has the file open -----------------------------------------
def test_mtime_set_while_open_survives_close(d, tmp_path):
    t = 1_234_567_890 * 10**9
    fd = os.open(d / "f", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.write(fd, b"x" * 10000)
        os.utime(fd, ns=(t, t))                        # futimens after the last write
    finally:
        os.close(fd)
    assert os.stat(d / "f").st_mtime_ns == t
    assert read(d / "f") == b"x" * 10000
    # a write after the utime makes the mtime the write's again
    fd = os.open(d / "f", os.O_WRONLY)
    try:
        os.utime(fd, ns=(t, t))
        os.pwrite(fd, b"y", 0)
    finally:
        os.close(fd)
    assert os.stat(d / "f").st_mtime_ns > t
    # cp -p sets the times on the open copy before it closes it
    src = tmp_path / "src"
    src.write_bytes(content("cp", 300000))
    os.utime(src, ns=(t + 5, t + 7))
    res = subprocess.run(["cp", "-p", str(src), str(d / "g")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert os.stat(d / "g").st_mtime_ns == t + 7
    assert read(d / "g") == src.read_bytes()


# ---- 11: an NVMe budget larger than its filesystem ------------------------------------------
@pytest.fixture
def small_fs(tmp_path):
    path = tmp_path / "small"
    path.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(path)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {res.stderr.strip()}")
    yield path
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_clean_unmount_keeps_the_newest_files_when_nvme_fs_is_smaller_than_its_budget(kvfs_mount, small_fs):
    m = kvfs_mount(ram="64MiB", nvme=small_fs / "nvme", nvme_size="1GiB")
    n = 12
    for i in range(n):                                   # 12 MiB closes fine, into RAM
        put(m.path / f"f{i:02d}", content(f"f{i}", MiB))
    m.remount()
    present = sorted(p for p in os.listdir(m.path))
    for name in present:
        i = int(name[1:])
        assert read(m.path / name) == content(f"f{i}", MiB), name
    # the disk holds fewer than 12: the least recently used went (as an eviction), never
    # the files just written
    assert len(present) >= 4
    assert present == [f"f{i:02d}" for i in range(n - len(present), n)], present
    if len(present) < n:
        assert "evict" in m.log_tail(200).lower()
    print(f"{len(present)} of {n} files kept on an 8 MiB filesystem under a 1 GiB budget")


# ---- 12: read-ahead of a deleted object, O_RDONLY|O_CREAT, a writer opening during a seal -----
def test_read_ahead_of_deleted_object_is_not_a_checksum_failure(kvfs_mount):
    m = kvfs_mount(ram="4MiB")
    size = 6 * MiB
    for i in range(12):
        put(m.path / f"f{i}", content(f"ra{i}", size))
    _wait_settled(m)
    for group in range(3):                  # four readers start 4 read-aheads each, then go
        names = [m.path / f"f{group * 4 + k}" for k in range(4)]
        for k, name in enumerate(names):
            fd = os.open(name, os.O_RDONLY)
            try:
                assert os.pread(fd, 4096, 0) == content(f"ra{group * 4 + k}", 4096)
            finally:
                os.close(fd)
        for name in names:
            os.unlink(name)
    st = _wait_settled(m)
    assert sum(t["checksum_failures"] for t in st["tiers"].values()) == 0
    assert "checksum mismatch" not in m.log_tail(400)


def test_rdonly_creat_fd_is_not_a_writer(d, mnt):
    fd = os.open(d / "f", os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        assert os.getxattr(d / "f", "user.kvfs.checksum")      # sealed (empty) at once
        assert mnt.stats()["writing"] == 0
        assert os.read(fd, 10) == b""
        with open(d / "f", "wb") as w:
            w.write(b"written")
        assert read(d / "f") == b"written"
    finally:
        os.close(fd)
    assert read(d / "f") == b"written"


def test_writer_opening_while_previous_version_seals_loses_nothing(d):
    size = 16 * MiB
    f = d / "f"
    for it in range(12):
        data = content(f"seal{it}", size)
        a = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(a, data)
        closer = threading.Thread(target=os.close, args=(a,))
        closer.start()                                   # the seal hashes 16 MiB meanwhile
        b = os.open(f, os.O_WRONLY)
        try:
            os.pwrite(b, b"B%03d" % it, 0)
        finally:
            os.close(b)
            closer.join()
        got = read(f)
        assert len(got) == size, (it, len(got))
        assert got[:4] == b"B%03d" % it, (it, got[:4])
        assert got[4:] == data[4:], (it, "the first writer's bytes were lost")


# ---- 6: an fd on an old version while the file is rewritten in place ------------------------
def test_old_version_reader_during_in_place_resize_reads_only_old_bytes(d):
    """The kernel keeps one size per inode: an old-version reader's reads end at the size of
    the version being written (docs/design.md), but every byte it gets is the old version's."""
    v1 = content("old", 100000)
    put(d / "f", v1)
    r = os.open(d / "f", os.O_RDONLY)
    try:
        assert os.pread(r, 200000, 0) == v1
        w2 = os.open(d / "f", os.O_RDWR | os.O_APPEND)
        try:
            os.ftruncate(w2, 1000)
            got = os.pread(r, 200000, 0)
            assert len(got) >= 1000 and v1.startswith(got), len(got)
            os.write(w2, b"N" * 5000)                 # appends at the new version's end
            assert os.fstat(w2).st_size == 6000
            got = os.pread(r, 200000, 0)
            assert v1.startswith(got), len(got)
        finally:
            os.close(w2)
        got = os.pread(r, 200000, 0)
        assert v1.startswith(got), len(got)
    finally:
        os.close(r)
    assert read(d / "f") == v1[:1000] + b"N" * 5000
