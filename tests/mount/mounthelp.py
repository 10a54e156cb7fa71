"""Helpers shared by the real-mount tests in tests/mount (content derived from seeds, polling)."""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import json
import os
import random
import subprocess
from pathlib import Path

import pytest

from conftest import pid_alive, put, run_kvfs, wait_for  # noqa: E402,F401

MiB = 1 << 20


def content(seed: str, size: int) -> bytes:
    """Deterministic bytes of ``size`` derived from ``seed``."""
    return random.Random(seed).randbytes(size)


def read(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def xattr(path, name: str) -> str:
    return os.getxattr(path, name).decode()


def errno_of(fn, *args, **kwargs) -> int | None:
    """Run ``fn``; return the errno of the OSError it raised, or None if it succeeded."""
    try:
        fn(*args, **kwargs)
    except OSError as e:
        return e.errno
    return None


_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
AT_FDCWD = -100
RENAME_NOREPLACE = 1


def renameat2(old, new, flags: int) -> None:
    fn = getattr(_libc, "renameat2", None)
    if fn is None:
        raise OSError(errno.ENOSYS, "renameat2 not in libc")
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    rc = fn(AT_FDCWD, os.fsencode(old), AT_FDCWD, os.fsencode(new), flags)
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    """fallocate(2) itself, not glibc's posix_fallocate (which emulates it on EOPNOTSUPP)."""
    fn = _libc.fallocate
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if fn(fd, mode, offset, length) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def stats_json(mount) -> dict:
    res = run_kvfs("stat", mount.path, "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def tier_total(st: dict, key: str) -> int:
    return sum(t.get(key, 0) for t in st["tiers"].values())


def open_mount(root: Path, *extra_args, ram="64MiB", nvme_size="1GiB", **options):
    """A mount outside the function-scoped ``kvfs_mount`` fixture (caller calls ``cleanup``)."""
    from conftest import Mount
    root.mkdir(parents=True, exist_ok=True)
    return Mount(root, extra_args, {"ram": ram, "nvme_size": nvme_size, **options}).mount()


@pytest.fixture(scope="module")
def mnt(tmp_path_factory):
    """One mount per test module (import this fixture and ``d`` into the module)."""
    m = open_mount(tmp_path_factory.mktemp("kvfs-mod") / "kvfs")
    yield m
    m.cleanup()


@pytest.fixture
def d(mnt, request) -> Path:
    """A fresh directory for the test inside the module's mount."""
    p = mnt.path / request.node.name.replace("[", "_").replace("]", "_")
    p.mkdir()
    return p


def scrape(m) -> dict:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families
    """``{(name, (label values sorted by label name)): value}`` of the daemon's /metrics."""
    addr = m.stats()["metrics"]
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=30) as r:
        assert r.status == 200
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(v for _, v in sorted(s.labels.items())))] = s.value
    return out


def abort_conn(conn: int) -> None:
    """Free the clients of a wedged FUSE connection (what an operator does by hand)."""
    ctl = "/sys/fs/fuse/connections"
    if not os.path.exists(f"{ctl}/{conn}"):
        subprocess.run(["mount", "-t", "fusectl", "none", ctl], capture_output=True)
    try:
        with open(f"{ctl}/{conn}/abort", "w") as f:
            f.write("1")
    except OSError:
        pass
