"""What a runtime gets from a kvfs mount, against the floor of a Python FUSE daemon and a plain directory.

    python benchmarks/runtime_patterns.py [--quick] [--rounds 5] [--dir DIR] [--json FILE]
                                          [--targets kvfs,kvfs_pyfuse3,...]
    kvfs bench --only runtime [--quick]            (the same on every target, through the CLI)

The storage patterns of inference runtimes, run in ONE run on six targets, interleaved
(every round runs each pattern on every target, in a rotated order) and repeated:

- ``kvfs``: a kvfs mount through the CLI with ``passthrough = true`` (kvfs's own FUSE transport
  with FUSE passthrough where the kernel offers it; ``.kvfs/stats`` says which it got);
- ``kvfs_before`` (only with ``--before DIR``): the ``kvfs`` target run by the code of another
  checkout (e.g. ``git archive`` of the commit before a change), so before and after share one
  run, interleaved;
- ``kvfs_wb`` (only when ``--targets`` names it): the same with ``writeback_cache = true``
  instead of passthrough (the kernel allows one or the other): the writeback-cache experiment
  of docs/design.md "How a read travels" (``--targets kvfs,kvfs_wb,plain``);
- ``kvfs_pyfuse3``: the same with ``transport = "pyfuse3"``: the path before passthrough,
  every READ answered by the daemon, so kvfs / kvfs on pyfuse3 shows what issue 30 changed;
- ``floor``: benchmarks/floorfs.py, an in-memory pyfuse3 + trio filesystem with kvfs's
  timeouts, mount options and read-ahead, served by ``pyfuse3.main``: what any Python FUSE
  daemon costs here with pyfuse3's own request loop;
- ``floor_kl``: the same floor served by kvfs's request loop (kvfs.fs.loop), so that kvfs /
  floor_kl is what kvfs's handlers cost beyond a daemon with the same loop;
- ``plain``: a plain directory on the filesystem that holds the kvfs NVMe tier;
- ``tmpfs``: a directory in /dev/shm.

Patterns: (a) create + write 32 KiB / 2 MiB + close + rename, 1 and 4 threads; (b) first
``stat`` of a file right after its write; (c) ``stat`` of files written at the start of the
run; (d) repeated ``os.path.exists`` of missing names; (e) open + one ``readinto`` of 2 MiB
right after the write, and again later; (e-mmap) open + ``mmap`` (``MAP_SHARED``) + a
memoryview copy of the whole 2 MiB (every page touched) right after the write; (f) vLLM's
store (O_DIRECT probe, O_EXCL temp ``<h>.bin_<rand>.tmp``, page-aligned buffer, one write, rename, 16 threads racing ``makedirs``
of ``h[:3]/h[3:5]_g0``) and its existence checks; (g) LMCache's (write in place, 4 threads;
O_DIRECT reads); (h) ``kvfs.KVCache.save`` + ``flush`` of 32 KiB and 2 MiB blocks;
(i) many creates, then ``stat`` and ``unlink`` of each; (j) open + one ``readinto`` of 2 MiB
blocks on the NVMe tier with the page cache dropped (``echo 1 > /proc/sys/vm/drop_caches``
once before each target's reads; without root, ``posix_fadvise(DONTNEED)`` on each file
instead, which a note says): on the kvfs targets the blocks were written at the start and
pushed to the NVMe tier by filling the RAM tier (confirmed by ``user.kvfs.tier`` before and
after every round's reads), on ``plain`` the same blocks written (and fsynced) on the disk that
holds the NVMe tier. Buffered reads on both sides: what a runtime loading a cold block does.
(j) runs on kvfs, kvfs_pyfuse3 and plain only (the other targets have no disk).

For each kvfs mount the run records, per pattern, ``transport.passthrough.opens`` and
``transport.data_reads`` from ``.kvfs/stats`` (summed over the rounds): reads served by
passthrough never reach the daemon; and (``requests`` in the JSON) the requests that reached
the daemon, by opcode (kvfs's own transport only).

Every figure is a rate (higher is better). Reported: each target's median with min-max
over the rounds, and kvfs's ratio to kvfs on pyfuse3, to both floors and to the plain
directory (median of the per-round ratios, with their min-max). Buffers are page-aligned
mmaps touched before timing.
"""
from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import logging
import mmap
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from kvfs.bench import BenchError, BenchMount, aligned_buffer, code_of, wait_for, xattr  # noqa: E402

log = logging.getLogger("runtime_patterns")
TARGETS = ("kvfs", "kvfs_pyfuse3", "floor", "floor_kl", "plain", "tmpfs")
EXPERIMENTS = ("kvfs_wb",)          # run only when --targets names them
BEFORE = "kvfs_before"        # a target only with --before: kvfs on another checkout's code
KVFS_TARGETS = ("kvfs", "kvfs_before", "kvfs_wb", "kvfs_pyfuse3")
DISK_TARGETS = ("kvfs", "kvfs_pyfuse3", "plain")        # those that run (j)
LABELS = {"kvfs": "kvfs", "kvfs_before": "kvfs before", "kvfs_wb": "kvfs, writeback cache",
          "kvfs_pyfuse3": "kvfs on pyfuse3", "floor": "floor fs",
          "floor_kl": "floor fs, kvfs's loop", "plain": "plain dir", "tmpfs": "tmpfs"}
O_DIRECT = getattr(os, "O_DIRECT", 0)
KIB, MIB = 1 << 10, 1 << 20


