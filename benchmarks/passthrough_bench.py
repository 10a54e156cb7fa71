"""FUSE passthrough on this kernel: what works (probe) and what it is worth (bench), issue 30.

    python benchmarks/passthrough_bench.py probe [--json out.json]
    python benchmarks/passthrough_bench.py bench [--runs 7] [--small 200] [--json out.json]
    python benchmarks/passthrough_bench.py disk [--runs 7] [--files 16] [--json out.json]
    python benchmarks/passthrough_bench.py opens [--opens 2000] [--json out.json]

As root (the spike mounts with mount(2); the probe also mounts a tmpfs and flips a module
parameter, restoring it). Each subcommand cleans up its mounts and scratch directories.

``probe`` mounts the spike server (benchmarks/passthrough_spike.py) and checks, counting the
requests that reach it: does passthrough negotiate; do read, pread, readv, O_DIRECT, mmap
(shared and private), sendfile and splice of an open file reach the daemon (backings on tmpfs,
a huge-page tmpfs, ext4); what a reader holding the file open sees when its backing file is
replaced or unlinked (and when tmpfs frees the space, when RELEASE comes, what page cache a
read adds); what happens when the daemon closes a backing id under a reader; writes through a
passthrough file; what the registration needs (CAP_SYS_ADMIN, a negotiated connection); whose
permissions count; and whether FUSE-over-io_uring can be negotiated (the fuse module's
``enable_uring``: global, set and restored).

``bench`` measures in one run, interleaved, medians of ``--runs``: open + readinto + close of
a 2 MiB and a 64 MiB file just written (tmpfs directly, the spike with passthrough, the spike
answering READ from Python, the current kvfs mount with a 256 MiB RAM tier), a second read of
the same file, an mmap read, and open + read + close of 32 KiB files (first open of each, then
again). Buffers are page aligned and warmed; the load average is reported before and after.

``disk`` reads 2 MiB files on ext4 (/var/tmp) with O_DIRECT after dropping their pages, then
buffered twice: the directory itself, the spike with passthrough over it, the spike's READ.
``opens`` times open + read 4 KiB + close of one file already open once (10th percentile and
median): the per-open cost that remains with passthrough.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from kvfs.bench import BenchMount, aligned_buffer, forget_pages  # noqa: E402
from kvfs.bench import read_file as bench_read, write_file as bench_write  # noqa: E402

SPIKE = Path(__file__).resolve().parent / "passthrough_spike.py"
URING = Path("/sys/module/fuse/parameters/enable_uring")
MiB = 1 << 20


def wait_until(pred, timeout: float = 30.0, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return False


class SpikeMount:
    """The spike server in a subprocess, mounted at ``mnt`` over the files of ``backing``."""

    def __init__(self, mnt: Path, backing: Path, *flags: str):
        self.mnt, self.backing, self.flags = mnt, backing, flags
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "SpikeMount":
        self.mnt.mkdir(parents=True, exist_ok=True)
        self.backing.mkdir(parents=True, exist_ok=True)
        self.log = open(self.mnt.parent / f"{self.mnt.name}.log", "w+b")   # never a full pipe
        self.proc = subprocess.Popen([sys.executable, str(SPIKE), str(self.mnt), str(self.backing),
                                      *self.flags], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=self.log)
        if not wait_until(lambda: os.path.ismount(self.mnt) or self.proc.poll() is not None):
            self.__exit__(None, None, None)
            raise RuntimeError("spike did not mount")
        if self.proc.poll() is not None:
            self.log.seek(0)
            raise RuntimeError(f"spike failed: {self.log.read().decode()}")
        self.stats()                                     # INIT has been answered once this returns
        dev = os.stat(self.mnt).st_dev                   # 1 MiB read-ahead, as kvfs sets it
        with open(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb", "w") as f:
            f.write("1024")
        return self

    def stats(self) -> dict:
        """The spike's counters (this read is itself one READ request, counted in them)."""
        fd = os.open(self.mnt / ".spike", os.O_RDONLY)
        try:
            return json.loads(os.pread(fd, 1 << 20, 0))
        finally:
            os.close(fd)

    def __exit__(self, *exc) -> None:
        subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], capture_output=True)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.log.close()


