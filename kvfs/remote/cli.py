"""``kvfs remote …``: talk to a remote volume without mounting (``kvfs remote probe URL``,
``kvfs remote status URL`` for a shared volume).

Registered by kvfs.cli with ``main.add_command(remote)``; also runs standalone as
``python -m kvfs.remote.cli``.
"""
from __future__ import annotations

import json
import logging
import sys

import click
import trio

from kvfs.errors import ConfigError, StoreError
from kvfs.remote.errors import NvmeError

log = logging.getLogger(__name__)


async def _probe(target: str) -> dict:
    from kvfs.remote import make_volume
    from kvfs.remote.volume_format import Superblock
    vol = make_volume(target)
    await vol.open()
    try:
        ident = vol.identity()
        try:
            raw = await vol.read(0, max(4096, vol.block_size))
            sb = Superblock.unpack(raw)
            ident["kvfs_volume"] = ("blank" if sb is None else
                                    f"uuid {sb.volume_uuid.hex()} owner {sb.owner} ({sb.region} bytes)")
        except ValueError as e:
            ident["kvfs_volume"] = f"none ({e})"
        return ident
    finally:
        await vol.close()


def _fail(msg: str) -> None:
    click.echo(f"kvfs remote: {msg}", err=True)
    sys.exit(1)


@click.group("remote")
def remote() -> None:
    """Remote tier tools (NVMe/TCP volumes, block devices)."""


@remote.command("probe")
@click.argument("url")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a table")
def probe(url: str, as_json: bool) -> None:
    """Connect to URL (nvme-tcp://HOST:PORT/SUBNQN?… or a device/file) and show its identity."""
    try:
        info = trio.run(_probe, url)
    except (ConfigError, StoreError, NvmeError, OSError) as e:
        _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    if as_json:
        click.echo(json.dumps(info, indent=2, sort_keys=True))
        return
    from rich.console import Console
    from rich.table import Table
    t = Table(title=f"remote {info.get('url', url)}", show_header=True)
    t.add_column("field", style="bold")
    t.add_column("value")
    for k, v in info.items():
        t.add_row(k, str(v))
    Console().print(t)


async def _status(target: str, lease: float, grace: float | None, sample: float) -> dict:
    from kvfs.remote import make_volume
    from kvfs.remote.share.status import volume_status
    vol = make_volume(target, read_only=True)
    try:
        await vol.open()
    except (StoreError, OSError) as e:
        raise ConfigError(f"cannot reach {target.split('?', 1)[0]}: {str(e).splitlines()[0] if str(e) else e}")
    try:
        return await volume_status(vol, lease=lease, grace=grace, sample=sample, name=target.split("?", 1)[0])
    finally:
        await vol.close()


@remote.command("status")
@click.argument("url")
@click.option("--mount", "mountpoint", default=None, metavar="DIR",
              help="a kvfs mount on this volume: add its view lag behind each node's log")
@click.option("--lease", type=float, default=10.0, show_default=True,
              help="the nodes' share_lease, seconds (a node is dead after lease + grace)")
@click.option("--grace", type=float, default=None, help="the nodes' share_grace (default lease/2)")
@click.option("--sample", type=float, default=0.0, show_default=True,
              help="read the slots twice, SECONDS apart: alive = its heartbeat moved meanwhile")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of tables")
def status(url: str, mountpoint: str | None, lease: float, grace: float | None, sample: float,
           as_json: bool) -> None:
    """Show a shared (format 2) volume: nodes, epochs, heartbeats, regions, logs (read-only)."""
    from kvfs.remote.share.status import read_stats, view_lag
    if lease <= 0 or (grace is not None and grace < 0) or sample < 0:
        _fail("--lease must be > 0, --grace and --sample >= 0")
    try:
        info = trio.run(_status, url, lease, grace, sample)
        if mountpoint is not None:
            info["view"] = view_lag(info, read_stats(mountpoint))
    except (ConfigError, StoreError, NvmeError, OSError) as e:
        _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    if as_json:
        click.echo(json.dumps(info, indent=2, sort_keys=True))
        return
    _print_status(info)


def _print_status(info: dict) -> None:
    import shutil
    from rich.console import Console
    from rich.table import Table
    con = Console(highlight=False, width=max(100, shutil.get_terminal_size((140, 24)).columns))
    con.print(f"shared volume {info['volume']} uuid {info['volume_uuid']}: {len(info['nodes'])} of "
              f"{info['max_nodes']} node slots used, {info['regions_total']} regions of "
              f"{info['region_bytes']} bytes, logs of {info['log_entries']} entries; "
              f"dead after {info['lease'] + info['grace']:.1f} s without a heartbeat")
    t = Table(title="nodes")
    for c in ("slot", "node", "epoch", "heartbeat", "age s", "state", "regions", "log head", "oldest", "wrapped"):
        t.add_column(c)
    for n in info["nodes"]:
        lg = n.get("log", {})
        t.add_row(str(n["slot"]), n.get("node_id", "?"), str(n.get("epoch", "")), str(n.get("heartbeat", "")),
                  "" if n.get("heartbeat_age") is None else f"{n['heartbeat_age']:.1f}", n["state"],
                  ",".join(map(str, n.get("regions", []))) + (f" (lost {n['lost_regions']})"
                                                             if n.get("lost_regions") else ""),
                  str(lg.get("head", "")), str(lg.get("oldest", "")), "yes" if lg.get("wrapped") else "no")
    con.print(t)
    t = Table(title="regions")
    for c in ("region", "owner slot", "taken over from", "objects", "used", "fill"):
        t.add_column(c)
    for r in info["regions"]:
        fr = r.get("taken_over_from")
        t.add_row(str(r["region"]), ",".join(map(str, r["owner_slots"] or [])) or "-",
                  f"{fr['node_id']} (slot {fr['slot']}, epoch {fr['epoch']})" if fr else "",
                  str(r.get("objects", "")), str(r.get("used", r.get("volume", ""))),
                  f"{100 * r['fill']:.1f} %" if "fill" in r else "")
    con.print(t)
    v = info.get("view")
    if v:
        t = Table(title=f"view of node {v['node_id']} (slot {v['slot']}): {v['polls']} polls, "
                        f"{v['rescans']} rescans")
        for c in ("node", "next seq", "behind", "of ring", "rescan due"):
            t.add_column(c)
        for nid, p in v["peers"].items():
            t.add_row(nid, str(p["next_seq"]), str(p["behind"]), f"{100 * p['wrap_risk']:.1f} %",
                      "yes" if p["needs_rescan"] else "no")
        con.print(t)


if __name__ == "__main__":
    remote()
