"""What /proc says about processes and mounts (one parser each, for the CLI, benchmarks and tests)."""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Iterator, NamedTuple

log = logging.getLogger(__name__)

MOUNTINFO = "/proc/self/mountinfo"


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie counts as gone (PID 1 may never reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def unescape_mountinfo(field: str) -> str:
    """A /proc mountinfo path field: spaces, tabs, newlines and backslashes are octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


class Mount(NamedTuple):
    device: str          # major:minor
    mountpoint: str      # unescaped
    fstype: str
    options: dict        # super options


def mounts(mountinfo: str = MOUNTINFO) -> Iterator[Mount]:
    """The kernel's mount table, in its order (a later mount on a path hides an earlier one).
    Raises OSError if ``mountinfo`` cannot be read."""
    with open(mountinfo, encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            left, sep, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if not sep or len(fields) < 5:
                continue
            opts = dict(o.partition("=")[::2] for o in tail[2].split(",")) if len(tail) > 2 else {}
            yield Mount(fields[2], unescape_mountinfo(fields[4]), tail[0] if tail else "", opts)


def filesystem_of(path: str | Path) -> tuple[str, str, dict[str, str]]:
    """``(mount point, filesystem type, super options)`` of the mount holding ``path`` (an
    existing path), from /proc/self/mountinfo: the longest mount point above it."""
    real = os.path.realpath(path)
    best = ("", "", {})
    with open(MOUNTINFO) as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if len(fields) < 5 or len(tail) < 3:
                continue
            mnt = fields[4].replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")
            inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
            if inside and len(mnt) >= len(best[0]):
                opts = dict(o.partition("=")[::2] for o in tail[2].split(","))
                best = (mnt, tail[0], opts)
    return best
