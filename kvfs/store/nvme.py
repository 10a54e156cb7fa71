"""The local NVMe tier: one file per object in a directory on a local filesystem.

Objects are written with O_DIRECT through a page-aligned bounce buffer where the
filesystem allows it (otherwise buffered), fsynced, and renamed into place before
the store records them in the index. Reads use O_DIRECT into aligned buffers, so
they cost a real disk read and never pollute the page cache.

Each object file carries its own record (CBOR: id, size, checksums, path, generation) in
its ``user.kvfs.object`` xattr, or in an ``<id>.rec`` side file when the record is too big
for one (kvfs.store.nvmerecord), so ``kvfs fsck --repair`` can rebuild a lost index from
the files alone. The directory is private (0700, checked, held by descriptor, see
kvfs.store.safedir), locked by one daemon at a time, and bound to one index: its
``instance`` file names the index instance whose objects it holds, and a daemon with
another index is refused (its orphan sweep would delete the other's objects).
"""
from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
from pathlib import Path
from typing import AsyncIterator

import cbor2
import trio

from kvfs.errors import ConfigError, NoSuchObject, TierFull
from kvfs.protocol import ALIGN
from kvfs.store import checksum, nvmerecord, safedir
from kvfs.store.ownerlinks import OwnerLinks, can_grant
from kvfs.store.safedir import Dir, DirLock
from kvfs.store.tier import ObjectInfo, Tier

log = logging.getLogger(__name__)


