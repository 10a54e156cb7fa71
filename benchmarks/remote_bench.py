"""Remote-tier benchmark: the userspace NVMe/TCP initiator vs the raw TCP stream of the same VM.

Boots the real nvmet-tcp target in QEMU (tests/support/nvmet.py), then in one run:

* raw TCP: the best throughput the VM streams to the host (busybox ``nc`` from /dev/zero,
  and ``nc -e dd bs=1M``), measured before and after the initiator runs;
* controller: sequential read/write throughput of the initiator (1 MiB commands, many
  in flight over the I/O queues), and 4 KiB read/write latency at queue depth 1;
* store: the RemoteTier (4 MiB objects through put/read, 8 at a time), and the latency
  of a 4 KiB read of an object;
* mount: a real kvfs mount (small RAM and NVMe tiers, ``--remote``): files written
  through the mount until they are demoted to the remote volume, then read back cold
  (1 and 4 readers), the time to the first 4 KiB of a remote file, and the daemon's CPU;
* CPU: process CPU seconds per GB moved (the bench process for controller/store, the
  daemon for the mount).

Every connect and read has a timeout; the VM and the mount are always torn down (finally,
atexit, SIGTERM/SIGINT/SIGHUP). Run it under ``flock /tmp/kvfs-bench.lock``.

Usage: python benchmarks/remote_bench.py [--mib 128] [--runs 3] [--json out.json] [--no-mount]
"""
from __future__ import annotations

import argparse
import atexit
import concurrent.futures
import json
import logging
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio
import xxhash

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from support.nvmet import Target  # noqa: E402

from kvfs.remote.controller import Controller  # noqa: E402
from kvfs.remote.url import parse_url  # noqa: E402
from kvfs.store.tier import ObjectInfo  # noqa: E402

log = logging.getLogger("remote_bench")

MiB = 1 << 20
CONNECT_TIMEOUT = 10.0       # one TCP connect / first byte
STREAM_DEADLINE = 120.0      # one raw-stream measurement, retries included
PHASE_TIMEOUT = 900.0        # one trio phase (controller, store)


# --- teardown: whatever happens, no VM and no mount stay behind --------------------
_cleanups: list = []


def _run_cleanups() -> None:
    while _cleanups:
        fn = _cleanups.pop()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - keep tearing down
            log.warning("cleanup %s failed: %s", getattr(fn, "__name__", fn), e)


def _on_signal(signum, frame):
    raise SystemExit(128 + signum)   # unwinds through the finally blocks


atexit.register(_run_cleanups)
for _sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(_sig, _on_signal)


# --- raw TCP ------------------------------------------------------------------------
def _stream_once(port: int, nbytes: int) -> float:
    """MB/s of reading nbytes (after 4 MiB of warm-up) from a VM port that streams zeros.
    Raises ConnectionError when the stream ends early (the guest's nc is restarting)."""
    with socket.create_connection(("127.0.0.1", port), timeout=CONNECT_TIMEOUT) as s:
        s.settimeout(CONNECT_TIMEOUT)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        view = memoryview(bytearray(MiB))
        got = 0
        while got < 4 * MiB:
            k = s.recv_into(view)
            if not k:
                raise ConnectionError("stream closed during warm-up")
            got += k
        t0, got = time.perf_counter(), 0
        while got < nbytes:
            k = s.recv_into(view)
            if not k:
                raise ConnectionError(f"stream closed after {got} bytes")
            got += k
        return got / (time.perf_counter() - t0) / 1e6


def raw_stream(port: int, nbytes: int) -> float:
    """One measurement, retried while the guest's listener comes back (bounded)."""
    deadline = time.monotonic() + STREAM_DEADLINE
    while True:
        try:
            return _stream_once(port, nbytes)
        except (OSError, ConnectionError) as e:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no raw stream from port {port} within {STREAM_DEADLINE} s: {e}") from e
            log.info("raw stream on %d: %s; retrying", port, e)
            time.sleep(0.2)   # the guest's nc restarts its listener; nothing to wait on from here


