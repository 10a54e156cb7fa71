"""Backing files of a namespace with an owner, with real users: the owner's leases and
``user.kvfs.backing`` give it paths it can open (RAM and NVMe copies); another user gets no
path and cannot open the owner's nor the daemon's; the grants go when the owner changes."""
from __future__ import annotations

import errno
import json
import os
import stat

import pytest

from kvfs.store.ownerlinks import search_acl
from support.files import MiB, content, read
from support.mount import wait_for
from support.users import reachable

pytestmark = pytest.mark.mount

# as a user: write files (optional), lease paths, read what the lease hands out, try paths
AS_USER = r"""
import json, os, sys
m, req = sys.argv[1], json.loads(sys.argv[2])
out = {}
for name, seed, size in req.get("write", []):
    import random
    with open(os.path.join(m, name), "wb") as f:
        f.write(random.Random(seed).randbytes(size))
fd = os.open(m + "/.kvfs/lease", os.O_RDWR)
os.pwrite(fd, "".join(p + "\n" for p in req.get("lease", [])).encode(), 0)
ans = json.loads(os.pread(fd, 1 << 20, 0))
out["prefix"], out["blocks"] = ans["prefix"], ans["blocks"]
def attempt(path):
    try:
        with open(path, "rb") as f:
            return f.read().hex()
    except OSError as e:
        return e.errno
out["leased"] = [attempt(b[1]) if b else None for b in ans["blocks"]]
out["tried"] = [attempt(p) for p in req.get("try", [])]
out["xattr"] = []
for p in req.get("xattr", []):
    try:
        out["xattr"].append(json.loads(os.getxattr(os.path.join(m, p), "user.kvfs.backing")))
    except OSError as e:
        out["xattr"].append(e.errno)
os.close(fd)
print(json.dumps(out))
"""


def as_user(user, m, **req) -> dict:
    with reachable(m.path):
        return json.loads(user.run(AS_USER, m.path, json.dumps(req)).stdout)


def test_backing_files_are_readable_only_by_the_daemon_and_the_owner(kvfs_mount, tenant, intruder):
    m = kvfs_mount(ram="8MiB", allow_other=True)      # a user's leases pin at most 2 MiB of it
    ns = m.path / "team-a"
    ns.mkdir(mode=0o700)
    os.chown(ns, tenant.uid, tenant.gid)
    names = ["team-a/b0", "team-a/b1"]
    want = {n: content(f"seed{i}", MiB) for i, n in enumerate(names)}
    # the filler pushes RAM past its high watermark: b0 and the filler go down to NVMe
    as_user(tenant, m, write=[[names[0], "seed0", MiB], ["team-a/filler", "f", 6 * MiB],
                              [names[1], "seed1", MiB]])
    wait_for(lambda: m.stats()["settled"], 120, "the store to settle")
    tiers = {n: os.getxattr(m.path / n, "user.kvfs.tier").decode() for n in names}
    assert set(tiers.values()) == {"ram", "nvme"}, tiers     # both kinds of backing file
    root_paths = [json.loads(os.getxattr(m.path / n, "user.kvfs.backing"))["path"] for n in names]

    # the owner: a lease hands it its own names of the files, which it can read
    got = as_user(tenant, m, lease=names, xattr=names[:1])
    assert got["prefix"] == 2 and all(got["blocks"]), got["blocks"]
    assert [b[0] for b in got["blocks"]] == [tiers[n] for n in names]
    assert [bytes.fromhex(x) for x in got["leased"]] == [want[n] for n in names]
    owner_paths = [b[1] for b in got["blocks"]]
    assert not set(owner_paths) & set(root_paths)
    assert got["xattr"][0]["path"] == owner_paths[0]
    for p in owner_paths:       # <grants>/<uid>/ is the daemon's; an ACL lets the owner search it
        st = os.stat(os.path.dirname(p))
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o710)
        assert os.getxattr(os.path.dirname(p), "system.posix_acl_access") == search_acl(tenant.uid)

    # another user: no lease, and neither the owner's paths nor the daemon's open
    other = as_user(intruder, m, lease=names, **{"try": owner_paths + root_paths})
    assert other["prefix"] == 0 and other["blocks"] == []
    assert other["tried"] == [errno.EACCES] * 4, other["tried"]
    # ... also where it may read the files through the mount: no path, read through the mount
    os.chmod(ns, 0o755)
    for n in names:
        os.chmod(m.path / n, 0o644)
    other = as_user(intruder, m, lease=names, xattr=names, **{"try": owner_paths + root_paths})
    assert other["prefix"] == 2 and other["blocks"] == [None] * 2
    assert other["xattr"] == [errno.ENODATA] * 2
    assert other["tried"] == [errno.EACCES] * 4, other["tried"]

    # the namespace changes owner: the old owner's names go, the new owner gets its own
    os.chown(ns, intruder.uid, intruder.gid)
    old = as_user(tenant, m, **{"try": owner_paths})
    assert all(e in (errno.ENOENT, errno.EACCES) for e in old["tried"]), old["tried"]
    new = as_user(intruder, m, lease=names)
    assert [bytes.fromhex(x) for x in new["leased"]] == [want[n] for n in names]
    assert as_user(tenant, m, **{"try": [b[1] for b in new["blocks"]]})["tried"] == [errno.EACCES] * 2

    # a file moved to a namespace the owner does not own: its grant goes too
    (m.path / "shared").mkdir(mode=0o755)
    os.rename(m.path / names[0], m.path / "shared" / "b0")
    again = as_user(intruder, m, **{"try": [b[1] for b in new["blocks"]]})["tried"]
    assert again[0] == errno.ENOENT and bytes.fromhex(again[1]) == want[names[1]]
    assert read(m.path / "shared" / "b0") == want[names[0]]

    # no grant outlives the mount
    m.remount()
    assert as_user(intruder, m, **{"try": [b[1] for b in new["blocks"][1:]]})["tried"] == [errno.ENOENT]
