"""Per-owner directories of hard links: how a namespace's owner opens its blocks' backing files.

A tier's object files live in a directory only the daemon's user can enter (0700). For a
namespace whose top-level directory is owned by another user, the lease and
``user.kvfs.backing`` hand that owner (and only that owner) a second name of the file in
``<grants>/<uid>/``: a directory of the daemon's (owned by it, mode 0700) with a POSIX ACL that
grants that one user search (``--x``) and nothing else, inside a grants directory of the
daemon's that others may traverse but not list (0711). So the owner can open a name it was
handed, and cannot list, create, rename, unlink, chmod or fill anything there: no entry under
the daemon's storage is a user's (a tenant that owned its ``<uid>/`` in earlier versions could
chmod it writable, fill the RAM tier's tmpfs or the NVMe disk outside its quota, and plant a
tree the daemon's cleanup recursed into: issue 40). The object file itself is made 0644 then,
which exposes it to nobody else: its only names are in the daemon's 0700 directory and in
``<uid>/``, which only that user may pass. Revoking a grant (the namespace changed owner, the
file moved to another namespace or changed mode, the object was deleted) unlinks that name
through the descriptor the daemon holds of ``<uid>/``; the grants directory is emptied at every
mount (without recursion: kvfs.store.safedir.clear_dir).

No grant is kept past its object: when the daemon frees an object file that was ever shared
(mode 0644) or that has a name it did not make (a hard link elsewhere, possible where
``fs.protected_hardlinks`` is 0), it punches the file's bytes out first (:meth:`OwnerLinks.scrub`),
so a name or an open descriptor a grantee kept holds no space once the object is gone.

The daemon needs root to grant (an ACL naming another user is the daemon's to set, but only
root's daemon serves other users' namespaces), and a filesystem with POSIX ACLs (tmpfs, ext4,
xfs, btrfs): where either is missing it hands out no grants (``null``: the owner reads through
the mount).
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import stat
import struct
from pathlib import Path

import trio

from kvfs.store import safedir

log = logging.getLogger(__name__)

GRANTS_DIR_MODE = 0o711
SHARED_FILE_MODE = 0o644
ACL_XATTR = "system.posix_acl_access"
# the ACL's tags and the "no id" of entries that name none (linux/posix_acl_xattr.h)
_ACL_USER_OBJ, _ACL_USER, _ACL_GROUP_OBJ, _ACL_MASK, _ACL_OTHER = 0x01, 0x02, 0x04, 0x10, 0x20
_ACL_NO_ID = 0xFFFFFFFF
_PUNCH = 0x01 | 0x02            # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE
_libc: ctypes.CDLL | None = None


def can_grant() -> bool:
    return os.geteuid() == 0


class OwnerLinks:
    """One tier's grants: ``<grants>/<uid>/<name>`` links to its object files."""

    def __init__(self):
        self.path: Path | None = None
        self.fd = -1
        self._users: dict[int, int] = {}        # uid -> descriptor of <grants>/<uid>/
        self.links: dict[int, set[int]] = {}    # oid -> uids holding a link
        self.exposed: set[int] = set()          # oids whose file was made 0644 (scrubbed when freed)
        self.scrubbed = 0                       # object files whose bytes were punched out when freed
        self.no_acl = False                     # the filesystem has no POSIX ACLs: no grants

    @property
    def active(self) -> bool:
        return self.fd >= 0

    def attach(self, path: Path, fd: int) -> None:
        """Use the (empty) directory ``fd`` as the grants directory."""
        os.fchmod(fd, GRANTS_DIR_MODE)
        self.path, self.fd = path, fd

    def close(self) -> None:
        for fd in self._users.values():
            os.close(fd)
        self._users.clear()
        self.links.clear()
        self.exposed.clear()
        if self.fd >= 0:
            os.close(self.fd)
        self.fd, self.path = -1, None

    def _user_dir(self, uid: int) -> int:
        """The descriptor of ``<grants>/<uid>/``, made when first needed: the daemon's, mode
        0700, with an ACL granting ``uid`` search only (kvfs.store.ownerlinks: search_acl)."""
        held = self._users.get(uid)
        if held is not None:
            return held
        name = str(uid)
        try:
            os.mkdir(name, 0o700, dir_fd=self.fd)
        except FileExistsError:
            pass
        top = os.open(name, safedir.DIR_FLAGS, dir_fd=self.fd)
        try:
            st = os.fstat(top)
            if st.st_uid != os.geteuid():
                raise OSError(errno.EPERM, f"grants directory of uid {uid} is not the daemon's")
            os.fchmod(top, 0o700)
            os.setxattr(top, ACL_XATTR, search_acl(uid))
        except OSError as e:
            os.close(top)
            if e.errno in (errno.EOPNOTSUPP, errno.ENOTSUP):
                self.no_acl = True
                log.warning("%s has no POSIX ACLs: namespace owners get no backing-file paths "
                            "there (they read through the mount)", self.path)
                try:
                    os.rmdir(name, dir_fd=self.fd)
                except OSError:
                    pass
            raise
        except BaseException:
            os.close(top)
            raise
        self._users[uid] = top
        return top

    def grant(self, src_dir_fd: int, name: str, oid: int, uid: int) -> str | None:
        """A path under ``uid``'s directory naming the file ``name`` of ``src_dir_fd`` (the
        object ``oid``), or None when it cannot be made (the error is logged)."""
        if not self.active or self.no_acl:
            return None
        try:
            if uid not in self.links.get(oid, ()):
                udir = self._user_dir(uid)
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=src_dir_fd)
                try:
                    if not stat.S_ISREG(os.fstat(fd).st_mode):
                        return None
                    os.fchmod(fd, SHARED_FILE_MODE)
                    self.exposed.add(oid)
                finally:
                    os.close(fd)
                try:
                    os.link(name, name, src_dir_fd=src_dir_fd, dst_dir_fd=udir, follow_symlinks=False)
                except FileExistsError:        # left by a revoked grant
                    os.unlink(name, dir_fd=udir)
                    os.link(name, name, src_dir_fd=src_dir_fd, dst_dir_fd=udir, follow_symlinks=False)
                self.links.setdefault(oid, set()).add(uid)
        except OSError as e:
            log.warning("cannot grant uid %d its backing file %s: %s", uid, name, e)
            return None
        return f"{self.path}/{uid}/{name}"

    def revoke(self, oid: int, name: str, uid: int | None = None) -> None:
        """Unlink ``uid``'s name of the object (every owner's when ``uid`` is None)."""
        uids = self.links.get(oid)
        if not uids:
            return
        for u in list(uids) if uid is None else [uid]:
            if u not in uids:
                continue
            uids.discard(u)
            fd = self._users.get(u)
            if fd is not None:
                try:
                    os.unlink(name, dir_fd=fd)
                except FileNotFoundError:
                    pass
                except OSError as e:
                    log.warning("cannot revoke uid %d's link %s: %s", u, name, e)
        if not uids:
            del self.links[oid]

    def drop(self, oid: int, name: str, src_dir_fd: int) -> None:
        """The object ``oid`` (the file ``name`` of ``src_dir_fd``) is being freed: every
        grant goes, and a file that was shared has its bytes punched out (:meth:`scrub`)."""
        self.revoke(oid, name)
        if oid in self.exposed:
            self.exposed.discard(oid)
            if src_dir_fd >= 0:
                self.scrub(src_dir_fd, name)

    def scrub(self, dir_fd: int, name: str, st: os.stat_result | None = None) -> bool:
        """Before the daemon unlinks the object file ``name`` of ``dir_fd`` (``st``: its
        ``lstat``, if taken): if it was ever shared (any permission for group or others) or
        has more names than the daemon's, punch its bytes out (truncate where the filesystem
        cannot), so that no name or descriptor a grantee kept holds space after the object is
        freed. Returns whether it did."""
        fd = self._open_shared(dir_fd, name, st)
        return fd >= 0 and self._punch_close(fd, name)

    def take(self, oid: int, name: str, dir_fd: int) -> int:
        """:meth:`drop` without the punch, for a caller on the trio thread: the grants go, and
        a shared file's descriptor comes back (-1: nothing to punch), to hand to
        :meth:`punched` once the name is unlinked (punching GBs takes tens of ms)."""
        self.revoke(oid, name)
        if oid not in self.exposed:
            return -1
        self.exposed.discard(oid)
        return self._open_shared(dir_fd, name, None) if dir_fd >= 0 else -1

    async def punched(self, fd: int, name: str, limiter=None) -> None:
        """Punch out and close ``fd`` (from :meth:`take`) in a worker thread."""
        if fd >= 0:
            with trio.CancelScope(shield=True):     # the descriptor is closed whatever happens
                await trio.to_thread.run_sync(self._punch_close, fd, name, limiter=limiter)

    def _open_shared(self, dir_fd: int, name: str, st: os.stat_result | None) -> int:
        """A descriptor of ``name`` if it was ever shared or has other names, else -1."""
        try:
            if st is None:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode) or not (st.st_mode & 0o077 or st.st_nlink > 1):
                return -1
            return os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError as e:
            log.warning("cannot free the bytes of shared object file %s: %s", name, e)
            return -1

    def _punch_close(self, fd: int, name: str) -> bool:
        try:
            punch(fd, os.fstat(fd).st_size)
        except OSError as e:
            log.warning("cannot free the bytes of shared object file %s: %s", name, e)
            return False
        finally:
            os.close(fd)
        self.scrubbed += 1
        log.debug("freed the bytes of shared object file %s", name)
        return True


def search_acl(uid: int) -> bytes:
    """The ``system.posix_acl_access`` value of a directory the daemon's user may do anything
    in and ``uid`` may only search (pass through to a name it knows): ``u::rwx,u:uid:--x,
    g::---,m::--x,o::---`` (mode 0710), in the kernel's xattr format (a version, then
    (tag, permissions, id) entries in tag order)."""
    entries = [(_ACL_USER_OBJ, 7, _ACL_NO_ID), (_ACL_USER, 1, uid), (_ACL_GROUP_OBJ, 0, _ACL_NO_ID),
               (_ACL_MASK, 1, _ACL_NO_ID), (_ACL_OTHER, 0, _ACL_NO_ID)]
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)


def punch(fd: int, size: int) -> None:
    """Free the bytes of the file ``fd`` (its size stays: readers that kept it read zeros, not
    SIGBUS); truncate it to 0 where the filesystem cannot punch holes."""
    global _libc
    if size <= 0:
        return
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if _libc.fallocate(fd, _PUNCH, 0, size) != 0:
        e = ctypes.get_errno()
        if e not in (errno.EOPNOTSUPP, errno.ENOSYS):
            raise OSError(e, os.strerror(e))
        os.ftruncate(fd, 0)
