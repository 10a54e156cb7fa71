"""The RAM tier: objects as files in shared memory (tmpfs), mapped into the daemon.

Living in /dev/shm lets the GPU loader map a sealed object directly (the fast
path beside FUSE). Write staging buffers count against the same byte budget: in the
daemon's memory below ``mapped_min`` (as the small object they become), a file here from
it on, so sealing into RAM is a rename, not a copy.

/dev/shm is writable by every user, so the tier's directory is created fresh at each
mount with an unpredictable name (``kvfs-<instance>-<random>``, mode 0700, see
kvfs.store.safedir), held by descriptor and locked for the mount's life; every file
under it is created relative to that descriptor with ``O_EXCL|O_NOFOLLOW``. A
previous mount's directory is removed only if it is a real directory of ours that no
live daemon holds. If the directory is removed under a running mount, the next write
re-creates it (objects already mapped keep working; their fast-path paths are gone).

Every mapped object holds one of the daemon's descriptors (Python's mmap keeps one). The
tier maps at most ``max_mapped`` objects (the descriptor limit less a reserve for everything
else); past it, and when a mapping fails for want of descriptors, an object of any size
lives in the daemon's memory like a small one (read through ``.kvfs/get`` or the mount, no
lease): a RAM tier larger than the descriptor limit allows is slower for those objects,
never an error.
"""
from __future__ import annotations

import errno
import fcntl
import itertools
import logging
import mmap
import os
import resource
from pathlib import Path
from typing import AsyncIterator

import trio

from kvfs.errors import NoSuchObject, TierFull
from kvfs.proc import filesystem_of
from kvfs.store import hugefs, names, ramroom, safedir
from kvfs.store.ownerlinks import OwnerLinks, can_grant
from kvfs.store.safedir import Dir
from kvfs.store.staging import Staging, unlink_quiet
from kvfs.store.tier import ObjectInfo, Tier

log = logging.getLogger(__name__)

MAPPED_MIN = 256 << 10    # default: objects at least this big stay tmpfs files (mapped; fast path)
FD_RESERVE_MIN = 1024     # descriptors never taken by mappings: staging files, LMDB, clients, leases
SPARE_STAGING = 64        # emptied staging files kept for the next writes (no create/unlink each)