def cpu_seconds(pid: int) -> float:
    """User + system CPU a process has used (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def write_file(path: Path, buf, size: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(buf)
        off = 0
        while off < size:
            off += os.write(fd, view[off:min(size, off + 4 * MiB)])
    finally:
        os.close(fd)


def read_whole(path: Path, buf, size: int, split: list | None = None) -> float:
    """open + readinto (1 MiB at a time) + close into a page-aligned buffer; seconds
    (``split`` gets [open + close, the reads alone])."""
    view = memoryview(buf)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    t1 = time.perf_counter()
    off = 0
    while off < size:
        n = os.readv(fd, [view[off:min(size, off + MiB)]])
        if n <= 0:
            raise OSError(f"short read of {path} at {off}")
        off += n
    t2 = time.perf_counter()
    os.close(fd)
    t3 = time.perf_counter()
    if split is not None:
        split[:] = [t1 - t0 + t3 - t2, t2 - t1]
    return t3 - t0


def mmap_whole(path: Path, buf, size: int, flags: int = mmap.MAP_SHARED) -> float:
    """open + mmap + copy every byte into a page-aligned buffer + munmap + close; seconds."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
    view, src = memoryview(buf), memoryview(mm)
    for off in range(0, size, 4 * MiB):                  # memoryview copies: no bytes objects
        end = min(size, off + 4 * MiB)
        view[off:end] = src[off:end]
    src.release()
    view.release()
    mm.close()
    os.close(fd)
    return time.perf_counter() - t0


