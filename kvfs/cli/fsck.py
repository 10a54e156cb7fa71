"""``kvfs fsck``: offline check (and repair) of the index against the backing objects."""
from __future__ import annotations

import logging

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvfs.cli.common import fail, stderr, stdout
from kvfs.cli.mounting import build_config
from kvfs.errors import ConfigError, StoreError

log = logging.getLogger(__name__)


@click.command("fsck")
@click.option("--config", "config_file", metavar="FILE", default=None, help="TOML config file.")
@click.option("--nvme", metavar="DIR", default=None, help="NVMe tier directory.")
@click.option("--state", metavar="DIR", default=None, help="State (index) directory.")
@click.option("--remote", metavar="URL", default=None, help="Remote tier to check as well.")
@click.option("--repair", is_flag=True, help="Fix what can be fixed (drop bad entries, orphans).")
@click.option("--rebuild-remote", is_flag=True,
              help="Add index entries for objects found on the remote volume that the index lacks.")
def fsck_cmd(config_file, nvme, state, remote, repair, rebuild_remote):
    """Check the index against the backing objects, checksums and orphans (unmounted only)."""
    cfg = build_config(config_file, None, nvme=nvme, state=state, remote=remote)
    if not cfg.state_dir.is_dir():
        raise fail(f"no kvfs state directory at {cfg.state_dir}")
    try:
        from kvfs.build import fsck_layout
        from kvfs.store.fsck import run_fsck
    except Exception as e:  # noqa: BLE001 - an unusable fsck module is reported, not raised
        raise fail(f"fsck is unavailable: {e}") from None
    if logging.getLogger().level > logging.DEBUG:
        # fsck logs each problem as a warning; here they are printed once, below
        logging.getLogger("kvfs.store").setLevel(logging.ERROR)
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=stderr, transient=True)
    with progress:
        task = progress.add_task("fsck", total=None)

        def report(done: int, total: int, what: str) -> None:
            progress.update(task, completed=done, total=total or None, description=str(what)[:40])

        try:
            result = run_fsck(fsck_layout(cfg), repair=repair, rebuild_remote=rebuild_remote, progress=report)
        except (ConfigError, StoreError, OSError) as e:
            raise fail(f"fsck failed: {e}") from None
    problems = list(getattr(result, "problems", []))
    repaired = int(getattr(result, "repaired", 0))
    for p in problems:
        stdout.print(f"problem: {p}", markup=False)
    if result.rebuilt:
        click.echo(f"rebuilt {result.rebuilt} index entries from the tiers' object records")
    if not problems:
        click.echo(f"clean: {cfg.state_dir}")
        return
    click.echo(f"{len(problems)} problem(s), {repaired} repaired")
    if repair and repaired >= len(problems):
        return
    if not repair and repaired < len(problems):      # some are fixed by any run (foreign entries)
        click.echo("run again with --repair to fix them", err=True)
    raise SystemExit(1)
