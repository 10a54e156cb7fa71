"""The kernel transport's dispatch (kvfs/fs/session.py reads the requests): each FUSE request
goes, by opcode, to its concern's decoder (kvfs/fs/decoders.py), which makes the call pyfuse3
would make on the handlers (:class:`kvfs.fs.ops.KvfsOperations`); the answer goes back here.
"""
from __future__ import annotations

import errno
import logging
import os
import stat
import time

import pyfuse3

from kvfs.fs import wire
from kvfs.fs.decoders import DirDecoder, EntryDecoder, Epoch, FileDecoder, SessionDecoder, XattrDecoder
from kvfs.fs.passthrough import Passthrough

log = logging.getLogger(__name__)


# KVFS_TRACE_REQUESTS=FILE: one line per answered request appended to FILE (a debugging aid for
# races between processes, docs/testing.md): monotonic time, unique, opcode, node, caller pid,
# errno, and what the answer said (an open's flags and backing id, a size, a read's length)
_TRACE = None


def _open_trace() -> None:
    global _TRACE
    path = os.environ.get("KVFS_TRACE_REQUESTS")
    if not path or _TRACE is not None:
        return
    try:
        _TRACE = open(path, "a", buffering=1)
    except OSError as e:
        log.error("KVFS_TRACE_REQUESTS=%s: %s; no request trace", path, e.strerror)
    else:
        log.warning("tracing every request to %s (KVFS_TRACE_REQUESTS)", path)


def _trace(opcode: int, unique: int, nodeid: int, pid: int, body, parts, err: int) -> None:
    extra = ""
    try:
        if opcode in (wire.READ, wire.WRITE):
            fh, off, size = wire.READ_IN.unpack_from(body)[:3]
            if not parts:
                done = 0
            elif opcode == wire.READ:
                done = sum(len(p) for p in parts)
            else:
                done = wire.WRITE_OUT.unpack_from(parts[-1])[0]
            extra = f"fh={fh} off={off} size={size} done={done}"
        elif opcode in (wire.OPEN, wire.CREATE) and parts:
            fh, flags, backing = wire.OPEN_OUT.unpack_from(parts[-1])
            extra = f"fh={fh} open_flags={flags:#x} backing={backing} flags={wire.OPEN_IN.unpack_from(body)[0]:#o}"
        elif opcode in (wire.GETATTR, wire.SETATTR) and parts:
            extra = f"size={wire.ATTR.unpack_from(b''.join(bytes(p) for p in parts), wire.ATTR_OUT.size)[1]}"
            if opcode == wire.SETATTR:
                valid, _, fh, size = wire.SETATTR_IN.unpack_from(body)[:4]
                extra += f" valid={valid:#x} fh={fh} set_size={size}"
        elif opcode == wire.LOOKUP and parts:
            entry = wire.ENTRY_ATTR.unpack_from(b"".join(bytes(p) for p in parts))
            extra = f"ino={entry[0]} size={entry[7]}"
        elif opcode in (wire.RELEASE, wire.FLUSH):
            extra = f"fh={wire.RELEASE_IN.unpack_from(body)[0]}"
    except Exception as e:      # noqa: BLE001 - a trace line must never fail the request
        extra = f"(undecoded: {e})"
    _TRACE.write(f"{time.monotonic():.6f} {unique} {wire.NAMES.get(opcode, opcode)} node={nodeid} "
                 f"pid={pid} err={err} {extra}\n")


class Context:
    """The caller of a request (``pyfuse3.RequestContext``'s fields)."""

    __slots__ = ("uid", "gid", "pid", "umask")

    def __init__(self, uid: int, gid: int, pid: int, umask: int = 0):
        self.uid, self.gid, self.pid, self.umask = uid, gid, pid, umask


UNIQUE_RESEND = 1 << 63     # set by the kernel on a request it sends again (FUSE_NOTIFY_RESEND)

# answers of more pieces than this are joined into one before writev (IOV_MAX is 1024)
REPLY_PARTS = 256
# an answer of one piece up to this size is copied behind its header and written with write(2)
# (cheaper than building writev's vector); larger ones (READ's data) are never copied
SMALL_REPLY = 4096
perf_ns = time.perf_counter_ns
_unpack_header = wire.IN_HEADER.unpack_from
_HEADER_SIZE = wire.IN_HEADER.size
_pack_out = wire.OUT_HEADER.pack
_OUT_SIZE = wire.OUT_HEADER.size