# -- probe ----------------------------------------------------------------------------------
def _method(name: str, path: Path, size: int) -> bytes:
    """Read the whole of ``path`` by one method; returns the bytes."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if name == "read":
            return b"".join(iter(lambda: os.read(fd, MiB), b""))
        if name == "pread":
            return os.pread(fd, size, 0)
        if name == "readv":
            bufs = [bytearray(size // 2), bytearray(size - size // 2)]
            os.readv(fd, bufs)
            return bytes(bufs[0] + bufs[1])
        if name == "odirect":
            os.close(fd)
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            buf = mmap.mmap(-1, size)
            n = os.preadv(fd, [buf], 0)
            return bytes(buf[:n])
        if name in ("mmap_shared", "mmap_private"):
            flag = mmap.MAP_SHARED if name == "mmap_shared" else mmap.MAP_PRIVATE
            with mmap.mmap(fd, size, flags=flag, prot=mmap.PROT_READ) as mm:
                return bytes(mm)
        a, b = socket.socketpair() if name == "sendfile" else os.pipe2(0) + ()
        out = bytearray()
        if name == "sendfile":
            a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
            off = 0
            while off < size:
                off += os.sendfile(a.fileno(), fd, off, min(size - off, 1 << 16))
                out += b.recv(1 << 20)
            while len(out) < size:
                out += b.recv(1 << 20)
            a.close(), b.close()
            return bytes(out)
        r, w = a, b                                      # splice file -> pipe
        while len(out) < size:
            n = os.splice(fd, w, 1 << 16)
            if n == 0:
                break
            out += os.read(r, n)
        os.close(r), os.close(w)
        return bytes(out)
    finally:
        os.close(fd)


METHODS = ("read", "pread", "readv", "odirect", "mmap_shared", "mmap_private", "sendfile", "splice")


def probe_methods(m: SpikeMount, size: int = 2 * MiB) -> dict:
    out = {}
    for i, name in enumerate(METHODS):
        data = os.urandom(size)
        (m.backing / f"m{i}.bin").write_bytes(data)
        before = m.stats()
        try:
            got = _method(name, m.mnt / f"m{i}.bin", size)
            ok = got == data
        except OSError as e:
            ok = f"{type(e).__name__}: {e}"
        after = m.stats()
        reads = after["requests"].get("read", 0) - before["requests"].get("read", 0) - 1
        out[name] = {"bytes_ok": ok, "read_requests": reads,
                     "passthrough_opens": after["passthrough_opens"] - before["passthrough_opens"]}
    return out


def _which(got: bytes, old: bytes, new: bytes) -> str:
    return "old" if got == old else "new" if got == new else "mix"


def _try_read(path: Path) -> bytes | str:
    try:
        return path.read_bytes()
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror}"


def probe_versions(m: SpikeMount) -> dict:
    """A reader holding a file open (fd and mapping) while its backing file is replaced and
    unlinked behind the kernel's back (the FUSE inode stays the same): what it sees, what a
    second open of that inode gets, when tmpfs frees the space."""
    size = 64 * MiB
    old, new = os.urandom(MiB) * 64, os.urandom(MiB) * 64
    (m.backing / "v.bin").write_bytes(old)
    fd = os.open(m.mnt / "v.bin", os.O_RDONLY)
    mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    (m.backing / "v.tmp").write_bytes(new)
    os.replace(m.backing / "v.tmp", m.backing / "v.bin")
    second = _try_read(m.mnt / "v.bin")
    res = {"held_fd_after_replace": _which(os.pread(fd, size, 0), old, new),
           "held_mmap_after_replace": _which(mm[:], old, new),
           "second_open_same_inode_new_backing": second if isinstance(second, str)
           else _which(second, old, new)}
    os.unlink(m.backing / "v.bin")
    free0 = shutil.disk_usage(m.backing).free
    res["held_fd_after_unlink"] = _which(os.pread(fd, size, 0), old, new)
    os.close(fd)
    free1 = shutil.disk_usage(m.backing).free
    mm.close()
    freed = wait_until(lambda: shutil.disk_usage(m.backing).free - free0 >= size - MiB, 10)
    res["tmpfs_MiB_freed"] = {"after_close_still_mapped": (free1 - free0) // MiB,
                              "after_munmap": (shutil.disk_usage(m.backing).free - free0) // MiB,
                              "freed_within_10s": freed}
    (m.backing / "v.bin").write_bytes(new)
    third = _try_read(m.mnt / "v.bin")
    res["open_after_all_closed"] = third if isinstance(third, str) else _which(third, old, new)
    return res


def probe_uring(root: Path) -> dict:
    """Can root turn the fuse module's ``enable_uring`` on, does INIT then offer
    FUSE_OVER_IO_URING, and what happens to a daemon that accepts it and keeps reading
    /dev/fuse (no ring registered)? The parameter is global: always restored."""
    res = {"enable_uring_was": URING.read_text().strip() if URING.exists() else None,
           "io_uring_disabled": Path("/proc/sys/kernel/io_uring_disabled").read_text().strip()}
    if res["enable_uring_was"] is None:
        return res
    mnt, back = root / "mnt-uring", root / "back-uring"
    mnt.mkdir(parents=True, exist_ok=True)
    back.mkdir(parents=True, exist_ok=True)
    proc = None
    try:
        URING.write_text("Y")
        res["enable_uring_set"] = URING.read_text().strip()
        proc = subprocess.Popen([sys.executable, str(SPIKE), str(mnt), str(back), "--uring"],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
        wait_until(lambda: f" {mnt} " in Path("/proc/self/mountinfo").read_text()
                   or proc.poll() is not None)      # not ismount: its stat would wait too
        try:                                             # the first request after INIT
            done = subprocess.run(["cat", str(mnt / ".spike")], capture_output=True, timeout=5)
            res["request_after_init"] = f"answered (rc {done.returncode})"
        except subprocess.TimeoutExpired:
            res["request_after_init"] = "hangs (the kernel waits for a registered ring)"
    except OSError as e:
        res["error"] = f"{type(e).__name__}: {e}"
    finally:
        if proc is not None:                             # kill first: that aborts the connection
            proc.kill()
            err = proc.communicate()[1].decode()
            for line in err.splitlines():
                if line.startswith('{"init"'):
                    init = json.loads(line)["init"]
                    res["kernel_offered_over_io_uring"] = init["kernel"]["over_io_uring"]
                    res["negotiated"] = init["negotiated"]
        res["umount"] = subprocess.run(["umount", "-l", str(mnt)], capture_output=True,
                                       text=True, timeout=30).stderr.strip() or "ok"
        URING.write_text(res["enable_uring_was"])
        res["enable_uring_restored"] = URING.read_text().strip()
    return res


def _write_into(path: Path, buf, size: int) -> float:
    """open O_WRONLY (existing file, no truncate) + write 1 MiB at a time + close; seconds."""
    view = memoryview(buf)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY)
    off = 0
    while off < size:
        off += os.write(fd, view[off:off + MiB])
    os.close(fd)
    return time.perf_counter() - t0


def probe_writes(root: Path, runs: int = 5) -> dict:
    """64 MiB written into an existing empty file opened write-only (the spike has no CREATE):
    do the writes reach the daemon, do the bytes land in the backing file, does the mount see
    the new size, and how fast (GB/s, median of ``runs``) against tmpfs."""
    size = 64 * MiB
    buf = aligned_buffer(size)
    direct = root / "w-tmpfs"
    direct.mkdir(parents=True, exist_ok=True)
    res: dict = {}
    with SpikeMount(root / "mnt-wp", root / "back-wp", "--writable") as pt, \
            SpikeMount(root / "mnt-wy", root / "back-wy", "--writable", "--no-passthrough") as py:
        rows: dict = {"tmpfs": [], "passthrough": [], "python_write": []}
        for run in range(runs + 1):
            for name, wdir, rdir in (("tmpfs", direct, direct), ("passthrough", pt.backing, pt.mnt),
                                     ("python_write", py.backing, py.mnt)):
                (wdir / "w.bin").write_bytes(b"")        # an empty file: every write extends it
                os.stat(rdir / "w.bin")                  # its attributes cached: size 0
                before = pt.stats() if name == "passthrough" else py.stats()
                dt = _write_into(rdir / "w.bin", buf, size)
                if run:
                    rows[name].append(size / dt / 1e9)
                if run == 0 and name != "tmpfs":
                    m = pt if name == "passthrough" else py
                    after = m.stats()
                    res[name] = {"write_requests": after["requests"].get("write", 0)
                                 - before["requests"].get("write", 0),
                                 "bytes_in_backing_ok": (wdir / "w.bin").read_bytes() == bytes(buf[:size]),
                                 "size_seen_through_mount": os.stat(rdir / "w.bin").st_size,
                                 "backing_error": after["backing_error"]}
        res["GBps"] = {n: round(med(v), 2) for n, v in rows.items()}
    return res


def probe_close_id_while_open(root: Path) -> dict:
    """Per-inode backing ids closed by the daemon (as at eviction) while a reader holds the
    file open and mapped: does the reader go on, and what does a new open of that inode get
    (the daemon registers the same file again: a second backing for the inode)?"""
    res: dict = {}
    with SpikeMount(root / "mnt-ci", root / "back-ci", "--per-inode") as m:
        data = os.urandom(2 * MiB)
        (m.backing / "e.bin").write_bytes(data)
        fd = os.open(m.mnt / "e.bin", os.O_RDONLY)
        mm = mmap.mmap(fd, len(data), prot=mmap.PROT_READ)
        closes = m.stats()["backing_closes"]
        try:
            os.stat(m.mnt / ".close-backings")
        except FileNotFoundError:
            pass
        res["ids_closed"] = m.stats()["backing_closes"] - closes
        res["held_fd_after_id_close"] = os.pread(fd, len(data), 0) == data
        res["held_mmap_after_id_close"] = mm[:] == data
        second = _try_read(m.mnt / "e.bin")
        res["new_open_new_id_while_held"] = second if isinstance(second, str) else second == data
        mm.close()
        os.close(fd)
        wait_until(lambda: m.stats()["data_releases"] >= 2, 10)
        m.stats()
        try:
            os.stat(m.mnt / ".close-backings")
        except FileNotFoundError:
            pass
        third = _try_read(m.mnt / "e.bin")
        res["new_open_new_id_after_release"] = third if isinstance(third, str) else third == data
    return res


def _cached_mib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Cached:"):
            return int(line.split()[1]) // 1024
    return 0


def probe_memory_and_release(m: SpikeMount) -> dict:
    """Page cache added by reading a 256 MiB tmpfs-backed file through the mount (a second
    copy of the bytes, or none), and when RELEASE comes for a file closed while mapped."""
    size = 256 * MiB
    (m.backing / "big.bin").write_bytes(os.urandom(MiB) * 256)
    before = _cached_mib()
    fd = os.open(m.mnt / "big.bin", os.O_RDONLY)
    buf = mmap.mmap(-1, 4 * MiB)
    off = 0
    while off < size:
        off += os.preadv(fd, [buf], off)
    res = {"page_cache_added_MiB": _cached_mib() - before}
    mm = mmap.mmap(fd, 4096, prot=mmap.PROT_READ)
    s0 = m.stats()["data_releases"]
    os.close(fd)
    closed = wait_until(lambda: m.stats()["data_releases"] > s0, 1)
    mm.close()
    res["release_at_close_while_mapped"] = closed
    res["release_after_munmap"] = closed or wait_until(lambda: m.stats()["data_releases"] > s0, 10)
    os.unlink(m.backing / "big.bin")
    return res


def _as_nobody(path: Path) -> str:
    """``cat`` of ``path`` as uid/gid 65534: "ok" with the bytes' length, or its error."""
    res = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                          "cat", str(path)], capture_output=True, timeout=30)
    return f"ok ({len(res.stdout)} bytes)" if res.returncode == 0 else res.stderr.decode().strip()


