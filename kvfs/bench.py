"""Foundation benchmarks: kvfs measured side by side with its physical baseline, in one run.

Every throughput figure is the median of several runs, read or written with page-aligned
(mmap) buffers that are touched before timing starts (freshly mapped memory is slow on a
Firecracker VM), and is reported as a ratio to the baseline measured a moment before or after:

- write: sequential write of a file through the mount vs the same write on tmpfs;
- read cold: a RAM-tier file with the page cache dropped vs the same bytes on tmpfs;
- read warm: re-read of the same file (kernel page cache, ``keep_cache``) vs tmpfs;
- read nvme: an NVMe-tier file (confirmed by ``user.kvfs.tier``) vs an O_DIRECT read of a
  plain file on the same disk;
- lookup: stat() of existing and missing names, cold and warm, vs tmpfs;
- remount: time to unmount (flush) and mount again, and daemon memory, with many small files.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvfs import protocol
from kvfs.proc import pid_alive

log = logging.getLogger(__name__)

GB = 1e9
TARGETS = {"write": 0.15, "read_cold": 0.25, "read_warm": 0.8, "read_nvme": 0.7}
SMALL_OBJECT = 1024


class BenchError(Exception):
    """The benchmark could not run (mount failed, scratch directory unusable, ...)."""


# -- buffers and caches ---------------------------------------------------------------------
def aligned_buffer(size: int, fill: bytes = b"") -> mmap.mmap:
    """A page-aligned anonymous mapping, every page touched (and filled with ``fill``)."""
    buf = mmap.mmap(-1, size)
    pattern = fill or os.urandom(4096)
    rep = (pattern * (size // len(pattern) + 1))[:size]
    buf[:] = rep
    buf[:] = rep
    return buf


def warm_memory(limit: int = 16 << 30, spare: int = 3 << 29) -> tuple[int, float]:
    """Touch (then free) up to ``limit`` bytes of the machine's available memory, leaving
    ``spare``; returns (bytes touched, seconds). On a VM whose host backs guest memory only
    at its first touch and takes freed memory back (this one: virtio-balloon free page
    reporting; a 512 KiB tmpfs page's first touch costs ~650 us against ~76 us) a benchmark's
    fresh page-cache or tmpfs pages cost whatever part of them happens to be first-touch,
    which no real machine pays: call it right before the allocation being measured (the host
    takes free memory back within seconds) so that both sides of a comparison see warm memory."""
    avail = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) << 10
    want = max(0, min(limit, avail - spare))
    step, maps, done = 256 << 20, [], 0
    t0 = time.perf_counter()
    try:
        while done + step <= want:
            mm = mmap.mmap(-1, step)
            ctypes.memset(ctypes.addressof(ctypes.c_char.from_buffer(mm)), 1, step)
            maps.append(mm)
            done += step
    finally:
        for mm in maps:
            mm.close()
    return done, time.perf_counter() - t0


def drop_caches() -> bool:
    """Drop the page, dentry and inode caches (root only); False when not allowed."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def forget_pages(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def write_file(path: Path, buf: mmap.mmap, size: int, block: int, fsync: bool = False) -> float:
    """Write ``size`` bytes in ``block`` calls and close; returns seconds."""
    mv = memoryview(buf)[:block]
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        off = 0
        while off < size:
            off += os.write(fd, mv)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    dt = time.perf_counter() - t0
    mv.release()
    return dt


def read_file(path: Path, buf: mmap.mmap, block: int, expect: int, direct: bool = False) -> float:
    """Read the whole file sequentially into ``buf`` in ``block`` calls; returns seconds."""
    mv = memoryview(buf)[:block]
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    t0 = time.perf_counter()
    fd = os.open(path, flags)
    try:
        total = 0
        while True:
            n = os.preadv(fd, [mv], total)
            if n <= 0:
                break
            total += n
    finally:
        os.close(fd)
    dt = time.perf_counter() - t0
    mv.release()
    if total != expect:
        raise BenchError(f"short read of {path}: {total} of {expect} bytes")
    return dt


def xattr(path: Path, name: str) -> str | None:
    try:
        return os.getxattr(path, name).decode()
    except OSError:
        return None


@contextlib.contextmanager
def code_of(tree: str | None):
    """A kvfs CLI (and so the daemon it starts) launched meanwhile runs the code of the
    checkout ``tree`` (None: this one): a before/after comparison in one benchmark run."""
    if tree is None:
        yield
        return
    cwd, path = os.getcwd(), os.environ.get("PYTHONPATH")
    os.chdir(tree)                       # ``python -m kvfs.cli`` imports from its directory first
    os.environ["PYTHONPATH"] = tree
    try:
        yield
    finally:
        os.chdir(cwd)
        if path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = path


def wait_for(pred, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def gbps(size: int, seconds: list[float]) -> list[float]:
    return [size / s / GB for s in seconds]


def pair(name: str, what: str, kvfs_runs: list[float], base_name: str,
         base_runs: list[float], **extra) -> dict:
    k, b = statistics.median(kvfs_runs), statistics.median(base_runs)
    row = {"name": name, "what": what, "kvfs_gbps": round(k, 3), "baseline": base_name,
           "baseline_gbps": round(b, 3), "ratio": round(k / b, 3) if b else None,
           "target": TARGETS.get(name), "kvfs_runs": [round(x, 3) for x in kvfs_runs],
           "baseline_runs": [round(x, 3) for x in base_runs]}
    if row["target"] is not None and row["ratio"] is not None:
        row["meets_target"] = row["ratio"] >= row["target"]
    row.update(extra)
    return row


# -- the mount under test --------------------------------------------------------------------
class BenchMount:
    """A kvfs mount driven through the real CLI, as an operator would."""

    def __init__(self, root: Path, ram: int | str, nvme_size: int | str, promote_hits: int | None = 1_000_000,
                 **config):
        self.root = root
        self.path, self.nvme, self.state = root / "mnt", root / "nvme", root / "state"
        self.config = root / "bench.toml"
        for d in (self.path, self.nvme, self.state):
            d.mkdir(parents=True, exist_ok=True)
        # a huge promote_hits keeps NVMe-tier files on NVMe while they are re-read
        if promote_hits is not None:
            config["promote_hits"] = promote_hits
        self.config.write_text("[kvfs]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in config.items()))
        self.args = ["--ram", str(ram), "--nvme", str(self.nvme), "--nvme-size", str(nvme_size),
                     "--state", str(self.state), "--config", str(self.config)]
        self.pid: int | None = None

    def _cli(self, *args, timeout: float = 1800) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kvfs.cli", *map(str, args)],
                              capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)

    def mount(self) -> float:
        t0 = time.perf_counter()
        res = self._cli("mount", self.path, *self.args)
        dt = time.perf_counter() - t0
        if res.returncode != 0:
            raise BenchError(f"kvfs mount failed: {res.stderr.strip()}")
        self.pid = int(self.stats()["pid"])
        return dt

    def __enter__(self) -> "BenchMount":
        self.mount()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.umount()
        except (BenchError, subprocess.TimeoutExpired):
            subprocess.run(["fusermount3", "-u", "-z", str(self.path)], capture_output=True)

    def umount(self) -> float:
        t0 = time.perf_counter()
        res = self._cli("umount", self.path)
        dt = time.perf_counter() - t0
        if res.returncode != 0:
            raise BenchError(f"kvfs umount failed: {res.stderr.strip()}")
        self.pid = None
        return dt

    def stats(self) -> dict:
        with open(self.path / protocol.CONTROL_NAME / protocol.STATS_FILE, "rb") as f:
            return json.loads(f.read())

    def memory(self) -> dict:
        out: dict = {}
        if self.pid is None:
            return out
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                key, _, val = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
                    out[key] = int(val.split()[0]) * 1024
        return out

    def cleanup(self) -> None:
        if os.path.ismount(self.path):
            subprocess.run(["fusermount3", "-u", "-z", str(self.path)], capture_output=True)
        if self.pid is not None and wait_for(lambda: not pid_alive(self.pid), 600, 0.1) is False:
            os.kill(self.pid, 9)


# -- the benchmarks --------------------------------------------------------------------------
class Runner:
    def __init__(self, base: Path, tmpfs: Path, size: int, block: int, runs: int, progress):
        self.base, self.size, self.block, self.runs = base, size, block, runs
        self.tmp = tmpfs / f"kvfs-bench-{os.getpid()}"
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.progress = progress
        self.src = aligned_buffer(block)
        self.dst = aligned_buffer(max(block, 1 << 20))
        self.notes: list[str] = []
        self.can_drop = drop_caches()
        if not self.can_drop:
            self.notes.append("could not write /proc/sys/vm/drop_caches (not root): cold reads "
                              "rely on posix_fadvise(DONTNEED) alone")

    def cold(self, *paths: Path) -> None:
        for p in paths:
            forget_pages(p)
        if self.can_drop:
            drop_caches()

    def bench_write(self, m: BenchMount) -> dict:
        k, b = [], []
        for i in range(self.runs):
            self.progress(f"write run {i + 1}/{self.runs}")
            for target, out in ((m.path / f"w{i}.bin", k), (self.tmp / f"w{i}.bin", b)):
                out.append(write_file(target, self.src, self.size, self.block))
                target.unlink()
        return pair("write", "sequential write + close", gbps(self.size, k), "tmpfs",
                    gbps(self.size, b))

    def bench_read(self, m: BenchMount) -> list[dict]:
        kf, tf = m.path / "r.bin", self.tmp / "r.bin"
        write_file(kf, self.src, self.size, self.block)
        write_file(tf, self.src, self.size, self.block)
        tier = xattr(kf, "user.kvfs.tier")
        cold, warm, base = [], [], []
        for i in range(self.runs):
            self.progress(f"read run {i + 1}/{self.runs}")
            self.cold(kf)
            cold.append(read_file(kf, self.dst, self.block, self.size))
            warm.append(read_file(kf, self.dst, self.block, self.size))
            base.append(read_file(tf, self.dst, self.block, self.size))
        if bytes(self.dst[:self.block]) != bytes(self.src[:self.block]):
            raise BenchError("read through the mount returned other bytes than were written")
        after = xattr(kf, "user.kvfs.tier")
        kf.unlink()
        tf.unlink()
        extra = {"tier_before": tier, "tier_after": after}
        return [pair("read_cold", "RAM-tier file, page cache dropped", gbps(self.size, cold),
                     "tmpfs", gbps(self.size, base), **extra),
                pair("read_warm", "re-read (kernel page cache)", gbps(self.size, warm),
                     "tmpfs", gbps(self.size, base), **extra)]

    def bench_nvme(self, m: BenchMount, ram: int) -> dict:
        kf = m.path / "n.bin"
        write_file(kf, self.src, self.size, self.block)
        filler, written, i = [], 0, 0
        while written < ram + self.size:
            self.progress(f"nvme: filling RAM to demote ({written >> 20} MiB)")
            p = m.path / f"fill{i}.bin"
            write_file(p, self.src, self.size, self.block)
            filler.append(p)
            written += self.size
            i += 1
        self.progress("nvme: waiting for demotion")
        if not wait_for(lambda: xattr(kf, "user.kvfs.tier") == "nvme", 600):
            raise BenchError(f"n.bin never reached the nvme tier (tier: {xattr(kf, 'user.kvfs.tier')})")
        for p in filler:
            p.unlink()
        plain_dir = self.base / "plain"
        plain_dir.mkdir(exist_ok=True)
        pf = plain_dir / "p.bin"
        write_file(pf, self.src, self.size, self.block, fsync=True)
        direct = True
        try:
            read_file(pf, self.dst, self.block, self.size, direct=True)
        except OSError:
            direct = False
            self.notes.append(f"O_DIRECT not supported under {plain_dir}: baseline is buffered")
        k, b, tiers = [], [], []
        for r in range(self.runs):
            self.progress(f"nvme read run {r + 1}/{self.runs}")
            self.cold(kf, pf)
            k.append(read_file(kf, self.dst, self.block, self.size))
            tiers.append(xattr(kf, "user.kvfs.tier"))
            if not direct:
                self.cold(pf)
            b.append(read_file(pf, self.dst, self.block, self.size, direct=direct))
        if bytes(self.dst[:self.block]) != bytes(self.src[:self.block]):
            raise BenchError("NVMe-tier read returned other bytes than were written")
        kf.unlink()
        pf.unlink()
        return pair("read_nvme", "NVMe-tier file, page cache dropped", gbps(self.size, k),
                    "O_DIRECT plain file" if direct else "buffered plain file (cold)",
                    gbps(self.size, b), tier_during=sorted(set(map(str, tiers))))

    def bench_lookup(self, m: BenchMount, n: int) -> dict:
        roots = {"kvfs": m.path / "lookup", "tmpfs": self.tmp / "lookup"}
        names = [f"{i % 256:02x}/{i:08d}.bin" for i in range(n)]
        for label, root in roots.items():
            self.progress(f"lookup: creating {n} files on {label}")
            for d in range(min(n, 256)):
                (root / f"{d:02x}").mkdir(parents=True, exist_ok=True)
            for name in names:
                fd = os.open(root / name, os.O_WRONLY | os.O_CREAT, 0o644)
                os.write(fd, b"x" * 16)
                os.close(fd)
        res: dict = {}
        for label, root in roots.items():
            cold, warm, miss = [], [], []
            for r in range(self.runs):
                self.progress(f"lookup: stat run {r + 1}/{self.runs} on {label}")
                if self.can_drop:
                    drop_caches()
                cold.append(_stat_all(root, names, True))
                warm.append(_stat_all(root, names, True))
                miss.append(_stat_all(root, [x + ".missing" for x in names], False))
            res[label] = {k: round(statistics.median(v) * 1e6, 2) for k, v in
                          (("cold_us", cold), ("warm_us", warm), ("miss_us", miss))}
        for key in ("cold_us", "warm_us", "miss_us"):
            k, t = res["kvfs"][key], res["tmpfs"][key]
            res.setdefault("ratio", {})[key] = round(t / k, 3) if k else None
        res["kvfs_stats_per_s"] = round(1e6 / res["kvfs"]["cold_us"]) if res["kvfs"]["cold_us"] else None
        res["files"] = n
        for root in roots.values():
            shutil.rmtree(root)
        return res

    def bench_remount(self, count: int) -> dict:
        root = self.base / f"remount-{count}"
        shutil.rmtree(root, ignore_errors=True)
        ram = max(64 << 20, count * SMALL_OBJECT // 4)
        m = BenchMount(root, ram=ram, nvme_size=max(4 << 30, 4 * count * SMALL_OBJECT))
        out: dict = {"objects": count, "object_size": SMALL_OBJECT, "ram": ram}
        try:
            m.mount()
            out["rss_empty"] = m.memory()
            payload = os.urandom(SMALL_OBJECT)
            t0 = time.perf_counter()
            out["create_per_s"] = round(count / _create_many(m.path / "small", count, payload,
                                                              self.progress, t0))
            out["rss_loaded"] = m.memory()
            st = m.stats()
            out["tiers"] = {k: v.get("objects") for k, v in (st.get("tiers") or {}).items()}
            self.progress(f"remount {count}: unmounting (flush)")
            out["umount_s"] = round(m.umount(), 3)
            self.progress(f"remount {count}: mounting again")
            out["mount_s"] = round(m.mount(), 3)
            out["rss_remounted"] = m.memory()
            self.progress(f"remount {count}: stat of every file")
            t0 = time.perf_counter()
            seen = sum(len(files) for _, _, files in os.walk(m.path / "small"))
            out["walk_s"] = round(time.perf_counter() - t0, 3)
            if seen != count:
                raise BenchError(f"after remount {seen} of {count} small files are visible")
            out["rss_after_walk"] = m.memory()
            m.umount()
        finally:
            m.cleanup()
            shutil.rmtree(root, ignore_errors=True)
        return out


def _stat_all(root: Path, names: list[str], exist: bool) -> float:
    """Mean seconds per stat() of ``names`` under ``root``."""
    paths = [os.path.join(root, n) for n in names]
    t0 = time.perf_counter()
    for p in paths:
        try:
            os.stat(p)
        except FileNotFoundError:
            if exist:
                raise BenchError(f"{p} vanished") from None
    return (time.perf_counter() - t0) / len(paths)


def _create_many(root: Path, count: int, payload: bytes, progress, t0: float) -> float:
    """Create ``count`` small files under 256 directories with 4 threads; returns seconds."""
    for d in range(256):
        (root / f"{d:02x}").mkdir(parents=True, exist_ok=True)

    def work(lo: int, hi: int) -> None:
        for i in range(lo, hi):
            fd = os.open(root / f"{i % 256:02x}" / f"{i:08d}.bin", os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.write(fd, payload)
            finally:
                os.close(fd)

    step = 10_000
    with ThreadPoolExecutor(4) as pool:
        for lo in range(0, count, step):
            hi = min(count, lo + step)
            chunk = (hi - lo + 3) // 4
            list(pool.map(lambda a: work(*a), [(x, min(hi, x + chunk)) for x in range(lo, hi, chunk)]))
            rate = hi / max(time.perf_counter() - t0, 1e-9)
            progress(f"remount {count}: created {hi} small files ({rate:.0f}/s)")
    return time.perf_counter() - t0


def machine() -> dict:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        import pyfuse3
        pf = pyfuse3.__version__ if hasattr(pyfuse3, "__version__") else "?"
    except Exception:  # noqa: BLE001
        pf = "unavailable"
    return {"cpus": os.cpu_count(), "memory_gib": round(mem / 2**30, 1),
            "kernel": platform.release(), "python": platform.python_version(), "pyfuse3": pf,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def run_all(base: Path, tmpfs: Path, size: int, block: int, runs: int, lookup_files: int,
            small_counts: list[int], selected: set[str], console=None) -> dict:
    """Run the selected benchmarks; returns a JSON-able dict of results."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    base = base.expanduser().resolve()
    try:
        base.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BenchError(f"cannot create scratch directory {base}: {e.strerror}") from None
    results: dict = {"machine": machine(), "params": {
        "size": size, "block": block, "runs": runs, "scratch": str(base), "tmpfs": str(tmpfs),
        "lookup_files": lookup_files, "small_objects": small_counts}}
    prog = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                    console=console, transient=True)
    with prog:
        task = prog.add_task("starting", total=None)

        def progress(what: str) -> None:
            prog.update(task, description=what)

        r = Runner(base, tmpfs, size, block, runs, progress)
        ram = 3 * size + (64 << 20)
        m = BenchMount(base / "main", ram=ram, nvme_size=max(8 << 30, 4 * (ram + size)))
        throughput: list[dict] = []
        try:
            progress("mounting")
            m.mount()
            for name, fn in (("write", lambda: [r.bench_write(m)]),
                             ("read", lambda: r.bench_read(m)),
                             ("nvme", lambda: [r.bench_nvme(m, ram)])):
                if name in selected:
                    try:
                        throughput += fn()
                    except (BenchError, OSError) as e:
                        throughput.append({"name": name, "error": str(e)})
            if "lookup" in selected:
                try:
                    results["lookup"] = r.bench_lookup(m, lookup_files)
                except (BenchError, OSError) as e:
                    results["lookup"] = {"error": str(e)}
            results["stats_after"] = m.stats()
            m.umount()
        finally:
            m.cleanup()
            shutil.rmtree(r.tmp, ignore_errors=True)
        results["throughput"] = throughput
        if "remount" in selected:
            results["remount"] = []
            for count in small_counts:
                try:
                    results["remount"].append(r.bench_remount(count))
                except (BenchError, OSError) as e:
                    results["remount"].append({"objects": count, "error": str(e)})
        results["notes"] = r.notes
    return results


def print_results(results: dict, console) -> None:
    from rich.table import Table
    t = Table(title="kvfs bench: throughput (GB/s, median)")
    for c in ("benchmark", "kvfs", "baseline", "base GB/s", "ratio", "target"):
        t.add_column(c, justify="left" if c in ("benchmark", "baseline") else "right")
    for row in results.get("throughput", []):
        if "error" in row:
            t.add_row(row["name"], "error", row["error"], "", "", "")
            continue
        ok = row.get("meets_target")
        mark = "" if ok is None else (" [green]ok[/]" if ok else " [red]below[/]")
        t.add_row(row["name"], f"{row['kvfs_gbps']:.2f}", row["baseline"],
                  f"{row['baseline_gbps']:.2f}", f"{row['ratio']:.2f}x",
                  (f"≥{row['target']}x" if row.get("target") else "") + mark)
    console.print(t)
    lk = results.get("lookup")
    if lk and "error" not in lk:
        console.print(f"stat latency (µs): kvfs cold {lk['kvfs']['cold_us']}, warm "
                      f"{lk['kvfs']['warm_us']}, miss {lk['kvfs']['miss_us']} | tmpfs cold "
                      f"{lk['tmpfs']['cold_us']}, warm {lk['tmpfs']['warm_us']}, miss "
                      f"{lk['tmpfs']['miss_us']}")
    elif lk:
        console.print(f"lookup: error: {lk['error']}")
    for rm in results.get("remount", []):
        console.print(f"remount: {json.dumps(rm)}")
    for n in results.get("notes", []):
        console.print(f"note: {n}")
