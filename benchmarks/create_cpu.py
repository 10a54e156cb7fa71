"""Daemon CPU and requests per runtime file: kvfs against the floor fs, in one run.

    python benchmarks/create_cpu.py [--files 400] [--rounds 5] [--size 32768] [--threads 1]
                                    [--vllm] [--base TREE] [--no-flush-floor] [--kvfs-loop-floor]
                                    [--dir DIR]

Mounts kvfs (through the CLI, as benchmarks/runtime_patterns.py does) and
benchmarks/floorfs.py with kvfs's kernel-facing settings, then runs, interleaved and
repeated, ``open(O_CREAT|O_TRUNC) + one write + close + rename`` of a temp file over a
fresh name (``--vllm``: vLLM's store, O_CREAT|O_EXCL|O_DIRECT when the probe passes).
For each target and round: files per second, the daemon's CPU per file (the run time of
its threads from /proc/PID/task/*/schedstat, in ns: utime + stime count whole 10 ms ticks)
and its read and write system calls per file (/proc/PID/io syscr and
syscw: one read of /dev/fuse per request, one write per reply, plus what the handlers do).
Prints medians (min-max) and kvfs's ratios to the floor; ``--base TREE`` mounts a second kvfs
from another checkout (the code before a change) beside them, in the same rotation, and
``--no-flush-floor`` a floor that answers FLUSH with ENOSYS (the kernel then sends none), and
``--kvfs-loop-floor`` the floor served by kvfs's request loop (kvfs.fs.loop) instead of
``pyfuse3.main`` (what that loop gives any Python daemon).
"""
from __future__ import annotations

import argparse
import os
import secrets
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from kvfs.bench import BenchMount, aligned_buffer  # noqa: E402
from runtime_patterns import O_DIRECT, FloorMount, _odirect_probe, _threads, kvfs_settings  # noqa: E402



def _usage(pid: int) -> tuple[float, int, int]:
    cpu = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):    # run time in ns (utime+stime count 10 ms ticks)
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                cpu += int(f.read().split()[0]) / 1e9
        except FileNotFoundError:               # a thread that ended meanwhile
            pass
    io = {}
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            k, v = line.split(":")
            io[k] = int(v)
    return cpu, io["syscr"], io["syscw"]


def _cycle(d: str, n: int, threads: int, mv, vllm: bool) -> float:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    if vllm:
        flags |= os.O_EXCL | (O_DIRECT if _odirect_probe(d) else 0)

    def one(i):
        tmp = os.path.join(d, f"{i}.bin_{secrets.token_hex(4)}.tmp" if vllm else f".{i}.tmp")
        fd = os.open(tmp, flags, 0o644)
        try:
            os.write(fd, mv)
        finally:
            os.close(fd)
        os.rename(tmp, os.path.join(d, f"{i}.bin"))
    t0 = time.perf_counter()
    _threads(threads, list(range(n)), one)
    return time.perf_counter() - t0


def _mount_from(b: BenchMount, tree: str | Path) -> None:
    """Mount ``b`` running kvfs from the source tree ``tree`` (``python -m kvfs.cli`` puts its
    working directory first on the path, and the CLI hands its own package root to the
    daemon: both must be the tree's)."""
    env, cwd = os.environ.get("PYTHONPATH"), os.getcwd()
    tree = str(Path(tree).resolve())
    os.environ["PYTHONPATH"] = tree
    os.chdir(tree)
    try:
        b.mount()
    finally:
        os.chdir(cwd)
        if env is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = env
    with open(f"/proc/{b.pid}/environ", "rb") as f:
        seen = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    if not seen.get(b"PYTHONPATH", b"").decode().startswith(tree):
        raise SystemExit(f"the daemon of {b.path} does not run {tree}: {seen.get(b'PYTHONPATH')!r}")