def probe_users(root: Path) -> dict:
    """Whose permissions count: the backing file is 0600 root; the FUSE file 0444 (daemon
    checks nothing) or 0400 with default_permissions (the kernel checks at open)."""
    res = {}
    for label, flags in (("fuse_0444", ()), ("fuse_0400_default_permissions", ("--private",))):
        with SpikeMount(root / f"mnt-u{len(res)}", root / f"back-u{len(res)}", *flags) as m:
            os.chmod(m.backing.parent, 0o755)
            (m.backing / "p.bin").write_bytes(b"p" * 8192)
            os.chmod(m.backing / "p.bin", 0o600)
            res[label] = {"nobody_reads_through_mount": _as_nobody(m.mnt / "p.bin"),
                          "nobody_reads_backing_directly": _as_nobody(m.backing / "p.bin"),
                          "passthrough_opens": m.stats()["passthrough_opens"]}
    return res


def probe(root: Path) -> dict:
    res: dict = {"kernel": os.uname().release}
    with SpikeMount(root / "mnt", root / "back") as m:
        res["negotiation"] = {k: m.stats()[k] for k in ("kernel", "negotiated")}
        res["methods"] = probe_methods(m)
        res["versions"] = probe_versions(m)
        res["backing_error"] = m.stats()["backing_error"]
        res["memory_release"] = probe_memory_and_release(m)
    with SpikeMount(root / "mnt-np", root / "back-np", "--no-passthrough") as m:
        res["methods_no_passthrough"] = probe_methods(m)
        res["versions_no_passthrough"] = probe_versions(m)
        res["memory_release_no_passthrough"] = probe_memory_and_release(m)
    with SpikeMount(root / "mnt-ce", root / "back-ce", "--close-early") as m:
        res["close_daemon_fd_early"] = {"methods": probe_methods(m), "versions": probe_versions(m)}
    with SpikeMount(root / "mnt-cap", root / "back-cap", "--drop-sys-admin") as m:
        (m.backing / "c.bin").write_bytes(b"c" * 8192)
        ok = (m.mnt / "c.bin").read_bytes() == b"c" * 8192
        s = m.stats()
        res["without_cap_sys_admin"] = {"backing_error": s["backing_error"], "read_ok": ok,
                                        "passthrough_opens": s["passthrough_opens"],
                                        "negotiated": s["negotiated"]["passthrough"]}
    with SpikeMount(root / "mnt-nn", root / "back-nn", "--no-passthrough", "--ioctl-anyway") as m:
        (m.backing / "n.bin").write_bytes(b"n" * 8192)
        ok = (m.mnt / "n.bin").read_bytes() == b"n" * 8192
        res["not_negotiated_registration"] = {"backing_error": m.stats()["backing_error"],
                                              "read_ok": ok}
    res["close_id_while_open"] = probe_close_id_while_open(root)
    res["writes"] = probe_writes(root)
    res["users"] = probe_users(root)
    ext4 = Path(tempfile.mkdtemp(prefix="passthru-ext4-", dir="/var/tmp"))
    try:
        with SpikeMount(root / "mnt-ext4", ext4 / "back") as m:
            res["methods_ext4_backing"] = probe_methods(m)
    finally:
        shutil.rmtree(ext4, ignore_errors=True)
    huge = root / "huge"                                 # kvfs's RAM tier as root: huge pages
    huge.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m,huge=within_size,mode=0755",
                       "kvfs-spike-huge", str(huge)], capture_output=True).returncode == 0:
        try:
            with SpikeMount(root / "mnt-huge", huge / "back") as m:
                res["methods_huge_tmpfs_backing"] = probe_methods(m)
        finally:
            subprocess.run(["umount", "-l", str(huge)], capture_output=True)
    res["uring"] = probe_uring(root)
    return res