def _refused(e: OSError) -> int:
    """The errno of an answer the kernel refused (logged unless the request was interrupted,
    ENOENT, or the mount is gone, ENODEV)."""
    if e.errno not in (errno.ENOENT, errno.ENODEV):
        log.error("reply to the kernel failed: %s", e)
    return e.errno


class Handlers:
    """Decode (by the concern's decoder), call, encode; one instance per session."""

    def __init__(self, ops, fd: int, want_passthrough: bool, want_writeback: bool = False, epoch: int = 0):
        self.ops = ops
        self.fd = fd
        self.epoch = epoch
        self.handles = handles = Epoch(epoch)
        self.first_answer: float | None = None     # time.monotonic() of the first answer
        self.on_first_answer = None     # called with it (a daemon that replaced a dead one)
        self.passthrough = passthrough = Passthrough(fd, want_passthrough)
        ops.opens.passthrough = passthrough
        self.session = SessionDecoder(passthrough, want_writeback, ops)
        self.entries = EntryDecoder(ops, handles)
        self.files = FileDecoder(ops, passthrough, handles)
        self.dirs = DirDecoder(ops)
        self.xattrs = XattrDecoder(ops)
        self.counts: dict[int, int] = {}
        self.ns: dict[int, int] = {}        # opcode -> nanoseconds its handlers took, replies included
        s, e, f, d, x = self.session, self.entries, self.files, self.dirs, self.xattrs
        self._table = {
            wire.INIT: s.init, wire.DESTROY: s.destroy,
            wire.LOOKUP: e.lookup, wire.GETATTR: e.getattr, wire.SETATTR: e.setattr,
            wire.READLINK: e.readlink, wire.SYMLINK: e.symlink, wire.MKNOD: e.mknod,
            wire.MKDIR: e.mkdir, wire.UNLINK: e.unlink, wire.RMDIR: e.rmdir,
            wire.RENAME: e.rename, wire.RENAME2: e.rename2, wire.LINK: e.link,
            wire.OPEN: f.open, wire.CREATE: f.create, wire.READ: f.read, wire.WRITE: f.write,
            wire.FLUSH: f.flush, wire.RELEASE: f.release, wire.FSYNC: f.fsync,
            wire.OPENDIR: d.opendir, wire.READDIR: d.readdir, wire.READDIRPLUS: d.readdirplus,
            wire.RELEASEDIR: d.releasedir, wire.FSYNCDIR: d.fsyncdir, wire.ACCESS: d.access,
            wire.SETXATTR: x.setxattr, wire.GETXATTR: x.getxattr, wire.LISTXATTR: x.listxattr,
            wire.REMOVEXATTR: x.removexattr, wire.STATFS: x.statfs,
        }
        self._forget = e.forget
        _open_trace()

    @property
    def minor(self) -> int:
        """The protocol's minor version INIT agreed on (0 before)."""
        return self.session.minor

    def close(self, handover: bool = False) -> None:
        self.passthrough.close(keep_in_use=handover)

    def requests(self) -> dict[str, int]:
        """Requests that reached the daemon, by opcode name."""
        return {wire.NAMES.get(k, str(k)): v for k, v in sorted(self.counts.items())}

    def request_us(self) -> dict[str, float]:
        """Mean microseconds from reading a request to its reply (waits included), by opcode name."""
        return {wire.NAMES.get(k, str(k)): round(v / 1e3 / self.counts[k], 1)
                for k, v in sorted(self.ns.items()) if self.counts.get(k)}

    # ---- dispatch -------------------------------------------------------------------------
    async def handle(self, req: memoryview) -> None:
        """One request, read whole into ``req``: decoded, run and answered. One frame for the
        dispatch, the errors and the answer (this runs for every request that reaches us)."""
        t0 = perf_ns()
        _, opcode, unique, nodeid, uid, gid, pid, _, _ = _unpack_header(req)
        counts = self.counts
        counts[opcode] = counts.get(opcode, 0) + 1
        try:
            fn = self._table.get(opcode)
            if fn is None:
                if opcode in wire.NO_REPLY:
                    if opcode != wire.INTERRUPT:
                        await self._forget(opcode, nodeid, req[_HEADER_SIZE:])
                else:
                    self.reply_error(unique, errno.ENOSYS)
                return
            try:
                parts = await fn(nodeid, req[_HEADER_SIZE:], Context(uid, gid, pid))
            except pyfuse3.FUSEError as e:
                if unique & UNIQUE_RESEND:
                    parts = await self._done_before(opcode, nodeid, req[_HEADER_SIZE:], e.errno, Context(uid, gid, pid))
                    if parts is not None:
                        self.reply(unique, parts)
                        return
                if _TRACE is not None:
                    _trace(opcode, unique, nodeid, pid, req[_HEADER_SIZE:], None, e.errno)
                self.reply_error(unique, e.errno)
                return
            except Exception:            # noqa: BLE001 - a handler's bug must not wedge the caller
                log.exception("%s failed", wire.NAMES.get(opcode, opcode))
                if _TRACE is not None:
                    _trace(opcode, unique, nodeid, pid, req[_HEADER_SIZE:], None, errno.EIO)
                self.reply_error(unique, errno.EIO)
                return
            if _TRACE is not None:
                _trace(opcode, unique, nodeid, pid, req[_HEADER_SIZE:], parts, 0)
            if not self.reply(unique, parts) and (opcode == wire.OPEN or opcode == wire.CREATE):
                # the opener was interrupted: no RELEASE will come for this handle
                fh = self.handles.released(wire.OPEN_OUT.unpack_from(parts[-1])[0])
                if fh is not None:
                    try:
                        await self.ops.release(fh)
                    finally:
                        self.passthrough.release(fh)
        finally:
            ns = self.ns
            ns[opcode] = ns.get(opcode, 0) + perf_ns() - t0

    async def _done_before(self, opcode: int, nodeid: int, body, err: int, ctx) -> list | None:
        """The answer to a request the kernel sent again (FUSE_NOTIFY_RESEND: its daemon died
        after reading it) whose failure says a dead daemon already did it, the commit having
        happened before the kill: a directory made (EEXIST: its entry), a name removed
        (ENOENT: done), a rename whose source is gone and whose target is there (done).
        None: the error stands."""
        try:
            if opcode == wire.MKDIR and err == errno.EEXIST:
                name, = wire.names_in(body[wire.MKDIR_IN.size:], 1)
                attr = await self.ops.lookup(nodeid, name, ctx)
                return [wire.entry_bytes(attr)] if attr.st_ino and stat.S_ISDIR(attr.st_mode) else None
            if opcode in (wire.UNLINK, wire.RMDIR) and err == errno.ENOENT:
                return []
            if opcode in (wire.RENAME, wire.RENAME2) and err == errno.ENOENT:
                size = wire.RENAME_IN.size if opcode == wire.RENAME else wire.RENAME2_IN.size
                newdir = wire.RENAME_IN.unpack_from(body)[0]
                _, new = wire.names_in(body[size:], 2)
                attr = await self.ops.lookup(newdir, new, ctx)
                return [] if attr.st_ino else None
        except (pyfuse3.FUSEError, ValueError):
            return None
        return None

    def _first(self) -> None:
        self.first_answer = time.monotonic()
        if self.on_first_answer is not None:
            try:
                self.on_first_answer(self.first_answer)
            except Exception:       # noqa: BLE001 - a note must never fail the answer
                log.exception("first answer's note failed")

    def reply(self, unique: int, parts: list) -> bool:
        if self.first_answer is None:
            self._first()
        if len(parts) == 1 and len(parts[0]) <= SMALL_REPLY:
            # one short piece (attributes, an entry, an open's answer): one buffer, one write
            part = parts[0]
            err = self._write(_pack_out(_OUT_SIZE + len(part), 0, unique) + part)
        else:
            size = _OUT_SIZE + sum(len(p) for p in parts)
            if len(parts) >= REPLY_PARTS:    # writev takes at most IOV_MAX (1024) pieces
                parts = [b"".join(parts)]
            err = self._send([_pack_out(size, 0, unique), *parts])
        if err not in (0, errno.ENOENT, errno.ENODEV):
            # the kernel refused the answer (a bug of ours): an error, or the caller waits forever
            self.reply_error(unique, errno.EIO)
        return err == 0

    def reply_error(self, unique: int, err: int) -> None:
        if self.first_answer is None:
            self._first()
        self._write(_pack_out(_OUT_SIZE, -(err or errno.EIO), unique))

    def _write(self, data: bytes) -> int:
        """:meth:`_send` of one buffer."""
        try:
            os.write(self.fd, data)
        except OSError as e:
            return _refused(e)
        return 0

    def _send(self, parts: list) -> int:
        """Write one answer; 0 or the errno (ENOENT: the request was interrupted; ENODEV:
        unmounted; anything else is logged)."""
        try:
            os.writev(self.fd, parts)
        except OSError as e:
            return _refused(e)
        return 0

    def notify(self, msg: bytes) -> None:
        """A notification written on the session's own device (when no helper holds a clone)."""
        os.write(self.fd, msg)
