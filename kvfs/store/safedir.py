"""Root-owned state on a shared node: private directories, descriptor-relative opens, locks.

The daemon runs as root beside other users. Everything it creates lives in a directory
it owns with mode 0700, opened once (``O_NOFOLLOW``) and held by descriptor for the
mount's life; files under it are opened relative to that descriptor with ``O_NOFOLLOW``
and, where they are created, ``O_EXCL``, so no name another user planted (a symlink, a
directory swapped in a race) can steer a write. One lock file (``flock``) per directory
names its holder, so a second daemon gets a one-line error instead of sharing it.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import tempfile
from pathlib import Path

from kvfs.errors import ConfigError, InUse

log = logging.getLogger(__name__)

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
CREATE_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _check_owned(st: os.stat_result, path, what: str) -> None:
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{what} {path} is not a directory")
    if st.st_uid != os.geteuid():
        raise ConfigError(f"{what} {path} is owned by uid {st.st_uid}, not by the daemon's user "
                          f"(uid {os.geteuid()}): refusing to keep state in it")


def _owned(fd: int, path, what: str) -> int:
    """``fd`` after checking it is a directory of ours (mode tightened to 0700); closed if not."""
    try:
        st = os.fstat(fd)
        _check_owned(st, path, what)
        if stat.S_IMODE(st.st_mode) & 0o066:     # search (x) alone is allowed: ownerlinks.py
            os.fchmod(fd, 0o700)
            log.info("%s %s: mode %o tightened to 0700", what, path, stat.S_IMODE(st.st_mode))
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_private_dir(path: str | Path, what: str, *, create: bool = True) -> int:
    """Create ``path`` (mode 0700) if needed and return a descriptor of it after checking
    it is a real directory (not a symlink) owned by us; a looser mode is tightened to 0700."""
    path = Path(path)
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
    try:
        fd = os.open(path, DIR_FLAGS)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ConfigError(f"{what} {path} is a symlink: refusing to follow it") from None
        if e.errno == errno.ENOTDIR:
            raise ConfigError(f"{what} {path} is not a directory") from None
        raise ConfigError(f"cannot open {what} {path}: {e.strerror}") from None
    return _owned(fd, path, what)


def open_subdir(dir_fd: int, name: str, what: str) -> int:
    """``name`` inside the directory ``dir_fd`` (created 0700 if missing), checked like
    ``open_private_dir``."""
    try:
        os.mkdir(name, 0o700, dir_fd=dir_fd)
    except FileExistsError:
        pass
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        raise ConfigError(f"cannot open {what} {name}: {e.strerror}") from None
    return _owned(fd, name, what)


def create_file(dir_fd: int, name: str, mode: int = 0o600) -> int:
    """Create ``name`` under ``dir_fd`` exclusively (a leftover of ours is replaced; a
    symlink or anything else planted there is never followed)."""
    try:
        return os.open(name, CREATE_FLAGS, mode, dir_fd=dir_fd)
    except FileExistsError:
        os.unlink(name, dir_fd=dir_fd)
        return os.open(name, CREATE_FLAGS, mode, dir_fd=dir_fd)


class Cleared(int):
    """How many entries :func:`clear_dir` removed, with what it found that was not the
    daemon's: ``foreign`` (kind -> count) and ``deepest`` (the deepest entry's nesting)."""

    foreign: dict
    deepest: int

    def describe(self) -> str:
        """``1600 directories, 1 file, 3 symlinks, 1 fifo (nested 1602 deep)``."""
        parts = [f"{n} {kind if n == 1 else _PLURAL.get(kind, kind + 's')}"
                 for kind, n in sorted(self.foreign.items(), key=lambda kv: (-kv[1], kv[0]))]
        return ", ".join(parts) + f" (nested {self.deepest} deep)"


_PLURAL = {"directory": "directories"}
_KINDS = {stat.S_IFDIR: "directory", stat.S_IFREG: "file", stat.S_IFLNK: "symlink", stat.S_IFIFO: "fifo",
          stat.S_IFSOCK: "socket", stat.S_IFCHR: "device", stat.S_IFBLK: "device"}


def _kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "other")


def clear_dir(dir_fd: int, ours=None) -> Cleared:
    """Remove every entry of the directory ``dir_fd`` without recursion and without following
    links, whatever depth of tree someone left in it: each subdirectory met is emptied by
    moving its own subdirectories up into ``dir_fd`` (``rename``, under a fresh name) and
    unlinking the rest, then removed; so the work is iterative, at most two descriptors are
    open at a time, and neither the stack nor the descriptor table grows with the depth.

    ``ours(depth, name, kind)`` (``kind``: ``directory``, ``file``, ``symlink``, ``fifo``,
    ``socket``, ``device``; ``depth`` 1 for the entries of ``dir_fd``) says which entries the
    daemon makes there; the others are counted in the result's ``foreign``. The directory must
    be one nobody else can write (the daemon's): names are chosen against its listing."""
    n = 0
    foreign: dict[str, int] = {}
    deepest = 0
    moved: dict[str, tuple[int, str]] = {}      # a name given to a moved-up directory -> (depth, name)
    seq = 0

    def note(depth: int, name: str, kind: str) -> None:
        nonlocal deepest
        deepest = max(deepest, depth)
        if ours is not None and not ours(depth, name, kind):
            foreign[kind] = foreign.get(kind, 0) + 1

    while True:
        names = os.listdir(dir_fd)
        if not names:
            break
        taken = set(names)
        for name in names:
            depth, was = moved.pop(name, (1, name))
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            kind = _kind(st.st_mode)
            if kind != "directory":
                os.unlink(name, dir_fd=dir_fd)
                note(depth, was, kind)
                n += 1
                continue
            sub = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
            try:
                for child in os.listdir(sub):
                    ck = _kind(os.stat(child, dir_fd=sub, follow_symlinks=False).st_mode)
                    if ck == "directory":
                        while True:
                            seq += 1
                            up = f".kvfs-clear-{seq}"
                            if up not in taken:
                                break
                        os.rename(child, up, src_dir_fd=sub, dst_dir_fd=dir_fd)
                        taken.add(up)
                        moved[up] = (depth + 1, child)
                    else:
                        os.unlink(child, dir_fd=sub)
                        note(depth + 1, child, ck)
                        n += 1
            finally:
                os.close(sub)
            os.rmdir(name, dir_fd=dir_fd)
            note(depth, was, kind)
            n += 1
    out = Cleared(n)
    out.foreign, out.deepest = foreign, deepest
    return out


def _hex_name(name: str) -> bool:
    return len(name) == 16 and all(c in "0123456789abcdef" for c in name)


def grants_entry(depth: int, name: str, kind: str) -> bool:
    """What the daemon makes in a grants directory (kvfs/store/ownerlinks.py): ``<uid>/``
    directories holding links named by object id (``<uid>/links/`` in earlier versions)."""
    if depth == 1:
        return kind == "directory" and name.isdigit()
    if depth == 2:
        return (kind == "file" and _hex_name(name)) or (kind == "directory" and name == "links")
    return depth == 3 and kind == "file" and _hex_name(name)


def staging_entry(depth: int, name: str, kind: str) -> bool:
    """What the daemon makes in a staging directory: plain files, nothing nested."""
    return depth == 1 and kind == "file"


def check_shared_parent(path: str | Path, what: str) -> None:
    """A directory other users can write (``/dev/shm``) must be sticky, or another user
    could rename our directory away and put theirs in its place."""
    st = os.stat(path)
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX and st.st_uid != os.geteuid():
        raise ConfigError(f"{what} {path} is writable by other users and not sticky")


def make_unique_dir(parent: str | Path, prefix: str) -> tuple[Path, int]:
    """A new directory ``parent/prefix<random>`` (mode 0700, unpredictable, created by us:
    nothing planted in advance can be it) and a descriptor of it."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    return path, open_private_dir(path, "directory", create=False)


def remove_stale_dirs(parent: str | Path, prefix: str, before=None) -> int:
    """Remove ``parent/prefix*`` directories a dead daemon of ours left: only real
    directories owned by us whose lock no live daemon holds; never through a symlink.
    ``before(dir_fd)`` runs on each first (kvfs.store.names.retire)."""
    n = 0
    try:
        names = [e for e in os.listdir(parent) if e.startswith(prefix)]
    except OSError:
        return 0
    pfd = os.open(parent, DIR_FLAGS)
    try:
        for name in names:
            try:
                fd = os.open(name, DIR_FLAGS, dir_fd=pfd)
            except OSError:
                continue                       # a symlink (ELOOP) or gone: not ours
            try:
                st = os.fstat(fd)
                if st.st_uid != os.geteuid():
                    continue
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue                   # a live daemon's directory
                if before is not None:
                    before(fd)
                clear_dir(fd)
                os.rmdir(name, dir_fd=pfd)
                n += 1
            except OSError as e:
                log.warning("could not remove stale %s/%s: %s", parent, name, e)
            finally:
                os.close(fd)
    finally:
        os.close(pfd)
    if n:
        log.info("removed %d stale RAM-tier directories in %s", n, parent)
    return n


class Dir:
    """A directory held open by descriptor for a component's life, with the path it had
    when opened (for messages and for paths handed to fast-path readers)."""

    __slots__ = ("path", "fd")

    def __init__(self, path: str | Path, fd: int):
        self.path = Path(path)
        self.fd = fd

    def gone(self) -> bool:
        """True when the directory was removed under us (creating in it now fails)."""
        return os.fstat(self.fd).st_nlink == 0

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __str__(self) -> str:
        return str(self.path)


class DirLock:
    """An exclusive ``flock`` on ``<dir>/lock`` held for the owner's life; the file names
    the holder (``pid`` and what it serves) for the error a second owner gets."""

    def __init__(self, dir_fd: int, path: str | Path, what: str, holder: str):
        self.fd = -1
        try:
            fd = os.open("lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        except OSError as e:
            raise ConfigError(f"cannot open the lock file of {what} {path}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                who = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "another process"
            finally:
                os.close(fd)
            raise InUse(f"{what} {path} is in use by {who}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{holder}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def holder_text(mountpoint: str | None) -> str:
    """How a lock names its holder: ``kvfs pid N mounted at M`` (or ``kvfs fsck pid N``)."""
    if mountpoint:
        return f"kvfs pid {os.getpid()} mounted at {mountpoint}"
    return f"kvfs pid {os.getpid()} (fsck or another tool)"


def write_file_atomic(dir_fd: int, name: str, data: bytes) -> None:
    tmp = f".{name}.tmp"
    fd = create_file(dir_fd, tmp)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    os.fsync(dir_fd)


def read_file(dir_fd: int, name: str, limit: int = 1 << 16) -> bytes | None:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    try:
        return os.read(fd, limit)
    finally:
        os.close(fd)


__all__ = ["Dir", "open_private_dir", "open_subdir", "create_file", "clear_dir", "Cleared",
           "grants_entry", "staging_entry", "make_unique_dir",
           "remove_stale_dirs", "DirLock", "holder_text", "write_file_atomic", "read_file",
           "check_shared_parent"]