def _syncfs(fd: int) -> None:
    """syncfs(2) of the filesystem holding ``fd`` (sync(2) where libc lacks it)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syncfs(fd) == 0:
            return
        log.warning("syncfs failed (%s): syncing every filesystem", os.strerror(ctypes.get_errno()))
    except (OSError, AttributeError):
        pass
    os.sync()


_BOUNCE = 4 << 20
RECORD_XATTR = nvmerecord.RECORD_XATTR
INSTANCE_FILE = "instance"


def _round_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


class _Buffers(threading.local):
    """Per-thread page-aligned buffers (mmap), reused: first touch of fresh memory is slow."""

    def get(self, size: int) -> mmap.mmap:
        size = _round_up(max(size, ALIGN))
        buf = getattr(self, "buf", None)
        if buf is None or len(buf) < size:
            buf = self.buf = mmap.mmap(-1, size)
        return buf


class NvmeTier(Tier):
    name = "nvme"
    puts_from_slices = True     # _write_file copies data[off:off + n] piece by piece
    volatile = False
    totals_from_records = True      # a file no record names (a put cut off by kill -9) is not in them

    def __init__(self, capacity: int, root: str | Path, *, threads: int = 4, holder: str | None = None):
        super().__init__(capacity)
        self.root = Path(root)
        self.objdir = self.root / "objects"
        self.direct = False
        self.holder = holder or safedir.holder_text(None)
        self.home: Dir | None = None
        self.staging: Dir | None = None     # write buffers spilled out of RAM
        self._shards: list[int] = []         # descriptors of objects/00 .. objects/ff
        self._lock: DirLock | None = None
        self._limiter = trio.CapacityLimiter(threads)
        self._bufs = _Buffers()
        self.grants = OwnerLinks()          # namespace owners' links, in <root>/grants/
        self._xattrs = True
        self.foreign: list[str] = []        # what open() removed that was not the daemon's

    @property
    def staging_dir(self) -> Dir | None:
        return self.staging

    def footprint(self, size: int) -> int:
        return _round_up(size)

    def path(self, oid: int) -> Path:
        h = f"{oid:016x}"
        return self.objdir / h[-2:] / h

    def _shard(self, oid: int) -> tuple[int, str]:
        h = f"{oid:016x}"
        return self._shards[int(h[-2:], 16)], h

    async def open(self) -> None:
        def prepare() -> bool:
            home = safedir.open_private_dir(self.root, "NVMe directory")
            self.home = Dir(self.root, home)
            self._lock = DirLock(home, self.root, "NVMe directory", self.holder)
            objs = safedir.open_subdir(home, "objects", "NVMe objects directory")
            try:
                self._shards = [safedir.open_subdir(objs, f"{i:02x}", "NVMe objects directory")
                                for i in range(256)]
            finally:
                os.close(objs)
            self.staging = Dir(self.root / "staging", safedir.open_subdir(home, "staging", "NVMe staging"))
            self._report("staging", safedir.clear_dir(self.staging.fd, safedir.staging_entry))
            self._clear_grants(home)
            try:
                fd = os.open(".direct-probe", safedir.CREATE_FLAGS | os.O_DIRECT, 0o600, dir_fd=home)
            except FileExistsError:
                os.unlink(".direct-probe", dir_fd=home)
                return False
            except OSError:
                return False
            try:
                buf = mmap.mmap(-1, ALIGN)
                os.pwrite(fd, buf, 0)
                return True
            except OSError:
                return False
            finally:
                os.close(fd)
                os.unlink(".direct-probe", dir_fd=home)
        try:
            self.direct = await trio.to_thread.run_sync(prepare)
        except BaseException:
            self._close_fds()
            raise
        log.info("nvme tier at %s: %s I/O", self.root, "O_DIRECT" if self.direct else "buffered")

    def _close_fds(self) -> None:
        for fd in self._shards:
            os.close(fd)
        self._shards = []
        for d in (self.staging, self.home):
            if d is not None:
                d.close()
        self.staging = self.home = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    async def close(self) -> None:
        if self.grants.active:
            try:
                safedir.clear_dir(self.grants.fd)
            except OSError as e:
                log.warning("could not empty %s/grants: %s", self.root, e)
        self.grants.close()
        self._close_fds()

    def _clear_grants(self, home: int) -> None:
        """No grant outlives the daemon that made it: empty ``grants/`` (an earlier mount's)."""
        try:
            fd = os.open("grants", safedir.DIR_FLAGS, dir_fd=home)
        except FileNotFoundError:
            return
        try:
            self._report("grants", safedir.clear_dir(fd, safedir.grants_entry))
        finally:
            os.close(fd)

    def _report(self, sub: str, cleared: safedir.Cleared) -> None:
        """Say what was removed from ``<root>/<sub>/`` that the daemon never makes there (what a
        tenant of an earlier version could leave in its grants directory, or someone else)."""
        if cleared.foreign:
            msg = f"removed foreign entries from {self.root}/{sub}: {cleared.describe()}"
            log.warning("%s", msg)
            self.foreign.append(msg)

    def grant_read(self, oid: int, loc: bytes, uid: int) -> dict | None:
        if not can_grant():
            return None
        if not self.grants.active:
            fd = safedir.open_subdir(self.home.fd, "grants", "NVMe grants directory")
            os.fchmod(self.home.fd, 0o711)     # owners traverse to grants/ (nothing else is theirs)
            self.grants.attach(self.root / "grants", fd)
        shard, name = self._shard(oid)
        p = self.grants.grant(shard, name, oid, uid)
        return None if p is None else {"path": p, "offset": 0, "direct": self.direct}

    def revoke_read(self, oid: int, uid: int | None = None) -> None:
        self.grants.revoke(oid, f"{oid:016x}", uid)

    def granted(self) -> dict[int, set[int]]:
        return self.grants.links

    def recorded_instance(self) -> str | None:
        raw = safedir.read_file(self.home.fd, INSTANCE_FILE)
        return raw.decode("ascii", "replace").strip() if raw is not None else None

    def bind(self, instance: str, state_dir, *, bound: bool = False) -> None:
        """Tie this directory to the index ``instance``: the first index to use it records
        itself; any other is refused (its orphan sweep would delete the first one's objects).
        ``bound``: the index was already tied to an NVMe directory, so one without a record
        is not its own (a copied state directory pointed at a new directory)."""
        have = self.recorded_instance()
        if have is None and bound:
            raise ConfigError(
                f"the index in {state_dir} (instance {instance}) belongs to another NVMe directory, "
                f"not {self.root}: a copied state directory? give the copy its own fresh --state")
        if have is None:
            safedir.write_file_atomic(self.home.fd, INSTANCE_FILE, instance.encode() + b"\n")
        elif have != instance:
            raise ConfigError(
                f"NVMe directory {self.root} holds the objects of kvfs instance {have}, not of the index "
                f"in {state_dir} (instance {instance}): use that instance's state directory, or give "
                f"this one its own --nvme directory")

    def _record(self, info: ObjectInfo) -> bytes:
        return cbor2.dumps({"oid": info.oid, "size": info.size, "checksum": info.checksum,
                            "chunk_size": info.chunk_size, "sums": checksum.pack_sums(info.chunk_sums),
                            "key": info.key, "gen": info.generation})

    def _write_file(self, info: ObjectInfo, data: memoryview) -> None:
        shard, name = self._shard(info.oid)
        tmp = name + ".tmp"
        try:
            os.unlink(tmp, dir_fd=shard)
        except FileNotFoundError:
            pass
        fd = os.open(tmp, safedir.CREATE_FLAGS | (os.O_DIRECT if self.direct else 0), 0o600, dir_fd=shard)
        try:
            if self.direct:
                bounce = self._bufs.get(_BOUNCE)
                off = 0
                while off < info.size:
                    n = min(_BOUNCE, info.size - off)
                    bounce[:n] = data[off:off + n]
                    wlen = _round_up(n)
                    if wlen > n:
                        bounce[n:wlen] = bytes(wlen - n)
                    done = os.pwrite(fd, memoryview(bounce)[:wlen], off)
                    if done < n:
                        # a short O_DIRECT write (the filesystem filled up): never keep a
                        # file with a hole where bytes should be
                        raise OSError(errno.ENOSPC, f"short write ({done} of {wlen} bytes)")
                    off += n
                os.ftruncate(fd, info.size)
            else:
                off = 0
                while off < info.size:
                    done = os.pwrite(fd, data[off:off + _BOUNCE], off)
                    if done <= 0:
                        raise OSError(errno.ENOSPC, "no progress writing an object")
                    off += done
            if self._xattrs:
                try:
                    # a record too big for an xattr goes to a side file, never reads as a full disk
                    nvmerecord.store(fd, shard, name, self._record(info), sync=not self.defer_sync)
                except OSError as e:
                    # EPERM: a filesystem that refuses this name (under another kvfs mount the
                    # user.kvfs.* names are its own); as without user xattrs, not a failed write
                    if e.errno not in nvmerecord.UNSUPPORTED:
                        raise
                    self._xattrs = False
                    log.warning("nvme tier at %s: no user xattrs (%s); objects are not self-describing "
                                "and fsck cannot rebuild the index from them", self.root, e)
            if not self.defer_sync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            try:
                os.unlink(tmp, dir_fd=shard)
            except FileNotFoundError:
                pass
            nvmerecord.remove_side(shard, nvmerecord.side_name(name))
            raise
        os.close(fd)
        os.rename(tmp, name, src_dir_fd=shard, dst_dir_fd=shard)
        if not self.defer_sync:
            os.fsync(shard)

    async def sync_deferred(self) -> None:
        """One syncfs(2) of the tier's filesystem for the puts made while defer_sync was set
        (the write-down at unmount: 100k small files paid two fsyncs each)."""
        await trio.to_thread.run_sync(_syncfs, self.home.fd, limiter=self._limiter)

    async def put(self, info: ObjectInfo, data: memoryview) -> bytes:
        need = self.footprint(info.size)
        if need > self.free():
            raise TierFull(f"nvme tier: {info.size} bytes do not fit")
        self.used += need
        try:
            await trio.to_thread.run_sync(self._write_file, info, data, limiter=self._limiter)
        except OSError as e:
            self.used -= need
            if e.errno == errno.ENOSPC:
                raise TierFull(f"nvme tier: disk full ({e})") from None
            raise
        except BaseException:
            self.used -= need
            raise
        self.objects += 1
        return b""

    def _read_file(self, oid: int, offset: int, length: int) -> bytes:
        shard, name = self._shard(oid)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | (os.O_DIRECT if self.direct else 0), dir_fd=shard)
        except FileNotFoundError:
            raise NoSuchObject(f"nvme tier has no object {oid:x}") from None
        try:
            if not self.direct:
                return os.pread(fd, length, offset)
            start = offset - offset % ALIGN
            span = _round_up(offset + length) - start
            buf = self._bufs.get(span)
            n = os.preadv(fd, [memoryview(buf)[:span]], start)
            lo = offset - start
            return bytes(memoryview(buf)[lo:max(lo, min(n, lo + length))])
        finally:
            os.close(fd)

    async def read(self, oid: int, loc: bytes, offset: int, length: int) -> memoryview:
        # abandoned when cancelled (read_deadline): a read stuck on a hung disk keeps its worker
        # thread and limiter slot until the disk answers, but the reader gets EIO at the deadline
        # (and, once every slot is stuck, later reads wait for one, also cut at the deadline)
        data = await trio.to_thread.run_sync(self._read_file, oid, offset, length, limiter=self._limiter,
                                             abandon_on_cancel=True)
        return memoryview(data)

    async def delete(self, oid: int, loc: bytes, counted: bool = True) -> None:
        """Free the object's file (``counted=False``: an orphan the sweep found, never in
        ``used``/``objects``)."""
        shard, name = self._shard(oid)
        self.grants.drop(oid, name, -1)             # its bytes are scrubbed by rm, in the thread
        def rm() -> int:
            nvmerecord.remove_side(shard, nvmerecord.side_name(name))    # first: see nvmerecord
            try:
                st = os.stat(name, dir_fd=shard, follow_symlinks=False)
                self.grants.scrub(shard, name, st)     # what an owner kept of it holds no space
                os.unlink(name, dir_fd=shard)
                return st.st_size
            except FileNotFoundError:
                return -1
        size = await trio.to_thread.run_sync(rm, limiter=self._limiter)
        if size >= 0 and counted:
            self.used -= self.footprint(size)
            self.objects -= 1

    def _listing(self) -> list[tuple[int, int, str]]:
        out = []
        for shard in self._shards:
            with os.scandir(shard) as it:
                for e in it:
                    if e.name.endswith(".tmp") or not e.is_file(follow_symlinks=False):
                        continue
                    try:
                        out.append((int(e.name, 16), e.stat(follow_symlinks=False).st_size, e.name))
                    except ValueError:
                        continue
        return out

    async def scan(self) -> AsyncIterator[tuple[int, bytes, int]]:
        for oid, size, _ in await trio.to_thread.run_sync(self._listing):
            yield oid, b"", size

    def _read_record(self, oid: int) -> ObjectInfo | None:
        shard, name = self._shard(oid)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=shard)
        except OSError:
            return None
        try:
            raw = nvmerecord.load(fd, shard, name)
            size = os.fstat(fd).st_size
        except OSError:
            return None
        finally:
            os.close(fd)
        if raw is None:
            return None
        try:
            m = cbor2.loads(raw, tag_hook=lambda d, t: None)      # the tier's own record map (nvmerecord)
            info = ObjectInfo(int(m["oid"]), int(m["size"]), int(m["checksum"]), int(m["chunk_size"]),
                              checksum.unpack_sums(bytes(m["sums"])), str(m["key"]), int(m["gen"]))
        except Exception as e:       # noqa: BLE001 - a damaged record is skipped, not trusted
            log.warning("nvme object %x: unreadable record (%s); skipped", oid, e)
            return None
        if info.oid != oid or info.size != size:
            log.warning("nvme object %x: record disagrees with the file; skipped", oid)
            return None
        return info

    def leftovers(self) -> list[tuple[int, str]]:
        """Files of puts cut off by a crash (for fsck, with the mount down)."""
        return nvmerecord.leftovers(self._shards)

    async def scan_records(self, progress=None) -> AsyncIterator[tuple[ObjectInfo, bytes]]:
        """Every object file whose own record reads back (for the index rebuild)."""
        rows = await trio.to_thread.run_sync(self._listing)
        for n, (oid, _, _) in enumerate(rows):
            if progress:
                progress(n, len(rows))
            info = await trio.to_thread.run_sync(self._read_record, oid, limiter=self._limiter)
            if info is not None:
                yield info, b""

    def backing(self, oid: int, loc: bytes) -> dict | None:
        return {"path": str(self.path(oid)), "offset": 0, "direct": self.direct}
