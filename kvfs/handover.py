"""The supervisor's socket (kvfs/supervisor.py): one JSON line a message, a descriptor passed
with SCM_RIGHTS beside it, and the daemon's side of it (:func:`attach`, :class:`Attachment`).

Kept apart from the supervisor so that the daemon imports only what it speaks, and the
supervisor only what it serves. The socket is ``0600`` in the private state directory and the
supervisor checks every peer with :func:`peer_credentials` (SO_PEERCRED).
"""
from __future__ import annotations

import array
import contextlib
import json
import os
import socket
import struct
import threading

HANDOVER = 75           # the daemon's exit status after ``kvfs restart`` handed the session on
SOCKET_NAME = "supervisor.sock"
HISTORY = 20            # restarts kept for .kvfs/stats


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of a UNIX socket's peer, as the kernel recorded them at connect."""
    return struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))


def send(conn: socket.socket, msg: dict, fd: int | None = None) -> None:
    data = (json.dumps(msg) + "\n").encode()
    if fd is None:
        conn.sendall(data)
    else:
        conn.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])


def recv_line(conn: socket.socket, buf: bytearray, fds: list | None = None) -> dict | None:
    """One JSON line from ``conn`` (None at EOF); received descriptors are added to ``fds``."""
    while b"\n" not in buf:
        msg, anc, _, _ = conn.recvmsg(1 << 16, socket.CMSG_SPACE(4 * 4))
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(data[:len(data) - len(data) % 4])
                if fds is None:
                    for fd in got:
                        os.close(fd)
                else:
                    fds.extend(got)
        if not msg:
            return None
        buf += msg
    line, _, rest = bytes(buf).partition(b"\n")
    buf[:] = rest
    return json.loads(line)


# ---- the daemon's side ------------------------------------------------------------------------
class Attachment:
    """A daemon's connection to its supervisor (kept open for the daemon's life)."""

    def __init__(self, conn: socket.socket, fd: int, reply: dict):
        self.conn, self.fd, self.reply = conn, fd, reply
        self._lock = threading.Lock()
        self.epoch = int(reply["epoch"])
        self.agreed = reply.get("agreed")
        self.history: list = list(reply.get("history") or [])

    def tell(self, msg: dict) -> None:
        """A note to the supervisor (``agreed``, ``served``, ``backing``); lost if it is gone.
        From any thread (the backing sweep's)."""
        with self._lock, contextlib.suppress(OSError):
            send(self.conn, msg)

    def statistics(self) -> dict:
        """The supervisor's part of ``.kvfs/stats``."""
        return {"pid": self.reply.get("supervisor"), "epoch": self.epoch,
                "restarts": len(self.history), "history": self.history[-HISTORY:]}


def attach(sock_path: str, options: list[str]) -> Attachment:
    """Ask the supervisor at ``sock_path`` for the session (it mounts on the first ask, with
    ``options``); OSError or RuntimeError (the refusal's reason) when it will not."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    conn.settimeout(120)
    conn.connect(sock_path)
    send(conn, {"op": "attach", "options": sorted(options)})
    fds: list[int] = []
    reply = recv_line(conn, bytearray(), fds)
    conn.settimeout(None)
    if reply is None or not reply.get("ok"):
        for fd in fds:
            os.close(fd)
        conn.close()
        raise RuntimeError((reply or {}).get("why") or "the supervisor closed the connection")
    if len(fds) != 1:
        raise RuntimeError("the supervisor sent no session descriptor")
    return Attachment(conn, fds[0], reply)
