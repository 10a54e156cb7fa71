"""``kvfs upgrade``: the supervisor (kvfs/supervisor.py) runs again from the code on disk,
a new program image holding the same descriptors.

The session's ``/dev/fuse`` descriptor, the socket, the attached daemon's connection and the
standby's pipes are made inheritable and survive ``execv``; the children stay the process's own
(the pid does not change); the rest of the state travels as JSON in a memfd whose number is the
new image's ``--resume`` argument. A failed exec leaves the old image running as it was.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys

log = logging.getLogger("kvfs.supervisor")


def _state(sup) -> tuple[dict, list[int]]:
    keep = [sup.lock, sup.sock.fileno()]
    st = {"config_json": sup.config_json, "fd": sup.fd, "agreed": sup.agreed, "epoch": sup.epoch,
          "history": sup.history, "crashes": sup.crashes, "cause": sup.cause, "died_at": sup.died_at,
          "started_at": sup.started_at, "lock": sup.lock, "sock": sup.sock.fileno(),
          "attached": sup.attached.fileno() if sup.attached is not None else -1,
          "attached_buf": sup.attached_buf.decode(errors="replace"),
          "child": sup.child.pid if sup.child is not None else None, "child_ready": sup.child_ready,
          "restart_at": sup.restart_at, "standby": None, "backing": sup.backing}
    keep += [fd for fd in (sup.fd, st["attached"], sup.child_ready) if fd >= 0]
    if sup.standby is not None:
        proc, rfd = sup.standby
        stdin = proc.stdin.fileno() if proc.stdin is not None else -1
        st["standby"] = {"pid": proc.pid, "stdin": stdin, "ready": rfd}
        keep += [fd for fd in (stdin, rfd) if fd >= 0]
    return st, keep


def exec_again(self) -> None:
    """Replace this program image with the supervisor's code as it is on disk now (an upgrade
    of kvfs), keeping the session, the socket, the daemon and the standby: the descriptors
    stay open across exec, the children stay ours (the pid does not change), the rest of the
    state goes through a memfd."""
    state, keep = _state(self)
    try:
        memfd = os.memfd_create("kvfs-supervisor-state", 0)
        os.write(memfd, json.dumps(state).encode())
        os.lseek(memfd, 0, os.SEEK_SET)
        for fd in keep:
            os.set_inheritable(fd, True)
        if self.child_pidfd >= 0:
            os.close(self.child_pidfd)      # pidfds are opened again by the new image
            self.child_pidfd = -1
        log.info("supervisor %d: re-exec (epoch %d, daemon %s)", os.getpid(), self.epoch,
                 state["child"])
        logging.shutdown()
        os.execv(sys.executable, [sys.executable, "-m", "kvfs.supervisor", "--resume", str(memfd)])
    except OSError as e:
        log.error("supervisor: re-exec failed (%s): this image goes on", e)
        self.reexec_due = False
        for fd in keep:
            with contextlib.suppress(OSError):
                os.set_inheritable(fd, False)
        if self.child is not None and self.child_pidfd < 0:
            self.child_pidfd = os.pidfd_open(self.child.pid)


def restore(sup, memfd: int, Proc):
    """``sup`` (a new Supervisor) given the state a re-exec handed over (see :func:`exec_again`);
    ``Proc`` makes the handles of the children it kept."""
    with os.fdopen(memfd, "rb") as f:
        st = json.loads(f.read())
    for key in ("fd", "agreed", "epoch", "history", "crashes", "cause", "died_at", "started_at",
                "lock", "child_ready", "restart_at", "backing"):
        setattr(sup, key, st[key])
    fds = [sup.fd, sup.lock, st["sock"], st["attached"], sup.child_ready]
    sup.sock = socket.socket(fileno=st["sock"])
    sup.sock.setblocking(False)
    if st["attached"] >= 0:
        sup.attached = socket.socket(fileno=st["attached"])
        sup.attached.setblocking(False)
        sup.attached_buf = bytearray(st["attached_buf"].encode())
    if st["child"] is not None:
        sup.child = Proc(st["child"])
        sup.child_pidfd = os.pidfd_open(sup.child.pid)
    if st["standby"]:
        sb = st["standby"]
        sup.standby = (Proc(sb["pid"], stdin_fd=sb["stdin"]), sb["ready"])
        fds += [sb["stdin"], sb["ready"]]
    for fd in fds:
        if fd is not None and fd >= 0:
            os.set_inheritable(fd, False)
    log.info("supervisor %d: resumed after re-exec (epoch %d, daemon %s)", os.getpid(), sup.epoch,
             st["child"])
    return sup
