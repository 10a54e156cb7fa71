"""``kvfs stat`` and ``kvfs ls``: what is cached, where, and how hot."""
from __future__ import annotations

import errno
import json
import logging
import os
import stat as st
import time
from pathlib import Path

import click
from rich.table import Table

from kvfs import protocol
from kvfs.cli.common import fail, human, read_stats, stdout

log = logging.getLogger(__name__)

TIER_ORDER = ("ram", "nvme", "remote")
_COLUMNS = [  # (key, header, formatter)
    ("capacity", "capacity", human), ("used", "used", human), ("objects", "objects", str),
    ("hits", "hits", str), ("misses", "misses", str),
    ("bytes_read", "bytes read", human), ("bytes_written", "bytes written", human),
    ("demotions", "demotions", str), ("promotions", "promotions", str),
    ("evictions", "evictions", str), ("checksum_failures", "checksum failures", str),
    ("errors", "errors", str), ("state", "state", str), ("reconnects", "reconnects", str),
]


def _fmt(fn, v):
    return "-" if v is None else fn(v)


@click.command("stat")
@click.argument("mountpoint", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print the stats JSON as is.")
def stat_cmd(mountpoint, as_json):
    """Per-tier capacity, usage and counters of the kvfs mount at MOUNTPOINT."""
    data = read_stats(mountpoint)
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=True))
        return
    tiers = data.get("tiers") or {}
    names = [t for t in TIER_ORDER if t in tiers] + [t for t in tiers if t not in TIER_ORDER]
    table = Table(title=f"kvfs {data.get('mountpoint', mountpoint)}  (pid {data.get('pid', '?')})")
    table.add_column("", style="bold")
    for name in names:
        t = tiers[name] or {}
        down = " [red](unavailable)[/red]" if t.get("available") is False else ""
        table.add_column(name + down, justify="right")
    for key, header, fn in _COLUMNS:
        row = []
        for name in names:
            t = tiers[name] or {}
            cell = _fmt(fn, t.get(key))
            if key == "used" and t.get("capacity") and t.get("used") is not None:
                cell += f" ({100 * t['used'] / t['capacity']:.0f}%)"
            row.append(cell)
        table.add_row(header, *row)
    stdout.print(table)
    for name in names:
        t = tiers[name] or {}
        if t.get("last_error"):
            stdout.print(f"{name} last error: {t['last_error']}", markup=False)
    share = (tiers.get("remote") or {}).get("share")
    if share:                   # a shared remote volume (docs/scale-out.md)
        peers = share.get("tail", {}).get("peers", {})
        stdout.print(f"remote share: node {share['node_id']} (slot {share['slot']}, epoch {share['epoch']}, "
                     f"region {share['region']}), published {share['published']}, {share['view']} blocks "
                     f"of {len(peers)} other node(s) in view", markup=False)
        state = "fenced: " + share["fenced"] if share.get("fenced") else (
            "partitioned (not writing)" if share.get("partitioned") else "writing")
        held = ", ".join(f"{r} from {h.get('from_node') or 'slot ' + str(h['from_slot'])}"
                         + (f" ({h['inherited_objects']} of its blocks left, {h['reclaimed']} freed, "
                            f"{h['own_objects']} ours)" if "inherited_objects" in h else "")
                         for r, h in sorted(share.get("held", {}).items()))
        stdout.print(f"remote share lease: {share.get('lease', 0):g} s + grace {share.get('grace', 0):g} s, "
                     f"{state}, partitions {share.get('partitions', 0)}, takeovers {share.get('takeovers', 0)}"
                     + (f", holding region {held}" if held else ""), markup=False)
    tr = data.get("transport")
    if tr:
        pt = tr.get("passthrough") or {}
        how = tr.get("why") or f"kvfs's own, FUSE protocol {tr.get('protocol')}"
        stdout.print(f"transport: {tr.get('name')} ({how})", markup=False)
        stdout.print(f"passthrough: {pt.get('state', 'off')}"
                     + (f", {pt['opens']} opens, {pt['held']} inodes held now" if "opens" in pt else ""),
                     markup=False)
    sup = data.get("supervisor")
    if sup:                     # kvfs/supervisor.py: the daemon's restarts (issue 41)
        if sup.get("pid"):
            last = (sup.get("history") or [{}])[-1]
            stdout.print(f"supervisor: pid {sup['pid']}, daemon epoch {sup.get('epoch')}, "
                         f"{sup.get('restarts', 0)} restart(s)"
                         + (f"; last: {last.get('cause')}, pause {last['pause_s']:.3f} s"
                            if last.get("pause_s") is not None else
                            f"; last: {last['cause']}" if last.get("cause") else ""), markup=False)
        else:
            stdout.print(f"supervisor: {sup.get('state', 'off')}", markup=False)
    extras = {k: v for k, v in data.items()
              if k not in ("tiers", "pid", "mountpoint", "time", "started")
              and not isinstance(v, (dict, list))}
    for k in sorted(extras):
        stdout.print(f"{k}: {extras[k]}")


