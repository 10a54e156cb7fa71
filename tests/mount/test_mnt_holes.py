"""Issue 40, item 1: holes in a RAM write buffer on a full tmpfs. A write at a large offset or a
truncate up leaves holes in the buffer's tmpfs file; the seal hashed it through a mapping, and
a fault on a hole that the full tmpfs could not back was a SIGBUS that killed the daemon. Now
the seal allocates the holes first (``fallocate``: ENOSPC, never a signal) or spills the
buffer to NVMe and reads it with ``pread``; a truncate up checks for room like a write."""
from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from support.files import MiB, content, read
from support.mount import pid_alive, wait_for

pytestmark = pytest.mark.mount

KiB = 1 << 10


def fill(where: Path) -> Path:
    """Take every free byte of ``where``'s filesystem (as another process would)."""
    path = where / "filler"
    with open(path, "wb") as f:
        chunk = b"\x5a" * (8 * MiB)
        while True:
            try:
                os.write(f.fileno(), chunk)
            except OSError as e:
                assert e.errno == errno.ENOSPC
                if len(chunk) == 4096:
                    return path
                chunk = chunk[:len(chunk) // 2]


def alive(m) -> None:
    assert pid_alive(m.pid), "the daemon died\n" + m.log_tail()
    assert "Fatal Python error" not in (m.state / "kvfs.log").read_text(errors="replace")


def test_holes_of_a_buffer_on_a_full_tmpfs_never_kill_the_daemon(kvfs_mount):
    m = kvfs_mount(ram="16MiB", nvme_size="256MiB")
    d = m.path / "ns"
    d.mkdir()
    tmpfs = Path(m.stats()["ram_dir"]).parent
    head = content("head", 300 * KiB)            # past mapped_min: the buffer is a tmpfs file
    tail = content("tail", 4 * KiB)
    fds = {}
    # truncated up while the tmpfs had room, sealed after it filled
    fds["up"] = os.open(d / "up", os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fds["up"], head)
    os.ftruncate(fds["up"], 3 * MiB)
    # written at a large offset while it had room (a hole between)
    fds["sparse"] = os.open(d / "sparse", os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fds["sparse"], head)
    os.pwrite(fds["sparse"], tail, 5 * MiB)
    # one truncated up after the tmpfs filled (the truncate checks for room)
    fds["late"] = os.open(d / "late", os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fds["late"], head)
    filler = fill(tmpfs)
    try:
        os.ftruncate(fds["late"], 6 * MiB)
        for name, fd in fds.items():
            os.close(fd)                         # the seal: before the fix, SIGBUS here
            alive(m)
        assert read(d / "up") == head + bytes(3 * MiB - len(head))
        assert read(d / "sparse") == head + bytes(5 * MiB - len(head)) + tail
        assert read(d / "late") == head + bytes(6 * MiB - len(head))
        for name in fds:                         # spilled: the tmpfs had no room for the holes
            assert os.getxattr(d / name, "user.kvfs.tier") == b"nvme", name
        alive(m)
    finally:
        filler.unlink()
    # the tmpfs has room again: the same, sealed into RAM with every page allocated
    with open(d / "again", "wb") as f:
        f.write(head)
        f.truncate(2 * MiB)
    assert read(d / "again") == head + bytes(2 * MiB - len(head))
    assert os.getxattr(d / "again", "user.kvfs.tier") == b"ram"
    ram = Path(m.stats()["ram_dir"])
    objects = [p for p in ram.iterdir() if p.is_file() and len(p.name) == 16]
    assert objects
    for p in objects:                            # no hole left to fault on
        st = p.stat()
        assert st.st_blocks * 512 >= st.st_size, p
    alive(m)
    m.umount()


def test_a_fatal_signal_leaves_its_traceback_in_kvfs_log(kvfs_mount):
    import signal
    m = kvfs_mount(ram="16MiB", nvme_size="64MiB")
    pid = m.pid
    os.kill(pid, signal.SIGBUS)
    wait_for(lambda: not pid_alive(pid), 30, "the daemon to die of SIGBUS")
    text = (m.state / "kvfs.log").read_text(errors="replace")
    assert "Fatal Python error: Bus error" in text, text[-2000:]
    assert "most recent call first" in text
