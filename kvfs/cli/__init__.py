"""The ``kvfs`` command: mount, umount, stat, ls, top, events, fsck, bench (and ``remote``).

Every error is one line on stderr (``kvfs: error: ...``) with a non-zero exit.
"""
from __future__ import annotations

import logging
import sys

import click

from kvfs import __version__
from kvfs.cli.bench_cmd import bench_cmd
from kvfs.cli.fsck import fsck_cmd
from kvfs.cli.inspect import ls_cmd, stat_cmd
from kvfs.cli.mounting import mount_cmd, umount_cmd
from kvfs.cli.quota import quota_cmd
from kvfs.cli.restart import restart_cmd, upgrade_cmd
from kvfs.cli.top import events_cmd, top_cmd

log = logging.getLogger(__name__)


class _Group(click.Group):
    """A click group whose errors, usage errors included, are a single line."""

    def main(self, args=None, prog_name="kvfs", **kwargs):  # noqa: D401
        kwargs.pop("standalone_mode", None)
        try:
            rv = super().main(args=args, prog_name=prog_name, standalone_mode=False, **kwargs)
        except click.exceptions.Abort:
            click.echo("kvfs: error: aborted", err=True)
            sys.exit(130)
        except click.ClickException as e:
            msg = " ".join(e.format_message().split())
            click.echo(f"kvfs: error: {msg}", err=True)
            sys.exit(e.exit_code)
        except KeyboardInterrupt:
            click.echo("kvfs: error: interrupted", err=True)
            sys.exit(130)
        sys.exit(rv if isinstance(rv, int) else 0)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvfs")
@click.option("--verbose", "-v", is_flag=True, help="Log what the command does (to stderr).")
def main(verbose):
    """kvfs: a tiered (RAM, NVMe, remote NVMe/TCP) KV-cache filesystem for LLM inference."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")


for _cmd in (mount_cmd, umount_cmd, stat_cmd, ls_cmd, fsck_cmd, bench_cmd, top_cmd, events_cmd, quota_cmd,
             restart_cmd, upgrade_cmd):
    main.add_command(_cmd)


def _add_remote() -> None:
    try:
        from kvfs.remote.cli import remote
    except Exception as e:  # noqa: BLE001 - a missing or broken remote layer must not break kvfs
        log.debug("kvfs remote unavailable: %s", e)
        return
    main.add_command(remote)


_add_remote()
