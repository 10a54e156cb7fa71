"""floorfs: the smallest in-memory pyfuse3 + trio filesystem, the floor of a Python FUSE daemon.

    python benchmarks/floorfs.py MOUNTPOINT [--entry-timeout S] [--attr-timeout S]
                                 [--negative-timeout S] [--default-permissions]

Every handler is a dict lookup and returns at once: what a request costs here is the kernel
round trip plus pyfuse3 and trio, nothing else. The runtime-pattern benchmark
(benchmarks/runtime_patterns.py) mounts it with kvfs's settings (timeouts, mount options,
1 MiB read-ahead, ``keep_cache``) so a ratio to it is what kvfs's own handlers cost.
File data lives in a bytearray per inode; reads answer a memoryview of it (no copy).
Serves until unmounted (``fusermount3 -u``) or SIGTERM.
"""
from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import stat
import time

import pyfuse3
import trio

log = logging.getLogger("floorfs")
ROOT = pyfuse3.ROOT_INODE


class Node:
    __slots__ = ("ino", "mode", "data", "mtime", "ctime", "nlink", "entries", "parent")

    def __init__(self, ino: int, mode: int, parent: int):
        self.ino, self.mode, self.parent = ino, mode, parent
        self.data = bytearray()
        self.mtime = self.ctime = time.time_ns()
        self.nlink = 2 if stat.S_ISDIR(mode) else 1
        self.entries: dict[bytes, int] | None = {} if stat.S_ISDIR(mode) else None


def _fail(code: int):
    raise pyfuse3.FUSEError(code)


class FloorFS(pyfuse3.Operations):
    enable_writeback_cache = False

    def __init__(self, entry_timeout: float, attr_timeout: float, negative_timeout: float):
        super().__init__()
        self.et, self.at, self.nt = entry_timeout, attr_timeout, negative_timeout
        self.nodes = {ROOT: Node(ROOT, stat.S_IFDIR | 0o755, ROOT)}
        self.next_ino = ROOT + 1
        self.uid, self.gid = os.getuid(), os.getgid()

    def _attr(self, n: Node) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino, a.generation = n.ino, 0
        a.entry_timeout, a.attr_timeout = self.et, self.at
        a.st_mode, a.st_nlink, a.st_uid, a.st_gid = n.mode, n.nlink, self.uid, self.gid
        a.st_size = len(n.data)
        a.st_blksize, a.st_blocks = 1 << 20, (len(n.data) + 511) // 512
        a.st_atime_ns = a.st_mtime_ns = n.mtime
        a.st_ctime_ns = n.ctime
        return a

    def _dir(self, ino: int) -> Node:
        n = self.nodes.get(ino)
        if n is None or n.entries is None:
            _fail(errno.ENOTDIR)
        return n

    def _new(self, parent: int, name: bytes, mode: int) -> Node:
        d = self._dir(parent)
        if name in d.entries:
            _fail(errno.EEXIST)
        n = Node(self.next_ino, mode, parent)
        self.next_ino += 1
        self.nodes[n.ino] = n
        d.entries[name] = n.ino
        d.mtime = d.ctime = time.time_ns()
        if n.entries is not None:
            d.nlink += 1
        return n

    async def lookup(self, parent_inode, name, ctx=None):
        d = self._dir(parent_inode)
        ino = parent_inode if name == b"." else d.parent if name == b".." else d.entries.get(name)
        if ino is None:
            if self.nt <= 0:
                _fail(errno.ENOENT)
            a = pyfuse3.EntryAttributes()     # st_ino 0: the kernel caches the miss
            a.st_ino, a.entry_timeout = 0, self.nt
            return a
        return self._attr(self.nodes[ino])

    async def getattr(self, inode, ctx=None):
        return self._attr(self.nodes[inode])

    async def setattr(self, inode, attr, fields, fh, ctx):
        n = self.nodes[inode]
        if fields.update_size:
            del n.data[attr.st_size:]
            n.data.extend(bytes(attr.st_size - len(n.data)))
        if fields.update_mode:
            n.mode = stat.S_IFMT(n.mode) | (attr.st_mode & 0o7777)
        if fields.update_mtime:
            n.mtime = attr.st_mtime_ns
        n.ctime = time.time_ns()
        return self._attr(n)

    async def forget(self, inode_list):
        pass

    async def getxattr(self, inode, name, ctx):
        _fail(errno.ENODATA)     # kvfs has xattrs, so the kernel keeps asking both

    async def access(self, inode, mode, ctx):
        raise pyfuse3.FUSEError(errno.ENOSYS)    # as kvfs: the kernel stops asking, allows

    async def mkdir(self, parent_inode, name, mode, ctx):
        return self._attr(self._new(parent_inode, name, stat.S_IFDIR | (mode & 0o7777)))

    async def create(self, parent_inode, name, mode, flags, ctx):
        n = self._new(parent_inode, name, stat.S_IFREG | (mode & 0o7777))
        return pyfuse3.FileInfo(fh=n.ino, keep_cache=True), self._attr(n)

    async def open(self, inode, flags, ctx):
        n = self.nodes[inode]
        if flags & os.O_TRUNC:
            n.data = bytearray()
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    async def read(self, fh, off, size):
        return memoryview(self.nodes[fh].data)[off:off + size]

    async def write(self, fh, off, buf):
        n = self.nodes[fh]
        end = off + len(buf)
        if end > len(n.data):
            try:
                n.data.extend(bytes(end - len(n.data)))
            except BufferError:              # a read's view still exported: grow a copy
                n.data = n.data + bytes(end - len(n.data))
        n.data[off:end] = buf
        n.mtime = time.time_ns()
        return len(buf)

    no_flush = False        # --no-flush: ENOSYS, and the kernel sends no FLUSH again (close(2) is free)

    async def flush(self, fh):
        if self.no_flush:
            raise pyfuse3.FUSEError(errno.ENOSYS)

    async def fsync(self, fh, datasync):
        pass

    async def release(self, fh):
        pass

    def _remove(self, parent: int, name: bytes, want_dir: bool) -> None:
        d = self._dir(parent)
        ino = d.entries.get(name)
        if ino is None:
            _fail(errno.ENOENT)
        n = self.nodes[ino]
        if want_dir != (n.entries is not None):
            _fail(errno.EISDIR if n.entries is not None else errno.ENOTDIR)
        if n.entries:
            _fail(errno.ENOTEMPTY)
        del d.entries[name]
        del self.nodes[ino]
        if want_dir:
            d.nlink -= 1
        d.mtime = d.ctime = time.time_ns()

    async def unlink(self, parent_inode, name, ctx):
        self._remove(parent_inode, name, False)

    async def rmdir(self, parent_inode, name, ctx):
        self._remove(parent_inode, name, True)

    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        src, dst = self._dir(parent_inode_old), self._dir(parent_inode_new)
        ino = src.entries.get(name_old)
        if ino is None:
            _fail(errno.ENOENT)
        old = dst.entries.get(name_new)
        if old is not None:
            if flags & pyfuse3.RENAME_NOREPLACE:
                _fail(errno.EEXIST)
            if self.nodes[old].entries:
                _fail(errno.ENOTEMPTY)
            del self.nodes[old]
        del src.entries[name_old]
        dst.entries[name_new] = ino
        self.nodes[ino].parent = parent_inode_new
        src.mtime = dst.mtime = time.time_ns()

    async def opendir(self, inode, ctx):
        self._dir(inode)
        return inode

    async def readdir(self, fh, start_id, token):
        items = list(self.nodes[fh].entries.items())
        for i in range(start_id, len(items)):
            name, ino = items[i]
            if not pyfuse3.readdir_reply(token, name, self._attr(self.nodes[ino]), i + 1):
                return

    async def releasedir(self, fh):
        pass

    async def statfs(self, ctx):
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = 4096
        s.f_blocks = s.f_bfree = s.f_bavail = 1 << 30
        s.f_files = s.f_ffree = s.f_favail = 1 << 32
        s.f_namemax = 255
        return s