# -- bench ----------------------------------------------------------------------------------
def med(xs: list[float]) -> float:
    return statistics.median(xs)


class Target:
    """Where a system's files are written (``write_dir``) and read back (``read_dir``)."""

    def __init__(self, name: str, write_dir: Path, read_dir: Path):
        self.name, self.write_dir, self.read_dir = name, write_dir, read_dir


def bench_large(targets: list[Target], sizes: list[int], runs: int, buf) -> dict:
    """Per size and target: the read just after the write (``first``; its name looked up
    before, as a runtime's existence check does) and a re-read (``again``), each as GB/s of
    open + reads + close, GB/s of the reads alone (``_reads``) and µs of open + close
    (``_open_close_us``); an mmap read (GB/s)."""
    res: dict = {}
    check = bytes(buf[:2 * MiB])
    keys = [f"{w}{k}" for w in ("first", "again") for k in ("", "_reads", "_open_close_us")]
    for size in sizes:
        rows = {t.name: {k: [] for k in keys + ["mmap"]} for t in targets}
        for run in range(runs + 1):                      # run 0 warms up and checks bytes
            for t in targets:
                name = f"L{size >> 20}_{run}.bin"
                write_file(t.write_dir / name, buf, size)
                os.stat(t.read_dir / name)
                for which in ("first", "again"):
                    split: list = []
                    total = read_whole(t.read_dir / name, buf, size, split)
                    if run == 0 and bytes(buf[:2 * MiB]) != check:
                        raise RuntimeError(f"{t.name}: wrong bytes")
                    if run:
                        r = rows[t.name]
                        r[which].append(size / total / 1e9)
                        r[f"{which}_reads"].append(size / split[1] / 1e9)
                        r[f"{which}_open_close_us"].append(split[0] * 1e6)
                mm = mmap_whole(t.read_dir / name, buf, size)
                if run:
                    rows[t.name]["mmap"].append(size / mm / 1e9)
                os.unlink(t.write_dir / name)
        res[f"{size >> 20}MiB"] = {n: {k: round(med(v), 2) for k, v in r.items()} for n, r in rows.items()}
    return res


