"""Kernel cache invalidations sent by a helper process, never by a thread of the daemon.

An invalidation of a name (``FUSE_NOTIFY_INVAL_ENTRY``, ``FUSE_NOTIFY_DELETE``) takes its
directory's lock in the kernel, uninterruptibly; one of an inode's pages waits on their page
locks. A client that holds that lock while it waits for the daemon's answer (``open`` with
``O_CREAT`` holds its directory through the lookup and create) makes the notification wait
until the daemon answers -- normally soon. But when the daemon is killed then, the thread
that wrote the notification stays in uninterruptible sleep, so the killed daemon cannot exit;
the daemon's ``/dev/fuse`` descriptor is released only when it exits, so the request the
client waits for is never ended: every client of the mount hung until the connection was
aborted through fusectl (found by tests/mount/test_mnt_kill_loop.py: 7 wedges in 102 cycles,
the daemon's thread in ``fuse_reverse_inval_entry``).

So the notifications go through a **clone** of the session's device (``FUSE_DEV_IOC_CLONE``:
the same connection, a device of its own) held by a small helper process. A killed daemon
always exits -- nothing of it waits in the kernel -- and the release of its device ends every
request it had taken (ECONNABORTED for their clients), which frees the directory locks the
helper may be waiting for. The helper then notices the daemon is gone, answers any request
still queued on the connection with ENOTCONN while its last notification finishes, and exits:
its device was the connection's last, so the kernel aborts the connection and every later
request fails at once (ENOTCONN), as after any daemon's death. Under a supervisor
(kvfs/supervisor.py, ``SUPERVISED``) the connection outlives the daemon: the helper answers
nothing, waits for its notification under way (the next daemon answers the request that
held its lock) and exits.

The daemon writes each notification (the kernel's message, built here) into the helper's
stdin and reads a 4-byte answer (0 or the errno) from its stdout: a pipe read, which a
``kill -9`` always interrupts.
"""
from __future__ import annotations

import fcntl
import logging
import os
import struct
import subprocess
import sys
import threading

log = logging.getLogger(__name__)

# set by a daemon serving a session its supervisor holds (kvfs/supervisor.py): its helper then
# leaves the connection's requests to the next daemon when it dies instead of failing them
SUPERVISED = False

FUSE_DEV_IOC_CLONE = 0x8004E500     # _IOR(229, 0, uint32_t)
NOTIFY_INVAL_INODE = 2
NOTIFY_INVAL_ENTRY = 3
NOTIFY_DELETE = 6
_HEADER = struct.Struct("<IiQ")     # fuse_out_header: len, error (the notify code), unique (0)

_HELPER = r"""
import errno, os, select, struct, sys, threading
fd, daemon, supervised = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:] == ["supervised"]
busy = threading.Lock()             # held while a notification is in the kernel
IN = struct.Struct("<IIQ")          # fuse_in_header: len, opcode, unique
NO_REPLY = (2, 36, 42)              # FORGET, INTERRUPT, BATCH_FORGET
def after_the_daemon():
    try:
        pidfd = os.pidfd_open(daemon)
        p = select.poll()
        p.register(pidfd, select.POLLIN)
        p.poll()
    except OSError:
        pass
    if supervised:
        # a supervisor holds the session and starts the next daemon, which answers what is
        # queued (and what the dead one had read, resent): only the notification under way
        # is waited for, then this device goes
        busy.acquire()
        os._exit(0)
    # the daemon is gone: what is still queued on the connection would wait for an answer while
    # this device keeps it open; answer ENOTCONN until the notification under way is through
    p = select.poll()
    p.register(fd, select.POLLIN)
    while not busy.acquire(blocking=False):
        if not p.poll(50):
            continue
        try:
            req = os.read(fd, (1 << 21) + 65536)
        except OSError:
            continue
        if len(req) >= IN.size:
            _, opcode, unique = IN.unpack_from(req)
            if opcode not in NO_REPLY:
                try:
                    os.write(fd, struct.pack("<IiQ", 16, -errno.ENOTCONN, unique))
                except OSError:
                    pass
    os._exit(0)
threading.Thread(target=after_the_daemon, daemon=True).start()
rd, wr = sys.stdin.buffer, sys.stdout.buffer
while True:
    head = rd.read(4)
    if len(head) < 4:
        break
    msg = head + rd.read(struct.unpack("<I", head)[0] - 4)
    with busy:
        try:
            os.write(fd, msg)
            err = 0
        except OSError as e:
            err = e.errno or errno.EIO
    wr.write(struct.pack("<i", err))
    wr.flush()
os._exit(0)
"""