def raw_all(t: Target, nbytes: int, runs: int) -> dict:
    nc = [raw_stream(t.raw_port, min(nbytes, 64 * MiB)) for _ in range(runs)]
    dd = [raw_stream(t.raw_port_dd, nbytes) for _ in range(runs)]
    return {"nc": nc, "dd": dd}


# --- measuring ------------------------------------------------------------------------
class Cpu:
    """Wall and CPU time of a block: this process, or another one by PID (/proc)."""

    def __init__(self, pid: int | None = None):
        self.pid = pid

    def _cpu(self) -> float:
        if self.pid is None:
            return time.process_time()
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def __enter__(self):
        self.t, self.c = time.perf_counter(), self._cpu()
        return self

    def __exit__(self, *a):
        self.wall = time.perf_counter() - self.t
        self.cpu = self._cpu() - self.c


def pct(xs: list[float], p: float) -> float:
    return sorted(xs)[int(p * (len(xs) - 1))]


def lat(xs: list[float]) -> dict:
    return {"p50_us": pct(xs, .5) * 1e6, "p99_us": pct(xs, .99) * 1e6, "n": len(xs)}


# --- controller and store (in this process) ---------------------------------------------
async def controller_bench(url: str, nbytes: int, runs: int) -> dict:
    with trio.fail_after(PHASE_TIMEOUT):
        c = await Controller.connect(parse_url(url))
        try:
            data = bytearray(os.urandom(nbytes))
            buf = bytearray(nbytes)
            w, r, wc, rc = [], [], [], []
            for _ in range(runs):
                with Cpu() as m:
                    await c.write(8192, data)
                    await c.flush()
                w.append(nbytes / m.wall / 1e6)
                wc.append(m.cpu / (nbytes / 1e9))
                with Cpu() as m:
                    await c.read(8192, memoryview(buf))
                r.append(nbytes / m.wall / 1e6)
                rc.append(m.cpu / (nbytes / 1e9))
            assert buf == data
            lat_r, lat_w = [], []
            small = bytearray(4096)
            for i in range(300):
                t = time.perf_counter()
                await c.read(8 * i, memoryview(small))
                lat_r.append(time.perf_counter() - t)
                t = time.perf_counter()
                await c.write(8 * i, small)
                lat_w.append(time.perf_counter() - t)
            return {"read_MBps": statistics.median(r), "write_MBps": statistics.median(w),
                    "read_runs": r, "write_runs": w,
                    "read_cpu_s_per_GB": statistics.median(rc), "write_cpu_s_per_GB": statistics.median(wc),
                    "lat_read_4k": lat(lat_r), "lat_write_4k": lat(lat_w)}
        finally:
            with trio.move_on_after(10):
                await c.shutdown()
            c.close()


