"""``kvfs top``: a live view of a mount (tiers, rates, top namespaces, remote state), and
``kvfs events``: follow ``.kvfs/events``.

Both read the mount's control files only (``.kvfs/stats``, ``.kvfs/events``): they need no
connection to the daemon and work for any user who can read those files.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time

import click
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from kvfs import protocol
from kvfs.cli.common import fail, human, read_stats

log = logging.getLogger(__name__)

TIER_ORDER = ("ram", "nvme", "remote")
TOP_NAMESPACES = 10


def _rate(new: dict, old: dict | None, key: str, dt: float) -> float | None:
    if old is None or dt <= 0:
        return None
    return max(0.0, (new.get(key, 0) - old.get(key, 0)) / dt)


def _hit_rate(new: dict, old: dict | None) -> str:
    """Hit rate over the interval; the whole mount's life when nothing happened in it."""
    hits, misses = new.get("hits", 0), new.get("misses", 0)
    if old is not None and (hits - old.get("hits", 0)) + (misses - old.get("misses", 0)) > 0:
        hits, misses = hits - old.get("hits", 0), misses - old.get("misses", 0)
    return f"{100 * hits / (hits + misses):.0f}%" if hits + misses else "-"


def _per_s(v: float | None, fn=None) -> str:
    if v is None:
        return "-"
    return f"{fn(v)}/s" if fn else f"{v:.1f}/s"


def _h(n) -> str:
    return human(n).replace(" ", "").replace("iB", "")


def tier_table(new: dict, old: dict | None, dt: float) -> Table:
    """Per tier: used, objects, hit rate, bytes in (written) and out (read) per second,
    demotions and evictions per second, state (remote: connection state and reconnects)."""
    tiers = new.get("tiers") or {}
    prev = (old or {}).get("tiers") or {}
    table = Table(title="tiers", expand=True)
    for col in ("tier", "used", "objs", "hit%", "in", "out", "demote", "evict", "state"):
        table.add_column(col, justify="left" if col in ("tier", "state") else "right")
    names = [t for t in TIER_ORDER if t in tiers] + [t for t in tiers if t not in TIER_ORDER]
    for name in names:
        t, o = tiers[name], prev.get(name)
        pct = f" {100 * t['used'] / t['capacity']:.0f}%" if t.get("capacity") else ""
        state = t.get("state") or ("up" if t.get("available", True) else "unavailable")
        if "reconnects" in t:
            state += f" ({t['reconnects']} reconn.)"
        table.add_row(name, f"{_h(t.get('used'))}/{_h(t.get('capacity'))}{pct}",
                      str(t.get("objects", 0)), _hit_rate(t, o),
                      _per_s(_rate(t, o, "bytes_written", dt), _h),
                      _per_s(_rate(t, o, "bytes_read", dt), _h),
                      _per_s(_rate(t, o, "demotions", dt)), _per_s(_rate(t, o, "evictions", dt)), state)
    return table


def namespace_table(new: dict, old: dict | None, dt: float, limit: int = TOP_NAMESPACES) -> Table:
    nss = new.get("namespaces") or {}
    prev = (old or {}).get("namespaces") or {}
    table = Table(title=f"top namespaces (by bytes, {min(limit, len(nss))} of {len(nss)})", expand=True)
    for col in ("namespace", "bytes", "blocks", "hits", "misses", "hit rate"):
        table.add_column(col, justify="left" if col == "namespace" else "right")
    for name, c in sorted(nss.items(), key=lambda kv: (-kv[1]["bytes"], kv[0]))[:limit]:
        o = prev.get(name)
        table.add_row(name, _h(c["bytes"]), str(c["blocks"]), _per_s(_rate(c, o, "hits", dt)),
                      _per_s(_rate(c, o, "misses", dt)), _hit_rate(c, o))
    return table


def frame(new: dict, old: dict | None, dt: float):
    """One screen: a header line, the tier table, the namespace table."""
    up = new.get("uptime", 0)
    ev = new.get("events") or {}
    head = Text.assemble(
        ("kvfs top ", "bold"), f"{new.get('mountpoint', '?')}  pid {new.get('pid', '?')}  up {up:.0f}s  ",
        f"objects {new.get('objects', 0)}  open {new.get('open_handles', 0)}  ",
        f"writing {new.get('writing', 0)}  leases {new.get('leases', 0)}  ",
        ("settled" if new.get("settled") else "moving", "green" if new.get("settled") else "yellow"),
        f"  event readers {ev.get('readers', 0)}",
        f"  admission drops {sum((new.get('admission_dropped') or {}).values())}",
        f"  deadline misses {sum((new.get('deadline_exceeded') or {}).values())}")
    return Group(head, tier_table(new, old, dt), namespace_table(new, old, dt))


def quit_on_ctrl_c() -> None:
    """Ctrl-C (SIGINT) is how these views stop, also when started from a context that
    ignores SIGINT (a background job of a non-interactive shell passes SIG_IGN on, and Python
    then never raises KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)


@click.command("top")
@click.argument("mountpoint", type=click.Path())
@click.option("--interval", "-n", type=click.FloatRange(min=0.05), default=1.0, show_default=True,
              help="Seconds between refreshes (and between the two samples of --once).")
@click.option("--once", is_flag=True, help="Print one frame (rates over one interval) and exit.")
def top_cmd(mountpoint, interval, once):
    """Live view of the kvfs mount at MOUNTPOINT: tiers, rates, top namespaces (Ctrl-C quits)."""
    quit_on_ctrl_c()
    console = Console(highlight=False)
    old = read_stats(mountpoint)
    t_old = time.monotonic()
    if once:
        time.sleep(interval)
        new = read_stats(mountpoint)
        console.print(frame(new, old, time.monotonic() - t_old))
        return
    try:
        with Live(frame(old, None, 0), console=console, screen=True, auto_refresh=False) as live:
            while True:
                time.sleep(interval)
                new, t_new = read_stats(mountpoint), time.monotonic()
                live.update(frame(new, old, t_new - t_old), refresh=True)
                old, t_old = new, t_new
    except KeyboardInterrupt:
        return


@click.command("events")
@click.argument("mountpoint", type=click.Path())
@click.option("--count", "-c", type=click.IntRange(min=1), default=None,
              help="Exit after this many events.")
@click.option("--idle", is_flag=True, help="Also print the idle lines (one per second without events).")
def events_cmd(mountpoint, count, idle):
    """Follow the KV events of the mount at MOUNTPOINT (JSON lines, see docs/operations.md)."""
    quit_on_ctrl_c()
    read_stats(mountpoint)                    # one-line errors for a missing or dead mount
    path = os.path.join(mountpoint, protocol.CONTROL_NAME, protocol.EVENTS_FILE)
    try:
        f = open(path, "rb", buffering=0)
    except OSError as e:
        raise fail(f"cannot open {path}: {e.strerror}") from None
    n = 0
    buf = b""
    try:
        with f:
            while count is None or n < count:
                chunk = f.read(1 << 16)
                if not chunk:                 # the daemon is shutting down
                    return
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if not idle and line.startswith(b'{"event":"idle"'):
                        continue
                    sys.stdout.write(line.decode() + "\n")
                    n += 1
                    if count is not None and n >= count:
                        break
                sys.stdout.flush()
    except KeyboardInterrupt:
        return
    except OSError as e:
        raise fail(f"reading {path}: {e.strerror}") from None


def load_events(text: str) -> list[dict]:
    """Parse ``kvfs events`` output (for scripts and tests)."""
    return [json.loads(line) for line in text.splitlines() if line.strip()]