@dataclasses.dataclass(frozen=True)
class Sizes:
    small: int = 400          # (a) 32 KiB files per thread setting
    big: int = 32             # (a) 2 MiB files per thread setting
    first_stat: int = 300     # (b)
    old: int = 1000           # (c) files written at the start, stat()ed every round
    missing: int = 500        # (d) names, each checked 5 times after a first miss
    reads: int = 24           # (e) 2 MiB files
    vllm: int = 64            # (f) blocks
    vllm_block: int = 2 * MIB
    lmcache: int = 48         # (g) 2 MiB chunks
    kv_small: int = 1000      # (h) 32 KiB blocks
    kv_big: int = 64          # (h) 2 MiB blocks
    many: int = 100_000       # (i)
    many_rounds: int = 1      # (i) runs in this many of the rounds (it is long)
    nvme: int = 32            # (j) 2 MiB blocks on the NVMe tier
    ram: int = 4 << 30        # each kvfs mount's RAM tier; (j) writes more than this to demote


QUICK = Sizes(small=20, big=4, first_stat=20, old=50, missing=20, reads=4, vllm=16,
              vllm_block=256 * KIB, lmcache=8, kv_small=32, kv_big=4, many=2000, many_rounds=1,
              nvme=4, ram=256 * MIB)

# (key, what, unit): the metrics in report order
METRICS = [
    ("a_32k_t1", "(a) create+write 32 KiB+close+rename, 1 thread", "files/s"),
    ("a_32k_t4", "(a) same, 4 threads", "files/s"),
    ("a_2m_t1", "(a) create+write 2 MiB+close+rename, 1 thread", "files/s"),
    ("a_2m_t4", "(a) same, 4 threads", "files/s"),
    ("b_first_stat", "(b) first stat right after the write", "stats/s"),
    ("c_old_stat", "(c) stat of files written at the start of the run", "stats/s"),
    ("d_missing", "(d) repeated exists() of missing names", "checks/s"),
    ("e_read_fresh", "(e) open+readinto 2 MiB right after the write", "GB/s"),
    ("e_read_later", "(e) same file again after a stat", "GB/s"),
    ("e_mmap_fresh", "(e-mmap) open+mmap (MAP_SHARED)+copy of 2 MiB right after the write", "GB/s"),
    ("f_vllm_store", "(f) vLLM store, 16 threads", "blocks/s"),
    ("f_vllm_exists", "(f) vLLM existence check of the blocks stored", "checks/s"),
    ("g_lmc_write", "(g) LMCache write in place, 4 threads", "GB/s"),
    ("g_lmc_read", "(g) LMCache O_DIRECT read, 4 threads", "GB/s"),
    ("h_save_32k", "(h) KVCache.save+flush, 32 KiB blocks", "blocks/s"),
    ("h_save_2m", "(h) KVCache.save+flush, 2 MiB blocks", "blocks/s"),
    ("i_create", "(i) create of many empty files", "files/s"),
    ("i_stat", "(i) stat of each", "stats/s"),
    ("i_unlink", "(i) unlink of each", "files/s"),
    ("j_nvme_read", "(j) open+readinto 2 MiB on the NVMe tier, page cache dropped", "GB/s"),
]


# -- the floor filesystem -----------------------------------------------------------------------
def kvfs_settings() -> dict:
    """The kernel-facing settings kvfs uses now, so the floor mounts with the same."""
    import pyfuse3
    from kvfs.fs import ops
    from kvfs import daemon
    if hasattr(daemon, "mount_options"):
        opts = daemon.mount_options(allow_other=False)
    else:
        opts = set(pyfuse3.default_options)
    return {"entry_timeout": ops.ENTRY_TIMEOUT, "attr_timeout": ops.ATTR_TIMEOUT,
            "negative_timeout": getattr(ops, "NEGATIVE_TIMEOUT", 0),
            "default_permissions": "default_permissions" in opts,
            "read_ahead_kb": daemon.READ_AHEAD_KB}


class FloorMount:
    def __init__(self, path: Path, settings: dict):
        self.path = path
        self.settings = settings
        self.proc: subprocess.Popen | None = None

    def mount(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        s = self.settings
        cmd = [sys.executable, str(REPO / "benchmarks" / "floorfs.py"), str(self.path),
               "--entry-timeout", str(s["entry_timeout"]), "--attr-timeout", str(s["attr_timeout"]),
               "--negative-timeout", str(s["negative_timeout"]), "--read-ahead-kb", str(s["read_ahead_kb"])]
        if s["default_permissions"]:
            cmd.append("--default-permissions")
        if s.get("no_flush"):
            cmd.append("--no-flush")
        if s.get("kvfs_loop"):
            cmd.append("--kvfs-loop")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
        if not wait_for(lambda: os.path.ismount(self.path) or self.proc.poll() is not None, 30, 0.02) \
                or not os.path.ismount(self.path):
            err = self.proc.stderr.read().decode(errors="replace") if self.proc.poll() is not None else ""
            self.cleanup()
            raise BenchError(f"floorfs did not mount: {err.strip()[-400:]}")

    def cleanup(self) -> None:
        if os.path.ismount(self.path):
            subprocess.run(["fusermount3", "-u", "-z", str(self.path)], capture_output=True)
        if self.proc is not None:
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


# -- helpers ----------------------------------------------------------------------------------
def _write(path: str, mv, flags: int = 0) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o644)
    try:
        n = os.write(fd, mv)
        if n != len(mv):
            raise BenchError(f"short write to {path}: {n}")
    finally:
        os.close(fd)


