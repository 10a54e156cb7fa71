"""``kvfs quota``: byte quotas per namespace (top-level directory) of a mount (kvfs.quota)."""
from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import click
from rich.table import Table

from kvfs.cli.common import fail, human, read_stats, stdout
from kvfs.errors import ConfigError
from kvfs.units import parse_size

log = logging.getLogger(__name__)

XATTR = "user.kvfs.quota"


def _namespace_dir(mountpoint: str, path: str) -> Path:
    """``path`` (absolute, or relative to the mountpoint) as a top-level directory of the mount."""
    mp = Path(mountpoint).resolve()
    p = Path(path)
    p = p if p.is_absolute() else mp / p
    p = Path(os.path.normpath(p))
    if p.parent != mp:
        raise fail(f"a quota is set on a top-level directory of {mp}, not {p}")
    return p


@click.group("quota")
def quota_cmd():
    """Byte quotas per namespace (top-level directory) of a kvfs mount."""


@quota_cmd.command("set")
@click.argument("mountpoint", type=click.Path())
@click.argument("path")
@click.argument("size")
def quota_set(mountpoint, path, size):
    """Limit the namespace PATH of MOUNTPOINT to SIZE (e.g. 64GiB; root only)."""
    read_stats(mountpoint)
    try:
        parse_size(size)
    except ConfigError as e:
        raise fail(str(e)) from None
    _set(_namespace_dir(mountpoint, path), size.encode())


@quota_cmd.command("rm")
@click.argument("mountpoint", type=click.Path())
@click.argument("path")
def quota_rm(mountpoint, path):
    """Remove the quota of the namespace PATH of MOUNTPOINT."""
    read_stats(mountpoint)
    _set(_namespace_dir(mountpoint, path), b"none")


def _set(d: Path, value: bytes) -> None:
    try:
        os.setxattr(d, XATTR, value)
    except OSError as e:
        why = {errno.EPERM: "only root sets quotas", errno.ENOENT: "no such directory",
               errno.EINVAL: "not a top-level directory or a bad size"}.get(e.errno, e.strerror)
        raise fail(f"cannot set the quota of {d}: {why}") from None


@quota_cmd.command("ls")
@click.argument("mountpoint", type=click.Path())
def quota_ls(mountpoint):
    """Quotas of MOUNTPOINT with their usage."""
    q = read_stats(mountpoint).get("quotas") or {}
    table = Table(title=f"quotas of {mountpoint}")
    for col in ("namespace", "limit", "used", "use%"):
        table.add_column(col, justify="left" if col == "namespace" else "right")
    for ns, row in (q.get("limits") or {}).items():
        pct = f"{100 * row['used'] / row['limit']:.0f}%" if row["limit"] else "-"
        table.add_row(ns, human(row["limit"]), human(row["used"]), pct)
    stdout.print(table)
    stdout.print(f"evicted to stay within quotas: {q.get('evicted', 0)}; writes refused (EDQUOT): "
                 f"{q.get('refused', 0)}")
