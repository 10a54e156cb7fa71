"""Where the time of "open + read a 2 MiB block right after it was written" goes.

    python benchmarks/readback_profile.py [--files 40] [--rounds 3] [--targets kvfs,kvfs_nopt,plain]

Per file (written untimed just before, as in runtime_patterns.py's pattern (e)): the time of
``open``, of one ``readv`` of the whole block, of ``close``; and the same for (e-mmap):
``open``, ``mmap`` + a copy of every page, ``munmap`` + ``close``; and with ``--kinds again``
the same file again (pattern (e)'s later read): one untimed read, then the timed one. For each kvfs mount, the
FUSE requests that reached the daemon during the reads, by opcode (``transport.by_opcode`` of
``.kvfs/stats``, less the requests of reading the stats file itself), and the passthrough
counters (opens given, backing files registered, opens that waited for a writer's RELEASE).

Targets: ``kvfs`` (kernel transport, passthrough on), ``kvfs_nopt`` (kernel transport,
passthrough off: the page cache), ``kvfs_pyfuse3``, ``plain`` (a directory beside the mounts),
``kvfs_spin`` (the ``kvfs`` target with ``fuse_spin_us`` = ``--spin-us``, the reader's
busy-poll after a request; ``kvfs_spinN``: N microseconds), and ``kvfs_before``: the ``kvfs`` target run by the code of another checkout (``--before DIR``,
e.g. a ``git archive`` of the commit before a change), so a before/after comparison shares
one run, interleaved, on a shared machine.
Medians per phase in microseconds; the spread is the min-max of the rounds' medians.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from kvfs.bench import BenchMount, aligned_buffer, code_of  # noqa: E402

MIB = 1 << 20
SIZE = 2 * MIB
MOUNTS = {"kvfs": dict(passthrough=True), "kvfs_nopt": dict(transport="kernel", passthrough=False),
          "kvfs_pyfuse3": dict(transport="pyfuse3"), "kvfs_before": dict(passthrough=True),
          "kvfs_spin": dict(passthrough=True)}
ns = time.perf_counter_ns


def write(path: str, mv) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, mv)
    finally:
        os.close(fd)


def read_one(path: str, r) -> tuple[int, int, int]:
    t0 = ns()
    fd = os.open(path, os.O_RDONLY)
    t1 = ns()
    n = os.readv(fd, [r])
    t2 = ns()
    os.close(fd)
    t3 = ns()
    assert n == SIZE, n
    return t1 - t0, t2 - t1, t3 - t2


def mmap_one(path: str, r) -> tuple[int, int, int]:
    t0 = ns()
    fd = os.open(path, os.O_RDONLY)
    t1 = ns()
    mm = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ)
    with memoryview(mm) as src:
        r[:] = src
    t2 = ns()
    mm.close()
    os.close(fd)
    t3 = ns()
    return t1 - t0, t2 - t1, t3 - t2


def daemon_cpu(pid: int | None) -> float | None:
    """The daemon's CPU seconds so far (user + system, all its threads)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, TypeError):
        return None
    return round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 2)


def stats(m: BenchMount) -> dict:
    tr = m.stats().get("transport", {})
    return {"ops": dict(tr.get("by_opcode", {})), "pt": dict(tr.get("passthrough") or {})}


def diff(a: dict, b: dict, base: dict) -> dict:
    ops = {k: b["ops"].get(k, 0) - a["ops"].get(k, 0) - base.get(k, 0) for k in b["ops"]}
    pt = {k: b["pt"][k] - a["pt"].get(k, 0) for k in b["pt"] if isinstance(b["pt"][k], int)}
    return {"ops": {k: v for k, v in ops.items() if v}, "pt": {k: v for k, v in pt.items() if v}}


