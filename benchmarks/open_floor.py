"""The floor of "open + read a 2 MiB block" with a FUSE round trip per open (stop 38).

    python benchmarks/open_floor.py [--files 40] [--rounds 6] [--spin-us 100] [--json OUT]

Compiles benchmarks/open_floor.c with gcc into a temporary directory (never committed as a
binary) and serves a directory (``--under``, default /tmp) with it twice: ``c`` (a blocking read of /dev/fuse, as
libfuse does) and ``c_spin`` (the read retried for ``--spin-us`` after each answer; ``c_spinN``: N µs;
``c_yieldN``: the same with ``sched_yield`` between tries); beside
them ``spike`` (benchmarks/passthrough_spike.py, Python, the same protocol work: open,
register, close per OPEN, ``FOPEN_NOFLUSH``, 1 thread) and ``plain`` (the served file itself).
Per file and target: 2 MiB written into the served directory (untimed), its name looked up
through the mount (untimed ``stat``: a LOOKUP, as kvfs's writer's CREATE leaves the name
cached), then ``open`` + one ``readv`` of it all + ``close`` timed apiece; targets interleaved
per round in a rotating order. Medians per phase in µs (min–max of the round medians), and
the ratio of each target's open+read+close to plain's, per round. Every server's CPU seconds,
and a 2-second idle window after the run (a spinning server must not burn a core when idle).
Needs root (mount(2), the backing ioctl).
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

SIZE = 2 << 20
ns = time.perf_counter_ns


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--spin-us", type=int, default=100)
    ap.add_argument("--targets", default="c,c_spin,spike,plain")
    ap.add_argument("--under", default="/tmp",
                    help="where the served directories live (/tmp: the page cache of readback_profile.py's "
                         "plain target; a 4 KiB-page tmpfs such as /dev/shm reads 2 MiB ~3x slower here)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    targets = a.targets.split(",")
    work = Path(tempfile.mkdtemp(prefix="open-floor-", dir="/tmp"))
    shm = Path(tempfile.mkdtemp(prefix="open-floor-files-", dir=a.under))
    exe = work / "open_floor"
    subprocess.run(["gcc", "-O2", "-Wall", "-o", str(exe), str(REPO / "benchmarks" / "open_floor.c")], check=True)
    procs: dict[str, subprocess.Popen] = {}
    dirs: dict[str, tuple[str, str]] = {}          # target -> (where the reader opens, where the file is written)
    try:
        for t in targets:
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
                # c_spin, c_spinN (N µs), c_yieldN (the same, sched_yield between tries)
                spin = 0 if t == "c" else int(t.lstrip("c_spinyeld") or a.spin_us)
                cmd = [str(exe), str(mnt), str(back), str(spin)] + ["yield"] * t.startswith("c_yield")
            procs[t] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            wait_mounted(str(mnt), procs[t])
            dirs[t] = (str(mnt), str(back))
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
                    t0 = ns()
                    fd = os.open(p, os.O_RDONLY)
                    t1 = ns()
                    n = os.readv(fd, [r])
                    t2 = ns()
                    os.close(fd)
                    t3 = ns()
                    assert n == SIZE, (t, n)
                    out.append((t1 - t0, t2 - t1, t3 - t2))
                res[t].append(out)
                for i in range(a.files):
                    os.unlink(os.path.join(wd, f"r{rnd}-{i}.bin"))
        cpu_run = {t: round(cpu_s(p.pid) - cpu0[t], 2) for t, p in procs.items()}
        idle0 = {t: cpu_s(p.pid) for t, p in procs.items()}
        time.sleep(2.0)
        cpu_idle = {t: round(cpu_s(p.pid) - idle0[t], 3) for t, p in procs.items()}
    finally:
        for t, p in procs.items():
            subprocess.run(["umount", "-l", dirs.get(t, (str(work / t),))[0]], capture_output=True)
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    print(f"{a.files} files x {a.rounds} rounds, 2 MiB each; spin {a.spin_us} µs; µs per file, median (min-max of round medians)")
    print("| target | open | readv | close | total | total / plain's, per round |")
    summary: dict = {}
    for t in targets:
        row, cells = {}, []
        for j, ph in enumerate(("open", "readv", "close", "total")):
            per = [[(x[j] if j < 3 else sum(x)) / 1e3 for x in rd] for rd in res[t]]
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
    if a.json:
        Path(a.json).write_text(json.dumps({"files": a.files, "rounds": a.rounds, "spin_us": a.spin_us,
                                            "summary": summary, "cpu_run_s": cpu_run, "cpu_idle_2s": cpu_idle,
                                            "raw": res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