def bench_small(targets: list[Target], count: int, runs: int, buf) -> dict:
    """µs per file of open + read 32 KiB + close: first open of each file, then again."""
    size = 32 << 10
    rows = {t.name: {"first": [], "again": []} for t in targets}
    for run in range(runs + 1):
        for t in targets:
            names = [f"S{run}_{i}.bin" for i in range(count)]
            for n in names:
                write_file(t.write_dir / n, buf, size)
            for key in ("first", "again"):
                t0 = time.perf_counter()
                for n in names:
                    read_whole(t.read_dir / n, buf, size)
                if run:
                    rows[t.name][key].append((time.perf_counter() - t0) / count * 1e6)
            for n in names:
                os.unlink(t.write_dir / n)
    return {n: {k: round(med(v), 1) for k, v in r.items()} for n, r in rows.items()}


def bench(root: Path, runs: int, count: int) -> dict:
    buf = aligned_buffer(64 * MiB)
    res: dict = {"kernel": os.uname().release, "cpus": os.cpu_count(), "runs": runs,
                 "load_before": os.getloadavg()}
    direct = root / "tmpfs"
    direct.mkdir(parents=True, exist_ok=True)
    with SpikeMount(root / "mnt-pt", root / "back-pt") as pt, \
            SpikeMount(root / "mnt-pi", root / "back-pi", "--per-inode") as pi, \
            SpikeMount(root / "mnt-pn", root / "back-pn", "--per-inode", "--noflush") as pn, \
            SpikeMount(root / "mnt-py", root / "back-py", "--no-passthrough") as py, \
            BenchMount(root / "kvfs", ram="256MiB", nvme_size="1GiB") as kv:
        spikes = {"passthrough": pt, "passthrough_inode": pi, "passthrough_inode_noflush": pn,
                  "python_read": py}
        targets = [Target("tmpfs", direct, direct),
                   *(Target(n, m.backing, m.mnt) for n, m in spikes.items()),
                   Target("kvfs", kv.path, kv.path)]
        pids = {**{n: m.proc.pid for n, m in spikes.items()}, "kvfs": kv.pid}
        cpu0 = {n: cpu_seconds(pid) for n, pid in pids.items()}
        res["large"] = bench_large(targets, [2 * MiB, 64 * MiB], runs, buf)
        res["small_32KiB_us"] = bench_small(targets, count, runs, buf)
        res["spikes"] = {n: m.stats() for n, m in spikes.items()}
        res["daemon_cpu_s"] = {n: round(cpu_seconds(pid) - cpu0[n], 2) for n, pid in pids.items()}
    res["load_after"] = os.getloadavg()
    return res


