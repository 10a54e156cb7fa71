"""The floor of "open + read a 2 MiB block" with a FUSE round trip per open (stop 38).

    python benchmarks/open_floor.py [--files 40] [--rounds 6] [--spin-us 100] [--mode open|stat] [--json OUT]

Compiles benchmarks/open_floor.c with gcc into a temporary directory (never committed as a
binary) and serves a directory (``--under``, default /tmp) with it twice: ``c`` (a blocking read of /dev/fuse, as
libfuse does) and ``c_spin`` (the read retried for ``--spin-us`` after each answer; ``c_spinN``: N µs;
``c_yieldN``: the same with ``sched_yield`` between tries; ``c_uring``: FUSE over io_uring, one
thread serving every CPU queue's entries, ``c_uringpin``: a thread per CPU queue pinned to its CPU,
``c_uring_spinN``/``c_uringpin_spinN``: the CQ ring polled N µs before sleeping); beside
them ``spike`` (benchmarks/passthrough_spike.py, Python, the same protocol work: open,
register, close per OPEN, ``FOPEN_NOFLUSH``, 1 thread) and ``plain`` (the served file itself).
Per file and target: 2 MiB written into the served directory (untimed), its name looked up
through the mount (untimed ``stat``: a LOOKUP, as kvfs's writer's CREATE leaves the name
cached), then ``open`` + one ``readv`` of it all + ``close`` timed apiece; targets interleaved
per round in a rotating order. Medians per phase in µs (min–max of the round medians), and
the ratio of each target's open+read+close to plain's, per round. Every server's CPU seconds,
and a 2-second idle window after the run (a spinning server must not burn a core when idle).
Needs root (mount(2), the backing ioctl).

Over io_uring the fuse module's ``enable_uring`` (host-global) must be on when the mount's INIT
is sent: it is set to Y just before the io_uring servers start, and put back to its old value as
soon as they have registered their rings (a connection that negotiated io_uring keeps it), and
again in ``finally``.

``--mode stat``: the servers answer LOOKUP and GETATTR with an attribute timeout of 0, and per
file, after the untimed LOOKUP, ``--stats`` ``stat`` calls are timed apiece: each one a GETATTR
round trip (plain: the file's own ``stat``).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from kvfs.bench import aligned_buffer  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
from readback_profile import SIZE, read_one  # noqa: E402  (the same timed read, 2 MiB)

ns = time.perf_counter_ns
URING = Path("/sys/module/fuse/parameters/enable_uring")


def c_args(t: str, spin_default: int) -> list[str]:
    """open_floor.c's arguments after MOUNTPOINT BACKING_DIR for a target name: c, c_spinN,
    c_yieldN, c_uring[_spinN], c_uringpin[_spinN]."""
    parts = t.split("_")[1:]
    spin, extra = 0, []
    for p in parts:
        if p in ("uring", "uringpin"):
            extra.append(p)
        elif p.startswith("spin") or p.startswith("yield"):
            spin = int(p.lstrip("spinyeld") or spin_default)
            if p.startswith("yield"):
                extra.append("yield")
        else:
            raise SystemExit(f"unknown target {t}")
    return [str(spin)] + extra


def wait_line(proc: subprocess.Popen, timeout: float = 10.0) -> str:
    """The server's first line on stdout (READY ... or URING_FAIL ...), or why there was none."""
    import select
    r, _, _ = select.select([proc.stdout], [], [], timeout)
    if not r:
        return "no line in %.0f s" % timeout
    return proc.stdout.readline().strip() or f"exited: {proc.stderr.read() if proc.stderr else ''}"


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_mounted(path: str, proc: subprocess.Popen) -> None:
    for _ in range(200):
        if os.path.ismount(path):
            return
        if proc.poll() is not None:
            raise RuntimeError(f"server for {path} exited: {proc.stderr.read() if proc.stderr else ''}")
        time.sleep(0.05)
    raise RuntimeError(f"{path} not mounted")