async def store_bench(url: str, nbytes: int, runs: int) -> dict:
    from kvfs.remote import make_volume
    from kvfs.remote.tier import RemoteTier
    with trio.fail_after(PHASE_TIMEOUT):
        tier = RemoteTier(make_volume(url, instance_id="bench"), instance_id="bench", size="100%", format=True)
        await tier.open()
        try:
            size = 4 * MiB
            n = max(1, nbytes // size)
            blobs = [os.urandom(size) for _ in range(4)]
            w, r, rc, wc = [], [], [], []
            limit = trio.CapacityLimiter(8)
            lat_r: list[float] = []
            for run in range(runs):
                locs = []

                async def put(i):
                    async with limit:
                        b = blobs[i % 4]
                        info = ObjectInfo(run * 10000 + i, size, xxhash.xxh3_64_intdigest(b), MiB, (0,) * 4)
                        locs.append((info.oid, await tier.put(info, memoryview(b))))

                async def get(oid, loc):
                    async with limit:
                        await tier.read(oid, loc, 0, size)

                with Cpu() as m:
                    async with trio.open_nursery() as nursery:
                        for i in range(n):
                            nursery.start_soon(put, i)
                w.append(n * size / m.wall / 1e6)
                wc.append(m.cpu / (n * size / 1e9))
                with Cpu() as m:
                    async with trio.open_nursery() as nursery:
                        for oid, loc in locs:
                            nursery.start_soon(get, oid, loc)
                r.append(n * size / m.wall / 1e6)
                rc.append(m.cpu / (n * size / 1e9))
                rnd = random.Random(run)
                for _ in range(100):
                    oid, loc = rnd.choice(locs)
                    t = time.perf_counter()
                    await tier.read(oid, loc, rnd.randrange(size // 4096) * 4096, 4096)
                    lat_r.append(time.perf_counter() - t)
                for oid, loc in locs:
                    await tier.delete(oid, loc)
            return {"objects": n, "object_size": size, "in_flight": 8, "read_MBps": statistics.median(r),
                    "write_MBps": statistics.median(w), "read_runs": r, "write_runs": w,
                    "read_cpu_s_per_GB": statistics.median(rc), "write_cpu_s_per_GB": statistics.median(wc),
                    "lat_read_4k": lat(lat_r)}
        finally:
            await tier.close()


# --- through a real mount ---------------------------------------------------------------
def kvfs(*args, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "kvfs.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)


def wait_for(pred, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def read_cold(path: Path, bufsize: int = MiB) -> int:
    """Read a whole file with the kernel's cached pages of it dropped first (one open)."""
    with open(path, "rb", buffering=0) as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        n = 0
        buf = bytearray(bufsize)
        while True:
            k = f.readinto(buf)
            if not k:
                return n
            n += k


def mount_bench(url: str, workdir: Path, nbytes: int, runs: int) -> dict:
    mnt, nvme, state = workdir / "mnt", workdir / "nvme", workdir / "state"
    for d in (mnt, nvme, state):
        d.mkdir(parents=True)
    # promotion off: every run reads the remote copies (promotion is measured elsewhere)
    conf = workdir / "kvfs.toml"
    conf.write_text("[kvfs]\npromote_hits = 1000000\n")
    res = kvfs("mount", mnt, "--config", conf, "--ram", "16MiB", "--nvme", nvme, "--nvme-size", "32MiB",
               "--state", state, "--remote", url, "--format-remote", timeout=120)
    if res.returncode != 0:
        raise RuntimeError(f"kvfs mount failed: {res.stderr.strip()}")
    stats_path = mnt / ".kvfs" / "stats"
    stats = lambda: json.loads(stats_path.read_bytes())
    pid = int(stats()["pid"])

    def teardown():
        if os.path.ismount(mnt):
            r = kvfs("umount", mnt, timeout=300)
            if r.returncode != 0:
                subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True, timeout=60)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _cleanups.append(teardown)
    try:
        size = 4 * MiB
        n = max(24, nbytes // size)       # 96 MiB at least: more than RAM + NVMe hold
        rnd = random.Random(1)
        blobs = [rnd.randbytes(size) for _ in range(4)]
        files = [mnt / f"m{i // 16:02d}" / f"blk{i:05d}.bin" for i in range(n)]
        st0 = stats()["tiers"]["remote"]
        # writes: through the mount into RAM, demoted down to the remote volume in the background
        with Cpu(pid) as m:
            for i, p in enumerate(files):
                p.parent.mkdir(exist_ok=True)
                tmp = p.with_name(p.name + ".tmp")
                with open(tmp, "wb") as f:
                    f.write(blobs[i % 4])
                os.replace(tmp, p)
            wait_for(lambda: stats()["settled"], 600, "demotion to the remote volume")
        st1 = stats()["tiers"]["remote"]
        moved = st1["bytes_written"] - st0["bytes_written"]
        write = {"files": n, "MBps_to_remote": moved / m.wall / 1e6, "bytes_to_remote": moved,
                 "daemon_cpu_s_per_GB": m.cpu / (n * size / 1e9)}
        remote = [p for p in files if os.getxattr(p, "user.kvfs.tier") == b"remote"]
        if len(remote) < 4:
            raise RuntimeError(f"only {len(remote)} files reached the remote tier")
        # time to the first 4 KiB of a remote file (open, one read, close): one chunk fetch
        first = []
        for p in remote[: min(24, len(remote))]:
            t = time.perf_counter()
            with open(p, "rb", buffering=0) as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                f.read(4096)
            first.append(time.perf_counter() - t)
        out = {"write": write, "remote_files": len(remote), "lat_first_4k": lat(first)}
        # cold reads of the remote files: page cache dropped, the store's chunk cache cycled
        # (it holds 48 MiB; every run reads more than that, in the same order)
        for readers in (1, 4):
            r, rc = [], []
            for run in range(runs):
                todo = remote
                with Cpu(pid) as m:
                    with concurrent.futures.ThreadPoolExecutor(readers) as ex:
                        got = sum(ex.map(read_cold, todo))
                r.append(got / m.wall / 1e6)
                rc.append(m.cpu / (got / 1e9))
            out[f"read_{readers}"] = {"MBps": statistics.median(r), "runs": r,
                                      "daemon_cpu_s_per_GB": statistics.median(rc), "files": len(todo)}
        out["remote_stats"] = {k: v for k, v in stats()["tiers"]["remote"].items()
                               if k in ("state", "errors", "reconnects", "promotions", "bytes_read",
                                        "bytes_written", "commands")}
        return out
    finally:
        _cleanups.remove(teardown)
        teardown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=128, help="MiB per throughput run")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cpus", type=int, default=1, help="vCPUs of the target VM")
    ap.add_argument("--query", default="", help="extra URL query, e.g. '?queues=4&digest=header,data'")
    ap.add_argument("--no-mount", action="store_true", help="skip the mount measurements")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    nbytes = args.mib * MiB
    with tempfile.TemporaryDirectory() as d:
        t = Target(Path(d) / "ns.img", size=max(2 * nbytes, 1 << 30), cpus=args.cpus)
        _cleanups.append(t.kill)
        try:
            t.start()
            log.info("target up in %.1f s; raw streams", t.boot_seconds)
            raw0 = raw_all(t, nbytes, args.runs)
            url = t.url + args.query
            log.info("controller")
            ctrl = trio.run(controller_bench, url, nbytes, args.runs)
            log.info("store")
            store = trio.run(store_bench, url, nbytes, args.runs)
            mnt = None
            if not args.no_mount:
                log.info("mount")
                mnt = mount_bench(url, Path(d) / "m", nbytes, args.runs)
            log.info("raw streams again")
            raw1 = raw_all(t, nbytes, args.runs)
        finally:
            _cleanups.remove(t.kill)
            t.kill()
    raw_nc = statistics.median(raw0["nc"] + raw1["nc"])
    raw_dd = statistics.median(raw0["dd"] + raw1["dd"])
    raw = max(raw_nc, raw_dd)
    res = {"raw_tcp_nc_MBps": raw_nc, "raw_tcp_dd_MBps": raw_dd, "raw_tcp_best_MBps": raw,
           "raw_runs": {"before": raw0, "after": raw1},
           "controller": ctrl, "store": store, "mount": mnt, "query": args.query, "vm_cpus": args.cpus,
           "mib": args.mib, "runs": args.runs, "boot_s": t.boot_seconds,
           "ratio": {"controller_read": ctrl["read_MBps"] / raw, "controller_write": ctrl["write_MBps"] / raw,
                     "store_read": store["read_MBps"] / raw, "store_write": store["write_MBps"] / raw}}
    if mnt:
        res["ratio"]["mount_read_1"] = mnt["read_1"]["MBps"] / raw
        res["ratio"]["mount_read_4"] = mnt["read_4"]["MBps"] / raw
        res["ratio"]["mount_write_to_remote"] = mnt["write"]["MBps_to_remote"] / raw
    print(json.dumps(res, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
