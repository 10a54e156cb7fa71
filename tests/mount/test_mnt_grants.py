"""Issue 34, defect 2, as a real tenant on an ``--allow-other`` mount: what a namespace's owner
does with the backing files its leases name (chmod the grants directories, rename or hard-link
the daemon's link, keep a descriptor open) keeps no space in the RAM tier's tmpfs once the
object is gone, and the other namespaces' writes still land in RAM."""
from __future__ import annotations

import errno
import json
import os
import subprocess

import pytest

from support.files import MiB, content, read
from support.mount import run_kvfs, wait_for
from support.users import reachable

pytestmark = pytest.mark.mount

ROUNDS = 24

# as the tenant: ROUNDS times {write a 1 MiB file; lease it; keep a descriptor of the backing
# file; chmod the grants directories; rename and hard-link the lease's link; release; unlink}.
# Then report, wait for a line on stdin (root measures meanwhile), report what the kept
# descriptors still hold.
ATTACK = r"""
import json, os, random, sys
m, ns, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
me = os.getuid()
out = {"chmod": [], "rename": [], "link": [], "chmod_links": [], "leased": 0}
kept = []
def errno_of(fn, *a):
    try:
        fn(*a)
        return 0
    except OSError as e:
        return e.errno
for i in range(rounds):
    name = f"f{i}"
    with open(os.path.join(m, ns, name), "wb") as f:
        f.write(random.Random(i).randbytes(1 << 20))
    lfd = os.open(m + "/.kvfs/lease", os.O_RDWR)
    os.pwrite(lfd, f"{ns}/{name}\n".encode(), 0)
    ans = json.loads(os.pread(lfd, 1 << 20, 0))
    block = ans["blocks"][0] if ans["blocks"] else None
    if block:
        out["leased"] += 1
        p = block[1]
        kept.append(os.open(p, os.O_RDONLY))
        own = os.path.dirname(p)                 # <grants>/<uid>/: the daemon's, searchable by me
        out["chmod"].append(errno_of(os.chmod, own, 0o700))
        out["chmod_links"].append(errno_of(os.chmod, os.path.dirname(own), 0o777))
        out["link"].append(errno_of(os.link, p, os.path.join(own, f"hl{i}")))
        out["rename"].append(errno_of(os.rename, p, os.path.join(own, f"mine{i}")))
    os.close(lfd)
    os.unlink(os.path.join(m, ns, name))
print(json.dumps(out), flush=True)
sys.stdin.readline()
print(json.dumps({"kept_blocks": sum(os.fstat(fd).st_blocks for fd in kept)}), flush=True)
"""


def fs_used(path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def test_a_tenant_cannot_keep_ram_tier_space_through_its_grants(kvfs_mount, tenant):
    m = kvfs_mount(ram="32MiB", nvme_size="128MiB", allow_other=True)
    ns = m.path / "team"
    ns.mkdir(mode=0o700)
    os.chown(ns, tenant.uid, tenant.gid)
    assert run_kvfs("quota", "set", m.path, "team", "4MiB").returncode == 0
    ram_dir = m.stats()["ram_dir"]
    base = fs_used(ram_dir)
    with reachable(m.path):
        p = subprocess.Popen([tenant.python, "-c", ATTACK, str(m.path), "team", str(ROUNDS)],
                             user=tenant.uid, group=tenant.gid, extra_groups=[], cwd="/", text=True,
                             env={"PATH": "/usr/bin:/bin", "HOME": str(tenant.home)},
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            line = p.stdout.readline()
            assert line, p.stderr.read()
            got = json.loads(line)
            wait_for(lambda: m.stats()["settled"] and m.stats()["tiers"]["ram"]["used"] == 0, 60,
                     "the tenant's objects to be freed")
            leaked = fs_used(ram_dir) - base
            p.stdin.write("\n")
            p.stdin.flush()
            kept = json.loads(p.stdout.readline())
        finally:
            p.kill()
            p.wait()
    # nothing the tenant kept holds space: neither the names nor the open descriptors
    assert got["leased"] == ROUNDS, got
    assert leaked < 4 * MiB, f"{leaked / MiB:.1f} MiB of the RAM tier's tmpfs kept by the tenant"
    assert kept["kept_blocks"] == 0
    # every round had its grant; none of the links could be moved, re-linked or opened up
    assert got["rename"] == [errno.EACCES] * ROUNDS, got
    assert all(e in (errno.EACCES, errno.EPERM) for e in got["link"]), got
    assert got["chmod"] == got["chmod_links"] == [errno.EPERM] * ROUNDS, got
    # the other namespaces' writes still land in RAM, whole
    other = m.path / "other"
    other.mkdir()
    for i in range(10):
        data = content(f"o{i}", 2_000_000)
        (other / f"o{i}").write_bytes(data)
        assert read(other / f"o{i}") == data
        assert os.getxattr(other / f"o{i}", "user.kvfs.tier") == b"ram"