def _read(path: str, mv, flags: int = 0) -> int:
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        n = os.readv(fd, [mv])
    finally:
        os.close(fd)
    if n != len(mv):
        raise BenchError(f"short read of {path}: {n} of {len(mv)}")
    return n


def _threads(n: int, items: list, fn) -> None:
    """Run ``fn`` over ``items`` split into ``n`` contiguous slices, one thread each."""
    if n == 1:
        for x in items:
            fn(x)
        return
    step = (len(items) + n - 1) // n

    def work(lo):
        for x in items[lo:lo + step]:
            fn(x)
    with ThreadPoolExecutor(n) as pool:
        list(pool.map(work, range(0, len(items), step)))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _drop_page_cache(paths: list[str]) -> bool:
    """Drop the page cache (``echo 1 > /proc/sys/vm/drop_caches``, root only: dentries and
    inodes stay); without root, ``posix_fadvise(DONTNEED)`` on each of ``paths``. True when
    the whole page cache was dropped."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return False


def _tiers(paths: list[str]) -> set[str]:
    return {str(xattr(Path(p), "user.kvfs.tier")) for p in paths}


def _odirect_probe(root: str) -> bool:
    """vLLM's start-up probe: can an aligned O_DIRECT write be done here?"""
    probe = os.path.join(root, f".odirect_probe_{secrets.token_hex(4)}")
    buf = mmap.mmap(-1, 4096)
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | O_DIRECT, 0o644)
    except OSError:
        return False
    try:
        os.write(fd, buf)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        buf.close()
        try:
            os.unlink(probe)
        except FileNotFoundError:
            pass


