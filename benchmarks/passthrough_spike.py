"""A minimal FUSE server of our own that speaks the kernel protocol directly (issue 30's spike).

    python benchmarks/passthrough_spike.py MOUNTPOINT BACKING_DIR [--no-passthrough]
           [--per-inode] [--noflush] [--drop-sys-admin] [--uring] ... (see --help)

It opens ``/dev/fuse`` itself, mounts with mount(2), answers INIT asking for protocol 7.40+
with ``FUSE_INIT_EXT`` and ``FUSE_PASSTHROUGH`` (``max_stack_depth`` 1), and serves a flat,
read-only directory: the regular files of BACKING_DIR (a tmpfs directory), looked up by name
at each LOOKUP. On OPEN it registers the backing file with ``FUSE_DEV_IOC_BACKING_OPEN`` and
answers ``FOPEN_PASSTHROUGH`` with the backing id (read, splice and mmap then go to the
backing file in the kernel, without a request); the id is closed with
``FUSE_DEV_IOC_BACKING_CLOSE`` at RELEASE. With ``--no-passthrough`` (or when the kernel
refuses it) OPEN answers ``FOPEN_KEEP_CACHE`` and READ is served from Python: ``preadv`` of the
backing file into a page-aligned buffer, one ``writev`` back.

A hidden file ``.spike`` (direct I/O, never cached) answers JSON: the requests counted per
opcode, what INIT negotiated, the backing registrations, and any error of the last backing
open. Written from ``include/uapi/linux/fuse.h`` (kernel 6.18); a measurement tool, not kvfs.
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import errno
import fcntl
import json
import mmap
import os
import stat
import struct
import sys
import threading
import time
from collections import Counter

# -- the protocol (include/uapi/linux/fuse.h) -----------------------------------------------
LOOKUP, FORGET, GETATTR, OPEN, READ, WRITE, STATFS = 1, 2, 3, 14, 15, 16, 17
RELEASE, FLUSH, INIT = 18, 25, 26
OPENDIR, READDIR, RELEASEDIR, ACCESS, INTERRUPT, DESTROY, BATCH_FORGET = 27, 28, 29, 34, 36, 38, 42
GETXATTR, LISTXATTR, READDIRPLUS, LSEEK, STATX = 22, 23, 44, 46, 52
OPNAMES = {LOOKUP: "lookup", FORGET: "forget", GETATTR: "getattr", OPEN: "open", READ: "read",
           WRITE: "write",
           STATFS: "statfs", RELEASE: "release", FLUSH: "flush", INIT: "init", OPENDIR: "opendir",
           READDIR: "readdir", RELEASEDIR: "releasedir", ACCESS: "access", INTERRUPT: "interrupt",
           DESTROY: "destroy", BATCH_FORGET: "batch_forget", GETXATTR: "getxattr",
           LISTXATTR: "listxattr", READDIRPLUS: "readdirplus", LSEEK: "lseek", STATX: "statx"}
NO_REPLY = {FORGET, BATCH_FORGET, INTERRUPT}

ASYNC_READ, BIG_WRITES, PARALLEL_DIROPS = 1 << 0, 1 << 5, 1 << 18
MAX_PAGES, INIT_EXT = 1 << 22, 1 << 30
PASSTHROUGH, OVER_IO_URING = 1 << 37, 1 << 41          # flags2 = bits 32..63
FOPEN_DIRECT_IO, FOPEN_KEEP_CACHE, FOPEN_NOFLUSH, FOPEN_PASSTHROUGH = 1 << 0, 1 << 1, 1 << 5, 1 << 7

IN_HEADER = struct.Struct("<IIQQIIIHH")                  # len opcode unique nodeid uid gid pid extlen pad
OUT_HEADER = struct.Struct("<IiQ")                       # len error unique
INIT_IN = struct.Struct("<IIIII")                        # major minor max_readahead flags flags2
INIT_OUT = struct.Struct("<IIIIHHIIHHIIH22x")            # ... flags2 max_stack_depth request_timeout
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")                # fuse_attr: 88 bytes
ENTRY_OUT = struct.Struct("<QQQQII")                     # nodeid generation entry_valid attr_valid ns ns
ATTR_OUT = struct.Struct("<QII")                         # attr_valid attr_valid_nsec dummy
OPEN_IN = struct.Struct("<II")
OPEN_OUT = struct.Struct("<QIi")                         # fh open_flags backing_id
READ_IN = struct.Struct("<QQII")                         # fh offset size read_flags
RELEASE_IN = struct.Struct("<QII")
WRITE_IN = struct.Struct("<QQIIQII")                     # fh offset size write_flags lock_owner ...
WRITE_OUT = struct.Struct("<II")
STATFS_OUT = struct.Struct("<QQQQQIIII24x")
DIRENT = struct.Struct("<QQII")
BACKING_MAP = struct.Struct("<iIQ")                      # fd flags padding


def _iow(nr: int, size: int) -> int:
    return (1 << 30) | (size << 16) | (229 << 8) | nr


BACKING_OPEN, BACKING_CLOSE = _iow(1, BACKING_MAP.size), _iow(2, 4)
ROOT, STATS_INO, STATS_NAME = 1, 2, ".spike"
TTL = 60                                                 # entry and attribute timeouts, seconds
MAX_WRITE = 1 << 20
BUFSIZE = MAX_WRITE + 8192
LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def mount_fuse(fd: int, mountpoint: str, extra: str = "") -> None:
    """mount(2) a fuse filesystem served by ``fd`` at ``mountpoint`` (needs CAP_SYS_ADMIN)."""
    data = f"fd={fd},rootmode=40000,user_id=0,group_id=0,allow_other{extra}".encode()
    flags = 0x2 | 0x4                                    # MS_NOSUID | MS_NODEV
    if LIBC.mount(b"kvfs-spike", mountpoint.encode(), b"fuse.kvfs-spike", flags, data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount: {os.strerror(err)}")


def drop_sys_admin() -> None:
    """Remove CAP_SYS_ADMIN (21) from this thread's effective and permitted sets (capset(2))."""
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)        # _LINUX_CAPABILITY_VERSION_3, this thread
    data = (ctypes.c_uint32 * 6)()
    if LIBC.capget(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    data[0] &= ~(1 << 21)                                # effective (low word)
    data[1] &= ~(1 << 21)                                # permitted
    if LIBC.capset(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


class Spike:
    """The filesystem: inode numbers by name, one backing fd per open file."""

    def __init__(self, dev: int, backing: str, passthrough: bool, uring: bool,
                 close_early: bool = False, per_inode: bool = False):
        self.dev, self.backing, self.close_early = dev, backing, close_early
        self.per_inode = per_inode                       # one backing id per inode, closed at FORGET
        self.backing_by_ino: dict[int, int] = {}
        self.file_mode = 0o444
        self.noflush = 0                                 # FOPEN_NOFLUSH: close sends no FLUSH
        self.ioctl_anyway = False                        # register even if not negotiated
        self.writable = False                            # allow write opens of existing files
        self.want_passthrough, self.want_uring = passthrough, uring
        self.counts: Counter = Counter()
        self.ino_by_name: dict[str, int] = {STATS_NAME: STATS_INO}
        self.name_by_ino: dict[int, str] = {STATS_INO: STATS_NAME}
        self.files: dict[int, tuple[int, int]] = {}      # fh -> (backing fd, backing id or -1)
        self.next_fh = 1
        self.lock = threading.Lock()
        self.info: dict = {"backing_opens": 0, "backing_closes": 0, "backing_error": None,
                           "passthrough_opens": 0, "data_releases": 0, "backing_open_us": 0.0,
                           "backing_close_us": 0.0}
        self.done = threading.Event()

    # -- replies --
    def reply(self, unique: int, *parts: bytes, error: int = 0) -> None:
        size = OUT_HEADER.size + sum(len(p) for p in parts)
        try:
            os.writev(self.dev, [OUT_HEADER.pack(size, -error, unique), *parts])
        except OSError as e:                             # ENOENT: the request was interrupted
            if e.errno not in (errno.ENOENT, errno.ENODEV):
                raise

    def attr(self, ino: int) -> bytes:
        if ino == ROOT:
            st = os.stat(self.backing)
            mode, size = stat.S_IFDIR | 0o755, 4096
        elif ino == STATS_INO:
            st, mode, size = os.stat(self.backing), stat.S_IFREG | 0o444, 0
        else:
            st = os.stat(os.path.join(self.backing, self.name_by_ino[ino]))
            mode, size = stat.S_IFREG | self.file_mode, st.st_size
        t = int(st.st_mtime)
        return ATTR.pack(ino, size, (size + 511) // 512, t, t, t, 0, 0, 0, mode, 1, 0, 0, 0, 4096, 0)

    # -- handlers: each returns the reply's parts or raises OSError --
    def do_init(self, body: memoryview) -> list[bytes]:
        major, minor, readahead, flags, flags2 = INIT_IN.unpack_from(body)
        kflags = flags | (flags2 << 32)
        self.info["kernel"] = {"major": major, "minor": minor, "max_readahead": readahead,
                               "passthrough": bool(kflags & PASSTHROUGH),
                               "over_io_uring": bool(kflags & OVER_IO_URING)}
        if major != 7 or minor < 40:
            raise OSError(errno.EPROTO, "kernel protocol older than 7.40")
        want = ASYNC_READ | BIG_WRITES | MAX_PAGES | PARALLEL_DIROPS | INIT_EXT
        if self.want_passthrough:
            want |= PASSTHROUGH
        if self.want_uring:
            want |= OVER_IO_URING
        got = want & kflags
        self.info["negotiated"] = {"minor": minor, "passthrough": bool(got & PASSTHROUGH),
                                   "over_io_uring": bool(got & OVER_IO_URING)}
        print(json.dumps({"init": self.info}), file=sys.stderr, flush=True)
        return [INIT_OUT.pack(7, minor, readahead, got & 0xFFFFFFFF, 16, 12, MAX_WRITE, 1,
                              MAX_WRITE // 4096, 0, got >> 32, 1, 0)]

    def do_lookup(self, parent: int, body: memoryview) -> list[bytes]:
        name = bytes(body).split(b"\0", 1)[0].decode()
        if name == ".close-backings":                    # probe hook: the daemon drops its ids
            for node in list(self.backing_by_ino):
                self.backing_close(self.backing_by_ino.pop(node))
            raise OSError(errno.ENOENT, name)
        if parent != ROOT or "/" in name:
            raise OSError(errno.ENOENT, name)
        if name != STATS_NAME and not os.path.isfile(os.path.join(self.backing, name)):
            raise OSError(errno.ENOENT, name)
        with self.lock:
            ino = self.ino_by_name.get(name)
            if ino is None:
                ino = len(self.name_by_ino) + 2
                self.ino_by_name[name], self.name_by_ino[ino] = ino, name
        return [ENTRY_OUT.pack(ino, 0, TTL, TTL, 0, 0), self.attr(ino)]

    def do_open(self, ino: int, body: memoryview) -> list[bytes]:
        flags, _ = OPEN_IN.unpack_from(body)
        access = flags & os.O_ACCMODE
        if access != os.O_RDONLY and not self.writable:
            raise OSError(errno.EROFS, "read-only")
        per_inode = self.per_inode and access == os.O_RDONLY
        with self.lock:
            fh, self.next_fh = self.next_fh, self.next_fh + 1
        if ino == STATS_INO:
            self.files[fh] = (-1, -1)
            return [OPEN_OUT.pack(fh, FOPEN_DIRECT_IO | self.noflush, 0)]
        if per_inode and ino in self.backing_by_ino:
            self.files[fh] = (-2, -1)
            self.info["passthrough_opens"] += 1
            return [OPEN_OUT.pack(fh, FOPEN_PASSTHROUGH | self.noflush, self.backing_by_ino[ino])]
        fd = os.open(os.path.join(self.backing, self.name_by_ino[ino]), access | os.O_CLOEXEC)
        backing_id, open_flags = -1, FOPEN_KEEP_CACHE | self.noflush
        if self.info.get("negotiated", {}).get("passthrough") or self.ioctl_anyway:
            try:
                backing_id = self.backing_open(fd)
                self.info["passthrough_opens"] += 1
                open_flags = FOPEN_PASSTHROUGH | self.noflush
                if self.close_early or per_inode:        # the kernel holds the file by the id
                    os.close(fd)
                    fd = -2
                if per_inode:
                    self.backing_by_ino[ino] = backing_id
                    self.files[fh] = (fd, -1)
                    return [OPEN_OUT.pack(fh, open_flags, backing_id)]
            except OSError as e:
                self.info["backing_error"] = f"{errno.errorcode.get(e.errno, e.errno)}: {e.strerror}"
        self.files[fh] = (fd, backing_id)
        return [OPEN_OUT.pack(fh, open_flags, max(backing_id, 0))]

    def backing_open(self, fd: int) -> int:
        t0 = time.perf_counter()
        backing_id = fcntl.ioctl(self.dev, BACKING_OPEN, bytearray(BACKING_MAP.pack(fd, 0, 0)))
        self.info["backing_open_us"] += (time.perf_counter() - t0) * 1e6
        self.info["backing_opens"] += 1
        return backing_id

    def backing_close(self, backing_id: int) -> None:
        t0 = time.perf_counter()
        fcntl.ioctl(self.dev, BACKING_CLOSE, bytearray(struct.pack("<I", backing_id)))
        self.info["backing_close_us"] += (time.perf_counter() - t0) * 1e6
        self.info["backing_closes"] += 1

    def forget(self, opcode: int, nodeid: int, body: memoryview) -> None:
        """FORGET / BATCH_FORGET: the kernel dropped an inode; close its backing id."""
        nodes = [nodeid] if opcode == FORGET else \
            [struct.unpack_from("<Q", body, 8 + 16 * i)[0] for i in range(struct.unpack_from("<I", body)[0])]
        for node in nodes:
            backing_id = self.backing_by_ino.pop(node, None)
            if backing_id is not None:
                self.backing_close(backing_id)

    def do_read(self, body: memoryview, buf: mmap.mmap) -> list:
        fh, offset, size, _ = READ_IN.unpack_from(body)
        fd, _ = self.files[fh]
        if fd == -2:
            raise OSError(errno.EIO, "READ reached the daemon of a passthrough file")
        if fd == -1:
            data = json.dumps(self.stats()).encode()
            return [data[offset:offset + size]]
        view = memoryview(buf)[:size]
        n = os.preadv(fd, [view], offset)
        return [view[:n]]

    def do_release(self, body: memoryview) -> list[bytes]:
        fh = RELEASE_IN.unpack_from(body)[0]
        fd, backing_id = self.files.pop(fh)
        if fd != -1:                                     # not the stats file
            self.info["data_releases"] += 1
        if backing_id >= 0:
            self.backing_close(backing_id)
        if fd >= 0:
            os.close(fd)
        return []

    def do_readdir(self, body: memoryview) -> list[bytes]:
        _, offset, size, _ = READ_IN.unpack_from(body)
        names = [(ROOT, "."), (ROOT, "..")] + [(0, n) for n in sorted(os.listdir(self.backing))]
        out = bytearray()
        for i, (ino, name) in enumerate(names[offset:], start=offset + 1):
            raw = name.encode()
            rec = DIRENT.pack(ino or 0xFFFFFFFF, i, len(raw), 8 if ino != ROOT else 4) + raw
            rec += b"\0" * (-len(rec) % 8)
            if len(out) + len(rec) > size:
                break
            out += rec
        return [bytes(out)]

    def stats(self) -> dict:
        return {"requests": {OPNAMES.get(k, str(k)): v for k, v in sorted(self.counts.items())},
                **self.info}

    def handle(self, req: memoryview, buf: mmap.mmap) -> None:
        _, opcode, unique, nodeid, *_ = IN_HEADER.unpack_from(req)
        body = req[IN_HEADER.size:]
        self.counts[opcode] += 1
        if opcode in NO_REPLY:
            if opcode in (FORGET, BATCH_FORGET):
                self.forget(opcode, nodeid, body)
            return
        try:
            if opcode == INIT:
                parts = self.do_init(body)
            elif opcode == LOOKUP:
                parts = self.do_lookup(nodeid, body)
            elif opcode == GETATTR:
                parts = [ATTR_OUT.pack(TTL, 0, 0), self.attr(nodeid)]
            elif opcode in (OPEN, OPENDIR):
                parts = self.do_open(nodeid, body) if opcode == OPEN else [OPEN_OUT.pack(0, 0, 0)]
            elif opcode == READ:
                parts = self.do_read(body, buf)
            elif opcode == WRITE:
                fh, offset, size, *_ = WRITE_IN.unpack_from(body)
                n = os.pwrite(self.files[fh][0], body[WRITE_IN.size:WRITE_IN.size + size], offset)
                parts = [WRITE_OUT.pack(n, 0)]
            elif opcode == RELEASE:
                parts = self.do_release(body)
            elif opcode in (FLUSH, RELEASEDIR):
                parts = []
            elif opcode == READDIR:
                parts = self.do_readdir(body)
            elif opcode == STATFS:
                parts = [STATFS_OUT.pack(1 << 20, 1 << 19, 1 << 19, 1 << 20, 1 << 19, 4096, 255, 4096, 0)]
            elif opcode == DESTROY:
                self.done.set()
                parts = []
            else:
                raise OSError(errno.ENOSYS, OPNAMES.get(opcode, str(opcode)))
        except OSError as e:
            self.reply(unique, error=e.errno or errno.EIO)
            return
        except Exception as e:                           # a bug here must not wedge the kernel
            print(f"{OPNAMES.get(opcode, opcode)}: {type(e).__name__}: {e}", file=sys.stderr)
            self.reply(unique, error=errno.EIO)
            return
        self.reply(unique, *parts)

    def serve(self) -> None:
        """One worker: read a request, answer it, until the connection goes away."""
        buf = mmap.mmap(-1, BUFSIZE)
        req = mmap.mmap(-1, BUFSIZE)
        view = memoryview(req)
        while not self.done.is_set():
            try:
                n = os.readv(self.dev, [view])
            except OSError as e:
                if e.errno in (errno.EINTR, errno.EAGAIN, errno.ENOENT):
                    continue
                if e.errno == errno.ENODEV:              # unmounted
                    self.done.set()
                    return
                raise
            self.handle(view[:n], buf)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mountpoint")
    ap.add_argument("backing")
    ap.add_argument("--no-passthrough", action="store_true")
    ap.add_argument("--uring", action="store_true", help="also ask for FUSE_OVER_IO_URING")
    ap.add_argument("--drop-sys-admin", action="store_true",
                    help="drop CAP_SYS_ADMIN after mount(2), before serving")
    ap.add_argument("--close-early", action="store_true",
                    help="close the daemon's backing fd right after registering it")
    ap.add_argument("--per-inode", action="store_true",
                    help="register one backing per inode at its first open, close it at FORGET")
    ap.add_argument("--ioctl-anyway", action="store_true",
                    help="try FUSE_DEV_IOC_BACKING_OPEN even when passthrough was not negotiated")
    ap.add_argument("--writable", action="store_true",
                    help="allow write opens of existing files (files 0644; no create/truncate)")
    ap.add_argument("--noflush", action="store_true", help="answer OPEN with FOPEN_NOFLUSH")
    ap.add_argument("--private", action="store_true",
                    help="files 0400 and the default_permissions mount option (the kernel checks)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    dev = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    mount_fuse(dev, args.mountpoint, ",default_permissions" if args.private else "")
    if args.drop_sys_admin:
        drop_sys_admin()                                 # new threads inherit this thread's creds
    spike = Spike(dev, os.path.abspath(args.backing), not args.no_passthrough, args.uring,
                  args.close_early, args.per_inode)
    if args.private:
        spike.file_mode = 0o400
    if args.noflush:
        spike.noflush = FOPEN_NOFLUSH
    spike.ioctl_anyway = args.ioctl_anyway
    if args.writable:
        spike.writable, spike.file_mode = True, 0o644
    workers = [threading.Thread(target=spike.serve, daemon=True) for _ in range(args.threads)]
    for w in workers:
        w.start()
    print("mounted", args.mountpoint, flush=True)
    spike.done.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
