"""What a running daemon serves, written where ``kvfs umount`` finds it after the daemon died.

A live daemon answers ``.kvfs/stats``; a dead one's mount answers ENOTCONN, and its state
directory, instance and RAM tier are then known nowhere else. So the daemon writes one small
record per mount when it is ready, ``<run dir>/mount-<hash of the mountpoint>.json``, and
removes it when it exits cleanly. ``kvfs umount`` of a mount whose daemon is dead reads it to
say what the next mount will drop (the index's tally, read offline: kvfs/store/tally.py) and
to unmount the dead daemon's RAM-tier tmpfs.

The run directory is ``/run/kvfs`` for root, ``$XDG_RUNTIME_DIR/kvfs`` (else
``~/.cache/kvfs/run``) for others: private to the user (0700), and a record is believed only
if that directory and the file are the reader's own and nobody else may write them (a record
decides what root's ``kvfs umount`` unmounts).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import stat
from pathlib import Path

log = logging.getLogger(__name__)


def run_dir() -> Path:
    if os.geteuid() == 0:
        return Path("/run/kvfs")
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "kvfs"
    return Path.home() / ".cache" / "kvfs" / "run"


def record_path(mountpoint: str) -> Path:
    digest = hashlib.sha256(os.path.abspath(mountpoint).encode("utf-8", "surrogateescape")).hexdigest()
    return run_dir() / f"mount-{digest[:24]}.json"


def _private(st: os.stat_result) -> bool:
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022


def write(mountpoint: str, info: dict) -> None:
    """The record of the mount at ``mountpoint`` (``info`` plus the mountpoint); a failure is
    logged, never raised (the mount serves without it)."""
    path = record_path(mountpoint)
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(path.parent)
        if not stat.S_ISDIR(st.st_mode) or not _private(st):
            raise OSError(f"{path.parent} is not a private directory of ours")
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({**info, "mountpoint": os.path.abspath(mountpoint)}, f)
        os.replace(tmp, path)
        _prune(path.parent, keep=path.name)
    except OSError as e:
        log.warning("could not write the mount record %s: %s (kvfs umount of this mount after "
                    "the daemon dies will not know its state directory)", path, e)


def _prune(d: Path, keep: str) -> None:
    """Remove the records of daemons that are gone and whose mounts are too (a mount detached
    by hand, a test's teardown): a record stays while its mountpoint is still mounted."""
    from kvfs.proc import mounts, pid_alive
    try:
        names = [n for n in os.listdir(d) if n.startswith("mount-") and n.endswith(".json") and n != keep]
        if not names:
            return
        mounted = {m.mountpoint for m in mounts() if m.fstype.startswith("fuse")}
    except OSError:
        return
    for name in names:
        try:
            with open(d / name, "rb") as f:
                info = json.loads(f.read(1 << 20))
            pid, mp = info.get("pid"), info.get("mountpoint")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(pid, int) and not pid_alive(pid) and mp not in mounted:
            with contextlib.suppress(OSError):
                os.unlink(d / name)


def read(mountpoint: str) -> dict | None:
    """The record of ``mountpoint``, or None (none, not ours, or not readable)."""
    path = record_path(mountpoint)
    try:
        dst = os.lstat(path.parent)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not (stat.S_ISDIR(dst.st_mode) and _private(dst) and stat.S_ISREG(st.st_mode) and _private(st)):
            log.warning("ignoring the mount record %s: not private to this user", path)
            return None
        with os.fdopen(fd, "rb") as f:
            fd = -1
            info = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return None
    finally:
        if fd >= 0:
            os.close(fd)
    if not isinstance(info, dict) or info.get("mountpoint") != os.path.abspath(mountpoint):
        return None
    return info


def remove(mountpoint: str, pid: int | None = None) -> None:
    """Remove the record of ``mountpoint`` (only the daemon ``pid``'s, when given)."""
    if pid is not None:
        info = read(mountpoint)
        if info is None or info.get("pid") != pid:
            return
    with contextlib.suppress(OSError):
        os.unlink(record_path(mountpoint))
