"""A namespace owner's fast path (lease + read of its blocks' backing files) and root's, on two
checkouts of kvfs in one run: the grants layout changed in issue 40 (a ``<grants>/<uid>/`` the
daemon owns, searchable by the owner through an ACL, instead of one the owner owned).

    python benchmarks/tenant_grants.py --before /tmp/kvfs-before [--after /tmp/kvfs-after] [--blocks 256] [--runs 5]

``--before DIR``: a tree holding the other checkout's ``kvfs`` package (``git archive REV kvfs |
tar -x -C DIR``); ``--after DIR`` likewise (default: this checkout; extract both the same way:
the same code ran 10-40 % slower from this checkout's directory than from an extract in /tmp). Needs root and a local user ``kvfs-tenant`` (the
tests' ``tenant``). Rows, medians of ``--runs``, µs per block (batches of 32 paths a lease):

* ``owner: first lease``  -- the owner's lease of blocks never granted (a link made per block)
* ``owner: lease again``  -- the same leases again (links exist)
* ``owner: read``         -- open + pread + close of each backing file the lease named
* ``root: lease``, ``root: read`` -- root's (the adapters' and loader's path: no grant)
"""
from __future__ import annotations

import argparse
import json
import os
import pwd
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# as a user: lease the paths in batches of 32 twice, then read every backing file named
CLIENT = r"""
import json, os, sys, time
m, names = sys.argv[1], json.loads(sys.argv[2])
fd = os.open(m + "/.kvfs/lease", os.O_RDWR)
def lease_all():
    blocks = []
    t0 = time.perf_counter()
    for i in range(0, len(names), 32):
        os.pwrite(fd, "".join(n + "\n" for n in names[i:i + 32]).encode(), 0)
        blocks += json.loads(os.pread(fd, 1 << 22, 0))["blocks"]
    return time.perf_counter() - t0, blocks
first, blocks = lease_all()
again, blocks = lease_all()
assert all(blocks), blocks
buf = bytearray(blocks[0][3])
t0 = time.perf_counter()
for b in blocks:
    f = os.open(b[1], os.O_RDONLY)
    os.preadv(f, [buf], b[2])
    os.close(f)
read = time.perf_counter() - t0
print(json.dumps({"first": first, "again": again, "read": read}))
"""


def run(cmd, **kw):
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw)


def one(pkg: Path, blocks: int, size: int, user) -> dict:
    env = {**os.environ, "PYTHONPATH": str(pkg)}
    root = Path(tempfile.mkdtemp(prefix="kvfs-grants-bench-"))
    os.chmod(root, 0o755)
    m = root / "mnt"
    m.mkdir()
    kvfs = [sys.executable, "-m", "kvfs.cli"]
    run([*kvfs, "mount", m, "--ram", f"{blocks * size * 2 + (64 << 20)}", "--nvme", root / "nvme",
         "--nvme-size", "1GiB", "--state", root / "state", "--allow-other"], env=env)
    try:
        ns = m / "team"
        ns.mkdir(mode=0o700)
        os.chown(ns, user.pw_uid, user.pw_gid)
        names = []
        for i in range(blocks):
            p = ns / f"b{i:05d}"
            p.write_bytes(os.urandom(size))
            os.chown(p, user.pw_uid, user.pw_gid)
            names.append(f"team/b{i:05d}")
        owner = subprocess.run(["/usr/bin/python3", "-c", CLIENT, str(m), json.dumps(names)], user=user.pw_uid,
                               group=user.pw_gid, extra_groups=[], capture_output=True, text=True, cwd="/")
        assert owner.returncode == 0, owner.stderr
        mine = run([sys.executable, "-c", CLIENT, str(m), json.dumps(names)])
        o, r = json.loads(owner.stdout), json.loads(mine.stdout)
        return {"owner: first lease": o["first"], "owner: lease again": o["again"], "owner: read": o["read"],
                "root: lease": r["again"], "root: read": r["read"]}
    finally:
        run([*kvfs, "umount", m], env=env)
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", type=Path, required=True)
    ap.add_argument("--after", type=Path, default=REPO)
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--size", type=int, default=256 << 10)
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    user = pwd.getpwnam("kvfs-tenant")
    rows: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
    order = [("before", a.before), ("after", a.after)]
    for i in range(a.runs):                 # interleaved, alternating which goes first
        for label, pkg in order if i % 2 == 0 else order[::-1]:
            for k, v in one(pkg, a.blocks, a.size, user).items():
                rows[label].setdefault(k, []).append(v / a.blocks * 1e6)
    print(f"{a.blocks} blocks of {a.size >> 10} KiB, medians of {a.runs} runs, µs per block")
    print("| row | before | after |\n|---|---:|---:|")
    for k in rows["after"]:
        print(f"| {k} | {statistics.median(rows['before'][k]):.1f} | {statistics.median(rows['after'][k]):.1f} |")


if __name__ == "__main__":
    main()
