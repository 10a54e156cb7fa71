"""setuid/setgid bits are cleared as on ext4 (issue 40, item 5).

A write or truncate by a caller without CAP_FSETID, and a chown, clear S_ISUID (and S_ISGID
where the kernel's rule says so: group-exec set, or a writer outside the file's group). kvfs
does it in the daemon, told by the kernel when (FUSE_HANDLE_KILLPRIV_V2 on kvfs's own
transport; libfuse's KILLPRIV on the pyfuse3 one, where the daemon decides from the caller).

Every case runs on a real ext4 (or tmpfs) directory and on the mount in the same test, by root
and by a real second user, and the modes must agree -- the reference is the machine's own
kernel, not a table written here.
"""
from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from support.users import reachable

pytestmark = pytest.mark.mount

# one operation per "op:path" argument, as the calling user
OPS = r'''
import os, sys

def run(op, path):
    if op == "write":
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, b"x", 0)
        finally:
            os.close(fd)
    elif op == "append":
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, b"more")
        finally:
            os.close(fd)
    elif op == "truncate":
        os.truncate(path, 1)
    elif op == "ftruncate":
        fd = os.open(path, os.O_WRONLY)
        try:
            os.ftruncate(fd, 1)
        finally:
            os.close(fd)
    elif op == "otrunc":
        os.close(os.open(path, os.O_WRONLY | os.O_TRUNC))
    elif op == "chgrp":
        os.chown(path, -1, os.getgid())
    elif op == "chown":
        os.chown(path, int(sys.argv[1]), -1)
    elif op == "chown_none":
        os.chown(path, -1, -1)
    else:
        raise SystemExit("unknown op " + op)

for arg in sys.argv[2:]:
    op, path = arg.split(":", 1)
    run(op, path)
'''

# name -> (mode, owner, actor, op). owner: "root" (root:root), "rootg" (root:the user's group),
# "user" (the user:the user's group); actor: "root" or "user"
CASES = {
    "write suid by other": (0o4777, "root", "user", "write"),
    "append suid by other": (0o4777, "root", "user", "append"),
    "write sgid+gx by other": (0o2777, "root", "user", "write"),
    "write sgid no gx by other": (0o2767, "root", "user", "write"),
    "write sgid no gx by group": (0o2767, "rootg", "user", "write"),
    "write sgid+gx by group": (0o2777, "rootg", "user", "write"),
    "write both by root": (0o6777, "root", "root", "write"),
    "write both by owner": (0o6777, "user", "user", "write"),
    "truncate suid by other": (0o4777, "root", "user", "truncate"),
    "ftruncate suid by other": (0o4777, "root", "user", "ftruncate"),
    "open O_TRUNC suid by other": (0o4777, "root", "user", "otrunc"),
    "open O_TRUNC sgid+gx by other": (0o2777, "root", "user", "otrunc"),
    "truncate both by root": (0o6777, "root", "root", "truncate"),
    "open O_TRUNC both by root": (0o6777, "root", "root", "otrunc"),
    "chown both by root": (0o6777, "root", "root", "chown"),
    "chown sgid no gx by root": (0o2767, "root", "root", "chown"),
    "chgrp both by owner": (0o6777, "user", "user", "chgrp"),
    "chgrp sgid no gx by owner": (0o2767, "user", "user", "chgrp"),
    "chown -1 -1 both by owner": (0o6777, "user", "user", "chown_none"),
    "chown -1 -1 sgid no gx by owner": (0o2767, "user", "user", "chown_none"),
    "chown -1 -1 both by root": (0o6777, "root", "root", "chown_none"),
    "chown -1 -1 sgid no gx by root": (0o2767, "root", "root", "chown_none"),
    "write plain by other": (0o0777, "root", "user", "write"),
}


def _run_as_root(ops: list[str], user_uid: int) -> None:
    ns: dict = {}
    argv = sys.argv
    try:
        sys.argv = ["-c", str(user_uid), *ops]
        exec(compile(OPS, "ops", "exec"), ns)
    finally:
        sys.argv = argv


def apply_cases(top: Path, user, cases: dict = CASES) -> dict[str, str]:
    """Every case in its own file under ``top``: made by root with the case's owner and mode,
    then the operation by the case's actor. Returns each file's mode afterwards (octal)."""
    top.mkdir(exist_ok=True)
    os.chmod(top, 0o777)
    owners = {"root": (0, 0), "rootg": (0, user.gid), "user": (user.uid, user.gid)}
    by_user, by_root = [], []
    paths = {}
    for i, (name, (mode, owner, actor, op)) in enumerate(cases.items()):
        p = top / f"f{i}"
        p.write_bytes(b"data" * 256)
        os.chown(p, *owners[owner])
        os.chmod(p, mode)                     # after the chown, which may clear bits
        assert stat.S_IMODE(os.stat(p).st_mode) == mode, name
        paths[name] = p
        (by_user if actor == "user" else by_root).append(f"{op}:{p}")
    if by_user:
        user.run(OPS, str(user.uid), *by_user)
    if by_root:
        _run_as_root(by_root, user.uid)
    return {name: oct(stat.S_IMODE(os.stat(p).st_mode)) for name, p in paths.items()}


@pytest.fixture
def reference(tmp_path, intruder):
    """The modes the machine's own kernel gives on a real local filesystem (the root
    filesystem's ext4 where tmp_path lives; tmpfs otherwise)."""
    ref = tmp_path / "reference"
    with reachable(tmp_path):
        return apply_cases(ref, intruder)


@pytest.mark.parametrize("transport", ["kernel", "pyfuse3"])
def test_setuid_setgid_cleared_as_on_a_local_filesystem(kvfs_mount, intruder, reference, transport):
    m = kvfs_mount("--transport", transport, allow_other=True, ram="32MiB", nvme_size="256MiB")
    with reachable(m.path.parent):
        got = apply_cases(m.path / "cases", intruder)
    # the kernel's rules, as this machine applies them (a sanity check of the reference)
    assert reference["write suid by other"] == "0o777"
    assert reference["write both by root"] == "0o6777"
    assert reference["write sgid no gx by group"] == "0o2767"
    diff = {k: (reference[k], got[k]) for k in CASES if reference[k] != got[k]}
    assert not diff, f"(local fs, kvfs) modes differ: {diff}"
    # and the cleared modes are the store's, not the kernel's cached attributes
    m.remount()
    again = {name: oct(stat.S_IMODE(os.stat(m.path / "cases" / f"f{i}").st_mode))
             for i, name in enumerate(CASES)}
    assert again == got
