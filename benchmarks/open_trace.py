"""Where the reader's ``open`` of a block just written goes, request by request (stop 38).

    python benchmarks/open_trace.py [--files 60] [--spin-us N] [--json OUT] [--keep TEXT]

Mounts kvfs (kernel transport, passthrough; ``--spin-us`` sets ``fuse_spin_us``), then per
file: a 2 MiB block written, then ``open`` + ``readv`` + ``close`` (as readback_profile.py), all
under ``perf record -a`` of the FUSE tracepoints,
the scheduler's switches and the syscalls that bound each step. For every reader's OPEN it
splits the time of ``openat`` into:

- ``before_send``: the reader's ``openat`` up to the OPEN request queued (path walk);
- ``to_first_read``: queued until the daemon's next ``readv`` of ``/dev/fuse`` returned
  (its wake-up, or its turn on the CPU); ``queued_behind``: from there until the OPEN itself
  was read (the writer's RELEASE, queued just before, handled first); ``to_read``: both;
- ``handler``: that ``readv`` until the reply's write ended the request;
- ``after_end``: the request ended until the reader's ``openat`` returned (the reader's
  wake-up and the kernel's open of the backing file);

and the state of the daemon's thread that read it when the OPEN was queued (``on`` the CPU,
``R`` preempted, ``S`` asleep), and how long before that the daemon had read its previous
request. Needs root (perf's tracepoints); perf's own overhead inflates syscall-heavy steps.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from kvfs.bench import BenchMount, aligned_buffer  # noqa: E402

SIZE = 2 << 20
OPEN = 14
EVENTS = ["fuse:fuse_request_send", "fuse:fuse_request_end", "sched:sched_switch",
          "syscalls:sys_enter_openat", "syscalls:sys_exit_openat", "syscalls:sys_exit_readv",
          "syscalls:sys_exit_read"]
LINE = re.compile(r"^\s*(?P<comm>.+?)\s+(?P<tid>\d+)\s+\[(?P<cpu>\d+)\]\s+(?P<t>[\d.]+):\s+(?P<ev>\S+):\s*(?P<rest>.*)$")


def workload(d: str, files: int, tag: str) -> None:
    w, r = memoryview(aligned_buffer(SIZE, b"k")), memoryview(aligned_buffer(SIZE))
    for i in range(files):
        p = os.path.join(d, f"{tag}{i}.bin")
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, w)
        os.close(fd)
        fd = os.open(p, os.O_RDONLY)
        os.readv(fd, [r])
        os.close(fd)


def parse(text: str, reader: int, daemon_pids: set[int]) -> list[dict]:
    """The OPENs the reader sent, each split into its phases (microseconds)."""
    ev = []
    for line in text.splitlines():
        m = LINE.match(line)
        if m:
            ev.append((float(m["t"]) * 1e6, int(m["tid"]), m["ev"], m["rest"]))
    state: dict[int, str] = {}            # tid -> "on" (running), "R" (preempted), "S" (asleep)
    daemon_read_at: list[float] = []      # the daemon's readv exits (any request)
    out, cur = [], None
    for t, tid, name, rest in ev:
        if name == "sched:sched_switch":
            pp = int(re.search(r"prev_pid=(\d+)", rest)[1])
            np_ = int(re.search(r"next_pid=(\d+)", rest)[1])
            st = re.search(r"prev_state=(\S+)", rest)[1]
            state[pp] = "R" if st.startswith("R") else "S"
            state[np_] = "on"
            if cur is not None and np_ in daemon_pids and "read" not in cur and "send" in cur:
                cur.setdefault("daemon_on", t)
            if cur is not None and np_ == reader and "end" in cur:
                cur.setdefault("reader_on", t)
        elif name == "syscalls:sys_enter_openat" and tid == reader:
            cur = {"enter": t}
        elif name == "fuse:fuse_request_send" and tid == reader and cur is not None:
            if int(re.search(r"opcode (\d+)", rest)[1]) == OPEN and "send" not in cur:
                cur["send"], cur["unique"] = t, int(re.search(r"req (\d+)", rest)[1])
                cur["len"], cur["reads_before"] = int(re.search(r"len (\d+)", rest)[1]), 0
                cur["states"] = {p: state.get(p, "S") for p in daemon_pids}
                cur["since_prev_read"] = t - daemon_read_at[-1] if daemon_read_at else None
        elif name in ("syscalls:sys_exit_readv", "syscalls:sys_exit_read") and tid in daemon_pids:
            m = re.search(r"0x([0-9a-f]+)", rest)
            n = int(m[1], 16) if m else 0
            if 0 < n < 4096:
                if cur is not None and "send" in cur and "read" not in cur:
                    cur.setdefault("first_read", t)
                    if n == cur["len"]:
                        cur["daemon"] = cur["states"].pop(tid)
                        del cur["states"]
                        cur["read"] = t
                    else:               # another request read first (the writer's RELEASE)
                        cur["reads_before"] += 1
                daemon_read_at.append(t)
        elif name == "fuse:fuse_request_end" and cur is not None and "unique" in cur:
            if int(re.search(r"req (\d+)", rest)[1]) == cur["unique"]:
                cur["end"] = t
        elif name == "syscalls:sys_exit_openat" and tid == reader and cur is not None:
            if {"send", "read", "end"} <= cur.keys():
                cur["ret"] = t
                out.append(cur)
            cur = None
    return out


def summary(rows: list[dict]) -> dict:
    def med(f):
        v = [f(r) for r in rows]
        v = [x for x in v if x is not None]
        return round(statistics.median(v), 1) if v else None
    return {
        "opens": len(rows),
        "openat": med(lambda r: r["ret"] - r["enter"]),
        "before_send": med(lambda r: r["send"] - r["enter"]),
        "to_read": med(lambda r: r["read"] - r["send"]),
        "handler": med(lambda r: r["end"] - r["read"]),
        "after_end": med(lambda r: r["ret"] - r["end"]),
        "reader_wakeup": med(lambda r: r.get("reader_on", r["ret"]) - r["end"]),
        "daemon_at_send": {k: sum(r["daemon"] == k for r in rows) for k in ("on", "R", "S")},
        "to_first_read": med(lambda r: r["first_read"] - r["send"]),
        "to_first_read_asleep": med(lambda r: (r["first_read"] - r["send"]) if r["daemon"] == "S" else None),
        "to_first_read_preempted": med(lambda r: (r["first_read"] - r["send"]) if r["daemon"] == "R" else None),
        "queued_behind": med(lambda r: r["read"] - r["first_read"]),
        "other_request_first": sum(r["reads_before"] > 0 for r in rows),
        "since_prev_read": med(lambda r: r["since_prev_read"]),
        "since_prev_read_p90": (round(sorted(x["since_prev_read"] for x in rows)[int(len(rows) * .9)], 1)
                                if rows else None),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=60)
    ap.add_argument("--spin-us", type=int)
    ap.add_argument("--dir", default="/tmp/open-trace")
    ap.add_argument("--json")
    ap.add_argument("--keep", help="write perf script's text here too")
    ap.add_argument("--syscalls", action="store_true", help="record every syscall's entry too (for --keep)")
    a = ap.parse_args(argv)
    shutil.rmtree(a.dir, ignore_errors=True)
    cfg = {"passthrough": True}
    if a.spin_us is not None:
        cfg["fuse_spin_us"] = a.spin_us
    m = BenchMount(Path(a.dir), ram=1 << 30, nvme_size=1 << 30, **cfg)
    m.mount()
    d, pids = str(m.path), {m.pid}
    try:
        workload(d, 5, "warm")                      # warm: the first files pay imports and the workers
        pids |= {int(t) for t in os.listdir(f"/proc/{next(iter(pids))}/task")}
        with tempfile.TemporaryDirectory(prefix="open-trace-") as tmp:
            data = os.path.join(tmp, "perf.data")
            perf = subprocess.Popen(["perf", "record", "-q", "-a", "-o", data]
                                    + [x for e in EVENTS + ["raw_syscalls:sys_enter"] * a.syscalls
                                       for x in ("-e", e)],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)                    # perf's start (not measured)
            workload(d, a.files, "t")
            perf.send_signal(signal.SIGINT)
            perf.wait()
            text = subprocess.run(["perf", "script", "-i", data, "-F", "comm,tid,cpu,time,event,trace"],
                                  capture_output=True, text=True).stdout
        if a.keep:
            Path(a.keep).write_text(text)
        rows = parse(text, os.getpid(), pids)
    finally:
        m.umount()
        shutil.rmtree(a.dir, ignore_errors=True)
    s = summary(rows)
    print(json.dumps(s))
    if a.json:
        Path(a.json).write_text(json.dumps({"summary": s, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
