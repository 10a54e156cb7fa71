"""Long paths under a real mount, and what a clean ``kvfs umount`` reports.

Each object's record on the NVMe tier carries its path, in one xattr (4 KiB on ext4): a file
4 KiB deep was lost at unmount while ``kvfs umount`` exited 0. Paths longer than
``PATH_MAX`` (3,072 bytes from the mount root) are refused with ENAMETOOLONG; one a directory
rename pushes deeper is kept without its path in the record; and ``kvfs umount`` exits 1
whenever the unmount could not keep a file.
"""
from __future__ import annotations

import errno
import os

import pytest

from mounthelp import MiB, content, errno_of, open_mount, read, run_kvfs

from kvfs.store.namespace import PATH_MAX

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


def test_path_limit_is_enforced_at_and_past_it_and_survives_umount(tmp_path):
    assert PATH_MAX == 3072
    m = open_mount(tmp_path / "kvfs", ram="64MiB", nvme_size="256MiB")
    # 11 directories of 255 bytes and one of 54: "/" + name each, 2,871 bytes
    names = [chr(ord("a") + i) * 255 for i in range(11)] + ["l" * 54]
    assert sum(len(n) + 1 for n in names) == PATH_MAX - 201
    data = content("deep", MiB)
    try:
        top = os.open(m.path, os.O_RDONLY | os.O_DIRECTORY)
        d = make_chain(top, names)
        os.close(top)
        write_at(d, "f" * 200, data)                      # exactly PATH_MAX bytes: fine
        os.mkdir("m" * 200, dir_fd=d)
        os.symlink("x", "s" * 200, dir_fd=d)
        past = "g" * 201                                  # PATH_MAX + 1
        assert errno_of(os.open, past, os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=d) == errno.ENAMETOOLONG
        assert errno_of(os.mkdir, past, dir_fd=d) == errno.ENAMETOOLONG
        assert errno_of(os.symlink, "x", past, dir_fd=d) == errno.ENAMETOOLONG
        assert errno_of(os.rename, "f" * 200, past, src_dir_fd=d, dst_dir_fd=d) == errno.ENAMETOOLONG
        assert sorted(os.listdir(d)) == sorted(["f" * 200, "m" * 200, "s" * 200])
        os.close(d)
        res = run_kvfs("umount", m.path)                  # the file is written down to NVMe
        assert res.returncode == 0, res.stderr + m.log_tail()
        res = fsck(m)
        assert res.returncode == 0, res.stdout + res.stderr
        m.mount()
        d = reopen(m, names)
        try:
            assert read_at(d, "f" * 200) == data
        finally:
            os.close(d)
    finally:
        m.cleanup()


def test_a_file_a_directory_rename_pushed_past_the_limit_is_kept(tmp_path):
    """The rename checks the moved directory's own path; a file below it that ends up longer
    than any xattr can hold is kept all the same (its record without the path)."""
    m = open_mount(tmp_path / "kvfs", ram="64MiB", nvme_size="256MiB")
    below = ["b" * 255] * 10 + ["c" * 200]               # 2,761 bytes below "/t"
    above = ["a" * 255] * 6                              # 1,536 bytes: the new home of "t"
    data = content("moved", MiB)
    try:
        top = os.open(m.path, os.O_RDONLY | os.O_DIRECTORY)
        d = make_chain(top, ["t", *below])
        write_at(d, "f" * 255, data)                      # /t/... 3,019 bytes
        os.close(d)
        a = make_chain(top, above)
        os.rename("t", "t", src_dir_fd=top, dst_dir_fd=a)     # now 4,555 bytes deep
        os.close(a)
        os.close(top)
        res = run_kvfs("umount", m.path)
        assert res.returncode == 0, res.stderr + m.log_tail()
        assert "kept without its" in m.log_tail(100)
        res = fsck(m)
        assert res.returncode == 0, res.stdout + res.stderr
        m.mount()
        d = reopen(m, [*above, "t", *below])
        try:
            assert read_at(d, "f" * 255) == data
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
