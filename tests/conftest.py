"""Shared fixtures: real kvfs mounts through the real CLI, in a subprocess.

``kvfs_mount(*extra_args, ram="64MiB", nvme_size="1GiB", **options)`` mounts a
fresh kvfs (its own mountpoint, NVMe directory and state directory under
``tmp_path``) with ``kvfs mount`` and returns a :class:`Mount`.  Keyword options
become flags (``nvme_size="1GiB"`` -> ``--nvme-size 1GiB``; ``True`` -> a bare
flag; ``None``/``False`` -> omitted).  Every mount is torn down at the end of
the test whatever happened: ``fusermount3 -u -z``, then SIGKILL of the daemon.

``kvfs_cli(*args)`` runs the ``kvfs`` command and returns the CompletedProcess.

Tests that mount are marked ``@pytest.mark.mount``; they are skipped only when
``/dev/fuse`` is missing.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvfs.proc import pid_alive  # noqa: F401  (tests import it from here)

REPO = Path(__file__).resolve().parent.parent
HAVE_FUSE = os.path.exists("/dev/fuse")
MOUNT_TIMEOUT = 120.0      # generous: a 2-core CI machine may be busy
EXIT_TIMEOUT = 120.0


def kvfs_command() -> list[str]:
    """The argv prefix that runs the kvfs CLI of this checkout."""
    return [sys.executable, "-m", "kvfs.cli"]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run_kvfs(*args, timeout: float = MOUNT_TIMEOUT, input: str | None = None,
             env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``kvfs ARGS`` (``env`` adds to the environment) and return the CompletedProcess."""
    return subprocess.run(
        [*kvfs_command(), *map(str, args)],
        capture_output=True, text=True, timeout=timeout, env={**_env(), **(env or {})}, input=input,
        stdin=None if input is not None else subprocess.DEVNULL,
    )


def wait_for(predicate, timeout: float, what: str, interval: float = 0.01):
    """Poll ``predicate`` until it returns a truthy value or the deadline passes."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def put(path: Path, data: bytes) -> None:
    """The runtime pattern: write ``name.tmp`` then ``os.replace`` over the final name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def tier_of(path: Path) -> str | None:
    """The tier a file of a mount lives on (``user.kvfs.tier``), or None if it cannot be read."""
    try:
        return os.getxattr(path, "user.kvfs.tier").decode()
    except OSError:
        return None