def bench_disk(root: Path, runs: int, files: int) -> dict:
    """2 MiB files on the disk (ext4, the NVMe tier's kind of filesystem): GB/s of open +
    read + close with O_DIRECT (the files' pages dropped first; vLLM's fs tier reads so), then
    buffered (from the disk: O_DIRECT left no pages), then buffered again (page-cache hot); the
    directory itself against the spike over it."""
    size, buf = 2 * MiB, aligned_buffer(2 * MiB)
    disk = Path(tempfile.mkdtemp(prefix="passthru-disk-", dir="/var/tmp"))
    res: dict = {"load_before": os.getloadavg(), "files": files, "runs": runs}
    try:
        with SpikeMount(root / "mnt-dp", disk / "back-pt", "--per-inode", "--noflush") as pt, \
                SpikeMount(root / "mnt-dy", disk / "back-py", "--no-passthrough") as py:
            (disk / "ext4").mkdir()
            targets = [Target("ext4", disk / "ext4", disk / "ext4"),
                       Target("passthrough_inode_noflush", pt.backing, pt.mnt),
                       Target("python_read", py.backing, py.mnt)]
            rows = {t.name: {"direct": [], "buffered": [], "hot": []} for t in targets}
            for run in range(runs + 1):
                for t in targets:
                    names = [f"D{run}_{i}.bin" for i in range(files)]
                    for n in names:
                        bench_write(t.write_dir / n, buf, size, size, fsync=True)
                        forget_pages(t.write_dir / n)
                    for key, direct in (("direct", True), ("buffered", False), ("hot", False)):
                        t0 = time.perf_counter()
                        for n in names:
                            bench_read(t.read_dir / n, buf, MiB, size, direct=direct)
                        if run:
                            rows[t.name][key].append(size * files / (time.perf_counter() - t0) / 1e9)
                    for n in names:
                        os.unlink(t.write_dir / n)
            res["GBps"] = {n: {k: round(med(v), 2) for k, v in r.items()} for n, r in rows.items()}
            res["spikes"] = {"passthrough_inode_noflush": pt.stats()["requests"],
                             "python_read": py.stats()["requests"]}
    finally:
        shutil.rmtree(disk, ignore_errors=True)
    res["load_after"] = os.getloadavg()
    return res


