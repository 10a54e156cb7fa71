"""``kvfs remote …``: talk to a remote volume without mounting (``kvfs remote probe URL``).

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


if __name__ == "__main__":
    remote()
