"""kvfs's own cost of one runtime file, handler by handler, without the kernel.

    python benchmarks/create_cycle.py [--files 1500] [--rounds 3] [--size 32768]

Calls the pyfuse3 handlers (kvfs.fs.ops.KvfsOperations) in process, in the order the kernel
sends them for ``open(O_CREAT|O_TRUNC) + write + close + rename`` of a temp file over a fresh
name: LOOKUP (miss), CREATE, GETXATTR ``security.capability`` (the kernel asks before every
write), WRITE, FLUSH (the seal), RELEASE, LOOKUP of the target (miss), RENAME. Real tiers
(tmpfs, a directory), real LMDB. Prints the median microseconds of each handler over the
rounds after the first, the process's CPU time per file over those rounds (a mean: what the
daemon pays, tails and garbage collection included), and the index commits' share per file (group commits run inline
here every GROUP_OPS operations; in the daemon the committer task runs them). The name
table (kvfs.store.names) is attached as in the daemon unless ``--no-names``. What the
kernel round trips cost on top (~35-50 us each here) is what benchmarks/floorfs.py measures.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import pyfuse3
import trio

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from kvfs.build import build_kvstore, build_ops  # noqa: E402
from kvfs.config import Config  # noqa: E402
from kvfs.store.index import ROOT_INO, Index  # noqa: E402
from kvfs.store.names import NameTable  # noqa: E402
from kvfs.store.nvme import NvmeTier  # noqa: E402
from kvfs.store.ram import RamTier  # noqa: E402

CTX = types.SimpleNamespace(uid=os.getuid(), gid=os.getgid(), pid=os.getpid(), umask=0o022)
STEPS = ("lookup_tmp", "create", "getxattr", "write", "flush", "release", "lookup_target", "rename")


async def _cycle(ops, d: int, i: int, payload: bytes, out: dict) -> None:
    pc = time.perf_counter
    tmp, fin = b".%d.tmp" % i, b"%d.bin" % i
    data = bytes(bytearray(payload))            # a fresh buffer per write, as pyfuse3 gives
    t = [pc()]
    await ops.lookup(d, tmp, CTX)
    t.append(pc())
    fi, attr = await ops.create(d, tmp, 0o644, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, CTX)
    t.append(pc())
    try:
        await ops.getxattr(attr.st_ino, b"security.capability", CTX)
    except pyfuse3.FUSEError:
        pass
    t.append(pc())
    await ops.write(fi.fh, 0, data)
    t.append(pc())
    await ops.flush(fi.fh)
    t.append(pc())
    await ops.release(fi.fh)
    t.append(pc())
    await ops.lookup(d, fin, CTX)
    t.append(pc())
    await ops.rename(d, tmp, d, fin, 0, CTX)
    t.append(pc())
    for k, a, b in zip(STEPS, t, t[1:]):
        out[k].append(b - a)


async def measure(files: int, rounds: int, size: int, names: bool = True) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvfs-create-cycle-") as td:
        index = Index(Path(td) / "state")
        if names:                   # as the daemon does (not on a shared volume)
            index.names = NameTable(td)
            index.names.open([])
        tiers = [RamTier(2 << 30, "/dev/shm", index.instance_id), NvmeTier(4 << 30, Path(td) / "nvme")]
        for t in tiers:
            await t.open()
        kvstore = build_kvstore(Config(), index, tiers)
        store = kvstore.store
        await kvstore.start()
        commit_s = [0.0]
        commit = index.commit

        def timed_commit() -> None:
            t0 = time.perf_counter()
            commit()
            commit_s[0] += time.perf_counter() - t0
        index.commit = timed_commit
        try:
            ops = build_ops(kvstore, lambda: {})
            out = {k: [] for k in STEPS}
            payload = os.urandom(size)
            cpu0 = time.process_time()
            for r in range(rounds):
                if r == 1:                       # the first round warms up
                    out = {k: [] for k in STEPS}
                    commit_s[0] = 0.0
                    cpu0 = time.process_time()
                d = (await ops.mkdir(ROOT_INO, b"r%d" % r, 0o755, CTX)).st_ino
                for i in range(files):
                    await _cycle(ops, d, i, payload, out)
            n = files * max(1, rounds - 1)
            res = {k: statistics.median(v) * 1e6 for k, v in out.items()}
            res["index commits (mean per file)"] = commit_s[0] / n * 1e6
            index.commit()
            res["cpu"] = (time.process_time() - cpu0) / n * 1e6
            return res
        finally:
            store.flush_stats()
            for t in tiers:
                await t.close()
            if index.names is not None:
                index.names.close()
                index.names = None
            index.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--files", type=int, default=1500)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--size", type=int, default=32 << 10)
    p.add_argument("--no-names", action="store_true", help="without the name table (a shared volume's daemon)")
    a = p.parse_args(argv)
    res = trio.run(measure, a.files, a.rounds, a.size, not a.no_names)
    cpu = res.pop("cpu")
    total = 0.0
    for k, v in res.items():
        total += v
        print(f"{k:32s} {v:7.1f} us")
    print(f"{'sum':32s} {total:7.1f} us per file")
    print(f"{'process CPU per file (mean)':32s} {cpu:7.1f} us (tails, GC and commits included)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
