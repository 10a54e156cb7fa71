"""The pause a daemon's death costs a supervised mount (issue 41), under a runtime-like load.

    python benchmarks/restart_pause.py [--counts 1000,100000] [--kills 5] [--workers 4]
        [--dir DIR] [--json FILE] [--plot PNG [--compare LABEL=JSON ...]]
    python benchmarks/restart_pause.py --plot PNG --compare LABEL=JSON ...   (plot only)

For each count N: a state with N empty sealed files (``metadata_scale.populate``: through the
store, in process), ``kvfs mount --supervise``, ``CONTENT`` files of ``SIZE`` bytes written
through the mount and made durable (a clean unmount writes them down, then a mount again).
Then ``--workers`` processes loop on the mount: ``stat`` of a random one of the N files and a
whole ``read`` of a random content file, checked against its digest; every error is counted by
errno. While they run the serving daemon is killed with SIGKILL ``--kills`` times (the next
kill once the new daemon has served and the workers went on). Measured per kill:
``pause_s``, from the supervisor seeing the death to the new daemon's first answer (its own
count, ``.kvfs/stats`` ``supervisor.history``); ``ready_s``, to the new daemon having the
session (import, store start, attach); ``stall_s``, the longest a worker waited on one
operation across the kill (from the client's side: kill, exit, start, resend, answer; reads of
files opened with passthrough need no daemon at all). Per count: ENOTCONN and other errors the workers saw, wrong bytes, the requests the
new daemons answered EIO because they came through a dead daemon's file handle (a read
descriptor not in passthrough: from the daemons' logs, at most 5 per daemon), and the
medians. The supervisor's crash-loop back-off is set off for the run (``KVFS_RESTART_STABLE_S``
0.5: a daemon alive half a second is not a crash loop). The machine is shared and noisy: compare within a run.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

REPO = Path(__file__).resolve().parents[1]
for p in (str(REPO), str(REPO / "benchmarks")):
    if p not in sys.path:
        sys.path.insert(0, p)

from kvfs.bench import BenchMount, wait_for  # noqa: E402
from kvfs.proc import pid_alive  # noqa: E402
from metadata_scale import file_names, populate  # noqa: E402

CONTENT = 64
SIZE = 256 << 10
DIRS = 1024

# one worker: its ops' completion times go to a file at the end (monotonic, the machine's clock)
WORKER = r"""
import errno, hashlib, json, os, random, sys, time
root, names, want, stop, out = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4], sys.argv[5]
rng = random.Random(os.getpid())
errors, wrong, done, longest = {}, 0, [], []
content = sorted(want)
while not os.path.exists(stop):
    for path, check in ((os.path.join(root, rng.choice(names)), None),
                        (os.path.join(root, rng.choice(content)), True)):
        t0 = time.monotonic()
        try:
            if check:
                with open(path, "rb") as f:
                    if hashlib.sha256(f.read()).hexdigest() != want[os.path.relpath(path, root)]:
                        wrong += 1
            else:
                os.stat(path)
        except OSError as e:
            k = errno.errorcode.get(e.errno, str(e.errno))
            errors[k] = errors.get(k, 0) + 1
        t1 = time.monotonic()
        done.append(t1)
        longest.append((t1 - t0, t0))