def mapping_budget() -> int:
    """How many objects the tier may map: the descriptor limit (the soft one raised to the
    hard one first, as the daemon does) less a reserve (1/8 of it, at least FD_RESERVE_MIN)
    for everything else the process opens."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):   # e.g. an infinite hard limit the kernel caps: keep ours
            pass
    if soft == resource.RLIM_INFINITY:
        return 1 << 30
    return max(0, soft - max(FD_RESERVE_MIN, soft // 8))


class RamTier(Tier):
    name = "ram"
    volatile = True

    def __init__(self, capacity: int, shm_dir: str | Path, instance_id: str, *, mapped_min: int = MAPPED_MIN,
                 own_fs: bool = False):
        super().__init__(capacity)
        self.mapped_min = mapped_min        # smaller objects live in the daemon (config ram_mapped_min)
        self.shm_dir = Path(shm_dir)        # where the tier's directories are made (see open)
        self.instance_id = instance_id
        self.own_fs = own_fs                # mount a huge-page tmpfs of our own (config ram_hugefs)
        self.mounted: Path | None = None    # that tmpfs, while mounted
        self._mount_fd = -1                 # its root, locked (kvfs.store.hugefs.sweep)
        self.prefix = f"kvfs-{instance_id}-"
        self.home: Dir | None = None        # the tier's directory (objects)
        self.staging: Dir | None = None     # its staging/ subdirectory (write buffers)
        self._maps: dict[int, tuple[mmap.mmap, int]] = {}
        self.mapped = 0                     # objects held as mappings (a descriptor each)
        self.max_mapped = 0                 # set at open: mapping_budget()
        self._stale: set[int] = set()       # objects whose file went with a removed directory
        self.staged = 0                      # bytes held by write buffers (part of used)
        self._seq = itertools.count()
        self._spare: list[tuple[str, int]] = []      # (name, fd) of empty staging files
        self.grants = OwnerLinks()          # namespace owners' links (a second fresh directory)

    @property
    def dir(self) -> Path:
        return self.home.path if self.home else self.shm_dir / self.prefix

    def _path(self, oid: int) -> str:
        return f"{self.home.path}/{oid:016x}"

    def _make_dir(self) -> None:
        path, fd = safedir.make_unique_dir(self.shm_dir, self.prefix)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)     # ours while we live (stale-dir sweep)
        self.home = Dir(path, fd)
        self.staging = Dir(path / "staging", safedir.open_subdir(fd, "staging", "RAM staging directory"))

    def _ensure_dir(self) -> None:
        """Re-create the directory if someone removed it under the running mount."""
        if self.home is not None and not self.home.gone():
            return
        log.error("RAM tier directory %s was removed under the mount: re-creating it", self.dir)
        self._stale.update(self._maps)
        self._close_dirs()
        self._make_dir()

    def _close_dirs(self) -> None:
        while self._spare:
            os.close(self._spare.pop()[1])
        for d in (self.staging, self.home):
            if d is not None:
                d.close()
        self.home = self.staging = None

    async def open(self) -> None:
        # whatever a crashed daemon of this instance left is volatile and gone by definition
        safedir.check_shared_parent(self.shm_dir, "shm_dir")
        safedir.remove_stale_dirs(self.shm_dir, self.prefix, before=names.retire)   # its readers stop
        if self.own_fs:
            hugefs.sweep(self.shm_dir, self.instance_id, self.prefix)
            if filesystem_of(self.shm_dir)[2].get("huge", "never") == "never":
                try:
                    self.mounted, self._mount_fd = hugefs.mount(self.shm_dir, self.instance_id, self.capacity)
                    self.shm_dir = self.mounted
                except OSError as e:
                    log.info("RAM tier without a huge-page tmpfs of its own (%s): in %s", e, self.shm_dir)
        self.max_mapped = mapping_budget()
        self._make_dir()

    async def close(self) -> None:
        self._maps.clear()
        self.mapped = 0
        self._close_grants()
        if self.home is None:
            return
        try:
            safedir.clear_dir(self.home.fd)
            parent = os.open(self.shm_dir, safedir.DIR_FLAGS)
            try:
                os.rmdir(self.home.path.name, dir_fd=parent)
            finally:
                os.close(parent)
        except OSError as e:
            log.warning("could not remove the RAM tier directory %s: %s", self.dir, e)
        finally:
            self._close_dirs()
            if self.mounted is not None:
                try:
                    hugefs.unmount(self.mounted, self._mount_fd)
                except OSError as e:
                    log.warning("could not unmount the RAM tier's tmpfs %s: %s", self.mounted, e)
                self.mounted = None

    def _install(self, oid: int, fd: int, size: int, mapping: mmap.mmap | None = None) -> None:
        """``mapping``: a read-only mapping of ``fd`` made beforehand (a commit's copier)."""
        mm = None
        mappable = size >= self.mapped_min and self.mapped < self.max_mapped
        if mapping is not None:
            if mappable and len(mapping) == size:
                mm = mapping
            else:                       # past the budget (or not this file's size): unused
                mapping.close()
        elif mappable:
            try:
                mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
            except OSError as e:
                if e.errno not in (errno.EMFILE, errno.ENFILE):
                    raise
                log.warning("ram tier: no descriptor left to map object %x (%d mapped): kept in memory",
                            oid, self.mapped)
        if mm is not None:
            self._maps[oid] = (mm, size)
            self.mapped += 1
        else:
            # small objects (and any past the mapping budget) live in the daemon's memory:
            # Python's mmap keeps a descriptor per mapping, and 100k small files would
            # exhaust the descriptor limit
            buf = os.pread(fd, size, 0)
            try:
                os.unlink(f"{oid:016x}", dir_fd=self.home.fd)
            except FileNotFoundError:
                pass
            self._maps[oid] = (buf, size)
        self.objects += 1

    async def put(self, info: ObjectInfo, data: memoryview) -> bytes:
        if info.size > self.free():
            raise TierFull(f"ram tier: {info.size} bytes do not fit")
        self.used += info.size
        try:
            self._ensure_dir()      # pwrite, not a mapping: a full tmpfs is ENOSPC, not SIGBUS
            fd = await trio.to_thread.run_sync(ramroom.put_file, self.home.fd, f"{info.oid:016x}", data)
            try:
                self._install(info.oid, fd, info.size)
            finally:
                os.close(fd)
        except BaseException:
            self.used -= info.size
            raise
        return b""

    def adopt(self, info: ObjectInfo, staging: "Staging", mapping: mmap.mmap | None = None) -> bytes:
        """Turn a RAM staging buffer into the object itself (no copy; a small object's bytes
        are copied into memory and its emptied staging file is kept for the next write).
        A buffer made by :meth:`object_file` is already named as the object (no rename);
        ``mapping``: its read-only mapping, made by whoever filled it (else made here)."""
        assert not staging.spilled and staging.size == info.size
        if staging.mem is not None:             # a small buffer, already the daemon's memory
            self._maps[info.oid] = (staging.mem, info.size)
            self.objects += 1
            self.staged -= staging.size
            staging.mem, staging.size = None, 0
            return b""
        if info.size < self.mapped_min and self.can_recycle(staging):
            self._maps[info.oid] = (os.pread(staging.fd, info.size, 0), info.size)
            self.objects += 1
            self.staged -= staging.size
            self.recycle(staging)
            return b""
        name = f"{info.oid:016x}"
        if staging.dir is not self.home or staging.name != name:
            try:
                os.rename(staging.name, name, src_dir_fd=staging.dir.fd, dst_dir_fd=self.home.fd)
            except OSError as e:
                # the buffer's directory was removed under the mount: keep the bytes by
                # descriptor (no fast-path file for this object)
                log.warning("object %x kept without a file in shared memory: %s", info.oid, e)
                self._stale.add(info.oid)
        self._install(info.oid, staging.fd, info.size, mapping)
        # the staged bytes become object bytes: used stays, staged drops
        self.staged -= staging.size
        staging.detach()
        return b""

    async def read(self, oid: int, loc: bytes, offset: int, length: int) -> memoryview:
        try:
            mm, size = self._maps[oid]
        except KeyError:
            raise NoSuchObject(f"ram tier has no object {oid:x}") from None
        return memoryview(mm)[offset:min(size, offset + length)]

    def view(self, oid: int) -> memoryview | None:
        entry = self._maps.get(oid)
        return memoryview(entry[0]) if entry else None

    async def delete(self, oid: int, loc: bytes) -> None:
        name = f"{oid:016x}"
        shared = self.grants.take(oid, name, self.home.fd if self.home is not None else -1)
        entry = self._maps.pop(oid, None)
        if entry is None:
            return await self.grants.punched(shared, name)
        self.used -= entry[1]
        self.objects -= 1
        if isinstance(entry[0], mmap.mmap):
            self.mapped -= 1            # its descriptor goes with the last view of the mapping
        self._stale.discard(oid)
        if self.home is not None:
            try:
                os.unlink(name, dir_fd=self.home.fd)
            except FileNotFoundError:
                pass
        await self.grants.punched(shared, name)     # in a worker thread (GBs: tens of ms)
        # the mapping is released when the last memoryview over it goes away

    def status(self) -> dict:
        """``mapped``: objects held as mappings (leasable), at most ``mapped_budget``."""
        return {"mapped": self.mapped, "mapped_budget": self.max_mapped, **ramroom.status(self)}

    async def scan(self) -> AsyncIterator[tuple[int, bytes, int]]:
        for oid, (_, size) in list(self._maps.items()):
            yield oid, b"", size

    def backing(self, oid: int, loc: bytes) -> dict | None:
        entry = self._maps.get(oid)
        if entry is None or not isinstance(entry[0], mmap.mmap) or oid in self._stale:
            return None
        return {"path": self._path(oid), "offset": 0, "direct": False}

    def grant_read(self, oid: int, loc: bytes, uid: int) -> dict | None:
        if self.backing(oid, loc) is None or not can_grant():
            return None
        if not self.grants.active:
            path, fd = safedir.make_unique_dir(self.shm_dir, self.prefix)   # swept like the home
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.grants.attach(path, fd)
        p = self.grants.grant(self.home.fd, f"{oid:016x}", oid, uid)
        return None if p is None else {"path": p, "offset": 0, "direct": False}

    def revoke_read(self, oid: int, uid: int | None = None) -> None:
        self.grants.revoke(oid, f"{oid:016x}", uid)

    def granted(self) -> dict[int, set[int]]:
        return self.grants.links

    def _close_grants(self) -> None:
        if not self.grants.active:
            return
        path = self.grants.path
        try:
            safedir.clear_dir(self.grants.fd)
            os.rmdir(path)
        except OSError as e:
            log.warning("could not remove the RAM tier's grants directory %s: %s", path, e)
        finally:
            self.grants.close()

    def can_recycle(self, staging: "Staging") -> bool:
        return not staging.spilled and staging.dir is self.staging and len(self._spare) < SPARE_STAGING

    def recycle(self, staging: "Staging") -> None:
        """Keep the staging file, emptied, for the next ``new_staging`` while writes go on
        (accounting is the caller's; :meth:`drop_spares` once none does)."""
        os.ftruncate(staging.fd, 0)     # always: never a spare holding bytes nobody counts
        self._spare.append((staging.name, staging.fd))
        staging.fd, staging.size = -1, 0

    def drop_spares(self) -> None:
        """Close and remove the spare staging files: called when no write state is left, so
        nothing in ``staging/`` outlives the descriptors that wrote it (issue 40: the buffers of
        versions renamed over, unlinked or truncated back while open stayed there, emptied and
        open, after every descriptor closed)."""
        while self._spare:
            name, fd = self._spare.pop()
            os.close(fd)
            if self.staging is not None:
                unlink_quiet(self.staging, name)

    def new_staging(self) -> "Staging":
        """An empty write buffer (in memory until it reaches ``mapped_min``: no file yet)."""
        return Staging(self, self.staging, f"w{next(self._seq):x}")

    def object_file(self, oid: int) -> tuple[Dir, str, int]:
        """(directory, name, descriptor) of a new, empty buffer already named as object ``oid``
        (a buffer bound to become that object: its adoption needs no rename)."""
        self._ensure_dir()
        name = f"{oid:016x}"
        return self.home, name, safedir.create_file(self.home.fd, name)

    def staging_file(self) -> tuple[Dir, str, int]:
        """(directory, name, descriptor) of an empty staging file: a spare one, or a new one."""
        self._ensure_dir()
        if self._spare:
            name, fd = self._spare.pop()
            return self.staging, name, fd
        name = f"w{next(self._seq):x}"
        return self.staging, name, safedir.create_file(self.staging.fd, name)