def _xattr(path: str, name: str) -> str | None:
    try:
        return os.getxattr(path, name, follow_symlinks=False).decode(errors="replace")
    except OSError as e:
        if e.errno in (errno.ENODATA, errno.ENOTSUP, errno.EPERM, errno.EINVAL, errno.EACCES):
            return None
        raise


def _int(v: str | None) -> int | None:
    try:
        return int(float(v)) if v is not None else None
    except ValueError:
        return None


def describe(path: str, name: str, dir_fd: int | None = None) -> dict:
    """One row of ``kvfs ls``: kind, size and the kvfs extended attributes. With ``dir_fd``,
    ``path`` is an entry of that open directory (no path length limit on deep trees)."""
    s = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
    kind = "dir" if st.S_ISDIR(s.st_mode) else "symlink" if st.S_ISLNK(s.st_mode) else \
        "file" if st.S_ISREG(s.st_mode) else "other"
    row: dict = {"name": name, "type": kind, "size": s.st_size}
    # the xattr calls take no dir_fd: reach the entry through the directory's /proc fd link
    xpath = path if dir_fd is None else f"/proc/self/fd/{dir_fd}/{path}"
    if kind == "file":
        row["tier"] = _xattr(xpath, "user.kvfs.tier")
        row["hits"] = _int(_xattr(xpath, "user.kvfs.hits"))
        atime = _xattr(xpath, "user.kvfs.atime")
        row["atime"] = float(atime) if atime and _int(atime) is not None else None
        pin = _xattr(xpath, "user.kvfs.pin")
        row["pinned"] = None if pin is None else pin.strip() == "1"
    elif kind == "symlink":
        row["target"] = os.readlink(path, dir_fd=dir_fd)
    return row


def _ago(ts: float | None) -> str:
    if ts is None:
        return "-"
    fmt = "%H:%M:%S" if time.time() - ts < 86400 else "%Y-%m-%d %H:%M"
    stamp = time.strftime(fmt, time.localtime(ts))
    dt = time.time() - ts
    rel = f"{dt:.0f}s" if dt < 120 else f"{dt / 60:.0f}m" if dt < 7200 else f"{dt / 3600:.0f}h"
    return f"{stamp} ({rel} ago)"


_MAX_OPEN_DIRS = 64      # directory fds ``kvfs ls -R`` keeps open while descending