longest.sort(reverse=True)
json.dump({"errors": errors, "wrong": wrong, "done": done, "longest": longest[:50]}, open(out, "w"))
"""


def _say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def one_count(base: Path, count: int, kills: int, workers: int) -> dict:
    root = base / f"restart-{count}"
    shutil.rmtree(root, ignore_errors=True)
    m = BenchMount(root, ram=256 << 20, nvme_size=4 << 30, supervise=True)
    _say(f"{count}: populating")
    trio.run(populate, root, count, DIRS, _say)
    m.mount()
    want = {}
    (m.path / "content").mkdir()
    for i in range(CONTENT):
        data = random.Random(i).randbytes(SIZE)
        (m.path / f"content/c{i:03d}").write_bytes(data)
        want[f"content/c{i:03d}"] = hashlib.sha256(data).hexdigest()
    m.umount()
    m.mount()
    names = [f"{d}/{n}" for d, n in random.Random(1).sample(file_names(count, DIRS), min(count, 5000))]
    tmp = Path(tempfile.mkdtemp(prefix="restart-pause-"))
    stop = tmp / "stop"
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(m.path), json.dumps(names), json.dumps(want),
                               str(stop), str(tmp / f"w{i}.json")]) for i in range(workers)]
    kill_times, rows = [], []
    try:
        time.sleep(1.0)                 # the workers under way (a benchmark, not a test)
        for k in range(kills):
            st = m.stats()
            old, epoch = int(st["pid"]), st["supervisor"]["epoch"]
            _say(f"{count}: kill -9 of daemon {old} (epoch {epoch})")
            kill_times.append(time.monotonic())
            os.kill(old, signal.SIGKILL)
            wait_for(lambda: not pid_alive(old), 120, 0.005)

            got: list = []

            def served():
                s = m.stats()
                h = (s["supervisor"].get("history") or [{}])[-1]
                if s["supervisor"]["epoch"] > epoch and "pause_s" in h:
                    got.append(s)
                return bool(got)
            if not wait_for(served, 300, 0.02):
                raise RuntimeError(f"no new daemon served after the kill of {old}")
            st = got[0]
            h = st["supervisor"]["history"][-1]
            rows.append({"pause_s": h["pause_s"], "ready_s": h["ready_s"], "resend": h.get("resend")})
            m.pid = int(st["pid"])
            time.sleep(1.0)             # load on the new daemon before the next kill
    finally:
        stop.touch()
        for p in procs:
            p.wait(120)
    seen = [json.loads((tmp / f"w{i}.json").read_text()) for i in range(workers)]
    shutil.rmtree(tmp, ignore_errors=True)
    done = sorted(t for s in seen for t in s["done"])
    for row, t_kill in zip(rows, kill_times):
        row["stall_s"] = round(max((d for s in seen for d, t0 in s["longest"] if t0 <= t_kill + 0.01
                                    and t0 + d >= t_kill), default=0.0), 4)
    errors: dict = {}
    for s in seen:
        for k, v in s["errors"].items():
            errors[k] = errors.get(k, 0) + v
    log_text = (m.state / "kvfs.log").read_text(errors="replace")
    stale = {kind: log_text.count(f"({kind}) reached this daemon: EIO")
             for kind in ("opened for reading", "opened for writing")}
    # what the daemons logged as errors besides the deaths (an EIO's cause: a read past its
    # deadline on a loaded machine, a handler's failure)
    logged = [line[24:220] for line in log_text.splitlines()
              if (" ERROR " in line or "deadline" in line) and "kvfs.supervisor" not in line][:20]
    m.umount()
    shutil.rmtree(root, ignore_errors=True)
    med = lambda key: round(statistics.median(r[key] for r in rows if r[key] is not None), 3)  # noqa: E731
    return {"files": count, "kills": kills, "workers": workers, "ops": len(done),
            "enotconn": errors.get("ENOTCONN", 0), "errors": errors,
            "wrong": sum(s["wrong"] for s in seen), "stale_handle_eio": stale, "logged": logged, "pause_s_median": med("pause_s"),
            "pause_s_max": max(r["pause_s"] for r in rows), "ready_s_median": med("ready_s"),
            "stall_s_median": med("stall_s"), "stall_s_max": max(r["stall_s"] for r in rows), "rows": rows}


def plot(path: str, series: dict[str, list[dict]]) -> None:
    """Each kill's pause (death to the first answer) against the file count, one series per
    run (a label each), the medians joined."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for (label, rows), marker in zip(series.items(), "os^dv"):
        xs = [r["files"] for r in rows]
        for key, style in (("pause_s", "-"), ("ready_s", ":")):
            pts = [(r["files"], row[key]) for r in rows for row in r["rows"]]
            line = ax.plot(xs, [statistics.median(row[key] for row in r["rows"]) for r in rows], style,
                           marker=marker, label=f"{label}: {'first answer' if key == 'pause_s' else 'ready'}")
            ax.scatter([x for x, _ in pts], [y for _, y in pts], s=10, alpha=0.4, color=line[0].get_color())
    ax.set_xscale("log")
    ax.set_xlabel("files in the mount")
    ax.set_ylabel("seconds from the daemon's death")
    ax.set_title("kill -9 of a supervised kvfs daemon under 4 stat/read workers")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    # kills a second apart are a crash loop to the supervisor (back-off): not here
    os.environ.setdefault("KVFS_RESTART_STABLE_S", "0.5")
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--counts", default="1000,100000")
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--dir", default="/var/tmp")
    p.add_argument("--json")
    p.add_argument("--plot", help="write a PNG of the pauses against the file count")
    p.add_argument("--compare", nargs="*", default=[], metavar="LABEL=JSON",
                   help="earlier results to plot beside (with --plot; alone: plot only)")
    p.add_argument("--label", default="this run")
    a = p.parse_args(argv)
    earlier = {k: json.loads(Path(v).read_text()) for k, v in (c.split("=", 1) for c in a.compare)}
    if a.plot and earlier and not any(x.startswith("--counts") for x in (argv or sys.argv[1:])):
        plot(a.plot, earlier)
        return 0
    base = Path(tempfile.mkdtemp(prefix="kvfs-restart-", dir=a.dir))
    try:
        out = [one_count(base, int(c), a.kills, a.workers) for c in a.counts.split(",")]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    for r in out:
        print(f"{r['files']:>9} files: pause median {r['pause_s_median']:.3f} s (max {r['pause_s_max']:.3f}), "
              f"new daemon ready {r['ready_s_median']:.3f} s, longest op across a kill {r['stall_s_median']:.3f} s "
              f"median (max {r['stall_s_max']:.3f}); {r['ops']} ops, ENOTCONN {r['enotconn']}, "
              f"errors {r['errors']} (dead daemons' handles answered EIO: {r['stale_handle_eio']}), wrong {r['wrong']}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    if a.plot:
        plot(a.plot, {**earlier, a.label: out})
    return 0


if __name__ == "__main__":
    sys.exit(main())
