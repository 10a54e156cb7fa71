"""Remote-tier benchmark: the userspace NVMe/TCP initiator vs the raw TCP stream of the same VM.

Boots the real nvmet-tcp target in QEMU (tests/target/nvmet_target.py), then in one run:

* raw TCP: the best throughput the VM streams to the host (busybox ``nc`` from /dev/zero,
  and ``nc -e dd bs=1M``), median of runs;
* initiator: sequential read/write throughput of the controller (1 MiB commands, many in
  flight over the I/O queues) and of the RemoteTier (4 MiB objects through put/read);
* latency: per-command 4 KiB read/write at queue depth 1 (median, p99);
* CPU: process CPU seconds spent per GB moved by the initiator.

Usage: python benchmarks/remote_bench.py [--mib 256] [--runs 3] [--json out.json] [--mount]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio
import xxhash

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "target"))

from nvmet_target import Target  # noqa: E402

from kvfs.remote.controller import Controller  # noqa: E402
from kvfs.remote.url import parse_url  # noqa: E402
from kvfs.store.tier import ObjectInfo  # noqa: E402


def raw_stream(port: int, nbytes: int) -> float:
    """MB/s of reading nbytes from a VM port that streams zeros."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        buf = bytearray(1 << 20)
        view = memoryview(buf)
        got = 0
        while got < 4 << 20:                   # warm-up: connection setup, first segments
            got += s.recv_into(view)
        t0, got = time.perf_counter(), 0
        while got < nbytes:
            k = s.recv_into(view)
            if not k:
                break
            got += k
        return got / (time.perf_counter() - t0) / 1e6


class Cpu:
    def __enter__(self):
        self.t, self.c = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *a):
        self.wall = time.perf_counter() - self.t
        self.cpu = time.process_time() - self.c


async def controller_bench(url: str, nbytes: int, runs: int) -> dict:
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
        q = lambda xs, p: sorted(xs)[int(p * (len(xs) - 1))] * 1e6
        return {"read_MBps": statistics.median(r), "write_MBps": statistics.median(w),
                "read_cpu_s_per_GB": statistics.median(rc), "write_cpu_s_per_GB": statistics.median(wc),
                "lat_read_4k_us_p50": q(lat_r, .5), "lat_read_4k_us_p99": q(lat_r, .99),
                "lat_write_4k_us_p50": q(lat_w, .5), "lat_write_4k_us_p99": q(lat_w, .99)}
    finally:
        await c.shutdown()


async def tier_bench(url: str, nbytes: int, runs: int) -> dict:
    from kvfs.remote import make_volume
    from kvfs.remote.tier import RemoteTier
    tier = RemoteTier(make_volume(url, instance_id="bench"), instance_id="bench", size="100%", format=True)
    await tier.open()
    try:
        size = 4 << 20
        n = max(1, nbytes // size)
        blobs = [os.urandom(size) for _ in range(4)]
        infos = []
        w, r, rc, wc = [], [], [], []
        for run in range(runs):
            locs = []
            with Cpu() as m:
                async with trio.open_nursery() as nursery:
                    async def put(i):
                        b = blobs[i % 4]
                        info = ObjectInfo(run * 10000 + i, size, xxhash.xxh3_64_intdigest(b), 1 << 20, (0,) * 4)
                        locs.append((info.oid, await tier.put(info, memoryview(b))))
                    for i in range(n):
                        nursery.start_soon(put, i)
            w.append(n * size / m.wall / 1e6)
            wc.append(m.cpu / (n * size / 1e9))
            with Cpu() as m:
                async with trio.open_nursery() as nursery:
                    async def get(oid, loc):
                        await tier.read(oid, loc, 0, size)
                    for oid, loc in locs:
                        nursery.start_soon(get, oid, loc)
            r.append(n * size / m.wall / 1e6)
            rc.append(m.cpu / (n * size / 1e9))
            for oid, loc in locs:
                await tier.delete(oid, loc)
            infos.append(len(locs))
        return {"objects": n, "object_size": size, "read_MBps": statistics.median(r),
                "write_MBps": statistics.median(w), "read_cpu_s_per_GB": statistics.median(rc),
                "write_cpu_s_per_GB": statistics.median(wc)}
    finally:
        await tier.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="MiB per throughput run")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cpus", type=int, default=1, help="vCPUs of the target VM")
    ap.add_argument("--query", default="", help="extra URL query, e.g. '?queues=4&digest=header,data'")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    nbytes = args.mib << 20
    with tempfile.TemporaryDirectory() as d:
        t = Target(Path(d) / "ns.img", size=max(2 * nbytes, 1 << 30), cpus=args.cpus)
        t.start()
        try:
            raw_nc = statistics.median(raw_stream(t.raw_port, min(nbytes, 64 << 20)) for _ in range(args.runs))
            raw_dd = statistics.median(raw_stream(t.raw_port_dd, nbytes) for _ in range(args.runs))
            url = t.url + args.query
            ctrl = trio.run(controller_bench, url, nbytes, args.runs)
            tier = trio.run(tier_bench, url, nbytes, args.runs)
        finally:
            t.kill()
    raw = max(raw_nc, raw_dd)
    res = {"raw_tcp_nc_MBps": raw_nc, "raw_tcp_dd_MBps": raw_dd, "raw_tcp_best_MBps": raw,
           "controller": ctrl, "tier": tier, "query": args.query, "vm_cpus": args.cpus, "mib": args.mib,
           "runs": args.runs, "boot_s": t.boot_seconds,
           "ratio_controller_read": ctrl["read_MBps"] / raw, "ratio_tier_read": tier["read_MBps"] / raw,
           "ratio_controller_write": ctrl["write_MBps"] / raw, "ratio_tier_write": tier["write_MBps"] / raw}
    print(json.dumps(res, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
