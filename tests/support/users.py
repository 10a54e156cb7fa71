"""Real second and third users (``useradd``) for the security tests, and ``reachable``."""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

INTRUDER = "kvfs-intruder"


class Intruder:
    """A real unprivileged local user: runs Python snippets as itself (``run``)."""

    def __init__(self, uid: int, gid: int, home: Path, python: str):
        self.uid, self.gid, self.home, self.python = uid, gid, home, python

    def run(self, code: str, *args, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        res = subprocess.run([self.python, "-c", code, *map(str, args)], user=self.uid, group=self.gid,
                             extra_groups=[], capture_output=True, text=True, timeout=timeout, cwd="/",
                             env={"PATH": "/usr/bin:/bin", "HOME": str(self.home)})
        if check:
            assert res.returncode == 0, f"as uid {self.uid}: rc={res.returncode}\n{res.stdout}{res.stderr}"
        return res


def _real_user(name: str):
    """A real unprivileged local user ``name`` (``useradd``), with a scratch home; skipped
    only where the machine cannot add users."""
    import pwd
    import tempfile
    if os.geteuid() != 0:
        pytest.skip("adding a user needs root")
    python = "/usr/bin/python3"
    if not os.access(python, os.X_OK):
        pytest.skip("no system python3 another user can run")
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        res = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                              name], capture_output=True, text=True)
        if res.returncode != 0:
            pytest.skip(f"cannot add a user here: {res.stderr.strip()}")
        pw = pwd.getpwnam(name)
    home = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    os.chown(home, pw.pw_uid, pw.pw_gid)
    yield Intruder(pw.pw_uid, pw.pw_gid, home, python)
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
def intruder():
    """A real second user (``useradd``); skipped only where the machine cannot add users."""
    yield from _real_user(INTRUDER)


@pytest.fixture
def tenant():
    """A real third user, the owner of a namespace in tests where ``intruder`` is the other one."""
    yield from _real_user("kvfs-tenant")


@contextlib.contextmanager
def reachable(path: Path):
    """Let other users traverse to ``path`` (o+x on each ancestor) for the block; restored after."""
    changed = []
    p = Path(path)
    for d in [p, *p.parents]:
        mode = d.stat().st_mode & 0o7777
        if not mode & 0o001:
            os.chmod(d, mode | 0o001)
            changed.append((d, mode))
    try:
        yield
    finally:
        for d, mode in reversed(changed):
            with contextlib.suppress(OSError):
                os.chmod(d, mode)