def measure(a, targets: tuple[str, ...]) -> dict[str, dict[str, list[float]]]:
    """Per target: rate, daemon CPU per file and read/write system calls per file, per round."""
    root = Path(a.dir).resolve()
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    m = BenchMount(root / "kvfs", ram=4 << 30, nvme_size=16 << 30)
    floor = FloorMount(root / "floor", kvfs_settings())
    mv = memoryview(aligned_buffer(a.size))
    res: dict[str, dict[str, list[float]]] = {t: {"rate": [], "cpu_us": [], "syscr": [], "syscw": []}
                                               for t in targets}
    b = BenchMount(root / "base", ram=4 << 30, nvme_size=16 << 30) if a.base else None
    nf = FloorMount(root / "floor_nf", dict(kvfs_settings(), no_flush=True)) if a.no_flush_floor else None
    kl = FloorMount(root / "floor_kl", dict(kvfs_settings(), kvfs_loop=True)) if a.kvfs_loop_floor else None
    try:
        _mount_from(m, a.tree)
        floor.mount()
        pids = {"kvfs": m.pid, "floor": floor.proc.pid}
        dirs = {"kvfs": m.path, "floor": floor.path}
        if b is not None:
            _mount_from(b, a.base)
            pids["base"], dirs["base"] = b.pid, b.path
        if nf is not None:
            nf.mount()
            pids["floor_nf"], dirs["floor_nf"] = nf.proc.pid, nf.path
        if kl is not None:
            kl.mount()
            pids["floor_kl"], dirs["floor_kl"] = kl.proc.pid, kl.path
        for rnd in range(a.rounds + 1):                 # round 0 warms up
            for t in targets[rnd % len(targets):] + targets[:rnd % len(targets)]:
                d = os.path.join(dirs[t], f"r{rnd}")
                os.mkdir(d)
                u0 = _usage(pids[t])
                dt = _cycle(d, a.files, a.threads, mv, a.vllm)
                u1 = _usage(pids[t])
                if rnd:
                    r = res[t]
                    r["rate"].append(a.files / dt)
                    r["cpu_us"].append((u1[0] - u0[0]) / a.files * 1e6)
                    r["syscr"].append((u1[1] - u0[1]) / a.files)
                    r["syscw"].append((u1[2] - u0[2]) / a.files)
                shutil.rmtree(d)
    finally:
        floor.cleanup()
        for f in (nf, kl):
            if f is not None:
                f.cleanup()
        for x in (m, b):
            if x is None:
                continue
            try:
                if x.pid is not None:
                    x.umount()
            finally:
                x.cleanup()
        shutil.rmtree(root, ignore_errors=True)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--files", type=int, default=400)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--size", type=int, default=32 << 10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--vllm", action="store_true")
    p.add_argument("--dir", default="/tmp/kvfs-create-cpu")
    p.add_argument("--tree", default=str(REPO), help="the source tree the 'kvfs' mount runs (default: this one)")
    p.add_argument("--base", default=None, metavar="TREE",
                   help="also mount kvfs from this source tree (a baseline checkout) as 'base'")
    p.add_argument("--no-flush-floor", action="store_true",
                   help="also mount the floor with FLUSH answered ENOSYS as 'floor_nf' (what a close's round trip costs)")
    p.add_argument("--kvfs-loop-floor", action="store_true",
                   help="also mount the floor served by kvfs's request loop (kvfs.fs.loop) as 'floor_kl'")
    a = p.parse_args(argv)
    targets = ("kvfs", "floor") + (("base",) if a.base else ()) + (("floor_nf",) if a.no_flush_floor else ()) \
        + (("floor_kl",) if a.kvfs_loop_floor else ())
    res = measure(a, targets)
    print(f"load {os.getloadavg()[0]:.1f}; {a.files} files x {a.rounds} rounds, {a.size} B, "
          f"{a.threads} threads{', vLLM pattern' if a.vllm else ''}")
    for k in ("rate", "cpu_us", "syscr", "syscw"):
        row = []
        for t in targets:
            v = res[t][k]
            row.append(f"{t} {statistics.median(v):7.1f} ({min(v):.1f}-{max(v):.1f})")
        for t in [t for t in targets if t != "floor"]:
            ratios = [x / y for x, y in zip(res[t][k], res["floor"][k]) if y]
            rs = f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else "-"
            row.append(f"{t}/floor {rs}")
        print(f"{k:7s} " + "  ".join(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
