"""``kvfs bench``: foundation benchmarks, each side by side with its physical baseline."""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import click

from kvfs.protocol import ALIGN
from kvfs.cli.common import fail, stderr

log = logging.getLogger(__name__)


@click.command("bench")
@click.option("--dir", "base", metavar="DIR", default=".kvfs-bench", show_default=True,
              help="Scratch directory on the disk under test (NVMe dir and O_DIRECT baseline).")
@click.option("--tmpfs", metavar="DIR", default="/dev/shm", show_default=True,
              help="tmpfs directory for the in-memory baseline.")
@click.option("--size", metavar="SIZE", default="256MiB", show_default=True,
              help="Size of the file read and written sequentially.")
@click.option("--block", metavar="SIZE", default="1MiB", show_default=True,
              help="Size of each read/write call (page-aligned buffer).")
@click.option("--runs", type=click.IntRange(1, 99), default=5, show_default=True,
              help="Runs per measurement; the median is reported.")
@click.option("--lookup-files", type=click.IntRange(1), default=10000, show_default=True,
              help="Files stat()ed by the lookup benchmark.")
@click.option("--small-objects", "small", type=click.IntRange(0), default=100000,
              show_default=True, help="Small objects for the remount/RSS benchmark (0 skips).")
@click.option("--full", is_flag=True, help="Also run the remount/RSS benchmark with 1M objects.")
@click.option("--only", metavar="NAMES", default=None,
              help="Comma-separated subset: write,read,nvme,lookup,remount,runtime "
                   "(runtime: the runtime storage patterns on kvfs, kvfs on pyfuse3, a floor FUSE "
                   "fs and a plain directory; only when named).")
@click.option("--quick", is_flag=True, help="runtime: tiny sizes (a smoke run, not a measurement).")
@click.option("--rounds", type=click.IntRange(1, 99), default=5, show_default=True,
              help="runtime: interleaved rounds; medians and min-max over them.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON on stdout.")
@click.option("--write-docs", metavar="FILE", default=None,
              help="Write the results (and a PNG plot beside it) into FILE, e.g. docs/benchmarks.md.")
def bench_cmd(base, tmpfs, size, block, runs, lookup_files, small, full, only, quick, rounds, as_json,
              write_docs):
    """Measure kvfs against tmpfs and O_DIRECT on the same machine, in one run; report ratios."""
    from kvfs.units import parse_size
    from kvfs.errors import ConfigError
    try:
        size_b, block_b = parse_size(size), parse_size(block)
    except ConfigError as e:
        raise fail(str(e)) from None
    if block_b < ALIGN or block_b % ALIGN or size_b % block_b or size_b <= 0:
        raise fail(f"--block must be a multiple of {ALIGN} and --size a positive multiple of --block")
    names = {"write", "read", "nvme", "lookup", "remount"}
    selected = set(names) if not only else {n.strip() for n in only.split(",") if n.strip()}
    if not selected <= names | {"runtime"}:
        raise fail(f"unknown benchmark(s) in --only: {', '.join(sorted(selected - names - {'runtime'}))}")
    if not Path(tmpfs).is_dir():
        raise fail(f"tmpfs directory does not exist: {tmpfs}")
    if "runtime" in selected:
        _runtime(Path(base), Path(tmpfs), rounds, quick, as_json, write_docs)
        selected.discard("runtime")
        if not selected:
            return
    from kvfs import bench
    counts = [n for n in ([small] if small else []) + ([1_000_000] if full else [])]
    try:
        results = bench.run_all(Path(base), Path(tmpfs), size_b, block_b, runs,
                                lookup_files, counts, selected, console=stderr)
    except bench.BenchError as e:
        raise fail(str(e)) from None
    if as_json:
        click.echo(json.dumps(results, indent=2))
    else:
        bench.print_results(results, console=stderr)
    if write_docs:
        from kvfs.cli import bench_report
        png = bench_report.write_docs(results, Path(write_docs))
        stderr.print(f"wrote {write_docs}" + (f" and {png}" if png else " (no plot: matplotlib missing)"))


def _runtime(base: Path, tmpfs: Path, rounds: int, quick: bool, as_json: bool, write_docs) -> None:
    """``--only runtime``: benchmarks/runtime_patterns.py (in a source checkout)."""
    import importlib.util
    import kvfs
    src = Path(kvfs.__file__).resolve().parents[1] / "benchmarks" / "runtime_patterns.py"
    if not src.is_file():
        raise fail(f"the runtime benchmark needs a source checkout ({src} is missing)")
    spec = importlib.util.spec_from_file_location("kvfs_runtime_patterns", src)
    rp = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = rp              # dataclasses look their module up there
    spec.loader.exec_module(rp)
    from kvfs import bench
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    try:
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                      console=stderr, transient=True) as prog:
            task = prog.add_task("starting", total=None)
            res = rp.run(base, tmpfs, rounds, rp.QUICK if quick else rp.Sizes(),
                         progress=lambda s: prog.update(task, description=s))
    except bench.BenchError as e:
        raise fail(str(e)) from None
    if as_json:
        click.echo(json.dumps({"runtime": res}, indent=2))
    else:
        stderr.print(rp.table(res))
        stderr.print(rp.passthrough_table(res))
    if write_docs:
        png = rp.write_docs(res, Path(write_docs))
        stderr.print(f"wrote {write_docs}" + (f" and {png}" if png else " (no plot: matplotlib missing)"))