def inval_inode(ino: int, attr_only: bool = False) -> bytes:
    """``FUSE_NOTIFY_INVAL_INODE`` (what ``pyfuse3.invalidate_inode`` sends)."""
    body = struct.pack("<Qqq", ino, -1 if attr_only else 0, 0)
    return _HEADER.pack(_HEADER.size + len(body), NOTIFY_INVAL_INODE, 0) + body


def inval_entry(parent: int, name: bytes, deleted: int = 0) -> bytes:
    """``FUSE_NOTIFY_INVAL_ENTRY``, or ``FUSE_NOTIFY_DELETE`` with ``deleted`` (the child's
    inode), as ``pyfuse3.invalidate_entry`` sends them."""
    if deleted:
        body = struct.pack("<QQII", parent, deleted, len(name), 0) + name + b"\0"
        code = NOTIFY_DELETE
    else:
        body = struct.pack("<QII", parent, len(name), 0) + name + b"\0"
        code = NOTIFY_INVAL_ENTRY
    return _HEADER.pack(_HEADER.size + len(body), code, 0) + body


def session_fd() -> int | None:
    """The daemon's descriptor of ``/dev/fuse`` (the one pyfuse3's session reads)."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == "/dev/fuse":
                found.append(int(name))
        except OSError:
            pass
    return found[0] if len(found) == 1 else None


class Channel:
    """The helper process and its pipes; ``send`` may be called from any thread."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self._lock = threading.Lock()

    def send(self, msg: bytes) -> int:
        """Deliver one notification; 0 or the errno the kernel answered (ENOENT: nothing
        cached). OSError (EPIPE) when the helper is gone."""
        with self._lock:
            self.proc.stdin.write(msg)
            self.proc.stdin.flush()
            got = self.proc.stdout.read(4)
        if len(got) < 4:
            raise BrokenPipeError("the notification helper ended")
        return struct.unpack("<i", got)[0]

    def abandon(self, timeout: float = 10.0) -> None:
        """End a helper that failed: kill it, close its pipes, reap it (no zombie, no fds left)."""
        try:
            self.proc.kill()
        except OSError:
            pass
        with self._lock:
            for pipe in (self.proc.stdin, self.proc.stdout):
                try:
                    pipe.close()
                except (OSError, ValueError):       # unflushed bytes to a dead helper
                    pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:   # stuck in the kernel: reaped by a later Popen
            log.warning("failed notification helper %d did not end within %.0fs", self.proc.pid, timeout)

    def close(self, timeout: float = 10.0) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("notification helper %d did not end within %.0fs", self.proc.pid, timeout)
        self.proc.stdout.close()


def open_channel() -> Channel | None:
    """A helper holding a clone of the session's device; None (logged) where that cannot be
    made: notifications then go from a thread of the daemon, as before."""
    fd = session_fd()
    if fd is None:
        log.warning("kernel notifications from the daemon itself: its /dev/fuse descriptor not found")
        return None
    try:
        clone = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        log.warning("kernel notifications from the daemon itself: cannot open /dev/fuse (%s)", e)
        return None
    try:
        fcntl.ioctl(clone, FUSE_DEV_IOC_CLONE, struct.pack("<I", fd))
        proc = subprocess.Popen([sys.executable, "-c", _HELPER, str(clone), str(os.getpid()),
                                 *(["supervised"] if SUPERVISED else [])],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(clone,),
                                close_fds=True)
    except OSError as e:
        log.warning("kernel notifications from the daemon itself: no helper (%s)", e)
        return None
    finally:
        os.close(clone)
    log.debug("kernel notifications through helper %d", proc.pid)
    return Channel(proc)
