"""Long paths under a real mount, and what a clean ``kvfs umount`` reports.

Each object's record on the NVMe tier carries its path: a file 4 KiB deep was lost at unmount
(ENOSPC from setxattr) while ``kvfs umount`` exited 0. Records too big for an xattr now go to
a side file (kvfs.store.nvmerecord), and ``kvfs umount`` exits 1 whenever the unmount could
not keep a file.
"""
from __future__ import annotations

import os

import cbor2
import pytest

from support.files import MiB, content, read
from support.mount import open_mount, run_kvfs

from kvfs.store import nvmerecord

pytestmark = pytest.mark.mount


def make_chain(top: int, names: list[str]) -> int:
    """mkdir each name under the last (dir descriptors: no absolute path is ever that long);
    returns a descriptor of the deepest."""
    fd = os.dup(top)
    for n in names:
        os.mkdir(n, dir_fd=fd)
        nfd = os.open(n, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nfd
    return fd


def write_at(dfd: int, name: str, data: bytes) -> None:
    fd = os.open(name, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o644, dir_fd=dfd)
    try:
        assert os.write(fd, data) == len(data)
    finally:
        os.close(fd)


def read_at(dfd: int, name: str) -> bytes:
    fd = os.open(name, os.O_RDONLY, dir_fd=dfd)
    try:
        return os.read(fd, 4 * MiB)
    finally:
        os.close(fd)


def reopen(m, names: list[str]) -> int:
    top = os.open(m.path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fd = os.dup(top)
        for n in names:
            nfd = os.open(n, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        return fd
    finally:
        os.close(top)


def fsck(m):
    return run_kvfs("fsck", "--nvme", m.nvme, "--state", m.state)


def nvme_records(m) -> list[dict]:
    """Each NVMe object file's own record (its xattr, or its side file when too big)."""
    out = []
    for p in (m.nvme / "objects").glob("*/*"):
        if p.is_file() and not p.name.endswith((".tmp", nvmerecord.SIDE_SUFFIX)):
            shard = os.open(p.parent, os.O_RDONLY | os.O_DIRECTORY)
            fd = os.open(p, os.O_RDONLY)
            try:
                out.append(cbor2.loads(nvmerecord.load(fd, shard, p.name)))
            finally:
                os.close(fd)
                os.close(shard)
    return out


def test_a_4k_deep_file_survives_a_clean_umount(tmp_path):
    """The issue's case: 1,990 nested directories (a 3,982-byte path here), one 1 MiB file, a
    clean unmount: its record no longer fits an ext4 xattr (setxattr said ENOSPC, taken for a
    full disk, and the file was lost while umount exited 0). Now the record goes to its side
    file, path and all; the one at 3,942 bytes (which used to fit) too; both read back after
    a remount."""
    m = open_mount(tmp_path / "kvfs", ram="64MiB", nvme_size="256MiB")
    fits, past = ["a"] * 1970, ["a"] * 1990
    fits_path, past_path = "/" + "/".join(fits + ["f"]), "/" + "/".join(past + ["f"])
    assert (len(fits_path), len(past_path)) == (3942, 3982)
    data = {1970: content("fits", MiB), 1990: content("past", MiB)}
    try:
        top = os.open(m.path, os.O_RDONLY | os.O_DIRECTORY)
        d = make_chain(top, fits)
        os.close(top)
        write_at(d, "f", data[1970])
        d2 = make_chain(d, ["a"] * 20)
        os.close(d)
        write_at(d2, "f", data[1990])
        os.close(d2)
        res = run_kvfs("umount", m.path)
        assert res.returncode == 0, res.stderr + m.log_tail()
        assert "could not keep" not in m.log_tail(100)
        assert sorted(r["key"] for r in nvme_records(m)) == sorted([fits_path, past_path])
        res = fsck(m)
        assert res.returncode == 0, res.stdout + res.stderr
        m.mount()
        for depth, want in data.items():
            d = reopen(m, ["a"] * depth)
            try:
                assert read_at(d, "f") == want
            finally:
                os.close(d)
    finally:
        m.cleanup()


def test_umount_exits_1_when_it_could_not_keep_a_file(tmp_path):
    m = open_mount(tmp_path / "kvfs", ram="64MiB", nvme_size="1MiB")
    try:
        (m.path / "small").write_bytes(content("small", 4096))
        (m.path / "big").write_bytes(content("big", 2 * MiB))     # never fits the NVMe tier
        res = run_kvfs("umount", m.path)
        assert res.returncode == 1, res.stdout + res.stderr
        assert "1 of 2 RAM-only files could not be kept" in res.stderr, res.stderr
        assert not os.path.ismount(m.path)
        m.mount()
        assert read(m.path / "small") == content("small", 4096)
        assert not (m.path / "big").exists()
        m.umount()                                                  # nothing to lose: exit 0
    finally:
        m.cleanup()
