"""Helpers shared by the kvfs subcommands: one-line errors, processes, the stats file."""
from __future__ import annotations

import errno
import json
import logging
import os
import time
from pathlib import Path

import click
from rich.console import Console

from kvfs import protocol
from kvfs.proc import mounts, pid_alive  # noqa: F401  (pid_alive: re-exported for the CLI)

log = logging.getLogger(__name__)

STATS_NAME = os.path.join(protocol.CONTROL_NAME, protocol.STATS_FILE)
stdout = Console(highlight=False)
stderr = Console(stderr=True, highlight=False)


class CLIError(click.ClickException):
    """A one-line error: printed as ``kvfs: error: MESSAGE`` with a non-zero exit."""

    exit_code = 1


def fail(message: str, code: int = 1) -> "CLIError":
    e = CLIError(message)
    e.exit_code = code
    return e


def wait_until(predicate, timeout: float, interval: float = 0.02) -> bool:
    """Poll ``predicate`` until true or ``timeout`` seconds pass; returns the last result."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def mount_fstype(path: str | os.PathLike, mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """The filesystem type mounted at ``path`` (e.g. ``fuse.kvfs``), or None if nothing is.

    Read from the kernel's mount table, never by ``stat``-ing the mountpoint: the mount of a
    dead FUSE daemon answers ENOTCONN, so ``os.path.ismount`` calls it "not a mountpoint".
    With several mounts stacked on ``path``, the last one (the visible one) counts.
    """
    p = os.path.abspath(os.fspath(path))
    # the parent resolved, the last name as given: realpath() would lstat the mountpoint itself,
    # which waits on a stopped daemon (kvfs umount --lazy); only a name no mount matches is
    # resolved in full (a symlink to a mountpoint)
    near = os.path.join(os.path.realpath(os.path.dirname(p)), os.path.basename(p))
    try:
        found = _fstype_at(mountinfo, {p, near})
        if found is None:
            far = os.path.realpath(p)
            if far not in (p, near):
                found = _fstype_at(mountinfo, {far})
    except OSError as e:
        log.debug("cannot read %s: %s", mountinfo, e)
        return None
    return found


def _fstype_at(mountinfo: str, wants: set[str]) -> str | None:
    found = None
    for m in mounts(mountinfo):
        if m.mountpoint in wants:
            found = m.fstype
    return found


KVFS_FSTYPES = ("fuse.kvfs", "fuse")     # the daemon mounts with subtype=kvfs


def read_stats(mountpoint: str | os.PathLike) -> dict:
    """The parsed ``.kvfs/stats`` of a kvfs mount, or a CLIError that says why not."""
    mp = Path(mountpoint)
    if mount_fstype(mp) is None:         # the mount table: a dead daemon's mount fails stat()
        if not os.path.lexists(mp):
            raise fail(f"no such directory: {mp}")
        raise fail(f"not a mountpoint: {mp}")
    try:
        with open(mp / STATS_NAME, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise fail(f"not a kvfs mount (no {STATS_NAME}): {mp}") from None
    except OSError as e:
        if e.errno == errno.ENOTCONN:
            raise fail(f"the kvfs daemon of {mp} is gone (transport endpoint not connected); "
                       f"run: fusermount3 -u -z {mp}") from None
        raise fail(f"cannot read {mp / STATS_NAME}: {e.strerror}") from None
    try:
        return json.loads(raw)
    except ValueError as e:
        raise fail(f"{mp / STATS_NAME} is not valid JSON: {e}") from None


def human(n: int | float | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"
