"""The test session's pytest hooks (``tests/conftest.py`` registers them): a base directory
per session, mount tests skipped without ``/dev/fuse``, and a watchdog that frees a test
stuck in a FUSE request."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from support.mount import HAVE_FUSE


def pytest_configure(config):
    """Each session gets a base directory of its own outside ``/tmp/pytest-of-<user>`` unless
    ``--basetemp`` names one: tests that let another user reach a mount (``reachable``) make
    its ancestors traversable, and a second pytest session starting meanwhile resets
    ``/tmp/pytest-of-<user>`` to 0700 (two test runs side by side on one machine failed so)."""
    if config.option.basetemp is None and not hasattr(config, "workerinput"):
        import tempfile
        config.option.basetemp = tempfile.mkdtemp(prefix="kvfs-pytest-")
        config._kvfs_basetemp = config.option.basetemp


def pytest_unconfigure(config):
    """The session's own base directory goes when every test passed (kept to debug a failure)."""
    base = getattr(config, "_kvfs_basetemp", None)
    failed = getattr(config, "_kvfs_failed", True)
    if base and not failed:
        with open("/proc/self/mounts") as f:      # never walk into a mount a test left behind
            if any(line.split()[1].startswith(base + "/") for line in f if len(line.split()) > 1):
                return
        shutil.rmtree(base, ignore_errors=True)


def pytest_sessionfinish(session, exitstatus):
    session.config._kvfs_failed = exitstatus != 0


def pytest_collection_modifyitems(config, items):
    if HAVE_FUSE:
        return
    skip = pytest.mark.skip(reason="/dev/fuse is missing on this machine")
    for item in items:
        if "mount" in item.keywords:
            item.add_marker(skip)


# ---- watchdog: a test stuck in a FUSE request fails alone --------------------------------
# pytest-timeout (pyproject: 600 s) ends a hung test by exiting the process, which a thread
# waiting on a FUSE answer the daemon never sends can outlive: the run then stalls whole. A
# little before that, abort the FUSE connections of this run's kvfs mounts (what an operator
# does with fusectl): the stuck call gets ENOTCONN, the test fails with its own traceback, the run
# goes on.
WATCHDOG_BEFORE = 60.0


def _abort_kvfs_connections(under: str) -> list[str]:
    """Abort the FUSE connections of the kvfs mounts below ``under`` (this run's temp dir)."""
    aborted = []
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    ctl = "/sys/fs/fuse/connections"
    if not os.path.isdir(f"{ctl}/.") or not os.listdir(ctl):
        subprocess.run(["mount", "-t", "fusectl", "none", ctl], capture_output=True)
    for fields in mounts:
        sep = fields.index("-")
        if fields[sep + 1] != "fuse.kvfs" and fields[sep + 2] != "kvfs":
            continue
        if not fields[4].startswith(under + "/"):
            continue
        conn = fields[2].split(":")[1]
        try:
            with open(f"{ctl}/{conn}/abort", "w") as a:
                a.write("1")
            aborted.append(fields[4])
        except OSError:
            pass
    return aborted


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    import threading
    limit = item.config.getini("timeout")
    marker = item.get_closest_marker("timeout")
    if marker and marker.args:
        limit = marker.args[0]
    limit = float(item.config.getoption("timeout", None) or limit or 0)
    timer = None
    if limit > WATCHDOG_BEFORE * 2:
        base = str(item.config._tmp_path_factory.getbasetemp())

        def fire():
            gone = _abort_kvfs_connections(base)
            sys.stderr.write(f"\nwatchdog: {item.nodeid} ran {limit - WATCHDOG_BEFORE:.0f} s; "
                             f"aborted the FUSE connections of {gone}\n")
        timer = threading.Timer(limit - WATCHDOG_BEFORE, fire)
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()