# -- the patterns -------------------------------------------------------------------------------
class Patterns:
    def __init__(self, sizes: Sizes):
        self.sz = sizes
        self.b32 = aligned_buffer(32 * KIB)
        self.b2m = aligned_buffer(2 * MIB)
        self.bvllm = aligned_buffer(sizes.vllm_block)
        self.rbuf = aligned_buffer(2 * MIB)
        self.rbufs = [aligned_buffer(2 * MIB) for _ in range(4)]
        self.bj = aligned_buffer(2 * MIB)
        self.kv = None
        self.notes: list[str] = []
        self.nvme: dict[str, tuple[list[str], bool]] = {}   # (j): root -> (block paths, on kvfs)

    def setup(self, root: str) -> None:
        """Files written once at the start: the 'older' files of (c)."""
        os.makedirs(os.path.join(root, "old"), exist_ok=True)
        mv = memoryview(self.b32)
        for i in range(self.sz.old):
            _write(os.path.join(root, "old", f"{i:06d}.bin"), mv)

    def setup_nvme(self, root: str, mount: BenchMount | None, progress=lambda s: None) -> None:
        """The 2 MiB blocks of (j), each with its own bytes. On a kvfs mount they are written
        first, then files are written beside them until the RAM tier's pressure has moved
        them all to the NVMe tier (the oldest go first), then those files are removed; on a
        plain directory they are written and synced."""
        d = os.path.join(root, "nvme")
        os.makedirs(d, exist_ok=True)
        paths = [os.path.join(d, f"j{i:04d}.bin") for i in range(self.sz.nvme)]
        mv = memoryview(self.bj)
        for i, p in enumerate(paths):
            mv[:8] = i.to_bytes(8, "little")
            _write(p, mv)
        if mount is not None:
            fill_dir = os.path.join(root, "nvme-filler")
            os.mkdir(fill_dir)
            fill_size = max(2 * MIB, self.sz.ram // 8)
            written, k = 0, 0
            while _tiers(paths) != {"nvme"} and written <= 2 * self.sz.ram:
                progress(f"(j) filling the RAM tier to demote ({written >> 20} MiB)")
                fd = os.open(os.path.join(fill_dir, f"f{k}.bin"), os.O_WRONLY | os.O_CREAT, 0o644)
                try:
                    for _ in range(fill_size // len(mv)):
                        os.write(fd, mv)
                finally:
                    os.close(fd)
                written += fill_size
                k += 1
            progress("(j) waiting for the blocks to reach the NVMe tier")
            if not wait_for(lambda: _tiers(paths) == {"nvme"}, 300, 0.2):
                raise BenchError(f"(j) blocks never all reached the NVMe tier: {sorted(_tiers(paths))}")
            shutil.rmtree(fill_dir)
        else:
            os.sync()
        self.nvme[root] = (paths, mount is not None)

    def run(self, name: str, root: str, rnd: int, out: dict) -> None:
        d = os.path.join(root, f"r{rnd}")
        os.makedirs(d, exist_ok=True)
        getattr(self, name)(d, rnd, out)

    # (a)
    def create_rename(self, d: str, rnd: int, out: dict) -> None:
        for size, buf, n, tag in ((32 * KIB, self.b32, self.sz.small, "32k"),
                                  (2 * MIB, self.b2m, self.sz.big, "2m")):
            mv = memoryview(buf)
            for threads in (1, 4):
                sub = os.path.join(d, f"a{tag}_{threads}")
                os.mkdir(sub)

                def one(i, sub=sub):
                    tmp = os.path.join(sub, f".{i}.tmp")
                    _write(tmp, mv)
                    os.rename(tmp, os.path.join(sub, f"{i}.bin"))
                out[f"a_{tag}_t{threads}"] = n / _timed(lambda: _threads(threads, list(range(n)), one))

    # (b)
    def first_stat(self, d: str, rnd: int, out: dict) -> None:
        mv = memoryview(self.b32)
        total = 0.0
        for i in range(self.sz.first_stat):
            p = os.path.join(d, f"b{i}.bin")
            _write(p, mv)
            t0 = time.perf_counter()
            st = os.stat(p)
            total += time.perf_counter() - t0
            if st.st_size != len(mv):
                raise BenchError(f"stat right after the write saw size {st.st_size}")
        out["b_first_stat"] = self.sz.first_stat / total

    # (c)
    def old_stat(self, d: str, rnd: int, out: dict) -> None:
        paths = [os.path.join(d, "..", "old", f"{i:06d}.bin") for i in range(self.sz.old)]
        out["c_old_stat"] = len(paths) / _timed(lambda: [os.stat(p) for p in paths])

    # (d)
    def missing(self, d: str, rnd: int, out: dict) -> None:
        paths = [os.path.join(d, f"missing-{i}.bin") for i in range(self.sz.missing)]
        if any(os.path.exists(p) for p in paths):      # the first miss of each, untimed
            raise BenchError("a missing name exists")

        def again():
            for _ in range(5):
                for p in paths:
                    os.path.exists(p)
        out["d_missing"] = 5 * len(paths) / _timed(again)

    # (e)
    def read_back(self, d: str, rnd: int, out: dict) -> None:
        w, r = memoryview(self.b2m), memoryview(self.rbuf)
        paths, fresh = [], 0.0
        for i in range(self.sz.reads):
            p = os.path.join(d, f"e{i}.bin")
            _write(p, w)
            fresh += _timed(lambda: _read(p, r))
            paths.append(p)
        if r[:4096] != w[:4096]:
            raise BenchError("read back other bytes than were written")
        for p in paths:
            os.stat(p)
        later = _timed(lambda: [_read(p, r) for p in paths])
        out["e_read_fresh"] = len(paths) * 2 * MIB / fresh / 1e9
        out["e_read_later"] = len(paths) * 2 * MIB / later / 1e9

    # (e-mmap)
    def read_mmap(self, d: str, rnd: int, out: dict) -> None:
        w, r = memoryview(self.b2m), memoryview(self.rbuf)

        def one(p):
            fd = os.open(p, os.O_RDONLY)
            try:
                mm = mmap.mmap(fd, len(w), mmap.MAP_SHARED, mmap.PROT_READ)
            finally:
                os.close(fd)
            try:
                with memoryview(mm) as src:
                    r[:] = src                 # touches every page of the mapping
            finally:
                mm.close()
        total = 0.0
        for i in range(self.sz.reads):
            p = os.path.join(d, f"em{i}.bin")
            _write(p, w)
            total += _timed(lambda: one(p))
        if r[:4096] != w[:4096] or r[-4096:] != w[-4096:]:
            raise BenchError("mmap read other bytes than were written")
        out["e_mmap_fresh"] = self.sz.reads * 2 * MIB / total / 1e9

    # (f)
    def vllm(self, d: str, rnd: int, out: dict) -> None:
        root = os.path.join(d, "llama-8b_0123456789ab_r0")
        os.makedirs(root, exist_ok=True)
        direct = O_DIRECT if _odirect_probe(root) else 0
        mv = memoryview(self.bvllm)
        hashes = [secrets.token_hex(16) for _ in range(self.sz.vllm)]

        def path_of(h):
            return os.path.join(root, h[:3], f"{h[3:5]}_g0", f"{h}.bin")

        def store(h):
            final = path_of(h)
            os.makedirs(os.path.dirname(final), exist_ok=True)     # 16 threads race here
            tmp = f"{final}_{secrets.token_hex(4)}.tmp"
            fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_TRUNC | os.O_WRONLY | direct, 0o644)
            try:
                if os.write(fd, mv) != len(mv):
                    raise BenchError("short vLLM write")
            finally:
                os.close(fd)
            os.rename(tmp, final)

        out["f_vllm_store"] = len(hashes) / _timed(lambda: _threads(16, hashes, store))
        out["f_vllm_exists"] = len(hashes) / _timed(
            lambda: [os.access(path_of(h), os.F_OK) or _raise(h) for h in hashes])
        out["f_direct"] = bool(direct)

    # (g)
    def lmcache(self, d: str, rnd: int, out: dict) -> None:
        w = memoryview(self.b2m)
        paths = [os.path.join(d, f"chunk{i}.pt") for i in range(self.sz.lmcache)]
        t = _timed(lambda: _threads(4, paths, lambda p: _write(p, w)))
        out["g_lmc_write"] = len(paths) * 2 * MIB / t / 1e9
        direct = O_DIRECT
        try:
            _read(paths[0], memoryview(self.rbuf), O_DIRECT)
        except OSError:
            direct = 0                         # tmpfs before Linux 6.6: no O_DIRECT
        lock = threading.Lock()
        free = [memoryview(b) for b in self.rbufs]

        def rd(p):
            with lock:
                mv = free.pop()
            try:
                _read(p, mv, direct)
            finally:
                with lock:
                    free.append(mv)
        out["g_lmc_read"] = len(paths) * 2 * MIB / _timed(lambda: _threads(4, paths, rd)) / 1e9
        out["g_direct"] = bool(direct)

    # (h)
    def kvcache(self, d: str, rnd: int, out: dict) -> None:
        try:
            import torch
            import kvfs
        except ImportError as e:
            self.notes.append(f"(h) skipped: {e}")
            return
        layouts = {"32k": (kvfs.KVLayout(num_layers=2, num_kv_heads=8, head_dim=32, dtype=torch.float16),
                           self.sz.kv_small),
                   "2m": (kvfs.KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16),
                          self.sz.kv_big)}
        if self.kv is None:
            self.kv = {k: torch.randn(lay.block_shape(n * lay.block_tokens)).to(lay.torch_dtype)
                       for k, (lay, n) in layouts.items()}
        for tag, (lay, n) in layouts.items():
            seed = int.from_bytes(os.urandom(4), "little")
            tokens = [(seed + i * 7919) % 150_000 for i in range(n * lay.block_tokens)]
            os.mkdir(os.path.join(d, f"kv{tag}"))
            c = kvfs.KVCache(os.path.join(d, f"kv{tag}"), model="bench/model", layout=lay,
                             save_timeout=None, max_pending_saves=n + 1, fast_path=False)
            try:
                def save():
                    res = c.save(tokens, self.kv[tag])
                    c.flush()
                    if res.dropped or res.queued != n:
                        raise BenchError(f"KVCache.save queued {res.queued} of {n} blocks")
                out[f"h_save_{tag}"] = n / _timed(save)
            finally:
                c.close()

    # (i)
    def many(self, d: str, rnd: int, out: dict) -> None:
        if rnd >= self.sz.many_rounds:
            return
        n, ndirs = self.sz.many, 100
        for k in range(ndirs):
            os.mkdir(os.path.join(d, f"i{k:02d}"))
        paths = [os.path.join(d, f"i{i % ndirs:02d}", f"{i:07d}") for i in range(n)]

        def create():
            for p in paths:
                os.close(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        out["i_create"] = n / _timed(create)
        out["i_stat"] = n / _timed(lambda: [os.stat(p) for p in paths])
        out["i_unlink"] = n / _timed(lambda: [os.unlink(p) for p in paths])


    # (j)
    def nvme_read(self, d: str, rnd: int, out: dict) -> None:
        got = self.nvme.get(os.path.dirname(d))
        if got is None:                    # a target without a disk
            return
        paths, on_kvfs = got
        if on_kvfs and _tiers(paths) != {"nvme"}:
            raise BenchError(f"(j) blocks not on the NVMe tier before the reads: {sorted(_tiers(paths))}")
        if not _drop_page_cache(paths):
            note = "(j) could not write /proc/sys/vm/drop_caches (not root): posix_fadvise(DONTNEED) instead"
            if note not in self.notes:
                self.notes.append(note)
        r = memoryview(self.rbuf)
        out["j_nvme_read"] = len(paths) * 2 * MIB / _timed(lambda: [_read(p, r) for p in paths]) / 1e9
        if int.from_bytes(r[:8], "little") != len(paths) - 1 or r[8:4096] != memoryview(self.bj)[8:4096]:
            raise BenchError("(j) read other bytes than were written")
        if on_kvfs and _tiers(paths) != {"nvme"}:
            raise BenchError(f"(j) blocks left the NVMe tier while read: {sorted(_tiers(paths))}")


def _raise(h):
    raise BenchError(f"block {h} missing right after it was stored")


PATTERN_LABELS = {"create_rename": "(a) create+write+rename", "first_stat": "(b) first stat",
                  "old_stat": "(c) stat of old files", "missing": "(d) missing names",
                  "read_back": "(e) read back 2 MiB", "read_mmap": "(e-mmap) mmap read 2 MiB",
                  "vllm": "(f) vLLM store", "lmcache": "(g) LMCache", "kvcache": "(h) KVCache.save",
                  "many": "(i) many files", "nvme_read": "(j) NVMe-tier read", "total": "all patterns"}
ORDER = ["create_rename", "first_stat", "old_stat", "missing", "read_back", "read_mmap", "vllm",
         "lmcache", "kvcache", "many", "nvme_read"]


# -- the run ----------------------------------------------------------------------------------------
def _summary(vals: list[float]) -> dict:
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


# (key, numerator, denominator): the ratios of each row, in table order
RATIOS = [("vs_before", "kvfs", "kvfs_before"), ("before_vs_plain", "kvfs_before", "plain"),
          ("vs_pyfuse3", "kvfs", "kvfs_pyfuse3"), ("vs_floor", "kvfs", "floor"),
          ("vs_floor_kl", "kvfs", "floor_kl"), ("vs_plain", "kvfs", "plain"),
          ("floor_vs_plain", "floor", "plain"), ("wb_vs_kvfs", "kvfs_wb", "kvfs"),
          ("wb_vs_plain", "kvfs_wb", "plain")]
RATIO_LABELS = {"vs_before": "kvfs / kvfs before", "before_vs_plain": "kvfs before / plain",
                "vs_pyfuse3": "kvfs / kvfs on pyfuse3", "vs_floor": "kvfs / floor",
                "vs_floor_kl": "kvfs / floor, kvfs's loop", "vs_plain": "kvfs / plain",
                "floor_vs_plain": "floor / plain", "wb_vs_kvfs": "kvfs writeback / kvfs",
                "wb_vs_plain": "kvfs writeback / plain"}


def _ratios(per_round: list[dict], a: str, b: str, key: str) -> dict | None:
    rs = [r[a][key] / r[b][key] for r in per_round
          if key in r.get(a, {}) and key in r.get(b, {}) and r[b][key]]
    return _summary(rs) if rs else None


def _counters(m: BenchMount) -> dict:
    """The transport counters of ``.kvfs/stats`` that say whether reads reached the daemon."""
    t = m.stats().get("transport", {})
    return {"opens": (t.get("passthrough") or {}).get("opens"), "data_reads": t.get("data_reads")}


def _requests(m: BenchMount) -> dict:
    """The requests that reached the daemon so far, by opcode, and ``all`` (kvfs's transport)."""
    t = m.stats().get("transport", {})
    return dict(t.get("by_opcode") or {}, all=t.get("requests"))


def _add(acc: dict, before: dict, after: dict, new_keys: bool = False) -> None:
    for k, v in after.items():
        if v is not None and (before.get(k) is not None or new_keys):
            acc[k] = acc.get(k, 0) + v - (before.get(k) or 0)


def run(base: Path, tmpfs: Path, rounds: int, sizes: Sizes, progress=lambda s: None,
        only: list[str] | None = None, targets: list[str] | None = None, before: str | None = None) -> dict:
    base = base.expanduser().resolve()
    root = base / "runtime"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    shm = tmpfs / f"kvfs-runtime-{os.getpid()}"
    unknown = set(targets or ()) - set(TARGETS + EXPERIMENTS + (BEFORE,))
    if unknown:
        raise BenchError(f"unknown target(s) {', '.join(sorted(unknown))} "
                         f"(targets: {', '.join(TARGETS + EXPERIMENTS + (BEFORE,))})")
    targets = tuple(t for t in TARGETS[:1] + (BEFORE,) + EXPERIMENTS + TARGETS[1:]
                    if (t in targets if targets else t in TARGETS or t == BEFORE)
                    and (t != BEFORE or before is not None))
    if not targets:
        raise BenchError(f"no target chosen (targets: {', '.join(TARGETS)})")
    settings = kvfs_settings()
    mounts = {"kvfs": BenchMount(root / "kvfs", ram=sizes.ram, nvme_size=16 << 30, passthrough=True),
              "kvfs_before": BenchMount(root / "kvfs_before", ram=sizes.ram, nvme_size=16 << 30, passthrough=True),
              "kvfs_wb": BenchMount(root / "kvfs_wb", ram=sizes.ram, nvme_size=16 << 30,
                                    writeback_cache=True),
              "kvfs_pyfuse3": BenchMount(root / "kvfs_pyfuse3", ram=sizes.ram, nvme_size=16 << 30,
                                         transport="pyfuse3")}
    mounts = {t: m for t, m in mounts.items() if t in targets}
    floors = {"floor": FloorMount(root / "floor", settings),
              "floor_kl": FloorMount(root / "floor_kl", dict(settings, kvfs_loop=True))}  # kvfs.fs.loop
    floors = {t: f for t, f in floors.items() if t in targets}
    plain = root / "kvfs" / "plain"       # beside the NVMe tier's directory, same filesystem
    pats = Patterns(sizes)
    names = [n for n in ORDER if not only or n in only]
    per_round: list[dict] = []
    counters = {t: {n: {} for n in names} for t in mounts}
    requests = {t: {n: {} for n in names} for t in mounts}
    transports: dict = {}
    try:
        for t, m in mounts.items():
            progress(f"mounting {t}")
            with code_of(os.path.abspath(before) if t == "kvfs_before" else None):
                m.mount()
            tr = m.stats().get("transport", {})
            transports[t] = {"name": tr.get("name"), "why": tr.get("why"),
                             "passthrough": (tr.get("passthrough") or {}).get("state")}
            if tr.get("writeback_cache"):
                transports[t]["writeback_cache"] = True
        for t, f in floors.items():
            progress(f"mounting {t}")
            f.mount()
        dirs = {t: m.path / "bench" for t, m in mounts.items()}
        dirs.update({t: f.path / "bench" for t, f in floors.items()})
        dirs.update({t: p for t, p in (("plain", plain), ("tmpfs", shm)) if t in targets})
        dirs = {t: dirs[t] for t in targets}
        for t, p in dirs.items():
            os.makedirs(p, exist_ok=True)
            if "nvme_read" in names and (t in DISK_TARGETS or t == BEFORE):
                progress(f"(j) setup on {t}")
                pats.setup_nvme(str(p), mounts.get(t), progress)
            progress(f"setup on {t}")
            pats.setup(str(p))
        for rnd in range(rounds):
            res: dict = {t: {} for t in targets}
            for k, name in enumerate(names):
                j = (rnd + k) % len(targets)
                order = targets[j:] + targets[:j]
                for t in order:
                    progress(f"round {rnd + 1}/{rounds}: {name} on {t}")
                    before = (_counters(mounts[t]), _requests(mounts[t])) if t in mounts else None
                    pats.run(name, str(dirs[t]), rnd, res[t])
                    if before is not None:
                        _add(counters[t][name], before[0], _counters(mounts[t]))
                        _add(requests[t][name], before[1], _requests(mounts[t]), new_keys=True)
            per_round.append(res)
            for t in targets:              # free the round's files (kvfs's RAM tier stays small)
                shutil.rmtree(dirs[t] / f"r{rnd}", ignore_errors=True)
            log.info("round %d: %s", rnd, json.dumps(res))
    finally:
        for f in floors.values():
            f.cleanup()
        for m in mounts.values():
            try:
                if m.pid is not None:
                    m.umount()
            except BenchError as e:
                log.warning("%s", e)
            m.cleanup()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    out: dict = {"rounds": rounds, "sizes": dataclasses.asdict(sizes), "floor_settings": settings,
                 "targets": list(targets),
                 "o_direct": {t: per_round[0][t].get("f_direct") for t in targets} if per_round else {},
                 "passthrough": {t: dict(transports.get(t, {}), by_pattern=counters[t],
                                         total={k: sum(c.get(k, 0) for c in counters[t].values())
                                                for k in ("opens", "data_reads")
                                                if any(k in c for c in counters[t].values())})
                                 for t in mounts},
                 "requests": requests, "metrics": [], "notes": pats.notes}
    for key, what, unit in METRICS:
        row = {"key": key, "what": what, "unit": unit}
        for t in targets:
            vals = [r[t][key] for r in per_round if key in r[t]]
            if vals:
                row[t] = _summary(vals)
        if not any(t in row for t in targets):
            continue
        for rk, a, b in RATIOS:
            row[rk] = _ratios(per_round, a, b, key)
        out["metrics"].append(row)
    return out


def _fmt(x: float) -> str:
    return f"{x:.3g}" if x < 1000 else f"{x:,.0f}"


def table(res: dict) -> str:
    """The results as a markdown table: a column per target of the run, then the ratios."""
    targets = res.get("targets", TARGETS)
    ratios = [k for k, a, b in RATIOS if a in targets and b in targets]
    lines = ["| pattern | unit | " + " | ".join(LABELS[t] for t in targets) + " | "
             + " | ".join(RATIO_LABELS[k] for k in ratios) + " |",
             "|---|---|" + "---:|" * (len(targets) + len(ratios))]
    for row in res["metrics"]:
        cells = []
        for t in targets:
            s = row.get(t)
            cells.append(_fmt(s["median"]) if s else "–")
        rat = []
        for k in ratios:
            s = row.get(k)
            rat.append(f"{s['median']:.2f} ({s['min']:.2f}–{s['max']:.2f})" if s else "–")
        lines.append(f"| {row['what']} | {row['unit']} | " + " | ".join(cells + rat) + " |")
    return "\n".join(lines)


def passthrough_table(res: dict) -> str:
    """Per pattern, what the kvfs mounts' ``.kvfs/stats`` counted (summed over the rounds):
    opens given to the kernel by passthrough, and READs of files that reached the daemon."""
    pt = res.get("passthrough") or {}
    ts = [t for t in KVFS_TARGETS if t in pt]
    if not ts:
        return ""
    names = [n for n in ORDER if any(n in pt[t]["by_pattern"] for t in ts)] + ["total"]

    def counts(t, name):
        return pt[t]["total"] if name == "total" else pt[t]["by_pattern"].get(name, {})
    # (target, counter, heading); a counter a transport does not keep gets no column
    cols = [(t, k, f"{LABELS[t]}: {head}") for t in ts
            for k, head in (("opens", "passthrough opens"), ("data_reads", "READs at the daemon"))
            if any(counts(t, n).get(k) is not None for n in names)]
    if not cols:
        return ""
    lines = ["| pattern | " + " | ".join(h for _, _, h in cols) + " |", "|---|" + "---:|" * len(cols)]
    for name in names:
        cells = [f"{counts(t, name)[k]:,}" if counts(t, name).get(k) is not None else "–"
                 for t, k, _ in cols]
        lines.append(f"| {PATTERN_LABELS.get(name, name)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def steps_table(steps: list[tuple[str, dict]], key: str = "vs_plain") -> str:
    """One row per pattern, one column per run (e.g. before and after each fix): kvfs's ratio
    ``key`` (vs_plain or vs_floor), median of the rounds of that run."""
    head = "| pattern | " + " | ".join(label for label, _ in steps) + " |"
    lines = [head, "|---|" + "---:|" * len(steps)]
    for key_, what, _ in METRICS:
        cells = []
        for _, res in steps:
            row = next((r for r in res["metrics"] if r["key"] == key_), None)
            s = row and row.get(key)
            cells.append(f"{s['median']:.2f}" if s else "–")
        lines.append(f"| {what} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(res: dict, png: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    bars = [(key, label, color) for key, label, color in
            (("vs_pyfuse3", "kvfs / kvfs on pyfuse3 (before passthrough)", "#8172b2"),
             ("vs_floor", "kvfs / floor fs", "#4c72b0"),
             ("vs_floor_kl", "kvfs / floor fs served by kvfs's loop", "#55a868"),
             ("vs_plain", "kvfs / plain dir", "#dd8452"))
            if any(r.get(key) for r in res["metrics"])]
    rows = [r for r in res["metrics"] if any(r.get(key) for key, _, _ in bars)]
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(10, (0.12 * len(bars) + 0.1) * len(rows) + 1.5))
    ys = range(len(rows))
    h = 0.8 / len(bars)
    for i, (key, label, color) in enumerate(bars):
        off = (i - (len(bars) - 1) / 2) * h
        got = [(y, r[key]) for y, r in zip(ys, rows) if r.get(key)]   # (j) has no floor ratios
        med = [s["median"] for _, s in got]
        lo = [s["median"] - s["min"] for _, s in got]
        hi = [s["max"] - s["median"] for _, s in got]
        ax.barh([y + off for y, _ in got], med, height=h, xerr=[lo, hi], label=label, color=color,
                error_kw={"elinewidth": 0.8, "capsize": 2})
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks(list(ys))
    ax.set_yticklabels([r["what"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("ratio of rates (median of interleaved rounds, min–max); >1: kvfs faster")
    ax.set_title(f"kvfs under runtime storage patterns ({res['rounds']} rounds)")
    fig.tight_layout()
    below = 0.55 / (ax.get_position().height * fig.get_figheight())     # under the x label
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -below), ncol=2, fontsize=8)
    fig.savefig(png, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return True


BEGIN = "<!-- kvfs-bench:runtime:begin (generated by `kvfs bench --only runtime --write-docs`) -->"
END = "<!-- kvfs-bench:runtime:end -->"
PLOT_NAME = "bench_runtime.png"


def markdown(res: dict, png_name: str | None) -> str:
    s = res["floor_settings"]
    out = [BEGIN, "### One run of the runtime-pattern benchmark", "",
           f"{res['rounds']} interleaved rounds; rates are medians over the rounds, ratios the median "
           "(min–max) of the per-round ratios. Floor fs settings (copied from kvfs): entry timeout "
           f"{s['entry_timeout']} s, attribute timeout {s['attr_timeout']} s, negative entries "
           f"{s['negative_timeout'] or 'off'}{' s' if s['negative_timeout'] else ''}, "
           f"default_permissions {'on' if s['default_permissions'] else 'off'}, read-ahead "
           f"{s['read_ahead_kb']} KiB. O_DIRECT used by (f): "
           + ", ".join(f"{t} {'yes' if v else 'no'}" for t, v in res.get("o_direct", {}).items())
           + f". Sizes: `{json.dumps(res['sizes'])}`.", ""]
    pt = res.get("passthrough") or {}
    if pt:
        out += ["Transports: " + "; ".join(
            f"{LABELS[t]}: {v.get('name')}, passthrough {v.get('passthrough') or 'off'}"
            for t, v in pt.items()) + ".", ""]
    if any(r["key"] == "j_nvme_read" for r in res["metrics"]) \
            and not any(n.startswith("(j) could not") for n in res.get("notes", [])):
        out += ["(j): buffered reads on every target, each target's reads right after "
                "`echo 1 > /proc/sys/vm/drop_caches`; on the kvfs mounts the blocks were on the NVMe "
                "tier (`user.kvfs.tier`) before and after the reads.", ""]
    if png_name:
        out += [f"![kvfs / kvfs on pyfuse3, kvfs / floor and kvfs / plain per pattern]({png_name})", ""]
    out.append(table(res))
    if pt:
        out += ["", "What reached the daemon (`.kvfs/stats` `transport.passthrough.opens` and "
                "`transport.data_reads`, summed over the rounds):", "", passthrough_table(res)]
    for n in res.get("notes", []):
        out += ["", f"Note: {n}"]
    out += ["", END]
    return "\n".join(out) + "\n"


def write_docs(res: dict, md: Path) -> Path | None:
    """Replace (or add) the runtime section of ``md``; returns the PNG path if drawn."""
    from kvfs.cli.bench_report import replace_section
    png = md.parent / PLOT_NAME
    drawn = plot(res, png)
    replace_section(md, BEGIN, END, markdown(res, PLOT_NAME if drawn else None))
    return png if drawn else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default=".kvfs-bench", help="scratch directory (holds the NVMe tier and the plain dir)")
    p.add_argument("--tmpfs", default="/dev/shm")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    p.add_argument("--many", type=int, default=None, help="files of pattern (i)")
    p.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(ORDER)}")
    p.add_argument("--targets", default=None,
                   help=f"comma-separated subset of {','.join(TARGETS)} (default: all)")
    p.add_argument("--before", default=None, metavar="DIR",
                   help="a checkout whose code the kvfs_before target runs (that target only with it)")
    p.add_argument("--json", default=None)
    p.add_argument("--steps", nargs="+", metavar="LABEL=JSON", default=None,
                   help="print the per-step ratio tables of earlier runs and exit")
    p.add_argument("--plot", default=None)
    p.add_argument("--write-docs", default=None, metavar="MD", help="write the section (and the plot beside it)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if a.steps:
        steps = [(x.split("=", 1)[0], json.loads(Path(x.split("=", 1)[1]).read_text())) for x in a.steps]
        for key in ("vs_plain", "vs_floor"):
            print(f"\nkvfs {key.replace('vs_', '/ ')}\n")
            print(steps_table(steps, key))
        return 0
    sizes = QUICK if a.quick else Sizes()
    if a.many is not None:
        sizes = dataclasses.replace(sizes, many=a.many)
    res = run(Path(a.dir), Path(a.tmpfs), a.rounds, sizes, progress=lambda s: log.info("%s", s),
              only=a.only.split(",") if a.only else None,
              targets=a.targets.split(",") if a.targets else None, before=a.before)
    print(table(res))
    print()
    print(passthrough_table(res))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    if a.plot:
        plot(res, Path(a.plot))
    if a.write_docs:
        write_docs(res, Path(a.write_docs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
