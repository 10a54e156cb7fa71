"""Issue 32 (2): kernel invalidations go through a helper process with a clone of the
session's /dev/fuse (kvfs.fs.notifyproc), so no thread of the daemon ever waits in the kernel
on a lock a client holds while it waits for the daemon: a killed daemon always exits."""
from __future__ import annotations

import errno
import os
import signal
import struct

import pytest

from support.files import errno_of
from support.mount import wait_for

from kvfs.fs import notifyproc

pytestmark = pytest.mark.mount


def test_messages_have_the_kernels_layout():
    m = notifyproc.inval_entry(7, b"name")
    assert struct.unpack_from("<IiQ", m) == (len(m), notifyproc.NOTIFY_INVAL_ENTRY, 0)
    assert struct.unpack_from("<QII", m, 16) == (7, 4, 0) and m[32:] == b"name\0"
    m = notifyproc.inval_entry(7, b"name", deleted=9)
    assert struct.unpack_from("<IiQQQII", m) == (len(m), notifyproc.NOTIFY_DELETE, 0, 7, 9, 4, 0)
    assert m[40:] == b"name\0"
    m = notifyproc.inval_inode(5, attr_only=True)
    assert struct.unpack("<IiQQqq", m) == (40, notifyproc.NOTIFY_INVAL_INODE, 0, 5, -1, 0)


def _helpers(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def _fuse_fds(pid: int) -> int:
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += os.readlink(f"/proc/{pid}/fd/{fd}") == "/dev/fuse"
        except OSError:
            pass
    return n


def test_the_helper_notifies_and_ends_with_the_daemon(kvfs_mount):
    m = kvfs_mount()
    helpers = _helpers(m.pid)
    assert len(helpers) == 1 and _fuse_fds(helpers[0]) == 1, "no helper with a device of its own"
    # a negative entry the kernel caches, then the name made by the daemon itself (a commit):
    # only an invalidation (through the helper) makes it visible
    assert errno_of(os.stat, m.path / "late") == errno.ENOENT
    from kvfs.kv.commit import CommitClient
    c = CommitClient(str(m.path))
    try:
        assert c.commit("", [("late", [bytearray(b"x" * 4096)])]) == [0]
    finally:
        c.close()
    assert os.stat(m.path / "late").st_size == 4096
    h = helpers[0]
    os.kill(m.pid, signal.SIGKILL)
    wait_for(lambda: not os.path.exists(f"/proc/{h}") or open(f"/proc/{h}/stat").read().split()[2] in "ZX",
             60, "the helper to end with its daemon")
    assert errno_of(os.stat, m.path / "never-looked-up") in (errno.ENOTCONN, errno.ECONNABORTED)


def test_a_failed_helper_is_reaped_and_notifying_goes_on(kvfs_mount):
    """The helper dies: the next notification finds it gone, the daemon kills and reaps it
    (no zombie, no pipes left) and says so at error level; notifications still arrive."""
    m = kvfs_mount()
    (h,) = _helpers(m.pid)
    os.kill(h, signal.SIGKILL)
    assert errno_of(os.stat, m.path / "late") == errno.ENOENT      # a cached negative entry
    from kvfs.kv.commit import CommitClient
    c = CommitClient(str(m.path))
    try:
        assert c.commit("", [("late", [bytearray(b"x" * 4096)])]) == [0]
    finally:
        c.close()
    wait_for(lambda: h not in _helpers(m.pid), 60, "the failed helper to be reaped")
    assert os.stat(m.path / "late").st_size == 4096             # notified from the daemon
    wait_for(lambda: "ERROR" in m.log_tail() and "notification helper failed" in m.log_tail(), 60,
             "the failure logged at error level")