def stat_threads(paths: list[str], threads: int, stats: int) -> int:
    """ns of wall time per stat with `threads` callers at once, each stat-ing its share of paths."""
    import threading
    go = threading.Barrier(threads + 1)

    def run(mine: list[str]) -> None:
        go.wait()
        for p in mine:
            for _ in range(stats):
                os.stat(p)
    ts = [threading.Thread(target=run, args=(paths[i::threads],)) for i in range(threads)]
    for th in ts:
        th.start()
    go.wait()
    t0 = ns()
    for th in ts:
        th.join()
    return (ns() - t0) // (len(paths) * stats)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--spin-us", type=int, default=100)
    ap.add_argument("--targets", default="c,c_spin,spike,plain")
    ap.add_argument("--under", default="/tmp",
                    help="where the served directories live (/tmp: the page cache of readback_profile.py's "
                         "plain target; a 4 KiB-page tmpfs such as /dev/shm reads 2 MiB ~3x slower here)")
    ap.add_argument("--mode", choices=("open", "stat"), default="open")
    ap.add_argument("--stats", type=int, default=10, help="timed stat calls per file (--mode stat)")
    ap.add_argument("--threads", type=int, default=1,
                    help="--mode stat: callers at once, each on its share of the files; the round's wall "
                         "time per stat is recorded (throughput), not each call")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    targets = a.targets.split(",")
    uring_targets = [t for t in targets if "uring" in t]
    uring_old = URING.read_text().strip() if uring_targets and URING.exists() else None
    uring_log: dict = {"enable_uring_was": uring_old}
    work = Path(tempfile.mkdtemp(prefix="open-floor-", dir="/tmp"))
    shm = Path(tempfile.mkdtemp(prefix="open-floor-files-", dir=a.under))
    exe = work / "open_floor"
    subprocess.run(["gcc", "-O2", "-Wall", "-pthread", "-o", str(exe), str(REPO / "benchmarks" / "open_floor.c")], check=True)
    procs: dict[str, subprocess.Popen] = {}
    served: dict[str, list] = {}                   # C servers: requests answered over /dev/fuse and over the ring
    dirs: dict[str, tuple[str, str]] = {}          # target -> (where the reader opens, where the file is written)
    try:
        # io_uring servers first: enable_uring is on only while they mount and register
        for t in sorted(targets, key=lambda t: "uring" not in t):
            if uring_targets and t == uring_targets[0]:
                URING.write_text("Y")
            if uring_old is not None and "uring" not in t and URING.read_text().strip() != uring_old:
                URING.write_text(uring_old)
                uring_log["restored_after_registration"] = URING.read_text().strip()
            back = shm / t
            back.mkdir()
            if t == "plain":
                dirs[t] = (str(back), str(back))
                continue
            mnt = work / t
            mnt.mkdir()
            if t == "spike":
                cmd = [sys.executable, str(REPO / "benchmarks" / "passthrough_spike.py"), str(mnt), str(back),
                       "--noflush", "--threads", "1"]
            else:
                cmd = [str(exe), str(mnt), str(back)] + c_args(t, a.spin_us)
                if a.mode == "stat":
                    cmd.append("attr_ttl=0")
            procs[t] = subprocess.Popen(cmd, stdout=subprocess.PIPE if "uring" in t else subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True)
            if "uring" in t:
                line = wait_line(procs[t])
                uring_log[t] = line
                if not line.startswith("READY"):
                    raise RuntimeError(f"{t}: {line}")
            wait_mounted(str(mnt), procs[t])
            dirs[t] = (str(mnt), str(back))
        if uring_old is not None and URING.read_text().strip() != uring_old:
            URING.write_text(uring_old)
            uring_log["restored_after_registration"] = URING.read_text().strip()
        w, r = memoryview(aligned_buffer(SIZE, b"k")), memoryview(aligned_buffer(SIZE))
        cpu0 = {t: cpu_s(p.pid) for t, p in procs.items()}
        res: dict = {t: [] for t in targets}
        for rnd in range(a.rounds):
            for t in targets[rnd % len(targets):] + targets[:rnd % len(targets)]:
                out = []
                rd, wd = dirs[t]
                for i in range(a.files):
                    name = f"r{rnd}-{i}.bin"
                    fd = os.open(os.path.join(wd, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                    os.write(fd, w)
                    os.close(fd)
                    p = os.path.join(rd, name)
                    os.stat(p)
                    if a.mode == "stat" and a.threads > 1:
                        continue
                    if a.mode == "stat":
                        for _ in range(a.stats):
                            t0 = ns()
                            os.stat(p)
                            out.append((ns() - t0,))
                        continue
                    out.append(read_one(p, r))          # open, readv, close: µs apiece
                if a.mode == "stat" and a.threads > 1:
                    out.append((stat_threads([os.path.join(rd, f"r{rnd}-{i}.bin") for i in range(a.files)],
                                             a.threads, a.stats),))
                res[t].append(out)
                for i in range(a.files):
                    os.unlink(os.path.join(wd, f"r{rnd}-{i}.bin"))
        cpu_run = {t: round(cpu_s(p.pid) - cpu0[t], 2) for t, p in procs.items()}
        idle0 = {t: cpu_s(p.pid) for t, p in procs.items()}
        time.sleep(2.0)
        cpu_idle = {t: round(cpu_s(p.pid) - idle0[t], 3) for t, p in procs.items()}
    finally:
        if uring_old is not None:
            URING.write_text(uring_old)
            uring_log["enable_uring_end"] = URING.read_text().strip()
        for t, p in procs.items():
            subprocess.run(["umount", "-l", dirs.get(t, (str(work / t),))[0]], capture_output=True)
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
            if t.startswith("c") and p.stderr:
                served[t] = [ln for ln in p.stderr.read().splitlines() if ln.startswith("served")]
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    phases = ("open", "readv", "close") if a.mode == "open" else ("stat",)
    what = "2 MiB each" if a.mode == "open" else f"{a.stats} stats each, attribute timeout 0"
    if a.mode == "stat" and a.threads > 1:
        what += f", {a.threads} threads: wall time per stat, one value a round"
    print(f"{a.files} files x {a.rounds} rounds, {what}; spin {a.spin_us} µs; µs per file, median (min-max of round medians)")
    print("| target | " + " | ".join(phases) + " | total | total / plain's, per round |")
    summary: dict = {}
    for t in targets:
        row, cells = {}, []
        for j, ph in enumerate(phases + ("total",)):
            per = [[(x[j] if j < len(phases) else sum(x)) / 1e3 for x in rd] for rd in res[t]]
            meds = [statistics.median(p) for p in per]
            row[ph] = {"median": statistics.median([v for p in per for v in p]), "min": min(meds), "max": max(meds)}
            cells.append(f"{row[ph]['median']:.0f} ({min(meds):.0f}-{max(meds):.0f})")
        ratios = []
        if "plain" in res:
            for i, rd in enumerate(res[t]):
                ratios.append(statistics.median(sum(x) for x in res["plain"][i]) / statistics.median(sum(x) for x in rd))
            row["vs_plain"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
        summary[t] = row
        rs = f"{row['vs_plain']['median']:.2f} ({row['vs_plain']['min']:.2f}-{row['vs_plain']['max']:.2f})" if ratios else ""
        print(f"| {t} | " + " | ".join(cells) + f" | {rs} |")
    print("server CPU seconds during the run: " + json.dumps(cpu_run) + "; in 2 s idle after it: " + json.dumps(cpu_idle))
    if uring_targets:
        print("io_uring: " + json.dumps(uring_log))
    print("requests served: " + json.dumps(served))
    if a.json:
        Path(a.json).write_text(json.dumps({"files": a.files, "rounds": a.rounds, "spin_us": a.spin_us,
                                            "mode": a.mode, "stats": a.stats, "threads": a.threads, "uring": uring_log, "served": served,
                                            "loadavg_end": os.getloadavg(),
                                            "summary": summary, "cpu_run_s": cpu_run, "cpu_idle_2s": cpu_idle,
                                            "raw": res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