class _Dir:
    """One directory being listed: its sorted entries, an fd (reopened through ``..`` of its
    child when it was closed to bound the open fds), and the name and path prefixes of its
    rows."""

    def __init__(self, fd: int, name_prefix: str, path_prefix: str, hide_control: bool):
        self.fd = fd
        self.name_prefix, self.path_prefix = name_prefix, path_prefix
        self.names = iter(sorted(n for n in os.listdir(fd) if not (hide_control and n == protocol.CONTROL_NAME)))

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _rows(p: Path, recursive: bool) -> list[dict]:
    """The rows of ``kvfs ls``: ``p`` itself if not a directory, else its entries (sorted),
    each directory followed by its own rows when ``recursive``.

    Iterative (a stack, depth first) and relative to open directory fds: a tree thousands of
    levels deep hits neither Python's recursion limit nor PATH_MAX. At most
    ``_MAX_OPEN_DIRS`` fds stay open; an ancestor whose fd was closed is reopened as ``..``
    of its child when the walk comes back up.
    """
    if not (p.is_dir() and not p.is_symlink()):
        return [describe(str(p), p.name) | {"path": str(p)}]
    rows: list[dict] = []
    stack = [_Dir(os.open(p, os.O_RDONLY | os.O_DIRECTORY), "", str(p) + os.sep, os.path.ismount(p))]
    try:
        while stack:
            top = stack[-1]
            n = next(top.names, None)
            if n is None:
                stack.pop()
                if stack and stack[-1].fd < 0:
                    stack[-1].fd = os.open("..", os.O_RDONLY | os.O_DIRECTORY, dir_fd=top.fd)
                top.close()
                continue
            try:
                row = describe(n, top.name_prefix + n, dir_fd=top.fd)
            except FileNotFoundError:              # removed while we list: not a row
                continue
            row["path"] = top.path_prefix + n
            rows.append(row)
            if recursive and row["type"] == "dir":
                try:
                    fd = os.open(n, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=top.fd)
                except (FileNotFoundError, NotADirectoryError):
                    continue
                try:
                    child = _Dir(fd, row["name"] + "/", row["path"] + os.sep, False)
                except BaseException:
                    os.close(fd)
                    raise
                stack.append(child)
                if len(stack) > _MAX_OPEN_DIRS:
                    stack[-1 - _MAX_OPEN_DIRS].close()
    finally:
        for d in stack:
            d.close()
    return rows


@click.command("ls")
@click.argument("paths", nargs=-1, type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="JSON output.")
@click.option("--recursive", "-R", is_flag=True, help="List directories recursively.")
@click.option("--tree", "namespace", metavar="NAMESPACE", default=None,
              help="Show a KV namespace directory as a prefix tree.")
def ls_cmd(paths, as_json, recursive, namespace):
    """List PATHs (default .) with size, tier, hits, last access and pin state of each file."""
    if namespace is not None:
        _tree(namespace, as_json)
        return
    groups: list[tuple[str, list[dict]]] = []
    for path in paths or (".",):
        try:
            groups.append((path, _rows(Path(path), recursive)))
        except FileNotFoundError:
            raise fail(f"no such file or directory: {path}") from None
        except OSError as e:
            raise fail(f"cannot list {path}: {e.strerror}") from None
    if as_json:
        click.echo(json.dumps([r for _, rows in groups for r in rows], indent=2))
        return
    for i, (path, rows) in enumerate(groups):
        if len(groups) > 1:
            stdout.print(("\n" if i else "") + f"[bold]{path}:[/]")
        stdout.print(_table(rows))


def _table(rows: list[dict]) -> Table:
    table = Table(box=None, pad_edge=False)
    for col, just in (("name", "left"), ("size", "right"), ("tier", "left"), ("hits", "right"),
                      ("last access", "left"), ("pinned", "left")):
        table.add_column(col, justify=just, overflow="fold" if col == "name" else "ellipsis",
                         no_wrap=col != "name")
    for r in rows:
        if r["type"] == "dir":
            table.add_row(f"[bold blue]{r['name']}/[/]", "-", "dir", "", "", "")
        elif r["type"] == "symlink":
            table.add_row(f"{r['name']} -> {r['target']}", "-", "link", "", "", "")
        else:
            pinned = "-" if r.get("pinned") is None else ("yes" if r["pinned"] else "no")
            table.add_row(r["name"], human(r["size"]), r.get("tier") or "-",
                          "-" if r.get("hits") is None else str(r["hits"]), _ago(r.get("atime")),
                          pinned)
    return table


def _tree(namespace: str, as_json: bool) -> None:
    if not os.path.isdir(namespace):
        raise fail(f"no such namespace directory: {namespace}")
    try:
        from kvfs.kv.tree import print_tree
    except Exception as e:  # noqa: BLE001 - any import failure means the KV layer is unusable
        raise fail(f"kvfs ls --tree needs the KV layer (kvfs.kv.tree), which is unavailable: {e}") \
            from None
    print_tree(namespace, as_json)