async def _read_ahead(mountpoint: str, kb: int) -> None:
    """Raise the mount's read-ahead, as kvfs's daemon does (the kernel sets it at INIT)."""
    dev = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            if parts[4] == mountpoint:
                dev = parts[2]
    if dev is None:
        return
    for _ in range(50):
        await trio.sleep(0.1)
        try:
            path = f"/sys/class/bdi/{dev}/read_ahead_kb"
            with open(path) as f:
                if int(f.read()) >= kb:
                    continue
            with open(path, "w") as f:
                f.write(str(kb))
        except OSError as e:
            log.info("read-ahead not raised: %s", e)
            return


async def _serve(mountpoint: str, kb: int, kvfs_loop: bool = False) -> bool:
    """Serve until unmounted (True) or told to stop by a signal (False: still mounted)."""
    stopped = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_read_ahead, mountpoint, kb)

        async def stop():
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as sigs:
                async for _ in sigs:
                    stopped.append(True)
                    pyfuse3.terminate()
                    return
        nursery.start_soon(stop)
        if kvfs_loop:                       # kvfs's request loop (kvfs.fs.loop), not pyfuse3's
            import sys
            sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            from kvfs.fs import loop
            await loop.serve()
        else:
            await pyfuse3.main()
        nursery.cancel_scope.cancel()
    return not stopped


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mountpoint")
    p.add_argument("--entry-timeout", type=float, default=60)
    p.add_argument("--attr-timeout", type=float, default=10)
    p.add_argument("--negative-timeout", type=float, default=0, help="0: misses are not cached")
    p.add_argument("--default-permissions", action="store_true")
    p.add_argument("--read-ahead-kb", type=int, default=1024)
    p.add_argument("--no-flush", action="store_true", help="answer FLUSH with ENOSYS (what a close costs without it)")
    p.add_argument("--kvfs-loop", action="store_true",
                   help="serve with kvfs's request loop (kvfs.fs.loop) instead of pyfuse3.main")
    a = p.parse_args(argv)
    mnt = os.path.abspath(a.mountpoint)
    options = set(pyfuse3.default_options) - {"default_permissions"}
    options.update(("fsname=floorfs", "subtype=floorfs"))
    if a.default_permissions:
        options.add("default_permissions")
    fs = FloorFS(a.entry_timeout, a.attr_timeout, a.negative_timeout)
    fs.no_flush = a.no_flush
    pyfuse3.init(fs, mnt, options)
    unmounted = False
    try:
        unmounted = trio.run(_serve, mnt, a.read_ahead_kb, a.kvfs_loop)
    finally:
        pyfuse3.close(unmount=not unmounted)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