def direct_read(path: Path, buf) -> bytes:
    """The whole file read with O_DIRECT (past the kernel's page cache) into ``buf``, an
    aligned buffer (``mmap.mmap(-1, size)``) at least as large as the file."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        return bytes(buf[:os.preadv(fd, [buf], 0)])
    finally:
        os.close(fd)


def lazy_unmount(path: Path) -> None:
    subprocess.run(["fusermount3", "-u", "-z", str(path)], capture_output=True, timeout=60)


def _flags(options: dict) -> list[str]:
    out: list[str] = []
    for key, val in options.items():
        flag = "--" + key.replace("_", "-")
        if val is None or val is False:
            continue
        if val is True:
            out.append(flag)
        else:
            out += [flag, str(val)]
    return out


class Mount:
    """One kvfs mount driven through the CLI."""

    def __init__(self, root: Path, extra_args: tuple, options: dict):
        self.path = root / "mnt"
        self.nvme = Path(options.pop("nvme", root / "nvme"))
        self.state = Path(options.pop("state", root / "state"))
        self.path.mkdir(parents=True, exist_ok=True)
        self.args: list[str] = [
            "--nvme", str(self.nvme), "--state", str(self.state),
            *_flags(options), *map(str, extra_args),
        ]
        self.pid: int | None = None
        self._pids: set[int] = set()
        self._ram_dirs: set[str] = set()      # the daemons' RAM tiers, in shared memory

    # -- lifecycle ---------------------------------------------------------
    def mount(self) -> "Mount":
        res = run_kvfs("mount", self.path, *self.args)
        assert res.returncode == 0, (
            f"kvfs mount failed (rc={res.returncode}): {res.stderr.strip()}\n{self.log_tail()}")
        assert os.path.ismount(self.path), "kvfs mount returned 0 but nothing is mounted"
        st = self.stats()
        self.pid = int(st["pid"])
        self._pids.add(self.pid)
        self._ram_dirs.add(st["ram_dir"])
        return self

    def umount(self) -> subprocess.CompletedProcess:
        res = run_kvfs("umount", self.path, timeout=EXIT_TIMEOUT + 30)
        assert res.returncode == 0, (
            f"kvfs umount failed (rc={res.returncode}): {res.stderr.strip()}\n{self.log_tail()}")
        assert not os.path.ismount(self.path)
        if self.pid is not None:
            assert not pid_alive(self.pid), "kvfs umount returned but the daemon still runs"
        return res

    def remount(self) -> "Mount":
        self.umount()
        return self.mount()

    def kill9(self) -> None:
        """SIGKILL the daemon (no flush, no clean shutdown), then detach the dead mount."""
        pid = self.pid if self.pid is not None else int(self.stats()["pid"])
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not pid_alive(pid), EXIT_TIMEOUT, f"daemon {pid} to die")
        lazy_unmount(self.path)
        wait_for(lambda: not os.path.ismount(self.path), 30, "the mount to go away")
        self.pid = None

    def stats(self) -> dict:
        with open(self.path / ".kvfs" / "stats", "rb") as f:
            return json.loads(f.read())

    def log_tail(self, lines: int = 40) -> str:
        log = self.state / "kvfs.log"
        try:
            text = log.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return f"(no log at {log})"
        return "--- kvfs.log (tail) ---\n" + "\n".join(text)

    def cleanup(self) -> None:
        # unconditionally: a dead daemon's mount fails stat() (ENOTCONN), so ismount says False
        lazy_unmount(self.path)
        for pid in self._pids:              # detached: a daemon shuts down (and frees its RAM tier)
            try:
                wait_for(lambda: not pid_alive(pid), 15, f"daemon {pid} to exit")
            except AssertionError:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for pid in self._pids:
            try:
                wait_for(lambda: not pid_alive(pid), 30, f"daemon {pid} to die")
            except AssertionError:
                pass
        # a killed daemon leaves its RAM tier in /dev/shm (a restart on the same state would
        # clear it; a test's state is thrown away): do not leak it into the machine's memory
        for d in self._ram_dirs:
            shutil.rmtree(d, ignore_errors=True)
            top = Path(d).parent                   # the daemon's own tmpfs (kvfs.store.hugefs)
            if ".hugefs-" in top.name and os.path.ismount(top):
                subprocess.run(["umount", "-l", str(top)], capture_output=True)
                with contextlib.suppress(OSError):
                    top.rmdir()

    def __repr__(self) -> str:
        return f"<Mount {self.path} pid={self.pid}>"


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


@pytest.fixture
def kvfs_mount(tmp_path):
    """Factory: ``kvfs_mount(*extra_args, ram="64MiB", nvme_size="1GiB", **options)``."""
    if not HAVE_FUSE:
        pytest.skip("/dev/fuse is missing on this machine")
    mounts: list[Mount] = []

    def factory(*extra_args, ram="64MiB", nvme_size="1GiB", **options) -> Mount:
        root = tmp_path / f"kvfs{len(mounts)}"
        root.mkdir()
        m = Mount(root, extra_args, {"ram": ram, "nvme_size": nvme_size, **options})
        mounts.append(m)
        return m.mount()

    yield factory
    for m in mounts:
        m.cleanup()


@pytest.fixture
def kvfs_cli():
    """Run the kvfs CLI: ``kvfs_cli("stat", path, "--json")`` -> CompletedProcess."""
    return run_kvfs


# Fixtures of the real nvmet-tcp target (tests/target) and the store test kit
# (tests/store/storekit.py), shared by every directory below (pyproject's pytest
# ``pythonpath`` puts those folders on the path). One conftest only: test modules import
# helpers from it by name (``from conftest import ...``).
from nvmet_fixtures import fresh_target, nvmet_target, remote_tier, remote_url  # noqa: E402,F401


# ---- a real second, unprivileged user (security tests) --------------------------------
INTRUDER = "kvfs-intruder"


class Intruder:
    """A real unprivileged local user: runs Python snippets as itself (``run``)."""

    def __init__(self, uid: int, gid: int, home: Path, python: str):
        self.uid, self.gid, self.home, self.python = uid, gid, home, python

    def run(self, code: str, *args, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        res = subprocess.run([self.python, "-c", code, *map(str, args)], user=self.uid, group=self.gid,
                             extra_groups=[], capture_output=True, text=True, timeout=timeout, cwd="/",
                             env={"PATH": "/usr/bin:/bin", "HOME": str(self.home)})
        if check:
            assert res.returncode == 0, f"as uid {self.uid}: rc={res.returncode}\n{res.stdout}{res.stderr}"
        return res


def _real_user(name: str):
    """A real unprivileged local user ``name`` (``useradd``), with a scratch home; skipped
    only where the machine cannot add users."""
    import pwd
    import tempfile
    if os.geteuid() != 0:
        pytest.skip("adding a user needs root")
    python = "/usr/bin/python3"
    if not os.access(python, os.X_OK):
        pytest.skip("no system python3 another user can run")
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        res = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                              name], capture_output=True, text=True)
        if res.returncode != 0:
            pytest.skip(f"cannot add a user here: {res.stderr.strip()}")
        pw = pwd.getpwnam(name)
    home = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    os.chown(home, pw.pw_uid, pw.pw_gid)
    yield Intruder(pw.pw_uid, pw.pw_gid, home, python)
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
def intruder():
    """A real second user (``useradd``); skipped only where the machine cannot add users."""
    yield from _real_user(INTRUDER)


@pytest.fixture
def tenant():
    """A real third user, the owner of a namespace in tests where ``intruder`` is the other one."""
    yield from _real_user("kvfs-tenant")


@contextlib.contextmanager
def reachable(path: Path):
    """Let other users traverse to ``path`` (o+x on each ancestor) for the block; restored after."""
    changed = []
    p = Path(path)
    for d in [p, *p.parents]:
        mode = d.stat().st_mode & 0o7777
        if not mode & 0o001:
            os.chmod(d, mode | 0o001)
            changed.append((d, mode))
    try:
        yield
    finally:
        for d, mode in reversed(changed):
            with contextlib.suppress(OSError):
                os.chmod(d, mode)


def plant_record(state: Path, db: bytes, key: bytes, value: bytes) -> None:
    """Write a raw value into the index of the state directory ``state`` (as an attacker
    with write access to it would, or a damaged disk)."""
    import lmdb
    env = lmdb.open(str(state / "index.lmdb"), max_dbs=8, subdir=True)
    try:
        with env.begin(write=True) as txn:
            txn.put(key, value, db=env.open_db(db, txn=txn))
    finally:
        env.close()


def assert_one_line_error(res: subprocess.CompletedProcess, *needles: str, code: int | None = None):
    err = res.stderr.strip()
    assert res.returncode != 0, f"expected failure, got rc=0; stdout={res.stdout!r}"
    if code is not None:
        assert res.returncode == code
    assert "\n" not in err, f"error is not one line: {err!r}"
    assert err.startswith("kvfs: error: "), err
    assert "Traceback" not in res.stderr + res.stdout
    for n in needles:
        assert n.lower() in err.lower(), f"{n!r} not in {err!r}"
    return err


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
