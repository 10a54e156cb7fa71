"""Scale of kvfs's metadata: mount time, daemon memory and lookup/stat latency against file count.

    python benchmarks/metadata_scale.py [--counts 10000,100000] [--dirs 4096] [--sample 3000]
        [--rounds 3] [--dir DIR] [--keep DIR] [--json FILE]

For each count N: a fresh state directory is filled with N empty files in ``--dirs`` directories
through the store itself (``kvfs.store.store.Store``, in process: the same index operations a
mount makes, without N FUSE round trips) and closed as a clean unmount closes it, then
``kvfs mount`` (the CLI, until ready) serves it. ``--keep DIR`` populates each count once into
DIR and mounts copies (to compare two builds on the same state). Measured: mount-until-ready
seconds, seconds until the daemon's background scan of its object table is done
(``table_loaded`` in ``.kvfs/stats``) and until its name table is built (``names``), the
daemon's RSS after mounting and after the stats
(anonymous and file-backed: LMDB's mapped pages), and per-file latency of ``os.stat`` over
random samples of the files: **cold** (the kernel has no entry: a LOOKUP answered by the
daemon), **warm** (the same names again: the kernel's cache) and **miss** (a name that does not
exist: a LOOKUP the daemon answers with a negative entry). All counts are mounted at once and
the stats run in ``--rounds`` interleaved rounds (fresh names each round), so the counts are
compared under the same load. Flat latency from the smallest to the largest count means the
daemon's lookup does not grow with the number of files. Then the **kill -9 row**: through each
mount, ``CRASH_FILES`` small files (RAM-only objects) and one file left open unsealed, the stats
read (the index committed), the daemon killed with SIGKILL, and ``kvfs mount`` timed again
until ready: mount seconds, RSS, the records its recovery decoded (``recovered.decoded``; a
full walk decodes two per file) and seconds until its table is scanned; then a clean unmount
and a clean mount of the same state timed again (``remount_s``: the page cache as warm as
for the crash start) and the ratio of the two starts (``crash_ratio``). This VM is shared and
noisy: compare within a run.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import shutil
import signal
import stat as statmod
import subprocess
import statistics
import sys
import time
from pathlib import Path

import trio

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from kvfs.bench import BenchMount, wait_for  # noqa: E402
from kvfs.build import build_kvstore  # noqa: E402
from kvfs.config import Config  # noqa: E402
from kvfs.proc import pid_alive  # noqa: E402
from kvfs.store.index import ROOT_INO, Index  # noqa: E402
from kvfs.store.nvme import NvmeTier  # noqa: E402
from kvfs.store.ram import RamTier  # noqa: E402

log = logging.getLogger("metadata_scale")
CRASH_FILES = 200           # RAM-only files written before the kill -9


def file_names(count: int, dirs: int) -> list[tuple[str, str]]:
    return [(f"{i % dirs:04x}", f"{i:08d}.bin") for i in range(count)]


async def populate(root: Path, count: int, dirs: int, progress) -> float:
    """``count`` empty sealed files under ``dirs`` directories in the state of a BenchMount
    at ``root`` (state/ and nvme/ as it lays them out); returns seconds."""
    index = Index(root / "state")
    tiers = [RamTier(64 << 20, "/dev/shm", index.instance_id), NvmeTier(1 << 30, root / "nvme")]
    for t in tiers:
        await t.open()
    kvstore = build_kvstore(Config(), index, tiers)
    await kvstore.start()
    t0 = time.perf_counter()
    try:
        dino = {}
        for d in range(min(dirs, count)):
            dino[f"{d:04x}"], _ = kvstore.ns.make(ROOT_INO, f"{d:04x}".encode(), statmod.S_IFDIR | 0o755,
                                                os.getuid(), os.getgid())
        for i, (d, name) in enumerate(file_names(count, dirs)):
            fh, _, _ = await kvstore.files.create(dino[d], name.encode(), 0o644, os.getuid(), os.getgid())
            await kvstore.files.release(fh)
            if i % 20000 == 19999:
                progress(f"{count}: {i + 1} files")
        await kvstore.store.mover.write_down_volatile()     # what `kvfs umount` does at the end
        kvstore.mark_clean()
    finally:
        for t in tiers:
            await t.close()
        index.close()
    return time.perf_counter() - t0


def _stat_us(paths: list[str], missing: bool = False) -> float:
    t0 = time.perf_counter()
    for p in paths:
        try:
            os.stat(p)
        except FileNotFoundError:
            if not missing:
                raise
    return (time.perf_counter() - t0) / len(paths) * 1e6


def _populated(root: Path, count: int, dirs: int, keep: Path | None, progress) -> float | None:
    """Fill ``root``'s state (and nvme) directories; with ``keep``, populate once into
    ``keep`` and copy from there (seconds of the population, None when copied)."""
    if keep is None:
        return round(trio.run(populate, root, count, dirs, progress), 2)
    tpl = keep / f"files-{count}-dirs-{dirs}"
    if not (tpl / "done").exists():
        shutil.rmtree(tpl, ignore_errors=True)
        (tpl / "nvme").mkdir(parents=True)
        (tpl / "state").mkdir(mode=0o700)
        trio.run(populate, tpl, count, dirs, progress)
        (tpl / "done").write_text("")
    for d in ("state", "nvme"):
        shutil.rmtree(root / d)
        shutil.copytree(tpl / d, root / d, symlinks=True)
    return None


def _mount(base: Path, count: int, dirs: int, keep: Path | None, progress) -> tuple[BenchMount, dict]:
    """A mount of ``count`` files: mount-until-ready, RSS, time until its table is scanned."""
    root = base / f"scale-{count}"
    shutil.rmtree(root, ignore_errors=True)
    m = BenchMount(root, ram=256 << 20, nvme_size=4 << 30)
    out: dict = {"files": count, "dirs": min(dirs, count)}
    out["populate_s"] = _populated(root, count, dirs, keep, progress)
    progress(f"{count}: mounting")
    t0 = time.perf_counter()
    out["mount_s"] = round(m.mount(), 3)
    mem = m.memory()
    out["rss_mounted"], out["anon_mounted"] = mem.get("VmRSS"), mem.get("RssAnon")
    # the object table's background scan (a daemon without one reports nothing: loaded) and
    # the name table's background build (advertised in ``names`` when complete)
    seen: dict = {}

    def done() -> bool:
        st, now = m.stats(), round(time.perf_counter() - t0, 2)
        if st.get("table_loaded", True):
            seen.setdefault("loaded_s", now)
        if st.get("names") is not None or not st.get("names_building", False):
            seen.setdefault("names_s", now)
        return len(seen) == 2
    wait_for(done, 3600, 0.02)
    out.update(seen)
    return m, out


def _kill9(m: BenchMount) -> None:
    pid = m.pid
    os.kill(pid, signal.SIGKILL)
    if not wait_for(lambda: not pid_alive(pid), 120):
        raise RuntimeError(f"daemon {pid} did not die")
    subprocess.run(["fusermount3", "-u", "-z", str(m.path)], capture_output=True, timeout=60)
    m.pid = None


def crash_row(m: BenchMount, out: dict, progress) -> None:
    """kill -9 after RAM-only files and an unsealed one, then time the start (see the top)."""
    d = m.path / "crash"
    d.mkdir()
    for i in range(CRASH_FILES):
        (d / f"r{i:04d}").write_bytes(b"r" * 4096)
    fd = os.open(d / "unsealed", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"u" * 4096)
        m.stats()                   # the index committed: what the kill leaves
        _kill9(m)
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    progress(f"{out['files']}: mounting after kill -9")
    t0 = time.perf_counter()
    out["crash_mount_s"] = round(m.mount(), 3)
    mem = m.memory()
    out["rss_crash"], out["anon_crash"] = mem.get("VmRSS"), mem.get("RssAnon")
    rec = m.stats().get("recovered", {})
    out["crash_decoded"], out["crash_dropped"] = rec.get("decoded"), rec.get("dropped_files")
    wait_for(lambda: m.stats().get("table_loaded", True), 3600, 0.05)
    out["crash_loaded_s"] = round(time.perf_counter() - t0, 2)
    # the same state started clean, with the page cache as warm as for the crash start
    # (the first mount above read a cold copy): a clean unmount, then the CLI again
    m.umount()
    out["remount_s"] = round(m.mount(), 3)
    mem = m.memory()
    out["rss_remount"], out["anon_remount"] = mem.get("VmRSS"), mem.get("RssAnon")
    out["crash_ratio"] = round(out["crash_mount_s"] / out["remount_s"], 2)


def measure_all(base: Path, counts: list[int], dirs: int, sample: int, rounds: int, progress,
                keep: Path | None = None) -> list[dict]:
    """Every count mounted at once, then ``rounds`` interleaved rounds of stats (each round
    a fresh sample of names, so cold stays cold): the counts are compared under the same
    load. Per count: medians over the rounds; ``cold_ratio``: per-round cold latency over
    the smallest count's, median and min-max."""
    mounts, rows = [], []
    try:
        for c in counts:
            m, out = _mount(base, c, dirs, keep, progress)
            mounts.append(m)
            rows.append(out)
        per = [max(1, min(sample, c // rounds)) for c in counts]
        names = [random.Random(c).sample(file_names(c, dirs), per[i] * rounds) for i, c in enumerate(counts)]
        got: list[dict] = [{"cold": [], "warm": [], "miss": []} for _ in counts]
        for r in range(rounds):
            progress(f"stat round {r + 1}/{rounds}")
            for i, m in enumerate(mounts):
                paths = [str(m.path / d / n) for d, n in names[i][r * per[i]:(r + 1) * per[i]]]
                got[i]["cold"].append(_stat_us(paths))
                got[i]["warm"].append(_stat_us(paths))
                got[i]["miss"].append(_stat_us([p + ".missing" for p in paths], missing=True))
        for i, (m, out) in enumerate(zip(mounts, rows)):
            for k in ("cold", "warm", "miss"):
                out[f"{k}_us"] = round(statistics.median(got[i][k]), 1)
            ratios = [a / b for a, b in zip(got[i]["cold"], got[0]["cold"])]
            out["cold_ratio"] = [round(statistics.median(ratios), 2), round(min(ratios), 2), round(max(ratios), 2)]
            mem = m.memory()
            out["rss_after"], out["anon_after"], out["file_after"] = (mem.get("VmRSS"), mem.get("RssAnon"),
                                                                      mem.get("RssFile"))
        for m, out in zip(mounts, rows):
            crash_row(m, out, progress)
        for m in mounts:
            m.umount()
    finally:
        for m in mounts:
            m.cleanup()
            shutil.rmtree(m.root, ignore_errors=True)
    return rows


def table(rows: list[dict]) -> str:
    out = ["| files | mount s | name table s | table scanned s | RSS mounted | RSS after stats (anon + file) "
           "| lookup (cold stat) µs | / smallest count | warm stat µs | miss µs |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    mib = lambda n: f"{n / 2**20:.0f}" if n is not None else "–"
    for r in rows:
        ratio = "{}× ({}–{})".format(*r["cold_ratio"])
        out.append(f"| {r['files']:,} | {r['mount_s']} | {r.get('names_s', '–')} | {r['loaded_s']} | "
                   f"{mib(r['rss_mounted'])} MiB | "
                   f"{mib(r['rss_after'])} MiB ({mib(r['anon_after'])} + {mib(r['file_after'])}) | "
                   f"{r['cold_us']} | {ratio} | {r['warm_us']} | {r['miss_us']} |")
    out += ["", "after kill -9 (" + str(CRASH_FILES) + " RAM-only files and one unsealed file in flight):", "",
            "| files | mount s | table scanned s | RSS mounted (anon) | records decoded | files dropped "
            "| clean remount s (RSS, anon) | crash / clean remount |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['files']:,} | {r['crash_mount_s']} | {r['crash_loaded_s']} | "
                   f"{mib(r['rss_crash'])} MiB ({mib(r['anon_crash'])}) | {r['crash_decoded']} | "
                   f"{r['crash_dropped']} | {r['remount_s']} ({mib(r['rss_remount'])} MiB, "
                   f"{mib(r['anon_remount'])}) | {r['crash_ratio']}× |")
    if len(rows) > 1 and rows[0]["cold_us"]:
        out += ["", f"lookup latency at {rows[-1]['files']:,} / at {rows[0]['files']:,} files: "
                f"{rows[-1]['cold_us'] / rows[0]['cold_us']:.2f}× (medians; per round "
                "{}×, {}–{})".format(*rows[-1]["cold_ratio"])]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--counts", default="10000,100000", help="comma-separated file counts")
    p.add_argument("--dirs", type=int, default=4096)
    p.add_argument("--sample", type=int, default=3000, help="files stat()ed per count and round")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of stats")
    p.add_argument("--dir", default=".kvfs-bench", help="scratch directory")
    p.add_argument("--json", default=None)
    p.add_argument("--keep", default=None, help="populate each count once into this directory and "
                   "mount copies of it (before/after comparisons of the same state)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    keep = Path(a.keep).resolve() if a.keep else None
    rows = measure_all(Path(a.dir).resolve(), [int(c) for c in a.counts.split(",")], a.dirs, a.sample,
                       a.rounds, lambda s: log.info("%s", s), keep)
    print(table(rows))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