def one_round(d: str, files: int, kind: str, w, r) -> list[tuple[int, int, int]]:
    fn = mmap_one if kind == "mmap" else read_one
    out = []
    for i in range(files):
        p = os.path.join(d, f"{kind}{i}.bin")
        write(p, w)
        if kind == "again":         # the same file again: read once untimed, then timed
            fn(p, r)
        out.append(fn(p, r))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/open-profile")
    ap.add_argument("--targets", default="kvfs,kvfs_nopt,plain")
    ap.add_argument("--before", help="a checkout whose code the kvfs_before target runs")
    ap.add_argument("--kinds", default="read,mmap",
                    help="read, mmap, again (a second open + readv of the file just read)")
    ap.add_argument("--spin-us", type=int, default=100, help="fuse_spin_us of the kvfs_spin target")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    for t in a.targets.split(","):         # kvfs_spin, or kvfs_spinN: fuse_spin_us = N
        if t.startswith("kvfs_spin"):
            MOUNTS[t] = dict(passthrough=True, fuse_spin_us=int(t[9:] or a.spin_us))
    kinds = a.kinds.split(",")
    base = Path(a.dir)
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    targets = a.targets.split(",")
    if "kvfs_before" in targets and not a.before:
        ap.error("the kvfs_before target needs --before DIR")
    mounts = {t: BenchMount(base / t, ram=1 << 30, nvme_size=1 << 30, **MOUNTS[t])
              for t in targets if t in MOUNTS}
    w, r = memoryview(aligned_buffer(SIZE, b"k")), memoryview(aligned_buffer(SIZE))
    res: dict = {t: {k: [] for k in kinds} for t in targets}
    counts: dict = {t: {} for t in mounts}
    try:
        for t, m in mounts.items():
            with code_of(os.path.abspath(a.before) if t == "kvfs_before" else None):
                m.mount()
        dirs = {t: str(m.path) for t, m in mounts.items()}
        if "plain" in targets:
            dirs["plain"] = str(base / "plain")
        sbase = {}
        for t, m in mounts.items():        # the requests of reading the stats file itself
            s0 = stats(m)
            s1 = stats(m)
            sbase[t] = {k: s1["ops"].get(k, 0) - s0["ops"].get(k, 0) for k in s1["ops"]}
        latency, request_loop, cpu, idle = {}, {}, {}, {}
        for rnd in range(a.rounds):
            for kind in kinds:
                for t in targets[rnd % len(targets):] + targets[:rnd % len(targets)]:
                    d = os.path.join(dirs[t], f"r{rnd}")
                    os.makedirs(d, exist_ok=True)
                    before = stats(mounts[t]) if t in mounts else None
                    res[t][kind].append(one_round(d, a.files, kind, w, r))
                    if before is not None:
                        c = diff(before, stats(mounts[t]), sbase[t])
                        acc = counts[t].setdefault(kind, {"ops": {}, "pt": {}})
                        for g in ("ops", "pt"):
                            for k, v in c[g].items():
                                acc[g][k] = acc[g].get(k, 0) + v
            for t in targets:
                shutil.rmtree(os.path.join(dirs[t], f"r{rnd}"), ignore_errors=True)
        for t, m in mounts.items():
            st = m.stats()
            latency[t] = st.get("transport", {}).get("us_by_opcode", {})
            request_loop[t] = st.get("request_loop", {})
            cpu[t] = daemon_cpu(m.pid)
        idle0 = {t: daemon_cpu(m.pid) for t, m in mounts.items()}
        time.sleep(2.0)                 # idle: a spinning reader must not burn a core meanwhile
        idle = {t: round(daemon_cpu(m.pid) - idle0[t], 3) for t, m in mounts.items()}
    finally:
        for m in mounts.values():
            try:
                m.umount()
            except Exception:       # noqa: BLE001
                m.cleanup()
        shutil.rmtree(base, ignore_errors=True)
    n = a.files * a.rounds
    print(f"{a.files} files x {a.rounds} rounds; microseconds per file, median (min-max of round medians)")
    summary: dict = {}
    for kind, phases in (("read", ("open", "readv", "close")), ("mmap", ("open", "mmap+copy", "munmap+close")),
                         ("again", ("open", "readv", "close"))):
        if kind not in kinds:
            continue
        print(f"\n{kind}: | target | " + " | ".join(phases) + " | total | GB/s |")
        for t in targets:
            rounds = res[t][kind]
            row, cells = {}, []
            for j, ph in enumerate(phases + ("total",)):
                per = [[(x[j] if j < 3 else sum(x)) / 1e3 for x in rd] for rd in rounds]
                meds = [statistics.median(p) for p in per]
                med = statistics.median([v for p in per for v in p])
                row[ph] = {"median": med, "min": min(meds), "max": max(meds)}
                cells.append(f"{med:.0f} ({min(meds):.0f}-{max(meds):.0f})")
            gb = SIZE / (row["total"]["median"] * 1e3)
            row["gbps"] = gb
            summary.setdefault(t, {})[kind] = row
            print(f"| {t} | " + " | ".join(cells) + f" | {gb:.2f} |")
    for t in mounts:
        for kind in kinds:
            c = counts[t].get(kind, {})
            print(f"{t} {kind}: per file, requests to the daemon "
                  + json.dumps({k: round(v / n, 2) for k, v in sorted(c.get("ops", {}).items())})
                  + "; passthrough " + json.dumps(c.get("pt", {})))
    for t, loop_stats in request_loop.items():
        print(f"{t}: request loop " + json.dumps(loop_stats))
    for t, lat in latency.items():
        if lat:
            print(f"{t}: mean microseconds in the daemon per request (whole run) " + json.dumps(lat))
    print("daemon CPU seconds, whole run (user+system): " + json.dumps(cpu)
          + "; in 2 s idle after it: " + json.dumps(idle))
    if a.json:
        Path(a.json).write_text(json.dumps({"files": a.files, "rounds": a.rounds, "spin_us": a.spin_us,
                                            "summary": summary, "counts": counts, "us_by_opcode": latency,
                                            "request_loop": request_loop, "daemon_cpu_s": cpu, "daemon_cpu_idle_2s": idle,
                                            "raw": res},
                                           indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
