"""Issue 32 (2): a kill -9 loop that never wedges the mount, and what it keeps.

Each cycle runs temp+rename writers of 2 MiB files, a verifying reader and a client whose
buffers are pages of this very mount (an ``mmap`` of one of its files) -- handed to
``.kvfs/commit`` by address and written with O_DIRECT through the mount -- and kills the
daemon with SIGKILL at one of three points: during that I/O, during the write-down of a
clean unmount, and right after a mount. Every cycle has a deadline: a killed daemon, its
notification helper or a client still alive past it is a wedge, reported with the state and kernel stack of each
of its threads, and its FUSE connection is aborted (``/sys/fs/fuse/connections/N/abort``)
so the suite never hangs. After each remount every file -- final names and temp files
alike -- must hold one sealed version whole (its 16-byte header repeated over 2 MiB) or be
absent (docs/design.md, "Durability and crash consistency").
"""
from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import signal
import subprocess
import sys
import time

import pytest

from support.files import MiB, read
from support.mount import lazy_unmount, wait_for, abort_conn

pytestmark = pytest.mark.mount

SIZE = 2 * MiB
UNIT = 16
DEADLINE = 60.0             # seconds a killed daemon (and its clients) may take to go


def body(tag: bytes, version: int) -> bytes:
    """A file of the loop: its 16-byte header (writer tag, version) repeated over 2 MiB."""
    head = (tag + b":%013d" % version)[:UNIT].ljust(UNIT, b".")
    return head * (SIZE // UNIT)


def whole(data: bytes) -> bool:
    return len(data) == SIZE and data == data[:UNIT] * (SIZE // UNIT)


_CLIENT = r"""
import errno, mmap, os, random, sys, threading
from kvfs.kv.commit import CommitClient
mp = sys.argv[1]
SIZE, UNIT = 2 << 20, 16
started = threading.Barrier(4)
stop = threading.Event()            # stdin closed: every thread ends after a whole iteration
def body(tag, v):
    return (tag + b":%013d" % v)[:UNIT].ljust(UNIT, b".") * (SIZE // UNIT)
def quit_on_oserror(fn):
    def run(*a):
        try:
            fn(*a)
        except (OSError, threading.BrokenBarrierError):
            pass
        except BaseException as e:
            print("BAD", repr(e), flush=True)
            os._exit(3)
    return run
@quit_on_oserror
def writer(tag):
    v = 0
    while not stop.is_set():
        tmp, final = os.path.join(mp, tag + ".tmp"), os.path.join(mp, tag + ".bin")
        with open(tmp, "wb") as f:
            f.write(body(tag.encode(), v))
        os.rename(tmp, final)
        v += 1
        if v == 1:
            started.wait()
@quit_on_oserror
def reader():
    names = ["w0.bin", "w1.bin", "m.bin", "d.bin"]
    n = 0
    while not stop.is_set():
        try:
            with open(os.path.join(mp, random.choice(names)), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            continue
        if not (len(data) == SIZE and data == data[:UNIT] * (SIZE // UNIT)):
            print("BAD read", len(data), data[:UNIT], flush=True)
            os._exit(3)
        n += 1
        if n == 1:
            started.wait()
@quit_on_oserror
def self_mapped():
    # buffers that are pages of this mount: committed by address, written with O_DIRECT
    src = os.open(os.path.join(mp, "src.bin"), os.O_RDONLY)
    c = CommitClient(mp)
    k = 0
    while not stop.is_set():
        os.posix_fadvise(src, 0, 0, os.POSIX_FADV_DONTNEED)      # faults reach the daemon
        mm = mmap.mmap(src, SIZE, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
        r = c.commit("", [("m.bin", [memoryview(mm)])])
        if r != [0]:
            print("BAD commit", r, flush=True)
            os._exit(3)
        fd = os.open(os.path.join(mp, "d.tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            os.pwritev(fd, [mm], 0)
        finally:
            os.close(fd)
        os.rename(os.path.join(mp, "d.tmp"), os.path.join(mp, "d.bin"))
        k += 1
        if k == 1:
            started.wait()
ts = [threading.Thread(target=writer, args=("w%d" % i,)) for i in range(2)]
ts += [threading.Thread(target=reader), threading.Thread(target=self_mapped)]
for t in ts:
    t.start()
def going():
    try:
        started.wait()
        print("going", flush=True)
    except threading.BrokenBarrierError:
        pass
threading.Thread(target=going, daemon=True).start()
sys.stdin.read()
stop.set()
try:
    started.abort()
except Exception:
    pass
for t in ts:
    t.join()
"""


def _threads(pid: int) -> dict[int, tuple[str, str]]:
    """``{tid: (state letter, kernel stack or '')}`` of every thread of ``pid``."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        stack = ""
        try:
            with open(f"/proc/{pid}/task/{tid}/stack") as f:
                stack = " <- ".join(line.split()[-1] for line in f.read().splitlines()[:8])
        except OSError:
            pass
        out[int(tid)] = (state, stack)
    return out


def _children(pid: int) -> list[int]:
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def _gone(pid: int) -> bool:
    return all(s in ("Z", "X") for s, _ in _threads(pid).values())




def _deadline(pred, seconds: float) -> bool:
    try:
        wait_for(pred, seconds, "")
        return True
    except AssertionError:
        return False


class Loop:
    def __init__(self, m):
        self.m = m
        self.wedges: list[str] = []
        self.checked = self.absent = self.temps = 0

    def seed(self) -> None:
        if not (self.m.path / "src.bin").exists():
            with open(self.m.path / "src.bin", "wb") as f:
                f.write(body(b"src", 0))

    def start_client(self) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", _CLIENT, str(self.m.path)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def kill(self, cycle: int, conn: int, clients: list) -> None:
        """SIGKILL the daemon; a daemon or client alive past the deadline is a wedge."""
        pid = self.m.pid
        helpers = _children(pid)                # the daemon's notification helper
        with contextlib.suppress(ProcessLookupError):   # an unmount that already finished
            os.kill(pid, signal.SIGKILL)
        for c in clients:
            c.stdin.close()                     # each ends once its I/O failed (ENOTCONN)
        wedged = []
        if not _deadline(lambda: _gone(pid), DEADLINE):
            wedged.append(f"daemon {pid}: {_threads(pid)}")
        for h in helpers:
            if not _deadline(lambda: _gone(h), 0 if wedged else DEADLINE):
                wedged.append(f"helper {h}: {_threads(h)}")
        for c in clients:
            if not _deadline(lambda: c.poll() is not None, 0 if wedged else DEADLINE):
                wedged.append(f"client {c.pid}: {_threads(c.pid)}")
        if wedged:
            self.wedges.append(f"cycle {cycle}: " + "; ".join(wedged))
            abort_conn(conn)
            for c in clients:
                c.kill()
        for c in clients:
            c.wait()
            out = c.stdout.read().decode(errors="replace")
            assert "BAD" not in out, f"cycle {cycle}: a client saw wrong bytes: {out}"
            c.stdout.close()
            c.stderr.close()
        lazy_unmount(self.m.path)
        assert _deadline(lambda: not os.path.ismount(self.m.path), 30), "the dead mount stays"
        self.m.pid = None

    def write_down(self, cycle: int, conn: int) -> None:
        """Kill the daemon while a clean unmount writes RAM-only objects down."""
        log = self.m.state / "kvfs.log"
        mark = log.stat().st_size if log.exists() else 0
        um = subprocess.Popen([sys.executable, "-m", "kvfs.cli", "umount", str(self.m.path)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            def writing_down() -> bool:
                with open(log, "rb") as f:
                    f.seek(mark)
                    return b"writing down" in f.read() or um.poll() is not None
            assert _deadline(writing_down, DEADLINE), f"cycle {cycle}: no write-down began"
            self.kill(cycle, conn, [])
        finally:
            um.wait(timeout=DEADLINE)

    def verify(self, cycle: int) -> None:
        for name in sorted(os.listdir(self.m.path)):
            data = read(self.m.path / name)
            assert whole(data), f"cycle {cycle}: {name} is torn ({len(data)} bytes, head {data[:UNIT]!r})"
            self.checked += 1
            self.temps += name.endswith(".tmp")
        self.absent += sum(not (self.m.path / n).exists() for n in ("w0.bin", "w1.bin", "m.bin", "d.bin"))

    def cycle(self, cycle: int) -> None:
        conn = os.minor(os.stat(self.m.path).st_dev)
        point = cycle % 3
        if point == 2:                          # right after the mount
            self.kill(cycle, conn, [self.start_client()])
        else:
            self.seed()
            c = self.start_client()
            line = c.stdout.readline()
            assert line == b"going\n", f"cycle {cycle}: the client failed: {line!r} {c.stderr.read()!r}"
            if point == 0:                      # during the I/O
                self.kill(cycle, conn, [c])
            else:                               # the client ends; then during the write-down
                c.stdin.close()                 # (killed, its open files would be sealed as
                if not _deadline(lambda: c.poll() is not None, DEADLINE):   # they were at its exit)
                    c.kill()
                    raise AssertionError(f"cycle {cycle}: the client did not stop: {_threads(c.pid)}")
                out = c.stdout.read().decode(errors="replace")
                assert c.returncode == 0 and "BAD" not in out, f"cycle {cycle}: the client failed: {out}"
                c.stdout.close()
                c.stderr.close()
                self.write_down(cycle, conn)
        self.m.mount()
        self.verify(cycle)


def _kill_loop(kvfs_mount, cycles: int) -> None:
    m = kvfs_mount(ram="8MiB", nvme_size="256MiB")
    loop = Loop(m)
    t0 = time.monotonic()
    for cycle in range(cycles):
        loop.cycle(cycle)
    print(f"kill -9 loop: {cycles} cycles, {len(loop.wedges)} wedges, {loop.checked} files checked "
          f"whole ({loop.temps} temp files), {loop.absent} final names absent, "
          f"{time.monotonic() - t0:.0f} s")
    assert not loop.wedges, "\n".join(loop.wedges)


def test_kill_loop_with_self_mapped_buffers_never_wedges(kvfs_mount):
    _kill_loop(kvfs_mount, 9)


@pytest.mark.slow
def test_kill_loop_with_self_mapped_buffers_never_wedges_long(kvfs_mount):
    _kill_loop(kvfs_mount, 102)


def test_commit_by_address_of_a_mapping_of_this_mount_is_exdev_and_the_client_copies_it(kvfs_mount):
    """The daemon never reads a range the caller mapped from a file of this mount (its own
    copier would fault pages only its own loop can serve): EXDEV; ``CommitClient`` then sends
    that buffer through its memfd and keeps naming its other buffers by address."""
    from kvfs.kv.commit import CommitClient
    m = kvfs_mount()
    with open(m.path / "src", "wb") as f:
        f.write(body(b"src", 7))
    fd = os.open(m.path / "src", os.O_RDONLY)
    mm = mmap.mmap(fd, SIZE, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
    anon = mmap.mmap(-1, SIZE)
    anon[:] = body(b"anon", 1)
    try:
        import ctypes
        at = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        mine = ctypes.addressof(ctypes.c_char.from_buffer(anon))
        ctl = os.open(m.path / ".kvfs" / "commit", os.O_RDWR)
        try:
            os.pwrite(ctl, b"\0mem\n%d %d a\n%d %d b\n%d+4096,%d+%d %d c\n"
                      % (at, SIZE, mine, SIZE, mine, at + 4096, SIZE - 4096, SIZE), 0)
            assert json.loads(os.pread(ctl, 1 << 16, 0))["results"] == [errno.EXDEV, 0, errno.EXDEV]
        finally:
            os.close(ctl)
        assert not (m.path / "a").exists() and read(m.path / "b") == body(b"anon", 1)
        c = CommitClient(str(m.path))
        try:
            assert c.commit("", [("x", [memoryview(mm)]), ("y", [memoryview(anon)])]) == [0, 0]
            assert c.use_memory, "one buffer of the mount turned the client off naming memory"
        finally:
            c.close()
        assert read(m.path / "x") == body(b"src", 7) and read(m.path / "y") == body(b"anon", 1)
    finally:
        mm.close()
        anon.close()
        os.close(fd)


def test_a_file_never_closed_before_kill9_is_absent_or_its_previous_sealed_version(kvfs_mount):
    """The torn temp file of issue 32: a 2 MiB file whose writer had not closed it when the
    daemon was killed is, after recovery, absent (new) or its previous sealed version (opened
    over one: with O_TRUNC, or without -- a new header over the old body, the torn shape), never
    the unfinished write; a reader's close meanwhile seals nothing."""
    m = kvfs_mount(ram="1MiB", nvme_size="256MiB")      # 2 MiB buffers spill to NVMe
    p = m.path
    for name in ("trunc.tmp", "over.tmp", "done.tmp"):
        with open(p / name, "wb") as f:
            f.write(body(b"v1", 1))
        wait_for(lambda: os.getxattr(p / name, "user.kvfs.tier") == b"nvme", 60, f"{name} on NVMe")
    fds = [os.open(p / "new.tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644),
           os.open(p / "trunc.tmp", os.O_WRONLY | os.O_TRUNC),
           os.open(p / "over.tmp", os.O_WRONLY)]
    try:
        new = body(b"v2", 2)
        for fd in fds:
            os.pwrite(fd, new[:UNIT], 0)                 # the header first
            r = os.open(p / "new.tmp", os.O_RDONLY)      # a reader opens and closes meanwhile
            os.close(r)
            os.pwrite(fd, new[:MiB][UNIT:], UNIT)         # half the body
        with open(p / "done.tmp", "r+b") as f:           # closed: its new version is sealed
            f.write(new)
        m.stats()                                        # the index committed
        m.kill9()
    finally:
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass                                     # ENOTCONN: the daemon is gone
    m.mount()
    assert not (p / "new.tmp").exists(), "a file never closed survived its writer's crash"
    assert read(p / "trunc.tmp") == body(b"v1", 1)
    assert read(p / "over.tmp") == body(b"v1", 1)
    assert read(p / "done.tmp") == new