def bench_opens(root: Path, count: int) -> dict:
    """µs of open + read 4 KiB + close of one 2 MiB file already looked up, ``count`` times per
    target, interleaved in rounds of 100: 10th percentile and median (the 10th percentile is
    what a request costs when the machine lets the daemon run at once)."""
    size, buf = 2 * MiB, aligned_buffer(2 * MiB)
    direct = root / "o-tmpfs"
    direct.mkdir(parents=True, exist_ok=True)
    res: dict = {"load_before": os.getloadavg(), "count": count}
    with SpikeMount(root / "mnt-op", root / "back-op") as pt, \
            SpikeMount(root / "mnt-oi", root / "back-oi", "--per-inode", "--noflush") as pn, \
            SpikeMount(root / "mnt-oy", root / "back-oy", "--no-passthrough") as py, \
            BenchMount(root / "kvfs-o", ram="256MiB", nvme_size="1GiB") as kv:
        targets = [Target("tmpfs", direct, direct), Target("passthrough", pt.backing, pt.mnt),
                   Target("passthrough_inode_noflush", pn.backing, pn.mnt),
                   Target("python_read", py.backing, py.mnt), Target("kvfs", kv.path, kv.path)]
        times: dict = {t.name: [] for t in targets}
        for t in targets:
            write_file(t.write_dir / "o.bin", buf, size)
            read_whole(t.read_dir / "o.bin", buf, size)          # looked up, cached, registered
        view = memoryview(buf)[:4096]
        for _ in range(max(1, count // 100)):
            for t in targets:
                path = t.read_dir / "o.bin"
                for _ in range(100):
                    t0 = time.perf_counter()
                    fd = os.open(path, os.O_RDONLY)
                    os.readv(fd, [view])
                    os.close(fd)
                    times[t.name].append((time.perf_counter() - t0) * 1e6)
        view.release()
        for t in targets:
            xs = sorted(times[t.name])
            res[t.name] = {"p10_us": round(xs[len(xs) // 10], 1), "median_us": round(med(xs), 1)}
        res["requests"] = {"passthrough": pt.stats()["requests"],
                           "passthrough_inode_noflush": pn.stats()["requests"],
                           "python_read": py.stats()["requests"]}
    res["load_after"] = os.getloadavg()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=("probe", "bench", "disk", "opens"))
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--small", type=int, default=200, help="32 KiB files per run")
    ap.add_argument("--files", type=int, default=16, help="2 MiB files per run (disk)")
    ap.add_argument("--opens", type=int, default=2000, help="opens per target (opens)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))   # run the finally clauses
    root = Path(tempfile.mkdtemp(prefix="passthru-", dir="/dev/shm"))
    try:
        if args.what == "probe":
            res = probe(root)
        elif args.what == "opens":
            res = bench_opens(root, args.opens)
        elif args.what == "disk":
            res = bench_disk(root, args.runs, args.files)
        else:
            res = bench(root, args.runs, args.small)
    finally:
        for mnt in root.glob("mnt*"):
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
    text = json.dumps(res, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
