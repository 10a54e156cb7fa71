"""Per-owner directories of hard links: how a namespace's owner opens its blocks' backing files.

A tier's object files live in a directory only the daemon's user can enter (0700). For a
namespace whose top-level directory is owned by another user, the lease and
``user.kvfs.backing`` hand that owner (and only that owner) a second name of the file in
``<grants>/<uid>/``: a directory owned by that user with mode 0500, inside a grants directory
of the daemon's that others may traverse but not list (0711). The object file itself is made
0644 then, which exposes it to nobody else: its only names are in the daemon's 0700 directory
and in the owner's 0500 one. Revoking a grant (the namespace changed owner, the file moved to
another namespace or changed mode, the object was deleted) unlinks that name; the grants
directory is emptied at every mount, so no grant outlives the daemon that made it.

The owner can chmod its own directory and add or remove names in it: that only touches its own
access (a name it planted makes the daemon's link fail and the lease answer ``null``). The
daemon needs root for this (chown); a daemon that is not root hands out no grants (``null``).
"""
from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path

from kvfs.store import safedir

log = logging.getLogger(__name__)

OWNER_DIR_MODE = 0o500
GRANTS_DIR_MODE = 0o711
SHARED_FILE_MODE = 0o644


def can_grant() -> bool:
    return os.geteuid() == 0


class OwnerLinks:
    """One tier's grants: ``<grants>/<uid>/<name>`` links to its object files."""

    def __init__(self):
        self.path: Path | None = None
        self.fd = -1
        self._users: dict[int, int] = {}        # uid -> descriptor of <grants>/<uid>
        self.links: dict[int, set[int]] = {}    # oid -> uids holding a link

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
        if self.fd >= 0:
            os.close(self.fd)
        self.fd, self.path = -1, None

    def _user_dir(self, uid: int) -> int:
        fd = self._users.get(uid)
        if fd is not None:
            return fd
        name = str(uid)
        try:
            os.mkdir(name, 0o700, dir_fd=self.fd)
        except FileExistsError:
            pass
        fd = os.open(name, safedir.DIR_FLAGS, dir_fd=self.fd)
        try:
            st = os.fstat(fd)
            if st.st_uid not in (uid, os.geteuid()):
                raise OSError(errno.EPERM, f"grants directory of uid {uid} has another owner")
            os.fchown(fd, uid, -1)
            os.fchmod(fd, OWNER_DIR_MODE)
        except BaseException:
            os.close(fd)
            raise
        self._users[uid] = fd
        return fd

    def grant(self, src_dir_fd: int, name: str, oid: int, uid: int) -> str | None:
        """A path under ``uid``'s directory naming the file ``name`` of ``src_dir_fd`` (the
        object ``oid``), or None when it cannot be made (the error is logged)."""
        if not self.active:
            return None
        try:
            udir = self._user_dir(uid)
            if uid not in self.links.get(oid, ()):
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=src_dir_fd)
                try:
                    if not stat.S_ISREG(os.fstat(fd).st_mode):
                        return None
                    os.fchmod(fd, SHARED_FILE_MODE)
                finally:
                    os.close(fd)
                try:
                    os.link(name, name, src_dir_fd=src_dir_fd, dst_dir_fd=udir, follow_symlinks=False)
                except FileExistsError:        # planted by the owner, or left by a revoked grant
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
