"""What the kernel may cache on a kvfs mount, and that it never hides or serves stale state.

kvfs/fs/ops.py answers a missing name with a negative entry (the kernel remembers the miss),
so a name must become visible however it appears afterwards: create, O_EXCL temp + rename
(vLLM, SGLang), mkdir races (vLLM's 16 writer threads), symlink.
"""
from __future__ import annotations

import os
import threading

import pytest

from mounthelp import content, put, read
from mounthelp import d, mnt  # noqa: F401 - shared fixtures

pytestmark = pytest.mark.mount


def _missing_twice(p) -> None:
    for _ in range(2):                          # the second miss is the kernel's cached one
        assert not os.path.exists(p)
        with pytest.raises(FileNotFoundError):
            os.stat(p)


@pytest.mark.parametrize("how", ["create", "rename", "mkdir", "symlink"])
def test_a_name_missed_twice_appears_when_made(d, how):
    p = d / "name"
    _missing_twice(p)
    data = content(how, 40_000)
    if how == "create":
        fd = os.open(p, os.O_CREAT | os.O_WRONLY, 0o644)
        os.write(fd, data)
        os.close(fd)
    elif how == "rename":
        fd = os.open(d / "name.bin_1234.tmp", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        os.write(fd, data)
        os.close(fd)
        os.rename(d / "name.bin_1234.tmp", p)
        _missing_twice(d / "name.bin_1234.tmp")
    elif how == "mkdir":
        os.mkdir(p)
    else:
        put(d / "target", data)
        os.symlink("target", p)
    assert os.path.exists(p)
    if how != "mkdir":
        assert read(p) == data
    # gone again: the miss is seen, then the name comes back
    if how == "mkdir":
        os.rmdir(p)
    else:
        os.unlink(p)
    _missing_twice(p)
    put(p, data[:100])
    assert read(p) == data[:100]


def test_makedirs_race_after_misses(d):
    """vLLM: 16 threads ``makedirs(exist_ok=True)`` the same parents after checking blocks there."""
    leaf = d / "m_abc" / "abc" / "de_g0"
    _missing_twice(leaf / "h.bin")
    errors = []

    def work(i):
        try:
            os.makedirs(leaf, exist_ok=True)
            put(leaf / f"{i}.bin", content(str(i), 4096))
        except OSError as e:                  # noqa: PERF203
            errors.append(e)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(os.listdir(leaf)) == sorted(f"{i}.bin" for i in range(16))
    assert all(read(leaf / f"{i}.bin") == content(str(i), 4096) for i in range(16))


def test_o_excl_still_fails_on_an_existing_name(d):
    put(d / "x", b"1")
    with pytest.raises(FileExistsError):
        os.open(d / "x", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    assert read(d / "x") == b"1"
